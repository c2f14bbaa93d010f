"""Drives one call of each kernel of interest between cudaProfilerStart / Stop, for Nsight Compute
(the nvidia-h200 machines run under Firecracker, where ncu reads the hardware counters):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --csv --page details \\
        python3 bench/ncu_kernels.py > ncu.csv

Kernels, in order: our paged attention and cuDNN's SDPA (over the same K/V made contiguous) for
MHA b 32 ctx 512 q 1, GQA 32/8 b 8 ctx 2048 q 1 and MHA b 8 ctx 512 q 1; then the GEMV and cuBLAS
(F.linear) on the Llama-7B o, gate_up and down projections at M = 1. ncu flushes the caches before
each kernel by default. The session-11 table in bench/README.md came from this
(results/logs/ncu_s11_call4.csv).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specdec.kernels.gemv import default_config, gemv  # noqa: E402
from specdec.kernels.paged_inputs import random_paged_batch  # noqa: E402
from specdec.kernels.triton_attention import launch_plan, paged_attention  # noqa: E402

DEV, DTYPE, PAGE, D = "cuda", torch.bfloat16, 16, 128
ATTENTION = [(32, 32, 32, 512, 1), (32, 8, 8, 2048, 1), (32, 32, 8, 512, 1)]  # H, Hkv, B, ctx, q
GEMVS = [(4096, 4096), (22016, 4096), (4096, 11008)]                          # N, K


def attention_calls(h, hkv, b, ctx, ql):
    base = random_paged_batch([ql] * b, [ctx] * b, h, hkv, D, PAGE, DTYPE, DEV, seed=1, poison=False)
    nblk = -(-ctx // PAGE)
    k4, v4 = (c[base.block_tables[:, :nblk].long()].reshape(b, nblk * PAGE, hkv, D)[:, :ctx]
              .transpose(1, 2).contiguous() for c in (base.k_cache, base.v_cache))
    q = torch.randn(b * ql, h, D, device=DEV, dtype=DTYPE)
    qsl = torch.arange(b + 1, device=DEV, dtype=torch.int32) * ql
    out = torch.empty_like(q)
    print("attention", (h, hkv, b, ctx, ql), launch_plan(b, h, hkv, D, ql, ctx, q.device), flush=True)
    q4 = q.view(b, ql, h, D).transpose(1, 2).contiguous()
    return [lambda: paged_attention(q, base.k_cache, base.v_cache, base.block_tables, base.context_lens,
                                    qsl, ql, D ** -0.5, max_context_len=ctx, out=out),
            lambda: F.scaled_dot_product_attention(q4, k4, v4, scale=D ** -0.5, enable_gqa=h != hkv)]


def gemv_calls(n, k):
    w = torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.01
    x = torch.randn(1, k, device=DEV, dtype=DTYPE)
    print("gemv", (n, k), default_config(1, n, k, torch.cuda.get_device_properties(0).multi_processor_count),
          flush=True)
    return [lambda: gemv(x, w), lambda: F.linear(x, w)]


def main() -> int:
    calls = [f for case in ATTENTION for f in attention_calls(*case)]
    calls += [f for case in GEMVS for f in gemv_calls(*case)]
    for f in calls:   # compile and warm up outside the profiled range
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for f in calls:
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled", len(calls), "calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
