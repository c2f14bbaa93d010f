"""Fused sampling: temperature, top-k, top-p, min-p, softmax, rounding to the transport dtype and the
inverse-CDF draw of one row in one Triton program (the GPU path of sampling/probs.py and draft.py).

Why. In torch a sampled draft position is ~77 small kernels (a vocabulary sort, softmax, masks, a
float64 cumsum, searchsorted, ...): 191 us of graph replay at batch 1 on an H200 with 32k ids and
top-k 50, 321 us at batch 8, more than the 68m draft's forward. This kernel: 76 us at both
(bench/results/sampling.json). And top-p's float32 cumsum over a batch rounds a row differently
with the row count, so a padded CUDA graph and an eager call disagreed (4 of 300 random cases in
tests/gpu/test_sampling_graphs_gpu.py, session 9). Here one program owns one row, so a row's bits
never depend on its neighbours.

Cost. A pass over a 32k row is ~36 instructions per id for a search pass, and one SM issues 128
lanes per cycle: ~5 us per pass, whatever the chunk (bench/sampling.py --sweep). Temperature alone
is 4 passes (20 us); top-k adds ~6 search passes, top-p ~6 more. Fewer passes (a radix select with
histograms) or several programs per row would be the next steps.

Semantics (Hugging Face's order: temperature, top-k, top-p, min-p), with every threshold a key:
- x = logit * (1 / temperature) in float32; keys order x as integers (`_order_key`).
- top-k keeps x >= the k-th largest x (ties at it kept, as probs.logits_to_probs does).
- top-p keeps x whose strictly-larger mass is < top_p of the top-k mass (the first token is always
  kept; ties at the boundary all kept, where the sort-based torch path keeps an arbitrary subset).
- min-p keeps e = exp(x - max) >= min_p (p >= min_p * max p), then one softmax over the kept set.
- Greedy rows: one-hot at the argmax of the logits (first index on ties), token = argmax.
- Non-finite logits: NaN reads as -inf, +inf (or logit / T overflowing) as the largest float32; a
  row with no finite logit takes id 0 one-hot. (torch.argmax would pick a NaN's index.)
Both thresholds are found by a search on the keys (`_search`): each pass over the row counts G(t),
the weight above 7 pivots, and snaps the bracket to the keys present in it; no sort.

Exactness of the draw (what makes speculative sampling lossless). The row is rounded to the
transport dtype first and stored; the draw reads the stored weights back as integers (fp16 weights
are multiples of 2**-24, flushed bf16 ones of 2**-47), so the running sums are exact and the token
is the first id whose integer prefix sum exceeds floor(u * total): a token of zero weight is never
drawn, and the probability of id i is w_i / total up to the float64 rounding of u * total.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The GPU path of probs.logits_to_probs and draft.draft_sample (SPECDEC_FUSED_SAMPLING=0, or
# set_enabled(False), keeps torch's ops on CUDA too: the A/B switch of bench/sampling.py and e2e.py).
ENABLED = os.environ.get("SPECDEC_FUSED_SAMPLING", "1") != "0"
MODE_FP16, MODE_BF16, MODE_PROBS = 0, 1, 2
_MODES = {torch.float16: MODE_FP16, torch.bfloat16: MODE_BF16}
CHUNK = 4096      # ids per step of a pass (tuning: bench/sampling.py --sweep)
NUM_WARPS = 16


def set_enabled(enabled: bool) -> None:
    global ENABLED
    ENABLED = bool(enabled)


def applies(device: torch.device | str) -> bool:
    """Whether sampling of tensors on this device takes the fused kernel."""
    return ENABLED and torch.device(device).type == "cuda"


@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (-0.0 must be canonicalised to +0.0 before)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _load_x(row, offs, V, inv_t):
    """x = logit / T with non-finite values made harmless: NaN reads as -inf (never kept),
    +inf (or an overflow of logit / T) as the largest float32, so the max, exp(x - max) and every
    sum stay finite; -0.0 reads as +0.0 (one key per value)."""
    ok = offs < V
    x = tl.load(row + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t + 0.0
    x = tl.where(x == x, x, float("-inf"))
    return tl.minimum(x, 3.4028234663852886e38), ok


@triton.jit
def _exp(x, m):
    """e = exp(x - m), the unnormalised weight of every rule and sum here."""
    return tl.exp2((x - m) * 1.4426950408889634)


@triton.jit
def _key_value(k):
    """_order_key's inverse: int64 key -> float32."""
    b = k.to(tl.int32)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.float32, bitcast=True)


