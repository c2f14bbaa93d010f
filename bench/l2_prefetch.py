"""Would bulk L2 prefetches, issued while a latency-bound kernel runs, make the next GEMV faster?

    python3 bench/l2_prefetch.py [--windows 2000 6000] [--programs 16 66 132 264]

A decode layer's small kernels (RoPE, attention at short contexts, the split merge) leave the HBM
idle for several us while the next projection's weights sit in HBM. This times, in CUDA graphs
after the L2 is emptied (common.cold_ms), per projection shape of the 7B and the two larger drafts:
a spin kernel of W ns (the window) then the GEMV, against the same spin kernel issuing
`cp.async.bulk.prefetch.L2` of the GEMV's whole weight (split over P programs of 128 threads)
before it spins, and each kernel alone. gemv_after = (kernel + GEMV) - kernel alone: what the GEMV
adds after the window; pf_cost = prefetching kernel - spin kernel: how much longer the window
kernel runs when it prefetches (a program does not retire before its bulk prefetches complete).
Writes bench/results/l2_prefetch.json.
"""
from __future__ import annotations

import argparse

from common import cold_ms, environment, graph_of, table, write_result

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from specdec.kernels.gemv import gemv  # noqa: E402

SHAPES = {"7b_o": (4096, 4096), "7b_qkv": (12288, 4096), "1.1b_o": (2048, 2048), "1.1b_down": (2048, 5632),
          "1.1b_gate_up": (11264, 2048), "160m_qkv": (2304, 768), "160m_o": (768, 768), "160m_down": (768, 3072)}
THREADS = 128


@triton.jit
def _now(dummy):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _prefetch_spin_kernel(P, chunk, n_bytes, spin_ns, PREFETCH: tl.constexpr, BLOCK: tl.constexpr):
    """Each thread prefetches its `chunk` bytes of P into the L2 (PREFETCH), then every program
    spins until spin_ns have passed on the global timer."""
    pid = tl.program_id(0)
    if PREFETCH:
        offs = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * chunk
        size = tl.where(offs < n_bytes, tl.minimum(n_bytes - offs, chunk), 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [P + offs, size], dtype=tl.int32, is_pure=False, pack=1)
    z = pid * 0
    t0 = _now(z)
    t = t0
    while t - t0 < spin_ns:
        t = _now(z)


def window(w: torch.Tensor, ns: int, programs: int, prefetch: bool):
    flat = w.view(torch.uint8).view(-1)
    chunk = max(16, -(-flat.numel() // (programs * THREADS) // 16) * 16)   # bulk sizes: multiples of 16 B
    _prefetch_spin_kernel[(programs,)](flat, chunk, flat.numel(), ns, PREFETCH=prefetch, BLOCK=THREADS,
                                       num_warps=THREADS // 32)


def measure(name: str, n: int, k: int, windows, programs) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ w.double().T
    err = ((gemv(x, w).double() - want).norm() / want.norm()).item()
    us = lambda fn: 1e3 * cold_ms(graph_of(fn, warmup=3))   # noqa: E731
    row = {"shape": name, "n": n, "k": k, "mb": n * k * 2 / 2**20, "rel_err": err,
           "gemv_us": us(lambda: gemv(x, w)), "cases": []}
    for ns in windows:
        for p in programs:
            spin, pf = us(lambda: window(w, ns, p, False)), us(lambda: window(w, ns, p, True))
            spin_gemv = us(lambda: (window(w, ns, p, False), gemv(x, w)))
            pf_gemv = us(lambda: (window(w, ns, p, True), gemv(x, w)))
            row["cases"].append({"window_ns": ns, "programs": p, "spin_us": spin, "prefetch_us": pf,
                                 "gemv_after_spin_us": spin_gemv - spin, "gemv_after_prefetch_us": pf_gemv - pf,
                                 "step_spin_us": spin_gemv, "step_prefetch_us": pf_gemv, "pf_cost_us": pf - spin})
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, nargs="+", default=[2000, 6000])
    ap.add_argument("--programs", type=int, nargs="+", default=[16, 66, 132, 264])
    args = ap.parse_args()
    rows = [measure(name, n, k, args.windows, args.programs) for name, (n, k) in SHAPES.items()]
    flat = [{"shape": r["shape"], "mb": r["mb"], **c} for r in rows for c in r["cases"]]
    path = write_result("l2_prefetch", {"benchmark": "l2_prefetch", "environment": environment(), "rows": rows})
    print(table(flat, [("shape", "shape", "s"), ("mb", "MB", ".1f"), ("window_ns", "window ns", "d"),
                       ("programs", "P", "d"), ("step_spin_us", "spin+gemv us", ".2f"),
                       ("step_prefetch_us", "prefetch+gemv us", ".2f"), ("gemv_after_spin_us", "gemv after spin", ".2f"),
                       ("gemv_after_prefetch_us", "gemv after prefetch", ".2f"), ("pf_cost_us", "pf cost us", ".2f")]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
