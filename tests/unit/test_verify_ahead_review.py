"""Review of --verify-ahead (TargetEngine.prepare_ahead): cases test_verify_ahead.py does not cover.

Each test drives two engines (one that stages the expected step ahead, one that never does) with
the same calls and compares answers and KV state, or checks one property of the staged window.
The three under "review findings, fixed" failed on 1fdc980, where --verify-ahead came in."""
from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from specdec.config import EngineConfig
from specdec.cuda_graphs import GraphSets
from specdec.engine import Code, TargetEngine, VerifySeqInput
from specdec.kernels.triton_attention import TritonAttention
from specdec.metrics import ServerMetrics
from specdec.runner import SeqInput
from specdec.sampling.params import SamplingParams
from specdec.serving.server import EngineRuntime
from target_server.servicer import TargetServicer, expected_next
from tests.helpers.cpu_graphs import CpuGraphs
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import make_pair

PROMPTS = {1: [5, 17, 42, 99, 7, 3], 2: [8, 1, 300, 12], 3: [77, 76, 75, 74, 73, 72, 71]}
K = 3
V = 320


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))[0]


def _engine(path, graphed: bool = False, sets: bool = False, **config) -> TargetEngine:
    cfg = dict(model=path, block_size=4, num_blocks=64, warmup_batch_sizes=(1,))
    cfg.update(config)
    engine = TargetEngine(EngineConfig(**cfg))
    if graphed:
        engine.runner.backend = TritonAttention()
        kw = dict(query_lens=engine.graph_query_lens(), batch_sizes=(1, 2, 4))
        if sets:   # GraphSets: a set for short contexts (bound 16) before the full one
            engine.runner.graphs = GraphSets.build(engine.runner, engine.max_model_len, (16,),
                                                   factory=CpuGraphs, **kw)
        else:
            engine.runner.graphs = CpuGraphs(engine.runner, max_model_len=engine.max_model_len, **kw)
    return engine


def _kv(engine: TargetEngine) -> dict:
    return {s: engine.runner.num_tokens(s) for s in engine.runner.blocks.seq_ids()}


def _out(outputs) -> list:
    return [(o.seq_id, o.accepted, o.next_token, None if o.error is None else o.error.code) for o in outputs]


def _both(ref: TargetEngine, ahead: TargetEngine, seqs, release=()) -> list:
    """One verify on each engine; asserts the same answers and KV afterwards; returns ref's outputs."""
    want, got = ref.verify(seqs, release).outputs, ahead.verify(seqs, release).outputs
    assert _out(got) == _out(want)
    assert _kv(ahead) == _kv(ref) and ahead.num_free_blocks == ref.num_free_blocks
    return want


def _start(ref, ahead, prompts=PROMPTS) -> dict[int, int]:
    """The prompts' step on both engines; each sequence's next token."""
    outs = _both(ref, ahead, [VerifySeqInput(s, p, first=True) for s, p in prompts.items()])
    return {o.seq_id: o.next_token for o in outs}


def _expect(seqs, outs) -> list[tuple[int, int, int]]:
    return [(s.seq_id, o.next_token, len(s.draft_tokens)) for s, o in zip(seqs, outs)]


# --- review findings, fixed ----------------------------------------------------------------------------------

def test_info_while_a_step_is_staged_reports_the_kv_free_as_before_it(target_path):
    """Info (the Info RPC runs between _account's prepare_ahead and the next Verify) does not count
    the staged step's reservation as used KV: as an engine without it, and as the
    specdec_kv_blocks_free gauge that _account published just before staging (review finding)."""
    ref, ahead = _engine(target_path), _engine(target_path)
    nxt = _start(ref, ahead, {1: [1] * 8})     # 8 tokens: 2 full blocks of 4
    assert ahead.prepare_ahead([(1, nxt[1], K)])   # 8 + 1 + 3 tokens: 1 more block reserved
    assert ahead.info().kv_blocks_free == ref.info().kv_blocks_free


