"""Draft engine: per step, roll each sequence back to its surviving drafts, append what it has not
seen, and draft num_draft tokens autoregressively, batched over all sequences (one forward per
drafted position)."""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec import trace
from specdec.config import EngineConfig
from specdec.models.llama import TensorParallel
from specdec.runner import SeqInput
from specdec.sampling.draft import draft_sample, greedy_tokens
from specdec.sampling.graphs import GraphedSampler
from specdec.sampling.probs import SamplingTensors, resolve_seeds
from specdec.sampling import transport
from specdec.staging import as_device_tensor
from specdec.engine.base import Admission, ModelEngine, log
from specdec.engine.types import (Code, DraftOutput, DraftSeqInput, SeqFailure, StepResult,
                                  StepTiming, unknown_seq)


@dataclass
class DraftState:
    """A sequence as the draft knows it. tokens = confirmed tokens + the last proposal's drafts;
    the first `base` are confirmed. The KV holds a prefix of tokens (after a proposal of k it lacks
    the last drafted token, which was never fed)."""
    tokens: list[int] = field(default_factory=list)
    base: int = 0


@dataclass
class Plan:
    """One sequence's step. Its tokens before drafting are the held state's first `kept` tokens
    and then `new` (a new sequence: `new` alone); the state changes only once the step succeeded
    (commit), in place: a step costs nothing per token of context."""
    index: int            # position in the request
    seq: DraftSeqInput
    state: DraftState | None  # the sequence as held (None: new, or restarted by `first`)
    kept: int             # of state.tokens, how many this step keeps (0 without a state)
    new: list[int]        # this step's tokens after them
    feed: list[int]       # tokens to run through the model before the first draft
    base: int             # of the step's tokens, how many are confirmed (extend: fewer than all)
    admission: Admission | None = None

    @property
    def length(self) -> int:
        """Tokens before drafting."""
        return self.kept + len(self.new)

    @property
    def kv_len_after(self) -> int:
        return self.length + max(self.seq.num_draft - 1, 0)  # the last draft is never fed

    def commit(self, drafts: list[int]) -> DraftState:
        """The state after this step: the kept tokens, the new ones and the drafts."""
        if self.state is None:
            return DraftState(self.new + drafts, self.base)
        tokens = self.state.tokens
        del tokens[self.kept:]
        tokens += self.new
        tokens += drafts
        self.state.base = self.base
        return self.state


