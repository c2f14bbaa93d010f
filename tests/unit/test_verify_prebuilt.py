"""The step's VerifyRequest is built while the draft works (ModelServer.step's on_sent, called once
the Propose is written) and only the drafts and releases are added after the draft answers: the
requests the target gets are byte for byte those built after the answer, through prompts in
chunks, sampled sequences, a draft failing for a sequence, a sequence the target forgets (resent
with `first`) and a release. (ModelServer.step's on_sent against a real server:
tests/integration/test_step_channel.py.)"""
from __future__ import annotations

import asyncio

from coordinator.sequence import Abort, GenParams, Sampling, Sequence
from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from tests.unit.test_spec_loop_faults import PROMPT, FakeDraft, FakeTarget, make_loop, plain_greedy, tokenizer


class RecordingTarget(FakeTarget):
    """Keeps every Verify as bytes; forgets sequence `forget[1]` at step `forget[0]` (NOT_FOUND)."""

    def __init__(self, forget=(6, 2)):
        super().__init__()
        self.sent: list[bytes] = []
        self.forget = forget

    async def step(self, request, timeout=None, on_sent=None):
        self.sent.append(request.SerializeToString())
        if request.step == self.forget[0]:
            self.held.pop(self.forget[1], None)
        return await super().step(request, timeout)


class EarlyDraft(FakeDraft):
    """Calls on_sent as ModelServer does (after the write, before the answer), and records what the
    loop had built by then."""

    def __init__(self, loop_ref: list, **kw):
        super().__init__(**kw)
        self.loop_ref = loop_ref
        self.built_during: list[bool] = []

    async def step(self, request, timeout=None, on_sent=None):
        assert on_sent is not None
        on_sent()
        on_sent()  # (a resend over gRPC calls it again: nothing is built twice)
        await asyncio.sleep(0)
        return await super().step(request, timeout)


def spoil_seq_3(r, s):
    if s.seq_id == 3:
        r.tokens = pack_ids([10_000] * s.num_draft)   # outside the vocabulary: the draft failed for it


def run(tmp_path, early: bool) -> tuple[list[bytes], list[list[int]]]:
    tok = tokenizer(tmp_path)

    async def main():
        ref: list = []
        draft = EarlyDraft(ref, spoil=spoil_seq_3) if early else FakeDraft(spoil=spoil_seq_3)
        target = RecordingTarget()
        loop, sched, _ = make_loop(draft, target, prefill_chunk=4)
        ref.append(loop)
        long_prompt = tuple(range(3, 14))   # 11 tokens: three chunks of at most 4
        seqs = []
        for i, (prompt, temp) in enumerate([(PROMPT, 0.0), (long_prompt, 0.0), (PROMPT, 0.0), (PROMPT, 0.8)]):
            params = GenParams(request_id=str(i), prompt_ids=prompt, max_new_tokens=14 + i,
                               sampling=Sampling(temperature=temp, seed=i))
            seqs.append(Sequence(seq_id=i + 1, params=params, max_len=512, tokenizer=tok))
        task = asyncio.create_task(loop.run())
        for s in seqs:
            sched.submit(s)
        outs = []
        try:
            for s in seqs:
                got = []
                while True:
                    item = await asyncio.wait_for(s.queue.get(), 10)
                    assert not isinstance(item, Abort), item
                    got += item.token_ids
                    if item.finish is not None:
                        break
                outs.append(got)
        finally:
            task.cancel()
        assert not target.violations and not draft.violations
        return target.sent, outs, seqs
    sent, outs, seqs = asyncio.run(main())
    for s, got in zip(seqs, outs):
        if s.params.sampling.temperature == 0:
            assert got == plain_greedy(s.params.prompt_ids, s.params.max_new_tokens)
    return sent, outs


def test_the_target_gets_the_same_requests_whether_built_early_or_late(tmp_path):
    early, early_out = run(tmp_path, early=True)
    late, late_out = run(tmp_path, early=False)
    assert early == late and early_out == late_out
    requests = [pb.VerifyRequest.FromString(b) for b in early]
    seqs = [s for r in requests for s in r.seqs]
    # what the comparison covered
    assert any(s.partial_prefill for s in seqs)
    assert sum(s.first for s in seqs if s.seq_id == 2) == 2   # the prompt's first chunk, and the resend
    assert any(s.draft_tokens for s in seqs) and any(s.HasField("draft_probs") for s in seqs)
    assert all(not s.draft_tokens for s in seqs if s.seq_id == 3 and not s.first)   # its draft failed
    assert any(r.release for r in requests)   # finished sequences released in a later Verify