def test_a_forward_staged_between_prepare_ahead_and_verify_falls_back(target_path):
    """Any other runner.prepare on the same graph bucket between prepare_ahead and the next verify
    (here a scratch sequence's single-token step, as warm_up / bench/anatomy-style direct runner
    use would do) overwrites the staged static inputs: the matching verify then drops the staged
    step and answers as an engine without it (review finding: it raised 'overwritten by a later
    step'). Not reachable from today's servers (warm_up runs before SERVING)."""
    ref, ahead = _engine(target_path, graphed=True), _engine(target_path, graphed=True)
    nxt = _start(ref, ahead, {1: PROMPTS[1]})
    assert ahead.prepare_ahead([(1, nxt[1], 0)])   # a plain decode step: bucket (1, 1)
    for e in (ref, ahead):
        e.runner.add_sequence("scratch")
        e.runner.step_flat([SeqInput("scratch", [1])])
        e.runner.free("scratch")
    _both(ref, ahead, [VerifySeqInput(1, [nxt[1]])])


# --- behaviour that holds (cases not covered by test_verify_ahead.py) -------------------------

@pytest.mark.parametrize("graphed", [False, True])
def test_a_forward_that_raises_on_the_fast_path_rolls_the_staged_step_back(target_path, graphed):
    ref, ahead = _engine(target_path, graphed), _engine(target_path, graphed)
    nxt = _start(ref, ahead)
    seqs = [VerifySeqInput(s, [nxt[s]], [1, 2, 3]) for s in PROMPTS]
    assert ahead.prepare_ahead([(s.seq_id, nxt[s.seq_id], K) for s in seqs])
    for e in (ref, ahead):
        real = e.runner.forward

        def boom(*a, _real=real, _e=e, **k):
            _e.runner.forward = _real
            raise RuntimeError("device lost")
        e.runner.forward = boom
        with pytest.raises(RuntimeError, match="device lost"):
            e.verify(seqs)
    assert _kv(ahead) == _kv(ref) and ahead.num_free_blocks == ref.num_free_blocks
    # (taken is counted once a step is served; a staged step that was not is dropped)
    assert ahead._ahead is None and ahead.ahead_taken == 0 and ahead.ahead_dropped == 1
    outs = _both(ref, ahead, seqs)                   # the step again, now served
    assert ahead.prepare_ahead(_expect(seqs, outs))
    _both(ref, ahead, [VerifySeqInput(s.seq_id, [o.next_token], [4, 5, 6]) for s, o in zip(seqs, outs)])
    assert ahead.ahead_taken == 1


@pytest.mark.parametrize("what", ["sampled", "first", "partial_prefill", "two_tokens", "reordered", "duplicate"])
def test_a_request_with_the_staged_sequences_that_asks_something_else_answers_as_without(target_path, what):
    ref, ahead = _engine(target_path), _engine(target_path)
    nxt = _start(ref, ahead)
    k = 0 if what == "partial_prefill" else K
    drafts = [1, 2, 3][:k]
    seqs = [VerifySeqInput(s, [nxt[s]], list(drafts)) for s in PROMPTS]
    assert ahead.prepare_ahead([(s.seq_id, nxt[s.seq_id], k) for s in seqs])
    if what == "sampled":
        seqs[1] = VerifySeqInput(2, [nxt[2]], list(drafts), torch.full((k, V), 1.0 / V),
                                 SamplingParams(temperature=0.8, seed=7))
    elif what == "first":
        seqs[0] = VerifySeqInput(1, [nxt[1]], list(drafts), first=True)
    elif what == "partial_prefill":
        seqs[2] = VerifySeqInput(3, [nxt[3]], partial_prefill=True)
    elif what == "two_tokens":
        seqs[0] = VerifySeqInput(1, [nxt[1], 5], list(drafts)[:k - 1])
    elif what == "reordered":
        seqs = seqs[::-1]
    elif what == "duplicate":
        seqs = [*seqs[:2], VerifySeqInput(1, [nxt[1]], list(drafts))]
    _both(ref, ahead, seqs)
    assert ahead.ahead_taken == 0 and ahead.ahead_dropped == 1


