"""Skinny GEMM for decode and verify: y[M, N] = x[M, K] @ W[N, K]^T (+ b) with M <= 16 tokens.

At these sizes a projection is a read of W and nothing else (Llama-7B o_proj: 32 MB of weight against
16 KB of activations), so the kernel is built to stream W once, at full width:
- each program owns BLOCK_N rows of W and walks K in BLOCK_K slices: every row segment is a
  contiguous run of BLOCK_K elements (512 B .. 2 KB), loaded as 16-byte vectors;
- M == 1 multiplies elementwise into a [BLOCK_N, BLOCK_K] fp32 accumulator and reduces once at the
  end (no tensor cores, no padding); 2 <= M <= 16 pads the tokens to 16 rows and uses tl.dot, whose
  operands the compiler pipelines through shared memory (num_stages deep);
- BLOCK_N shrinks for small N so that there are programs for every SM; where even the smallest
  BLOCK_N leaves SMs idle, K is split over a second grid axis: fp32 partials [S, M, N] and a second,
  tiny kernel that sums them in split order (deterministic: the same bits every run, unlike atomics).
Accumulation is fp32 for every input dtype, rounded once to the output dtype with the bias added, as
cuBLAS does, so bf16 results agree with F.linear up to reduction order.

With epilogue="silu_mul" the gate_up projection ([2I, K] weight: gate rows, then up rows) returns
SiLU(gate) * up, [M, I], instead of [M, 2I]: each program reads the gate rows of its output columns
and the matching up rows (the same bytes per program as the plain GEMV's tile), and its epilogue
rounds gate and up to the dtype as the projection would have, then applies SiLU * up as
kernels/fused.silu_mul does. So the silu_mul kernel goes (one kernel fewer per layer) and the bits
stay those of gate_up + silu_mul; each SiLU is computed once. Opt-in (GemvOps(fuse_silu=True))
until an H200 run has compared it (bench/decode.py's "silu_gemv" kernel set).

The GPU path of the model uses it through GemvOps (chosen at build, on by default on CUDA); `gemv` itself
runs anywhere Triton does (the CPU under TRITON_INTERPRET=1, which the unit tests use).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.kernels import pdl
from specdec.kernels.fused import _rotate_half
from specdec.models.llama import qkv_rope_store

MAX_M = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _silu_mul_rounded(g, u, DTYPE: tl.constexpr):
    """SiLU(g) * u from fp32 accumulators, rounded where gate_up's output and silu_mul round."""
    g = g.to(DTYPE).to(tl.float32)
    u = u.to(DTYPE).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return (act * u).to(DTYPE)


@triton.jit
def _norm_scale(SS, M, num_parts, K, eps, offs_m, m_ok, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """1 / RMS of each row from the producer's per-program sums of squares [num_parts, M], summed
    in part order (deterministic)."""
    offs_p = tl.arange(0, BLOCK_P)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        p = p0 + offs_p
        part = tl.load(SS + p[None, :] * M + offs_m[:, None], mask=m_ok[:, None] & (p < num_parts)[None, :],
                       other=0.0)
        total += tl.sum(part, axis=1)
    return tl.math.rsqrt(total / K + eps)


@triton.jit
def _normed(x, rstd, nw, DTYPE: tl.constexpr):
    """RMSNorm's rounding (HF order, as fused.add_rmsnorm): x * rstd in fp32, cast to the dtype,
    times the norm weight, cast again."""
    y = (x.to(tl.float32) * rstd).to(DTYPE).to(tl.float32)
    return (y * nw.to(tl.float32)).to(DTYPE)


@triton.jit
def _residual_out(acc, R, Y, SS, part, M, N, offs_m, offs_n, m_ok, n_ok, stride_r, stride_ym):
    """The producer's epilogue: r = residual + y rounded to the dtype (torch's `residual + x`),
    stored as the new residual stream, and this program's sum of r^2 per row into SS[part, m]."""
    mask = m_ok[:, None] & n_ok[None, :]
    res = tl.load(R + offs_m.to(tl.int64)[:, None] * stride_r + offs_n[None, :], mask=mask, other=0.0)
    r = (acc.to(Y.dtype.element_ty).to(tl.float32) + res.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], r, mask=mask)
    rf = tl.where(mask, r.to(tl.float32), 0.0)
    tl.store(SS + part * M + offs_m, tl.sum(rf * rf, axis=1), mask=m_ok)


