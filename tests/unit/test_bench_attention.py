"""bench/attention.py's bookkeeping, on the CPU: --cases parsing, the tuning sweep's candidates
and the goals' counts against the floor and against a copy of the same bytes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` is top-level

from attention import FLOOR_GOAL_BYTES, goals, parse_cases, tune_candidates  # noqa: E402


def test_cases_parse_and_bad_items_are_refused():
    assert parse_cases(" gqa_32q_8kv_x128:8:2048:16, llama7b_32x128:1:1024:8,") == [
        ("gqa_32q_8kv_x128", 8, 2048, 16), ("llama7b_32x128", 1, 1024, 8)]
    for bad in ("gqa_32q_8kv_x128:8:2048", "mystery:1:2:3", "llama7b_32x128:1:x:8"):
        with pytest.raises((SystemExit, ValueError)):
            parse_cases(bad)


def _plan(block_m=16, block_n=64, stages=3, splits=8):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": stages,
            "num_splits": splits}


def test_tuning_candidates_cover_half_the_splits_and_smaller_gqa_row_tiles():
    got = list(tune_candidates(_plan(block_m=64, splits=4), rows=64))
    keys = [(tuple(sorted(c.items())), s, m) for c, s, m in got]
    assert len(keys) == len(set(keys))                          # no config timed twice
    assert got[0] == ({"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}, 1, "separate")
    other = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    # Each other tile first at the plan's splits, half of them and one (before the wide tail).
    assert [s for c, s, m in got if c == other and m == "separate"][:3] == [4, 2, 1]
    # 64-row GQA tiles: 32- and 16-row tiles (more query tiles) are among the candidates.
    assert {c.get("BLOCK_M") for c, _, _ in got} == {None, 16, 32}   # None: the plan's 64
    assert all(m == "separate" for _, s, m in got if s == 1)    # one split: nothing to merge
    # A 16-row plan gets no smaller MMA tiles; 8 rows of q=1 GQA get CUDA-core tiles.
    assert not any(c.get("BLOCK_M") in (16, 32) for c, _, _ in tune_candidates(_plan(), rows=16))
    assert any(c.get("BLOCK_M") == 8 for c, _, _ in tune_candidates(_plan(), rows=8))


def _row(kv_mib, ms, floor_ms, copy_ms=None, sdpa_ms=1.0, q=1):
    r = {"shape": "s", "batch": 1, "context": 512, "query_len": q, "kv_bytes": kv_mib << 20,
         "ms": ms, "sdpa_ms": sdpa_ms, "floor_ms": floor_ms, "frac_of_floor": floor_ms / ms,
         "ms_write_flush": ms, "sdpa_ms_write_flush": sdpa_ms, "ms_inline_merge": ms,
         "frac_of_floor_write_flush": floor_ms / ms, "eager_ms": ms, "check_ok": True,
         "vs_sdpa": sdpa_ms / ms}
    if copy_ms is not None:
        r["same_bytes_copy_ms"] = copy_ms
        r["frac_of_same_bytes_copy"] = copy_ms / ms
    return r


def test_goals_count_the_floor_and_the_same_bytes_copy_apart():
    rows = [_row(64, 0.020, 0.0157, copy_ms=0.0185),   # 78% of the floor, 92% of the copy
            _row(64, 0.030, 0.0157, copy_ms=0.0185),   # 52%, 62%
            _row(128, 0.035, 0.0314, copy_ms=0.0340),  # 90%, 97%
            _row(32, 0.010, 0.0078, copy_ms=0.0117)]   # under 64 MiB: in neither count
    assert FLOOR_GOAL_BYTES == 64 << 20
    g = goals(rows)
    assert g["floor_80pct_where_kv_ge_64MiB"] == {"met": 1, "of": 3}
    assert g["floor_80pct_of_same_bytes_copy_where_kv_ge_64MiB"] == {"met": 2, "of": 3}
    assert g["same_bytes_copy_frac_of_floor"] == {"32 MiB": pytest.approx(0.667, abs=1e-3),
                                                  "64 MiB": pytest.approx(0.849, abs=1e-3),
                                                  "128 MiB": pytest.approx(0.924, abs=1e-3)}
    assert g["errors"] == 0 and g["mismatches_vs_sdpa"] == 0
