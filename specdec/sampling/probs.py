"""Batched logits -> probabilities with per-row temperature, top-k, top-p and min-p.

Greedy rows become one-hot at the argmax. That makes greedy the zero-temperature case of the same
arithmetic everywhere: a greedy draft proposes the argmax with q = 1, a greedy target (p one-hot)
accepts exactly when its argmax matches and its residual max(p - q, 0) is its own argmax.

Order of the filters is Hugging Face's: temperature, top-k, top-p, min-p. Ties at the k-th logit
are all kept. Which filters run is decided on the host from the params (no data-dependent branches).
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.kernels import sampling as fused
from specdec.sampling.params import SamplingParams
from specdec.sampling.rng import seed_to_int64
from specdec.sampling.transport import (  # noqa: F401  (the transport API is reached from here too)
    EncodedProbs, ProbsDecodeError, decode_probs, encode_probs, normalize, round_probs, sample_from)
from specdec.staging import as_device_tensor, to_device


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on a device. Rows are sequences, or flat verify rows after expand."""
    temperature: torch.Tensor  # [R] float32 (1 on greedy rows, never used there)
    top_k: torch.Tensor        # [R] int64, 0 = off
    top_p: torch.Tensor        # [R] float32, 1 = off
    min_p: torch.Tensor        # [R] float32, 0 = off
    greedy: torch.Tensor       # [R] bool
    seeds: torch.Tensor        # [R] int64 (uint64 bits)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu",
                    seeds: Sequence[int] | None = None) -> "SamplingTensors":
        """seeds overrides params' seeds. A row with neither gets a fresh random seed on every call:
        still lossless (fresh randomness always is) but not reproducible, and never a seed shared
        by all unseeded requests. The coordinator seeds every request once, when it arrives."""
        rows = host_rows(params, seeds)
        # Three staged copies (one per dtype) rather than one per field.
        floats = as_device_tensor([rows.temperature, rows.top_p, rows.min_p], torch.float32, device)  # [3, R]
        ints = as_device_tensor([rows.top_k, rows.seeds], torch.int64, device)                       # [2, R]
        return cls(
            temperature=floats[0], top_k=ints[0], top_p=floats[1], min_p=floats[2],
            greedy=as_device_tensor(rows.greedy, torch.bool, device), seeds=ints[1],
            all_greedy=all(rows.greedy), **filter_flags(params),
        )

    def __len__(self) -> int:
        return self.greedy.shape[0]

    def filters(self) -> tuple[torch.Tensor, ...]:
        """(temperature, top_k, top_p, min_p, greedy): the fused kernel's per-row arguments."""
        return self.temperature, self.top_k, self.top_p, self.min_p, self.greedy

    def index(self, rows: torch.Tensor) -> "SamplingTensors":
        """The rows at `rows` (a device int64 index, repeats allowed); host flags are kept (a
        superset is harmless: a filter that is off on a row leaves it unchanged)."""
        return SamplingTensors(
            self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
            self.greedy[rows], self.seeds[rows],
            self.all_greedy, self.any_top_k, self.any_top_p, self.any_min_p)

    def repeat(self, counts: Sequence[int]) -> "SamplingTensors":
        """Row b repeated counts[b] times (host counts): per-sequence params -> flat verify rows."""
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
        return self.index(to_device(rows, self.greedy.device))


@dataclass(frozen=True)
class HostRows:
    """SamplingTensors' per-row values as host lists (what from_params stages; the graphed sampler
    writes the same values into its static inputs)."""
    temperature: list[float]  # 1 on greedy rows
    top_p: list[float]
    min_p: list[float]
    top_k: list[int]
    seeds: list[int]          # int64 bits of the uint64 seeds
    greedy: list[bool]

    def take(self, rows: Sequence[int]) -> "HostRows":
        """The rows at `rows` (repeats allowed), as SamplingTensors.index does on the device."""
        return HostRows(*([getattr(self, f)[i] for i in rows] for f in self.__dataclass_fields__))


def resolve_seeds(params: Sequence[SamplingParams]) -> list[int]:
    """Each row's seed: its own, or a fresh random one (lossless, not reproducible)."""
    return [p.seed if p.seed is not None else secrets.randbits(64) for p in params]


def host_rows(params: Sequence[SamplingParams], seeds: Sequence[int] | None = None) -> HostRows:
    """seeds overrides params' seeds; a row with neither gets a fresh random seed (from_params)."""
    if seeds is None:
        seeds = resolve_seeds(params)
    if len(seeds) != len(params):
        raise ValueError(f"seeds: {len(seeds)} for {len(params)} rows")
    return HostRows([1.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params],
                    [p.min_p for p in params], [p.top_k for p in params],
                    [seed_to_int64(s) for s in seeds], [p.greedy for p in params])


def filter_flags(params: Sequence[SamplingParams]) -> dict[str, bool]:
    """Which filters logits_to_probs runs for these rows (any_top_k, any_top_p, any_min_p). A
    filter that runs on a row that does not use it leaves the row's bits unchanged, so running
    more filters than the rows need (the graphed sampler does) changes nothing."""
    return dict(any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
                any_top_p=any(p.top_p < 1 and not p.greedy for p in params),
                any_min_p=any(p.min_p > 0 and not p.greedy for p in params))


def logits_to_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [R, V] -> float32 probabilities [R, V]; greedy rows one-hot at the argmax.
    On CUDA the fused kernel (kernels/sampling.py: one program per row, the same rules with ties
    at a top-p boundary all kept); below, torch's ops (the CPU path, and CUDA with it switched off)."""
    if fused.applies(logits.device) and not t.all_greedy:
        return fused.fused_probs(logits, *t.filters())
    logits = logits.float()
    one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    if t.all_greedy:
        return one_hot
    x = logits / t.temperature[:, None]
    v = x.shape[-1]
    if t.any_top_k or t.any_top_p:
        sorted_x, order = x.sort(-1, descending=True)                    # [R, V]
        if t.any_top_k:
            k = torch.where(t.top_k > 0, t.top_k, v).clamp(max=v)
            kth = sorted_x.gather(1, (k - 1)[:, None])                   # [R, 1]
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
            x = x.masked_fill(x < kth, float("-inf"))
        if t.any_top_p:
            ps = sorted_x.softmax(-1)
            # Drop a token when the tokens before it already reach top_p; the first always stays.
            drop = (ps.cumsum(-1) - ps) >= t.top_p[:, None]
            drop[:, 0] = False
            drop &= (t.top_p < 1)[:, None]  # top_p = 1 must not drop a float-rounding tail
            x = x.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
    probs = x.softmax(-1)
    if t.any_min_p:
        floor = t.min_p[:, None] * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        # Renormalise only the rows that use min_p: another row's bits must not depend on whether
        # its batch holds a min_p request (dividing by a sum that is 1 up to rounding moves them).
        probs = torch.where((t.min_p > 0)[:, None], probs / probs.sum(-1, keepdim=True), probs)
    return torch.where(t.greedy[:, None], one_hot, probs)
