"""--verify-ahead through the three real services on loopback, tiny models: the target stages the
step it expects after each answer, the next Verify takes it (specdec_verify_ahead_steps_total
outcome="taken" moves), greedy output still equals plain decoding with 1 and 8 clients, seeded
sampled requests stay reproducible (their steps are never staged ahead), and every KV block is
freed, staged reservations included."""
from __future__ import annotations

import urllib.request

import pytest

from tests.helpers.cluster import all_free, tiny_cluster, wait_kv_free
from tests.integration.test_services import MAX_NEW, PROMPTS, run_many


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with tiny_cluster(tmp_path_factory.mktemp("ahead"), target_args=["--verify-ahead"],
                      coordinator_args=["--max-batch-size", "8", "--num-draft", "4",
                                        "--prefill-chunk", "64"]) as c:
        yield c


def ahead_steps(cluster, outcome: str) -> float:
    text = urllib.request.urlopen(f"http://{cluster.metrics['target']}/metrics", timeout=5).read().decode()
    series = f'specdec_verify_ahead_steps_total{{outcome="{outcome}",role="target"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series))


@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_output_is_plain_decodings_with_steps_staged_ahead(cluster, concurrency):
    taken = ahead_steps(cluster, "taken")
    plain = run_many(cluster.coordinator, PROMPTS, 8, max_new_tokens=MAX_NEW, speculate=False)
    spec = run_many(cluster.coordinator, PROMPTS, concurrency, max_new_tokens=MAX_NEW, num_draft=4)
    assert spec == plain and all(len(o) > 0 for o in spec)
    assert all_free(wait_kv_free(cluster))
    # (the counters are published with the step after: one step's lag at most)
    assert ahead_steps(cluster, "taken") > taken


def test_seeded_sampled_requests_stay_reproducible(cluster):
    runs = [run_many(cluster.coordinator, PROMPTS[:6], 6, max_new_tokens=MAX_NEW, num_draft=3,
                     temperature=0.8, seed=11) for _ in range(2)]
    assert runs[0] == runs[1] and all(len(o) > 0 for o in runs[0])
    assert all_free(wait_kv_free(cluster))


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    with tiny_cluster(tmp_path_factory.mktemp("ahead-pipeline"), target_args=["--verify-ahead"],
                      coordinator_args=["--max-batch-size", "8", "--num-draft", "4",
                                        "--prefill-chunk", "64", "--pipeline"]) as c:
        yield c


def test_pipelined_steps_beside_steps_staged_ahead(pipelined):
    """--pipeline (the default where the draft has a GPU of its own) with --verify-ahead (the
    default on a GPU target): a Verify of a pipelined extension is checked against the staged
    guess like any other, so greedy output still equals plain decoding and no block is left."""
    from tests.integration.test_pipeline_services import metric
    plain = run_many(pipelined.coordinator, PROMPTS, 8, max_new_tokens=MAX_NEW, speculate=False)
    staged = ahead_steps(pipelined, "taken") + ahead_steps(pipelined, "dropped")
    piped = metric(pipelined, "specdec_pipelined_steps_total")
    spec = run_many(pipelined.coordinator, PROMPTS, 8, max_new_tokens=MAX_NEW, num_draft=4)
    assert spec == plain and all(len(o) > 0 for o in spec)
    assert metric(pipelined, "specdec_pipelined_steps_total") > piped
    assert ahead_steps(pipelined, "taken") + ahead_steps(pipelined, "dropped") > staged
    assert all_free(wait_kv_free(pipelined))