@triton.jit
def _rope_out(x1, x2, head, j0, Q, Cos, Sin, Slots, KC, VC, offs_m, m_ok, stride_qt, stride_qh, stride_ct,
              stride_kb, stride_ks, stride_kh, num_heads, num_kv_heads, HT: tl.constexpr,
              HEAD_D: tl.constexpr, PAGE: tl.constexpr):
    """The qkv projection's epilogue with RoPE + KV store (fused.rope_store's rounding): x1 / x2 are
    rows j0 + [0, HT) of one head's two halves, [BLOCK_M, HT] fp32 accumulators."""
    DT: tl.constexpr = Q.dtype.element_ty
    x1 = x1.to(DT).to(tl.float32)            # the projection's output, as gemv would store it
    x2 = x2.to(DT).to(tl.float32)
    jj = j0 + tl.arange(0, HT)
    rows = offs_m.to(tl.int64)
    if head < num_heads + num_kv_heads:       # q or k: rotate
        c = tl.load(Cos + rows[:, None] * stride_ct + jj[None, :], mask=m_ok[:, None], other=0.0)
        s = tl.load(Sin + rows[:, None] * stride_ct + jj[None, :], mask=m_ok[:, None], other=0.0)
        o1, o2 = _rotate_half(x1, x2, c.to(DT).to(tl.float32), s.to(DT).to(tl.float32), DT)
    else:
        o1 = x1.to(DT)
        o2 = x2.to(DT)
    if head < num_heads:
        q = Q + rows[:, None] * stride_qt + head * stride_qh + jj[None, :]
        tl.store(q, o1, mask=m_ok[:, None])
        tl.store(q + HEAD_D // 2, o2, mask=m_ok[:, None])
    else:
        slot = tl.load(Slots + rows, mask=m_ok, other=-1)
        ok = (m_ok & (slot >= 0))[:, None]
        base = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks
        if head < num_heads + num_kv_heads:
            cache = KC + base[:, None] + (head - num_heads) * stride_kh + jj[None, :]
        else:
            cache = VC + base[:, None] + (head - num_heads - num_kv_heads) * stride_kh + jj[None, :]
        tl.store(cache, o1.to(cache.dtype.element_ty), mask=ok)
        tl.store(cache + HEAD_D // 2, o2.to(cache.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_kernel(X, W, B, Y, WS, R, SS, NW, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                 stride_r, num_parts, eps,
                 Cos, Sin, Slots, KC, VC, stride_ct, stride_qh, stride_kb, stride_ks, stride_kh,
                 num_heads, num_kv_heads,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 UPCAST: tl.constexpr, USE_PDL: tl.constexpr, GLU: tl.constexpr,
                 RES_OUT: tl.constexpr = False, NORM_IN: tl.constexpr = False, BLOCK_P: tl.constexpr = 16,
                 ROPE: tl.constexpr = False, HEAD_D: tl.constexpr = 2, PAGE: tl.constexpr = 1):
    """N output columns. GLU: W has 2N rows (gate, then up); a program's BLOCK_N rows are the gate
    rows of its BLOCK_N / 2 output columns and their up rows, and it writes SiLU(gate) * up.
    RES_OUT (one split, no GLU): Y = residual R + x @ W^T, and per-program sums of squares into SS.
    NORM_IN: x is the residual stream of such a producer and is RMS-normalised on the fly (SS, its
    num_parts partial sums; NW, the norm weight; eps) before the product.
    ROPE (one split): W is the qkv projection ((num_heads + 2 num_kv_heads) heads of HEAD_D rows);
    a program's BLOCK_N rows are BLOCK_N / 2 rows of one head's first half and the matching rows of
    its second half, and its epilogue is fused.rope_store's: RoPE(q) into Y ([M, num_heads, HEAD_D],
    head stride stride_qh), RoPE(k) and v into the paged caches KC / VC at Slots (negative: none)."""
    pdl.enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if GLU:
        HALF: tl.constexpr = BLOCK_N // 2
        offs_r = tl.arange(0, BLOCK_N)
        col = pid_n * HALF + offs_r % HALF
        offs_n = col + (offs_r // HALF) * N             # W rows: gate rows, then the up rows
        n_ok = col < N
    elif ROPE:
        HT: tl.constexpr = BLOCK_N // 2
        TILES: tl.constexpr = HEAD_D // BLOCK_N        # programs per head
        head = pid_n // TILES
        j0 = (pid_n % TILES) * HT
        offs_r = tl.arange(0, BLOCK_N)
        offs_n = head * HEAD_D + j0 + offs_r % HT + (offs_r // HT) * (HEAD_D // 2)
        n_ok = offs_n < N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn                   # [BLOCK_N, 1]
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm                   # [BLOCK_M, 1]
    if NORM_IN:
        rstd = _norm_scale(SS, M, num_parts, K, eps, offs_m, m_ok, BLOCK_M, BLOCK_P)   # [BLOCK_M]
    if BLOCK_M == 1:
        if NORM_IN:
            rstd1 = tl.sum(rstd, axis=0)
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(X + offs_k)
                if NORM_IN:
                    x = _normed(x, rstd1, tl.load(NW + offs_k), X.dtype.element_ty)
            else:  # splits are whole BLOCK_Ks: only K's own end needs a mask (K % 16 keeps 16 B loads)
                k_ok = offs_k < K
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(X + offs_k, mask=k_ok, other=0.0)
                if NORM_IN:
                    x = _normed(x, rstd1, tl.load(NW + offs_k, mask=k_ok, other=0.0), X.dtype.element_ty)
            part += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(part, axis=1)[None, :]                                  # [1, BLOCK_N]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
                if NORM_IN:
                    x = _normed(x, rstd[:, None], tl.load(NW + offs_k)[None, :], X.dtype.element_ty)
            else:
                k_ok = offs_k < K
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if NORM_IN:
                    x = _normed(x, rstd[:, None], tl.load(NW + offs_k, mask=k_ok, other=0.0)[None, :],
                                X.dtype.element_ty)
            if UPCAST:  # fp32 weights (exact products, not tf32), or the interpreter (no bf16 matmul)
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:  # fp32 partials of every W row (GLU: 2N columns), summed in split order
        n_ws = 2 * N if GLU else N
        ws = WS + (pid_k * M + offs_m)[:, None].to(tl.int64) * n_ws + offs_n[None, :]
        tl.store(ws, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GLU:
            gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HALF]), [0, 2, 1]))
            cols = pid_n * HALF + tl.arange(0, HALF)
            y = Y + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :]
            tl.store(y, _silu_mul_rounded(gate, up, Y.dtype.element_ty),
                     mask=m_ok[:, None] & (cols < N)[None, :])
        elif RES_OUT:
            _residual_out(acc, R, Y, SS, pid_n, M, N, offs_m, offs_n, m_ok, n_ok, stride_r, stride_ym)
        elif ROPE:
            x1, x2 = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HT]), [0, 2, 1]))
            _rope_out(x1, x2, head, j0, Y, Cos, Sin, Slots, KC, VC, offs_m, m_ok, stride_ym, stride_qh,
                      stride_ct, stride_kb, stride_ks, stride_kh, num_heads, num_kv_heads, HT, HEAD_D, PAGE)
        else:
            y = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
            tl.store(y, acc.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(WS, B, Y, R, SS, M, N, stride_ym, stride_r, SPLIT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                          GLU: tl.constexpr, RES_OUT: tl.constexpr = False):
    pdl.enter(USE_PDL)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
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
        _residual_out(acc[None, :], R, Y, SS, tl.program_id(1), M, N, rows, offs, rows < M, ok,
                      stride_r, stride_ym)
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
        if self.block_m not in (1, 16) or self.split_k < 1:
            raise ValueError(f"GemvConfig: block_m {self.block_m} must be 1 or 16, split_k >= 1")
        if self.block_m == 16 and (self.block_n < 16 or self.block_k < 16):
            raise ValueError("GemvConfig: tl.dot needs block_n, block_k >= 16")
        if any(b & (b - 1) or b < 1 for b in (self.block_n, self.block_k)):
            raise ValueError(f"GemvConfig: blocks {self.block_n} x {self.block_k} must be powers of two")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pick what an H200 would
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """The winners of the H200 sweep in bench/results/gemv.json (Llama-7B projections; differences
    under ~1 us were taken as noise). M = 1: [8, 512] W tiles (8 KB of bf16 per K step), 8 warps where
    N <= 4096 leaves few programs per SM to hide latency with. M > 1: [16, 32, 128] tl.dot tiles, 5
    stages of cp.async except for the widest N (gate_up, the LM head), where 3 won. Split-K where
    the N tiles alone leave SMs idle (Llama-7B's down projection at M > 1; small draft models)."""
    if m == 1:
        block_n, block_k, warps, stages = 8, 512, 8 if n <= 4096 else 4, 3
    else:
        block_n, block_k, warps, stages = 32, 128, 4, 5 if n <= 16384 else 3
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n)
    split = 1
    if tiles < num_sms:
        # Whole K blocks per split, at most 16 splits; the count is the one gemv() launches.
        blocks = triton.cdiv(k, block_k)
        per = max(1, blocks // triton.cdiv(num_sms, tiles), triton.cdiv(blocks, 16))
        split = triton.cdiv(blocks, per)
    return GemvConfig(block_m=1 if m == 1 else 16, block_n=block_n, block_k=block_k, split_k=split,
                      num_warps=warps, num_stages=stages)


def split_layout(k: int, cfg: GemvConfig) -> tuple[int, int]:
    """(K elements per split, splits launched): whole BLOCK_Ks per split, no empty splits (so the
    launched count can be below cfg.split_k when the K blocks do not divide evenly)."""
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, epilogue: str | None = None, *,
         residual: torch.Tensor | None = None, norm: "NormInput | None" = None,
         rope: "RopeStore | None" = None):
    """x: [M, K] with M <= 16, weight: [N, K] (K contiguous), bias: [N] or None -> [M, N] in x's
    dtype. epilogue="silu_mul": weight is [2I, K] (gate rows, then up rows) and the result is
    SiLU(gate) * up, [M, I], with the bits of the plain result followed by fused.silu_mul. Always
    the Triton kernel (the interpreter on a CPU); `linear` is the dispatching entry.

    Add + RMSNorm folded into the projections around it (opt-in, GemvOps(fuse_norm=True)):
    residual [M, N] (no epilogue): returns (residual + y, sums of squares [parts, M] fp32), the new
    residual stream rounded as torch's `residual + y` and each program's sum of its squares;
    norm=NormInput(sums, weight, eps): x is such a residual stream and the product is taken with
    RMSNorm(x) * weight (HF rounding, as fused.add_rmsnorm), its RMS from the partial sums.

    rope=RopeStore(...) (weight: the qkv projection; opt-in, GemvOps(fuse_rope=True)): returns
    RoPE(q) [M, H, D] and writes RoPE(k) and v into the paged caches, with the bits of this
    projection followed by fused.rope_store where rope_keeps_bits says so (one kernel fewer per
    layer). Always one split. Composes with norm=."""
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
    _check_norm(norm, x)
    if rope is not None:
        return _gemv_rope(x, weight, bias, config, epilogue, residual, norm, rope)
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
            return y.copy_(residual), torch.zeros((1, m), dtype=torch.float32, device=x.device)
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
    if glu and cfg.block_n < 2:
        raise ValueError("gemv: the silu_mul epilogue needs block_n >= 2 (gate and up rows)")
    k_per_split, split = split_layout(k, cfg)
    ws = torch.empty((split, m, rows), dtype=torch.float32, device=x.device) if split > 1 else y
    b = bias if bias is not None else y
    block = min(1024, triton.next_power_of_2(n))
    n_tiles = triton.cdiv(rows, cfg.block_n)
    sums = None
    if residual is not None:   # one partial sum per program that writes outputs
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        sums = torch.empty((triton.cdiv(n, block) if split > 1 else n_tiles, m), dtype=torch.float32,
                           device=x.device)
    res = residual if residual is not None else y
    ss, nw, parts, eps, block_p = _norm_args(norm, y)
    ss = sums if sums is not None else ss
    launch = pdl.options(x.device)
    _gemv_kernel[(n_tiles, split)](
        x, weight, b, y, ws, res, ss, nw, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0), res.stride(0), parts, eps, *_NO_ROPE(y),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        UPCAST=x.dtype == torch.float32 or x.device.type == "cpu", GLU=glu,
        RES_OUT=residual is not None and split == 1, NORM_IN=norm is not None, BLOCK_P=block_p,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch)
    if split > 1:
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            ws, b, y, res, ss, m, n, y.stride(0), res.stride(0), SPLIT=split, HAS_BIAS=bias is not None,
            BLOCK=block, GLU=glu, RES_OUT=residual is not None, num_warps=4, **launch)
    return y if residual is None else (y, sums)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           on_cpu: bool = False) -> torch.Tensor:
    """F.linear, on the GEMV kernel where it serves: CUDA (or on_cpu, for interpreter tests), 2-D
    after flattening, M <= 16, matching 16/32-bit dtypes. Anything else is F.linear's."""
    if not _serves(x, weight, bias, on_cpu):
        return F.linear(x, weight, bias)
    return _on_rows(x, weight, bias)


