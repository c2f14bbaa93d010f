"""Fused elementwise kernels of the decoder layer: the GPU path of LlamaModel (models/llama.py keeps
the torch path, which the CPU runs and these are tested against).

At decode and verify sizes a layer's time outside its four GEMMs is kernel count, not bytes: each
small kernel costs ~2 us of launch, ramp-up and tail even inside a CUDA graph (H200 measurements of
the torch path: 2.1-2.3 us per kernel for all three draft shapes). The torch path launches 37 per
bf16 layer (RMSNorm alone is 8, RoPE of q and k 10); with these, 10 (4 GEMMs, 2 attention):
- add_rmsnorm: residual + x and the RMSNorm of the sum in one pass (both outputs written);
- rope_store: RoPE of q and k, with k and v written straight into their paged KV slots;
- silu_mul: SiLU(gate) * up read from the fused gate_up projection.
add_rmsnorm and silu_mul round to the model dtype wherever the torch (and Hugging Face) path does,
so in bf16 they agree with it except for reduction order and exp/rsqrt approximations; rope_store
rounds once per output (half an ulp of the exact rotation, where torch's path is within one).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels import pdl
from specdec.models.llama import TorchLayerOps


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Out, ResOut, n_cols, eps,
                        stride_x, stride_r, stride_o, stride_ro,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        # The residual stream lives in the model dtype: round the sum there, as torch's `r + x` does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    # HF order: normalise in fp32, cast to the input dtype, then multiply by the weight.
    y = (xf * inv_rms).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (y * w).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_half(x1, x2, c, s, DTYPE: tl.constexpr):
    """(x1, x2) halves -> (x1 c - x2 s, x2 c + x1 s) in fp32, rounded to DTYPE once. The torch path
    (x * cos + rotate_half(x) * sin) rounds each product to the dtype as well; where the two products
    cancel, that extra rounding moves its result by up to 1 ulp from the exact value, this one by at
    most half an ulp (plus fp32's). A version that rounded the products like torch still differed
    from torch in 10-13% of bf16 elements on the H200 (cause not pinned down), so exact agreement
    was not to be had; the test holds this one to 1 ulp of a float64 reference instead."""
    return (x1 * c - x2 * s).to(DTYPE), (x2 * c + x1 * s).to(DTYPE)


@triton.jit
def _rope_store_kernel(Q, K, V, Cos, Sin, QOut, KCache, VCache, Slots, num_heads, num_kv_heads,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_ct, stride_st, stride_ot, stride_oh,
                       stride_kb, stride_ks, stride_kvh, stride_vb, stride_vs, stride_vvh,
                       PAGE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                       HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, USE_PDL: tl.constexpr,
                       EARLY_LOADS: tl.constexpr):
    if not EARLY_LOADS:
        pdl.enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    # cos/sin rows are [D/2] or [D] (the [D/2] frequencies twice): read the first D/2. The torch path
    # rounds them to the model dtype before use; so does this (a no-op when they come in that dtype).
    c = tl.load(Cos + t * stride_ct + offs_d, mask=d_ok, other=0.0)
    s = tl.load(Sin + t * stride_st + offs_d, mask=d_ok, other=0.0)
    c = c.to(Q.dtype.element_ty).to(tl.float32)[None, :]
    s = s.to(Q.dtype.element_ty).to(tl.float32)[None, :]
    slot = tl.load(Slots + t)
    if EARLY_LOADS:  # cos / sin and slots are never the qkv projection's output (pdl.EARLY_LOADS)
        pdl.enter(USE_PDL)

    hq = tl.arange(0, HQ_PAD)
    q_mask = (hq[:, None] < num_heads) & d_ok[None, :]
    q_ptr = Q + t * stride_qt + hq[:, None] * stride_qh + offs_d[None, :]
    q1 = tl.load(q_ptr, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=q_mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate_half(q1, q2, c, s, Q.dtype.element_ty)
    o_ptr = QOut + t * stride_ot + hq[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, o1, mask=q_mask)
    tl.store(o_ptr + HALF, o2, mask=q_mask)

    if slot >= 0:  # negative: a CUDA-graph padding token, which owns no KV slot
        hk = tl.arange(0, HK_PAD)
        k_mask = (hk[:, None] < num_kv_heads) & d_ok[None, :]
        k_ptr = K + t * stride_kt + hk[:, None] * stride_kh + offs_d[None, :]
        k1 = tl.load(k_ptr, mask=k_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_ptr + HALF, mask=k_mask, other=0.0).to(tl.float32)
        r1, r2 = _rotate_half(k1, k2, c, s, K.dtype.element_ty)
        page = slot // PAGE
        off = slot % PAGE
        kc_ptr = KCache + page * stride_kb + off * stride_ks + hk[:, None] * stride_kvh + offs_d[None, :]
        tl.store(kc_ptr, r1.to(KCache.dtype.element_ty), mask=k_mask)
        tl.store(kc_ptr + HALF, r2.to(KCache.dtype.element_ty), mask=k_mask)
        v_ptr = V + t * stride_vt + hk[:, None] * stride_vh + offs_d[None, :]
        vc_ptr = VCache + page * stride_vb + off * stride_vs + hk[:, None] * stride_vvh + offs_d[None, :]
        v1 = tl.load(v_ptr, mask=k_mask, other=0.0)
        v2 = tl.load(v_ptr + HALF, mask=k_mask, other=0.0)
        tl.store(vc_ptr, v1.to(VCache.dtype.element_ty), mask=k_mask)
        tl.store(vc_ptr + HALF, v2.to(VCache.dtype.element_ty), mask=k_mask)


@triton.jit
def _silu_mul_kernel(GateUp, Out, inter, stride_g, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds its result to the dtype before the product with up, so round here too.
    act = (g / (1.0 + tl.exp(-g))).to(GateUp.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * u).to(Out.dtype.element_ty), mask=mask)


def _row_warps(block: int) -> int:
    return max(1, min(8, block // 256))


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, N]. Returns (RMSNorm(residual + x) * weight, residual + x); with no residual,
    (RMSNorm(x) * weight, x)."""
    if x.dim() != 2 or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rmsnorm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rmsnorm: residual {tuple(residual.shape)} is not x's {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, n = x.shape
    out = torch.empty((t, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = x if residual is None else torch.empty_like(x)
    if t == 0:
        return out, res_out
    r = x if residual is None else residual
    if r.stride(-1) != 1:
        r = r.contiguous()
    block = triton.next_power_of_2(n)
    _add_rmsnorm_kernel[(t,)](
        x, r, weight, out, res_out, n, eps, x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
        HAS_RES=residual is not None, BLOCK=block, num_warps=_row_warps(block),
        **pdl.options(x.device))
    return out, res_out


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q: [T, H, D], k, v: [T, Hkv, D] (views of the qkv projection are fine); cos, sin: [T, D] or
    [T, D/2] (Rotary.cos_sin or cos_sin_half);
    caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] flat slots, negative = no store.
    Writes RoPE(k) and v into the caches and returns RoPE(q) as a new [T, H, D] tensor."""
    t, h, d = q.shape
    hkv = k.shape[1]
    if (d % 2 or k.shape != (t, hkv, d) or v.shape != k.shape or tuple(cos.shape) not in ((t, d), (t, d // 2))
            or sin.shape != cos.shape):
        raise ValueError(f"rope_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cos {tuple(cos.shape)} do not fit")
    if k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"rope_store: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold "
                         f"[blocks, block_size, {hkv}, {d}]")
    q, k, v, cos, sin = (a if a.stride(-1) == 1 else a.contiguous() for a in (q, k, v, cos, sin))
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_store: KV caches need a contiguous head_dim")
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    half = d // 2
    hq_pad = triton.next_power_of_2(h)
    _rope_store_kernel[(t,)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping, h, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE=k_cache.shape[1], HALF=half, HALF_PAD=triton.next_power_of_2(half), HQ_PAD=hq_pad,
        HK_PAD=triton.next_power_of_2(hkv), num_warps=_row_warps(hq_pad * triton.next_power_of_2(half)),
        EARLY_LOADS=pdl.EARLY_LOADS, **pdl.options(q.device))
    return q_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate columns first). Returns SiLU(gate) * up, [T, I]."""
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"silu_mul: gate_up width {two_i} is odd")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=_row_warps(block),
        **pdl.options(gate_up.device))
    return out


class FusedLayerOps(TorchLayerOps):
    """The decoder layer's elementwise steps on the kernels above (TorchLayerOps in models/llama.py
    is the contract; linear and gate_up_silu, built on linear and silu_mul, are its own). The KV
    store is part of rope_store, so the attention backend's own store is not called: both write the
    KVCache layout [blocks, block_size, Hkv, D]."""

    name = "fused"

    @staticmethod
    def cos_sin(rotary, positions, dtype):
        return rotary.cos_sin_half(positions)                                # [T, D/2] fp32 each

    @staticmethod
    def add_rmsnorm(x, residual, norm):
        return add_rmsnorm(x, residual, norm.weight, norm.eps)

    @staticmethod
    def rope_store(q, k, v, cos, sin, kv_layer, batch, backend):
        k_cache, v_cache = kv_layer
        return rope_store(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping)

    @staticmethod
    def silu_mul(gate_up):
        return silu_mul(gate_up)
