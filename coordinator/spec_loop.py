"""The speculative step loop: one asyncio task drives every running sequence, one step at a time.

Per step (DESIGN section 2): ONE Propose on the draft stream for the sequences that draft this step,
then ONE Verify on the target stream for all of them (sequences that do not draft verify zero draft
tokens, which is plain decoding), then each sequence's accepted drafts + next token go to its client.
With --pipeline, a second Propose (`extend`) runs beside the Verify: the draft drafts on from its
proposal, and sequences whose drafts were all accepted and whose next token the draft guessed
verify that extension next step without a Propose (DESIGN section 4's pipelined speculation).
The draft is optional: if it fails, the step goes on without drafts and the draft is probed again
in the background; sequences it held are released and re-sent from scratch when it is back.

A server that lost a sequence (restarted, or dropped it) answers NOT_FOUND for it (every message
but a sequence's first must find it held). Nothing is lost and the output stays exact: the target
gets the sequence again from the start, prompt + every emitted token (chunked like a prompt), and
continues exactly where it was; the draft gets the same resend. A target step that fails outright
(the server died) waits for the target to answer again, then resends every sequence of the step
the same way; so does a step that takes longer than --target-timeout (a hung target). A sequence
lost again right after its resends ends with UNAVAILABLE.

A draft result that is malformed (coordinator/proposals.py) is that sequence's draft failing: it
goes on by plain decoding. Releases that fail while the loop is idle are kept and tried again
with backoff (the draft's once it is back), so no KV block stays held on a server for good.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from dataclasses import dataclass, field

import grpc

from coordinator.config import CoordinatorConfig
from coordinator.gamma import choose_num_draft
from coordinator.proposals import BadProposal, checked_proposal, probs_join, probs_row
from coordinator.scheduler import Scheduler
from coordinator.sequence import Abort, Sequence
from coordinator.servers import ModelServer, status_from_code
from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from specdec.busy_poll import BusyPoll
from specdec.cost_model import WindowStats, bucket_for
from specdec.metrics import CoordinatorMetrics

log = logging.getLogger("specdec.coordinator")
STATS_LOG_S = 30.0  # how often the loop logs its statistics while busy
# Resends from the start a sequence may need before it emits again; one more loss ends it
# (UNAVAILABLE for the target; the draft is then turned off for it, which stays lossless).
MAX_TARGET_RESENDS = 2
MAX_DRAFT_RESENDS = 2
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
# A target's refusal of a sequence's draft_tokens / draft_probs (its conversion says "seqs[i].draft_probs
# ...", its engine "draft_probs: ..."): what the draft sent, not what the client asked.
DRAFT_FIELD = re.compile(r"(seqs\[\d+\]\.)?draft_(tokens|probs)\b")
# Idle Release calls that failed are tried again after this backoff (seconds, doubling), sooner
# when a request arrives (its first step carries them).
RELEASE_RETRY_S = (0.5, 10.0)


@dataclass
class Plan:
    seq: Sequence
    target_new: list[int]
    partial: bool = False
    num_draft: int = 0
    drafts: list[int] = field(default_factory=list)
    probs: pb.Probs | None = None
    ahead: bool = False  # the drafts were proposed during the last step's verify (--pipeline)
    draft_prefill: bool = False  # the Propose fed the draft a prompt (first, or a catch-up of > 2 tokens)
    draft_bytes: bytes | None = None  # drafts as the draft sent them (packed ids) when from this step's Propose


def sampling_pb(seq: Sequence) -> pb.SamplingParams:
    """The sequence's sampling parameters as sent with each of its step messages (built once:
    adding a message to a request copies it)."""
    if seq.wire_sampling is None:
        s = seq.params.sampling
        seq.wire_sampling = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                              min_p=s.min_p, seed=s.seed)
    return seq.wire_sampling


class SpecLoop:
    def __init__(self, config: CoordinatorConfig, scheduler: Scheduler, target: ModelServer,
                 draft: ModelServer | None, metrics: CoordinatorMetrics, *, vocab_size: int,
                 draft_max_len: int = 0, check_draft=None, target_back=None):
        self.config, self.scheduler, self.metrics = config, scheduler, metrics
        self.target, self.draft = target, draft
        self.vocab_size = vocab_size
        self.draft_max_len = draft_max_len
        # The servers' --max-num-draft (ModelInfo.max_num_draft; 0: not known): no step asks more.
        self.draft_max_num_draft = self.target_max_num_draft = 0
        self.draft_up = draft is not None
        self._check_draft = check_draft  # async callable: Info + compatibility, raises when not
        # callable(ModelInfo) -> problem or None: a target answering again after a failure (it may
        # have restarted with other limits, or another model: the problem, which fails its requests)
        self._target_back = target_back
        self._probe: asyncio.Task | None = None
        self._step_no = 0
        self._policy_inputs: tuple[float | None, float | None] = (None, None)  # (α, c) of this step
        self.draft_orphans: set[int] = set()  # to release on the draft once it is reachable again
        self._release_retry_s = RELEASE_RETRY_S[0]
        self.busy_poll = BusyPoll(config.busy_poll_ms / 1e3)  # specdec/busy_poll.py
        self.pipeline = config.pipeline == "on"  # the coordinator resolves "auto" (pipeline_enabled)
        self._running_shown: int | None = None  # the running-sequences gauge as last set here

    # --- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        sched = self.scheduler
        next_log, logged_step = time.monotonic() + STATS_LOG_S, 0
        while True:
            try:
                if time.monotonic() >= next_log and self._step_no > logged_step:
                    next_log, logged_step = time.monotonic() + STATS_LOG_S, self._step_no
                    log.info("stats %s", summary(self._step_no, self.metrics.stats.window()))
                await sched.wait_for_work()
                started = time.perf_counter()
                sched.drop_cancelled()
                sched.admit()
                self._set_running(len(sched.running))
                if not sched.running:
                    await self._release_now()
                    continue
                await self._step(list(sched.running), started)
            except Exception as e:
                # A bug must not strand the clients: fail every request (the waiting ones too, or
                # a failing admit would fail again at once), pause briefly, go on.
                log.exception("step loop iteration failed")
                self.fail_all(grpc.StatusCode.INTERNAL, f"coordinator: {type(e).__name__}: {e}")
                await asyncio.sleep(0.1)

    def set_draft_down(self, reason: str) -> None:
        if not self.draft_up:
            return
        log.warning("draft server lost (%s); continuing by plain decoding", reason)
        self.draft_up = False
        self.draft.reset()
        for seq in self.scheduler.running:
            if seq.use_draft:
                seq.draft_resync = True
        if self._check_draft is not None and (self._probe is None or self._probe.done()):
            self._probe = asyncio.create_task(self._probe_draft())

    async def _probe_draft(self) -> None:
        while True:
            await asyncio.sleep(self.config.draft_retry_s)
            try:
                await self._check_draft()
            except Exception as e:
                log.info("draft server still unavailable: %s", _describe(e))
                continue
            log.warning("draft server back; speculation resumes")
            self.scheduler.release_draft |= self.draft_orphans
            self.draft_orphans = set()
            self.draft_up = True
            self.scheduler.wake()  # an idle loop sends the orphans' Release now
            return

    # --- one step ----------------------------------------------------------------------------
    def _plan(self, seq: Sequence, batch: int, chunk: int) -> Plan:
        """chunk: the prompt tokens this sequence may send in this step."""
        if seq.prefilling and len(seq.target_pending) > chunk:
            return Plan(seq, seq.target_pending[:chunk], partial=True)
        return Plan(seq, list(seq.target_pending), num_draft=self._num_draft(seq, batch))

    def _plans(self, seqs: list[Sequence]) -> list[Plan]:
        """The step's plans. --prefill-chunk bounds the prompt tokens of the whole step (a step of
        several joining prompts stays within the target's prefill graph buckets, and the decode
        of the others is not held up by more than one chunk): prompts take it in batch order, and a
        prompt left without any this step sits the step out. Decode and verify sequences always
        take part."""
        budget = self.config.prefill_chunk
        plans = []
        for seq in seqs:
            if seq.prefilling and budget <= 0:
                continue
            plans.append(self._plan(seq, len(seqs), budget))
            if seq.prefilling:
                budget -= len(plans[-1].target_new)
        return plans

    def _num_draft(self, seq: Sequence, batch: int) -> int:
        cfg = self.config
        if not (seq.use_draft and self.draft_up) or 0 < cfg.spec_max_batch < batch:
            # Above --spec-max-batch the step decodes plainly; the draft catches up on the tokens
            # it missed (draft_pending) at the next step that drafts.
            return 0
        alpha, c = self._policy_inputs
        k = choose_num_draft(requested=seq.params.num_draft, policy=cfg.gamma_policy,
                             default=cfg.num_draft, max_gamma=cfg.max_num_draft,
                             accepted=seq.accepted, rejections=seq.rejections,
                             global_alpha=alpha, c=c)
        # More drafts than tokens the sequence may still emit are wasted (the target adds one);
        # the draft server must also stay within its own length limit.
        k = min(k, seq.remaining - 1)
        if self.draft_max_len:
            k = min(k, self.draft_max_len - seq.num_tokens)
        for limit in (self.draft_max_num_draft, self.target_max_num_draft):
            if limit:
                k = min(k, limit)
        return max(k, 0)

    async def _step(self, seqs: list[Sequence], started: float) -> None:
        self._step_no += 1
        self.busy_poll.kick()
        if self.config.gamma_policy == "auto":
            stats = self.metrics.stats
            window = stats.window()
            self._policy_inputs = (window.alpha, stats.c.get(bucket_for(len(seqs), stats.buckets), window.c))
        plans = self._plans(seqs)
        seqs = [p.seq for p in plans]
        if self.pipeline:
            self._take_ahead(plans)
        t0 = time.perf_counter()
        # For the statistics: whether the step was to speculate (a failed Propose leaves every
        # num_draft 0, which is no plain step), and the most drafts its Propose asks of a sequence.
        planned = (any(p.num_draft > 0 for p in plans),
                   max((p.num_draft for p in plans if not p.ahead), default=0))
        # The Verify is built while the draft works (once the Propose is written), but for the
        # drafts; with no Propose to send, here.
        built: list = []  # [VerifyRequest, its seqs' messages in plan order]
        draft_timing = await self._propose(plans, functools.partial(self._verify_request_early, plans, built))
        t1 = time.perf_counter()
        self._verify_request(plans, built)   # (built already, or raises here: the step fails, not the draft)
        request = built[0]
        for p, msg in zip(plans, built[1]):
            if p.drafts:
                # The draft's bytes are the packed drafts (checked_proposal unpacked them).
                msg.draft_tokens = p.draft_bytes if p.draft_bytes is not None else pack_ids(p.drafts)
            if p.probs is not None:
                msg.draft_probs.CopyFrom(p.probs)  # as received: exactness
        sched = self.scheduler
        request.release.extend(sorted(sched.release_target))
        sched.release_target.clear()
        # Pipelined: the draft drafts the next step while the target verifies this one.
        ahead = asyncio.create_task(self._extend(plans, len(seqs))) if self.pipeline and self.draft_up else None
        try:
            await self._verify(plans, request, seqs, started, t0, t1, draft_timing, ahead, planned)
        finally:
            if ahead is not None and not ahead.done():
                await ahead  # one request at a time on the draft stream: the next step waits for it

    def _verify_request(self, plans: list[Plan], built: list) -> None:
        """The step's VerifyRequest without drafts and releases, and its seqs' messages in plan
        order, into `built` (once: it may be called again when the Propose goes again over gRPC).
        Nothing it reads changes while the draft works: the target's side of a sequence moves only
        when a Verify's answer is applied."""
        if built:
            return
        request = pb.VerifyRequest(step=self._step_no)
        msgs = []  # (kept: iterating request.seqs after the draft's answer makes a wrapper per message)
        for p in plans:
            msg = request.seqs.add(seq_id=p.seq.seq_id, new_tokens=pack_ids(p.target_new), sampling=sampling_pb(p.seq))
            if p.partial:  # (false flags are not passed: each keyword costs a step at large batches)
                msg.partial_prefill = True
            if p.seq.target_first:
                msg.first = True
            msgs.append(msg)
        built += (request, msgs)

    def _verify_request_early(self, plans: list[Plan], built: list) -> None:
        """_verify_request from inside the draft's call: a failure there is not the draft's (it
        would count as the draft failing and take it down); the build after the call raises it."""
        try:
            self._verify_request(plans, built)
        except Exception:
            built.clear()

    async def _verify(self, plans: list[Plan], request: pb.VerifyRequest, seqs: list[Sequence],
                      started: float, t0: float, t1: float, draft_timing, ahead,
                      planned: tuple[bool, int]) -> None:
        sched = self.scheduler
        try:
            response = await self.target.step(request, timeout=self.config.target_timeout_s)
        except Exception as e:
            # The target's state is unknown: free what it may hold and, once it answers again,
            # resend the batch from the start (`first` makes that right whatever it still holds).
            sched.release_target.update(request.release)
            await self._target_lost(seqs, f"target server failed: {_describe(e)}")
            return
        t2 = time.perf_counter()
        if len(response.results) != len(plans):
            self._abort_all(seqs, grpc.StatusCode.INTERNAL,
                            f"target answered {len(response.results)} results for {len(plans)} sequences")
            return
        confirms: list[tuple[Sequence, list[int]]] = []
        outcomes = [self._apply(p, r, confirms) for p, r in zip(plans, response.results)]
        t3 = time.perf_counter()
        stages = {"schedule": t0 - started, "verify": t2 - t1, "emit": t3 - t2}
        if draft_timing is not None:
            stages["propose"] = t1 - t0
        if ahead is not None:
            await ahead  # its proposals are merged before the emitted tokens are matched against them
            stages["ahead"] = time.perf_counter() - t3
        for seq, tokens in confirms:
            seq.draft_confirm(tokens)
        # Off the critical path: the step's statistics (a few hundred us of Python per step on
        # a slow host) are recorded once the next step's Propose is on its way, when the loop
        # first waits; the γ policy then reads statistics one step old. (Only the step's time is
        # taken here; what is derived from the plans and outcomes is worked out then.)
        asyncio.get_running_loop().call_soon(self._observe_step, outcomes, plans, time.perf_counter() - started,
                                             stages, draft_timing, response.timing, planned)
        self._set_running(len(sched.running))

    def _observe_step(self, outcomes: list[tuple[int, int, int]], plans: list[Plan], step_seconds: float,
                      stages: dict, draft_timing, target_timing, planned: tuple[bool, int]) -> None:
        drafted, accepted, emitted = zip(*outcomes)
        planned_spec, gamma = planned
        self.metrics.observe_step(
            drafted, accepted, emitted, step_seconds=step_seconds, stage_seconds=stages,
            has_prefill=any(p.partial or len(p.target_new) > 1 or p.draft_prefill for p in plans),
            draft_timing=draft_timing, target_timing=target_timing, planned_spec=planned_spec,
            propose_gamma=gamma)

    def _set_running(self, n: int) -> None:
        """The running-sequences gauge, set only when it changes (twice a step otherwise, ~2 us each
        on the step's critical path)."""
        if n != self._running_shown:
            self._running_shown = n
            self.metrics.set_running(n)

    async def _propose(self, plans: list[Plan], on_sent=None) -> pb.StepTiming | None:
        """The draft's part of the step; on return every plan's drafts are set (or num_draft is 0).
        on_sent: ModelServer.step's (not called when no Propose goes out)."""
        sched = self.scheduler
        drafting = [p for p in plans if p.num_draft > 0 and not p.ahead]
        if not drafting:
            return None
        # Prompts being prefilled in chunks go to the draft chunk by chunk too (num_draft 0: it
        # only appends), in the Propose the decoding sequences send anyway: else the draft took a
        # whole prompt in the step of its last chunk, one long forward that held up every other
        # sequence of that step. Steps without a decoding sequence send no Propose for this.
        # Only a sequence that will draft once its prompt is in (_num_draft > 0: not past the
        # draft's max_model_len, more than one token to go) is worth a draft prefill.
        batch = len(sched.running)
        appending = [p for p in plans if p.partial and p.seq.draft_pending and self._num_draft(p.seq, batch) > 0]
        request = pb.ProposeRequest(step=self._step_no)
        for p in drafting + appending:
            seq = p.seq
            if seq.draft_resync:  # the server restarted or failed: release and start it afresh
                if seq.draft_holds:
                    sched.release_draft.add(seq.seq_id)
                seq.restart_draft()
                seq.draft_resync = seq.draft_holds = False
            if p.partial:  # the draft takes what the target takes (or less, if it lags)
                new_tokens = seq.draft_pending[:len(p.target_new)]
                seq.draft_pending = seq.draft_pending[len(new_tokens):]
            else:
                new_tokens = seq.draft_pending
            # A decode step feeds the draft 1 or 2 tokens (the correction; or the last draft and the
            # bonus token); more, or a fresh start, is a prefill the step's timing must not count.
            p.draft_prefill = not seq.draft_holds or len(new_tokens) > 2
            request.seqs.add(seq_id=seq.seq_id, keep=seq.draft_keep,
                             new_tokens=pack_ids(new_tokens), num_draft=p.num_draft,
                             sampling=sampling_pb(seq), first=not seq.draft_holds)
            seq.draft_holds = True  # from here on the draft may hold it, whatever happens
            if p.partial:
                # An append proposes nothing: the draft now holds the kept drafts and these tokens
                # as confirmed, and no proposal; the next keep counts from here. (keep > 0 when
                # the target lost a decoding sequence and its resend from the start is chunked.)
                seq.draft_keep, seq.draft_prop = 0, []
        request.release.extend(sorted(sched.release_draft))
        sched.release_draft.clear()
        sent = drafting + appending
        try:
            response = await self.draft.step(request, timeout=self.config.draft_timeout_s, on_sent=on_sent)
        except Exception as e:  # whatever the draft does wrong, the step goes on without it
            sched.release_draft.update(request.release)
            self.set_draft_down(_describe(e))
            for p in drafting:
                p.num_draft = 0
            return None
        if len(response.results) != len(sent):
            self.set_draft_down(f"{len(response.results)} results for {len(sent)} sequences")
            for p in drafting:
                p.num_draft = 0
            return None
        for p, r in zip(sent, response.results):
            proposal = self._proposal(p.seq, r, p.num_draft)
            if proposal is None:
                p.num_draft = 0
                continue
            if p.partial:
                continue  # appended: nothing proposed, nothing to mirror
            p.drafts, p.probs = proposal
            p.draft_bytes = r.tokens
            p.seq.draft_proposed(p.drafts, rows=None if p.probs is None else self._rows(p.probs))
        return response.timing

    def _proposal(self, seq: Sequence, r: pb.DraftResult, num_draft: int):
        """A draft result's (drafts, probs), checked; None when the sequence goes without drafts
        this step (the draft lost it: resent from the start next time; or it failed for it: the
        sequence goes on by plain decoding)."""
        if r.HasField("error") and r.error.code == NOT_FOUND and seq.draft_resends < MAX_DRAFT_RESENDS:
            # The draft lost it (restarted between steps, or dropped it): no drafts this
            # step, and the next proposal sends it afresh (prompt + output, with `first`).
            self.metrics.count_error("NOT_FOUND")
            log.warning("draft lost sequence %d; resending it from the start", seq.seq_id)
            seq.draft_resends += 1
            seq.draft_holds, seq.draft_resync = False, True
            return None
        try:
            if r.HasField("error"):
                raise BadProposal(r.error.message or "error without a message")
            proposal = checked_proposal(r, seq.seq_id, num_draft, self.vocab_size,
                                        sampled=seq.params.sampling.temperature > 0 and num_draft > 0)
        except BadProposal as e:
            # This sequence goes on without the draft; the rest of the batch is unaffected.
            self.metrics.count_error(status_from_code(r.error.code).name if r.error.code else "INTERNAL")
            self._draft_failed(seq, str(e))
            return None
        seq.draft_resends = 0
        return proposal

    def _draft_failed(self, seq: Sequence, reason: str) -> None:
        """The draft failed for this sequence: it goes on by plain decoding (exact), and the draft
        server releases it."""
        log.warning("draft failed for sequence %d: %s", seq.seq_id, reason)
        seq.use_draft = False
        self.scheduler.release_draft.add(seq.seq_id)
        self.scheduler.drop_draft(seq)
        seq.draft_holds = False

    # --- pipelined speculation (--pipeline) --------------------------------------------------
    def _pipelined(self, seq: Sequence) -> bool:
        return seq.use_draft and seq.draft_holds and not seq.draft_resync and not seq.pipeline_refused

    def _rows(self, probs: pb.Probs | None) -> list | None:
        """Per drafted token (its proposal's Probs, its row), kept only where the loop pipelines:
        a sampled sequence verifies a pipelined proposal's rows over two steps. Rows are cut
        when a step sends them (_take_ahead), off the path of the step that drafted them."""
        return [(probs, i) for i in range(probs.rows)] if probs is not None and self.pipeline else None

    def _take_ahead(self, plans: list[Plan]) -> None:
        """Sequences whose last pipelined proposal is still on track (the target accepted every
        draft and its next token was the draft's first guess) verify its rest: no Propose."""
        n = 0
        for p in plans:
            if p.num_draft and self._pipelined(p.seq):
                ahead = p.seq.draft_ahead[:p.num_draft]
                if not ahead:
                    continue
                probs = None
                if p.seq.params.sampling.temperature > 0:
                    # The target needs the distribution each draft was drawn from.
                    rows = p.seq.draft_ahead_rows(len(ahead))
                    if any(r is None for r in rows):
                        continue
                    probs = probs_join([probs_row(m, i) for m, i in rows])
                p.drafts, p.num_draft, p.probs, p.ahead = ahead, len(ahead), probs, True
                n += 1
        self.metrics.count_pipelined(n)

    async def _extend(self, plans: list[Plan], batch: int) -> None:
        """While the target verifies: the draft drafts after each sequence's proposal, its first
        token a guess of the target's next token and the rest the next step's drafts (Propose with
        `extend`; a sampled sequence's come with their distributions, which _take_ahead passes on
        row by row). Never raises: a failure is the draft failing, as in _propose."""
        sched = self.scheduler
        request = pb.ProposeRequest(step=self._step_no)
        extending = []
        for p in plans:
            seq = p.seq
            if not (p.num_draft and self._pipelined(seq)) or seq.draft_pending:
                continue
            unconfirmed = len(seq.draft_prop) - seq.draft_keep
            k = min(self._num_draft(seq, batch) + 1, seq.remaining - 1 - unconfirmed)
            if self.draft_max_len:
                k = min(k, self.draft_max_len - seq.num_tokens - unconfirmed)
            if self.draft_max_num_draft:
                k = min(k, self.draft_max_num_draft)
            if k < 2:  # a guess and at least one draft
                continue
            request.seqs.add(seq_id=seq.seq_id, keep=seq.draft_keep, num_draft=k,
                             sampling=sampling_pb(seq), extend=True)
            extending.append((seq, k))
        if not extending:
            return
        request.release.extend(sorted(sched.release_draft))
        sched.release_draft.clear()
        try:
            response = await self.draft.step(request, timeout=self.config.draft_timeout_s)
        except Exception as e:
            sched.release_draft.update(request.release)
            self.set_draft_down(_describe(e))
            return
        if len(response.results) != len(extending):
            self.set_draft_down(f"{len(response.results)} results for {len(extending)} sequences")
            return
        for (seq, k), r in zip(extending, response.results):
            if seq.done:
                continue  # finished meanwhile: released at the next draft call
            if r.error.code and r.error.code != NOT_FOUND:
                # The draft refused the extension and kept its state: the sequence's drafts come
                # from Propose from now on, and it keeps speculating.
                self.metrics.count_error(status_from_code(r.error.code).name)
                log.warning("draft refused to extend sequence %d (%s); not pipelining it", seq.seq_id,
                            r.error.message)
                seq.pipeline_refused = True
                continue
            proposal = self._proposal(seq, r, k)
            if proposal is not None:
                seq.draft_proposed(proposal[0], extend=True, rows=self._rows(proposal[1]))

    def _apply(self, p: Plan, r: pb.VerifyResult, confirms: list) -> tuple[int, int, int]:
        """Applies one sequence's verify result; returns its (drafted, accepted, emitted) for the
        step's statistics, all 0 when nothing was verified (prefill chunk, error, cancelled).
        The emitted tokens go to `confirms` for the draft's bookkeeping, done after the step's
        pipelined proposal is in."""
        seq = p.seq
        if seq.done or seq.cancelled:  # cancelled while the step was in flight: retired next boundary
            return 0, 0, 0
        if r.HasField("error") and r.error.code:
            self.metrics.count_error(status_from_code(r.error.code).name)
            if r.error.code == NOT_FOUND:
                self._resend_target(seq, f"target: {r.error.message}")
            elif p.drafts and r.error.code == INVALID_ARGUMENT and DRAFT_FIELD.match(r.error.message):
                # The target refused what the draft sent (probabilities the coordinator does not
                # scan, e.g. NaN in a dense row) and changed nothing: the draft failed, not the
                # request. The sequence goes on without it from the same tokens, as after a bad
                # proposal.
                self._draft_failed(seq, f"the target refused its drafts: {r.error.message}")
            else:
                self._abort(seq, status_from_code(r.error.code), f"target: {r.error.message}")
            return 0, 0, 0
        seq.target_first = False
        if p.partial:
            seq.target_pending = seq.target_pending[len(p.target_new):]
            return 0, 0, 0
        accepted, next_token, drafts = r.accepted, r.next_token, p.drafts  # (each field read once)
        if not 0 <= accepted <= len(drafts) or not 0 <= next_token < self.vocab_size:
            self.metrics.count_error("INTERNAL")
            self._abort(seq, grpc.StatusCode.INTERNAL,
                        f"target returned accepted={accepted} next_token={next_token} "
                        f"for {len(drafts)} drafts")
            return 0, 0, 0
        tokens = drafts[:accepted] + [next_token]
        seq.target_pending = [next_token]
        if seq.use_draft:
            confirms.append((seq, tokens))
        num_draft = p.num_draft
        seq.target_resends = 0
        seq.steps += 1
        seq.drafted += num_draft
        seq.accepted += accepted
        seq.rejections += accepted < num_draft
        chunk = seq.emit(tokens)
        if chunk.finish is not None:
            self.scheduler.retire(seq)  # leaves the batch before the client sees the end
        seq.queue.put_nowait(chunk)
        return num_draft, accepted, len(chunk.token_ids)

    # --- failures and releases ---------------------------------------------------------------
    async def _target_lost(self, seqs: list[Sequence], reason: str) -> None:
        """The target step failed as a whole: wait (bounded) for the target to answer Info again,
        then resend each sequence of the step from the start; fail them if it does not come back."""
        live = [seq for seq in seqs if not seq.done]
        timeout = self.config.connect_timeout_s
        log.warning("%s; waiting up to %.0fs for it, then resending %d sequences from the start",
                    reason, timeout, len(live))
        try:
            info = await self.target.wait_ready(timeout)
        except ConnectionError as e:
            self._abort_all(live, grpc.StatusCode.UNAVAILABLE, f"{reason}; not back: {e}")
            return
        problem = self._target_back(info) if self._target_back is not None else None
        if problem is not None:
            self._abort_all(live, grpc.StatusCode.FAILED_PRECONDITION, f"{reason}; {problem}")
            return
        for seq in live:
            self._resend_target(seq, reason)

    def _resend_target(self, seq: Sequence, reason: str) -> None:
        if seq.done:
            return
        if seq.target_resends >= MAX_TARGET_RESENDS:
            message = (f"{reason}; the target lost sequence {seq.seq_id} again after "
                       f"{seq.target_resends} resends from the start; giving up")
            log.warning("%s", message)
            self._abort(seq, grpc.StatusCode.UNAVAILABLE, message)
            return
        seq.restart_target()
        log.warning("%s; resending sequence %d from the start (%d tokens)", reason, seq.seq_id,
                    len(seq.target_pending))

    def _abort(self, seq: Sequence, code: grpc.StatusCode, message: str) -> None:
        self.scheduler.retire(seq)
        seq.queue.put_nowait(Abort(code.value[0], message))

    def _abort_all(self, seqs: list[Sequence], code: grpc.StatusCode, message: str) -> None:
        for seq in seqs:
            if not seq.done:
                self._abort(seq, code, message)

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        """Ends every running and waiting request with `code`."""
        self._abort_all(list(self.scheduler.running) + list(self.scheduler.waiting), code, message)

    async def _release_now(self) -> None:
        """Idle: free finished sequences with Release calls instead of waiting for a next step.
        Ids whose Release fails are kept: the target's for a retry after a backoff (or the next
        step's `release`), the draft's until the draft is back."""
        sched = self.scheduler
        if sched.release_draft and not self.draft_up:
            # Kept until the draft is back (it may only have been slow, not restarted).
            self.draft_orphans |= sched.release_draft
            sched.release_draft.clear()
        if sched.release_draft:
            batch = set(sched.release_draft)
            sched.release_draft.clear()
            try:
                await self.draft.release(batch)
            except Exception as e:
                self.draft_orphans |= batch
                self.set_draft_down(f"Release failed: {_describe(e)}")
        if sched.release_target:
            batch = set(sched.release_target)
            sched.release_target.clear()
            try:
                await self.target.release(batch)
            except Exception as e:
                sched.release_target |= batch
                log.warning("release on the target server failed (%s); retrying in %.1fs",
                            _describe(e), self._release_retry_s)
                await sched.wait_for_requests(self._release_retry_s)
                self._release_retry_s = min(2 * self._release_retry_s, RELEASE_RETRY_S[1])
                return
            self._release_retry_s = RELEASE_RETRY_S[0]


def summary(steps: int, w: WindowStats) -> str:
    """The periodic log line. alpha is Leviathan's per-token α (accepted / (accepted + rejections),
    the specdec_alpha gauge); accepted/drafted is specdec_acceptance_ratio."""
    def f(x):
        return "-" if x is None else f"{x:.3f}"
    return (f"steps={steps} alpha={f(w.alpha)} accepted/drafted={f(w.acceptance_ratio)} "
            f"tau={f(w.mean_accepted_length)} gamma={f(w.mean_draft_length)} c={f(w.c)} "
            f"c_system={f(w.c_system)} expected_speedup={f(w.expected_speedup)} "
            f"measured_speedup={f(w.measured_speedup)}")


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__