def test_prepare_ahead_with_a_duplicate_or_unknown_sequence_stages_nothing(target_path):
    engine = _engine(target_path)
    nxt = engine.verify([VerifySeqInput(1, PROMPTS[1], first=True)]).outputs[0].next_token
    kv, free = _kv(engine), engine.num_free_blocks
    assert not engine.prepare_ahead([(1, nxt, 2), (1, nxt, 2)])
    assert not engine.prepare_ahead([(1, nxt, 2), (9, 4, 2)])
    assert not engine.prepare_ahead([(1, 400, 2)])           # a token outside the vocabulary
    assert not engine.prepare_ahead([(1, nxt, 99)])          # more drafts than max_num_draft
    assert _kv(engine) == kv and engine.num_free_blocks == free and engine._ahead is None


def test_steps_staged_ahead_up_to_max_model_len(target_path):
    """A sequence decoded with K drafts to max_model_len, its drafts cut as it nears the end (as
    the coordinator cuts them): each step is staged after the one before, the last ones with the
    drafts that still fit (not refused with the step: review finding), taken, and answered as on an
    engine that never stages; a step with more drafts than fit then fails as without staging."""
    ref, ahead = _engine(target_path, max_model_len=24), _engine(target_path, max_model_len=24)
    nxt = _start(ref, ahead, {1: PROMPTS[1]})[1]
    staged, ks = [], []
    while (room := 24 - ref.runner.num_tokens(1) - 2) >= 0:
        seqs = [VerifySeqInput(1, [nxt], [0] * min(K, room))]
        outs = _both(ref, ahead, seqs)
        assert outs[0].error is None
        nxt = outs[0].next_token
        ks.append(len(seqs[0].draft_tokens))
        staged.append(ahead.prepare_ahead([(1, nxt, K)]))   # staged with K; cut to what fits
    # Staged after every step but the last (no room left even for the next token alone).
    assert all(staged[:-1]) and not staged[-1] and ks[-2:] == [1, 0]
    assert ahead.ahead_taken == len(staged) - 1 and ahead.ahead_dropped == 0
    outs = _both(ref, ahead, [VerifySeqInput(1, [nxt], [0] * K)])
    assert outs[0].error.code == Code.INVALID_ARGUMENT


@pytest.mark.parametrize("graphed", [False, True])
def test_a_sequence_near_max_model_len_does_not_keep_the_others_from_being_staged(target_path, graphed):
    """Staged with the step's most drafts, a sequence with little room left is cut to what fits
    (review finding: the whole step was refused): the others' step is still taken."""
    ref, ahead = (_engine(target_path, graphed, max_model_len=24) for _ in range(2))
    nxt = _start(ref, ahead, {1: [1] * 20, 2: PROMPTS[2]})     # 1: room for 2 drafts at most
    assert ahead.prepare_ahead([(1, nxt[1], K), (2, nxt[2], K)])
    _both(ref, ahead, [VerifySeqInput(1, [nxt[1]], [0]), VerifySeqInput(2, [nxt[2]], [0, 1, 2])])
    assert ahead.ahead_taken == 1 and ahead.ahead_dropped == 0


def test_a_staged_reservation_never_refuses_another_request_kv(target_path):
    """The staged step holds the last free block; a request that is not that step (a new prompt)
    needs it: the reservation is undone first, so it is served as without staging."""
    ref, ahead = _engine(target_path, num_blocks=6), _engine(target_path, num_blocks=6)
    nxt = _start(ref, ahead, {1: [1] * 16})        # 4 of 6 blocks
    assert ahead.prepare_ahead([(1, nxt[1], K)])   # 20 tokens: a 5th block
    assert ahead.num_free_blocks == 1
    # A prompt of 8 tokens (2 blocks): 2 are free once the staged block is given back, 1 before.
    outs = _both(ref, ahead, [VerifySeqInput(2, [3] * 8, first=True)])
    assert all(o.error is None for o in outs)
    assert ahead.ahead_dropped == 1


