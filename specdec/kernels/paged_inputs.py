"""Random ragged paged-attention inputs and a float64 oracle, shared by the kernel tests and
bench/attention.py. Blocks are handed out in a shuffled order so that no sequence's pages are
contiguous, and every cache slot no sequence owns holds NaN: a kernel that reads past a context
returns NaN and fails."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    q: torch.Tensor                # [T, H, D]
    k_cache: torch.Tensor          # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with 0
    context_lens: torch.Tensor     # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    query_lens: list[int]
    context_lens_host: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host)

    def kv_bytes(self) -> int:
        """Bytes of K and V that attention over this batch must read (each context once)."""
        _, _, hkv, d = self.k_cache.shape
        return 2 * sum(self.context_lens_host) * hkv * d * self.k_cache.element_size()


def random_paged_batch(query_lens: Sequence[int], context_lens: Sequence[int], num_heads: int,
                       num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str, seed: int = 0, poison: bool = True) -> PagedBatch:
    if len(query_lens) != len(context_lens) or any(
            not 1 <= q <= c for q, c in zip(query_lens, context_lens)):
        raise ValueError(f"need 1 <= query_len <= context_len, got {query_lens} / {context_lens}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n_blocks = [-(-c // block_size) for c in context_lens]
    total = sum(n_blocks) + 2                            # two blocks nobody owns
    order = torch.randperm(total, generator=gen)
    shape = (total, block_size, num_kv_heads, head_dim)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    k_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    width = max(n_blocks)
    table = torch.zeros(len(n_blocks), width, dtype=torch.int32)
    used = torch.zeros(total * block_size, dtype=torch.bool)
    at = 0
    for b, (n, ctx) in enumerate(zip(n_blocks, context_lens)):
        blocks = order[at:at + n]
        at += n
        table[b, :n] = blocks.to(torch.int32)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
        used[slots] = True
    if poison:
        free = (~used).nonzero().flatten().to(device)
        k_cache.view(-1, num_kv_heads, head_dim)[free] = float("nan")
        v_cache.view(-1, num_kv_heads, head_dim)[free] = float("nan")
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=dev_gen, device=device).to(dtype)
    starts = torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    return PagedBatch(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table.to(device),
                      context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
                      query_start_loc=starts.to(device), query_lens=list(query_lens),
                      context_lens_host=list(context_lens))


def contiguous_kv(batch: PagedBatch, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's K and V gathered out of the pages: each [ctx, Hkv, D]."""
    _, bs, hkv, d = batch.k_cache.shape
    ctx = batch.context_lens_host[b]
    blocks = batch.block_tables[b, : -(-ctx // bs)].long()
    k = batch.k_cache[blocks].reshape(-1, hkv, d)[:ctx]
    v = batch.v_cache[blocks].reshape(-1, hkv, d)[:ctx]
    return k, v


def reference_f64(batch: PagedBatch, scale: float) -> torch.Tensor:
    """The oracle: causal attention in float64, [T, H, D]."""
    h = batch.q.shape[1]
    out = torch.empty(batch.q.shape, dtype=torch.float64, device=batch.q.device)
    start = 0
    for b, (ql, ctx) in enumerate(zip(batch.query_lens, batch.context_lens_host)):
        k, v = (x.double() for x in contiguous_kv(batch, b))
        group = h // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qb = batch.q[start:start + ql].double()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale                 # [H, ql, ctx]
        visible = torch.arange(ctx, device=k.device)[None, :] <= torch.arange(
            ctx - ql, ctx, device=k.device)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + ql] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += ql
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives NaN (which fails every `<` check)."""
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
