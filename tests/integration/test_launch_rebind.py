"""A port launch.py chose is taken before the server binds it (any process's outgoing connection can
take an ephemeral port): start_healthy starts the server again on fresh ports and it serves there."""
from __future__ import annotations

import socket

import grpc

from coordinator import launch
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests.helpers.tiny_models import make_checkpoint


def _occupied_then_free(monkeypatch, taken: int):
    """free_port answers `taken` first, then real free ports."""
    real = launch.free_port
    answers = [taken]
    monkeypatch.setattr(launch, "free_port", lambda: answers.pop(0) if answers else real())


def _info(address: str) -> pb.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.TargetStub(channel).Info(pb.InfoRequest(), timeout=10)


def test_server_whose_grpc_port_was_taken_starts_again_elsewhere(tmp_path, monkeypatch):
    model = make_checkpoint(tmp_path / "target", layers=1, seed=3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        _occupied_then_free(monkeypatch, taken)
        proc = launch.spawn_server("target", model, tmp_path, args=["--warmup-batch-sizes", "1"])
        try:
            assert proc.address == f"127.0.0.1:{taken}"
            launch.start_healthy(proc, 120)
            assert proc.address != f"127.0.0.1:{taken}"
            assert proc.metrics_address != proc.address
            assert _info(proc.address).vocab_size > 0
            log = proc.log_path.read_text(errors="replace")
            assert "Failed to bind to address" in log  # the first run died on the taken port
            assert "Failed to bind" not in proc.log_since_start()  # the second did not
        finally:
            launch.stop_all([proc])


def test_other_start_up_failures_are_not_retried(tmp_path, monkeypatch):
    proc = launch.spawn_server("target", tmp_path / "no-such-model", tmp_path)
    starts = []
    real_start = launch.start_process
    monkeypatch.setattr(launch, "start_process", lambda p: starts.append(p) or real_start(p))
    try:
        launch.start_healthy(proc, 60)
    except launch.LaunchError as e:
        assert "exited with code" in str(e)
    else:
        raise AssertionError("a server without a model became healthy")
    finally:
        launch.stop_all([proc])
    assert starts == []
