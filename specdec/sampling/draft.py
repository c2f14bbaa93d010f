"""Draft-side sampling: the token and the exact (transport-rounded) distribution it was drawn from."""
from __future__ import annotations

import torch

from specdec.kernels import sampling as fused
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import DRAFT, RESAMPLE, uniform
from specdec.sampling.transport import round_probs, sample_from
from specdec.staging import to_device


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64 argmax: what sampling gives on greedy rows (ties: the lowest id)."""
    return logits.float().argmax(-1)


def draft_sample(logits: torch.Tensor, tensors: SamplingTensors, positions: torch.Tensor,
                 transport_dtype: torch.dtype = torch.float16,
                 guess: torch.Tensor | None = None,
                 u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V], positions [B] int64 (absolute position of the token being drafted)
    -> (tokens [B] int64, q [B, V] float32 weights, or None when every row is greedy).

    q is rounded to the transport dtype BEFORE sampling, so the token is drawn from exactly the
    weights the target will decode (see transport.py); send q with encode_probs(q, transport_dtype).
    Greedy rows give their argmax with a one-hot q (which the target does not need); an all-greedy
    batch gives the argmax alone (one kernel instead of the sampling path's ~25 launches per drafted
    position, the same tokens). u [B] float64: the rows' uniforms, given (the graphed sampler
    stages rng.uniform_host's: RESAMPLE on guess rows, DRAFT on the others); positions and guess
    are then unused.
    """
    if tensors.all_greedy:
        return greedy_tokens(logits), None
    if u is None:
        positions = to_device(positions, tensors.seeds.device)
        u = uniform(tensors.seeds, positions, DRAFT)
        if guess is not None:
            # Rows that guess the target's own next token (the first token of a pipelined
            # extension, never verified as a draft) draw with the uniform of the target's bonus
            # sample at that position (rng.RESAMPLE), by the same inverse CDF: the two draws agree
            # whenever that uniform falls where the token's CDF intervals under q and p overlap,
            # which is most of the time when q is close to p (independent draws agree with
            # probability sum p*q).
            u = torch.where(to_device(guess, u.device), uniform(tensors.seeds, positions, RESAMPLE), u)
    if fused.applies(logits.device):   # one kernel: filters, softmax, rounding and the draw
        rows, v = logits.shape
        q = torch.empty(rows, v, dtype=transport_dtype, device=logits.device)
        tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
        fused.fused_sample(logits, *tensors.filters(), u, q, tokens)
        return tokens, q.float()
    q = round_probs(logits_to_probs(logits, tensors), transport_dtype)   # [B, V]
    return sample_from(q, u), q
