"""Both model servers as real processes on loopback: health, reflection, Info, the bidi step streams,
and bad input answered with INVALID_ARGUMENT while the server keeps serving."""
from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.tokenizer_info import tokenizer_fingerprint
from tests.helpers.tiny_models import make_pair

ROOT = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 60


def ids(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def unids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


class Server:
    def __init__(self, role: str, model: Path, log: Path):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"{role}_server", "--model", str(model), "--port", "0",
                 "--host", "127.0.0.1", "--num-blocks", "64", "--block-size", "8",
                 "--warmup-batch-sizes", "1"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.port = self._wait_for_port()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            m = re.search(r"listening on \S+:(\d+)", self.log.read_text())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"server did not start:\n{self.log.read_text()}")

    def wait_serving(self, service: str) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.1)
        raise RuntimeError(f"not SERVING:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            assert self.proc.wait(timeout=15) == 0, self.log.read_text()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("servers")
    target_path, draft_path = make_pair(root)
    started = []
    try:
        for role, path in (("draft", draft_path), ("target", target_path)):
            started.append(Server(role, path, root / f"{role}.log"))
        draft, target = started
        draft.wait_serving("specdec.v1.Draft")
        target.wait_serving("specdec.v1.Target")
        yield {"draft": draft, "target": target, "draft_path": draft_path, "target_path": target_path}
    finally:
        for s in started:
            s.stop()  # a clean exit on SIGTERM (status 0) is part of the test


class Stream:
    """A persistent bidi call: write one request, read its response."""

    def __init__(self, method):
        self.requests: queue.Queue = queue.Queue()
        self.responses = method(iter(self.requests.get, None))

    def step(self, request):
        self.requests.put(request)
        return next(self.responses)

    def close(self):
        self.requests.put(None)


def test_health_and_reflection(servers):
    for role in ("draft", "target"):
        channel = servers[role].channel
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == \
            health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert {f"specdec.v1.{role.title()}", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_info(servers):
    d = pb_grpc.DraftStub(servers["draft"].channel).Info(pb.InfoRequest(), timeout=10)
    t = pb_grpc.TargetStub(servers["target"].channel).Info(pb.InfoRequest(), timeout=10)
    for info in (d, t):
        assert info.architecture == "LlamaForCausalLM" and info.vocab_size == 320
        assert info.kv_blocks_total == 64 and info.block_size == 8 and info.max_model_len == 512
        assert info.device == "cpu" and info.dtype == "float32" and list(info.eos_token_ids) == [0]
        assert info.tensor_parallel_size == 1
        assert info.max_num_draft == 16 and list(info.device_uuids) == []  # the default; no GPU
    assert d.tokenizer_fingerprint == t.tokenizer_fingerprint == tokenizer_fingerprint(servers["target_path"])
    assert d.model_name == str(servers["draft_path"])


def test_propose_verify_round_trip(servers):
    draft = Stream(pb_grpc.DraftStub(servers["draft"].channel).Propose)
    target = Stream(pb_grpc.TargetStub(servers["target"].channel).Verify)
    sampled = pb.SamplingParams(temperature=0.9, top_k=40, seed=5)
    prompt = [5, 17, 42, 99, 7]
    keep, d_new, t_new, out = [0, 0], [prompt, prompt], [prompt, prompt], [[], []]
    try:
        for step in range(3):
            prop = draft.step(pb.ProposeRequest(step=step, seqs=[
                pb.DraftSeq(seq_id=1, keep=keep[0], new_tokens=ids(d_new[0]), num_draft=3,
                            first=step == 0),
                pb.DraftSeq(seq_id=2, keep=keep[1], new_tokens=ids(d_new[1]), num_draft=2, sampling=sampled,
                            first=step == 0)]))
            assert prop.step == step and [r.seq_id for r in prop.results] == [1, 2]
            assert prop.timing.num_forwards == 3 and prop.timing.batch_size == 2
            assert prop.timing.forward_seconds > 0 and prop.timing.decode_forward_seconds > 0
            greedy, samp = prop.results
            assert not greedy.HasField("error") and not greedy.HasField("probs")
            assert samp.probs.rows == 2 and samp.probs.vocab_size == 320 and samp.probs.encoding != 0
            ver = target.step(pb.VerifyRequest(step=step, seqs=[
                pb.VerifySeq(seq_id=1, new_tokens=ids(t_new[0]), draft_tokens=greedy.tokens,
                             first=step == 0),
                pb.VerifySeq(seq_id=2, new_tokens=ids(t_new[1]), draft_tokens=samp.tokens,
                             draft_probs=samp.probs, sampling=sampled, first=step == 0)]))
            assert ver.step == step and ver.timing.num_forwards == 1
            for i, (p, v) in enumerate(zip(prop.results, ver.results)):
                assert not v.HasField("error") and 0 <= v.accepted <= len(unids(p.tokens))
                assert 0 <= v.next_token < 320
                out[i] += unids(p.tokens)[:v.accepted] + [v.next_token]
                keep[i], d_new[i], t_new[i] = v.accepted, [v.next_token], [v.next_token]
        assert all(len(o) >= 3 for o in out)
    finally:
        draft.close()
        target.close()
    for role, stub in (("draft", pb_grpc.DraftStub), ("target", pb_grpc.TargetStub)):
        reply = stub(servers[role].channel).Release(pb.ReleaseRequest(seq_ids=[1, 2, 77]), timeout=10)
        assert reply.released == 2 and reply.kv_blocks_free == 64


def test_bad_requests(servers):
    target = pb_grpc.TargetStub(servers["target"].channel)
    # Malformed packed fields fail their own sequence, naming the field with its index; the rest of
    # the batch is served and the stream goes on.
    reply = list(target.Verify(iter([pb.VerifyRequest(step=1, seqs=[
        pb.VerifySeq(seq_id=3, new_tokens=b"\x01\x02\x03"),
        pb.VerifySeq(seq_id=3, new_tokens=ids([1]), draft_tokens=ids([2]),
                     sampling=pb.SamplingParams(temperature=1.0),
                     draft_probs=pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=1, vocab_size=320,
                                          values=b"\0"))])]), timeout=10))[0]
    bad_bytes, bad_probs = reply.results
    assert bad_bytes.error.code == 3 and bad_bytes.error.message.startswith("seqs[0].new_tokens")
    assert bad_probs.error.code == 3 and bad_probs.error.message.startswith("seqs[1].draft_probs.values")
    # A bad sequence fails alone; the server still serves on new streams.
    reply = list(target.Verify(iter([pb.VerifyRequest(step=2, seqs=[
        pb.VerifySeq(seq_id=4, new_tokens=ids([1, 999]), first=True),
        pb.VerifySeq(seq_id=5, new_tokens=ids([1, 2]), sampling=pb.SamplingParams(temperature=-1),
                     first=True),
        pb.VerifySeq(seq_id=6, new_tokens=ids([1, 2]), first=True)])]), timeout=10))[0]
    bad_token, bad_sampling, ok = reply.results
    assert bad_token.error.code == 3 and "new_tokens" in bad_token.error.message
    assert bad_sampling.error.code == 3 and "seqs[1].sampling.temperature" in bad_sampling.error.message
    assert not ok.HasField("error") and 0 <= ok.next_token < 320
    draft = pb_grpc.DraftStub(servers["draft"].channel)
    reply = list(draft.Propose(iter([pb.ProposeRequest(seqs=[pb.DraftSeq(seq_id=1, new_tokens=b"\x01")])]),
                               timeout=10))[0]
    assert reply.results[0].error.code == 3 and "seqs[0].new_tokens" in reply.results[0].error.message
    info = target.Info(pb.InfoRequest(), timeout=10)
    assert info.num_sequences == 1  # seq 6 holds KV; the failed ones hold nothing
    assert target.Release(pb.ReleaseRequest(seq_ids=[6]), timeout=10).kv_blocks_free == 64
    assert draft.Info(pb.InfoRequest(), timeout=10).kv_blocks_free == 64
