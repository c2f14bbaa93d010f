"""A real Prometheus scrapes specdec metrics; every dashboard expression returns data.

The exporter here is tests/helpers/synthetic_exporter.py (specdec.metrics fed synthetic steps);
the same harness runs against the real three services in the end-to-end observability test.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.prometheus import PrometheusError, PrometheusServer, has_finite, require_prometheus
from tests.helpers.synthetic_exporter import draft_seconds, target_seconds

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specdec.json"
pytestmark = pytest.mark.slow
# Grafana's $__rate_interval is at least 4 scrape intervals; with 1 s scrapes and ~6 s of data a
# 30 s window holds every sample, so rate() sees the whole run.
RATE_WINDOW = "30s"


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"].replace("$__rate_interval", RATE_WINDOW))
            for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    binary = require_prometheus()
    exporter = subprocess.Popen([sys.executable, "-m", "tests.helpers.synthetic_exporter",
                                 "--duration", "90"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(exporter.stdout.readline())
        targets = {role: [f"127.0.0.1:{port}"] for role, port in ports.items()}
        with PrometheusServer(targets, tmp_path_factory.mktemp("prom"), "1s", binary) as prom:
            prom.wait_for_scrapes(6)
            yield prom
    finally:
        exporter.terminate()
        exporter.wait(timeout=10)


def test_every_dashboard_expression_returns_data(scraped):
    empty = []
    for title, expr in dashboard_exprs():
        values = scraped.values(expr)  # raises on a PromQL syntax or execution error
        if not has_finite(values):
            empty.append((title, expr, values))
    assert not empty, f"expressions without a finite value: {empty}"


def test_scraped_values_match_what_was_recorded(scraped):
    # α from the raw counters: the exporter accepts each draft token with probability 0.8.
    alpha = scraped.values("sum(rate(specdec_accepted_tokens_total[30s])) / (sum(rate("
                           "specdec_accepted_tokens_total[30s])) + sum(rate(specdec_rejections_total[30s])))")
    assert alpha[0] == pytest.approx(0.8, abs=0.06)
    # c: the coordinator's gauge and the ratio of the servers' profiles both equal the fixed times.
    c = {r["metric"]["batch"]: float(r["value"][1]) for r in scraped.query("specdec_cost_coefficient")}
    assert set(c) == {"1", "2", "4"}
    for batch, value in c.items():
        b = int(batch)
        assert value == pytest.approx(draft_seconds(b) / target_seconds(b, 1), rel=1e-6)
    ratio = scraped.values('max by (batch) (specdec_forward_profile_seconds{role="draft", query_len="1"})'
                           ' / max by (batch) (specdec_forward_profile_seconds{role="target", query_len="1"})')
    assert sorted(ratio) == pytest.approx(sorted(draft_seconds(b) / target_seconds(b, 1)
                                                 for b in (1, 2, 4, 8)), rel=1e-6)
    up = {r["metric"]["job"] for r in scraped.query("up == 1")}
    assert up == {"coordinator", "draft", "target"}


def test_bad_promql_is_reported(scraped):
    with pytest.raises(PrometheusError, match="bad_data"):
        scraped.query("sum(rate(specdec_draft_tokens_total[30s])")
