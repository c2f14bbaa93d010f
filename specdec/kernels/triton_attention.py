"""Triton paged attention over a flat varlen batch (decode, k+1 verification, prefill chunks) and the
KV-store kernel that writes new K/V into their paged slots. The GPU path of the runner; the torch
reference in reference.py is the CPU path and the oracle.

Design (notes/attention.md has the numbers):
- One program owns (sequence, KV head, query tile, KV split). Its BLOCK_M rows are the query tile's
  tokens x the G = H / Hkv query heads sharing that KV head, so each K/V tile is read once per
  group of heads and tokens: decode and verification are reads of the KV cache and little else.
- Keys that every row of the tile may see are streamed without masks; only the tail that the causal
  mask cuts (the tile's own new tokens) runs the masked loop.
- Split-KV (flash-decoding): when batch x KV heads x query tiles cannot fill the GPU, each program
  covers 1/S of the keys and writes an unnormalised partial (o, log-sum-exp); a second kernel merges
  them, or (merge="inline") the last split of each query tile to arrive, counted by an atomic, does.
  Tiles of fewer than 16 rows (a config override: BLOCK_M < 16) use CUDA-core products, not tl.dot.
  The grid depends only on (batch, KV heads, max query len, S), all host values a CUDA-graph
  bucket fixes; nothing in here reads device memory on the host.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from specdec.kernels import pdl
from specdec.kernels.counters import arrival_counters
from specdec.kernels.switch import Switch

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 128   # below this a split's reads no longer pay for its partial write + merge
# (H200, B=1 ctx 1024 q 8, 32 heads: 8 splits of 128 keys 18.4 us, 4 of 256 22.5 us)
MAX_SPLITS = 64
# Load each KV tile's page indices one tile ahead (see the kernel), for tiles of at most
# PAGE_AHEAD_MAX_BLOCK_N keys. H200, 98 cases in one run (bench/README.md, session 5): with 64-key
# tiles 3-14% faster (short streams, split-KV, batch 1); with 128-key tiles (>= LONG_KEYS keys per
# program) 12-20% slower, so those keep the page load in the tile's own iteration.
# SPECDEC_ATTN_PAGE_AHEAD=0 or set_page_ahead(False) switches it off (read at launch; graphs keep
# what they captured).
PAGE_AHEAD = os.environ.get("SPECDEC_ATTN_PAGE_AHEAD", "1") != "0"
PAGE_AHEAD_MAX_BLOCK_N = 64


def set_page_ahead(enabled: bool) -> None:
    global PAGE_AHEAD
    PAGE_AHEAD = bool(enabled)


# Grid order. Heads first: CUDA starts blocks in x order, so the programs running at one time are
# the KV heads of a few sequences, whose key rows for one position are adjacent in a page (a page
# is [block_size, Hkv, D]: one head's row is D elements, the position's rows of all heads are
# contiguous). Sequences first: they are one head of many sequences, 256 B reads Hkv x D apart.
# SPECDEC_ATTN_HEADS_FIRST=0 or set_heads_first(False): sequences first (read at launch).
HEADS_FIRST = os.environ.get("SPECDEC_ATTN_HEADS_FIRST", "1") != "0"


def set_heads_first(enabled: bool) -> None:
    global HEADS_FIRST
    HEADS_FIRST = bool(enabled)


# Warps of the separate split merge. One program merges one (token, head)'s S partials of D_PAD
# floats. With 4 warps Triton lays the [S_PAD, D_PAD] tile out with the splits across the warps, so
# the sum over splits goes through shared memory and a barrier; with one warp it stays in registers.
# H200, attention + merge in a graph, PDL on (bench/results/logs/s26/merge_exp_call1_h200.log): the
# merge's marginal time after the attention at S = 8 was 2.2 us with 4 warps and 0.96 with 1 (7B
# b 1 ctx 384), 3.6 and 1.3 (7B b 8); with 1 warp 0.8-1.3 us at every S from 2 to 30 measured.
# In the servers' 4096 graphs at ctx 384 (H100, timeline.py, logs/s26/merge_call3_*): the 7B b 1
# forward 4995 vs 5073 us, llama-160m b 8 407 vs 422, TinyLlama b 1 1060 vs 1068.
# A warp takes up to MERGE_ELEMS_PER_WARP partial elements (64 a thread), larger merges get more
# warps (at most 4). merge_warps.forced(n) fixes the count for A/B runs (0: by size).
MERGE_ELEMS_PER_WARP = 2048


def _check_warps(n: int) -> int:
    if isinstance(n, bool) or n not in (0, 1, 2, 4, 8):
        raise ValueError(f"merge warps must be 0 (by size), 1, 2, 4 or 8, not {n!r}")
    return n


merge_warps: Switch[int] = Switch(0, _check_warps)


def merge_num_warps(num_splits: int, d_pad: int) -> int:
    if merge_warps.value:
        return merge_warps.value
    return min(4, max(1, triton.next_power_of_2(num_splits) * d_pad // MERGE_ELEMS_PER_WARP))


@triton.jit
def _tile_pages(bt_row, start, kv_len, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The KV page of each key of the tile at `start` (0 past kv_len)."""
    keys = start + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + keys // PAGE, mask=keys < kv_len, other=0).to(tl.int64)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, K, V, bt_row, kv_off_k, kv_off_v, start, kv_len, pos, scale_log2,
                 stride_kb, stride_ks, stride_vb, stride_vs, ahead,
                 PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr,
                 DOT: tl.constexpr, PAGE_AHEAD: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    keys = start + offs_n
    if PAGE_AHEAD:  # the caller loaded this tile's pages one tile earlier (`ahead`)
        page = ahead
    elif MASKED:
        page = tl.load(bt_row + keys // PAGE, mask=keys < kv_len, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + keys // PAGE).to(tl.int64)
    slot = keys % PAGE
    if DOT:  # K as [D, N], the dot's right operand
        k_ptrs = K + kv_off_k + page[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None]
        k_ok = (keys[None, :] < kv_len) & (offs_d[:, None] < HEAD_DIM)
        k_d_ok = offs_d[:, None] < HEAD_DIM
    else:    # K as [N, D] rows, like V
        k_ptrs = K + kv_off_k + page[:, None] * stride_kb + slot[:, None] * stride_ks + offs_d[None, :]
        k_ok = (keys[:, None] < kv_len) & (offs_d[None, :] < HEAD_DIM)
        k_d_ok = offs_d[None, :] < HEAD_DIM
    v_ptrs = V + kv_off_v + page[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :]
    if MASKED:
        # Padded keys past kv_len must read as 0, not whatever the (page 0) slot holds: 0 * NaN = NaN.
        k = tl.load(k_ptrs, mask=k_ok, other=0.0)
        v = tl.load(v_ptrs, mask=(keys[:, None] < kv_len) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == D_PAD:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=k_d_ok, other=0.0)
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    if not DOT:
        # Fewer than 16 rows (a q=1 GQA group): CUDA-core products in fp32, no padded MMA rows.
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale_log2                # [M, N]
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * scale_log2                  # [M, N]
    else:
        s = tl.dot(q, k) * scale_log2
    if MASKED:
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
    # m_i starts finite (-1e30), so a row with every key of this tile masked gets p = 0, not NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if not DOT:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    elif UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attend_keys(acc, m_i, l_i, q, K, V, bt_row, kv_off_k, kv_off_v, begin, end, kv_len, pos, scale_log2,
                 stride_kb, stride_ks, stride_vb, stride_vs, ahead,
                 PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr,
                 DOT: tl.constexpr, PAGE_AHEAD: tl.constexpr):
    """The key tiles from begin to end (one loop: one software pipeline), each tile's pages
    loaded one tile ahead with PAGE_AHEAD; returns the running state and the next pages."""
    for start in range(begin, end, BLOCK_N):
        nxt = _tile_pages(bt_row, start + BLOCK_N, kv_len, PAGE, BLOCK_N) if PAGE_AHEAD else 0
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, K, V, bt_row, kv_off_k, kv_off_v, start, kv_len,
                                     pos, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs, ahead,
                                     PAGE, HEAD_DIM, D_PAD, BLOCK_N, MASKED, UPCAST, DOT, PAGE_AHEAD)
        ahead = nxt
    return acc, m_i, l_i, ahead


