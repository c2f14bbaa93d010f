"""Skinny GEMM for decode and verify: y[M, N] = x[M, K] @ W[N, K]^T (+ b) with M <= 64 tokens.

At these sizes a projection is a read of W and nothing else (Llama-7B o_proj: 32 MB of weight against
16 KB of activations), so the kernel is built to stream W once, at full width:
- each program owns BLOCK_N rows of W and walks K in BLOCK_K slices: every row segment is a
  contiguous run of BLOCK_K elements (512 B .. 2 KB), loaded as 16-byte vectors;
- M == 1 multiplies elementwise into a [BLOCK_N, BLOCK_K] fp32 accumulator and reduces once at the
  end (no tensor cores, no padding); 2 <= M <= 16 pads the tokens to 16 rows and uses tl.dot, whose
  operands the compiler pipelines through shared memory (num_stages deep); M up to 64 (verification
  at batch 8 with up to 7 drafts) runs in ceil(M / BLOCK_M) row tiles of 16, 32 or 64, the row
  tiles of one W tile in adjacent programs, so that all but the first read W from L2. `linear`
  hands the kernel at most SERVE_MAX_M rows, and above 16 rows only projections up to WIDE_MAX_N
  wide (below: the BLAS serves the rest);
- BLOCK_N shrinks for small N so that there are programs for every SM; where even the smallest
  BLOCK_N leaves SMs idle, K is split over a second grid axis: each program stores its fp32 partial,
  and the last of an N tile's programs to arrive (an atomic count per tile) sums them in split order
  and writes the output (deterministic: the same bits whichever program is last, unlike atomic adds
  of the values); SPECDEC_GEMV_SPLIT_REDUCE=separate sums them in a second, tiny kernel instead.
Accumulation is fp32 for every input dtype, rounded once to the output dtype with the bias added, as
cuBLAS does, so bf16 results agree with F.linear up to reduction order.

With epilogue="silu_mul" the gate_up projection ([2I, K] weight: gate rows, then up rows) returns
SiLU(gate) * up, [M, I], instead of [M, 2I]: each program reads the gate rows of its output columns
and the matching up rows (the same bytes per program as the plain GEMV's tile), and its epilogue
rounds gate and up to the dtype as the projection would have, then applies SiLU * up as
kernels/fused.silu_mul does. So the silu_mul kernel goes (one kernel fewer per layer) and the bits
stay those of gate_up + silu_mul; each SiLU is computed once. Opt-in (GemvOps(fuse_silu=True)):
on the H200 (bench/decode.py's "silu_gemv" kernel set, session 12) the 7B decode replay took
3.77 / 4.25 / 4.68 ms against 3.73 / 4.12 / 4.74 without it at batch 1 / 8 / 32, no gain.

The GPU path of the model uses it through GemvOps (chosen at build, on by default on CUDA); `gemv` itself
runs anywhere Triton does (the CPU under TRITON_INTERPRET=1, which the unit tests use).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.kernels import pdl
from specdec.kernels.counters import arrival_counters
from specdec.kernels.switch import Switch

MAX_M = 64
SMALL_TILE_MAX_M = 16   # the most rows of the 16-row tile (block_m_for); more run on 64-row tiles
BLOCK_MS = (1, 16, 32, 64)   # row tiles: M = 1 without tl.dot; else tl.dot tiles, as many as M needs
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NORM_DTYPES = (torch.bfloat16, torch.float32)   # gemv(norm=...): bf16's range holds x * weight


@triton.jit
def _silu_mul_rounded(g, u, DTYPE: tl.constexpr):
    """SiLU(g) * u from fp32 accumulators, rounded where gate_up's output and silu_mul round."""
    g = g.to(DTYPE).to(tl.float32)
    u = u.to(DTYPE).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return (act * u).to(DTYPE)


@triton.jit
def _partial_sums(SS, M, num_parts, p0, offs_m, m_ok, BLOCK_P: tl.constexpr):
    """Partial sums of squares p0 + [0, BLOCK_P) of each row, [BLOCK_M, BLOCK_P] (0 past num_parts)."""
    p = p0 + tl.arange(0, BLOCK_P)
    return tl.load(SS + p[None, :] * M + offs_m[:, None], mask=m_ok[:, None] & (p < num_parts)[None, :], other=0.0)


@triton.jit
def _norm_scale(first, SS, M, num_parts, K, eps, offs_m, m_ok, BLOCK_P: tl.constexpr):
    """1 / RMS of each row: the producer's per-program sums of squares [num_parts, M], `first` the
    first BLOCK_P of them (loaded before the K loop, so their latency hides behind it), any further
    ones loaded here; summed in part order (deterministic)."""
    total = tl.sum(first, axis=1)
    for p0 in range(BLOCK_P, num_parts, BLOCK_P):
        total += tl.sum(_partial_sums(SS, M, num_parts, p0, offs_m, m_ok, BLOCK_P), axis=1)
    return tl.math.rsqrt(total / K + eps)


@triton.jit
def _residual_out(acc, res, Y, SS, part, M, offs_m, offs_n, m_ok, n_ok, stride_ym, RW, nw,
                  RES_WEIGHTED: tl.constexpr):
    """The producer's epilogue: r = residual `res` (loaded before the K loop) + y rounded to the dtype
    (torch's `residual + x`), stored as the new residual stream, and this program's sum of r^2 per row
    into SS[part, m]. RES_WEIGHTED: also r * the next norm's weight `nw` (this tile's columns) into
    RW, rounded as the consumer's _weighted would round it, so the consumer reads it as it is."""
    mask = m_ok[:, None] & n_ok[None, :]
    r = (acc.to(Y.dtype.element_ty).to(tl.float32) + res.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], r, mask=mask)
    if RES_WEIGHTED:
        tl.store(RW + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
                 _weighted(r, nw[None, :], Y.dtype.element_ty), mask=mask)
    rf = tl.where(mask, r.to(tl.float32), 0.0)
    tl.store(SS + part * M + offs_m, tl.sum(rf * rf, axis=1), mask=m_ok)