@pytest.mark.parametrize("graphed", [False, True])
def test_plain_decoding_steps_staged_ahead(target_path, graphed):
    """k = 0 (speculation off: one token per sequence and step), batch growing across a bucket."""
    ref, ahead = _engine(target_path, graphed), _engine(target_path, graphed)
    nxt = _start(ref, ahead)
    for step in range(6):
        if step == 3:   # a fourth sequence joins: batch 4 bucket
            nxt.update(_start(ref, ahead, {4: [9, 99, 199]}))
        seqs = [VerifySeqInput(s, [t]) for s, t in nxt.items()]
        outs = _both(ref, ahead, seqs)
        nxt = {o.seq_id: o.next_token for o in outs}
        assert ahead.prepare_ahead(_expect(seqs, outs))
    assert ahead.ahead_taken == 4   # steps 1, 2, 4, 5 (0 follows the prompts; 3 had the join before it)


def test_steps_staged_ahead_on_graph_sets(target_path):
    """GraphSets (a short-context set before the full one): steps staged on the short set while
    the contexts fit it, then on the full one; each answers as on an engine that never stages."""
    ref, ahead = _engine(target_path, True, sets=True), _engine(target_path, True, sets=True)
    nxt = _start(ref, ahead, {1: PROMPTS[1], 2: PROMPTS[2]})
    for _ in range(8):
        seqs = [VerifySeqInput(s, [t], [0, 1, 2]) for s, t in nxt.items()]
        outs = _both(ref, ahead, seqs)
        nxt = {o.seq_id: o.next_token for o in outs}
        assert ahead.prepare_ahead(_expect(seqs, outs))
    assert ahead.ahead_taken == 7
    assert all(s.replays for s in ahead.runner.graphs.sets)   # both sets ran staged steps


def _request(step: int, seqs) -> pb.VerifyRequest:
    r = pb.VerifyRequest(step=step)
    for s in seqs:
        r.seqs.add(seq_id=s.seq_id, new_tokens=pack_ids(s.new_tokens), draft_tokens=pack_ids(s.draft_tokens),
                   first=s.first)
    return r


def _servicer(engine) -> TargetServicer:
    runtime = EngineRuntime(ServerMetrics(CollectorRegistry(), "target"))
    runtime.attach(engine)
    return TargetServicer(runtime)


def test_two_streams_on_one_server_answer_as_without_staging(target_path):
    """Two coordinators' streams whose steps alternate, with each stream's _account (prepare_ahead)
    run late, after the other stream's step (the order the runtime lock allows), a Release and an
    Info in between: every answer and the KV are those of a server that never stages; the counters
    and gauges follow."""
    ref = _servicer(_engine(target_path))
    ahead = _servicer(_engine(target_path, verify_ahead=True))
    streams = {"a": {1: PROMPTS[1], 2: PROMPTS[2]}, "b": {3: PROMPTS[3]}}
    pending = []   # (servicer, request, response) whose _account has not run yet
    nxt: dict[str, dict[int, int]] = {}
    step = 0
    for rnd in range(6):
        for name in ("a", "b", "a", "a") if rnd % 2 else ("a", "b", "b"):
            if name not in nxt:
                seqs = [VerifySeqInput(s, p, first=True) for s, p in streams[name].items()]
            else:
                seqs = [VerifySeqInput(s, [t], [0, 1]) for s, t in nxt[name].items()]
            step += 1
            request = _request(step, seqs)
            responses = []
            for sv in (ref, ahead):
                response = sv._step(request, time.perf_counter())
                responses.append(response)
            want, got = ([(r.seq_id, r.accepted, r.next_token, r.error.code) for r in resp.results]
                         for resp in responses)
            assert got == want, (rnd, name)
            assert _kv(ahead.runtime.engine) == _kv(ref.runtime.engine)
            nxt[name] = {r.seq_id: r.next_token for r in responses[0].results}
            # The other stream's late _account runs now, then this one's right away (in order).
            for sv, req, resp in pending:
                sv._account(req, resp, 0.0)
            pending = []
            ahead._account(request, responses[1], 0.0)
            ref._account(request, responses[0], 0.0)
            if name == "b" and rnd == 3:
                assert ahead.runtime.engine.info().num_sequences == ref.runtime.engine.info().num_sequences
                for sv in (ref, ahead):
                    sv.runtime.engine.release([3])
                    sv.runtime.publish_state()
                del nxt["b"]
    engine = ahead.runtime.engine
    assert engine.ahead_taken > 0 and engine.ahead_dropped > 0
    engine.drop_ahead()
    assert _kv(engine) == _kv(ref.runtime.engine)
    assert engine.num_free_blocks == ref.runtime.engine.num_free_blocks


