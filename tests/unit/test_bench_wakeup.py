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
    for mode in ("blocking", "poll"):
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
    assert "poll+grpc" in capsys.readouterr().out and common.ROOT.exists()
    json.dumps(written)   # what write_result gets is JSON