@triton.jit
def _weighted(x, nw, DTYPE: tl.constexpr):
    """The norm consumer's operand: x * the norm weight, rounded to the dtype (its 1 / RMS scales the
    product after the K loop)."""
    return (x.to(tl.float32) * nw.to(tl.float32)).to(DTYPE)


@triton.jit
def _gemv_kernel(X, W, B, Y, WS, CNT, R, SS, NW, RW, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                 stride_r, num_parts, eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 UPCAST: tl.constexpr, USE_PDL: tl.constexpr, GLU: tl.constexpr,
                 RES_OUT: tl.constexpr = False, NORM_IN: tl.constexpr = False, BLOCK_P: tl.constexpr = 16,
                 INLINE_REDUCE: tl.constexpr = False, M_TILES: tl.constexpr = 1,
                 RES_WEIGHTED: tl.constexpr = False, NORM_W: tl.constexpr = True,
                 LATE_TRIGGER: tl.constexpr = False):
    """N output columns. GLU: W has 2N rows (gate, then up); a program's BLOCK_N rows are the gate
    rows of its BLOCK_N / 2 output columns and their up rows, and it writes SiLU(gate) * up.
    RES_OUT (no GLU): Y = residual R + x @ W^T, and per-program sums of squares into SS (split over
    K: by the reduce kernel's programs, or with INLINE_REDUCE one per N tile).
    INLINE_REDUCE (split over K): the last of an N tile's programs to arrive, counted in CNT, sums
    the tile's partials and runs the epilogue, instead of a second kernel.
    NORM_IN: x is the residual stream of such a producer and the product is RMSNorm(x) @ W^T:
    (x * NW) @ W^T scaled by 1 / RMS, the RMS from SS (its num_parts partial sums) and eps; without
    NORM_W x is already x * NW (a RES_WEIGHTED producer's RW) and only the scale is left.
    RES_WEIGHTED (RES_OUT): the producer also stores the new stream times the next norm's weight NW
    into RW: the consumer's product without a multiply on its K steps.
    Both load what their epilogue needs (the residual tile; the partial sums) before the K loop, so
    that load's latency hides behind the weight stream instead of following it.
    M_TILES: M > BLOCK_M rows in M_TILES tiles of BLOCK_M, each its own program over the same W
    tile (sums of squares stay one per N tile: the M tiles write disjoint rows of it).
    LATE_TRIGGER (launched without PDL): let the next kernel launch once this program's K loop
    is done, so that it becomes resident during the epilogues and the last wave's tail."""
    pdl.enter(USE_PDL)
    # Axis 0 walks the (N tile, M tile) pairs with the M tiles of one N tile adjacent: programs
    # started together read the same W rows, so the M tiles after the first find them in L2.
    tile = tl.program_id(0)
    pid_n = tile // M_TILES
    pid_m = tile % M_TILES
    pid_k = tl.program_id(1)
    if GLU:
        HALF: tl.constexpr = BLOCK_N // 2
        offs_r = tl.arange(0, BLOCK_N)
        col = pid_n * HALF + offs_r % HALF
        offs_n = col + (offs_r // HALF) * N             # W rows: gate rows, then the up rows
        n_ok = col < N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn                   # [BLOCK_N, 1]
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm                   # [BLOCK_M, 1]
    if NORM_IN:
        sums = _partial_sums(SS, M, num_parts, 0, offs_m, m_ok, BLOCK_P)    # [BLOCK_M, BLOCK_P]
    res = 0.0   # (the residual tile: RES_OUT only)
    nwt = 0.0   # (the next norm's weight on this tile's columns: RES_WEIGHTED only)
    if RES_WEIGHTED:
        nwt = tl.load(NW + offs_n, mask=n_ok, other=0.0)
    if RES_OUT and SPLIT == 1:
        res = tl.load(R + offs_m.to(tl.int64)[:, None] * stride_r + offs_n[None, :],
                      mask=m_ok[:, None] & n_ok[None, :], other=0.0)
    if BLOCK_M == 1:
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(X + offs_k)
                if NORM_IN and NORM_W:
                    x = _weighted(x, tl.load(NW + offs_k), X.dtype.element_ty)
            else:  # splits are whole BLOCK_Ks: only K's own end needs a mask (K % 16 keeps 16 B loads)
                k_ok = offs_k < K
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(X + offs_k, mask=k_ok, other=0.0)
                if NORM_IN and NORM_W:
                    x = _weighted(x, tl.load(NW + offs_k, mask=k_ok, other=0.0), X.dtype.element_ty)
            part += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(part, axis=1)[None, :]                                  # [1, BLOCK_N]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if NORM_IN and NORM_W:
            # The norm weight of each K step is loaded one step ahead. Loaded inside its step, it
            # is the one load the pipeliner does not stream (x and W come by cp.async): sm_90 PTX
            # had a 2-byte global load, a shared-memory store and a barrier on every step's path
            # (tests/helpers/compile_sm90.py --counts "gemv M16"), ~32 L2 round trips a 4096-wide
            # projection, about what the fusion lost at b 8 (4.76 vs 4.10 ms, session 12).
            offs_b = tl.arange(0, BLOCK_K)
            nw_next = tl.load(NW + k_start + offs_b, mask=k_start + offs_b < K, other=0.0)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if NORM_IN and NORM_W:
                nw = nw_next
                nw_next = tl.load(NW + BLOCK_K + offs_k, mask=BLOCK_K + offs_k < K, other=0.0)
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < K
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM_IN and NORM_W:
                x = _weighted(x, nw[None, :], X.dtype.element_ty)
            if UPCAST:  # fp32 weights (exact products, not tf32), or the interpreter (no bf16 matmul)
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
    pdl.trigger(LATE_TRIGGER)
    if NORM_IN:   # RMSNorm's 1 / RMS, a per-row factor: after the sum (split partials alike)
        acc = acc * _norm_scale(sums, SS, M, num_parts, K, eps, offs_m, m_ok, BLOCK_P)[:, None]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:  # fp32 partials of every W row (GLU: 2N columns), summed in split order
        n_ws = 2 * N if GLU else N
        ws_rows = WS + offs_m[:, None].to(tl.int64) * n_ws + offs_n[None, :]
        tl.store(ws_rows + (pid_k * M).to(tl.int64) * n_ws, acc, mask=out_mask)
        if INLINE_REDUCE:
            # The tile's last program to arrive sums the partials (in split order: the same bits
            # whichever program is last) and runs the epilogue. Release: the barrier orders every
            # thread's partial stores before the one thread's gpu-scope release atomic (release is
            # cumulative); acquire: the last program's atomic, then the barrier, order all its
            # threads' loads (.cg: past L1) after every other release (triton_attention's inline
            # merge does the same). It puts the count back to 0 for the next launch or replay.
            tl.debug_barrier()
            arrived = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                tl.debug_barrier()
                tl.store(CNT + tile, 0)
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # fixed order: deterministic
                    total += tl.load(ws_rows + (s * M) * n_ws, mask=out_mask, other=0.0, cache_modifier=".cg")
                tile_res = tl.load(R + offs_m.to(tl.int64)[:, None] * stride_r + offs_n[None, :], mask=out_mask,
                                   other=0.0) if RES_OUT else res
                _epilogue(total, tile_res, B, Y, SS, pid_n, M, N, offs_m, offs_n, m_ok, n_ok, stride_ym,
                          BLOCK_M, BLOCK_N, HAS_BIAS, GLU, RES_OUT, RW, nwt, RES_WEIGHTED)
    else:
        _epilogue(acc, res, B, Y, SS, pid_n, M, N, offs_m, offs_n, m_ok, n_ok, stride_ym,
                  BLOCK_M, BLOCK_N, HAS_BIAS, GLU, RES_OUT, RW, nwt, RES_WEIGHTED)


@triton.jit
def _epilogue(acc, res, B, Y, SS, pid_n, M, N, offs_m, offs_n, m_ok, n_ok, stride_ym,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
              RES_OUT: tl.constexpr, RW, nwt, RES_WEIGHTED: tl.constexpr):
    """A tile's output from its fp32 sums: the bias, then SiLU(gate) * up (GLU), the residual add
    and the tile's sums of squares (RES_OUT), or the product rounded to the dtype."""
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        HALF: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HALF]), [0, 2, 1]))
        cols = pid_n * HALF + tl.arange(0, HALF)
        y = Y + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(y, _silu_mul_rounded(gate, up, Y.dtype.element_ty), mask=m_ok[:, None] & (cols < N)[None, :])
    elif RES_OUT:
        _residual_out(acc, res, Y, SS, pid_n, M, offs_m, offs_n, m_ok, n_ok, stride_ym, RW, nwt, RES_WEIGHTED)
    else:
        y = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _splitk_reduce_kernel(WS, B, Y, R, SS, NW, RW, M, N, stride_ym, stride_r, SPLIT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                          GLU: tl.constexpr, RES_OUT: tl.constexpr = False, RES_WEIGHTED: tl.constexpr = False):
    pdl.enter(USE_PDL)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    nwt = 0.0
    if RES_OUT:   # loaded first: its latency hides behind the partials' loads
        res = tl.load(R + m.to(tl.int64) * stride_r + offs, mask=ok, other=0.0)[None, :]
        if RES_WEIGHTED:
            nwt = tl.load(NW + offs, mask=ok, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    n_ws = 2 * N if GLU else N
    for s in tl.static_range(SPLIT):  # fixed order: deterministic
        acc += tl.load(WS + (s * M + m).to(tl.int64) * n_ws + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs, mask=ok, other=0.0).to(tl.float32)
    if GLU:  # the up half, then SiLU(gate) * up
        up = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            up += tl.load(WS + (s * M + m).to(tl.int64) * n_ws + N + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            up += tl.load(B + N + offs, mask=ok, other=0.0).to(tl.float32)
        out = _silu_mul_rounded(acc, up, Y.dtype.element_ty)
        tl.store(Y + m.to(tl.int64) * stride_ym + offs, out, mask=ok)
    elif RES_OUT:
        rows = m + tl.arange(0, 1)
        _residual_out(acc[None, :], res, Y, SS, tl.program_id(1), M, rows, offs, rows < M, ok, stride_ym,
                      RW, nwt, RES_WEIGHTED)
    else:
        tl.store(Y + m.to(tl.int64) * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block_m not in BLOCK_MS or self.split_k < 1:
            raise ValueError(f"GemvConfig: block_m {self.block_m} must be one of {BLOCK_MS}, split_k >= 1")
        if self.block_m > 1 and (self.block_n < 16 or self.block_k < 16):
            raise ValueError("GemvConfig: tl.dot needs block_n, block_k >= 16")
        if any(b & (b - 1) or b < 1 for b in (self.block_n, self.block_k)):
            raise ValueError(f"GemvConfig: blocks {self.block_n} x {self.block_k} must be powers of two")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pick what an H200 would
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_m_for(m: int) -> int:
    """The default row tile of M tokens: 1 (no tl.dot), 16 up to 16 rows, else 64 (one M tile up to
    MAX_M). H200, bench/gemv.py --m 40 32 (bench/results/gemv_m32_m40.json): the 64-row tile ties
    cuBLAS (7B projections at 40 rows 4.21 vs 4.25 ms a forward, per projection's best) where M tiles
    of 16 rows took 7.28 ms (session 19): W read again from L2 per M tile costs more than it saves."""
    return 1 if m == 1 else 16 if m <= SMALL_TILE_MAX_M else 64


def default_config(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """The winners of the H200 sweep in bench/results/gemv.json (Llama-7B projections; differences
    under ~1 us were taken as noise). M = 1: [8, 512] W tiles (8 KB of bf16 per K step), 8 warps where
    N <= 4096 leaves few programs per SM to hide latency with. M > 1: [16, 32, 128] tl.dot tiles, 5
    stages of cp.async except for the widest N (gate_up, the LM head), where 3 won. Split-K where
    the N tiles alone leave SMs idle (Llama-7B's down projection at M > 1; small draft models)."""
    block_m = block_m_for(m)
    if m == 1:
        block_n, block_k, warps, stages = 8, 512, 8 if n <= 4096 else 4, 3
    else:
        block_n, block_k, warps, stages = 32, 128, 4, 5 if n <= 16384 else 3
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)   # programs before any split
    if block_m == 64:
        # H200, session 31 (bench/gemv.py --m 40 --wide, logs/s31/gemv_wide.json): 64-row tiles
        # took 30.5 us for the 7B's qkv at 3 stages against ~37 at 5; o and down (split over K)
        # 13.0 / 29.6 at 4 stages
        stages = 4 if tiles < num_sms else 3
    split = 1
    if tiles < num_sms:
        # Whole K blocks per split, at most 16 splits; the count is the one gemv() launches.
        blocks = triton.cdiv(k, block_k)
        per = max(1, blocks // triton.cdiv(num_sms, tiles), triton.cdiv(blocks, 16))
        split = triton.cdiv(blocks, per)
    return GemvConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split,
                      num_warps=warps, num_stages=stages)


# How a launch split over K sums its partials: "inline" (each N tile's last program to arrive,
# counted by an atomic; no second launch) or "separate" (a second kernel, _splitk_reduce_kernel).
# Read at launch: a CUDA graph keeps what it was captured with. SPECDEC_GEMV_SPLIT_REDUCE sets it.
# H200, graphed decode (bench/decode.py, cost_coefficient.py, session 17; inline against the
# kernel set splitk_separate): the 7B at b 8 (its down projection splits at 8 rows) 3.92 vs
# 4.09 ms, the 160m draft at b 8 0.374 vs 0.383 ms; b 1 within 1% (3.65 vs 3.67 ms; 160m 0.308
# vs 0.309). An earlier call with the sides the other way round: 3.94 vs 4.09 ms.
SPLIT_REDUCE_MODES = ("separate", "inline")


def _split_reduce_mode(mode: str) -> str:
    if mode not in SPLIT_REDUCE_MODES:
        raise ValueError(f"split reduce mode {mode!r}: expected one of {SPLIT_REDUCE_MODES}")
    return mode


_env_reduce = os.environ.get("SPECDEC_GEMV_SPLIT_REDUCE", "inline")
if _env_reduce not in SPLIT_REDUCE_MODES:
    raise ValueError(f"SPECDEC_GEMV_SPLIT_REDUCE={_env_reduce!r}: expected one of {SPLIT_REDUCE_MODES}")
_split_reduce: Switch[str] = Switch(_env_reduce, _split_reduce_mode)
set_split_reduce = _split_reduce.set
# split_reduce_forced(mode): launch (and capture) with this mode inside the block; benchmarks compare both
split_reduce_forced = _split_reduce.forced
# The inline reduce's arrival counts, one int32 per (N tile, M tile) (kernels/counters.py: zero between
# launches, one buffer per device). A split launch has fewer tiles than the device has SMs
# (default_config), far below the capacity.
MAX_SPLIT_TILES = 4096


def split_reduce() -> str:
    return _split_reduce.value


def _consumer_pdl_mode(value: bool | None) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"consumer PDL {value!r}: expected None (by rule), True or False")
    return value


# PDL at a norm consumer's launch (gemv(norm=...): the qkv / gate_up projection right after the
# GEMV that wrote its residual stream). With PDL the consumer's blocks become resident while the
# producer still streams its weight and wait there; on the tl.dot path (2..16 rows) of a wide stream
# that cost the consumers 3-7 us each: H200, bench/timeline.py, both orders (bench/results/logs/s27/
# consumer_pdl_call5_*), the 7B's 5-token verify at b 1 took 4340 / 4328 us fused with PDL, 3874 /
# 3871 fused without it at the consumer, 4002 / 3983 unfused; its decode at b 8 4658 / 4689,
# 4212 / 4215, 4388 / 4389; TinyLlama 2048 wide the same way (b 8 decode 1081 / 1070, 1023 / 1024,
# 1071 / 1064). At one row, and on the 768-wide drafts at any row count, the consumer on PDL is
# the faster (7B b 1 decode 3695 vs 3754 us, 160m b 8 370 vs 386). So by default (None) a consumer
# of more than one row on a stream wider than NARROW_NORM_N is launched without PDL: it starts once
# the producer has finished, as in plain stream order (the kernel after it may still take PDL:
# everything before its predecessor has then finished). consumer_pdl.forced(True / False) makes
# every consumer take / skip PDL, for A/B runs; in a server, SPECDEC_GEMV_CONSUMER_PDL=1 / 0 does
# (unset: the rule). Read at launch (a CUDA graph keeps what it captured).
def _env_consumer_pdl() -> bool | None:
    value = os.environ.get("SPECDEC_GEMV_CONSUMER_PDL", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"SPECDEC_GEMV_CONSUMER_PDL={value!r}: expected 0, 1 or unset")
    return None if value == "" else value == "1"


consumer_pdl: Switch[bool | None] = Switch(_env_consumer_pdl(), _consumer_pdl_mode)


def consumer_launch_pdl(m: int, k: int) -> bool:
    """Whether a norm consumer of m rows over a k-wide residual stream takes PDL (when PDL is on)."""
    if consumer_pdl.value is not None:
        return consumer_pdl.value
    return m == 1 or k <= NARROW_NORM_N


# A consumer launched without PDL (consumer_launch_pdl False, PDL on) lets the kernel after it
# (RoPE + KV store after qkv, SiLU after gate_up) launch once its K loop is done (LATE_TRIGGER):
# without it that kernel's launch waits for the consumer's end. H200, bench/timeline.py at ctx 256
# in the servers' graphs (@4096+256), both orders (bench/results/logs/s28/call2_tl_*), replay span
# in us with / without: 7B verify b 1 q 5 3858 / 3861 vs 3874 / 3872, 7B decode b 8 4201 / 4195 vs
# 4226 / 4215, TinyLlama b 1 q 5 1004 / 1006 vs 1013 / 1017, b 8 1006 / 1009 vs 1021 / 1021; steps
# without such a consumer (one row, cuBLAS above 16) unchanged. consumer_trigger.forced(False)
# turns it off for A/B runs. Read at launch.
consumer_trigger: Switch[bool] = Switch(True, bool)


def _counters(device: torch.device) -> torch.Tensor:
    """The inline reduce's arrival counts on `device` (kernels/counters.py)."""
    return arrival_counters(device, MAX_SPLIT_TILES)


def split_layout(k: int, cfg: GemvConfig) -> tuple[int, int]:
    """(K elements per split, splits launched): whole BLOCK_Ks per split, no empty splits (so the
    launched count can be below cfg.split_k when the K blocks do not divide evenly)."""
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, epilogue: str | None = None, *,
         residual: torch.Tensor | None = None, norm: "NormInput | None" = None,
         norm_weight: torch.Tensor | None = None):
    """x: [M, K] with M <= 64, weight: [N, K] (K contiguous), bias: [N] or None -> [M, N] in x's
    dtype. epilogue="silu_mul": weight is [2I, K] (gate rows, then up rows) and the result is
    SiLU(gate) * up, [M, I], with the bits of the plain result followed by fused.silu_mul. Always
    the Triton kernel (the interpreter on a CPU); `linear` is the dispatching entry.

    Add + RMSNorm folded into the projections around it (GemvOps(fuse_norm=True), the model's default):
    residual [M, N] (no epilogue): returns (residual + y, sums of squares [parts, M] fp32), the new
    residual stream rounded as torch's `residual + y` and each program's sum of its squares;
    norm=NormInput(sums, weight, eps): x is such a residual stream and the product is
    RMSNorm(x) @ W^T taken as ((x * weight) rounded to the dtype) @ W^T times 1 / RMS (fp32, RMS from
    the partial sums): RMSNorm's value, not its bits (it rounds x / RMS before the weight multiply).
    The factor comes after the sum, so no load of the sums waits in front of the weight stream.
    norm_weight [N] (with residual): the producer also returns (residual + y) * norm_weight, rounded
    to the dtype as the consumer rounds x * weight: (r, sums, rw). A consumer given rw as x and
    NormInput(sums, None, eps) skips the multiply on its K steps and gives the same bits."""
    if epilogue not in (None, "silu_mul"):
        raise ValueError(f"gemv: epilogue {epilogue!r} is not None or 'silu_mul'")
    glu = epilogue == "silu_mul"
    m, k = x.shape
    rows = weight.shape[0]
    if residual is not None and (glu or residual.shape != (m, rows) or residual.dtype != x.dtype or k == 0):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} {residual.dtype} does not fit "
                         f"[{m}, {rows}] {x.dtype} (no epilogue, K > 0)")
    if residual is not None and norm is not None:
        raise ValueError("gemv: residual= and norm= together (a producer's sums are its output)")
    if norm_weight is not None and (residual is None or norm_weight.shape != (rows,)
                                    or norm_weight.dtype != x.dtype or x.dtype not in NORM_DTYPES):
        raise ValueError(f"gemv: norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} needs residual= and "
                         f"[{rows}] of x's dtype, one of {NORM_DTYPES}")
    _check_norm(norm, x)
    if m > MAX_M or weight.shape != (rows, k) or (bias is not None and bias.shape != (rows,)):
        raise ValueError(f"gemv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit (M <= {MAX_M})")
    if glu and rows % 2:
        raise ValueError(f"gemv: the silu_mul epilogue needs gate and up rows, got {rows} (odd)")
    if x.dtype != weight.dtype or x.dtype not in _DTYPES:
        raise ValueError(f"gemv: x {x.dtype} and weight {weight.dtype} must be one of {_DTYPES}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("gemv: weight rows must be contiguous")
    n = rows // 2 if glu else rows   # output columns
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:   # with residual: the stream as it is, and its (empty) rows' sums
        if residual is not None:
            out = y.copy_(residual), torch.zeros((1, m), dtype=torch.float32, device=x.device)
            return out if norm_weight is None else (*out, (residual.float() * norm_weight.float()).to(x.dtype))
        return y
    if k == 0:
        if glu:
            from specdec.kernels.fused import silu_mul
            full = torch.zeros((m, rows), dtype=x.dtype, device=x.device)
            return silu_mul(full if bias is None else full + bias)
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    # The tile (rows of W per program) is the plain GEMV's over all rows: the same bytes per program.
    cfg = config or default_config(m, rows, k, _num_sms(x.device))
    if (m == 1) != (cfg.block_m == 1):
        raise ValueError(f"gemv: config block_m {cfg.block_m} does not serve M = {m}")
    m_tiles = triton.cdiv(m, cfg.block_m)
    if glu and cfg.block_n < 2:
        raise ValueError("gemv: the silu_mul epilogue needs block_n >= 2 (gate and up rows)")
    k_per_split, split = split_layout(k, cfg)
    n_tiles = triton.cdiv(rows, cfg.block_n)
    # (more tiles than the counters: the separate reduce; default_config never splits those)
    inline = split > 1 and _split_reduce.value == "inline" and n_tiles * m_tiles <= MAX_SPLIT_TILES
    ws = torch.empty((split, m, rows), dtype=torch.float32, device=x.device) if split > 1 else y
    b = bias if bias is not None else y
    block = min(1024, triton.next_power_of_2(n))
    sums = None
    if residual is not None:   # one partial sum per program that writes outputs
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        sums = torch.empty((triton.cdiv(n, block) if split > 1 and not inline else n_tiles, m),
                           dtype=torch.float32, device=x.device)
    res = residual if residual is not None else y
    ss, nw, parts, eps, block_p = _norm_args(norm, y, cfg.block_m)
    ss = sums if sums is not None else ss
    rw = y   # (the weighted stream: norm_weight only; the producer's NW is the norm weight)
    if norm_weight is not None:
        rw, nw = torch.empty_like(y), norm_weight.contiguous()
    launch = pdl.options(x.device)
    own = pdl.options(x.device, norm is None or consumer_launch_pdl(m, k))
    late = consumer_trigger.value and launch["USE_PDL"] and not own["USE_PDL"]
    _gemv_kernel[(n_tiles * m_tiles, split)](
        x, weight, b, y, ws, _counters(x.device) if inline else y, res, ss, nw, rw, m, n, k,
        k_per_split, x.stride(0), weight.stride(0), y.stride(0), res.stride(0), parts, eps,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        UPCAST=x.dtype == torch.float32 or x.device.type == "cpu", GLU=glu,
        RES_OUT=residual is not None and (split == 1 or inline), NORM_IN=norm is not None, BLOCK_P=block_p,
        INLINE_REDUCE=inline, M_TILES=m_tiles, RES_WEIGHTED=norm_weight is not None and (split == 1 or inline),
        NORM_W=norm is not None and norm.weight is not None, LATE_TRIGGER=late,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **own)
    if split > 1 and not inline:
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            ws, b, y, res, ss, nw, rw, m, n, y.stride(0), res.stride(0), SPLIT=split, HAS_BIAS=bias is not None,
            BLOCK=block, GLU=glu, RES_OUT=residual is not None, RES_WEIGHTED=norm_weight is not None,
            num_warps=4, **launch)
    if residual is None:
        return y
    return (y, sums) if norm_weight is None else (y, sums, rw)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           on_cpu: bool = False) -> torch.Tensor:
    """F.linear, on the GEMV kernel where it serves: CUDA (or on_cpu, for interpreter tests), 2-D
    after flattening, M <= the dispatch bound (SERVE_MAX_M unless serve_max_m_forced changes it),
    above SMALL_TILE_MAX_M rows N <= wide_max_n, matching 16/32-bit dtypes. Anything else is F.linear's."""
    if not _serves(x, weight, bias, on_cpu):
        return F.linear(x, weight, bias)
    return _on_rows(x, weight, bias)


