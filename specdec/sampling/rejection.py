"""Lossless speculative sampling on the target (Leviathan et al. 2023; Chen et al. 2023), batched.

For each sequence independently: draft token i (drawn from q_i) is accepted with probability
min(1, p_i(x) / q_i(x)); at the first rejection the output is drawn from norm(max(p_i - q_i, 0));
when all k are accepted a bonus token is drawn from p_{k+1}. The output then has exactly the target's
distribution. Sequences may carry different k, 0 included (that is plain decoding from p).

Greedy needs no special arithmetic: greedy rows of p (and a greedy draft's q) are one-hot, so the
same rule accepts while the target's argmax matches and then emits the target's argmax. A batch
that is greedy throughout takes that outcome directly (argmax and compare: a few kernels instead of
the ~40 of probabilities, hashing and inverse-CDF draws, which at decode sizes cost more host time
to launch than the verify forward's own launches); the tests hold it to the general path.
draft_probs=None means the drafts were chosen deterministically (q one-hot at the drafted token),
which is exact for a greedy draft whatever the target samples.

Everything after the host-built index layout is tensor ops on the device: no .item(), no syncs, the
same code on CPU and CUDA. Host-built tensors reach the device through pinned staging
(specdec/staging.py), never a blocking copy. The caller copies the result to the host once
(SpecOutput.to_host).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import ACCEPT, RESAMPLE, uniform
from specdec.sampling.transport import normalize, sample_from
from specdec.staging import as_device_tensor, to_device


@dataclass(frozen=True)
class HostSpecOutput:
    accepted: list[int]
    num_emitted: list[int]
    tokens: list[list[int]]  # per sequence: accepted drafts, then the correction or bonus token

    @classmethod
    def from_rows(cls, rows: list[list[int]]) -> "HostSpecOutput":
        """From SpecOutput.packed() rows on the host."""
        return cls([r[0] for r in rows], [r[1] for r in rows], [r[2:2 + r[1]] for r in rows])


@dataclass(frozen=True)
class SpecOutput:
    accepted: torch.Tensor     # [B] int64, drafts accepted
    tokens: torch.Tensor       # [B, max_k+1] int64: accepted drafts, then correction/bonus; -1 after
    num_emitted: torch.Tensor  # [B] int64, accepted + 1

    def packed(self) -> torch.Tensor:
        """[B, max_k + 3]: accepted, emitted, then the tokens (what HostSpecOutput.from_rows reads)."""
        return torch.cat([self.accepted[:, None], self.num_emitted[:, None], self.tokens], 1)

    def to_host(self) -> HostSpecOutput:
        """One device-to-host copy of everything."""
        return HostSpecOutput.from_rows(self.packed().cpu().tolist())


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) per row [R, V]. A row where it vanishes (p <= q everywhere, i.e. p == q up
    to rounding, where a rejection has probability ~0) falls back to p."""
    r = (p - q).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=torch.finfo(r.dtype).tiny), p)


def rejection_sample(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None, num_draft: Sequence[int] | torch.Tensor,
                     tensors: SamplingTensors, positions: torch.Tensor | Sequence[int]) -> SpecOutput:
    """target_logits [sum(k_b + 1), V]: per sequence, rows for its k_b drafts then the bonus row;
    draft_tokens [sum k_b]; draft_probs [sum k_b, V] rounded weights (decode_probs / draft_sample)
    or None; num_draft [B] on the host; tensors: per-sequence params [B]; positions [B]: absolute
    position of each sequence's first draft token (its current length)."""
    counts = _host_counts(num_draft)
    if tensors.all_greedy:
        return greedy_accept(target_logits, draft_tokens, counts)
    p = logits_to_probs(target_logits, tensors.repeat([k + 1 for k in counts]))
    return rejection_sample_probs(p, draft_tokens, draft_probs, counts, tensors.seeds, positions)


