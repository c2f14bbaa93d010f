"""A real Prometheus server for tests: Debian's `prometheus` binary on a loopback port.

    with PrometheusServer({"coordinator": ["127.0.0.1:9400"]}, tmp_path) as prom:
        prom.wait_for_scrapes(5)
        prom.query('sum(rate(specdec_emitted_tokens_total[30s]))')

The Makefile's `test` target installs the package when it is missing and we are root; tests call
`require_prometheus()` to skip with the reason when the binary still cannot be had. The server is
always stopped on exit: the Debian package's init script is never used, its data lives in tmp.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from coordinator.launch import free_port

INSTALL_HINT = "apt-get install -y prometheus (Debian's package; `make test` does it as root)"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)


def require_prometheus() -> str:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip(f"no prometheus binary: {INSTALL_HINT}")
    return binary


class PrometheusError(RuntimeError):
    pass


class PrometheusServer:
    """Starts prometheus scraping `targets` ({job: [host:port, ...]}) every `scrape_interval`."""

    def __init__(self, targets: dict[str, list[str]], workdir: Path, scrape_interval: str = "1s",
                 binary: str | None = None, startup_timeout_s: float = 30.0) -> None:
        self.targets = targets
        self.workdir = Path(workdir)
        self.scrape_interval = scrape_interval
        self.binary = binary or require_prometheus()
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._log = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        # JSON is YAML: no YAML writer needed.
        return json.dumps({
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": self.scrape_interval},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(addrs)}]}
                               for job, addrs in self.targets.items()],
        }, indent=2)

    def start(self) -> "PrometheusServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(self.config_text())
        self.port = free_port()
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
                 "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self._proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise PrometheusError(f"prometheus not ready after {self.startup_timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        self._proc = None

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def api(self, path: str, **params: str) -> dict | list:
        """GET /api/v1/<path>; returns `data`, raises PrometheusError with Prometheus' message."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as err:  # 400 bad query, 422 execution error
            body = json.loads(err.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query at now: a list of {"metric": labels, "value": [t, "v"]} (vector) results."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def values(self, expr: str) -> list[float]:
        return [float(r["value"][1]) for r in self.query(expr)]

    def scrape_targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for_scrapes(self, n: int, timeout_s: float = 60.0) -> None:
        """Until every target has been scraped successfully at least n times."""
        jobs = len(self.targets)
        expr = f"count(count_over_time(up[1h]) >= {n} and up == 1) == {jobs}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.query(expr):
                return
            time.sleep(0.25)
        raise PrometheusError(f"targets not scraped {n} times in {timeout_s} s: "
                              f"{[(t['scrapeUrl'], t['health'], t['lastError']) for t in self.scrape_targets()]}")


def has_finite(values: list[float]) -> bool:
    return any(math.isfinite(v) for v in values)