# The most rows `linear` (and GemvOps) hand to the kernel; above it, the BLAS (kernels/blas.py).
# Steps of more than SMALL_TILE_MAX_M rows run on 64-row tiles, and there projections wider than
# WIDE_MAX_N stay on the BLAS as well. H200, session 31 (results/logs/s31/call4_*, call5_*): at 40
# rows bench/gemv.py's sweep found the kernel ahead of F.linear on cuBLAS for the 7B's qkv, o and
# down (30.5 / 13.0 / 29.6 us against 32.1 / 15.2 / 31.0, once the 64-row tiles ran 3-4 stages
# instead of 5) and behind on gate_up (53.8 against 52.0, 22016 wide); in the graphed forward,
# against the default BLAS (cuBLASLt) for every 17..64-row step, the 7B's 5-token verify at b 8
# took 4.05 / 4.06 ms against 4.26 (two runs), its b 32 decode 4.31 against 4.54, the drafts' b 32
# decode 0.118 / 0.449 / 1.142 ms (68m / 160m / 1.1B) against 0.127 / 0.501 / 1.253; steps of up
# to 16 rows unchanged. (Session 18, 5 stages and gate_up included: 4.68 against 4.28 ms.)
# serve_max_m_forced(16) is the old bound (the kernel set gemv_m16). Read when a step's ops run: a
# CUDA graph keeps the path it was captured with.
SERVE_MAX_M = 64
WIDE_MAX_N = 16384


