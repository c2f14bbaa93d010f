"""Pipelined speculation (--pipeline) in the coordinator's step loop, against the in-process fake
servers of test_spec_loop_faults: while the target verifies a step, the draft extends its
proposal; a step whose drafts were all accepted and whose next token the draft guessed verifies
the extension with no Propose. The output stays exactly plain greedy decoding whatever the draft
guesses, a sampled request's distributions reach the target row by row with its drafts, and a
draft failing mid-pipeline degrades as usual."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.sequence import Finish
from protos import specdec_pb2 as pb
from protos.wire import unpack_ids
from tests.unit.test_spec_loop_faults import (NEW, PROMPT, V, FakeDraft, FakeTarget, collect, make_loop, model,
                                              new_seq, plain_greedy, rpc_error, tokenizer, until)


def noisy(ctx: list[int]) -> int:
    """model() except at every ninth position: rejections, right and wrong guesses all happen."""
    return model(ctx) if len(ctx) % 9 else (model(ctx) + 1) % V


def run(tmp_path, draft: FakeDraft, temperatures=(0.0, 0.0, 0.7), pipeline=True, max_new=NEW, target=None):
    async def main():
        loop, sched, target_ = make_loop(draft, target, pipeline="on" if pipeline else "off")
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        seqs = [new_seq(tok, i + 1, t, max_new_tokens=max_new) for i, t in enumerate(temperatures)]
        for seq in seqs:
            sched.submit(seq)
        try:
            results = await asyncio.gather(*(collect(s) for s in seqs))
            await until(lambda: not draft.held and not target_.held)  # everything released
        finally:
            task.cancel()
        return results, seqs, target_, loop
    return asyncio.run(main())


def pipelined_steps(loop) -> float:
    return loop.metrics.registry.get_sample_value("specdec_pipelined_steps_total") or 0.0


@pytest.mark.parametrize("delay", [0.0, 0.002], ids=["draft_first", "target_first"])
@pytest.mark.parametrize("draft_model", [model, noisy], ids=["exact", "noisy"])
def test_pipelined_output_is_plain_greedy(tmp_path, draft_model, delay):
    # delay: the extension arrives before the target's answer, or after it.
    draft = FakeDraft(draft_model=draft_model, delay=delay)
    results, seqs, target, loop = run(tmp_path, draft)
    for tokens, end in results:
        assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW)
    assert not target.violations and not draft.violations
    extends = [s for r in draft.requests for s in r.seqs if s.extend]
    assert {s.seq_id for s in extends} == {1, 2, 3}  # greedy and sampled (seq 3, temperature 0.7)
    hits = pipelined_steps(loop)
    steps = sum(seq.steps for seq in seqs)
    if draft_model is model:
        # Every guess is right: after the first step, no step waits for a Propose (the sampled
        # sequence's one-hot rows passed the target's check of rows against drafts).
        assert hits == steps - 3
        # ... and each of those steps verified the right continuation: nothing was rejected.
        sample = loop.metrics.registry.get_sample_value
        assert sample("specdec_rejections_total") == 0
        assert sample("specdec_accepted_tokens_total") == sample("specdec_draft_tokens_total") > 0
        proposes = [r for r in draft.requests if any(not s.extend for s in r.seqs)]
        assert len(proposes) == 1
    else:
        assert 0 < hits < steps - 3
    assert target.accepted > 0


def test_pipeline_off_sends_no_extend(tmp_path):
    draft = FakeDraft(draft_model=noisy)
    results, _, _, loop = run(tmp_path, draft, pipeline=False)
    assert all(tokens == plain_greedy(PROMPT, NEW) for tokens, _ in results)
    assert not any(s.extend for r in draft.requests for s in r.seqs) and pipelined_steps(loop) == 0


def test_extensions_stay_within_the_request_budget(tmp_path):
    # 8 new tokens, γ = 4: the first step may emit 5, so the extension beside it may hold at most
    # 8 - 1 - 4 = 3 more tokens; the draft's KV stays within the scheduler's reservation.
    draft = FakeDraft()
    results, _, _, _ = run(tmp_path, draft, temperatures=(0.0,), max_new=8)
    assert results[0][0] == plain_greedy(PROMPT, 8)
    extends = [s.num_draft for r in draft.requests for s in r.seqs if s.extend]
    assert extends and min(extends) < 5  # an extension was cut short
    assert draft.longest[1] <= len(PROMPT) + 8 - 1
    assert not draft.violations


def test_extensions_ask_no_more_than_the_draft_server_takes(tmp_path):
    """The draft server's --max-num-draft (its Info) bounds every Propose, extensions included:
    γ = 4 and a limit of 4 make the extension 4 long (a guess + 3), not 5."""
    draft = FakeDraft(max_num_draft=4)

    async def main():
        loop, sched, target = make_loop(draft, pipeline="on")
        loop.draft_max_num_draft = 4
        task = asyncio.create_task(loop.run())
        seq = new_seq(tokenizer(tmp_path), 1)
        sched.submit(seq)
        try:
            out = await collect(seq)
        finally:
            task.cancel()
        return out, seq, loop
    (tokens, end), seq, loop = asyncio.run(main())
    assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW)
    sizes = {s.num_draft for r in draft.requests for s in r.seqs if s.extend}
    assert sizes and max(sizes) == 4 and seq.use_draft and not seq.pipeline_refused
    assert pipelined_steps(loop) > 0 and not draft.violations


def test_a_refused_extension_stops_pipelining_not_speculation(tmp_path):
    """A draft that refuses extensions (here: a limit the coordinator was not told): the sequence
    drafts through Propose from then on, and its output is exact."""
    draft = FakeDraft(max_num_draft=4)
    (results, seqs, target, loop) = run(tmp_path, draft, temperatures=(0.0,))
    tokens, end = results[0]
    assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW)
    seq = seqs[0]
    assert seq.pipeline_refused and seq.use_draft and pipelined_steps(loop) == 0
    extends = [r for r in draft.requests if any(s.extend for s in r.seqs)]
    assert len(extends) == 1  # refused once, never asked again
    assert target.accepted > 0 and not draft.violations


@pytest.mark.parametrize("after_apply", [False, True], ids=["before", "after_applying"])
def test_draft_failing_during_extend_degrades_and_recovers(tmp_path, after_apply):
    """The draft server's call fails during an extension, before or after it applied it (a
    timeout after the work): the step still completes from the target's answer, the draft is
    taken down and probed, and speculation resumes with the sequences sent afresh; exact output."""
    class FailingOnExtend(FakeDraft):
        failed_at = None

        async def step(self, request: pb.ProposeRequest, timeout=None, on_sent=None):
            if self.failed_at is None and any(s.extend for s in request.seqs) and len(self.requests) > 3:
                self.failed_at = len(self.requests)
                if after_apply:
                    await super().step(request, timeout)
                else:
                    self.requests.append(request)
                raise rpc_error()
            return await super().step(request, timeout)

    class SlowTarget(FakeTarget):  # 400 steps take longer than the draft's probe (every 50 ms)
        async def step(self, request, timeout=None, on_sent=None):
            await asyncio.sleep(0.001)
            return await super().step(request, timeout)

    draft = FailingOnExtend(draft_model=noisy)
    results, _, target, loop = run(tmp_path, draft, temperatures=(0.0, 0.0), max_new=400, target=SlowTarget())
    assert draft.failed_at is not None
    for tokens, end in results:
        assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, 400)
    later = draft.requests[draft.failed_at:]
    firsts = [s.seq_id for r in later for s in r.seqs if s.first]
    assert sorted(firsts) == [1, 2]  # after the probe, both sent afresh (the draft's state unknown)
    assert any(s.extend for r in later for s in r.seqs)  # and pipelined again
    assert loop.draft_up and not target.violations and not draft.violations


def test_target_failing_while_an_extension_is_in_flight(tmp_path):
    """The target's call fails while the draft still works on the step's extension: the loop
    waits for the extension before the next step's draft call (one call at a time on the draft's
    stream), resends the sequences to the target, and the output is exact."""
    class FailingOnce(FakeTarget):
        calls = 0

        async def step(self, request, timeout=None, on_sent=None):
            self.calls += 1
            if self.calls == 4:
                raise rpc_error()
            return await super().step(request, timeout)

    draft = FakeDraft(delay=0.003)
    results, seqs, target, _ = run(tmp_path, draft, temperatures=(0.0, 0.0), target=FailingOnce())
    assert target.calls > 4
    for tokens, end in results:
        assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW)
    assert not draft.violations and not target.violations


class Chaos(FakeDraft):
    """A draft that checks the coordinator's mirror on every message (the context a message
    implies must be the sequence's confirmed tokens), and fails in every way the loop handles."""

    def __init__(self, rng, seqs, **kw):
        super().__init__(**kw)
        self.rng, self.seqs = rng, seqs
        self.fail_p = self.lose_p = 0.0
        self.calls = 0

    async def step(self, request: pb.ProposeRequest, timeout=None, on_sent=None):
        self.calls += 1
        try:
            if self.calls > 1:
                self.violations.append(f"step {request.step} sent while another call was in flight")
            return await self._chaos_step(request, timeout)
        finally:
            self.calls -= 1

    async def _chaos_step(self, request: pb.ProposeRequest, timeout=None):
        for s in request.seqs:
            seq = self.seqs[s.seq_id]
            if s.first or s.seq_id not in self.held:
                continue
            before, proposal = self.proposals.get(s.seq_id, (self.held[s.seq_id], []))
            implied = before + proposal[:s.keep] + unpack_ids(s.new_tokens)
            truth = list(PROMPT) + seq.output
            # An extension is built before the target's answer is applied: a prefix of the truth.
            if implied != truth[:len(implied)] or (not s.extend and implied != truth):
                self.violations.append(f"seq {s.seq_id}: draft context {len(implied)} tokens, "
                                       f"confirmed {len(truth)}")
        if self.rng.random() < self.lose_p:  # the server restarted: it holds nothing
            self.held.clear()
            self.proposals.clear()
        if self.rng.random() < self.fail_p:
            if self.rng.random() < 0.5:
                await super().step(request, timeout)  # applied, then the call failed
            else:
                self.requests.append(request)
            raise rpc_error()
        if self.rng.random() < 0.5:
            await asyncio.sleep(self.rng.choice([0.0, 0.001, 0.003]))
        return await super().step(request, timeout)


