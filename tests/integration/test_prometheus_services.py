"""The three real services under load, scraped by a real Prometheus: every query of the Grafana
dashboard returns data, and the exported cost coefficient c agrees with the two models' forwards
timed independently here.

Needs Debian's `prometheus` binary (`make test` installs it as root); skips, saying so, without it.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator.client import Client
from coordinator.launch import local_cluster
from specdec.config import CacheConfig
from specdec.engine.base import WARMUP_CONTEXT
from specdec.models.loader import load_model
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.prometheus import PrometheusError, PrometheusServer, has_finite, require_prometheus
from tests.helpers.tiny_models import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specdec.json"
pytestmark = pytest.mark.slow

# Grafana's $__rate_interval is at least four scrape intervals; a 60 s window holds the whole run
# (1 s scrapes), so rate() sees every step.
RATE_WINDOW = "60s"
TARGET_LAYERS = 8  # the draft is the target's first layer: c ≈ 1/5 on the CPU (overhead per layer)
PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os", "The quick brown fox",
           "Speculative decoding"]


def make_cost_pair(root: Path) -> tuple[Path, Path]:
    """(target, draft) of very different cost that still agree often: the target has
    TARGET_LAYERS layers whose upper ones write little into the residual stream, the draft is its
    first layer with the same embeddings, norm and head (and the same tokenizer)."""
    target = make_checkpoint(root / "target", layers=TARGET_LAYERS, seed=1)
    draft = make_checkpoint(root / "draft", layers=1, seed=1)  # config and tokenizer; weights below
    weights = load_file(str(target / "model.safetensors"))

    def layer(name: str) -> int:
        return int(name.split(".")[2]) if name.startswith("model.layers.") else -1

    for name, w in weights.items():
        if layer(name) >= 1 and name.endswith(("o_proj.weight", "down_proj.weight")):
            w.mul_(0.1)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v for k, v in weights.items() if layer(k) < 1}, str(draft / "model.safetensors"),
              metadata={"format": "pt"})
    return target, draft


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"].replace("$__rate_interval", RATE_WINDOW))
            for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def generate(address: str, prompt: str, **params) -> list[int]:
    with Client(address) as client:
        return [t for chunk in client.generate(prompt, timeout=60, **params) for t in chunk.token_ids]


def drive_load(address: str) -> None:
    """Concurrent speculative and plain requests (mixed batches), then a plain and a speculative
    request alone: batch-1 steps give c, c_system and the measured speedup their own bucket, with
    an observed plain step time before the speculative steps that are measured against it."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            sampled = dict(temperature=0.8, seed=i) if i == 1 else {}
            tokens = generate(address, PROMPTS[i], max_new_tokens=20, ignore_eos=True,
                              speculate=i % 2 == 0 or i == 1, **sampled)
            assert len(tokens) == 20
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(generate(address, "def add(a, b):", max_new_tokens=24, ignore_eos=True, speculate=False)) == 24
    assert len(generate(address, "for i in range", max_new_tokens=32, ignore_eos=True, num_draft=3)) == 32
    with pytest.raises(grpc.RpcError) as e:  # a failed request: requests_total{code="INVALID_ARGUMENT"}
        generate(address, "x", max_new_tokens=-1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class SingleTokenTimer:
    """Times single-token forwards at batch 1 after WARMUP_CONTEXT tokens, as the servers time
    theirs on the cpu device with one torch thread: the thread's CPU time around ModelRunner.step
    (specdec/engine/timing.py host_clock; the caller sets one thread)."""

    def __init__(self, path: Path):
        model, _ = load_model(path, torch.float32, torch.device("cpu"))
        self.runner = ModelRunner(model, CacheConfig(num_blocks=8, block_size=16, dtype=torch.float32))
        self.runner.add_sequence(0)
        self.runner.step([SeqInput(0, [1] * WARMUP_CONTEXT)])
        self.seconds(5)  # lazy initialisation

    def seconds(self, repeats: int) -> list[float]:
        times = []
        for _ in range(repeats):
            self.runner.truncate(0, WARMUP_CONTEXT)  # the same context every time
            t0 = time.thread_time()
            self.runner.step([SeqInput(0, [1])])
            times.append(time.thread_time() - t0)
        return times


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    binary = require_prometheus()
    root = tmp_path_factory.mktemp("prom-services")
    target, draft = make_cost_pair(root / "models")
    with local_cluster(target, draft, device="cpu", log_dir=root / "logs",
                       server_args=["--warmup-batch-sizes", "1,2"],
                       coordinator_args=["--num-draft", "3"], startup_timeout=120) as cluster:
        targets = {role: [address] for role, address in cluster.metrics.items()}
        with PrometheusServer(targets, root / "prometheus", "1s", binary) as prom:
            # A scrape before the load (every series exists at zero then) and one that began after
            # it: rate() sees the whole load even when scrapes time out while the cores are busy.
            prom.wait_for_scrapes(1)
            drive_load(cluster.coordinator)
            wait_scraped_after(prom, time.time())
            yield cluster, prom, (target, draft)


def wait_scraped_after(prom: PrometheusServer, t: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # timestamp() of a plain selector is the scrape's start (of an expression: the query's).
        if prom.values(f"count((timestamp(up) > {t:.3f}) and (up == 1))") == [3.0]:
            return
        time.sleep(0.25)
    raise PrometheusError(f"no successful scrape of every process after the load: {prom.scrape_targets()}")


def test_every_dashboard_expression_returns_data(loaded):
    _, prom, _ = loaded
    empty = []
    for title, expr in dashboard_exprs():
        values = prom.values(expr)  # raises on a PromQL syntax or execution error
        if not has_finite(values):
            empty.append((title, expr, values))
    scrapes = {r["metric"]["job"]: r["value"][1] for r in prom.query("sum_over_time(up[1h])")}
    assert not empty, f"expressions without a finite value: {empty} (successful scrapes: {scrapes})"


def test_scrapes_reach_every_process_and_counters_add_up(loaded):
    cluster, prom, _ = loaded
    assert {r["metric"]["job"] for r in prom.query("up == 1")} == {"coordinator", "draft", "target"}
    for name in ("coordinator", "draft_server", "target_server"):  # the bound port is logged
        assert "metrics on port" in cluster.procs[name].log_path.read_text()
    emitted = prom.values("sum(specdec_emitted_tokens_total)")[0]
    assert emitted == 6 * 20 + 24 + 32
    assert prom.values('specdec_requests_total{code="OK"}') == [8.0]
    assert prom.values('specdec_requests_total{code="INVALID_ARGUMENT"}') == [1.0]
    # Speculative and plain steps both ran: the plain baseline of c_system and measured speedup.
    assert prom.values("specdec_spec_steps_total")[0] > 0 and prom.values("specdec_plain_steps_total")[0] > 0
    for role in ("draft", "target"):
        assert prom.values(f'specdec_kv_blocks_used{{role="{role}"}}') == [0.0]  # all released
        phases = {r["metric"]["phase"] for r in prom.query(
            f'specdec_forward_seconds_count{{role="{role}"}} > 0')}
        assert phases == ({"prefill", "decode"} if role == "draft" else {"prefill", "decode", "verify"})
        # CPU servers run every forward eagerly (warm-up included); no graph replays
        assert prom.values(f'specdec_server_forwards_total{{role="{role}",path="eager"}}')[0] > 0
        assert prom.values(f'specdec_server_forwards_total{{role="{role}",path="graph"}}') == [0.0]
    alpha = prom.values("specdec_alpha")[0]
    ratio = prom.values("specdec_acceptance_ratio")[0]
    assert 0.0 < ratio <= alpha < 1.0  # accepted/drafted counts untested tokens as failures


def test_exported_c_agrees_with_an_independent_measurement(loaded):
    _, prom, (target, draft) = loaded
    exported = {r["metric"]["batch"]: float(r["value"][1]) for r in prom.query("specdec_cost_coefficient")}
    assert "1" in exported, exported
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the servers (local_cluster: one thread per model server)
    try:
        d_timer, t_timer = SingleTokenTimer(draft), SingleTokenTimer(target)
        # Interleaved rounds, so that a busy spell of the shared machine slows both models alike.
        d_times, t_times = [], []
        for _ in range(10):
            d_times += d_timer.seconds(10)
            t_times += t_timer.seconds(10)
    finally:
        torch.set_num_threads(before)
    d_med, t_med = statistics.median(d_times), statistics.median(t_times)
    measured = d_med / t_med
    profiles = {r["metric"]["role"]: float(r["value"][1]) * 1e3 for r in prom.query(
        'specdec_forward_profile_seconds{batch="1",query_len="1"}')}
    print(f"c at batch 1: exported {exported['1']:.3f}, measured here {measured:.3f} "
          f"(draft {d_med * 1e3:.3f} ms, target {t_med * 1e3:.3f} ms; the servers' profiles: "
          f"{', '.join(f'{role} {ms:.3f} ms' for role, ms in sorted(profiles.items()))})")
    # Tolerance: a factor of 2. Here c is the median of 100 draft forwards over the median of 100
    # target forwards, ~0.45 ms and ~2.5 ms on a 2-core machine shared with Prometheus and other
    # jobs. The servers' values are a 3-run warm-up median, then an EMA of live forwards taken
    # while the coordinator, the other server and the scrapes compete for the cores. Timed by the
    # wall clock, that inflated the short draft forward relatively more (exported / measured
    # 1.05-1.25 in our runs, 1.8 once before live samples were clamped, 2.4 in one CI run); timed
    # by thread CPU time, as now, waiting for a core or the GIL no longer counts (session 32 on a
    # 2-core VM: 0.74-1.10 in three runs with two busy loops beside the test, 1.02-1.12 in three
    # with one). A factor of 2 still rejects wrong definitions: the ratio swapped (target / draft
    # ≈ 6 against ≈ 0.17: 35x), draft time per step instead of per forward (x γ = 3 here), or
    # coordinator round trips instead of device time (1-2 ms of gRPC and Python on a 0.45 ms draft
    # forward: >= 2.5x; that quantity is c_system, exported apart).
    assert measured / 2 <= exported["1"] <= measured * 2, (exported, measured)
    assert exported["1"] < 0.5  # the target costs several drafts whatever the noise


def test_bad_promql_is_reported(loaded):
    _, prom, _ = loaded
    with pytest.raises(PrometheusError, match="bad_data"):
        prom.query("sum(rate(specdec_draft_tokens_total[30s])")