def _serve_bound(m: int) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"serve_max_m_forced: {m} outside 1..{MAX_M}")
    return m


_serve_max_m: Switch[int] = Switch(SERVE_MAX_M, _serve_bound)
# serve_max_m_forced(m): dispatch steps of at most m rows to the kernel inside the block
serve_max_m_forced = _serve_max_m.forced


def _check_max_n(n: int | None) -> int | None:
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"wide_max_n {n!r}: expected None or a positive int")
    return n


# wide_max_n.forced(n): above SMALL_TILE_MAX_M rows, projections wider than n stay on the BLAS
# (None: any width goes to the kernel, as the kernel set gemv_m64_all_n times)
wide_max_n: Switch[int | None] = Switch(WIDE_MAX_N, _check_max_n)


def _serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, on_cpu: bool) -> bool:
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if m > SMALL_TILE_MAX_M and wide_max_n.value is not None and weight.shape[0] > wide_max_n.value:
        return False
    return ((x.is_cuda or on_cpu) and m <= _serve_max_m.value and x.dtype == weight.dtype and x.dtype in _DTYPES
            and weight.dim() == 2 and weight.stride(-1) == 1 and x.shape[-1] != 0
            and (bias is None or bias.dtype == x.dtype))


def _on_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             epilogue: str | None = None) -> torch.Tensor:
    """gemv over x flattened to rows, reshaped back to x's leading dimensions."""
    y = gemv(x.reshape(-1, x.shape[-1]), weight, bias, epilogue=epilogue)
    return y.view(*x.shape[:-1], y.shape[-1])


