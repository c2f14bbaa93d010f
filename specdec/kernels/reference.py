"""Torch reference for the paged attention and KV-store kernels. Correct and slow: the CPU path and
the oracle the Triton kernels are tested against."""
from __future__ import annotations

import torch


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [NB, BS, Hkv, D]; slot_mapping: [T] flat slots."""
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: list[int], query_lens: list[int],
                        scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    q: [T, H, D], the new tokens of all sequences back to back (query_lens[b] each); sequence b's
    context holds context_lens[b] tokens, its new ones last, so query i sits at position
    context_lens[b] - query_lens[b] + i and sees keys 0..that position. Returns [T, H, D] in q's dtype.
    """
    _, bs, hkv, d = k_cache.shape
    h = q.shape[1]
    out = torch.empty_like(q)
    start = 0
    for b, (ctx, ql) in enumerate(zip(context_lens, query_lens)):
        blocks = block_tables[b, : -(-ctx // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:ctx].float()               # [ctx, Hkv, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:ctx].float()
        k = k.repeat_interleave(h // hkv, dim=1)                             # [ctx, H, D]
        v = v.repeat_interleave(h // hkv, dim=1)
        qb = q[start:start + ql].float()                                     # [ql, H, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale                 # [H, ql, ctx]
        q_pos = torch.arange(ctx - ql, ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + ql] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        start += ql
    return out


class TorchAttention:
    """Attention backend on the torch reference: the CPU path."""

    name = "torch"

    def store(self, k, v, k_cache, v_cache, batch) -> None:
        store_kv_ref(k, v, k_cache, v_cache, batch.slot_mapping)

    def attend(self, q, k_cache, v_cache, batch, scale: float) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, v_cache, batch.block_tables, batch.context_lens_host,
                                   batch.query_lens_host, scale)
