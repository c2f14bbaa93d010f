"""Rotary position embeddings, with the frequency scalings checkpoints ask for."""
from __future__ import annotations

import math

import torch

from specdec.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / rope.theta ** exponents
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        # Llama 3.1 long-context scaling (Meta's reference): long wavelengths are divided by `factor`,
        # short ones kept, and the band in between interpolated smoothly.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class Rotary(torch.nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        # A plain attribute, not a buffer: it stays float32 when the model is cast to bf16/fp16.
        self.inv_freq = inv_frequencies(rope, head_dim)

    def _apply(self, fn, recurse=True):
        self.inv_freq = self.inv_freq.to(fn(self.inv_freq).device)  # follow .to(device), keep fp32
        return super()._apply(fn, recurse)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]           # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                               # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin_half(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D/2] in float32: the same values as cos_sin's halves before the cast, in 3
        kernels instead of 7 (kernels/fused.rope_store rounds them to the model dtype itself)."""
        freqs = positions[:, None] * self.inv_freq[None, :]                  # int64 * fp32 -> fp32
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, D]. Half-split rotation (the Hugging Face Llama layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