def _check_norm(norm: "NormInput | None", x: torch.Tensor) -> None:
    if norm is None:
        return
    m, k = x.shape
    weight = None if norm.weight is None else (tuple(norm.weight.shape), norm.weight.dtype)
    if (weight not in (None, ((k,), x.dtype)) or k == 0
            or norm.sums.dtype != torch.float32 or norm.sums.dim() != 2
            or norm.sums.shape[1] != m or norm.sums.shape[0] < 1):
        raise ValueError(f"gemv: norm weight {weight} / sums "
                         f"{tuple(norm.sums.shape)} {norm.sums.dtype} do not fit x [{m}, {k}] {x.dtype}")
    if x.dtype not in NORM_DTYPES:
        raise ValueError(f"gemv: norm= takes {NORM_DTYPES}, not {x.dtype}: the consumer rounds x * weight to "
                         "the dtype before 1 / RMS scales it, which overflows fp16 near its maximum")


# Partial sums a norm consumer loads ahead of its K loop, per row of its tile: one load covers every
# producer program at M = 1 (the 7B's o_proj has 512); 16-row tiles keep 128 (2048 fp32 values
# held across the loop). H200, b 1: the consumer's sums loaded 64 at a time in front of the loop
# cost the 7B decode 4083 us against 3716 without the fusion; all at once 3738, after the loop 3727.
PARTS_AHEAD = {1: 1024, 16: 128, 32: 64, 64: 32}


