"""Connections to the draft and target servers: Info, Release and the persistent step stream.

The step stream is one bidi call that lives as long as the coordinator (a unary call per step
costs ~0.3-0.6 ms); exactly one request is in flight on it, so responses pair with requests by
order. A stream that fails is dropped and reopened on the next step.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from protos.wire import MAX_MESSAGE_BYTES
from specdec.metrics import CoordinatorMetrics

CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   # A restarted server is found again within a second (the default backoff grows
                   # to minutes, and the coordinator waits on a lost target before resending).
                   ("grpc.max_reconnect_backoff_ms", 1000),
                   # A peer that vanished without closing the connection (host down, network cut)
                   # fails the open step stream within ~30 s instead of never. The servers must
                   # accept pings this often, also between calls (SERVER_OPTIONS of the servers).
                   ("grpc.keepalive_time_ms", 20_000),
                   ("grpc.keepalive_timeout_ms", 10_000),
                   ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0)]  # 0: keep pinging an idle stream


class StreamBroken(ConnectionError):
    """The server closed the step stream."""


def status_from_code(code: int) -> grpc.StatusCode:
    """The StatusCode of a numeric code (google.rpc.Code); INTERNAL for an unknown one."""
    return next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.INTERNAL)


def status_name(e: BaseException) -> str:
    """The gRPC status a failed call counts under in specdec_errors_total."""
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name
    if isinstance(e, asyncio.TimeoutError):
        return "DEADLINE_EXCEEDED"
    if isinstance(e, ConnectionError):
        return "UNAVAILABLE"
    return "INTERNAL"


class ModelServer:
    """One model server as the coordinator sees it. Step and Release round trips go into
    specdec_rpc_seconds{role="coordinator"}, their failures into specdec_errors_total."""

    def __init__(self, role: str, address: str, metrics: CoordinatorMetrics | None = None):
        if role not in ("draft", "target"):
            raise ValueError(f"role: expected draft or target, got {role!r}")
        self.role, self.address, self.metrics = role, address, metrics
        self.rpc = "Propose" if role == "draft" else "Verify"
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub_cls = pb_grpc.DraftStub if role == "draft" else pb_grpc.TargetStub
        self.stub = stub_cls(self.channel)
        self._call = None

    async def info(self, timeout: float = 5.0) -> pb.ModelInfo:
        return await self.stub.Info(pb.InfoRequest(), timeout=timeout)

    async def wait_ready(self, timeout: float) -> pb.ModelInfo:
        """Info, retried until the server answers or `timeout` seconds pass."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return await self.info(timeout=min(5.0, max(0.1, deadline - loop.time())))
            except grpc.aio.AioRpcError as e:
                if loop.time() >= deadline:
                    raise ConnectionError(f"{self.role} server at {self.address} did not answer Info "
                                          f"within {timeout:.0f}s: {e.code().name} {e.details()}") from None
                await asyncio.sleep(0.2)

    async def release(self, seq_ids, timeout: float = 5.0) -> pb.ReleaseResponse:
        t0 = time.perf_counter()
        try:
            response = await self.stub.Release(pb.ReleaseRequest(seq_ids=sorted(seq_ids)), timeout=timeout)
        except Exception as e:
            self._failed(e)
            raise
        self._observe("Release", t0)
        return response

    async def step(self, request, timeout: float | None = None):
        """Writes one step request on the persistent stream and reads its response, both within
        `timeout` seconds (None: no limit); a server that takes longer counts as failed."""
        t0 = time.perf_counter()
        try:
            response = await self._step(request, timeout)
        except Exception as e:
            self._failed(e)
            raise
        self._observe(self.rpc, t0)
        return response

    async def _step(self, request, timeout: float | None):
        if self._call is not None and self._call.done():
            # Ended between steps (e.g. the connection dropped while idle): no request was in
            # flight, so a new stream loses nothing (a server that lost sequences says NOT_FOUND).
            self._call = None
        if self._call is None:
            self._call = self.stub.Propose() if self.role == "draft" else self.stub.Verify()
        try:
            response = await asyncio.wait_for(self._exchange(request), timeout)
        except BaseException:
            self.reset()
            raise
        if response is grpc.aio.EOF:
            self.reset()
            raise StreamBroken(f"{self.role} server at {self.address} closed the step stream")
        if response.step != request.step:
            self.reset()
            raise StreamBroken(f"{self.role} server answered step {response.step} to step {request.step}")
        return response

    async def _exchange(self, request):
        await self._call.write(request)
        return await self._call.read()

    def _observe(self, rpc: str, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_rpc(rpc, time.perf_counter() - t0)

    def _failed(self, e: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.count_error(status_name(e))

    def reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        self.reset()
        await self.channel.close()
