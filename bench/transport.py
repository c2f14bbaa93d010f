"""Host cost of the draft distributions on the wire: encode on the draft server (device -> bytes),
decode + validate on the target server (bytes -> weights), per step of a batch, for the encodings a
sampled request can produce. Host work, so it runs anywhere (the servers pay it on their CPU).

    python3 bench/transport.py [--vocab 32000] [--num-draft 4] [--batches 1 8]

Rows: dense fp16 / bf16 (a full-support distribution), sparse fp16 (top-k 50 truncation). Medians
of 7 repeats; writes bench/results/transport.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import environment, table, write_result

import numpy as np  # noqa: E402
import torch  # noqa: E402

from protos.wire import repeats_a_column  # noqa: E402

from specdec.sampling.transport import decode_probs, encode_probs, round_probs  # noqa: E402

CASES = [("dense fp16", torch.float16, False, None), ("dense bf16", torch.bfloat16, False, None),
         ("sparse fp16, top-50", torch.float16, True, 50)]


def _median_us(fn, n: int = 20, repeats: int = 7) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    a = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, dtype, sparse, top_k in CASES:
        logits = torch.randn(a.num_draft, a.vocab, generator=gen) * 3
        if top_k:
            logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[:, -1:], float("-inf"))
        q = round_probs(torch.softmax(logits, -1), dtype)
        enc = encode_probs(q, dtype, sparse=sparse)
        decoded = decode_probs(enc.values, enc.rows, enc.vocab_size, enc.encoding, enc.indices, enc.row_lengths)
        assert torch.equal(decoded, q), name  # exact round trip
        enc_us = _median_us(lambda: encode_probs(q, dtype, sparse=sparse))
        dec_us = _median_us(lambda: decode_probs(enc.values, enc.rows, enc.vocab_size, enc.encoding,
                                                 enc.indices, enc.row_lengths, dtype=None))
        size = len(enc.values) + len(enc.indices) + len(enc.row_lengths)
        for b in a.batches:
            rows.append({"encoding": name, "batch": b, "bytes_per_seq": size, "encode_us_per_seq": enc_us,
                         "decode_us_per_seq": dec_us, "step_ms": b * (enc_us + dec_us) / 1e3})
    # The sparse decode's duplicate-column check, side by side: the one-pass test for columns in
    # increasing order (what encoders write; protos.wire.repeats_a_column) against sorting them
    # (np.unique, which the decode ran for every sparse sequence before), on the same positions.
    flat = (np.repeat(np.arange(enc.rows) * a.vocab, np.frombuffer(enc.row_lengths, "<i4"))
            + np.frombuffer(enc.indices, "<i4").astype(np.int64))
    shuffled = np.random.default_rng(0).permutation(flat)
    dup = {"nonzeros": int(flat.size),
           "one_pass_us": _median_us(lambda: repeats_a_column(flat), n=200),
           "np_unique_us": _median_us(lambda: np.unique(flat).size != flat.size, n=200),
           "unsorted_input_us": _median_us(lambda: repeats_a_column(shuffled), n=200)}
    assert not repeats_a_column(flat) and not repeats_a_column(shuffled)
    result = {"benchmark": "transport", "environment": environment(), "vocab": a.vocab,
              "num_draft": a.num_draft, "rows": rows, "duplicate_check": dup}
    path = write_result("transport", result)
    print(table(rows, [("encoding", "encoding", "s"), ("batch", "batch", "d"), ("bytes_per_seq", "bytes/seq", "d"),
                       ("encode_us_per_seq", "encode us/seq", ".0f"), ("decode_us_per_seq", "decode us/seq", ".0f"),
                       ("step_ms", "host ms/step (both sides)", ".2f")]))
    print(f"duplicate-column check of one sparse sequence ({dup['nonzeros']} nonzeros): one pass "
          f"{dup['one_pass_us']:.1f} us, np.unique {dup['np_unique_us']:.1f} us, unsorted input "
          f"(falls back to np.unique) {dup['unsorted_input_us']:.1f} us")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
