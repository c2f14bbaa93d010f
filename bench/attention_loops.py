"""The attention kernel's key loops side by side: one masked loop (triton_attention.single_key_loop,
the default for tiles of up to ONE_LOOP_MAX_M rows) against an unmasked loop then a masked one,
on the same inputs in one process, rounds alternating which goes first.

    python3 bench/attention_loops.py [--rounds 4]

Per case: each mode's median replay time of paged_attention in a CUDA graph
(triton.testing.do_bench_cudagraph; no L2 flush between replays, so small cases read from L2 and
the figures are not bench/attention.py's), the ratio, whether the outputs are bit-equal (they
need not be: the compiled loop bodies differ) and the plan. Both modes are forced on every case
(the launch bound is left aside). Writes bench/results/attention_loops.json.
"""
from __future__ import annotations

import argparse
import statistics

from common import environment, table, write_result

import torch  # noqa: E402

# (batch, context, query length, heads, KV heads): decode and verify steps of the 7B and a GQA
# shape, contexts on and off the 64-key tile, and one 64-row GQA tile
CASES = [
    (1, 300, 1, 32, 32), (1, 300, 5, 32, 32), (8, 300, 1, 32, 32), (8, 300, 5, 32, 32),
    (1, 1024, 8, 32, 32), (8, 512, 1, 32, 32), (8, 512, 8, 32, 32), (32, 512, 4, 32, 32),
    (1, 8192, 1, 32, 32), (1, 8192, 8, 32, 32), (8, 2048, 1, 32, 8), (8, 2048, 8, 32, 8),
    (32, 2048, 1, 32, 32), (64, 8192, 16, 32, 8), (8, 8000, 5, 32, 32)]


def measure(case: tuple, rounds: int) -> dict:
    from triton.testing import do_bench_cudagraph
    from specdec.kernels import triton_attention as ta
    from specdec.kernels.paged_inputs import random_paged_batch
    b, ctx, q, h, hkv = case
    batch = random_paged_batch([q] * b, [ctx] * b, h, hkv, 128, 16, torch.bfloat16, "cuda", seed=b + ctx + q)

    def call(out):
        ta.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                           batch.query_start_loc, q, 0.088, max_context_len=ctx, out=out)
    outs, times = {}, {True: [], False: []}
    bound = ta.ONE_LOOP_MAX_M
    ta.ONE_LOOP_MAX_M = 1 << 30   # both modes on every tile size
    try:
        for r in range(rounds):
            for mode in ((True, False) if r % 2 == 0 else (False, True)):
                with ta.single_key_loop.forced(mode):
                    out = torch.full_like(batch.q, float("nan"))
                    call(out)
                    torch.cuda.synchronize()
                    outs[mode] = out
                    times[mode].append(do_bench_cudagraph(lambda: call(out), rep=40) * 1e3)
    finally:
        ta.ONE_LOOP_MAX_M = bound
    one, two = statistics.median(times[True]), statistics.median(times[False])
    return dict(batch=b, context=ctx, query_len=q, heads=h, kv_heads=hkv, one_loop_us=one, two_loops_us=two,
                one_over_two=one / two, one_loop_values=times[True], two_loops_values=times[False],
                bit_equal=bool(torch.equal(outs[True], outs[False])),
                nan=bool(outs[True].isnan().any() or outs[False].isnan().any()),
                plan=ta.launch_plan(b, h, hkv, 128, q, ctx, "cuda"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_loops.py needs a CUDA GPU")
    rows = []
    for case in CASES:
        rows.append(measure(case, a.rounds))
        r = rows[-1]
        print(f"b {r['batch']} ctx {r['context']} q {r['query_len']}: one {r['one_loop_us']:.2f} us, "
              f"two {r['two_loops_us']:.2f} us", flush=True)
    path = write_result("attention_loops", {"benchmark": "attention_loops", "environment": environment(),
                                            "rounds": a.rounds, "rows": rows})
    print(table(rows, [("batch", "b", "d"), ("context", "ctx", "d"), ("query_len", "q", "d"),
                       ("kv_heads", "kv heads", "d"), ("one_loop_us", "one loop us", ".2f"),
                       ("two_loops_us", "two loops us", ".2f"), ("one_over_two", "one / two", ".3f"),
                       ("bit_equal", "bit-equal", "")]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
