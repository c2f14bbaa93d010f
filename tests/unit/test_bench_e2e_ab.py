"""bench/e2e_ab.py's summary: rows matched by (pair, gpus, batch) across alternating passes,
medians per side, B / A ratios; rows one side lacks are left out."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` is top-level

from e2e_ab import parse_env, summarize  # noqa: E402


def _row(batch, spec, host, pair="7b/68m"):
    return {"pair": pair, "gpus": 1, "batch": batch, "spec_tok_s": spec, "plain_tok_s": 100.0,
            "speedup": spec / 100.0, "draft_host_ms_spec": host}


def test_medians_and_ratios_per_row():
    passes = {"A": [[_row(1, 200, 2.0), _row(8, 1000, 3.0)], [_row(1, 240, 2.4), _row(8, 900, 3.3)],
                    [_row(1, 220, 2.2), _row(8, 1100, 2.7)]],
              "B": [[_row(1, 300, 1.0), _row(8, 1000, 3.0)], [_row(1, 260, 1.5)],
                    [_row(1, 280, 1.2), _row(8, 1200, 2.0), _row(1, 999, 0.1, pair="other")]]}
    rows = summarize(passes)
    assert [(r["pair"], r["batch"]) for r in rows] == [("7b/68m", 1), ("7b/68m", 8)]   # "other": A lacks it
    b1, b8 = rows
    assert (b1["spec_tok_s_a"], b1["spec_tok_s_b"]) == (220, 280)
    assert b1["spec_tok_s_ratio"] == pytest.approx(280 / 220)
    assert b1["draft_host_ms_spec_b"] == 1.2 and b1["draft_host_ms_spec_ratio"] == pytest.approx(1.2 / 2.2)
    assert (b8["passes_a"], b8["passes_b"]) == (3, 2) and b8["spec_tok_s_b"] == 1100   # median of two
    assert b8["spec_tok_s_a_values"] == [1000, 900, 1100]
    assert b1["target_host_ms_spec_a"] is None and b1["target_host_ms_spec_ratio"] is None   # not in the rows


def test_rows_without_speculation_and_bad_env_items():
    passes = {"A": [[{"pair": "p", "gpus": 1, "batch": 1, "spec_tok_s": None}]], "B": [[_row(1, 10, 1.0, "p")]]}
    assert summarize(passes) == []
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        parse_env(["novalue"])


@pytest.mark.parametrize("order, expected, finished", [
    ("abba", ["A", "B", "B", "A"], [(1, 0, 1), (1, 1, 2), (1, 2, 3)]),
    ("ab", ["A", "B", "A", "B"], [(1, 0, 1), (1, 1, 2), (2, 1, 3)]),
])
def test_passes_alternate_report_after_each_and_put_the_result_file_back(tmp_path, monkeypatch, order, expected, finished):
    import e2e_ab
    out = tmp_path / "bench" / "results" / "e2e.json"
    out.parent.mkdir(parents=True)
    out.write_text('{"rows": "the committed run"}')
    ran = []

    def fake_pass(args, env, timeout, root):
        ran.append(env["SIDE"])
        out.write_text("overwritten by a pass")
        if len(ran) == 4:
            raise SystemExit(143)            # the call's time limit, as the SIGTERM handler raises it
        return [_row(1, 100.0 * len(ran), 1.0)], 1.0, 0

    seen = []
    monkeypatch.setattr(e2e_ab, "run_pass", fake_pass)
    sides = {"A": ([], {"SIDE": "A"}), "B": ([], {"SIDE": "B"})}
    with pytest.raises(SystemExit):
        e2e_ab.run_passes(sides, {"A": tmp_path, "B": tmp_path}, 3, 10.0, order=order,
                          after_pass=lambda passes, log: seen.append((len(passes["A"]), len(passes["B"]), len(log))))
    assert ran == expected
    assert seen == finished                  # what was finished when the fourth pass died
    assert out.read_text() == '{"rows": "the committed run"}'


def test_abba_is_the_default_order():
    import e2e_ab
    assert [e2e_ab.pass_order(i, "abba") for i in range(3)] == [("A", "B"), ("B", "A"), ("A", "B")]
    assert e2e_ab.ORDERS[0] == "abba"
