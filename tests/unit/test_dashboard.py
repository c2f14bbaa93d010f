"""The Grafana dashboard JSON, its provisioning, its README, and the container health check."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.metrics import exposed_series_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specdec.json"
PANEL_TYPES = {"timeseries", "bargauge", "stat", "table", "barchart"}
# What issue 6 asks the dashboard to show, as words its panel titles must contain.
REQUIRED_TOPICS = ["Acceptance rate", "Acceptance by draft position", "c by batch size over time",
                   "c_system by batch size over time", "c and c_system by batch size",
                   "Expected vs measured speedup", "Tokens per second", "Time to first token",
                   "Time per output token", "KV cache usage", "Error rate"]


@pytest.fixture(scope="module")
def board() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs(board: dict) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_dashboard_is_up_to_date_with_its_generator():
    r = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "make_dashboard.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_dashboard_structure(board):
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    datasource_uid = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]["uid"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    for p in board["panels"]:
        assert p["type"] in PANEL_TYPES and p["title"] and p["description"], p.get("title")
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24
        assert p["datasource"]["uid"] == datasource_uid
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == datasource_uid and t["expr"].strip()


def test_every_query_uses_defined_metrics(board):
    known = exposed_series_names()
    for expr in exprs(board):
        names = set(re.findall(r"\bspecdec_[a-z_]+", expr))
        assert names, f"no specdec_ metric in {expr}"
        assert names <= known, f"{expr}: unknown {names - known}"
        assert expr.count("(") == expr.count(")"), expr


def test_dashboard_covers_the_issue(board):
    titles = [p["title"] for p in board["panels"]]
    for topic in REQUIRED_TOPICS:
        assert any(topic in t for t in titles), topic
    queries = " ".join(exprs(board))
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(specdec_time_to_first_token" in queries


def test_readme_describes_every_panel_and_query(board):
    readme = (DEPLOY / "README.md").read_text()
    for p in board["panels"]:
        section = re.search(rf"^### \d+\. {re.escape(p['title'])}\n(.*?)(?=^### |^## |\Z)",
                            readme, re.M | re.S)
        assert section, f"deploy/README.md has no section for panel {p['title']!r}"
        text = section.group(1)
        assert len(text.split("```")[0].split()) >= 10, f"{p['title']}: describe the panel"
        for t in p["targets"]:
            assert t["expr"] in text, f"{p['title']}: query missing from README: {t['expr']}"


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(None)


def run_healthcheck(address: str) -> int:
    return subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py"), address],
                          capture_output=True, timeout=30).returncode


def test_healthcheck_script(health_server):
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert run_healthcheck(f"127.0.0.1:{port}") == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run_healthcheck(f"127.0.0.1:{port}") == 1
    from coordinator.launch import free_port
    assert run_healthcheck(f"127.0.0.1:{free_port()}") == 1  # nothing listening
