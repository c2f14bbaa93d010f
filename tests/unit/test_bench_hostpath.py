"""bench/hostpath.py's host-path measurements on this CPU: the critical-path arithmetic, and the
loop and the servers' Python steps running for real (few steps: the plumbing, not the figures)."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` is top-level

import hostpath  # noqa: E402


def test_critical_path_is_the_time_between_target_entries_outside_the_calls():
    # step k: target call [10k, 10k+4), draft call [10k+6, 10k+7): 5 units outside per step
    calls = []
    for k in range(hostpath.WARMUP * 3):
        calls += [("target", 10.0 * k, 10.0 * k + 4), ("draft", 10.0 * k + 6, 10.0 * k + 7)]
    assert abs(hostpath.critical_us(calls) - 5e6) < 1e-3
    calls[2 * 100] = ("target", 1000.0, 1009.0)   # one longer target call: the median does not move
    assert abs(hostpath.critical_us(calls) - 5e6) < 1e-3


def test_the_loop_and_the_servers_python_run_and_take_time():
    steps = 30
    whole = asyncio.run(hostpath.loop_step_us(2, steps))
    critical = asyncio.run(hostpath.loop_step_us(2, steps, delay=0.001))
    assert 0 < whole < 1e5 and 0 < critical < 1e5
    for role in ("target", "draft"):
        assert 0 < hostpath.server_python_us(role, 2, steps) < 1e5


def test_the_servers_python_on_the_graph_path_replays_graphs_and_runs_nothing_eagerly():
    """graphed=True times the GPU servers' path: every timed step is served by the (CPU stand-in)
    graphs, none by an eager forward; the draft's γ positions come from its head graph and
    chain (a fed chain of GAMMA forwards a step), the target's verify from one replay."""
    steps = 40
    for role, per_step in (("target", 1), ("draft", hostpath.GAMMA)):
        seen = {}
        assert 0 < hostpath.server_python_us(role, 2, steps, graphed=True, seen=seen) < 1e5
        assert seen["eager"] == 0 and seen["steps"] == steps - 1
        assert seen["replays"] == per_step * seen["steps"], (role, seen)


def test_the_servers_graph_path_in_parts_adds_up_to_its_step_and_leaves_no_tracing_on():
    """parts_rows: per server, the medians of trace_steps' parts of its step (each there, none
    negative) summing to about the step (medians of parts need not add up exactly); the trace is off
    again afterwards and keeps no stamps."""
    from specdec import trace
    from trace_steps import STEP_PARTS
    rows = hostpath.parts_rows([2], 40)
    assert [r["server"] for r in rows] == ["draft", "target, staged ahead"]
    for r in rows:
        values = [r[f"{name}_us"] for name, _, _ in STEP_PARTS]
        assert all(v is not None and v >= 0 for v in values), r
        assert 0.5 * r["total_us"] < sum(values) < 1.5 * r["total_us"], r
    assert not trace.enabled and not trace._events
