"""The model servers' step channel (specdec/serving/step_channel.py) and the coordinator's use of
it (coordinator/servers.py ChannelCall): a real target server on the CPU.

- Info names the channel's port; a Verify step over it answers what the same step over the gRPC
  stream answers (on two fresh sequences of the same prompt);
- bad frames (not a VerifyRequest, an impossible length, a connection cut inside a frame) get an
  INVALID_ARGUMENT error frame or a close, counted in the server's errors, and the server goes on
  serving both the channel and gRPC;
- the coordinator's ModelServer steps over the channel where Info names one, over gRPC with
  step_channel=False or against a server started with --step-port -1, and finds the channel again
  after the server it talks to restarted (on another port); a channel it cannot connect to sends
  that step over gRPC, and gRPC stays until an Info names another port or follows a failure;
- a --step-port in use is a start-up error;
- through the whole cluster, greedy output is the same with --step-channel grpc and auto, and the
  coordinator's log says which it used.
"""
from __future__ import annotations

import asyncio
import socket
import struct

import grpc
import pytest
from prometheus_client import CollectorRegistry

from coordinator.launch import free_port, spawn_server, start_healthy, start_process, stop_all
from coordinator import servers as servers_mod
from coordinator.servers import ModelServer, StepFailed
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from protos.wire import FRAME_ERROR, FRAME_MESSAGE, frame, pack_ids
from specdec.metrics import STEP_TRANSPORTS, CoordinatorMetrics
from tests.helpers.cluster import server_info, tiny_cluster
from tests.helpers.tiny_models import make_pair
from tests.integration.test_services import run_many

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("channel"))


@pytest.fixture
def target(pair, tmp_path):
    procs = [spawn_server("target", pair[0], tmp_path, device="cpu", args=["--warmup-batch-sizes", "1"],
                          cpu_threads=1)]
    try:
        start_healthy(procs[0], 120)
        yield procs[0]
    finally:
        stop_all(procs)


def first_step(seq_id: int, step: int = 1) -> pb.VerifyRequest:
    request = pb.VerifyRequest(step=step)
    request.seqs.add(seq_id=seq_id, new_tokens=pack_ids(PROMPT), draft_tokens=pack_ids([9, 9]), first=True)
    return request


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < 5:
        chunk = sock.recv(5 - len(head))
        if not chunk:
            raise EOFError("closed")
        head += chunk
    length, kind = struct.unpack("<IB", head)
    body = b""
    while len(body) < length - 1:
        body += sock.recv(length - 1 - len(body))
    return kind, body


def channel_socket(proc) -> socket.socket:
    port = server_info(proc.address, "target").step_port
    assert port > 0
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_a_verify_over_the_channel_answers_as_over_grpc(target):
    with channel_socket(target) as sock:
        sock.sendall(frame(first_step(1).SerializeToString()))
        kind, body = recv_frame(sock)
    assert kind == FRAME_MESSAGE
    over_channel = pb.VerifyResponse.FromString(body)
    with grpc.insecure_channel(target.address) as ch:
        over_grpc = next(pb_grpc.TargetStub(ch).Verify(iter([first_step(2)]), timeout=10))
    assert over_channel.step == over_grpc.step == 1
    assert [(r.accepted, r.next_token) for r in over_channel.results] == \
        [(r.accepted, r.next_token) for r in over_grpc.results]
    assert over_channel.results[0].next_token >= 0 and over_channel.timing.step_seconds > 0
    info = server_info(target.address, "target")
    assert info.num_sequences == 2     # the channel's sequence is the server's like any other


@pytest.mark.parametrize("bad", ["not a message", "impossible length", "cut inside a frame"])
def test_bad_frames_are_refused_and_the_server_goes_on(target, bad):
    with channel_socket(target) as sock:
        if bad == "not a message":
            sock.sendall(frame(b"\xff\xff\xff"))
        elif bad == "impossible length":
            sock.sendall(struct.pack("<IB", 0, FRAME_MESSAGE))
        else:
            sock.sendall(frame(first_step(1).SerializeToString())[:9])
            sock.shutdown(socket.SHUT_WR)
        kind, body = recv_frame(sock)
        assert kind == FRAME_ERROR and body.decode().startswith("INVALID_ARGUMENT: ")
        with pytest.raises(EOFError):
            recv_frame(sock)              # and the connection is closed
    with channel_socket(target) as sock:  # the server serves the next connection
        sock.sendall(frame(first_step(3).SerializeToString()))
        kind, body = recv_frame(sock)
        assert kind == FRAME_MESSAGE and pb.VerifyResponse.FromString(body).results[0].next_token >= 0
    assert server_info(target.address, "target").num_sequences >= 1


