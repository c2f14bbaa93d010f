"""Draft-side sampling: the token and the exact (transport-rounded) distribution it was drawn from."""
from __future__ import annotations

import torch

from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import DRAFT, uniform
from specdec.sampling.transport import round_probs, sample_from
from specdec.staging import to_device


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64 argmax: what sampling gives on greedy rows (ties: the lowest id)."""
    return logits.float().argmax(-1)


def draft_sample(logits: torch.Tensor, tensors: SamplingTensors, positions: torch.Tensor,
                 transport_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V], positions [B] int64 (absolute position of the token being drafted)
    -> (tokens [B] int64, q [B, V] float32 weights, or None when every row is greedy).

    q is rounded to the transport dtype BEFORE sampling, so the token is drawn from exactly the
    weights the target will decode (see transport.py); send q with encode_probs(q, transport_dtype).
    Greedy rows give their argmax with a one-hot q (which the target does not need); an all-greedy
    batch gives the argmax alone (one kernel instead of the sampling path's ~25 launches per drafted
    position, the same tokens).
    """
    if tensors.all_greedy:
        return greedy_tokens(logits), None
    q = round_probs(logits_to_probs(logits, tensors), transport_dtype)   # [B, V]
    u = uniform(tensors.seeds, to_device(positions, tensors.seeds.device), DRAFT)
    return sample_from(q, u), q