@triton.jit
def _pivot(lo, hi, vlo, vhi, j: tl.constexpr):
    """The j-th of 6 pivots evenly spaced in value over (lo, hi] (values spread where the keys
    are; in simulation 5.7 passes against 7.3 for pivots evenly spaced in key), kept inside."""
    v = vlo + (vhi - vlo) * (j / 7.0)
    return tl.minimum(tl.maximum(_order_key(v + 0.0).to(tl.int64), lo + 1), hi - 1).to(tl.int32)


@triton.jit
def _narrow(lo, hi, g, piv, c):
    """A pivot whose weight above is still >= c raises lo, one below c lowers hi."""
    return tl.where(g >= c, tl.maximum(lo, piv.to(tl.int64)), lo), tl.where(g < c, tl.minimum(hi, piv.to(tl.int64)), hi)


@triton.jit
def _search(row, V, inv_t, m, c, lo, hi, MASS: tl.constexpr, CHUNK: tl.constexpr):
    """The smallest key kappa present in the row with G(kappa) < c, where G(t) sums w over the
    keys > t, w = 1 (counts, MASS False) or e = exp(x - m) (MASS True). For top-p after top-k, c is
    top_p times the kept mass; the tokens top-k dropped need no mask here, since they lie below
    every key where the answer can exceed top-k's own threshold.
    Needs G(lo) >= c > G(hi) (int64 bounds). Each pass narrows (lo, hi] to the keys present in it
    and splits it at 7 pivots (6 in value, the key midpoint). Every thread accumulates its own lanes across the chunks (1-D, one
    per pivot: a [CHUNK, pivots] tile cost a layout shuffle per chunk) and the lanes are reduced
    once per pass; each pivot's sum runs in the same order whatever its value, so G is a function
    of t, monotone, and the loop ends."""
    passes = 0
    while (hi - lo > 1) & (passes < 64):   # <= 32 with finite sums (the midpoint); 64 is a backstop
        passes += 1
        vlo = _key_value(lo + 1)
        vhi = _key_value(hi)
        p1 = _pivot(lo, hi, vlo, vhi, 1)
        p2 = _pivot(lo, hi, vlo, vhi, 2)
        p3 = _pivot(lo, hi, vlo, vhi, 3)
        p4 = _pivot(lo, hi, vlo, vhi, 4)
        p5 = _pivot(lo, hi, vlo, vhi, 5)
        p6 = _pivot(lo, hi, vlo, vhi, 6)
        p7 = (lo + (hi - lo) // 2).to(tl.int32)   # the key midpoint: at most 32 passes whatever the values
        lo32 = lo.to(tl.int32)
        hi32 = hi.to(tl.int32)
        g1 = tl.zeros([CHUNK], dtype=tl.float32)
        g2 = tl.zeros([CHUNK], dtype=tl.float32)
        g3 = tl.zeros([CHUNK], dtype=tl.float32)
        g4 = tl.zeros([CHUNK], dtype=tl.float32)
        g5 = tl.zeros([CHUNK], dtype=tl.float32)
        g6 = tl.zeros([CHUNK], dtype=tl.float32)
        g7 = tl.zeros([CHUNK], dtype=tl.float32)
        kmin = tl.full([CHUNK], 0, tl.int32) + hi32
        kmax = tl.full([CHUNK], 0, tl.int32) + lo32
        for start in range(0, V, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            x, ok = _load_x(row, offs, V, inv_t)
            key = _order_key(x)
            if MASS:
                w = tl.where(ok, _exp(x, m), 0.0)
            else:
                w = tl.where(ok, 1.0, 0.0)
            g1 += tl.where(key > p1, w, 0.0)
            g2 += tl.where(key > p2, w, 0.0)
            g3 += tl.where(key > p3, w, 0.0)
            g4 += tl.where(key > p4, w, 0.0)
            g5 += tl.where(key > p5, w, 0.0)
            g6 += tl.where(key > p6, w, 0.0)
            g7 += tl.where(key > p7, w, 0.0)
            inside = ok & (key > lo32) & (key <= hi32)
            kmin = tl.minimum(kmin, tl.where(inside, key, hi32))
            kmax = tl.maximum(kmax, tl.where(inside, key, lo32))
        # No key lies in (lo, kmin) or (kmax, hi]: G is constant there, so the bracket snaps.
        lo = tl.min(kmin, 0).to(tl.int64) - 1
        hi = tl.max(kmax, 0).to(tl.int64)
        lo, hi = _narrow(lo, hi, tl.sum(g1, 0), p1, c)
        lo, hi = _narrow(lo, hi, tl.sum(g2, 0), p2, c)
        lo, hi = _narrow(lo, hi, tl.sum(g3, 0), p3, c)
        lo, hi = _narrow(lo, hi, tl.sum(g4, 0), p4, c)
        lo, hi = _narrow(lo, hi, tl.sum(g5, 0), p5, c)
        lo, hi = _narrow(lo, hi, tl.sum(g6, 0), p6, c)
        lo, hi = _narrow(lo, hi, tl.sum(g7, 0), p7, c)
    return hi.to(tl.int32)


@triton.jit
def _units(w, MODE: tl.constexpr):
    """Transport weights as exact integers: fp16 ones are multiples of 2**-24, flushed bf16 of 2**-47."""
    if MODE == 0:
        return (w.to(tl.float32) * 16777216.0).to(tl.int64)
    else:
        return (w.to(tl.float32) * 140737488355328.0).to(tl.int64)


@triton.jit
def _stored_units(out, start, V, MODE: tl.constexpr, CHUNK: tl.constexpr):
    """The chunk at `start` of the weights just stored, as exact integers (0 past V)."""
    offs = start + tl.arange(0, CHUNK)
    return _units(tl.load(out + offs, mask=offs < V, other=0.0), MODE)


@triton.jit
def _sample_kernel(Logits, stride_l, Temp, TopK, TopP, MinP, Greedy, U,
                   Out, stride_os, stride_or, Tok, stride_ts, Step, V,
                   MODE: tl.constexpr, HAS_STEP: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0)
    row = Logits + r.to(tl.int64) * stride_l
    if HAS_STEP:
        s = tl.load(Step).to(tl.int64)
    else:
        s = 0
    out = Out + s * stride_os + r.to(tl.int64) * stride_or
    greedy = tl.load(Greedy + r) != 0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.load(Temp + r).to(tl.float32))

    # Pass 1: max, first index of the max (per lane, then across lanes), smallest key.
    mx = tl.full([CHUNK], float("-inf"), tl.float32)
    ix = tl.full([CHUNK], 0, tl.int32) + V
    kmn = tl.full([CHUNK], 0x7FFFFFFF, tl.int32)
    for start in range(0, V, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        x, ok = _load_x(row, offs, V, inv_t)
        better = x > mx
        ix = tl.where(better, offs, ix)
        mx = tl.where(better, x, mx)
        kmn = tl.minimum(kmn, tl.where(ok, _order_key(x), 0x7FFFFFFF))
    m = tl.max(mx, 0)
    arg = tl.minimum(tl.min(tl.where(mx == m, ix, V), 0), V - 1)
    kfirst = tl.min(kmn, 0)
    # A row with no finite logit (all -inf or NaN) has no distribution: it takes id 0, one-hot.
    no_mass = m == float("-inf")
    arg = tl.where(no_mass, 0, arg)
    greedy = greedy | no_mass

    if greedy:
        for start in range(0, V, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            tl.store(out + offs, tl.where(offs == arg, 1.0, 0.0).to(out.dtype.element_ty), mask=offs < V)
        if MODE != 2:
            tl.store(Tok + s * stride_ts + r, arg.to(tl.int64))
    else:
        kmax_key = _order_key(m).to(tl.int64)
        lo0 = kfirst.to(tl.int64) - 1
        tau = kfirst
        k = tl.load(TopK + r)
        if (k > 0) & (k < V):
            tau = _search(row, V, inv_t, m, k.to(tl.float32), lo0, kmax_key, False, CHUNK)
        top_p = tl.load(TopP + r)
        if top_p < 1.0:
            zk = tl.zeros([CHUNK], dtype=tl.float32)
            for start in range(0, V, CHUNK):
                offs = start + tl.arange(0, CHUNK)
                x, ok = _load_x(row, offs, V, inv_t)
                zk += tl.where(ok & (_order_key(x) >= tau), _exp(x, m), 0.0)
            tau = tl.maximum(tau, _search(row, V, inv_t, m, top_p * tl.sum(zk, 0), lo0, kmax_key, True, CHUNK))
        min_p = tl.load(MinP + r).to(tl.float32)

        za = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, V, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            x, ok = _load_x(row, offs, V, inv_t)
            e = _exp(x, m)
            za += tl.where(ok & (_order_key(x) >= tau) & (e >= min_p), e, 0.0)
        z = tl.sum(za, 0)
        tot = tl.zeros([CHUNK], dtype=tl.int64)
        for start in range(0, V, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            x, ok = _load_x(row, offs, V, inv_t)
            e = _exp(x, m)
            p = tl.where(ok & (_order_key(x) >= tau) & (e >= min_p), e / z, 0.0)
            if MODE == 0:
                w = p.to(tl.float16)
                tot += _units(w, MODE)
                tl.store(out + offs, w, mask=ok)
            elif MODE == 1:
                w = p.to(tl.bfloat16).to(tl.float32)
                w = tl.where(w < 9.094947017729282e-13, 0.0, w)      # 2**-40: the flush of round_probs
                tot += _units(w, MODE)
                tl.store(out + offs, w.to(tl.bfloat16), mask=ok)
            else:
                tl.store(out + offs, p, mask=ok)
        if MODE != 2:
            # The draw reads back the weights just stored (the same bits the target decodes), in
            # id order, and stops at the chunk where the prefix sum passes the target.
            tl.debug_barrier()
            total = tl.sum(tot, 0)
            u = tl.load(U + r)
            target = tl.minimum((u * total.to(tl.float64)).to(tl.int64), total - 1)
            # Whole chunks below the target first (one reduction each), then one scan of the
            # chunk where the prefix sum passes it.
            run = tl.full([], 0, tl.int64)
            start = 0
            crossed = 0
            while (start < V) & (crossed == 0):
                n = _stored_units(out, start, V, MODE, CHUNK)
                chunk = tl.sum(n, 0)
                if run + chunk > target:
                    crossed = 1
                else:
                    run += chunk
                    start += CHUNK
            n = _stored_units(out, start, V, MODE, CHUNK)
            tok = tl.minimum(start + tl.sum((run + tl.cumsum(n, 0) <= target).to(tl.int32), 0), V - 1)
            tl.store(Tok + s * stride_ts + r, tok.to(tl.int64))


def _launch(logits, temperature, top_k, top_p, min_p, greedy, u, out, tok, step, mode, config=None):
    rows, v = logits.shape
    if rows == 0:
        return
    if logits.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("fused sampling: the vocabulary dimension must be contiguous")
    chunk, warps = (config or {}).get("CHUNK", CHUNK), (config or {}).get("num_warps", NUM_WARPS)
    has_step = step is not None
    if out.dim() == 3:   # [steps, rows, V] with the step read on the device
        stride_os, stride_or = out.stride(0), out.stride(1)
    else:
        stride_os, stride_or = 0, out.stride(0)
    stride_ts = tok.stride(0) if tok is not None and tok.dim() == 2 else 0
    dummy = greedy   # never read: no uniforms or tokens in probs mode, no step without one
    _sample_kernel[(rows,)](
        logits, logits.stride(0), temperature, top_k, top_p, min_p, greedy,
        u if u is not None else dummy, out, stride_os, stride_or,
        tok if tok is not None else dummy, stride_ts, step if has_step else dummy, v,
        MODE=mode, HAS_STEP=has_step, CHUNK=chunk, num_warps=warps)


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, greedy: torch.Tensor, u: torch.Tensor, q_out: torch.Tensor,
                 tok_out: torch.Tensor, step: torch.Tensor | None = None, config: dict | None = None) -> None:
    """Rows of logits [R, V] -> tokens into tok_out [R] and transport-dtype weights into q_out [R, V]
    (fp16 or bf16). With step (a device int64 scalar tensor), q_out is [S, R, V] and tok_out [S, R],
    and row `step` is written: a CUDA graph's position index. Per-row params: temperature [R] f32,
    top_k [R] i64 (0 = off), top_p [R] f32 (1 = off), min_p [R] f32 (0 = off), greedy [R] bool,
    u [R] float64 uniforms. config: {"CHUNK", "num_warps"} overrides (tuning)."""
    if q_out.dtype not in _MODES:
        raise ValueError(f"fused_sample: q_out must be float16 or bfloat16, got {q_out.dtype}")
    _launch(logits, temperature, top_k, top_p, min_p, greedy, u, q_out, tok_out, step, _MODES[q_out.dtype], config)


def fused_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, greedy: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of logits [R, V] -> float32 probabilities [R, V] after the filters (no rounding, no draw)."""
    if out is None:
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    _launch(logits, temperature, top_k, top_p, min_p, greedy, None, out, None, None, MODE_PROBS)
    return out
