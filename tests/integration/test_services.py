"""The three services as real processes on loopback, tiny models: streaming, greedy losslessness
through the services (1 and 8 clients), seeded reproducibility, cancellation and deadlines freeing
the KV, health and reflection, and plain decoding when the draft server dies (and speculation again
when it is back)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.client import AsyncClient, Client
from coordinator.launch import restart
from tests.helpers.cluster import all_free, tiny_cluster, wait_kv_free

PROMPTS = [f"{head} {i}" for i, head in enumerate([
    "def add(a, b):", "for i in range(10):", "class Point:", "import os", "The quick brown fox",
    "if __name__ == '__main__':", "return a +", "print(i * i)", "Speculative decoding is",
    "self.x = x", "sys.exit(main())", "jumps over the lazy dog.", "def __init__(self, x, y):",
    "lossless", "import sys\n\n", "    return", "x = [i for i in", "while True:", "# comment", "a, b = b, a",
    "def mul(a, b):", "The lazy dog"])]
# Longer than the coordinator's prefill chunk (64 tokens below): prefilled in several target steps.
PROMPTS += ["class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 4,
            "for i in range(10):\n    print(i * i)\n" * 6]
MAX_NEW = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with tiny_cluster(tmp_path_factory.mktemp("services"),
                      coordinator_args=["--max-batch-size", "8", "--num-draft", "4",
                                        "--prefill-chunk", "64", "--draft-retry", "0.5"]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.coordinator) as c:
        yield c


def run_many(address: str, prompts: list[str], concurrency: int, **params) -> list[tuple[int, ...]]:
    """Each prompt's generated token ids, with `concurrency` clients at a time."""
    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with AsyncClient(address) as client:
            async def one(prompt):
                async with sem:
                    return tuple(t for ch in [c async for c in client.generate(prompt, **params)]
                                 for t in ch.token_ids)
            return await asyncio.gather(*(one(p) for p in prompts))
    return asyncio.run(main())


@pytest.fixture(scope="module")
def plain_outputs(cluster):
    return run_many(cluster.coordinator, PROMPTS, 1, max_new_tokens=MAX_NEW, speculate=False)


def test_streaming_end_to_end(client):
    chunks = list(client.generate("def add(a, b):", max_new_tokens=32, ignore_eos=True, num_draft=4))
    assert len(chunks) > 1
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length"
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 32 == last.usage.completion_tokens
    assert last.usage.draft_tokens > 0 and last.usage.steps < 32  # speculation emitted > 1 per step
    assert last.usage.prompt_tokens > 0 and len({c.request_id for c in chunks}) == 1
    # The streamed text is the incremental decode of the streamed ids.
    from tokenizers import Tokenizer
    info = client.info()
    tok = Tokenizer.from_file(os.path.join(info.target.model_name, "tokenizer.json"))
    assert "".join(c.text for c in chunks) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_speculative_equals_plain(cluster, plain_outputs, concurrency):
    spec = run_many(cluster.coordinator, PROMPTS, concurrency, max_new_tokens=MAX_NEW, num_draft=4)
    assert len(PROMPTS) >= 20
    assert spec == plain_outputs
    assert all(len(o) > 0 for o in spec)


def test_plain_decoding_with_8_clients_matches(cluster, plain_outputs):
    assert run_many(cluster.coordinator, PROMPTS, 8, max_new_tokens=MAX_NEW, speculate=False) == plain_outputs


def test_sampled_runs_with_a_seed_are_reproducible(cluster):
    params = dict(max_new_tokens=40, temperature=0.9, top_k=50, seed=1234, ignore_eos=True, num_draft=3)
    first = run_many(cluster.coordinator, ["def add(a, b):"], 1, **params)
    # Again, now sharing the batch with other requests: the seed alone decides the tokens.
    again = run_many(cluster.coordinator, ["def add(a, b):"] + PROMPTS[:7], 8, **params)[0]
    other_seed = run_many(cluster.coordinator, ["def add(a, b):"], 1, **{**params, "seed": 99})[0]
    assert first[0] == again
    assert len(first[0]) == 40 and other_seed != first[0]


def test_cancel_mid_stream_frees_all_kv(cluster, client):
    stream = client.generate("class Point:", max_new_tokens=400, ignore_eos=True)
    got = [next(stream) for _ in range(3)]
    assert sum(len(c.token_ids) for c in got) >= 3
    stream.close()  # cancels the call
    assert all_free(wait_kv_free(cluster))


def test_deadline_frees_all_kv(cluster, client):
    with pytest.raises(grpc.RpcError) as e:
        for _ in client.generate("import os", max_new_tokens=450, ignore_eos=True, timeout=0.3):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert all_free(wait_kv_free(cluster))


def test_health_and_reflection(cluster):
    for address in (cluster.coordinator, cluster.target, cluster.draft):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=5)
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert "grpc.health.v1.Health" in names
            assert names & {"specdec.v1.Generation", "specdec.v1.Target", "specdec.v1.Draft"}
    with grpc.insecure_channel(cluster.coordinator) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="specdec.v1.Generation")]), timeout=5)
        assert any(r.file_descriptor_response.file_descriptor_proto for r in responses)


def test_draft_server_loss_falls_back_to_plain_decoding(cluster, client, plain_outputs):
    """Last but one in the module: kills the draft. Requests go on, by plain decoding, with the same output."""
    draft = cluster.procs["draft_server"].popen
    os.kill(draft.pid, signal.SIGKILL)
    draft.wait(10)
    outputs = run_many(cluster.coordinator, PROMPTS[:6], 3, max_new_tokens=MAX_NEW, num_draft=4)
    assert outputs == plain_outputs[:6]
    chunks = list(client.generate(PROMPTS[0], max_new_tokens=MAX_NEW))
    assert chunks[-1].usage.draft_tokens == 0
    assert tuple(t for c in chunks for t in c.token_ids) == plain_outputs[0]


def test_draft_server_back_resumes_speculation(cluster, client, plain_outputs):
    """After the test above: a new draft server on the same port. The coordinator finds it again,
    re-sends the sequences it lost, and speculation is back, still lossless."""
    restart(cluster.procs["draft_server"])
    long = {"ignore_eos": True, "max_new_tokens": 200}
    stream = client.generate(PROMPTS[1], **long)  # runs while the draft comes back
    for _ in range(100):
        chunks = list(client.generate(PROMPTS[0], max_new_tokens=MAX_NEW))
        if chunks[-1].usage.draft_tokens:
            break
        time.sleep(0.1)
    assert chunks[-1].usage.draft_tokens > 0
    assert tuple(t for c in chunks for t in c.token_ids) == plain_outputs[0]
    rest = [t for c in stream for t in c.token_ids]
    assert len(rest) == 200 and tuple(rest[:len(plain_outputs[1])]) == plain_outputs[1]
    assert run_many(cluster.coordinator, PROMPTS, 8, max_new_tokens=MAX_NEW, num_draft=4) == plain_outputs
    assert all_free(wait_kv_free(cluster))