class ChaosTarget(FakeTarget):
    def __init__(self, rng):
        super().__init__()
        self.rng = rng
        self.fail_p = self.lose_p = 0.0

    async def step(self, request: pb.VerifyRequest, timeout=None, on_sent=None):
        if self.rng.random() < self.fail_p:
            await asyncio.sleep(self.rng.choice([0.0, 0.002]))  # the extension may be in flight
            raise rpc_error()
        if self.rng.random() < self.lose_p and request.seqs:
            self.held.pop(self.rng.choice(list(request.seqs)).seq_id, None)
        if self.rng.random() < 0.5:
            await asyncio.sleep(self.rng.choice([0.0, 0.001, 0.002]))
        return await super().step(request, timeout)


@pytest.mark.parametrize("seed", range(30))
def test_pipelined_loop_under_faults_keeps_the_draft_in_step(tmp_path, seed):
    """Random batches, budgets, batch limits and delays; the draft and target fail, restart and
    lose sequences; a request may be cancelled. Every draft message implies exactly the confirmed
    tokens, no two draft calls overlap, every finished output is plain greedy decoding, nothing
    hangs and every KV block is released."""
    import random
    rng = random.Random(seed)

    async def main():
        seqs = {}
        draft = Chaos(rng, seqs, draft_model=rng.choice([model, noisy]), max_num_draft=rng.choice([0, 5, 8]))
        draft.fail_p, draft.lose_p = rng.choice([0.0, 0.04]), rng.choice([0.0, 0.03])
        target = ChaosTarget(rng)
        target.fail_p, target.lose_p = rng.choice([0.0, 0.03]), rng.choice([0.0, 0.03])
        loop, sched, _ = make_loop(draft, target, pipeline="on", spec_max_batch=rng.choice([0, 2, 3]),
                                   prefill_chunk=rng.choice([2, 512]))
        loop.draft_max_num_draft = draft.max_num_draft
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        batch = [new_seq(tok, i + 1, rng.choice([0.0, 0.0, 0.7]), max_new_tokens=rng.choice([1, 3, 8, 24, 40]))
                 for i in range(rng.randint(1, 5))]
        for seq in batch:
            seqs[seq.seq_id] = seq
            sched.submit(seq)
        # A client that goes away: the request is cancelled and its stream gets nothing more.
        cancelled = batch.pop() if len(batch) > 1 and rng.random() < 0.3 else None
        if cancelled is not None:
            asyncio.get_running_loop().call_later(rng.random() * 0.01, sched.cancel, cancelled)
        try:
            results = await asyncio.gather(*(collect(s, timeout=5) for s in batch))
            await until(lambda: not draft.held and not target.held)
        finally:
            task.cancel()
        return batch, results, draft, target
    batch, results, draft, target = asyncio.run(main())
    for seq, (tokens, end) in zip(batch, results):
        if isinstance(end, Finish):  # (an Abort: a server lost it more often than it may)
            assert tokens == plain_greedy(PROMPT, seq.params.max_new_tokens)
    assert not draft.violations and not target.violations


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_probability_rows_split_and_join_as_received(sparse):
    """A sampled proposal's distributions are verified over two steps: split into rows, joined
    again for the next step's drafts, byte for byte, each row still that draft's distribution."""
    import numpy as np
    import torch

    from coordinator.proposals import checked_proposal, probs_join, probs_row
    from protos.wire import pack_ids
    from specdec.sampling.transport import decode_probs, encode_probs

    gen = torch.Generator().manual_seed(3)
    w = torch.rand(5, V, generator=gen)
    w[w < (0.9 if sparse else 0.0)] = 0  # sparse: ~10% nonzero, one row empty but its token's
    w[2] = 0
    tokens = [int(row.argmax()) for row in w]
    w[2, 7] = 1.0
    tokens[2] = 7
    enc = encode_probs(w / w.sum(-1, keepdim=True), torch.float16, sparse=sparse)
    probs = pb.Probs(encoding=pb.ProbsEncoding.Value("PROBS_ENCODING_" + enc.encoding), rows=enc.rows,
                     vocab_size=enc.vocab_size, values=enc.values, indices=enc.indices,
                     row_lengths=enc.row_lengths)
    r = pb.DraftResult(seq_id=1, tokens=pack_ids(tokens), probs=probs)
    _, checked = checked_proposal(r, 1, 5, V, sampled=True)
    rows = [probs_row(checked, i) for i in range(checked.rows)]
    assert len(rows) == 5 and all(x.rows == 1 for x in rows)
    whole = decode_probs(probs.values, 5, V, enc.encoding, probs.indices, probs.row_lengths, dtype=torch.float32)
    for i, row in enumerate(rows):
        got = decode_probs(row.values, 1, V, enc.encoding, row.indices, row.row_lengths, dtype=torch.float32)
        assert torch.equal(got[0], whole[i])
    assert probs_join(rows) == probs
    with pytest.raises(ValueError, match="encodings"):  # rows of two proposals never mix
        probs_join([rows[0], pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_BF16 if sparse else
                                      pb.PROBS_ENCODING_SPARSE_FP16, rows=1, vocab_size=V)])
    tail = probs_join(rows[1:4])  # what a pipelined step sends: the rows after the guess
    checked_proposal(pb.DraftResult(seq_id=1, tokens=pack_ids(tokens[1:4]), probs=tail), 1, 3, V, sampled=True)
    assert np.array_equal(decode_probs(tail.values, 3, V, enc.encoding, tail.indices, tail.row_lengths,
                                       dtype=torch.float32).numpy(), whole[1:4].numpy())