def _serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, on_cpu: bool) -> bool:
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return ((x.is_cuda or on_cpu) and m <= MAX_M and x.dtype == weight.dtype and x.dtype in _DTYPES
            and weight.dim() == 2 and weight.stride(-1) == 1 and x.shape[-1] != 0
            and (bias is None or bias.dtype == x.dtype))


def _on_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             epilogue: str | None = None) -> torch.Tensor:
    """gemv over x flattened to rows, reshaped back to x's leading dimensions."""
    y = gemv(x.reshape(-1, x.shape[-1]), weight, bias, epilogue=epilogue)
    return y.view(*x.shape[:-1], y.shape[-1])


def _check_norm(norm: "NormInput | None", x: torch.Tensor) -> None:
    m, k = x.shape
    if norm is not None and (norm.weight.shape != (k,) or norm.weight.dtype != x.dtype or k == 0
                             or norm.sums.dtype != torch.float32 or norm.sums.dim() != 2
                             or norm.sums.shape[1] != m or norm.sums.shape[0] < 1):
        raise ValueError(f"gemv: norm weight {tuple(norm.weight.shape)} {norm.weight.dtype} / sums "
                         f"{tuple(norm.sums.shape)} {norm.sums.dtype} do not fit x [{m}, {k}] {x.dtype}")


