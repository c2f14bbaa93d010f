"""The GEMV kernel (specdec/kernels/gemv.py) against cuBLAS (F.linear) on the projection shapes of a model,
at decode/verify token counts, against the weight-read floor.

    python3 bench/gemv.py [--shape llama-7b] [--m 1 4 8] [--no-sweep | --wide]

Each time is one call's share of a CUDA graph that runs it over enough copies of the weight to defeat
the L2 (>= 256 MB per pass), so it is HBM time without launch overhead, as in a graphed decode step.
Besides the default configuration, a small sweep of tiles and split-K is timed, so the heuristic in
default_config can be checked (or retuned) from one run. Writes bench/results/gemv.json after each shape.
"""
from __future__ import annotations

import argparse

from common import SHAPES, copy_bandwidth, environment, table, write_result

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from specdec.kernels.gemv import GemvConfig, block_m_for, default_config, gemv  # noqa: E402

L2_DEFEAT_BYTES = 256 * 2**20


def projections(shape: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, how many per step) for one rank."""
    s = SHAPES[shape]
    h, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    d = h // s["num_attention_heads"]
    qkv = h + 2 * s["num_key_value_heads"] * d
    return {"qkv": (qkv, h, layers), "o": (h, h, layers), "gate_up": (2 * inter, h, layers),
            "down": (h, inter, layers), "lm_head": (s["vocab_size"], h, 1)}


# Wider W tiles against the x tile's rows (--wide). A row tile of x is loaded from L2 into shared
# memory by every program beside its W tile: with 64 x rows and 32 W rows that is twice W's bytes
# per K step, which a GEMV at 40 rows might pay for in L2 bandwidth. Wide W tiles leave fewer N tiles
# than SMs, so each is split over K until the programs fill whole waves. H200, session 31
# (results/logs/s31/gemv_wide.*): they did not win. At 40 rows the best per projection stayed
# [32..64, 128] tiles (7B step 4.13 ms against cuBLAS 4.24, floor 3.07); [128, 64] tiles split to
# fill waves took 4.84 (qkv 40.3 us against 30.5), and in the graphed 5-token verify b 8 took 4.94
# ms against 4.26 on cuBLAS and 4.61 with the narrow 64-row tiles.
WIDE_TILES = ((32, 128), (64, 128), (128, 64), (128, 128), (256, 64))


def wide_sweep(m: int, n: int, k: int, num_sms: int) -> list[GemvConfig]:
    bm = block_m_for(m)
    out = []
    for bn, bk in WIDE_TILES:
        tiles = -(-n // bn) * -(-m // bm)
        blocks = -(-k // bk)
        splits = [s for s in (1, 2, 4, 8) if s <= blocks and tiles * s <= 6 * num_sms]
        for s in splits:
            for st in (3, 4):
                out.append(GemvConfig(bm, bn, bk, split_k=s, num_warps=8 if bn >= 256 else 4, num_stages=st))
    return out


def sweep(m: int) -> list[GemvConfig]:
    if m == 1:
        tiles = [(4, 1024), (8, 512), (16, 256), (32, 128)]
    else:
        tiles = [(16, 256), (32, 128), (16, 128), (64, 64)]
    if m == 1:  # register loads: more warps is more bytes in flight
        return [GemvConfig(1, bn, bk, split_k=s, num_warps=w) for bn, bk in tiles for s in (1, 2) for w in (4, 8)]
    # cp.async pipeline: deeper is more bytes in flight, at the cost of shared memory (occupancy)
    bm = block_m_for(m)
    if m > 16:
        # Row tiles of 16 (M tiles of their own, W from L2 after the first), 32 or 64 (session 18:
        # one 64-row tile with [32, 128] W tiles lost to cuBLAS at 40 rows, and wider W tiles or
        # more warps did not win it back)
        return [GemvConfig(rows, bn, bk, num_stages=st) for rows in (16, 32, 64)
                for bn, bk in ((32, 128), (64, 64), (16, 256)) for st in (3, 5)]
    return [GemvConfig(bm, bn, bk, split_k=s, num_stages=st) for bn, bk in tiles for s in (1, 2) for st in (3, 5)]


def time_per_call(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Microseconds per call, from a graph that calls fn(x, w) once per weight copy."""
    for w in weights:
        fn(x, w)  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    ms = do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    del graph
    return 1e3 * ms / len(weights)