def test_auto_pipelines_only_a_draft_on_a_gpu_of_its_own():
    from coordinator.app import pipeline_enabled

    def info(*uuids):
        return pb.ModelInfo(device_uuids=list(uuids))
    gpu0, gpu1 = "GPU-0b5c", "GPU-77aa"
    assert pipeline_enabled("auto", info(gpu0), info(gpu1))
    assert not pipeline_enabled("auto", info(gpu0), info(gpu0))   # one GPU shared (the compose one-GPU variant)
    assert not pipeline_enabled("auto", info(gpu0, gpu1), info(gpu1))  # the draft on a target rank's GPU
    assert not pipeline_enabled("auto", info(), info())            # CPU servers report no GPU
    assert not pipeline_enabled("auto", info(gpu0), None)          # no draft (yet)
    assert pipeline_enabled("on", info(), info()) and not pipeline_enabled("off", info(gpu0), info(gpu1))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_sampled_guess_is_confirmed_but_never_verified_as_a_draft(tmp_path, temperature):
    """A sampled extension's first token was drawn with the target's own uniform for its
    position: it may be confirmed (it equals the target's token), but it must never reach the
    target as a draft, e.g. after a lost verify, when the whole proposal is still unconfirmed."""
    seq = new_seq(tokenizer(tmp_path), 1, temperature)
    d, e = [11, 12, 13], [21, 22, 23]
    seq.draft_proposed(d)
    seq.draft_proposed(e, extend=True)        # beside the verify of d
    # The verify was lost: nothing confirmed. A greedy guess is a draft like any other.
    assert seq.draft_ahead == (d if temperature else d + e)
    seq.draft_confirm(d + [21])               # all of d accepted, the target's token was the guess
    assert seq.draft_ahead == [22, 23]
    seq.draft_proposed([31, 32], extend=True)  # beside the verify of [22, 23]: keep = 4
    seq.draft_confirm([22, 99])               # 23 rejected: the proposal is off track
    assert seq.draft_ahead == [] and seq.draft_pending == [99] and seq.draft_keep == 1
