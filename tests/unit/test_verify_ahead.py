"""TargetEngine.prepare_ahead (--verify-ahead): the step that usually follows is admitted and
staged before its request comes, and a verify that is that step takes it. Whatever comes instead
(other drafts counts, a release, a new sequence, a bad draft, a Release call) undoes it first. Either
way every answer and the KV afterwards are those of an engine that never prepares ahead: checked
step by step against one, eager and on the CPU stand-ins for CUDA graphs, with drafts that are
accepted in full, in part and not at all."""
from __future__ import annotations

import random

import pytest
import torch

from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from specdec.config import EngineConfig
from specdec.engine import Code, TargetEngine, VerifySeqInput
from specdec.kernels.triton_attention import TritonAttention
from target_server.servicer import expected_next
from tests.helpers.cpu_graphs import CpuGraphs
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import make_pair

PROMPTS = {1: [5, 17, 42, 99, 7, 3], 2: [8, 1, 300, 12], 3: [77, 76, 75, 74, 73, 72, 71]}
JOIN = (4, [9, 99, 199])
K = 3


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))[0]


def _engine(path, graphed) -> TargetEngine:
    if graphed == "cuda":   # real CUDA graphs and Triton kernels, fp32: the bits of eager steps
        engine = TargetEngine(EngineConfig(model=path, device="cuda", dtype=torch.float32, block_size=4,
                                           num_blocks=64, warmup_batch_sizes=(1, 2, 4)))
        engine.warm_up()
        assert engine.runner.graphs is not None
        return engine
    engine = TargetEngine(EngineConfig(model=path, block_size=4, num_blocks=64, warmup_batch_sizes=(1,)))
    if graphed:
        # (the Triton backend under the interpreter: its KV store skips a bucket's padding slots)
        engine.runner.backend = TritonAttention()
        engine.runner.graphs = CpuGraphs(engine.runner, max_model_len=engine.max_model_len,
                                         query_lens=engine.graph_query_lens(), batch_sizes=(1, 2, 4))
    return engine


def _continuations(path, n: int = 120, graphed=False) -> dict[int, list[int]]:
    """Each prompt's greedy continuation (plain steps on an engine of its own, on the CPU or, for
    "cuda", on the GPU): drafts made from it are accepted up to the first one changed."""
    engine = _engine(path, graphed=graphed if graphed == "cuda" else False)
    out = {}
    for seq_id, prompt in [*PROMPTS.items(), JOIN]:
        tokens = [engine.verify([VerifySeqInput(seq_id, prompt, first=True)]).outputs[0].next_token]
        while len(tokens) < n:
            tokens.append(engine.verify([VerifySeqInput(seq_id, tokens[-1:])]).outputs[0].next_token)
        out[seq_id] = tokens
        engine.release([seq_id])
    return out


def _kv(engine: TargetEngine) -> dict:
    return {s: engine.runner.num_tokens(s) for s in engine.runner.blocks.seq_ids()}


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA-graph case needs a GPU")])