def greedy_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor, counts: Sequence[int]) -> SpecOutput:
    """rejection_sample's result when every sequence is greedy: drafts are accepted while they equal
    the target's argmax, then the target's argmax at the first mismatch (or the bonus row)."""
    dev = target_logits.device
    m = draft_tokens.shape[0]
    layout, kmax = _layout(counts, target_logits.shape[0], m, dev)
    k, p_start, p_rows, q_rows = layout[:, 0], layout[:, 1], layout[:, 2:kmax + 3], layout[:, kmax + 3:]
    best = target_logits.float().argmax(-1)                                      # [N]
    j = torch.arange(kmax + 1, device=dev)[None, :]
    x = to_device(draft_tokens, dev)[q_rows] if m else torch.zeros_like(p_rows)   # [B, kmax+1]
    ok = (j < k[:, None]) & (x == best[p_rows])
    accepted = ok.long().cumprod(1).sum(1)
    tokens = torch.where(j < accepted[:, None], x, -1)
    tokens = tokens.scatter(1, accepted[:, None], best[p_start + accepted][:, None])
    return SpecOutput(accepted=accepted, tokens=tokens, num_emitted=accepted + 1)


def greedy_accept_rows(best: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """greedy_accept on the host, from the target's argmax of every row (per sequence: its k
    drafts' rows, then the bonus row, in order): (accepted, next token) per sequence. For a batch
    that is all greedy this is the whole rule, and one argmax plus one small copy replace the
    dozen launches and two host-to-device copies of greedy_accept."""
    need = sum(len(d) + 1 for d in drafts)
    if need != len(best):
        raise ValueError(f"drafts {[len(d) for d in drafts]} need {need} target rows, got {len(best)}")
    out, row = [], 0
    for d in drafts:
        a = 0
        while a < len(d) and d[a] == best[row + a]:
            a += 1
        out.append((a, best[row + a]))
        row += len(d) + 1
    return out


def layout_width(kmax: int) -> int:
    return 2 * kmax + 4


def layout_rows(counts: Sequence[int], kmax: int, m: int) -> list[list[int]]:
    """The padded [B, layout_width(kmax)] layout of the flat rows as host lists: per sequence its
    k and p_start, then kmax+1 target rows (the last repeated past k) and kmax+1 draft rows
    (clamped to the m - 1 drafts there are). kmax may exceed the counts' (the graphed verifier
    pads every step to its own)."""
    rows, p0, q0, last = [], 0, 0, max(m - 1, 0)
    for k in counts:
        rows.append([k, p0, *(p0 + min(j, k) for j in range(kmax + 1)),
                     *(min(q0 + j, last) for j in range(kmax + 1))])
        p0, q0 = p0 + k + 1, q0 + k
    return rows


def _layout(counts: Sequence[int], n: int, m: int, dev: torch.device) -> tuple[torch.Tensor, int]:
    """layout_rows on the device in one staged transfer, and kmax. Built in Python: the dozen tiny
    host tensor ops it took before cost more than the lists. Checks first that the counts fit n
    target rows and m draft tokens."""
    check_counts(counts, n, m)
    kmax = max(counts, default=0)
    layout = torch.tensor(layout_rows(counts, kmax, m), dtype=torch.int64).reshape(len(counts), layout_width(kmax))
    return to_device(layout, dev), kmax


def check_counts(counts: Sequence[int], n: int, m: int) -> None:
    if n != sum(counts) + len(counts) or m != sum(counts):
        raise ValueError(f"num_draft {list(counts)} needs {sum(counts) + len(counts)} target rows and "
                         f"{sum(counts)} draft tokens, got {n} and {m}")


def rejection_sample_probs(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                           draft_probs: torch.Tensor | None, num_draft: Sequence[int] | torch.Tensor,
                           seeds: torch.Tensor, positions: torch.Tensor | Sequence[int]) -> SpecOutput:
    """As rejection_sample, from target probabilities [sum(k_b + 1), V] and seeds [B] int64."""
    counts = _host_counts(num_draft)
    dev = target_probs.device
    n, v = target_probs.shape
    b, m = len(counts), draft_tokens.shape[0]
    layout, kmax = _layout(counts, n, m, dev)  # checks the counts first
    if draft_probs is not None and draft_probs.shape != (m, v):
        raise ValueError(f"draft_probs: shape {tuple(draft_probs.shape)}, expected {(m, v)}")
    if isinstance(positions, torch.Tensor):
        positions = to_device(positions.long(), dev)
    else:
        positions = as_device_tensor(positions, torch.int64, dev)
    seeds, draft_tokens = to_device(seeds, dev), to_device(draft_tokens, dev)
    if draft_probs is not None:
        draft_probs = to_device(draft_probs, dev)
    # Every uniform a sequence may use this step: the accept test of each draft and the
    # correction / bonus sample after any number accepted (accept_from picks one per sequence).
    at = positions[:, None] + torch.arange(kmax + 1, device=dev)[None, :]        # [B, kmax+1]
    s = seeds[:, None].expand(b, kmax + 1)
    return accept_from(target_probs, draft_tokens if m else None, draft_probs if m else None, layout, kmax,
                       uniform(s, at, ACCEPT), uniform(s, at, RESAMPLE))


def accept_from(target_probs: torch.Tensor, draft_tokens: torch.Tensor | None,
                draft_probs: torch.Tensor | None, layout: torch.Tensor, kmax: int,
                u_accept: torch.Tensor, u_resample: torch.Tensor) -> SpecOutput:
    """The rule itself, tensor ops only (what the graphed verifier captures): layout [B,
    layout_width(kmax)] (layout_rows), u_accept / u_resample [B, kmax + 1] float64: the ACCEPT and RESAMPLE
    uniforms at each sequence's positions first + j. draft_tokens None: no drafts in the batch;
    draft_probs None: every draft deterministic (q one-hot at it). Rows past a sequence's k are
    never read into its result, so padding may hold anything."""
    k, p_start = layout[:, 0], layout[:, 1]
    p_rows, q_rows = layout[:, 2:kmax + 3], layout[:, kmax + 3:]
    j = torch.arange(kmax + 1, device=layout.device)[None, :]   # made on the device: no copy at all
    is_draft = j < k[:, None]                                                   # [B, kmax+1]

    x = draft_tokens[q_rows] if draft_tokens is not None else torch.zeros_like(p_rows)   # [B, kmax+1]
    p_x = target_probs[p_rows, x].double()
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        w = draft_probs.double()
        # Same float32 values as normalize(w) produces row-wise: the p == q case accepts surely.
        q_x = (w[q_rows, x] / w.sum(-1)[q_rows]).float().double()
    ok = is_draft & (q_x > 0) & (u_accept * q_x < p_x)   # a token the draft gave q = 0 is never accepted
    accepted = ok.long().cumprod(1).sum(1)                                       # [B]

    p_final = target_probs[p_start + accepted]                                   # [B, V]
    if draft_tokens is not None:
        q_row = q_rows.gather(1, accepted[:, None]).squeeze(1)   # the row after the accepted drafts
        if draft_probs is None:
            q_final = torch.zeros_like(p_final).scatter_(1, draft_tokens[q_row, None], 1.0)
        else:
            q_final = normalize(draft_probs[q_row])
        dist = torch.where((accepted < k)[:, None], residual_probs(p_final, q_final), p_final)
    else:
        dist = p_final
    nxt = sample_from(dist, u_resample.gather(1, accepted[:, None]).squeeze(1))

    tokens = torch.where(j < accepted[:, None], x, -1)
    tokens = tokens.scatter(1, accepted[:, None], nxt[:, None])
    return SpecOutput(accepted=accepted, tokens=tokens, num_emitted=accepted + 1)


def one_hot_probs(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft rows for deterministically chosen tokens [M] -> [M, V]: fill the rows of greedy
    sequences with these when other sequences of the batch send real draft probabilities."""
    rows = torch.zeros(tokens.shape[0], vocab_size, device=tokens.device)
    return rows.scatter_(1, tokens.long()[:, None], 1.0)


def _host_counts(num_draft: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(num_draft, torch.Tensor):
        if num_draft.device.type != "cpu":
            raise ValueError("num_draft: pass host counts (a list or CPU tensor); reading a device "
                             "tensor here would synchronise")
        num_draft = num_draft.tolist()
    counts = [int(c) for c in num_draft]
    if any(c < 0 for c in counts):
        raise ValueError(f"num_draft: counts must be >= 0, got {counts}")
    return counts
