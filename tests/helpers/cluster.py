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


def log_offsets(cluster: Cluster) -> dict[str, int]:
    """Each process's log size now: logged_lines reads what comes after."""
    return {name: proc.log_path.stat().st_size for name, proc in cluster.procs.items()}


def logged_lines(cluster: Cluster, offsets: dict[str, int],
                 words: Sequence[str] = ("Traceback", " ERROR ")) -> dict[str, list[str]]:
    """Per process, the lines logged since `offsets` that hold any of `words` (processes with none
    left out)."""
    out = {}
    for name, proc in cluster.procs.items():
        with open(proc.log_path, "rb") as f:
            f.seek(offsets[name])
            text = f.read().decode(errors="replace")
        bad = [line for line in text.splitlines() if any(word in line for word in words)]
        if bad:
            out[name] = bad
    return out


def side_by_side(cluster: Cluster, request: pb.GenerateRequest, n: int = 2) -> tuple[list[list], int]:
    """n copies of `request` at once through the coordinator: their responses, and the most
    sequences the target held at one time meanwhile (polled every 20 ms)."""
    import asyncio
    seen = [0]

    async def main():
        async with grpc.aio.insecure_channel(cluster.coordinator) as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def one():
                return [r async for r in stub.Generate(request, timeout=60)]

            async def watch():
                while True:
                    seen.append(await asyncio.to_thread(lambda: server_info(cluster.target, "target").num_sequences))
                    await asyncio.sleep(0.02)
            watcher = asyncio.create_task(watch())
            try:
                return await asyncio.gather(*(one() for _ in range(n)))
            finally:
                watcher.cancel()
    return list(asyncio.run(main())), max(seen)


def assert_alive_and_serving(cluster: Cluster) -> None:
    """Every process of the cluster runs and answers its health check SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for proc in cluster.procs.values():
        assert proc.popen.poll() is None, f"{proc.name} died:\n{proc.log_tail()}"
    for address in (cluster.coordinator, cluster.target, cluster.draft):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, address