@triton.jit
def _paged_attention_kernel(
        Q, K, V, Out, Part, Counters, BlockTables, ContextLens, QueryStart,
        scale_log2, num_heads, num_splits, lse_offset,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_bt,
        G: tl.constexpr, QT: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, INLINE_MERGE: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
        PAGE_AHEAD: tl.constexpr, HEADS_FIRST: tl.constexpr, EARLY_LOADS: tl.constexpr,
        ONE_LOOP: tl.constexpr = False):
    if not EARLY_LOADS:
        pdl.enter(USE_PDL)
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        seq = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    qtile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(QueryStart + seq)
    q_len = tl.load(QueryStart + seq + 1) - q_start
    ctx = tl.load(ContextLens + seq)
    t0 = qtile * QT
    first_pos = ctx - q_len                  # position of the sequence's first new token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    tok = t0 + offs_m // G                   # row -> (token of the sequence, head of the group)
    head = kvh * G + offs_m % G
    row_ok = (offs_m < QT * G) & (tok < q_len)
    kv_len = first_pos + tl.minimum(t0 + QT, q_len)   # keys the tile's last token sees
    pos = tl.minimum(first_pos + tok, kv_len - 1)     # padded rows clamp: no key past kv_len

    # This split's keys: whole BLOCK_N tiles, an even share of the tile's kv_len.
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, kv_len)
    # Keys < first_pos + t0 + 1 are visible to every row: no mask there (ONE_LOOP: masks on all).
    if ONE_LOOP:
        unmasked_end = lo
    else:
        unmasked_end = tl.minimum(tl.maximum((first_pos + t0 + 1) // BLOCK_N * BLOCK_N, lo), hi)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    # PAGE_AHEAD: each tile's page indices are loaded one tile earlier, so a tile's K/V addresses
    # never wait on a page-table read of the same iteration (both loops continue one chain).
    ahead = _tile_pages(bt_row, lo, kv_len, PAGE, BLOCK_N) if PAGE_AHEAD else 0
    if EARLY_LOADS:
        # Query starts, context lengths and page tables are never written by the kernel launched
        # just before this one (pdl.py: EARLY_LOADS), so they load while it still runs.
        pdl.enter(USE_PDL)
    if t0 >= q_len:  # the grid is sized by the longest query; shorter ones stop here
        return

    q_ptrs = Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST or BLOCK_M < 16:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_off_k = kvh * stride_kh
    kv_off_v = kvh * stride_vh
    if not ONE_LOOP:
        acc, m_i, l_i, ahead = _attend_keys(acc, m_i, l_i, q, K, V, bt_row, kv_off_k, kv_off_v, lo, unmasked_end,
                                            kv_len, pos, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
                                            ahead, PAGE, HEAD_DIM, D_PAD, BLOCK_N, False, UPCAST, BLOCK_M >= 16,
                                            PAGE_AHEAD)
    acc, m_i, l_i, ahead = _attend_keys(acc, m_i, l_i, q, K, V, bt_row, kv_off_k, kv_off_v, unmasked_end, hi,
                                        kv_len, pos, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
                                        ahead, PAGE, HEAD_DIM, D_PAD, BLOCK_N, True, UPCAST, BLOCK_M >= 16,
                                        PAGE_AHEAD)

    out = acc / tl.maximum(l_i, 1e-30)[:, None]       # l == 0 only where a split saw no visible key
    dmask = offs_d[None, :] < HEAD_DIM
    if SPLIT:
        row = ((q_start + tok) * num_heads + head) * num_splits + split
        tl.store(Part + row[:, None] * D_PAD + offs_d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(Part + lse_offset + row, lse, mask=row_ok)
        if INLINE_MERGE:
            # The last split of this (sequence, KV head, query tile) to finish merges all of them.
            # Release: the barrier orders every thread's partial stores before the one thread's
            # gpu-scope release atomic (release is cumulative); acquire: the last program's atomic
            # then the barrier order all its threads' partial loads after every other release.
            tl.debug_barrier()
            n_qtiles = tl.num_programs(2) // num_splits
            counter = Counters + (seq * num_kv_heads + kvh) * n_qtiles + qtile
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.debug_barrier()
                tl.store(counter, 0)    # every split has arrived: zero for the next call or replay
                out = _merge_rows(Part, lse_offset, ((q_start + tok) * num_heads + head) * num_splits,
                                  row_ok, num_splits, BLOCK_M, D_PAD)
                o_ptrs = (Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
                          + offs_d[None, :])
                tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dmask)
    else:
        o_ptrs = Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dmask)


@triton.jit
def _merge_rows(Part, lse_offset, row0, row_ok, num_splits, BLOCK_M: tl.constexpr,
                D_PAD: tl.constexpr):
    """Online merge of num_splits partials of BLOCK_M rows (row r's split s at row0[r] + s).
    Loads bypass L1 (.cg): the partials were written by other programs of this launch."""
    offs_d = tl.arange(0, D_PAD)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(Part + lse_offset + row0 + s, mask=row_ok, other=float("-inf"),
                      cache_modifier=".cg")
        o = tl.load(Part + (row0 + s)[:, None] * D_PAD + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)      # 0 for a split that saw no visible key (lse = -inf)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    return acc / tl.maximum(den, 1e-30)[:, None]


@triton.jit
def _merge_splits_kernel(Out, Part, num_heads, num_splits, lse_offset, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl.enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    row = (t * num_heads + h) * num_splits + offs_s
    s_ok = offs_s < num_splits
    lse = tl.load(Part + lse_offset + row, mask=s_ok, other=float("-inf"))  # [S]
    w = tl.math.exp2(lse - tl.max(lse, 0))   # split 0 holds key 0, which every query sees: max finite
    o = tl.load(Part + row[:, None] * D_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _store_kv_kernel(Kin, Vin, KC, VC, Slots, num_kv_heads,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                     H_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.enter(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:  # padded token of a CUDA-graph bucket: owns no slot
        return
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(Kin + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(Vin + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = KC + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = VC + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(VC.dtype.element_ty), mask=mask)


# --- host side --------------------------------------------------------------------------------
# Everything below runs on every eager call (a CUDA graph replays none of it), so the plan is a
# cached function of host ints and a split call makes one allocation.

SMEM_BUDGET = 200 * 1024   # of the H100/H200's 227 KiB per block: room for Triton's layout scratch
LONG_KEYS = 2048           # keys per program from which 128-key tiles win (H200 sweep, notes)
SLOTS_PER_SM = 2           # programs of the default tiles resident per SM (shared memory bound)
SPLIT_SLACK = 1.1          # take the fewest splits within 10% of the best modelled time
WIDE_32_ROW_KEYS = 512     # keys per program from which 32-row tiles take 128-key tiles
SMALL_SPLIT_KEYS = 256     # split programs with fewer keys than this, more than one per SM: small tiles
# small_split_tiles.forced(False): plans without that rule, for A/B runs (read when a plan is made).
small_split_tiles: Switch[bool] = Switch(True, bool)
# One loop over a program's keys, every tile through the masked path, instead of an unmasked loop
# and a second, masked one for the tiles the causal mask or kv_len cut. Two loops are two
# software pipelines: the masked tile's K/V loads are not in flight while the last unmasked tiles
# are consumed, and the second loop fills its pipeline from empty (a verify's last tile, and a
# decode's wherever kv_len is no multiple of BLOCK_N). single_key_loop.forced(False): the two
# loops, for A/B runs. Read at launch. Tiles of more than ONE_LOOP_MAX_M rows (prefill chunks,
# long GQA verifies) keep the two loops: there the masked path's work per tile shows (H200,
# call 3 of session 28: GQA b 64 ctx 8192 q 16, 64-row tiles, 635 vs 585 us).
single_key_loop: Switch[bool] = Switch(True, bool)
ONE_LOOP_MAX_M = 32


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # interpreter: fewer programs, and tests choose their splits explicitly
    return torch.cuda.get_device_properties(device).multi_processor_count


def _d_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot wants every dim >= 16


def tile_config(group: int, max_query_len: int, head_dim: int, keys_per_program: int = 0,
                elem_size: int = 2, programs: int = 0, num_sms: int = 0, num_splits: int = 1,
                small_split: bool = True) -> dict:
    """BLOCK_M (query rows = tokens x heads of a KV group), BLOCK_N (keys), warps, stages.

    Short queries stream the cache: a program with >= LONG_KEYS keys to read takes 128-key tiles
    (fewer loop trips and page-table loads per byte); short splits keep 64 (a deep pipeline of wide
    tiles is mostly fill and drain there). The first (BLOCK_N, stages) whose K/V stages and Q tile
    fit SMEM_BUDGET wins, so fp32 caches fall back to narrower tiles.

    Given the grid (programs, num_sms), short streams also mind occupancy (H200 tuning sweep of
    session 7, bench/README.md): where the default tile's SLOTS_PER_SM programs per SM would
    take two waves but four per SM fit in one, 16-row tiles take 32 keys (~53 KB of shared
    memory: four per SM) and run in one wave (GQA B=64 ctx 512 q=1: 40.1 us against 51.5);
    where every program has an SM to itself and at most 128 keys, one 128-key tile replaces a
    loop of two (B=1 ctx 512, 4-14% faster); and unsplit 32-row tiles with at least a program
    per SM take 128-key tiles (session 23: 10-15% faster at GQA ctx 512 q=8, B=32 and 64); and
    split programs of fewer than SMALL_SPLIT_KEYS keys, more of them than SMs, take 32-key 2-warp
    tiles (session 26; small_split=False leaves that rule out)."""
    d_pad = _d_pad(head_dim)
    rows = triton.next_power_of_2(max_query_len * group)
    floor_m = max(16, triton.next_power_of_2(group))   # tl.dot wants M >= 16; one token's heads fit
    if rows <= 64:
        block_m, warps = max(floor_m, rows), 4
    else:
        block_m, warps = max(floor_m, 128 if rows >= 256 else 64), 8 if rows >= 256 else 4
    if d_pad > 128:
        prefs = [(32, 2), (16, 2)]
    elif block_m <= 64 and keys_per_program >= LONG_KEYS:
        prefs = [(128, 3), (64, 3), (64, 2), (32, 2)]
    else:
        prefs = [(64, 3), (64, 2), (32, 2), (16, 2)]
    if programs and num_sms and d_pad <= 128 and 0 < keys_per_program < LONG_KEYS and block_m <= 32:
        if (small_split and num_splits > 1 and keys_per_program < SMALL_SPLIT_KEYS and programs > num_sms
                and elem_size <= 2):
            # Short splits, more programs than SMs: 32-key tiles at 2 warps (~57 KB of shared
            # memory), so an SM runs more programs at once and each program's fixed latency (its
            # metadata -> page table -> K/V chain) overlaps more others'. H200, session 25: MHA B=1
            # ctx 1024 q 8 (8 splits of 128 keys) 16.6 -> 15.6 us, GQA B=8 ctx 512 16.3-22.7 ->
            # 15.5-21.5. Session 26 (one-warp merge, side by side): the latency case 15.39 -> 15.04
            # us. In the servers' graphs (132 SMs) it changes: llama-160m / 68m at b 1 in the 4096
            # graphs (20 splits of 205 keys; forward 293 -> 290 us) and at b 8 / 32 in the 256
            # graphs (2 of 128; b 8 347 vs 346 us, within noise), the 7B at b 4 and TinyLlama at
            # b 32 in the 256 graphs, TinyLlama at b 2 in the 4096 graphs (the last three not yet
            # timed in a forward). Session 25's companion rule, twice the splits from 256 keys a
            # split with these tiles, lost in the forward (bench/README.md).
            return dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=2, num_stages=3)
        if keys_per_program <= 128 and programs <= num_sms:
            prefs = [(128, 2)] + prefs
        elif SLOTS_PER_SM * num_sms < programs <= 4 * num_sms and block_m <= 16:
            # (32-row tiles do not fit four per SM: GQA B=64 ctx 512 q=8 took 64.3 us, not 54.8)
            prefs = [(32, 3)] + prefs
        elif (block_m == 32 and num_splits == 1 and programs >= num_sms
              and keys_per_program >= WIDE_32_ROW_KEYS):
            # Unsplit 32-row tiles (a GQA group of 4 x 5-8 verified tokens), a program per SM or
            # more: 128-key tiles, half the loop trips and page-table reads at the same two
            # programs per SM (compiled for sm_90: 80 KB of shared memory and 217 registers against
            # 76 KB and 151 for 64 keys) (H200, session 23, each against the 64-key
            # plan in the same run, two runs: GQA ctx 512 q=8 at B=32 30.1 / 30.1 -> 27.3 / 27.1
            # us, at B=64 54.1 / 54.2 -> 47.5 / 47.2). Split tiles lost: B=8 ctx 2048 (4 splits of
            # 512 keys) 35.7 -> 36.4 / 36.5, B=1 ctx 8192 (30 of 273) 25.5 -> 27.1.
            prefs = [(128, 3)] + prefs
    for block_n, stages in prefs:
        if (2 * stages * block_n + block_m) * d_pad * elem_size <= SMEM_BUDGET:
            break
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def choose_splits(num_programs: int, max_context_len: int, num_sms: int) -> int:
    """KV splits per (sequence, KV head, query tile), from a wave model of the GPU.

    Each SM holds SLOTS_PER_SM programs; a call lasts ceil(programs x S / slots) waves of programs
    that each read 1/S of the keys, i.e. ceil(P S / slots) / S full-context waves. S = 1 above 3
    programs per SM (balanced enough, no merge); otherwise the fewest splits within SPLIT_SLACK of
    the best time, never under MIN_KEYS_PER_SPLIT keys. H200 data behind it (notes/attention.md):
    B=1 ctx 8192 32 heads ran best at S=8 (256 programs, 1.94 waves) not 17 (4.1 waves: the 5th
    mostly idle); B=8 x 32 heads (256 programs) at S=1, not 3."""
    if num_programs >= 3 * num_sms:
        return 1
    max_s = max(1, min(MAX_SPLITS, math.ceil(max_context_len / MIN_KEYS_PER_SPLIT)))
    slots = SLOTS_PER_SM * num_sms
    cost = [math.ceil(num_programs * s / slots) / s for s in range(1, max_s + 1)]
    best = min(cost)
    return next(s for s, c in enumerate(cost, 1) if c <= SPLIT_SLACK * best)


@functools.lru_cache(maxsize=4096)
def _plan(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int,
          max_context_len: int, num_sms: int, elem_size: int, num_splits: int | None,
          config: tuple, small_split: bool = True) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages, QT, n_qtiles, splits); config: sorted override items."""
    group = num_heads // num_kv_heads
    over = dict(config)
    block_m = over.get("BLOCK_M", tile_config(group, max_query_len, head_dim)["BLOCK_M"])
    qt = block_m // group
    if qt < 1:
        raise ValueError(f"BLOCK_M {block_m} is smaller than the query group {group}")
    n_qtiles = triton.cdiv(max_query_len, qt)
    if num_splits is None:
        num_splits = choose_splits(num_seqs * num_kv_heads * n_qtiles, max_context_len, num_sms)
    tile = {**tile_config(group, max_query_len, head_dim, triton.cdiv(max_context_len, num_splits),
                          elem_size, programs=num_seqs * num_kv_heads * n_qtiles * num_splits,
                          num_sms=num_sms if num_sms > 1 else 0, num_splits=num_splits,
                          small_split=small_split), **over}
    return (tile["BLOCK_M"], tile["BLOCK_N"], tile["num_warps"], tile["num_stages"], qt, n_qtiles,
            num_splits)


def launch_plan(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int,
                max_context_len: int, device: torch.device, num_splits: int | None = None,
                config: dict | None = None, elem_size: int = 2) -> dict:
    """Tile config, query tiles per sequence and KV splits: everything the grid depends on, from
    host values alone (a CUDA-graph bucket fixes max_query_len and the split count)."""
    plan = _plan(num_seqs, num_heads, num_kv_heads, head_dim, max_query_len, max_context_len,
                 _num_sms(torch.device(device)), elem_size, num_splits,
                 tuple(sorted((config or {}).items())), small_split_tiles.value)
    return dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "QT", "n_qtiles", "num_splits"),
                    plan))


MERGE_MODES = ("separate", "inline")   # how a split call's partials are merged (paged_attention)


def _check_merge(merge: str, where: str) -> str:
    if merge not in MERGE_MODES:
        raise ValueError(f"{where}: merge must be one of {MERGE_MODES}, not {merge!r}")
    return merge


def _tile_counters(device: torch.device, capacity: int) -> torch.Tensor:
    """Zeroed int32 arrival counters of the inline merge, one per (sequence, KV head, query tile)
    (kernels/counters.py)."""
    return arrival_counters(device, capacity)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float, *,
                    max_context_len: int | None = None, num_splits: int | None = None,
                    out: torch.Tensor | None = None, config: dict | None = None,
                    merge: str = "separate", _upcast: bool | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context (see
    reference.paged_attention_ref for the semantics).

    q: [T, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] int32;
    context_lens: [B] int32 (new tokens included); query_start_loc: [B+1] int32. max_query_len and
    max_context_len are host bounds (any upper bound works; they size the grid and the split count).
    merge (with more than one KV split): "separate" launches a second kernel that merges the
    partials; "inline" lets the last split of each query tile merge them (one launch, an atomic
    counter per tile). Returns out [T, H, D] in q's dtype.
    """
    _check_merge(merge, "paged_attention")
    t, h, d = q.shape
    _, page, hkv, d_k = k_cache.shape
    if d_k != d or v_cache.shape != k_cache.shape or h % hkv:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches need a contiguous head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    b = context_lens.shape[0]
    if t == 0 or b == 0:
        return out
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * page
    device = q.device
    block_m, block_n, warps, stages, qt, n_qtiles, num_splits = _plan(
        b, h, hkv, d, max_query_len, max_context_len, _num_sms(device), k_cache.element_size(),
        num_splits, tuple(sorted(config.items())) if config else (), small_split_tiles.value)
    upcast = (device.type == "cpu" or k_cache.dtype == torch.float32) if _upcast is None else _upcast
    d_pad = _d_pad(d)
    split = num_splits > 1
    if split:  # one fp32 workspace: partial outputs [T, H, S, D_PAD], then their log2-sum-exp [T, H, S]
        lse_offset = t * h * num_splits * d_pad
        part = torch.empty(lse_offset + t * h * num_splits, dtype=torch.float32, device=device)
    else:
        part, lse_offset = out, 0  # never touched: the SPLIT branch is compiled out
    inline = split and merge == "inline"
    if inline:  # capacity in powers of two from 4096: one buffer covers every automatic split plan
        counters = _tile_counters(device, max(4096, triton.next_power_of_2(b * hkv * n_qtiles)))
    else:
        counters = part
    launch = pdl.options(device)
    heads_first = HEADS_FIRST and b <= 65535      # CUDA's grid y and z stop at 65535
    grid = (hkv, b) if heads_first else (b, hkv)
    _paged_attention_kernel[grid + (n_qtiles * num_splits,)](
        q, k_cache, v_cache, out, part, counters, block_tables, context_lens, query_start_loc,
        scale * LOG2E, h, num_splits, lse_offset,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0),
        G=h // hkv, QT=qt, PAGE=page, HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT=split, INLINE_MERGE=inline, UPCAST=upcast,
        PAGE_AHEAD=PAGE_AHEAD and block_n <= PAGE_AHEAD_MAX_BLOCK_N, HEADS_FIRST=heads_first,
        EARLY_LOADS=pdl.EARLY_LOADS, ONE_LOOP=single_key_loop.value and block_m <= ONE_LOOP_MAX_M, num_warps=warps,
        num_stages=stages, **launch)
    if split and not inline:
        _merge_splits_kernel[(t, h)](
            out, part, h, num_splits, lse_offset, out.stride(0), out.stride(1),
            HEAD_DIM=d, D_PAD=d_pad, S_PAD=triton.next_power_of_2(num_splits),
            num_warps=merge_num_warps(num_splits, d_pad), **launch)
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (any row strides); caches: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64 flat slots, negative = skip."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, hkv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE=k_cache.shape[1], HEAD_DIM=d, D_PAD=triton.next_power_of_2(d),
        H_PAD=triton.next_power_of_2(hkv), num_warps=4, **pdl.options(k.device))


class TritonAttention:
    """Attention backend on the Triton kernels: the GPU path (and the CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self, merge: str | None = None):
        # how split-KV partials are merged (see paged_attention); by default SPECDEC_ATTN_MERGE's
        # ("separate" where unset), read when the backend is made
        merge = os.environ.get("SPECDEC_ATTN_MERGE", "separate") if merge is None else merge
        self.merge = _check_merge(merge, "TritonAttention (SPECDEC_ATTN_MERGE)")

    def store(self, k, v, k_cache, v_cache, batch) -> None:
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping)

    def attend(self, q, k_cache, v_cache, batch, scale: float) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                               batch.query_start_loc, batch.max_query_len, scale,
                               max_context_len=batch.max_context_len, merge=self.merge)
