"""Shared-memory frames on the step channel (protos/shared_slots.py), a real target server on the
CPU and the coordinator's ModelServer:

- a ModelServer that polls (poll_s > 0) offers the server shared slots on a new connection; the
  server takes them and the steps' answers equal those over plain socket frames (poll_s 0, no
  offer) and over gRPC; the answers did come through the slot; the coordinator holds no
  descriptor of a mapping after its steps;
- a server with SPECDEC_STEP_SHM=0 refuses the offer and the same steps go over socket frames; so
  do they against a server that does not know the offer (an older one: it answers an error frame
  and closes), on a new connection; the ModelServer offers no more after a refusal;
- the coordinator's specdec_step_transport_state gauge names the transport its steps took
  (shared, socket or grpc);
- through the whole cluster with the coordinator polling, greedy output is the same with the
  coordinator's shared frames on and off, and its log says they were used.
"""
from __future__ import annotations

import asyncio
import os

import pytest
from prometheus_client import CollectorRegistry

from coordinator.launch import spawn_server, start_healthy, stop_all
from coordinator.servers import ModelServer
from protos import shared_slots
from protos import specdec_pb2 as pb
from protos.wire import FRAME_ERROR, FRAME_MESSAGE, frame, read_frame
from specdec.metrics import STEP_TRANSPORTS, CoordinatorMetrics
from tests.helpers.cluster import tiny_cluster
from tests.helpers.tiny_models import make_pair
from tests.integration.test_services import run_many
from tests.integration.test_step_channel import first_step

pytestmark = pytest.mark.skipif(not (shared_slots.SPIN and shared_slots.AVAILABLE),
                                reason="shared-memory frames need sealed memfds (Linux) and an x86 CPU (polled slots)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("shared"))


def _memfds() -> list[str]:
    """This process's open descriptors of step-channel mappings."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:specdec-step"):
            out.append(target)
    return out


def _spawn(pair, tmp_path, env=None):
    old = os.environ.get("SPECDEC_STEP_SHM")
    if env is not None:
        os.environ["SPECDEC_STEP_SHM"] = env
    try:
        proc = spawn_server("target", pair[0], tmp_path, device="cpu", args=["--warmup-batch-sizes", "1"],
                            cpu_threads=1)
    finally:
        if env is not None:
            os.environ.pop("SPECDEC_STEP_SHM") if old is None else os.environ.__setitem__("SPECDEC_STEP_SHM", old)
    start_healthy(proc, 120)
    return proc


def _transport(registry: CollectorRegistry, role: str = "target") -> dict[str, float | None]:
    """specdec_step_transport_state's series of `role`, by transport."""
    return {t: registry.get_sample_value("specdec_step_transport_state", {"role": role, "transport": t})
            for t in STEP_TRANSPORTS}


async def _steps(address: str, poll_s: float, seq_id: int, channel: bool = True, metrics=None):
    """(answers of three steps, whether they came through shared slots, the refusal if any)."""
    server = ModelServer("target", address, metrics=metrics, step_channel=channel, poll_s=poll_s)
    try:
        await server.wait_ready(30)
        got = []
        for step in (1, 2, 3):
            request = first_step(seq_id + step, step)
            got.append([(r.accepted, r.next_token) for r in (await server.step(request, timeout=20)).results])
        call = server._call
        slotted = getattr(call, "_inbox", None) is not None and call._inbox._taken == 3
        return got, slotted, server.shared.refused
    finally:
        await server.close()


def test_steps_through_shared_slots_answer_as_over_the_socket(pair, tmp_path):
    proc = _spawn(pair, tmp_path)
    try:
        registries = [CollectorRegistry() for _ in range(3)]
        shared, slotted, refused = asyncio.run(_steps(proc.address, 0.02, 10,
                                                      metrics=CoordinatorMetrics(registries[0])))
        assert slotted and refused is None
        plain, slotted, _ = asyncio.run(_steps(proc.address, 0.0, 20, metrics=CoordinatorMetrics(registries[1])))
        assert not slotted and plain == shared
        over_grpc, _, _ = asyncio.run(_steps(proc.address, 0.02, 30, channel=False,
                                             metrics=CoordinatorMetrics(registries[2])))
        assert over_grpc == shared
        # specdec_step_transport_state says how each ModelServer's steps traveled.
        assert [_transport(r) for r in registries] == [dict(grpc=0, socket=0, shared=1),
                                                       dict(grpc=0, socket=1, shared=0),
                                                       dict(grpc=1, socket=0, shared=0)]
        assert all(r[0][1] >= 0 for r in shared)
        assert _memfds() == []                         # every offered descriptor was closed
    finally:
        stop_all([proc])


def test_a_server_that_refuses_gets_socket_frames(pair, tmp_path):
    proc = _spawn(pair, tmp_path, env="0")
    try:
        registry = CollectorRegistry()
        got, slotted, refused = asyncio.run(_steps(proc.address, 0.02, 10, metrics=CoordinatorMetrics(registry)))
        assert not slotted and "SPECDEC_STEP_SHM=0 on the server" in refused
        assert _transport(registry) == dict(grpc=0, socket=1, shared=0)
        assert all(r[0][1] >= 0 for r in got)
    finally:
        stop_all([proc])


def test_a_server_that_does_not_know_the_offer_is_stepped_on_a_new_connection():
    """An older server: any frame but a message is answered with an error frame and a close."""
    async def main():
        connections = []

        async def serve(reader, writer):
            connections.append(True)
            while True:
                try:
                    kind, payload = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                if kind != FRAME_MESSAGE:
                    writer.write(frame(f"INVALID_ARGUMENT: a frame of kind {kind}".encode(), FRAME_ERROR))
                    break
                request = pb.VerifyRequest.FromString(payload)
                response = pb.VerifyResponse(step=request.step)
                response.results.add(seq_id=request.seqs[0].seq_id, next_token=7)
                writer.write(frame(response.SerializeToString()))
            writer.close()
        old = await asyncio.start_server(serve, "127.0.0.1", 0)
        registry = CollectorRegistry()
        server = ModelServer("target", "127.0.0.1:1", metrics=CoordinatorMetrics(registry), poll_s=0.02)
        server.step_port = old.sockets[0].getsockname()[1]
        try:
            answers = [(await server.step(first_step(5, step), timeout=10)).results[0].next_token for step in (1, 2)]
            assert answers == [7, 7] and len(connections) == 2
            assert "a frame of kind 3" in server.shared.refused
            assert _transport(registry) == dict(grpc=0, socket=1, shared=0)
            server.reset()
            await server.step(first_step(5, 3), timeout=10)
            assert len(connections) == 3               # no offer again: one connection, not two
        finally:
            await server.close()
            old.close()
    asyncio.run(main())


def test_the_cluster_serves_the_same_with_shared_frames_on_and_off(tmp_path, monkeypatch):
    prompts = ["def add(a, b):", "The quick brown fox", "for i in range(10):"]
    outputs, logs = {}, {}
    for mode in ("1", "0"):
        monkeypatch.setenv("SPECDEC_STEP_SHM", mode)
        with tiny_cluster(tmp_path / mode, coordinator_args=["--busy-poll-ms", "5"]) as cluster:
            outputs[mode] = run_many(cluster.coordinator, prompts, 3, max_new_tokens=12)
            logs[mode] = (cluster.log_dir / "coordinator.log").read_text()
    assert outputs["1"] == outputs["0"]
    assert "Verify step channel" in logs["1"] and "Propose step channel" in logs["1"]
    assert "frames through shared memory" not in logs["0"]