def test_expected_next_of_a_step_whose_sequence_failed_conversion_stages_nothing():
    request = pb.VerifyRequest(step=1)
    request.seqs.add(seq_id=1, new_tokens=pack_ids([3]), draft_tokens=pack_ids([4, 5]))
    request.seqs.add(seq_id=2, new_tokens=b"\x01\x02\x03", draft_tokens=b"")   # not int32 ids
    response = pb.VerifyResponse(results=[pb.VerifyResult(seq_id=1, accepted=2, next_token=9),
                                          pb.VerifyResult(seq_id=2, next_token=-1, error=pb.SeqError(code=3))])
    assert expected_next(request, response) == []


def test_hostpath_loop_figures_run_against_an_engine_without_verify_ahead(monkeypatch):
    """bench/hostpath.py's loop_ab runs this checkout's script over a baseline commit's packages.
    Against a commit before --verify-ahead the target figures still run and the staged-ahead one is
    None (review finding: server_python_us imported expected_next at its top, so every target
    figure failed with ImportError there). Here: the servicer module of such a commit, i.e. without
    expected_next."""
    import sys
    import types
    from pathlib import Path

    import target_server.servicer as real
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    monkeypatch.syspath_prepend(bench)
    old = types.ModuleType("target_server.servicer")
    old.verify = real.verify
    monkeypatch.setitem(sys.modules, "target_server.servicer", old)
    import hostpath
    assert hostpath.server_python_us("target", 1, 3) > 0
    assert hostpath.server_python_us("target", 1, 3, graphed=True, ahead=True) is None


def test_a_step_that_ran_the_staged_shape_leaves_the_verify_profile_alone(target_path):
    """A taken step whose request sent fewer drafts than staged ran the staged shape (batch, 1 +
    staged drafts): the servicer must not file its time under the request's (batch, 1 + drafts)
    (review finding); a step that ran its own shape still moves its entry."""
    sv = _servicer(_engine(target_path, verify_ahead=True))
    engine = sv.runtime.engine
    nxt = {s: None for s in PROMPTS}

    def step(n: int, drafts) -> None:
        seqs = ([VerifySeqInput(s, p, first=True) for s, p in PROMPTS.items()] if drafts is None
                else [VerifySeqInput(s, [nxt[s]], list(drafts)) for s in PROMPTS])
        request = _request(n, seqs)
        response = sv._step(request, time.perf_counter())
        assert all(not r.HasField("error") for r in response.results)
        sv._account(request, response, 0.0)    # publishes, observes, stages the next step
        nxt.update({r.seq_id: r.next_token for r in response.results})

    step(1, None)
    step(2, [0, 1, 2])                         # more drafts than the prompt step's: not taken
    assert engine.ahead_taken == 0 and engine.profile.costs.get(3, 4) is not None
    step(3, [0, 1])                            # fewer than staged: taken, ran (3, 4)
    assert engine.ahead_taken == 1 and engine.ran_staged_shape
    assert engine.profile.costs.get(3, 3) is None
    step(4, [0, 1])                            # as many as staged: taken, its own shape
    assert engine.ahead_taken == 2 and not engine.ran_staged_shape
    assert engine.profile.costs.get(3, 3) is not None
