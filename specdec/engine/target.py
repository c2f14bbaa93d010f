"""Target engine: per step, ONE forward over every sequence's new tokens + drafts, batched
rejection sampling, and KV rollback to the accepted prefix."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec import trace
from specdec.runner import SeqInput
from specdec.sampling.graphs import GraphedVerifier
from specdec.sampling.probs import SamplingTensors, resolve_seeds
from specdec.sampling.rejection import greedy_accept_rows, one_hot_probs, rejection_sample
from specdec.sampling.transport import SparseWeights, scatter_rows
from specdec.staging import as_device_tensor, to_device
from protos.wire import outside_vocab
from specdec.engine.base import Admission, ModelEngine, log
from specdec.engine.types import (Code, SeqFailure, StepResult, StepTiming, VerifyOutput,
                                  VerifySeqInput, unknown_seq)


@dataclass
class Plan:
    index: int
    seq: VerifySeqInput
    start: int             # tokens in the KV before the step
    admission: Admission | None = None

    @property
    def kv_len_after(self) -> int:
        return self.start + len(self.seq.new_tokens) + len(self.seq.draft_tokens)

    @property
    def num_logits(self) -> int:
        return 0 if self.seq.partial_prefill else len(self.seq.draft_tokens) + 1

    @property
    def first_draft_position(self) -> int:
        return self.start + len(self.seq.new_tokens)


def _mass_beyond(q, v: int) -> bool:
    """Whether draft weights (a tensor or SparseWeights) put mass on ids >= v."""
    if isinstance(q, SparseWeights):
        return bool(((q.flat % q.vocab_size >= v) & (q.bits > 0)).any())   # checked: no negative bits but -0.0
    return bool(q[:, v:].any())


@dataclass
class _Ahead:
    """A verify step admitted and staged before its request came (TargetEngine.prepare_ahead):
    its plans (placeholder drafts), the batch staged for them, and what a request must say to
    take it: per sequence its id, its one new token and how many drafts."""
    plans: list[Plan]
    batch: object                  # the ForwardBatch runner.prepare staged (placeholder draft ids)
    expect: list[tuple[int, int, int]]
    free_before: int               # KV blocks free before the staging reserved its slots

    def mismatch(self, seqs: Sequence[VerifySeqInput], vocab_size: int, gone: Sequence[int] = ()) -> str | None:
        """Why seqs are not the predicted step (for the log), or None when they are: the staged
        sequences less those the request releases (`gone`), in the same order, each with the
        predicted token, at most as many drafts as staged, all in the vocabulary, greedy, nothing
        else asked."""
        expect = [e for e in self.expect if e[0] not in gone] if gone else self.expect
        if len(seqs) != len(expect):
            return f"{len(seqs)} sequences, {len(expect)} expected"
        if not seqs:
            return "nothing left to verify"
        for s, (seq_id, token, k) in zip(seqs, expect):
            if s.seq_id != seq_id:
                return f"sequence {s.seq_id} where {seq_id} was expected"
            if len(s.new_tokens) != 1 or s.new_tokens[0] != token:
                return f"sequence {seq_id}: new tokens other than the one returned"
            if len(s.draft_tokens) > k:
                return f"sequence {seq_id}: {len(s.draft_tokens)} drafts, {k} staged"
            if s.first or s.partial_prefill or not s.sampling.greedy:
                return f"sequence {seq_id}: first, partial prefill or sampled"
            if outside_vocab(s.draft_tokens, vocab_size) is not None:
                return f"sequence {seq_id}: a draft outside the vocabulary"
        return None

    def take(self, seqs: Sequence[VerifySeqInput], gone: Sequence[int]) -> list[Plan]:
        """The staged plans with the request's sequences in place of the placeholders (mismatch
        passed). A sequence with fewer drafts than staged keeps the staged layout: its missing
        drafts are NO_DRAFT, which never matches, so its rows past its own drafts go unused and
        their KV is cut back with the rejected. A sequence the request releases keeps its
        placeholder (scored with the step, index -1: no output; freed after)."""
        request = enumerate(seqs)
        for p in self.plans:
            if p.seq.seq_id in gone:
                p.index = -1
                continue
            index, s = next(request)
            k = len(p.seq.draft_tokens)
            if len(s.draft_tokens) < k:
                s = dataclasses.replace(s, draft_tokens=[*s.draft_tokens, *[NO_DRAFT] * (k - len(s.draft_tokens))])
            p.seq, p.index = s, index
        return self.plans


# A staged draft the request did not send (it sent fewer): matches no token; fed as id 0.
NO_DRAFT = -1


class TargetEngine(ModelEngine):
    verifier: GraphedVerifier | None = None  # sampled rejection steps on CUDA graphs (set at capture)
    _ahead: _Ahead | None = None             # a step staged ahead of its request (prepare_ahead)
    ahead_taken = 0                          # verifies that took a step staged ahead
    ahead_dropped = 0                        # steps staged ahead and undone (another request came)
    ran_staged_shape = False                 # the last verify ran a staged step's shape, not its request's

    def graph_query_lens(self) -> tuple[int, ...]:
        # One new token + k drafts; k beyond 8 is rare enough to run eagerly.
        return tuple(range(1, min(self.config.max_num_draft, 8) + 2))

    def _capture_graphs(self) -> None:
        super()._capture_graphs()
        kmax = max(self.runner.graphs.query_lens) - 1   # verifies of up to kmax drafts are graphed
        if self.config.sampler_graphs and kmax >= 1:     # (kmax 0: no verify graphs, none needed)
            t0 = time.perf_counter()
            self.verifier = GraphedVerifier(self.vocab_size, self.config.graph_batch_sizes, kmax, self.device)
            log.info("captured %d rejection-sampling graphs (up to %d drafts) in %.1fs",
                     len(self.verifier.graphs), kmax, time.perf_counter() - t0)

    def prepare_ahead(self, expect: Sequence[tuple[int, int, int]]) -> bool:
        """Admits and stages the step expected next: per (seq_id, next_token, k) the sequence's
        token and k placeholder drafts (greedy). The next verify takes it when its request is that
        step (_Ahead.mismatch: it then skips admission, host arrays and staging, and only puts the
        drafts' ids in); any other request, a release, or another prepare_ahead undoes it first
        (the KV cut back to where it was), so a wrong guess costs work but changes nothing.
        Returns whether a step is staged. (A step that takes it times its forward without the
        staging, which the other steps' timed span holds: on a GPU the live profile of those
        shapes moves toward the forward's own time.)"""
        self.drop_ahead()
        if not expect or self.tp.size > 1:   # (tensor-parallel ranks mirror steps, not this)
            return False
        free = self.num_free_blocks
        # A sequence near max_model_len is staged with the drafts it can still take (its token, k
        # drafts and the target's next must fit), not refused with the whole step.
        blocks, room = self.runner.blocks, self.max_model_len - 2
        expect = [(s, t, max(0, min(k, room - blocks.num_tokens(s))) if s in blocks else k)
                  for s, t, k in expect]
        seqs = [VerifySeqInput(seq_id, [token], [0] * k) for seq_id, token, k in expect]
        plans, errors = self.admit_step(seqs, self._plan)
        if any(e is not None for e in errors):
            self.roll_back(p.admission for p in plans)
            return False
        try:
            batch = self.runner.prepare(self._items(plans))
        except Exception:
            self.roll_back(p.admission for p in plans)
            return False
        self._ahead = _Ahead(plans, batch, list(expect), free)
        return True

    def _still_staged(self, ahead: _Ahead) -> bool:
        """Whether the graph still holds what prepare_ahead staged (nothing else staged on its
        bucket since: the servers stage only in steps, which take or drop it first; a runner used
        directly in between would overwrite it)."""
        if self.runner.graphs is None or ahead.batch.graph_key is None:
            return True
        try:
            self.runner.graphs.staged_graph(ahead.batch)
        except (RuntimeError, ValueError):
            return False
        return True

    def info(self):
        # A staged step's reservation is not the sequences' yet: free as before it (the KV gauge,
        # published before the staging, says the same).
        info = super().info()
        if self._ahead is not None:
            info = dataclasses.replace(info, kv_blocks_free=self._ahead.free_before)
        return info

    def drop_ahead(self) -> None:
        """Undoes a step staged by prepare_ahead, if any (its sequences' KV back to before it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._undo(ahead)

    def _undo(self, ahead: _Ahead) -> None:
        self.ahead_dropped += 1
        self.roll_back(p.admission for p in ahead.plans)

    def release(self, seq_ids) -> int:
        self.drop_ahead()
        return super().release(seq_ids)

    def verify(self, seqs: Sequence[VerifySeqInput], release: Sequence[int] = ()) -> StepResult:
        t0 = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        gone: list[int] = []   # staged sequences the request releases: scored with the step, then freed
        if ahead is not None:
            staged = {seq_id for seq_id, _, _ in ahead.expect}
            gone = [r for r in release if r in staged]
            why = ahead.mismatch(seqs, self.vocab_size, gone) or (
                None if self._still_staged(ahead) else "its graph inputs were overwritten")
            if why is not None:
                log.debug("step staged ahead dropped: %s", why)
                self._undo(ahead)
                ahead, gone = None, []
        self.release([r for r in release if r not in gone])
        if ahead is not None:
            # The step staged ahead: the same plans (admitted, their KV reserved), now with the
            # request's sequences, whose drafts replace the placeholders.
            plans, errors = ahead.take(seqs, gone), [None] * len(seqs)
        else:
            plans, errors = self.admit_step(seqs, self._plan)
        outputs: list[VerifyOutput | None] = [None if e is None else VerifyOutput(s.seq_id, error=e)
                                              for s, e in zip(seqs, errors)]
        clock = self.clock()
        try:
            results = self._score(plans, clock, None if ahead is None else ahead.batch)
        except BaseException:
            self.roll_back(p.admission for p in plans)
            self.release(gone)
            if ahead is not None:
                self.ahead_dropped += 1   # staged and not served
            raise
        if ahead is not None:
            self.ahead_taken += 1
        # A taken step that ran the staged shape rather than the request's (fewer drafts, released
        # sequences): the servicer then leaves the (batch, query length) profile alone.
        self.ran_staged_shape = ahead is not None and (bool(gone) or any(
            NO_DRAFT in p.seq.draft_tokens for p in plans))
        for plan, (accepted, next_token) in zip(plans, results):
            if plan.index < 0:
                continue   # released by this request (freed below)
            # The KV keeps the accepted drafts; next_token comes back as next step's new_tokens.
            self.runner.truncate(plan.seq.seq_id, plan.first_draft_position + accepted)
            outputs[plan.index] = VerifyOutput(plan.seq.seq_id, accepted, next_token)
        self.release(gone)
        forwards = clock.seconds()
        if forwards and plans and all(len(p.seq.new_tokens) + len(p.seq.draft_tokens) == 1 for p in plans):
            self.profile.update(len(plans), forwards[0])  # a plain decode step: a live sample of t(b, 1)
        timing = StepTiming(forward_seconds=sum(forwards), step_seconds=time.perf_counter() - t0,
                            batch_size=len(seqs), num_forwards=len(forwards),
                            decode_forward_seconds=self.profile(len(seqs)))  # at batch_size's bucket
        return StepResult(outputs, timing)

    def _plan(self, index: int, seq: VerifySeqInput) -> Plan:
        """Checks one sequence without changing anything; the plan starts from its KV length now."""
        if not seq.new_tokens:
            # The token scoring the first draft must be fed; the target never holds its own last one.
            raise SeqFailure(Code.INVALID_ARGUMENT, f"new_tokens: empty for sequence {seq.seq_id}")
        k = len(seq.draft_tokens)
        self.check_num_draft(k, "draft_tokens")
        if seq.partial_prefill and k:
            raise SeqFailure(Code.INVALID_ARGUMENT, "draft_tokens: must be empty with partial_prefill")
        self.check_tokens(seq.new_tokens, "new_tokens")
        self.check_tokens(seq.draft_tokens, "draft_tokens")
        if k and not seq.sampling.greedy:
            q = seq.draft_probs
            if q is None:
                raise SeqFailure(Code.INVALID_ARGUMENT,
                                 "draft_probs: required when sampling.temperature > 0 and drafts are sent")
            if q.dim() != 2 or q.shape[0] != k:
                raise SeqFailure(Code.INVALID_ARGUMENT,
                                 f"draft_probs: {tuple(q.shape)} rows for {k} draft tokens")
            if q.shape[1] > self.vocab_size and _mass_beyond(q, self.vocab_size):
                raise SeqFailure(Code.INVALID_ARGUMENT,
                                 f"draft_probs: mass on ids outside the target vocabulary of {self.vocab_size}")
        if seq.first:
            start = 0  # whatever is held under the id is dropped by verify once this passes
        elif seq.seq_id in self.runner.blocks:
            start = self.runner.num_tokens(seq.seq_id)
        else:
            raise unknown_seq(seq.seq_id)
        emitted = 0 if seq.partial_prefill else 1
        self.check_length(start + len(seq.new_tokens) + k + emitted, "new_tokens + draft_tokens")
        return Plan(index, seq, start)

    def _score(self, plans: list[Plan], clock, staged=None) -> list[tuple[int, int]]:
        """The forward and the rejection sampler; (accepted, next_token) per plan. staged: the
        batch prepare_ahead staged for these plans (all greedy), whose ids are replaced by theirs."""
        if not plans:
            return []
        items = self._items(plans)
        scored = [i for i, p in enumerate(plans) if p.num_logits]
        sp = [plans[i] for i in scored]
        # All greedy: rejection_sample's result is the argmax of every row, compared with the
        # drafts on the host (no sampling parameters, draft rows or layout to stage), and the
        # argmaxes come straight from a graph's output (no copy of the logits).
        greedy = all(p.seq.sampling.greedy for p in sp)
        if trace.enabled:
            trace.mark_step("e_launch")
        with clock.forward():
            # [sum(k+1), V] (greedy: [sum(k+1)]): the scored plans' rows in order (the others have none)
            if staged is None:
                flat = self.runner.step_flat(items, argmax=greedy)
            else:
                ids = [t if t >= 0 else 0 for item in items for t in item.token_ids]   # (NO_DRAFT: 0)
                if staged.graph_key is not None:   # on a graph: its input ids rewritten in place
                    self.runner.graphs.put_ids(staged, ids)
                else:
                    staged = dataclasses.replace(staged, input_ids=as_device_tensor(ids, torch.int64, self.device))
                flat = self.runner.forward(staged, argmax=greedy)
        if trace.enabled:
            trace.mark_step("e_launched")
        results = [(0, -1)] * len(plans)
        if not scored:
            return results
        if greedy:
            rows = flat.tolist()
            if trace.enabled:
                trace.mark_step("e_synced")
            for i, r in zip(scored, greedy_accept_rows(rows, [p.seq.draft_tokens for p in sp])):
                results[i] = r
            return results
        counts = [len(p.seq.draft_tokens) for p in sp]
        drafts = [t for p in sp for t in p.seq.draft_tokens]
        params = [p.seq.sampling for p in sp]
        seeds = resolve_seeds(params)
        positions = [p.first_draft_position for p in sp]
        if self.verifier is not None and self.verifier.fits(len(sp), max(counts), flat.shape[1]):
            out = self.verifier.verify(flat, drafts, self._draft_probs(sp), counts, params, seeds,
                                       positions)
        else:
            draft_tokens = as_device_tensor(drafts, torch.int64, self.device)
            out = rejection_sample(flat, draft_tokens, self._draft_probs(sp), counts,
                                   SamplingTensors.from_params(params, self.device, seeds), positions).to_host()
        if trace.enabled:
            trace.mark_step("e_synced")   # (the sampler's launches and its copy out included)
        for i, accepted, tokens in zip(scored, out.accepted, out.tokens):
            results[i] = (accepted, tokens[-1])
        return results

    @staticmethod
    def _items(plans: list[Plan]) -> list[SeqInput]:
        """The forward's items: each plan's new tokens and drafts, with its logit rows."""
        return [SeqInput(p.seq.seq_id, list(p.seq.new_tokens) + list(p.seq.draft_tokens), p.num_logits)
                for p in plans]

    def _draft_probs(self, plans: list[Plan]) -> torch.Tensor | None:
        """Flat [sum k, V] draft weights, or None when every draft was deterministic. Greedy
        sequences' drafts are deterministic: one-hot rows. A draft vocabulary narrower than the
        target's is padded with zeros (those ids were never proposed). Sparse rows (SparseWeights,
        as the wire carried them) are scattered on the device; dense ones take one pinned copy."""
        if all(p.seq.sampling.greedy or not p.seq.draft_tokens for p in plans):
            return None
        v = self.vocab_size
        dense, dense_at, sparse = [], [], []
        offset = 0
        for p in plans:
            k = len(p.seq.draft_tokens)
            if not k:
                continue
            if isinstance(p.seq.draft_probs, SparseWeights) and not p.seq.sampling.greedy:
                sparse.append((offset, p.seq.draft_probs))
            else:
                if p.seq.sampling.greedy:
                    q = one_hot_probs(torch.tensor(p.seq.draft_tokens), v)
                else:
                    q = p.seq.draft_probs.cpu()  # the wire's fp16/bf16 (decode_probs keeps it: exact)
                    q = q[:, :v] if q.shape[1] >= v else torch.nn.functional.pad(q, (0, v - q.shape[1]))
                dense.append(q)
                dense_at += range(offset, offset + k)
            offset += k
        if not sparse:
            # One pinned copy in the rows' own dtype (mixed rows widen to float32 in the cat), then
            # float32 on the device.
            return to_device(torch.cat(dense), self.device).float()
        out = torch.zeros(offset, v, dtype=torch.float32, device=self.device)
        scatter_rows(out, sparse)
        if dense:
            at = to_device(torch.tensor(dense_at, dtype=torch.int64), self.device)
            out.index_copy_(0, at, to_device(torch.cat(dense), self.device).float())
        return out
