"""A minimal speculative decoding loop over two ModelRunners, for tests (the real loop, split
across draft server, target server and coordinator, is the services' job).

Per step, for the whole batch: the draft appends the tokens it has not seen and drafts k_b tokens
autoregressively; the target scores new tokens + drafts in ONE forward (num_logits = k_b + 1),
rejection-samples, and both KV caches are truncated to the accepted prefix.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.runner import ModelRunner, SeqInput
from specdec.sampling import SamplingParams, SamplingTensors, SpecCounters, draft_sample, rejection_sample
from specdec.sampling.rejection import one_hot_probs


def greedy_reference(runner: ModelRunner, prompts: Sequence[Sequence[int]], max_new: int,
                     tag: str = "ref") -> list[list[int]]:
    """Target-only greedy decoding, one token per step for the whole batch."""
    ids = [(tag, i) for i in range(len(prompts))]
    for s in ids:
        runner.add_sequence(s)
    outs: list[list[int]] = [[] for _ in prompts]
    feed = [list(p) for p in prompts]
    for _ in range(max_new):
        logits = runner.step([SeqInput(s, f) for s, f in zip(ids, feed)])
        for i, lg in enumerate(logits):
            outs[i].append(int(lg[-1].argmax()))
        feed = [[o[-1]] for o in outs]
    for s in ids:
        runner.free(s)
    return outs


def speculative_generate(target: ModelRunner, draft: ModelRunner, prompts: Sequence[Sequence[int]],
                         num_draft: Sequence[int], max_new: int, params: Sequence[SamplingParams],
                         tag: str = "spec", send_probs: bool = True) -> tuple[list[list[int]], SpecCounters]:
    n = len(prompts)
    ids = [(tag, i) for i in range(n)]
    for s in ids:
        target.add_sequence(s)
        draft.add_sequence(s)
    seqs = [list(p) for p in prompts]
    t_cached, d_cached = [0] * n, [0] * n
    counters = SpecCounters()
    while True:
        active = [b for b in range(n) if len(seqs[b]) - len(prompts[b]) < max_new]
        if not active:
            break
        ks = [num_draft[b] for b in active]
        tensors = SamplingTensors.from_params([params[b] for b in active])
        drafts: list[list[int]] = [[] for _ in active]
        qs: list[list[torch.Tensor]] = [[] for _ in active]
        for j in range(max(ks)):
            rows = [i for i, k in enumerate(ks) if k > j]
            items = [SeqInput(ids[active[i]], seqs[active[i]][d_cached[active[i]]:] if j == 0
                              else [drafts[i][-1]]) for i in rows]
            logits = torch.cat(draft.step(items))                              # [len(rows), V]
            pos = torch.tensor([len(seqs[active[i]]) + j for i in rows])
            tok, q = draft_sample(logits, tensors.index(torch.tensor(rows)), pos)
            for r, i in enumerate(rows):
                drafts[i].append(int(tok[r]))
                # an all-greedy batch's q is one-hot at the token (draft_sample returns None)
                qs[i].append(q[r] if q is not None else one_hot_probs(tok[r:r + 1], logits.shape[1])[0])
        items = [SeqInput(ids[b], seqs[b][t_cached[b]:] + drafts[i], num_logits=ks[i] + 1)
                 for i, b in enumerate(active)]
        target_logits = torch.cat(target.step(items))                      # [sum(k+1), V]
        flat = [t for d in drafts for t in d]
        draft_tokens = torch.tensor(flat, dtype=torch.int64)
        draft_probs = (torch.stack([q for row in qs for q in row]) if flat
                       else torch.zeros(0, target_logits.shape[1])) if send_probs else None
        positions = torch.tensor([len(seqs[b]) for b in active])
        out = rejection_sample(target_logits, draft_tokens, draft_probs, ks, tensors, positions)
        host = counters.update(out, ks)
        for i, b in enumerate(active):
            base, a = len(seqs[b]), host.accepted[i]
            # Rollback: the target keeps the accepted drafts (the new token is not in its cache yet);
            # the draft holds at most k-1 of its drafts (the last one was never fed back).
            t_cached[b] = base + a
            target.truncate(ids[b], t_cached[b])
            if ks[i]:
                d_cached[b] = min(base + ks[i] - 1, base + a)
                draft.truncate(ids[b], d_cached[b])
            seqs[b] += host.tokens[i]
    for s in ids:
        target.free(s)
        draft.free(s)
    return [s[len(p):len(p) + max_new] for s, p in zip(seqs, prompts)], counters