def _norm_args(norm: "NormInput | None", dummy: torch.Tensor, block_m: int) -> tuple:
    """(SS, NW, num_parts, eps, BLOCK_P) of a launch: the norm's (the kernel reads NW as NW + k, so
    contiguous), or a dummy tensor and zeros without one."""
    if norm is None:
        return dummy, dummy, 0, 0.0, 1
    parts = norm.sums.shape[0]
    return (norm.sums.contiguous(), dummy if norm.weight is None else norm.weight.contiguous(), parts, float(norm.eps),
            min(PARTS_AHEAD[block_m], triton.next_power_of_2(parts)))


class NormInput(NamedTuple):
    """RMSNorm still to apply to a residual stream, by the GEMV that reads it: the producer's
    per-program sums of squares [parts, M] (fp32), the norm weight (None to a consumer whose x is
    the producer's weighted stream) and eps."""
    sums: torch.Tensor
    weight: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The norm on its own (an RMSNorm module's call, for op sets that call the module)."""
        if self.weight is None:   # a consumer's view of a weighted stream (PendingNorm.consumed)
            raise ValueError("NormInput without its weight: only a gemv consumer of the weighted stream takes it")
        from specdec.models.llama import RMSNorm
        return RMSNorm.forward(self, x)


class RowLinear(NamedTuple):
    """A projection into the residual stream (o_proj, down_proj) not run yet: the add + RMSNorm
    that follows runs it with the residual add in its epilogue (GemvOps.add_rmsnorm)."""
    x: torch.Tensor
    weight: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape[:-1] + self.weight.shape[:1]


class PendingNorm(NamedTuple):
    """A residual stream whose RMSNorm the next projection applies as it reads it; weighted: the
    stream times the norm's weight as the producer wrote it (None: the consumer multiplies)."""
    r: torch.Tensor
    norm: NormInput
    weighted: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.r.shape

    def consumed(self) -> tuple[torch.Tensor, NormInput]:
        """(x, norm) for the consuming gemv: the weighted stream and the scale alone, or the stream."""
        if self.weighted is None:
            return self.r, self.norm
        return self.weighted, NormInput(self.norm.sums, None, self.norm.eps)


# The widest residual stream whose norm consumers of 2..16 rows take PDL by default (the 68m / 160m
# drafts' 768; TinyLlama's 2048 and the 7B's 4096 are faster without it: see consumer_pdl).
NARROW_NORM_N = 1024
# The most tokens a step may have for the norm fusion by default (GemvOps.norm_bound): what was
# timed. At 40 rows it did not help (H200, session 31: the 7B's 5-token verify at b 8 4.99 ms with
# it against 4.94 without, on the wide-tile experiment).
NORM_MAX_M = 16


class GemvOps:
    """A layer op set (TorchLayerOps or FusedLayerOps) whose linear layers run on the GEMV kernel:
    every other step is the base set's. fuse_silu: the gate_up projection returns SiLU(gate) * up
    itself (gemv epilogue="silu_mul") where the GEMV serves the step.

    fuse_norm (one rank, no o / MLP bias, bf16 / fp32): add + RMSNorm leaves the layer as a kernel
    of its own. o_proj and down_proj come back unrun (RowLinear); the add_rmsnorm after them runs
    the projection with the residual add in its epilogue, which writes the new residual stream and
    each program's sum of squares, and returns a PendingNorm; the qkv / gate_up projection that
    reads it multiplies each K slice by the norm weight as it loads it and scales its sums by
    1 / RMS (from those partial sums, in a fixed order: deterministic) at the end. RMSNorm's value,
    not the separate kernel's bits. Two kernels fewer per layer. With norm_ahead (the default) the
    producer also writes the stream times the norm weight (gemv(norm_weight=)) and the consumer
    reads that, its K steps without the multiply (the same bits).
    Which steps: norm_max_m tokens at most where set; by default (None) steps of up to NORM_MAX_M
    tokens, whatever the width (wide streams' consumers of 2..16 rows without PDL: consumer_pdl).
    H200, same weights, graphed decode (bench/timeline.py): at b 1 the forward took 3688 vs 3722
    us (7B), 294 vs 309 (160m), 897 vs 946 (1.1B; session 12). On the tl.dot path (2..16 rows) the
    consumer that multiplied on its K steps lost everywhere (7B verify of 5 tokens at b 1: 4943 vs
    4048 us, session 24); weighed ahead it won on narrow models (session 24: 160m decode at b 8 348
    vs 363 us) and lost on wide ones (7B verify at b 1 4239 vs 4005) until their consumers left PDL
    (session 27: 3874 vs 4002; see consumer_pdl)."""

    def __init__(self, base, on_cpu: bool = False, fuse_silu: bool = False, fuse_norm: bool = False):
        self.base = base
        self.on_cpu = on_cpu
        self.fuse_silu = fuse_silu
        self.fuse_norm = fuse_norm
        self.norm_max_m: int | None = None
        # the producer writes the stream times the norm weight too (gemv(norm_weight=)), so the
        # consumer's K steps carry no multiply; SPECDEC_GEMV_NORM_AHEAD=0 leaves it to the consumer
        self.norm_ahead = os.environ.get("SPECDEC_GEMV_NORM_AHEAD", "1") != "0"
        self.name = base.name + "+gemv" + ("+silu" if fuse_silu else "") + ("+norm" if fuse_norm else "")

    def row_linear(self, x, weight):
        if (self.fuse_norm and x.dim() == 2 and x.shape[0] <= self.norm_bound()
                and _serves(x, weight, None, self.on_cpu)):
            return RowLinear(x, weight)
        return self.linear(x, weight)

    def norm_bound(self) -> int:
        """The most tokens a step may have for the norm fusion."""
        if self.norm_max_m is not None:
            return self.norm_max_m
        return NORM_MAX_M   # what was timed, whatever serve_max_m_forced says

    def add_rmsnorm(self, x, residual, norm):
        if isinstance(x, RowLinear):
            if (residual is not None and residual.shape == x.shape
                    and residual.dtype == x.x.dtype == norm.weight.dtype and residual.dtype in NORM_DTYPES):
                weighted = None
                if self.norm_ahead:
                    r, sums, weighted = gemv(x.x, x.weight, residual=residual, norm_weight=norm.weight)
                else:
                    r, sums = gemv(x.x, x.weight, residual=residual)
                return PendingNorm(r, NormInput(sums, norm.weight, norm.eps), weighted), r
        return self.base.add_rmsnorm(self.resolve(x), residual, norm)

    def resolve(self, x):
        """A plain tensor for a RowLinear (its product) or a PendingNorm (its normalised rows)."""
        if isinstance(x, RowLinear):
            return self.linear(x.x, x.weight)
        if isinstance(x, PendingNorm):
            return self.base.add_rmsnorm(x.r, None, x.norm)[0]
        return x

    def __getattr__(self, attr):  # only called for what the instance lacks: the base set's ops
        if attr == "base":
            raise AttributeError(attr)
        return getattr(self.base, attr)

    def linear(self, x, weight, bias=None):
        if isinstance(x, PendingNorm):
            if _serves(x.r, weight, bias, self.on_cpu):
                xin, norm = x.consumed()
                return gemv(xin, weight, bias, norm=norm)
            x = self.resolve(x)
        return linear(x, weight, bias, on_cpu=self.on_cpu)

    def gate_up_silu(self, x, weight, bias=None):
        if self.fuse_silu and weight.shape[0] % 2 == 0:
            if isinstance(x, PendingNorm) and _serves(x.r, weight, bias, self.on_cpu):
                xin, norm = x.consumed()
                return gemv(xin, weight, bias, epilogue="silu_mul", norm=norm)
            if not isinstance(x, PendingNorm) and _serves(x, weight, bias, self.on_cpu):
                return _on_rows(x, weight, bias, epilogue="silu_mul")
        return self.base.silu_mul(self.linear(x, weight, bias))