def _norm_args(norm: "NormInput | None", dummy: torch.Tensor) -> tuple:
    """(SS, NW, num_parts, eps, BLOCK_P) of a launch: the norm's (the kernel reads NW as NW + k, so
    contiguous), or a dummy tensor and zeros without one."""
    if norm is None:
        return dummy, dummy, 0, 0.0, 1
    parts = norm.sums.shape[0]
    return (norm.sums.contiguous(), norm.weight.contiguous(), parts, float(norm.eps),
            min(64, triton.next_power_of_2(parts)))


def _NO_ROPE(y: torch.Tensor) -> tuple:  # noqa: N802 - the rope arguments of a launch without ROPE
    return (y, y, y, y, y, 0, 0, 0, 0, 0, 0, 0)


class RopeStore(NamedTuple):
    """What the qkv projection's RoPE + KV-store epilogue needs (fused.rope_store's arguments):
    cos / sin [M, D/2] or [M, D], the caches [blocks, block_size, Hkv, D], slot per token."""
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


def rope_keeps_bits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv(rope=...) has the bits of the plain projection followed by rope_store: where
    the plain GEMV would split K (few N tiles: small models at M > 1) it sums per-split partials in
    split order, and the epilogue's single pass sums K in another order (GemvOps keeps the separate
    kernels there). fp32 models can still differ by an ulp: the compiler contracts RoPE's two
    products into an FMA in the other order than rope_store's kernel (fp16 / bf16 products are
    exact in fp32, so they cannot)."""
    m, k = x.reshape(-1, x.shape[-1]).shape
    return split_layout(k, default_config(m, weight.shape[0], k, _num_sms(x.device)))[1] == 1


def _gemv_rope(x, weight, bias, config, epilogue, residual, norm, rope: RopeStore) -> torch.Tensor:
    m, k = x.shape
    h, hkv, d = rope.num_heads, rope.num_kv_heads, rope.head_dim
    kc, vc = rope.k_cache, rope.v_cache
    if (epilogue is not None or residual is not None or weight.shape[0] != (h + 2 * hkv) * d or d % 2
            or d < 16 or d & (d - 1) or m > MAX_M or x.dtype != weight.dtype or x.dtype not in _DTYPES
            or kc.shape[2:] != (hkv, d) or vc.shape != kc.shape or vc.stride() != kc.stride()
            or kc.stride(-1) != 1 or rope.cos.shape[0] != m or rope.cos.shape[1] not in (d, d // 2)
            or rope.sin.shape != rope.cos.shape or rope.slots.shape != (m,)):
        raise ValueError(f"gemv rope: x {tuple(x.shape)}, weight {tuple(weight.shape)}, heads {h}/{hkv}x{d}, "
                         f"caches {tuple(kc.shape)}, cos {tuple(rope.cos.shape)}, slots "
                         f"{tuple(rope.slots.shape)} do not fit (power-of-two head_dim >= 16, M <= {MAX_M})")
    q = torch.empty((m, h, d), dtype=x.dtype, device=x.device)
    if m == 0:
        return q
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = rope.cos, rope.sin      # the kernel reads both with cos's row stride
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or sin.stride(0) != cos.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    base = config or default_config(m, weight.shape[0], k, _num_sms(x.device))
    if (m == 1) != (base.block_m == 1) or base.block_n < 2 or weight.stride(-1) != 1:
        raise ValueError(f"gemv rope: config {base} does not serve M = {m} (block_n >= 2), or the weight "
                         "rows are not contiguous")
    # one split (the epilogue writes the outputs), a whole number of programs per head
    cfg = GemvConfig(base.block_m, min(base.block_n, d), base.block_k, 1, base.num_warps, base.num_stages)
    ss, nw, parts, eps, block_p = _norm_args(norm, q)
    rows = weight.shape[0]
    _gemv_kernel[(triton.cdiv(rows, cfg.block_n), 1)](
        x, weight, bias if bias is not None else q, q, q, q, ss, nw, m, rows, k, split_layout(k, cfg)[0],
        x.stride(0), weight.stride(0), q.stride(0), 0, parts, eps,
        cos, sin, rope.slots, kc, vc, cos.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        h, hkv,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=1,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        UPCAST=x.dtype == torch.float32 or x.device.type == "cpu", GLU=False, NORM_IN=norm is not None,
        BLOCK_P=block_p, ROPE=True, HEAD_D=d, PAGE=kc.shape[1],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x.device))
    return q


class NormInput(NamedTuple):
    """RMSNorm still to apply to a residual stream, by the GEMV that reads it: the producer's
    per-program sums of squares [parts, M] (fp32), the norm weight and eps."""
    sums: torch.Tensor
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The norm on its own (an RMSNorm module's call, for op sets that call the module)."""
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
    """A residual stream whose RMSNorm the next projection applies as it reads it."""
    r: torch.Tensor
    norm: NormInput

    @property
    def shape(self) -> torch.Size:
        return self.r.shape


