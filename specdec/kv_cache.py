"""Paged KV storage: one tensor per layer and per K/V, addressed by flat slot = block * block_size + offset."""
from __future__ import annotations

import torch

from specdec.config import CacheConfig, ModelConfig


class KVCache:
    def __init__(self, model: ModelConfig, cache: CacheConfig, device: torch.device | str,
                 num_kv_heads: int | None = None):
        # num_kv_heads < model.num_kv_heads when the target is tensor-parallel (heads sharded by rank).
        heads = num_kv_heads or model.num_kv_heads
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        shape = (model.num_layers, 2, cache.num_blocks, cache.block_size, heads, model.head_dim)
        self.data = torch.zeros(shape, dtype=cache.dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.data[i, 0], self.data[i, 1]

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @staticmethod
    def bytes_per_block(model: ModelConfig, cache_block_size: int, dtype: torch.dtype,
                        num_kv_heads: int | None = None) -> int:
        heads = num_kv_heads or model.num_kv_heads
        elem = torch.empty((), dtype=dtype).element_size()
        return model.num_layers * 2 * cache_block_size * heads * model.head_dim * elem
