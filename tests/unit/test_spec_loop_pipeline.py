"""Pipelined speculation (--pipeline) in the coordinator's step loop, against the in-process fake
servers of test_spec_loop_faults: while the target verifies a step, the draft extends its
proposal; a step whose drafts were all accepted and whose next token the draft guessed verifies
the extension with no Propose. The output stays exactly plain greedy decoding whatever the draft
guesses, sampled requests are not pipelined, and a draft failing mid-pipeline degrades as usual."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.sequence import Finish
from protos import specdec_pb2 as pb
from tests.unit.test_spec_loop_faults import (NEW, PROMPT, V, FakeDraft, collect, make_loop, model, new_seq,
                                              plain_greedy, rpc_error, tokenizer, until)


def noisy(ctx: list[int]) -> int:
    """model() except at every ninth position: rejections, right and wrong guesses all happen."""
    return model(ctx) if len(ctx) % 9 else (model(ctx) + 1) % V


def run(tmp_path, draft: FakeDraft, temperatures=(0.0, 0.0, 0.7), pipeline=True, max_new=NEW):
    async def main():
        loop, sched, target = make_loop(draft, pipeline="on" if pipeline else "off")
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        seqs = [new_seq(tok, i + 1, t, max_new_tokens=max_new) for i, t in enumerate(temperatures)]
        for seq in seqs:
            sched.submit(seq)
        try:
            results = await asyncio.gather(*(collect(s) for s in seqs))
            await until(lambda: not draft.held and not target.held)  # everything released
        finally:
            task.cancel()
        return results, seqs, target, loop
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
    assert extends and all(s.seq_id in (1, 2) for s in extends)  # greedy sequences only
    hits = pipelined_steps(loop)
    steps = sum(seq.steps for seq in seqs[:2])
    if draft_model is model:
        # Every guess is right: after the first step, no greedy step waits for a Propose.
        assert hits == steps - 2
        # ... and each of those steps verified the right continuation: nothing was rejected.
        sample = loop.metrics.registry.get_sample_value
        assert sample("specdec_rejections_total") == 0
        assert sample("specdec_accepted_tokens_total") == sample("specdec_draft_tokens_total") > 0
        proposes = [r for r in draft.requests if any(not s.extend for s in r.seqs)]
        assert all({s.seq_id for s in r.seqs if not s.extend} <= {3} for r in proposes[1:])
    else:
        assert 0 < hits < steps - 2
    assert target.accepted > 0


def test_pipeline_off_sends_no_extend(tmp_path):
    draft = FakeDraft(draft_model=noisy)
    results, _, _, loop = run(tmp_path, draft, pipeline=False)
    assert all(tokens == plain_greedy(PROMPT, NEW) for tokens, _ in results)
    assert not any(s.extend for r in draft.requests for s in r.seqs) and pipelined_steps(loop) == 0


def test_short_budget_does_not_extend_past_it(tmp_path):
    # 3 new tokens: the first step may emit all of them; an extension would only waste draft KV.
    draft = FakeDraft()
    results, _, _, _ = run(tmp_path, draft, temperatures=(0.0,), max_new=3)
    assert results[0][0] == plain_greedy(PROMPT, 3)
    for r in draft.requests:
        for s in r.seqs:
            assert not s.extend or s.num_draft <= 2


def test_draft_failing_during_extend_degrades_to_plain(tmp_path):
    """The draft server fails on an extend: the step still completes from the target's answer,
    speculation stops (the draft is probed again), and the output is exact."""
    class FailingOnExtend(FakeDraft):
        failed = False

        async def step(self, request: pb.ProposeRequest, timeout=None):
            if not self.failed and any(s.extend for s in request.seqs) and len(self.requests) > 3:
                self.failed = True
                self.requests.append(request)
                raise rpc_error()
            return await super().step(request, timeout)

    draft = FailingOnExtend(draft_model=noisy)
    results, _, target, _ = run(tmp_path, draft, temperatures=(0.0, 0.0))
    assert draft.failed
    for tokens, end in results:
        assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW)
    assert not target.violations and not draft.violations


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
