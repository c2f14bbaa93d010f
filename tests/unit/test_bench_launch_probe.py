"""bench/launch_probe.py's reading of a profiled run: each graph launch's call time and when the
device started and ended its work, from synthetic events (the profiled replays need a GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` is top-level

launch_probe = pytest.importorskip("launch_probe")


def test_each_launch_gets_the_device_ops_up_to_the_next_launch():
    events = [
        ("device", 5.0, 7.0),                                    # before any launch: nobody's
        ("launch", 100.0, 160.0), ("device", 150.0, 170.0), ("device", 171.0, 400.0),
        ("launch", 1000.0, 1030.0), ("device", 1010.0, 1200.0),  # starts while the call still runs
        ("launch", 2000.0, 2010.0),                              # no device op seen: no row
    ]
    got = launch_probe.launch_gaps(list(reversed(events)))      # any order in
    assert got == [
        {"launch_call_us": 60.0, "first_op_us": 50.0, "last_op_end_us": 300.0, "ops": 2},
        {"launch_call_us": 30.0, "first_op_us": 10.0, "last_op_end_us": 200.0, "ops": 1},
    ]


def test_no_launches_no_rows():
    assert launch_probe.launch_gaps([("device", 1.0, 2.0)]) == []


@pytest.mark.gpu
def test_a_profiled_graph_launch_reports_its_device_work():
    import torch
    from specdec.cuda_graphs import GraphCaptures
    x = torch.ones(1 << 20, device="cuda")
    graph, _ = GraphCaptures._record(lambda: [x.mul_(1.0) for _ in range(8)], None)   # 8 kernels
    got = launch_probe.first_op_delay(graph, reps=5)
    assert set(got) == {"launch_call_us", "first_op_us", "last_op_end_us"}
    assert 0 < got["launch_call_us"] and 0 <= got["first_op_us"] < got["last_op_end_us"]