@pytest.mark.parametrize("graphed", [False, True, CUDA])
def test_steps_staged_ahead_answer_as_steps_that_were_not(target_path, graphed):
    cont = _continuations(target_path, graphed=graphed)
    ref, ahead = _engine(target_path, graphed), _engine(target_path, graphed)
    rng = random.Random(5)
    emitted: dict[int, int] = {}      # tokens of the continuation emitted so far, per sequence
    nxt: dict[int, int] = {}          # the next token to send (the target's last answer)
    for e in (ref, ahead):
        outs = e.verify([VerifySeqInput(s, p, first=True) for s, p in PROMPTS.items()]).outputs
    for s, o in zip(PROMPTS, outs):
        emitted[s], nxt[s] = 1, o.next_token
    live = list(PROMPTS)
    for step in range(18):
        k = 2 if step == 5 else K                           # step 5: fewer drafts than staged
        release = []
        if step == 8:                                       # a sequence finished: released, gone
            live.remove(2)
            release = [2]
        seqs = []
        for s in live:
            # Drafts: the continuation from here, one of them changed (accepted up to it) or none.
            drafts = list(cont[s][emitted[s]:emitted[s] + k])
            cut = rng.randrange(k + 1)
            if cut < k:
                drafts[cut] = (drafts[cut] + 1) % 320
            if step == 14 and s == 1:
                drafts[0] = 320                             # outside the vocabulary: this one fails
            seqs.append(VerifySeqInput(s, [nxt[s]], drafts))
        if step == 11:                                      # a new sequence joins the step
            seqs.append(VerifySeqInput(JOIN[0], JOIN[1], first=True))
        if step == 16:                                      # a Release call between steps
            for e in (ref, ahead):
                e.release([99])
        want, got = ref.verify(seqs, release).outputs, ahead.verify(seqs, release).outputs
        assert [(o.seq_id, o.accepted, o.next_token, o.error) for o in got] == \
               [(o.seq_id, o.accepted, o.next_token, o.error) for o in want], step
        assert _kv(ahead) == _kv(ref) and ahead.num_free_blocks == ref.num_free_blocks, step
        for seq, o in zip(seqs, want):
            if o.error is not None:
                assert o.error.code == Code.INVALID_ARGUMENT and step == 14
                continue
            if seq.first:
                live.append(seq.seq_id)
                emitted[seq.seq_id] = 1
            else:
                assert o.accepted == next(i for i, (d, c) in enumerate(
                    zip(seq.draft_tokens + [-1], cont[seq.seq_id][emitted[seq.seq_id]:] + [-2])) if d != c)
                emitted[seq.seq_id] += o.accepted + 1
            assert o.next_token == cont[seq.seq_id][emitted[seq.seq_id] - 1]
            nxt[seq.seq_id] = o.next_token
        # What the servicer stages after answering (expected_next of the wire messages).
        request = pb.VerifyRequest(step=step)
        for seq in seqs:
            request.seqs.add(seq_id=seq.seq_id, new_tokens=pack_ids(seq.new_tokens),
                             draft_tokens=pack_ids(seq.draft_tokens))
        response = pb.VerifyResponse(step=step)
        for o in want:
            r = response.results.add(seq_id=o.seq_id, accepted=o.accepted, next_token=o.next_token)
            if o.error is not None:
                r.error.code = 3
        staged = ahead.prepare_ahead(expected_next(request, response))
        # Staging reserves the next step's KV; nothing else changes until a verify takes it.
        assert staged == all(o.error is None for o in want), step
    # Nothing is staged before step 0 (the prompts' step) nor before 15 (after 14's failure).
    # Taken: 1-4, 5 (fewer drafts than staged: the staged layout, the missing drafts never
    # accepted), 7, 8 (a staged sequence released with the request: scored, no answer, freed),
    # 9, 10, 12 (the joined sequence's first drafts: staged with the step's most, as the others),
    # 13, 17. Undone: 6 (more drafts than staged after 5), 11 (a join), 14 (a draft outside the
    # vocabulary), 16 (a Release call).
    assert ahead.ahead_taken == 12
    if graphed:   # the staged steps ran on the graphs
        assert ahead.runner.graphs.replays >= ahead.ahead_taken
    assert ahead.ahead_dropped == 4
    ahead.drop_ahead()                                      # the one staged after 17
    assert ahead.ahead_dropped == 5
    for e in (ref, ahead):
        e.release(list(e.runner.blocks.seq_ids()))
        assert e.num_free_blocks == e.runner.blocks.num_blocks and e.num_sequences() == 0


def test_expected_next_stages_nothing_it_cannot_know():
    def step(**seq):
        request = pb.VerifyRequest(step=1)
        request.seqs.add(seq_id=1, new_tokens=pack_ids([3]), draft_tokens=pack_ids([4, 5]))
        request.seqs.add(seq_id=2, new_tokens=pack_ids([6]), **seq)
        return request
    ok = pb.VerifyResponse(results=[pb.VerifyResult(seq_id=1, accepted=1, next_token=9),
                                    pb.VerifyResult(seq_id=2, next_token=11)])
    # (2 had no drafts: staged with the step's most, 2, which it may then leave unsent)
    assert expected_next(step(), ok) == [(1, 9, 2), (2, 11, 2)]
    assert expected_next(step(partial_prefill=True), ok) == []
    assert expected_next(step(sampling=pb.SamplingParams(temperature=0.7)), ok) == []
    failed = pb.VerifyResponse(results=[ok.results[0], pb.VerifyResult(seq_id=2, next_token=-1,
                                                                       error=pb.SeqError(code=3))])
    assert expected_next(step(), failed) == []