class DraftEngine(ModelEngine):
    graph_chains = True  # greedy steps after the first run as one chain of graph replays
    sampler: GraphedSampler | None = None  # sampled drafts on CUDA graphs (set at capture)

    def __init__(self, config: EngineConfig, tp: TensorParallel = TensorParallel()):
        super().__init__(config, tp)
        self.states: dict[int, DraftState] = {}

    def _capture_graphs(self) -> None:
        super()._capture_graphs()
        if self.config.sampler_graphs:
            t0 = time.perf_counter()
            self.sampler = GraphedSampler(self.vocab_size, self.config.graph_batch_sizes,
                                          self.config.max_num_draft, self.config.probs_dtype, self.device)
            log.info("captured %d sampler graphs in %.1fs", len(self.sampler.graphs), time.perf_counter() - t0)
            self._capture_sampled_chains()

    def _capture_sampled_chains(self) -> None:
        """With config.sampled_chains: chain graphs whose steps draw with the sampler, on the
        buckets both have (the runner's chain bucket for n rows must be the sampler's)."""
        graphs = self.runner.graphs
        if not (self.config.sampled_chains and self.sampler is not None and graphs is not None and graphs.chains):
            return
        if set(self.sampler.batch_sizes) != set(graphs.batch_sizes):
            log.warning("no sampled chains: sampler buckets %s differ from the graphs' %s",
                        self.sampler.batch_sizes, graphs.batch_sizes)
            return
        t0 = time.perf_counter()
        graphs.capture_sampled_chains(self.sampler.chain_pick)
        log.info("captured %d sampled chain graphs in %.1fs", len(graphs.sampled_chains), time.perf_counter() - t0)

    def graph_query_lens(self) -> tuple[int, ...]:
        # A step's first forward feeds 1 token per sequence (the target's correction) or 2 (the
        # last draft, never fed, and the bonus token after all were accepted); later ones feed 1.
        return (1, 2)

    def _forget(self, seq_id) -> None:
        super()._forget(seq_id)
        self.states.pop(seq_id, None)

    def propose(self, seqs: Sequence[DraftSeqInput], release: Sequence[int] = ()) -> StepResult:
        t0 = time.perf_counter()
        self.release(release)
        plans, errors = self.admit_step(seqs, self._plan)
        outputs: list[DraftOutput | None] = [None if e is None else DraftOutput(s.seq_id, error=e)
                                             for s, e in zip(seqs, errors)]
        clock = self.clock()
        if trace.enabled:
            trace.mark_step("e_launch")
        try:
            drafted, probs = self._draft(plans, clock)
        except BaseException:
            self.roll_back(p.admission for p in plans)
            raise
        if trace.enabled:
            trace.mark_step("e_synced")
        for plan, toks, q in zip(plans, drafted, probs):
            self.states[plan.seq.seq_id] = plan.commit(toks)
            outputs[plan.index] = DraftOutput(plan.seq.seq_id, toks, q)
        forwards = clock.seconds()
        self._update_profile(plans, forwards)
        timing = StepTiming(forward_seconds=sum(forwards), step_seconds=time.perf_counter() - t0,
                            batch_size=len(seqs), num_forwards=len(forwards),
                            decode_forward_seconds=self.profile(len(seqs)))  # at batch_size's bucket
        return StepResult(outputs, timing)

    def _plan(self, index: int, seq: DraftSeqInput) -> Plan:
        """Validates one sequence and rolls its KV back to what survives; no other state changes
        (a sequence failing later in the step keeps its old state, consistent with the shorter KV)."""
        self.check_num_draft(seq.num_draft, "num_draft")
        self.check_tokens(seq.new_tokens, "new_tokens")
        # `first` restarts the sequence: whatever is held under the id is dropped once the plan is
        # valid (admit_step), so a resend from the start is idempotent and an invalid one changes
        # nothing.
        state = None if seq.first else self.states.get(seq.seq_id)
        if state is None:
            if not seq.first:
                raise unknown_seq(seq.seq_id)
            if not seq.new_tokens:
                raise SeqFailure(Code.INVALID_ARGUMENT, f"new_tokens: empty for new sequence {seq.seq_id}")
            new = list(seq.new_tokens)
            self.check_length(len(new) + seq.num_draft, "new_tokens + num_draft")
            return Plan(index, seq, None, 0, new, feed=new, base=len(new))
        drafted = len(state.tokens) - state.base
        if not 0 <= seq.keep <= drafted:
            raise SeqFailure(Code.INVALID_ARGUMENT,
                             f"keep: {seq.keep} outside 0..{drafted} (drafts proposed last step)")
        if seq.extend:
            # Pipelined: the target still verifies the proposal; its first `keep` tokens are
            # confirmed and the rest stay proposed, with the new drafts after them.
            if seq.new_tokens:
                raise SeqFailure(Code.INVALID_ARGUMENT, "new_tokens: must be empty with extend")
            kept, new = len(state.tokens), []
        else:
            kept, new = state.base + seq.keep, list(seq.new_tokens)
        length = kept + len(new)
        self.check_length(length + seq.num_draft, "new_tokens + num_draft")
        base = state.base + seq.keep if seq.extend else length
        kv_len = min(self.runner.num_tokens(seq.seq_id), kept)
        if kv_len == length and seq.num_draft:
            kv_len -= 1  # nothing new to feed, but drafting needs the last token's logits
        self.runner.truncate(seq.seq_id, kv_len)
        return Plan(index, seq, state, kept, new, feed=state.tokens[kv_len:kept] + new, base=base)

    def _draft(self, plans: list[Plan], clock) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per plan the drafted tokens and (sampled sequences only) the transport-rounded
        distributions [k, V] they were drawn from. The first forward runs every sequence's feed
        (sequences with num_draft 0 only append); each later one feeds one token per sequence still
        drafting, so sequences with smaller num_draft drop out as they finish. Drafted tokens stay
        on the device and are fed back as the next forward's input ids: the step synchronises
        once, when they are copied out at the end, not once per position. Greedy steps whose
        sequences all want the same number of tokens run every position after the first as one
        chain of graph replays (ModelRunner.greedy_chain) where the GPU path has one."""
        active = [i for i, p in enumerate(plans) if p.seq.num_draft]
        # All greedy: the drafts are the argmaxes (draft_sample's all-greedy result) and no sampling
        # parameters or positions are staged (four pinned host-to-device copies a step).
        greedy = all(plans[i].seq.sampling.greedy for i in active)
        rows = list(range(len(active)))  # rows of the first position still drafting
        if not greedy:
            # Per drafting row (`rows` indexes these): its sampling parameters, one seed for the
            # whole step, the position of its first draft, and whether that draft is a guess of
            # the target's token (the first of an extension; see draft_sample).
            sampling = [plans[i].seq.sampling for i in active]
            seeds = resolve_seeds(sampling)
            first_pos = [plans[i].length for i in active]
            guess = [bool(plans[i].seq.extend) for i in active]
        fed = None      # [len(items)] device token ids replacing the items' placeholder ids
        # (rows, tokens, q) per position; a greedy chain's positions in one entry, tokens [n, len(rows)]
        steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []
        step = 0
        items = None    # the first forward's, made only when a step needs them (not a whole chain)
        # Every sequence feeds one token (the target's correction) and drafts: the whole step can
        # be one chain, its first forward included (not with a guess: its first draw uses the
        # RESAMPLE uniform, which a sampled chain does not stage).
        # A greedy step whose feeds are 1 or 2 tokens (2: the last draft and the bonus token after
        # all were accepted) can be one chain too, behind a head graph (ModelRunner.fed_chain).
        if len(active) == len(plans) and (greedy or not any(guess)):
            if all(len(p.feed) == 1 for p in plans):
                if self._chain(plans, [p.feed[0] for p in plans], rows, 0, clock, steps,
                               None if greedy else (sampling, seeds, first_pos)):
                    items = []
            elif greedy and self._fed_chain(plans, items := self._feeds(plans), rows, clock, steps):
                items = []
        if items is None:
            items = self._feeds(plans)
        while items:
            with clock.forward():
                batch = self.runner.prepare(items)
                if fed is not None:
                    batch = dataclasses.replace(batch, input_ids=fed)
                # Rows with logits are the drafting sequences, in `rows` order.
                logits = self.runner.forward(batch)                             # [len(rows), V]
            if not rows:
                break
            if greedy:
                tokens, q = greedy_tokens(logits), None
            else:
                tokens, q = self._sample(logits, [sampling[r] for r in rows], [seeds[r] for r in rows],
                                         [first_pos[r] + step for r in rows], guess if step == 0 else None,
                                         step)
            steps.append((rows, tokens, q))
            step += 1
            keep = [j for j, r in enumerate(rows) if plans[active[r]].seq.num_draft > step]
            if not keep:
                break  # every sequence has its drafts (the usual uniform-γ step)
            if len(keep) == len(rows) and self._chain(
                    [plans[active[r]] for r in rows], tokens, rows, step, clock, steps,
                    None if greedy else ([sampling[r] for r in rows], [seeds[r] for r in rows],
                                         [first_pos[r] + step for r in rows])):
                break
            fed = tokens
            if len(keep) < len(rows):
                kept = as_device_tensor(keep, torch.int64, self.device)
                fed = tokens.index_select(0, kept)
            rows = [rows[j] for j in keep]
            items = [SeqInput(plans[active[r]].seq.seq_id, [0]) for r in rows]
        if trace.enabled:
            trace.mark_step("e_launched")
        return self._to_host(plans, active, steps)

    @staticmethod
    def _feeds(plans: list[Plan]) -> list[SeqInput]:
        """The first forward's items: every plan's feed, with a logit row where it drafts."""
        return [SeqInput(p.seq.seq_id, p.feed, 1 if p.seq.num_draft else 0) for p in plans if p.feed]

    @staticmethod
    def _to_host(plans: list[Plan], active: list[int], steps: list) -> tuple[list[list[int]], list]:
        """The step's drafted tokens and sampled rows, from the device: the tokens and the rows'
        nonzero counts in one copy, then the rows (transport.draft_rows_to_host: sparse rows as
        their nonzeros, dense rows in one copy), never a sync per sequence. Below
        DEVICE_SPARSE_MIN_ROWS sampled rows, every row is copied densely (no counts)."""
        owner: list[int] = []                               # the plan of each drafted token, in order
        qs: list[list[torch.Tensor]] = [[] for _ in plans]
        pieces = []
        for rows_at, t, q in steps:
            if t.dim() == 2:                                # a greedy chain: positions x rows_at
                owner += [active[r] for r in rows_at] * len(t)
                pieces.append(t.reshape(-1))
                continue
            pieces.append(t)
            for j, r in enumerate(rows_at):
                i = active[r]
                owner.append(i)
                if not plans[i].seq.sampling.greedy:
                    qs[i].append(q[j])
        flat = [row for rows_i in qs for row in rows_i]
        q_all = torch.stack(flat) if flat else None
        device_sparse = (q_all is not None and transport.DRAFT_DEVICE_SPARSE
                         and len(q_all) >= transport.DEVICE_SPARSE_MIN_ROWS)
        counts = transport.nonzero_counts(q_all) if device_sparse else None
        if counts is not None:
            pieces.append(counts)
        host = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).tolist() if pieces else []
        drafted: list[list[int]] = [[] for _ in plans]
        for i, tok in zip(owner, host):
            drafted[i].append(tok)
        if q_all is None:
            return drafted, [None] * len(plans)
        return drafted, transport.draft_rows_to_host(q_all, [len(q) for q in qs], None if counts is None else host[len(owner):])

    def _sample(self, logits: torch.Tensor, sampling: list, seeds: list[int], positions: list[int],
                guess: list[bool] | None, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_sample of one position's rows: (tokens [n], q [n, V] in the transport dtype, exact
        since q is rounded to it), on the graphed sampler where it fits, else eagerly."""
        if self.sampler is not None and self.sampler.fits(len(sampling), step, logits.shape[1]):
            return self.sampler.sample(logits, sampling, seeds, positions, guess, step)
        dev, dtype = self.device, self.config.probs_dtype
        tokens, q = draft_sample(logits, SamplingTensors.from_params(sampling, dev, seeds),
                                 as_device_tensor(positions, torch.int64, dev), dtype,
                                 None if guess is None or not any(guess) else as_device_tensor(guess, torch.bool, dev))
        return tokens, None if q is None else q.to(dtype)   # None: the rows left are all greedy

    def _chain(self, plans: list[Plan], first_ids, rows: list[int], done: int, clock, steps: list,
               sampled: tuple[list, list[int], list[int]] | None = None) -> bool:
        """The rest of a step as one chain of graph replays (ModelRunner.greedy_chain), when every
        plan wants the same number of further tokens and a chain graph fits: their drafts go to
        `steps` (one entry per position, rows as given) and True is returned. `done` positions
        were drafted already; first_ids (host or device) feed the first forward.
        sampled: the rows' (params, seeds, positions of the first chained draft) for a sampled
        chain (config.sampled_chains): the sampler's parameters and the uniforms of every chained
        position are staged in one copy, and replay i draws row done + i of the sampler's outputs
        as sample() would (the same kernel, parameters and uniforms: the same tokens and q)."""
        left = {p.seq.num_draft - done for p in plans}
        ids = [p.seq.seq_id for p in plans]
        if len(left) != 1 or not self.runner.can_chain(ids, n := left.pop(), sampled is not None):
            return False
        if sampled is not None:   # sampled chains exist: so does the sampler, with their buckets
            if done + n > self.sampler.max_steps:
                return False
            self.sampler.stage_chain(*sampled, done, n)
        # One timed span for the chain (its staging copy included), split evenly over its n
        # forwards: the live decode profile (and c) gets the chain's mean forward time.
        with clock.forward(n):
            chained = self.runner.greedy_chain(ids, first_ids, n, sampled is not None,
                                               0 if sampled is None else done)   # [n, len(plans)]
        if sampled is None:
            steps.append((rows, chained, None))   # all n positions in one entry (see _to_host)
        else:
            steps += [(rows, t, self.sampler.q[done + i, :len(ids)]) for i, t in enumerate(chained)]
        return True

    def _fed_chain(self, plans: list[Plan], items: list[SeqInput], rows: list[int], clock, steps: list) -> bool:
        """A greedy step whose sequences all draft the same number of tokens, its first forward
        feeding 1 or 2 tokens each, as one head graph and a chain (ModelRunner.fed_chain), when
        they fit: the drafts go to `steps` and True is returned. One timed span for all of it,
        split evenly over its forwards (the 2-token forward's share joins the profile's
        single-token samples; a small draft's 2-token forward costs what a 1-token one does)."""
        left = {p.seq.num_draft for p in plans}
        if len(left) != 1 or not self.runner.can_fed_chain(items, n := left.pop()):
            return False
        with clock.forward(n):
            chained = self.runner.fed_chain(items, n)   # [n, len(plans)]
        steps.append((rows, chained, None))
        return True

    def _update_profile(self, plans: list[Plan], forwards: list[float]) -> None:
        # Forwards after the first feed exactly one token per sequence: live single-token samples.
        # One update_many per run of forwards at the same batch (a uniform step: all of them).
        counts = [p.seq.num_draft for p in plans if p.seq.num_draft]
        batches = [sum(1 for k in counts if k > step) for step in range(1, len(forwards))]
        for batch, run in itertools.groupby(zip(batches, forwards[1:]), key=lambda pair: pair[0]):
            if batch:
                self.profile.update_many(batch, [seconds for _, seconds in run])