def measure(name: str, n: int, k: int, m: int, bw: float, do_sweep: bool, num_sms: int,
            wide: bool = False) -> dict:
    nbytes = n * k * 2
    copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(m)
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    floor_us = 1e6 * nbytes / bw
    want = x.double() @ weights[0].double().T
    cfg = default_config(m, n, k, num_sms)
    row = {"proj": name, "m": m, "n": n, "k": k, "floor_us": floor_us, "config": cfg.__dict__,
           "rel_err": ((gemv(x, weights[0], config=cfg).double() - want).norm() / want.norm()).item(),
           "rel_err_cublas": ((F.linear(x, weights[0]).double() - want).norm() / want.norm()).item(),
           "cublas_us": time_per_call(F.linear, weights, x),
           "gemv_us": time_per_call(lambda a, w: gemv(a, w, config=cfg), weights, x)}
    if do_sweep:
        tried = []
        for c in (wide_sweep(m, n, k, num_sms) if wide and m > 1 else sweep(m)):
            try:
                tried.append({"config": c.__dict__,
                              "us": time_per_call(lambda a, w, c=c: gemv(a, w, config=c), weights, x)})
            except Exception as exc:  # a tile the compiler rejects is a result, not a failed run
                tried.append({"config": c.__dict__, "error": f"{type(exc).__name__}: {exc}"[:200]})
        ok = [t for t in tried if "us" in t]
        best = min(ok, key=lambda t: t["us"]) if ok else None
        row["sweep"] = tried
        row["best_us"] = best["us"] if best else None
        row["best_config"] = best["config"] if best else None
    for key in ("cublas", "gemv", "best"):
        if row.get(f"{key}_us"):
            row[f"{key}_frac_floor"] = floor_us / row[f"{key}_us"]
    del weights
    torch.cuda.empty_cache()
    return row


def step_estimate(rows: list[dict], projs: dict, m: int) -> dict:
    """Sum over one decode step of every projection's time (per-layer ones times the layer count)."""
    mine = [r for r in rows if r["m"] == m]
    out = {"m": m}
    for key in ("floor", "cublas", "gemv", "best"):
        vals = [r.get(f"{key}_us") for r in mine]
        if vals and all(v is not None for v in vals):
            out[f"{key}_ms"] = sum(v * projs[r["proj"]][2] for v, r in zip(vals, mine)) / 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-7b")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--no-sweep", action="store_true", help="time the default configuration only")
    ap.add_argument("--wide", action="store_true",
                    help="M > 1: sweep wide W tiles split over K (WIDE_TILES) instead of the default sweep")
    args = ap.parse_args()
    bw = copy_bandwidth()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    projs = projections(args.shape)
    rows: list[dict] = []
    result = {"benchmark": "gemv", "shape": args.shape, "environment": environment(),
              "copy_bandwidth_GBs": bw / 1e9, "rows": rows, "steps": []}
    for m in args.m:
        for name, (n, k, _) in projs.items():
            rows.append(measure(name, n, k, m, bw, not args.no_sweep, num_sms, args.wide))
            print({k: v for k, v in rows[-1].items() if k != "sweep"}, flush=True)
            write_result("gemv", result)
        result["steps"].append(step_estimate(rows, projs, m))
    path = write_result("gemv", result)
    print(table(rows, [("proj", "proj", "s"), ("m", "M", "d"), ("floor_us", "floor us", ".1f"),
                       ("cublas_us", "cuBLAS us", ".1f"), ("gemv_us", "gemv us", ".1f"),
                       ("best_us", "best us", ".1f"), ("cublas_frac_floor", "cuBLAS frac", ".2f"),
                       ("gemv_frac_floor", "gemv frac", ".2f"), ("best_frac_floor", "best frac", ".2f"),
                       ("rel_err", "rel err", ".1e")]))
    print(table(result["steps"], [("m", "M", "d"), ("floor_ms", "floor ms/step", ".3f"),
                                  ("cublas_ms", "cuBLAS ms/step", ".3f"), ("gemv_ms", "gemv ms/step", ".3f"),
                                  ("best_ms", "best ms/step", ".3f")]))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
