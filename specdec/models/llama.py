"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat varlen batch and a paged KV cache.

Linear layers are laid out for tensor parallelism: q/k/v and gate/up are column-sharded by rank
(whole heads, whole intermediate slices), o and down are row-sharded and all-reduced. With one rank
(the default) the all-reduce is skipped and the shapes are the checkpoint's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import ConfigError, ModelConfig
from specdec.models.rope import Rotary, apply_rotary

if TYPE_CHECKING:
    from specdec.kv_cache import KVCache
    from specdec.runner import ForwardBatch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside world size {self.size}")
        # The all-reduce sums over the default process group: it must hold exactly these ranks
        # (in a larger or smaller group the sums are of other shards or of too few, silently).
        dist = torch.distributed
        if self.size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.size:
            raise ValueError(f"tensor-parallel size {self.size} differs from the process group's world "
                             f"size {dist.get_world_size()}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (specdec/collectives.py: NCCL, or one-shot for small
        activations on GPUs); x itself or a new tensor: use the value returned."""
        if self.size > 1:
            from specdec import collectives
            return collectives.all_reduce(x)
        return x

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ConfigError(f"{what} ({n}) is not divisible by tensor-parallel size {self.size}")
        return n // self.size


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class TorchLayerOps:
    """The decoder layer's elementwise steps in plain torch: the CPU path, and the reference that
    kernels/fused.FusedLayerOps (the CUDA path) is tested against. LlamaModel holds one of the two,
    chosen at build, and hands it to every layer."""

    name = "torch"

    @staticmethod
    def cos_sin(rotary: Rotary, positions, dtype):
        return rotary.cos_sin(positions, dtype)                              # [T, D] each

    @staticmethod
    def add_rmsnorm(x, residual, norm: RMSNorm):
        """(norm(residual + x), residual + x); with no residual yet (the first layer), (norm(x), x)."""
        if residual is not None:
            x = residual + x
        return norm(x), x

    @staticmethod
    def rope_store(q, k, v, cos, sin, kv_layer, batch, backend):
        """RoPE of q [T, H, D] and k [T, Hkv, D]; k and v go into the layer's KV cache. Returns q."""
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k_cache, v_cache = kv_layer
        backend.store(k, v, k_cache, v_cache, batch)
        return q

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)                                  # [T, I] each
        return F.silu(gate) * up

    @staticmethod
    def linear(x, weight, bias=None):
        """Every projection and the LM head (kernels/gemv.GemvOps replaces it at decode sizes)."""
        return F.linear(x, weight, bias)

    @classmethod
    def gate_up_silu(cls, x, weight, bias=None):
        """SiLU(gate) * up of the fused gate_up projection (GemvOps may do both in one kernel)."""
        return cls.silu_mul(cls.linear(x, weight, bias))

    @classmethod
    def row_linear(cls, x, weight):
        """o_proj and down_proj, the projections into the residual stream (GemvOps(fuse_norm)
        defers them to the add + RMSNorm that follows)."""
        return cls.linear(x, weight)

    @staticmethod
    def resolve(x):
        """x as a tensor (GemvOps(fuse_norm) may hold a projection or a norm not run yet)."""
        return x


