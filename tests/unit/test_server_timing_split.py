"""A server's step time split three ways: its forwards (device time), the engine's call outside
them (engine_host) and the server's handling around the engine (serving: request and response
conversion). The servers report the engine's call as StepTiming.engine_seconds; the coordinator
exports the split as specdec_server_step_seconds{part=...}."""
from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from specdec.cost_model import ServerTiming
from specdec.metrics import CoordinatorMetrics
from specdec.serving import convert
from tests.helpers.servicers import servicer_pair
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: this module runs single-threaded)
from tests.unit.test_metrics import scrape, value

SLOW_S = 0.03


@pytest.fixture(scope="module")
def servicers(tmp_path_factory):
    return servicer_pair(tmp_path_factory.mktemp("pair"))


def _slowed(monkeypatch, name):
    """convert.<name> (the request's conversion, outside the engine's call) made SLOW_S slower."""
    original = getattr(convert, name)

    def slow(*args, **kwargs):
        time.sleep(SLOW_S)
        return original(*args, **kwargs)
    monkeypatch.setattr(convert, name, slow)


def _check(timing: pb.StepTiming) -> None:
    assert timing.num_forwards >= 1 and timing.forward_seconds > 0
    assert timing.forward_seconds <= timing.engine_seconds
    # The slowed conversion is the server's, not the engine's: it lands in step - engine.
    assert timing.step_seconds - timing.engine_seconds >= SLOW_S
    assert timing.engine_seconds < timing.step_seconds - SLOW_S


def test_the_servers_report_the_engines_call_apart_from_their_own_handling(servicers, monkeypatch):
    target, draft = servicers
    _slowed(monkeypatch, "verify_seqs_from_pb")
    _slowed(monkeypatch, "draft_seqs_from_pb")
    request = pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=1, new_tokens=pack_ids([5, 17, 42]), first=True)])
    response, _ = target._timed_step(request, time.perf_counter())
    assert not response.results[0].HasField("error")
    _check(response.timing)
    request = pb.ProposeRequest(step=1, seqs=[pb.DraftSeq(seq_id=1, keep=0, new_tokens=pack_ids([5, 17, 42]),
                                                           num_draft=3, first=True)])
    response, _ = draft._timed_step(request, time.perf_counter())
    assert not response.results[0].HasField("error")
    _check(response.timing)
    target.runtime.engine.release([1])
    draft.runtime.engine.release([1])


def test_the_coordinator_exports_the_split_and_leaves_it_out_when_a_server_does_not_say():
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2))
    draft = ServerTiming(0.004, 0.001, batch_size=2, step_seconds=0.0050, engine_seconds=0.0046)
    target = ServerTiming(0.006, 0.005, batch_size=2, step_seconds=0.0070)          # an older server
    cm.observe_step([3, 3], [1, 2], step_seconds=0.0131, draft_timing=draft, target_timing=target)
    s = scrape(reg)
    part = dict(role="draft")
    assert value(s, "specdec_server_step_seconds_sum", part="host", **part) == pytest.approx(0.001)
    assert value(s, "specdec_server_step_seconds_sum", part="engine_host", **part) == pytest.approx(0.0006)
    assert value(s, "specdec_server_step_seconds_sum", part="serving", **part) == pytest.approx(0.0004)
    assert value(s, "specdec_server_step_seconds_count", part="serving", **part) == 1
    # host = engine_host + serving
    assert (value(s, "specdec_server_step_seconds_sum", part="engine_host", **part)
            + value(s, "specdec_server_step_seconds_sum", part="serving", **part)) == pytest.approx(0.001)
    assert value(s, "specdec_server_step_seconds_count", role="target", part="host") == 1
    assert value(s, "specdec_server_step_seconds_count", role="target", part="engine_host") == 0
    assert value(s, "specdec_server_step_seconds_count", role="target", part="serving") == 0


ENGINE_POINTS = ["s_engine", "e_launch", "e_launched", "e_synced", "s_engined"]


def test_with_tracing_on_a_step_stamps_the_engines_parts_in_order_and_only_its_own(servicers, monkeypatch):
    """specdec/trace.py's stamps inside a server's step (bench/trace_steps.py's s_pre .. s_post):
    each of the engine's points once, in order, under the step's (rpc, step); none once the
    step is over (the verify-ahead staging after an answer is no step's)."""
    from specdec import trace
    events: list = []
    monkeypatch.setattr(trace, "enabled", True)
    monkeypatch.setattr(trace, "_events", events)
    target, draft = servicers
    prompt = pack_ids([5, 17, 42])
    steps = [(target, pb.VerifyRequest(step=7, seqs=[pb.VerifySeq(seq_id=3, new_tokens=prompt, first=True)])),
             (draft, pb.ProposeRequest(step=8, seqs=[pb.DraftSeq(seq_id=3, new_tokens=prompt, num_draft=3,
                                                                  first=True)])),
             (target, pb.VerifyRequest(step=9, seqs=[pb.VerifySeq(seq_id=3, new_tokens=pack_ids([9]),
                                                                  draft_tokens=pack_ids([1, 2, 3]))]))]
    try:
        for servicer, request in steps:
            del events[:]
            t0 = time.perf_counter()
            response, _ = servicer._timed_step(request, t0)
            assert not response.results[0].HasField("error")
            assert [e[0] for e in events] == ENGINE_POINTS
            assert {(e[1], e[2]) for e in events} == {(servicer.rpc_name, request.step)}
            stamps = [e[4] for e in events]
            assert t0 <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= time.perf_counter()
            trace.mark_step("e_launch")   # after the step: no step to stamp
            assert len(events) == len(ENGINE_POINTS)
    finally:
        target.runtime.engine.release([3])
        draft.runtime.engine.release([3])
