"""Host time of a sampled draft step's last stage: its drafted tokens and weight rows from the
device to the bytes of the wire (the draft engine's _to_host, then encode_probs per sequence),
in the two ways the engine can take, side by side in one run:

- device: the tokens and each row's nonzero count in one copy, then, for the sequences whose
  rows are smaller sparse, their nonzeros found on the device and copied (draft_rows_to_host);
- host (SPECDEC_DRAFT_DEVICE_SPARSE=0): the tokens in one copy, every row densely in another,
  and encode_probs scanning the rows with numpy.

    python3 bench/draft_rows.py [--vocab 32000] [--batches 1 8 16] [--gamma 4]

Rows are fp16 weights of a 32k vocabulary: top-k 50 (sparse on the wire) and temperature only
(dense: both ways copy them whole). Median host wall time per step over --steps steps, the two
ways alternating in two rounds. Writes bench/results/draft_rows.json.
"""
from __future__ import annotations

import argparse

from common import environment, table, wall_ms, write_result

import torch  # noqa: E402

from specdec.sampling.transport import draft_rows_to_host, encode_probs, nonzero_counts  # noqa: E402


def weight_rows(rows: int, vocab: int, top_k: int | None, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(rows, vocab, device="cuda", generator=gen)
    if top_k:
        x = torch.where(x >= x.topk(top_k, dim=1).values[:, -1:], x, torch.zeros_like(x))
    return (x / x.sum(1, keepdim=True)).half()


def on_device(tokens: torch.Tensor, q: torch.Tensor, lengths: list[int]) -> list:
    host = torch.cat([tokens, nonzero_counts(q)]).tolist()
    parts = draft_rows_to_host(q, lengths, host[len(tokens):])
    return [encode_probs(p, torch.float16) for p in parts]


def on_host(tokens: torch.Tensor, q: torch.Tensor, lengths: list[int]) -> list:
    tokens.tolist()
    return [encode_probs(p, torch.float16) for p in q.cpu().split(lengths)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rows = []
    for rows_kind, top_k in (("top-k 50", 50), ("temperature only", None)):
        for b in args.batches:
            lengths = [args.gamma] * b
            q = weight_rows(sum(lengths), args.vocab, top_k)
            tokens = torch.arange(sum(lengths), device="cuda")
            dev, host = (lambda: on_device(tokens, q, lengths)), (lambda: on_host(tokens, q, lengths))
            assert dev() == host(), "the two ways must give the same wire bytes"
            d1, h1 = 1e3 * wall_ms(dev, args.steps), 1e3 * wall_ms(host, args.steps)
            h2, d2 = 1e3 * wall_ms(host, args.steps), 1e3 * wall_ms(dev, args.steps)
            row = {"rows": rows_kind, "batch": b, "drafted_rows": sum(lengths),
                   "encoding": encode_probs(draft_rows_to_host(q, lengths, nonzero_counts(q).tolist())[0]).encoding,
                   "device_us": (d1 + d2) / 2, "host_us": (h1 + h2) / 2}
            row["x_faster"] = row["host_us"] / row["device_us"]
            rows.append(row)
            print(row, flush=True)
    path = write_result("draft_rows", {"benchmark": "draft_rows", "environment": environment(),
                                       "vocab": args.vocab, "gamma": args.gamma, "rows": rows})
    print(table(rows, [("rows", "rows", "s"), ("batch", "b", "d"), ("drafted_rows", "rows", "d"),
                       ("encoding", "wire", "s"), ("device_us", "device nonzeros us", ".0f"),
                       ("host_us", "dense copy + numpy us", ".0f"), ("x_faster", "x faster", ".2f")]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
