"""The paged-attention kernel's two grid orders side by side: KV heads first (the default) and
sequences first (triton_attention.set_heads_first), on bench/attention.py's cases, in one run.

    python3 bench/attention_grid.py [--query-lens 1 8] [--passes 3]

CUDA starts a grid's blocks in x order. Heads first, the programs that run at one time are the KV
heads of a few sequences, whose key rows of one position lie side by side in a page
([block_size, Hkv, D]); sequences first, they are one head of many sequences, 256 B rows Hkv x D
apart. Each case is one graph per order, timed with the L2 emptied by reads (common.cold_ms), the
orders alternating for --passes passes (medians), SDPA over contiguous K/V beside them, and both
outputs checked against SDPA. Writes bench/results/attention_grid.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

import attention as A
from common import cold_ms, copy_bandwidth, environment, table, write_result
from specdec.kernels import triton_attention as TA
from specdec.kernels.paged_inputs import random_paged_batch, rel_error

ORDERS = {"seq_first": False, "heads_first": True}


def case(shape: str, b: int, ctx: int, ql: int, bw: float, passes: int) -> dict:
    h, hkv, d = A.SHAPES[shape]
    base = random_paged_batch([1] * b, [ctx] * b, h, hkv, d, A.BLOCK_SIZE, A.DTYPE, A.DEVICE,
                              seed=b + ctx, poison=False)
    nblk = -(-ctx // A.BLOCK_SIZE)
    k4, v4 = (c[base.block_tables[:, :nblk].long()].reshape(b, nblk * A.BLOCK_SIZE, hkv, d)[:, :ctx]
              .transpose(1, 2).contiguous() for c in (base.k_cache, base.v_cache))
    q = torch.randn(b * ql, h, d, device=A.DEVICE, dtype=A.DTYPE)
    qsl = torch.arange(b + 1, device=A.DEVICE, dtype=torch.int32) * ql
    out = torch.empty_like(q)

    def ours():
        return TA.paged_attention(q, base.k_cache, base.v_cache, base.block_tables, base.context_lens,
                                  qsl, ql, d ** -0.5, max_context_len=ctx, out=out)

    q4 = q.view(b, ql, h, d).transpose(1, 2).contiguous()
    sdpa, _ = A.sdpa_runner(q4, k4, v4, ql, ctx, d ** -0.5, h != hkv)
    ref = sdpa().transpose(1, 2).reshape(b * ql, h, d)
    kv_bytes = 2 * b * ctx * hkv * d * base.k_cache.element_size()
    row = {"shape": shape, "batch": b, "context": ctx, "query_len": ql, "kv_bytes": kv_bytes,
           "floor_ms": kv_bytes / bw * 1e3}
    graphs = {}
    old = TA.HEADS_FIRST
    try:
        for name, heads_first in ORDERS.items():
            TA.set_heads_first(heads_first)      # read at launch: each graph keeps its order
            out.fill_(float("nan"))
            ours()
            row[f"rel_err_{name}"] = rel_error(out, ref)
            graphs[name] = A.graph_of(ours)
    finally:
        TA.set_heads_first(old)
    times = {name: [] for name in ORDERS}
    for _ in range(passes):
        for name in ORDERS:
            times[name].append(cold_ms(graphs[name], warmup=5, rep=25))
    for name in ORDERS:
        row[f"{name}_ms"] = statistics.median(times[name])
        row[f"{name}_frac_of_floor"] = row["floor_ms"] / row[f"{name}_ms"]
    row["sdpa_ms"] = cold_ms(A.graph_of(sdpa), warmup=5, rep=25)
    row["heads_over_seq"] = row["heads_first_ms"] / row["seq_first_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--query-lens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = [case(shape, b, ctx, ql, bw, args.passes)
            for shape in A.SHAPES for b in (1, 8, 32, 64) for ctx in (512, 2048, 8192)
            for ql in args.query_lens]
    for r in rows:
        for k in ("seq_first_ms", "heads_first_ms", "sdpa_ms"):
            r[k.replace("_ms", "_us")] = r[k] * 1e3
    print(table(rows, [("shape", "shape", ""), ("batch", "b", ""), ("context", "ctx", ""),
                       ("query_len", "q", ""), ("seq_first_us", "seq first us", ".1f"),
                       ("heads_first_us", "heads first us", ".1f"), ("heads_over_seq", "ratio", ".3f"),
                       ("sdpa_us", "SDPA us", ".1f"), ("heads_first_frac_of_floor", "of floor", ".2f"),
                       ("rel_err_heads_first", "rel err", ".1e")]))
    ratios = [r["heads_over_seq"] for r in rows]
    big = [r for r in rows if r["kv_bytes"] >= 64 * 2**20]
    summary = {"median_heads_over_seq": statistics.median(ratios),
               "faster_by_0.5pct": sum(x < 0.995 for x in ratios),
               "slower_by_0.5pct": sum(x > 1.005 for x in ratios), "cases": len(rows)}
    for name in ORDERS:
        summary[f"{name}_floor_goal"] = f"{sum(r[f'{name}_frac_of_floor'] >= 0.8 for r in big)} / {len(big)}"
        summary[f"{name}_not_slower_than_sdpa"] = f"{sum(r[f'{name}_ms'] <= r['sdpa_ms'] for r in rows)} / {len(rows)}"
    print(summary)
    write_result("attention_grid", {"benchmark": "attention_grid", "environment": environment(),
                                    "copy_bandwidth_GBps": bw / 1e9, "passes": args.passes,
                                    "summary": summary, "rows": rows})
    ok = all(r[f"rel_err_{n}"] < 2 * A.CHECK_TOL[A.DTYPE] for r in rows for n in ORDERS)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