def test_a_step_staged_ahead_that_does_not_fit_stages_nothing(target_path):
    engine = _engine(target_path, graphed=False)
    engine.verify([VerifySeqInput(1, [1] * 250, first=True)])   # 63 of 64 blocks (4 tokens each)
    free = engine.num_free_blocks
    # 250 tokens held; the next token and 9 drafts need 2 more blocks, 1 is free.
    assert not engine.prepare_ahead([(1, 7, 9)])
    assert engine.num_free_blocks == free and engine.runner.num_tokens(1) == 250
    assert engine.prepare_ahead([(1, 7, 2)])                    # 253 tokens: fits the last block
    assert engine.num_free_blocks == free - 1
    engine.release([1])
    assert engine.num_free_blocks == engine.runner.blocks.num_blocks and engine.ahead_dropped == 1


@pytest.mark.parametrize("graphed", [False, True, CUDA])
def test_a_request_that_releases_a_staged_sequence_does_not_take_the_step(target_path, graphed):
    # The step staged for sequence 1 is the request's, but the request releases 1 first: as on an
    # engine that staged nothing, 1 is then unknown (NOT_FOUND) and nothing stays behind.
    ref, ahead = _engine(target_path, graphed), _engine(target_path, graphed)
    for e in (ref, ahead):
        nxt = e.verify([VerifySeqInput(1, PROMPTS[1], first=True)]).outputs[0].next_token
    assert ahead.prepare_ahead([(1, nxt, 2)])
    seqs = [VerifySeqInput(1, [nxt], [3, 4])]
    want, got = ref.verify(seqs, [1]).outputs[0], ahead.verify(seqs, [1]).outputs[0]
    assert got.error is not None and got.error.code == want.error.code == Code.NOT_FOUND
    assert ahead.ahead_taken == 0 and ahead.ahead_dropped == 1
    for e in (ref, ahead):
        assert e.num_sequences() == 0 and e.num_free_blocks == e.runner.blocks.num_blocks


@pytest.mark.parametrize("graphed", [False, True, CUDA])
def test_fewer_drafts_than_staged_and_released_sequences_take_the_staged_step(target_path, graphed):
    """Where a request ends: the staged step is taken when a sequence sends fewer drafts than
    staged (all of them right, so the answer is the row after its last real draft) or none, and
    when the request releases a staged sequence (finished): answers, KV and free blocks as on an
    engine that staged nothing, the released sequence gone."""
    cont = _continuations(target_path, graphed=graphed)
    ref, ahead = _engine(target_path, graphed), _engine(target_path, graphed)
    for e in (ref, ahead):
        outs = e.verify([VerifySeqInput(s, p, first=True) for s, p in PROMPTS.items()]).outputs
    nxt = {s: o.next_token for s, o in zip(PROMPTS, outs)}
    assert all(nxt[s] == cont[s][0] for s in PROMPTS)
    assert ahead.prepare_ahead([(s, nxt[s], K) for s in PROMPTS])
    # 1: two right drafts of three staged; 3: none; 2: released with the request.
    seqs = [VerifySeqInput(1, [nxt[1]], cont[1][1:3]), VerifySeqInput(3, [nxt[3]], [])]
    want, got = ref.verify(seqs, [2]).outputs, ahead.verify(seqs, [2]).outputs
    assert ahead.ahead_taken == 1 and ahead.ahead_dropped == 0
    assert [(o.seq_id, o.accepted, o.next_token, o.error) for o in got] == \
           [(o.seq_id, o.accepted, o.next_token, o.error) for o in want]
    assert (got[0].accepted, got[0].next_token) == (2, cont[1][3])
    assert (got[1].accepted, got[1].next_token) == (0, cont[3][1])
    assert _kv(ahead) == _kv(ref) == {1: len(PROMPTS[1]) + 3, 3: len(PROMPTS[3]) + 1}
    assert ahead.num_free_blocks == ref.num_free_blocks
    for e in (ref, ahead):
        e.release([1, 3])
        assert e.num_free_blocks == e.runner.blocks.num_blocks
