"""A local specdec cluster (target, draft, coordinator as real processes on loopback) of a tiny
model pair, for integration tests; and small helpers to look at the servers' KV."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from coordinator.launch import Cluster, local_cluster
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests.helpers.tiny_models import make_pair


@contextlib.contextmanager
def tiny_cluster(root: Path, *, server_args: Sequence[str] = (), coordinator_args: Sequence[str] = (),
                 target_args: Sequence[str] = ()) -> Iterator[Cluster]:
    target, draft = make_pair(root)
    with local_cluster(target, draft, device="cpu", log_dir=root / "logs",
                       server_args=["--warmup-batch-sizes", "1", *server_args],
                       coordinator_args=coordinator_args, startup_timeout=120,
                       target_args=target_args) as cluster:
        yield cluster


def server_info(address: str, role: str) -> pb.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        stub = (pb_grpc.DraftStub if role == "draft" else pb_grpc.TargetStub)(channel)
        return stub.Info(pb.InfoRequest(), timeout=5)


def wait_kv_free(cluster: Cluster, timeout: float = 10.0) -> dict[str, pb.ModelInfo]:
    """Polls both servers until every KV block is free and no sequence is held; returns their Info."""
    deadline = time.monotonic() + timeout
    while True:
        infos = {role: server_info(addr, role) for role, addr in
                 (("target", cluster.target), ("draft", cluster.draft))}
        if all(i.kv_blocks_free == i.kv_blocks_total and i.num_sequences == 0 for i in infos.values()):
            return infos
        if time.monotonic() > deadline:
            return infos
        time.sleep(0.05)


def all_free(infos: dict[str, pb.ModelInfo]) -> bool:
    return all(i.kv_blocks_free == i.kv_blocks_total and i.num_sequences == 0 for i in infos.values())
