"""bench/gaps.py's accounting: device idle time inside a step charged to the innermost host range
open at each instant, from a Chrome trace; and its method wrappers come off again."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gaps  # noqa: E402


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_idle_time_goes_to_the_innermost_open_range():
    # One step 0..100. Device: a copy 10..12 and kernels 12..40 and 30..50 (overlapping), 80..90.
    # Host: verify 0..100 holds prepare 2..20 and score 60..95; nothing outside them.
    trace = {"traceEvents": [
        _x(gaps.STEP, "user_annotation", 0, 100),
        _x("target.verify", "user_annotation", 0, 100),
        _x("runner.prepare", "user_annotation", 2, 18),
        _x("target._score", "user_annotation", 60, 35),
        _x("memcpy", "gpu_memcpy", 10, 2), _x("k1", "kernel", 12, 28), _x("k2", "kernel", 30, 20),
        _x("k3", "kernel", 80, 10),
        _x("ignored: not complete", "kernel", 0, 0) | {"ph": "i"},
        _x("a host op, not a range", "cpu_op", 0, 100),
    ]}
    (step,) = gaps.per_step(trace)
    assert step["window_us"] == 100 and step["busy_us"] == 40 + 10 and step["idle_us"] == 50
    # idle 0..10: verify 0..2, prepare 2..10; 50..80: verify 50..60, score 60..80; 90..100: score 90..95, verify 95..100
    assert step["idle_by_range_us"] == {"target.verify": 2 + 10 + 5, "runner.prepare": 8, "target._score": 20 + 5}
    assert sum(step["idle_by_range_us"].values()) == step["idle_us"]


def test_steps_are_windows_of_their_own_and_gaps_outside_ranges_are_none():
    trace = {"traceEvents": [
        _x(gaps.STEP, "user_annotation", 0, 10), _x(gaps.STEP, "user_annotation", 20, 10),
        _x("k", "kernel", 5, 20),          # spans the end of step 1 and the start of step 2
        _x("draft.propose", "user_annotation", 26, 2),
    ]}
    one, two = gaps.per_step(trace)
    assert (one["busy_us"], one["idle_by_range_us"]) == (5, {"(none)": 5})
    assert (two["busy_us"], two["idle_by_range_us"]) == (5, {"draft.propose": 2, "(none)": 3})
    s = gaps.summarize([one, two])
    assert s["steps"] == 2 and s["idle_us"] == 5
    assert s["idle_by_range_us"] == {"(none)": 4.0, "draft.propose": 1.0}   # a step without it counts 0


def test_wrapped_methods_run_inside_named_ranges_and_come_off():
    from specdec.engine.draft import DraftEngine
    from specdec.runner import ModelRunner
    before = {m: DraftEngine.__dict__[m] for m in ("propose", "_to_host")}
    prepare = ModelRunner.__dict__["prepare"]
    with gaps.wrapped():
        assert DraftEngine.__dict__["propose"] is not before["propose"]
        assert isinstance(DraftEngine.__dict__["_to_host"], staticmethod)   # still callable unbound
        assert DraftEngine._to_host([], [], []) == ([], [])
    assert {m: DraftEngine.__dict__[m] for m in before} == before and ModelRunner.__dict__["prepare"] is prepare
    with pytest.raises(RuntimeError), gaps.wrapped():
        raise RuntimeError("the wrappers come off on the way out of an error too")
    assert DraftEngine.__dict__["propose"] is before["propose"]


def test_waits_name_the_ops_on_either_side_of_each_gap_and_the_range_charged_most():
    # Device: k1 0..10, (gap 10..30), a memcpy 30..32 inside a longer k2 30..40, (gap 40..45), k3 45..50.
    # Host: stage 5..28 covers most of the first gap; replay 38..50 the second. The idle before k1's
    # start and after k3's end is the window's edge, not a wait between two ops.
    trace = {"traceEvents": [
        _x(gaps.STEP, "user_annotation", -5, 60),
        _x("graphs.stage", "user_annotation", 5, 23), _x("graphs.replay", "user_annotation", 38, 12),
        _x("k1", "kernel", 0, 10), _x("memcpy", "gpu_memcpy", 30, 2), _x("k2", "kernel", 30, 10),
        _x("k3", "kernel", 45, 5),
    ]}
    (step,) = gaps.per_step(trace)
    assert step["waits"] == [(20, "graphs.stage", "k1", "k2"), (5, "graphs.replay", "k2", "k3")]
    assert step["idle_us"] == 5 + 20 + 5 + 5
    s = gaps.summarize([step, step], top=1)
    assert s["waits"] == [{"range": "graphs.stage", "after": "k1", "before": "k2", "us_per_step": 20,
                           "gaps_per_step": 1, "median_gap_us": 20}]
    assert gaps.short("x" * 50, 10) == "xxxxxxx..." and gaps.short("k1") == "k1"


def test_host_split_charges_each_range_its_own_time_without_the_ranges_inside_it(monkeypatch):
    # A fake clock: every perf_counter call moves 1 s on; enter/exit of each scope reads it once.
    import time
    ticks = iter(range(1000))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
    split = gaps.HostSplit()
    with split("outer"):             # t 0 .. 7
        with split("inner"):         # t 1 .. 4
            with split("wait"):      # t 2 .. 3
                pass
        with split("inner"):         # t 5 .. 6
            pass
    assert split.take() == {"outer": 7 - 3 - 1, "inner": (3 - 1) + 1, "wait": 1}
    assert split.take() == {}        # reset


def test_inherited_methods_are_wrapped_and_the_override_removed_after():
    import torch
    split = gaps.HostSplit()
    assert "tolist" not in torch.Tensor.__dict__
    with gaps.wrapped(gaps.WAITS[:1], scope=split):
        assert torch.tensor([1, 2]).tolist() == [1, 2]
        assert "tolist" in torch.Tensor.__dict__
    assert "tolist" not in torch.Tensor.__dict__ and torch.tensor([3]).tolist() == [3]
    assert set(split.take()) == {"wait"}


def test_methods_a_class_lacks_are_left_out():
    """gaps-ab runs this tree's gaps.py over another commit's packages, which may lack a wrapped
    method (fed_chain is new in session 21): it is skipped, the others are still wrapped."""
    import torch
    split = gaps.HostSplit()
    specs = [("gone", "torch", "Tensor", "no_such_method_here"), *gaps.WAITS[:1]]
    with gaps.wrapped(specs, scope=split):
        assert torch.tensor([1]).tolist() == [1]
    assert not hasattr(torch.Tensor, "no_such_method_here") and set(split.take()) == {"wait"}


def test_compare_puts_each_labels_median_split_side_by_side_with_ratios_to_the_first():
    def result(step, fill, batch=1):
        return {"rows": [{"batch": batch, "host_split": {"step_us": step, "host_us": step / 10,
                                                          "exclusive_us": {"packed.fill": fill, "wait": step - 100}}}]}
    runs = [("A", result(1000, 50)), ("B", result(900, 20)), ("A", result(1300, 90)), ("B", result(950, 30)),
            ("A", result(1100, 60))]                                        # medians, not means
    rows = {(r["batch"], r["range"]): r for r in gaps.compare(runs)}
    fill = rows[(1, "packed.fill")]
    assert (fill["A"], fill["B"]) == (60, 25) and fill["B/A"] == pytest.approx(25 / 60)
    assert (rows[(1, "step")]["A"], rows[(1, "step")]["B"]) == (1100, 925)
    assert rows[(1, "host outside wait")]["B"] == 92.5
    assert [r["range"] for r in gaps.compare(runs)][0] == "step"          # largest first within a batch
    only_b = gaps.compare([("A", result(1000, 50)), ("B", result(900, 20, batch=8))])
    assert {(r["batch"], r["A"], r["B"]) for r in only_b if r["range"] == "packed.fill"} == {(1, 50, None), (8, None, 20)}


def test_bare_steps_give_each_engine_calls_wall_forward_and_host_medians():
    class FakeLoop:
        def __init__(self):
            self.calls = iter([(0.003, 0.002, 0.010, 0.009), (0.001, 0.0005, 0.012, 0.0095),
                               (0.002, 0.001, 0.011, 0.0104)])

        def spec(self):
            dw, df, tw, tf = next(self.calls)
            return {"draft_wall": dw, "draft_fwd": df, "target_wall": tw, "target_fwd": tf, "tokens": 5}

    out = gaps.bare_steps(FakeLoop(), 3)
    assert out["draft_wall_us"] == pytest.approx(2000) and out["draft_fwd_us"] == pytest.approx(1000)
    # the host time is the median of each call's wall - forward, not the difference of the medians
    assert out["draft_host_us"] == pytest.approx(1000)          # of 1000, 500, 1000
    assert out["target_host_us"] == pytest.approx(1000)         # of 1000, 2500, 600
    assert out["target_wall_us"] - out["target_fwd_us"] == pytest.approx(11000 - 9500)
    assert out["step_us"] >= 0


def test_event_segments_are_medians_by_position_over_the_most_common_path():
    chained = [("step>", 0.0), ("propose>", 10.0), ("replay> head", 200.0), ("replay< head", 400.0),
               ("step<", 450.0)]
    other = [("step>", 0.0), ("propose>", 5.0), ("replay> chain", 50.0), ("step<", 60.0)]
    slower = [("step>", 0.0), ("propose>", 30.0), ("replay> head", 300.0), ("replay< head", 700.0),
              ("step<", 800.0)]
    faster = [("step>", 0.0), ("propose>", 20.0), ("replay> head", 120.0), ("replay< head", 220.0),
              ("step<", 240.0)]
    rows = gaps.segments([other, chained, slower, faster])
    # The three head-path steps count; the chain-path one is left out.
    assert [r["segment"] for r in rows] == ["step> -> propose>", "propose> -> replay> head",
                                            "replay> head -> replay< head", "replay< head -> step<",
                                            "step (step> -> step<)"]
    assert [r["us"] for r in rows] == [20.0, 190.0, 200.0, 50.0, 450.0]
    assert rows[-1]["steps"] == 3
    # A tie goes to the path seen first.
    assert gaps.segments([other, chained])[0]["us"] == 5.0


def test_launch_rows_split_each_graphs_launches_by_stream_state():
    # Three steps: (graph, stream busy, seconds) per replay() call.
    per = [
        [("head", False, 100e-6), ("chain", True, 20e-6), ("chain", True, 30e-6), ("verify", False, 200e-6)],
        [("head", False, 80e-6), ("chain", True, 40e-6), ("chain", False, 90e-6), ("verify", False, 150e-6)],
        [("verify", False, 170e-6)],   # a step without the draft's graphs
    ]
    rows = {r["graph"]: r for r in gaps.launch_rows(per)}
    assert set(rows) == {"head", "chain", "verify"}
    chain = rows["chain"]
    assert chain["per_step"] == 2 and chain["us_per_step"] == pytest.approx(50.0)   # medians of 50, 130, 0
    assert (chain["busy_n"], chain["idle_n"]) == (3, 1)
    assert chain["busy_us"] == pytest.approx(30.0) and chain["idle_us"] == pytest.approx(90.0)
    head = rows["head"]
    assert head["per_step"] == 1 and head["us_per_step"] == pytest.approx(80.0) and head["busy_us"] is None
    assert rows["verify"]["idle_us"] == pytest.approx(170.0) and rows["verify"]["busy_n"] == 0
