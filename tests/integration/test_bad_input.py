"""Bad requests get INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the problem, and every process of
the cluster keeps serving; a draft with another vocabulary stops the coordinator at start-up."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest

from coordinator.client import AsyncClient, Client
from coordinator.launch import REPO_ROOT, spawn_server, stop_all, wait_healthy
from tests.helpers.cluster import all_free, tiny_cluster, wait_kv_free
from tests.helpers.tiny_models import make_checkpoint

INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # 24 KV blocks of 16 tokens on each server; 2 running requests and 1 waiting at most.
    with tiny_cluster(tmp_path_factory.mktemp("bad_input"), server_args=["--num-blocks", "24"],
                      coordinator_args=["--max-batch-size", "2", "--max-waiting", "1"]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.coordinator) as c:
        yield c


CASES = [
    ("empty text prompt", "", {}, INVALID, "prompt.text: empty"),
    ("empty token prompt", [], {}, INVALID, "prompt.token_ids: empty"),
    ("prompt over max_model_len", [5] * 512, {}, INVALID, "prompt: 512 tokens"),
    ("long text prompt", "def add(a, b): " * 200, {}, INVALID, "the model allows at most 511"),
    ("token id above vocab", [5, 320], {}, INVALID, "prompt.token_ids: token id 320 is outside"),
    ("negative token id", [-1, 5], {}, INVALID, "prompt.token_ids: token id -1"),
    ("negative max tokens", "hi", {"max_new_tokens": -5}, INVALID, "max_new_tokens: must be positive"),
    ("zero max tokens", "hi", {"max_new_tokens": 0}, INVALID, "max_new_tokens"),
    ("negative temperature", "hi", {"temperature": -0.5}, INVALID, "sampling.temperature"),
    ("nan temperature", "hi", {"temperature": float("nan")}, INVALID, "sampling.temperature"),
    ("top_p above one", "hi", {"top_p": 1.5}, INVALID, "sampling.top_p"),
    ("negative top_k", "hi", {"top_k": -3}, INVALID, "sampling.top_k"),
    ("min_p above one", "hi", {"min_p": 2.0}, INVALID, "sampling.min_p"),
    ("stop token outside vocab", "hi", {"stop_token_ids": [999]}, INVALID, "stop_token_ids: token id 999"),
    ("empty stop string", "hi", {"stop": ["ok", ""]}, INVALID, "stop[1]: empty"),
    ("stop string too long", "hi", {"stop": ["ok", "-" * 257]}, INVALID, "stop[1]: longer than 256 characters"),
    ("too many stop token ids", "hi", {"stop_token_ids": [5] * 1025}, INVALID, "stop_token_ids: at most 1024"),
    ("request_id with a newline", "hi", {"request_id": "a\nINFO forged"}, INVALID, "request_id: printable"),
    ("num_draft too large", "hi", {"num_draft": 1000}, INVALID, "num_draft"),
    ("negative num_draft", "hi", {"num_draft": -1}, INVALID, "num_draft"),
    ("more KV than the servers have", "hi", {"max_new_tokens": 450}, EXHAUSTED, "kv cache"),
]


@pytest.mark.parametrize("name, prompt, params, code, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_its_status(client, name, prompt, params, code, message):
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(prompt, **{"max_new_tokens": 8, **params}))
    assert e.value.code() == code, e.value.details()
    assert message in e.value.details()


CORRUPT = b"\xff\xff\xff\x07"  # a field header that promises more bytes than follow


@pytest.mark.parametrize("role, method, streams", [
    ("coordinator", "/specdec.v1.Generation/Generate", "unary_stream"),
    ("coordinator", "/specdec.v1.Generation/Info", "unary_unary"),
    ("target_server", "/specdec.v1.Target/Info", "unary_unary"),
    ("target_server", "/specdec.v1.Target/Verify", "stream_stream"),
    ("draft_server", "/specdec.v1.Draft/Propose", "stream_stream"),
])
def test_bytes_that_are_not_a_request_are_invalid_argument(cluster, role, method, streams):
    """Undecodable request bytes (any client may send them) are INVALID_ARGUMENT with a message,
    logged as bad input, not UNKNOWN / INTERNAL with a traceback (before: gRPC answered a unary
    request's DecodeError itself, and a stream's came out of the handler as INTERNAL)."""
    proc = cluster.procs[role]
    with grpc.insecure_channel(proc.address) as channel:
        rpc = getattr(channel, streams)(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            if streams == "unary_unary":
                rpc(CORRUPT, timeout=10)
            elif streams == "unary_stream":
                list(rpc(CORRUPT, timeout=10))
            else:
                list(rpc(iter([CORRUPT]), timeout=10))
    assert e.value.code() == INVALID and "request: not a valid message" in e.value.details()
    log = proc.log_path.read_text(errors="replace")
    assert "Traceback" not in log and " ERROR " not in log, log[-2000:]


def test_more_concurrent_requests_than_capacity(cluster):
    async def main():
        async with AsyncClient(cluster.coordinator) as client:
            async def one(i):
                try:
                    chunks = [c async for c in client.generate(f"def f{i}(x):", max_new_tokens=80,
                                                               ignore_eos=True)]
                    return sum(len(c.token_ids) for c in chunks)
                except grpc.aio.AioRpcError as e:
                    return e
            return await asyncio.gather(*(one(i) for i in range(8)))
    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
    assert served and all(n == 80 for n in served)
    assert len(refused) >= 8 - 3  # 2 running + 1 waiting at most
    assert all(e.code() == EXHAUSTED and "capacity" in e.details() for e in refused)


def test_servers_still_serve(cluster, client):
    for proc in cluster.procs.values():
        assert proc.popen.poll() is None, f"{proc.name} died:\n{proc.log_tail()}"
    chunks = list(client.generate("def add(a, b):", max_new_tokens=16, ignore_eos=True))
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 16
    assert all_free(wait_kv_free(cluster))


def test_incompatible_draft_is_a_clear_start_up_error(cluster, tmp_path):
    """A coordinator given a draft with another vocabulary refuses to start and says why."""
    other = make_checkpoint(tmp_path / "other", vocab_size=384, seed=3)
    draft = spawn_server("draft", other, tmp_path, args=["--warmup-batch-sizes", "1"])
    try:
        wait_healthy(draft, 120)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        done = subprocess.run([sys.executable, "-m", "coordinator", "--target", cluster.target,
                               "--draft", draft.address, "--port", "0"],
                              capture_output=True, text=True, timeout=60, env=env, cwd=REPO_ROOT)
    finally:
        stop_all([draft])
    assert done.returncode == 1
    assert "vocab_size: target 320 != draft 384" in done.stderr
    assert "tokenizer_fingerprint" in done.stderr
