"""bench/wakeup.py: a frame's one-way time from a sender process's write to a receiver's
read_frame, for the receiver's ways of waiting (few frames: the plumbing, not the figures)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` is top-level

import wakeup  # noqa: E402


def test_each_mode_measures_every_frame_in_a_plausible_time():
    from protos import shared_slots
    shm = ("poll+grpc+shm",) if shared_slots.AVAILABLE and shared_slots.SPIN else ()
    for mode in ("blocking", "poll", *shm):
        lat = wakeup.receiver(mode, frames=20, gap_s=0.001)
        assert len(lat) == 20 and all(0 < t < 1.0 for t in lat), (mode, lat)


def test_the_table_run_writes_rows_per_mode(tmp_path, monkeypatch, capsys):
    import common
    written = {}
    monkeypatch.setattr(wakeup, "write_result", lambda name, result: written.update(result) or tmp_path / name)
    assert wakeup.main(["--modes", "asyncio", "poll+grpc", "--frames", "20", "--gap-ms", "1"]) == 0
    rows = written["rows"]
    assert [r["mode"] for r in rows] == ["asyncio", "poll+grpc"]
    assert all(r["frames"] == 18 and 0 < r["min_us"] <= r["median_us"] <= r["p90_us"] for r in rows)
    out = capsys.readouterr().out
    assert "poll+grpc" in out and common.ROOT.exists()
    clock = written["clock"]   # the host's clock beside the rows: plausible costs, and printed
    assert 0 < clock["monotonic_ns"] < 1e5 and 0 < clock["perf_counter_ns"] < 1e5 and 0 < clock["loop_turn_us"] < 1e4
    assert f"{clock['loop_turn_us']:.2f} us" in out
    json.dumps(written)   # what write_result gets is JSON


def test_pinning_puts_the_loop_thread_on_a_cpu_of_its_own():
    import os
    import threading
    if len(os.sched_getaffinity(0)) < 2:
        assert wakeup.pin_loop_thread() is None
        return
    before = os.sched_getaffinity(0)
    done = {}

    def run():   # in a thread of its own: the test process's threads are not all moved for good
        stop = threading.Event()
        waiter = threading.Thread(target=stop.wait)
        waiter.start()
        done["pinned"] = wakeup.pin_loop_thread()
        done["mine"] = os.sched_getaffinity(0)
        done["waiter"] = os.sched_getaffinity(waiter.native_id)
        stop.set()
        waiter.join()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    try:
        cpu, rest = done["pinned"]
        assert done["mine"] == {cpu} and done["waiter"] == rest and cpu not in rest
        assert rest | {cpu} == before
    finally:
        for tid in (int(x) for x in os.listdir("/proc/self/task")):
            try:
                os.sched_setaffinity(tid, before)
            except ProcessLookupError:
                pass


def test_pinned_poll_mode_measures_every_frame():
    lat = wakeup.receiver("poll+pin", frames=20, gap_s=0.001)
    assert len(lat) == 20 and all(0 < t < 1.0 for t in lat)