class GemvOps:
    """A layer op set (TorchLayerOps or FusedLayerOps) whose linear layers run on the GEMV kernel:
    every other step is the base set's. fuse_silu: the gate_up projection returns SiLU(gate) * up
    itself (gemv epilogue="silu_mul") where the GEMV serves the step.

    fuse_norm (opt-in until timed on the GPU; one rank, no o / MLP bias): add + RMSNorm leaves
    the layer as a kernel of its own. o_proj and down_proj come back unrun (RowLinear); the
    add_rmsnorm after them runs the projection with the residual add in its epilogue, which
    writes the new residual stream and each program's sum of squares, and returns a PendingNorm;
    the qkv / gate_up projection that reads it normalises each K slice as it loads it, its RMS
    from those sums in a fixed order (deterministic; not the bits of the separate kernel, whose
    sum runs in another order). Where the GEMV does not serve a step (more than 16 tokens) each
    piece runs as before. Two kernels fewer per layer."""

    def __init__(self, base, on_cpu: bool = False, fuse_silu: bool = False, fuse_norm: bool = False,
                 fuse_rope: bool = False):
        self.base = base
        self.on_cpu = on_cpu
        self.fuse_silu = fuse_silu
        self.fuse_norm = fuse_norm
        self.fuse_rope = fuse_rope and base.name == "fused"   # the epilogue has fused.rope_store's bits
        self.name = (base.name + "+gemv" + ("+silu" if fuse_silu else "") + ("+norm" if fuse_norm else "")
                     + ("+rope" if self.fuse_rope else ""))

    def qkv_rope(self, x, weight, bias, heads, cos, sin, kv_layer, batch, backend):
        """fuse_rope: the qkv GEMV writes RoPE(q) and the caches itself where it serves the step
        (reading a PendingNorm's stream normalised, too); otherwise projection, then rope_store."""
        rows = x.r if isinstance(x, PendingNorm) else x
        d = heads[2]
        if (self.fuse_rope and rows.dim() == 2 and d >= 16 and not d & (d - 1)
                and _serves(rows, weight, bias, self.on_cpu) and rope_keeps_bits(rows, weight)):
            k_cache, v_cache = kv_layer
            return gemv(rows, weight, bias, norm=x.norm if isinstance(x, PendingNorm) else None,
                        rope=RopeStore(cos, sin, k_cache, v_cache, batch.slot_mapping, *heads))
        return qkv_rope_store(self, x, weight, bias, heads, cos, sin, kv_layer, batch, backend)

    def row_linear(self, x, weight):
        if self.fuse_norm and x.dim() == 2 and _serves(x, weight, None, self.on_cpu):
            return RowLinear(x, weight)
        return self.linear(x, weight)

    def add_rmsnorm(self, x, residual, norm):
        if isinstance(x, RowLinear):
            if residual is not None and residual.shape == x.shape and residual.dtype == x.x.dtype == norm.weight.dtype:
                r, sums = gemv(x.x, x.weight, residual=residual)
                return PendingNorm(r, NormInput(sums, norm.weight, norm.eps)), r
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
                return gemv(x.r, weight, bias, norm=x.norm)
            x = self.resolve(x)
        return linear(x, weight, bias, on_cpu=self.on_cpu)

    def gate_up_silu(self, x, weight, bias=None):
        if self.fuse_silu and weight.shape[0] % 2 == 0:
            if isinstance(x, PendingNorm) and _serves(x.r, weight, bias, self.on_cpu):
                return gemv(x.r, weight, bias, epilogue="silu_mul", norm=x.norm)
            if not isinstance(x, PendingNorm) and _serves(x, weight, bias, self.on_cpu):
                return _on_rows(x, weight, bias, epilogue="silu_mul")
        return self.base.silu_mul(self.linear(x, weight, bias))