class RowParallelLinear(nn.Module):
    """y = all_reduce(x @ W_shard^T) + b: the bias is added once, after the reduction."""

    def __init__(self, in_local: int, out: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, in_local))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor, linear=F.linear) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)

    def forward(self, x, cos, sin, kv_layer, batch: "ForwardBatch", backend, ops) -> torch.Tensor:
        t = x.shape[0]
        # Keep qkv -> rope_store -> attend back to back: under PDL the RoPE kernel loads cos / sin /
        # slots and the attention kernel its lengths and page table before waiting for the kernel
        # before them (kernels/pdl.py, EARLY_LOADS), so nothing launched in between may write them.
        qkv = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = ops.rope_store(q.view(t, self.num_heads, self.head_dim),
                           k.view(t, self.num_kv_heads, self.head_dim),
                           v.view(t, self.num_kv_heads, self.head_dim), cos, sin, kv_layer, batch, backend)
        k_cache, v_cache = kv_layer
        out = backend.attend(q, k_cache, v_cache, batch, self.scale)         # [T, H, D]
        return self.o_proj(out.reshape(t, self.q_size), ops.row_linear)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.inter = tp.split(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        act = ops.gate_up_silu(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return self.down_proj(act, ops.row_linear)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, residual, cos, sin, kv_layer, batch, backend, ops):
        """x: this layer's input, or the previous layer's MLP output with `residual` the stream it is
        still to be added to (None before the first layer): the add is fused into the next norm.
        Returns (MLP output, residual stream)."""
        h, residual = ops.add_rmsnorm(x, residual, self.input_layernorm)
        h = self.self_attn(h, cos, sin, kv_layer, batch, backend, ops)
        h, residual = ops.add_rmsnorm(h, residual, self.post_attention_layernorm)
        return self.mlp(h, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel(), fused_kernels: bool = False,
                 gemv_kernels: bool = False):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.fused_kernels = fused_kernels
        self.gemv_kernels = gemv_kernels
        self.gemv_silu = False  # SiLU * up in the gate_up projection's GEMV epilogue (set_gemv_silu)
        # add + RMSNorm folded into the GEMVs around it at decode steps (set_gemv_norm;
        # SPECDEC_GEMV_NORM=0 turns it off)
        self.gemv_norm = os.environ.get("SPECDEC_GEMV_NORM", "1") != "0"
        self._choose_ops()
        # Embedding and LM head are replicated on every rank (vocab-parallel is a later refinement).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    def set_fused_kernels(self, enabled: bool) -> None:
        """Triton kernels for norm/RoPE/KV store/SiLU (CUDA) or the torch ops (any device). Choose before
        capturing CUDA graphs: a graph keeps the ops it was captured with."""
        self.fused_kernels = enabled
        self._choose_ops()

    def set_gemv_kernels(self, enabled: bool) -> None:
        """The Triton GEMV (kernels/gemv.py) for the projections and LM head on CUDA where it serves
        a step (gemv.linear: up to 16 tokens at any width, up to 64 for projections up to
        WIDE_MAX_N wide), the BLAS otherwise; the same caveat about captured graphs."""
        self.gemv_kernels = enabled
        self._choose_ops()

    def set_gemv_silu(self, enabled: bool) -> None:
        """With the GEMV: SiLU(gate) * up computed in the gate_up projection's epilogue (one kernel
        fewer per layer, same bits); off by default until measured on the GPU."""
        self.gemv_silu = enabled
        self._choose_ops()

    def set_gemv_norm(self, enabled: bool) -> None:
        """With the GEMV: add + RMSNorm folded into the projections around it at steps of up to 16
        tokens (GemvOps fuse_norm / norm_bound: two kernels fewer per layer, RMSNorm's value but not
        the separate kernel's bits); one rank, no o / MLP bias, bf16 / fp32 only, else ignored. On
        by default."""
        self.gemv_norm = enabled
        self._choose_ops()

    def _choose_ops(self) -> None:
        if self.fused_kernels:
            from specdec.kernels.fused import FusedLayerOps  # Triton is imported only when asked for
            self.ops = FusedLayerOps()
        else:
            self.ops = TorchLayerOps()
        if self.gemv_kernels:
            from specdec.kernels.gemv import GemvOps
            cfg = self.config
            fuse_norm = self.gemv_norm and self.tp.size == 1 and not cfg.o_bias and not cfg.mlp_bias
            self.ops = GemvOps(self.ops, fuse_silu=self.gemv_silu, fuse_norm=fuse_norm)

    @property
    def num_kv_heads_local(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, batch: "ForwardBatch", kv: "KVCache", backend,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Returns logits [len(batch.logits_indices), vocab] in float32: in `out` when given (the
        CUDA graphs share one such buffer), else a new tensor."""
        x = self.embed_tokens(batch.input_ids)                               # [T, hidden]
        cos, sin = self.ops.cos_sin(self.rotary, batch.positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, kv.layer(i), batch, backend, self.ops)
        rows = batch.logits_indices
        x = self.ops.resolve(x)        # GemvOps(fuse_norm): the last down_proj, unrun until here
        last = None if residual is None else residual[rows]
        x, _ = self.ops.add_rmsnorm(x[rows], last, self.norm)               # [N, hidden]
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.ops.linear(x, head)
        return logits.float() if out is None else out.copy_(logits)