def test_model_server_steps_over_the_channel_or_grpc_and_follows_a_restart(pair, tmp_path):
    for d in "ac":
        (tmp_path / d).mkdir()
    async def steps(address: str, channel: bool, seq_id: int) -> tuple[str, list]:
        server = ModelServer("target", address, step_channel=channel)
        try:
            await server.wait_ready(30)
            got = []
            for step in (1, 2):
                request = first_step(seq_id + step, step)
                got.append([(r.accepted, r.next_token) for r in (await server.step(request, timeout=10)).results])
            return server.transport, got
        finally:
            await server.close()

    procs = [spawn_server("target", pair[0], tmp_path / "a", device="cpu", args=["--warmup-batch-sizes", "1"],
                          cpu_threads=1)]
    try:
        start_healthy(procs[0], 120)
        address = procs[0].address
        transport, over_channel = asyncio.run(steps(address, True, 10))
        assert transport == "channel"
        transport, over_grpc = asyncio.run(steps(address, False, 20))
        assert transport == "grpc" and over_grpc == over_channel

        async def across_restart():
            server = ModelServer("target", address)
            try:
                await server.wait_ready(30)
                old_port = server.step_port
                await server.step(first_step(30), timeout=10)
                stop_all(procs)
                procs[0].argv += ["--step-port", str(free_port())]   # the same gRPC port, another channel
                start_process(procs[0])
                await asyncio.get_running_loop().run_in_executor(None, start_healthy, procs[0], 120)
                # The old connection is gone: dropped between steps, the step goes to the old
                # channel port, which refuses it, and then over gRPC to the new server; a drop seen
                # only inside the step fails it.
                try:
                    await server.step(first_step(31, 2), timeout=10)
                    assert server.transport == "grpc"
                except (ConnectionError, StepFailed):
                    pass
                await server.wait_ready(30)                           # what the coordinator does next
                assert server.step_port != old_port and server.transport == "channel"
                return (await server.step(first_step(32, 3), timeout=10)).results[0].next_token
            finally:
                await server.close()
        assert asyncio.run(across_restart()) >= 0
    finally:
        stop_all(procs)

    procs = [spawn_server("target", pair[0], tmp_path / "c", device="cpu",
                          args=["--warmup-batch-sizes", "1", "--step-port", "-1"], cpu_threads=1)]
    try:
        start_healthy(procs[0], 120)
        assert server_info(procs[0].address, "target").step_port == 0
        transport, without = asyncio.run(steps(procs[0].address, True, 40))
        assert transport == "grpc" and without == over_channel
    finally:
        stop_all(procs)


def test_the_cluster_serves_the_same_over_either_transport(tmp_path):
    prompts = ["def add(a, b):", "The quick brown fox", "for i in range(10):"]
    outputs, logs = {}, {}
    for mode in ("grpc", "auto"):
        with tiny_cluster(tmp_path / mode, coordinator_args=["--step-channel", mode]) as cluster:
            outputs[mode] = run_many(cluster.coordinator, prompts, 3, max_new_tokens=12)
            logs[mode] = (cluster.log_dir / "coordinator.log").read_text()
    assert outputs["auto"] == outputs["grpc"]
    assert "target steps over its step channel" in logs["auto"] and "draft steps over its step channel" in logs["auto"]
    assert "target steps over the gRPC stream" in logs["grpc"]


def test_a_step_port_in_use_is_a_clear_start_up_error(pair, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen(1)
        taken = blocker.getsockname()[1]
        proc = spawn_server("target", pair[0], tmp_path, device="cpu",
                            args=["--warmup-batch-sizes", "1", "--step-port", str(taken)], cpu_threads=1)
        try:
            assert proc.popen.wait(timeout=120) == 2
        finally:
            stop_all([proc])
    assert f"--step-port {taken}: cannot listen on it" in proc.log_path.read_text()


def test_an_unreachable_channel_falls_back_to_grpc_without_losing_the_step(target):
    registry = CollectorRegistry()

    def transport() -> str:   # specdec_step_transport_state's 1 for the target
        return next(t for t in STEP_TRANSPORTS if registry.get_sample_value(
            "specdec_step_transport_state", {"role": "target", "transport": t}) == 1)

    async def main():
        server = ModelServer("target", target.address, metrics=CoordinatorMetrics(registry))
        try:
            await server.wait_ready(30)
            with socket.socket() as s:           # a port nothing listens on (a firewall's refusal)
                s.bind(("127.0.0.1", 0))
                closed = s.getsockname()[1]
            real, server.step_port = server.step_port, closed
            got = (await server.step(first_step(50), timeout=10)).results[0]
            assert got.next_token >= 0 and server.transport == "grpc"   # answered, over gRPC
            assert transport() == "grpc"
            await server.info()                  # another port named: the channel is tried again
            assert server.step_port == real and server.transport == "channel"
            server._channel_off = True           # as if the real port had been unreachable
            await server.info()                  # the same port, no failure since: gRPC stays
            assert server.transport == "grpc"
            with pytest.raises(asyncio.TimeoutError):
                await server.step(first_step(51, 2), timeout=1e-6)
            await server.info()                  # an Info after a failed call: the channel again
            assert server.transport == "channel"
            again = (await server.step(first_step(52, 3), timeout=10)).results[0]
            assert transport() == "socket"       # the gauge follows the channel back
            return got, again
        finally:
            await server.close()
    got, again = asyncio.run(main())
    assert (got.accepted, got.next_token) == (again.accepted, again.next_token)


@pytest.mark.parametrize("channel", [True, False])
def test_on_sent_runs_once_per_request_after_the_write(target, channel, monkeypatch):
    """ModelServer.step's on_sent (the coordinator builds the Verify in it while the draft works):
    called once per request that has one, over either transport; over the step channel, after the
    request went out and before its answer is read."""
    seen = []
    real_read = servers_mod.ChannelCall.read

    async def read(self):
        seen.append("read")
        return await real_read(self)
    monkeypatch.setattr(servers_mod.ChannelCall, "read", read)

    async def main():
        server = ModelServer("target", target.address, step_channel=channel)
        await server.info()
        try:
            response = await server.step(first_step(7), timeout=30, on_sent=lambda: seen.append(server.transport))
            assert len(response.results) == 1 and not response.results[0].HasField("error")
            await server.step(pb.VerifyRequest(step=2, release=[7]), timeout=30)   # without one
        finally:
            await server.close()
    asyncio.run(main())
    assert seen == (["channel", "read", "read"] if channel else ["grpc"])
