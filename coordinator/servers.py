"""Connections to the draft and target servers: Info, Release and the persistent step stream.

The step stream lives as long as the coordinator (a unary call per step costs ~0.3-0.6 ms):
the server's step channel (a plain socket it names in Info, specdec/serving/step_channel.py:
the event loop reads the answer itself, no gRPC thread hand-off) where it has one and the
coordinator may use it, else one gRPC bidi call. Exactly one request is in flight on it, so
responses pair with requests by order. A stream that fails is dropped and reopened on the next
step. Where the server is on this host, the channel's frames go through shared memory
(protos/shared_slots.py) and the coordinator polls for the answer there.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from protos import shared_slots
from protos.shared_slots import TO_CLIENT, Inbox, SharedSlots, SharedSlotsError
from protos.wire import FRAME_ERROR, FRAME_OFFER, MAX_MESSAGE_BYTES, frame, read_frame
from specdec import trace
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


log = logging.getLogger("specdec.coordinator")

# A step channel that accepts no connection within this long is taken as unreachable from here (a
# firewall between hosts that lets gRPC through): the step goes over gRPC instead (ModelServer).
CHANNEL_CONNECT_TIMEOUT_S = 5.0


class StreamBroken(ConnectionError):
    """The server closed the step stream."""


class ChannelUnreachable(ConnectionError):
    """No connection to a server's step channel: the request never left."""


class StepFailed(ConnectionError):
    """The server answered a step on its step channel with an error frame: the step failed as a
    whole, with this gRPC status (the gRPC stream would have ended with it)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


# StepDeadlines needs Task.cancelling / uncancel (Python 3.11); before, steps use asyncio.wait_for.
_DEADLINES = hasattr(asyncio.Task, "uncancel")


class _Guard:
    __slots__ = ("task", "deadline", "cancelling", "expired")

    def __init__(self, task: asyncio.Task, deadline: float):
        self.task, self.deadline, self.expired = task, deadline, False
        self.cancelling = task.cancelling()


class StepDeadlines:
    """Deadlines of a server's steps with asyncio.timeout's semantics (at its deadline a step's task
    is cancelled, and the step raises TimeoutError unless its task was also cancelled from
    outside), under one timer for many steps. asyncio.wait_for arms and cancels a timer for each
    call (~7 us a call on the 2-core VM with Python 3.12, half before the request is written and
    half after the answer is read: the step's critical path); here a step only registers its
    deadline. The timer is armed for the earliest deadline registered since it last fired; when it
    fires it expires the steps whose deadline it reached and re-arms for the earliest left, so it
    fires about once per timeout's length while steps keep coming. As with asyncio.timeout (and
    Python 3.12's wait_for), an answer that arrives in the loop iteration the deadline fires in is
    a timeout; Python 3.11's wait_for returned it."""

    def __init__(self):
        self._guards: set[_Guard] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    async def run(self, aw, loop: asyncio.AbstractEventLoop, deadline: float):
        """Awaits `aw` (a coroutine) in the current task, within `deadline` (loop time)."""
        task = asyncio.current_task()
        guard = _Guard(task, deadline)
        self._guards.add(guard)
        if self._timer is None or self._timer_at > deadline or self._timer_loop is not loop:
            self._arm(loop, deadline)
        try:
            result = await aw
        except BaseException as e:
            self._guards.discard(guard)
            if guard.expired and task.uncancel() <= guard.cancelling and type(e) is asyncio.CancelledError:
                raise TimeoutError from e  # (what asyncio.timeout raises)
            raise
        self._guards.discard(guard)
        if guard.expired:
            task.uncancel()
        return result

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._fire)
        self._timer_at, self._timer_loop = when, loop

    def _fire(self) -> None:
        self._timer = None
        at = self._timer_at
        left = None
        for guard in list(self._guards):
            if guard.task.get_loop() is not self._timer_loop:
                # A step of an earlier event loop, left pending when it closed: not this timer's
                # (cancelling its task would raise here and leave the steps after it unguarded).
                self._guards.discard(guard)
                continue
            if guard.expired:
                continue
            if guard.deadline <= at:  # (the loop runs a timer within its clock resolution of `at`)
                guard.expired = True
                guard.task.cancel()
            elif left is None or guard.deadline < left:
                left = guard.deadline
        if left is not None:
            self._arm(self._timer_loop, left)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ChannelCall:
    """One connection to a server's step channel, used as the gRPC stream call is (write, read,
    done, cancel): read returns grpc.aio.EOF where the server closed it between frames."""

    def __init__(self, host: str, port: int, response_cls, connect_timeout: float = CHANNEL_CONNECT_TIMEOUT_S,
                 shared: "SharedFrames | None" = None, on_path=None):
        """on_path(transport): told "shared" or "socket" once a connection is set up (how its
        frames travel)."""
        self.host, self.port, self.response_cls = host, port, response_cls
        self.connect_timeout = connect_timeout
        self.shared = shared
        self.on_path = on_path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._inbox: Inbox | None = None   # over the connection's shared slots, where the server took them
        self._rpc = "Propose" if response_cls is pb.ProposeResponse else "Verify"  # (trace marks)
        self._step = 0

    def done(self) -> bool:
        """Whether the connection is gone (closed here, or by the server between steps)."""
        return self._writer is not None and (self._writer.is_closing() or self._reader.at_eof())

    async def _connect(self) -> None:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise ChannelUnreachable(f"{self.host}:{self.port}: {type(e).__name__}: {e}") from None

    async def _offer(self) -> None:
        """Offers the server shared slots (first thing on a new connection). Taken: frames go
        through them from here on. Refused, or a server that does not know the offer (it answers
        an error and closes): socket frames, on a new connection in the second case, and the
        ModelServer offers no more until the server restarts."""
        try:
            slots = SharedSlots.create()
        except SharedSlotsError as e:
            self.shared.refuse(f"coordinator: {e}")
            return
        try:
            self._writer.write(frame(slots.offer(), FRAME_OFFER))
            await self._writer.drain()
            kind, payload = await asyncio.wait_for(read_frame(self._reader), self.connect_timeout)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as e:
            kind, payload = FRAME_ERROR, f"no answer to the offer ({type(e).__name__})".encode()
        finally:
            slots.close_offer()   # opened by the server by now, or never: the mappings stay
        if kind == FRAME_OFFER and not payload:
            self._inbox = Inbox(self._reader, slots, TO_CLIENT, self.shared.spin_s)
            self._inbox.timed = trace.enabled
            log.info("%s step channel at %s:%d: frames through shared memory", self._rpc, self.host, self.port)
            return
        slots.close()
        self.shared.refuse(f"server: {payload.decode('utf-8', 'replace')}")
        if kind != FRAME_OFFER:   # the connection is closed or in an unknown state: a fresh one
            self._writer.close()
            await self._connect()

    async def write(self, request) -> None:
        if self._writer is None:
            await self._connect()
            if self.shared is not None and self.shared.wanted():
                await self._offer()
            if self.on_path is not None:
                self.on_path("shared" if self._inbox is not None else "socket")
        if trace.enabled:
            self._step = request.step
            trace.mark("c_built", self._rpc, request.step, len(request.seqs))
        shared_slots.send(self._writer, self._inbox, request.SerializeToString())
        if trace.enabled:
            trace.mark("c_write", self._rpc, request.step)
        await self._writer.drain()

    async def read(self):
        try:
            kind, payload = await shared_slots.receive(self._reader, self._inbox)
            if trace.enabled:
                trace.mark("c_read", self._rpc, self._step)
                if self._inbox is not None:
                    trace.mark_arrival("c", self._rpc, self._step, self._inbox)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise StreamBroken(f"the step channel at {self.host}:{self.port} closed inside a frame") from None
            return grpc.aio.EOF
        if kind == FRAME_ERROR:
            code, _, message = payload.decode("utf-8", "replace").partition(": ")
            raise StepFailed(code, message)
        response = self.response_cls()
        response.ParseFromString(payload)
        if trace.enabled:
            trace.mark("c_parsed", self._rpc, self._step)
        return response

    def cancel(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        if self._writer is not None:
            self._writer.close()


class SharedFrames:
    """Whether a ModelServer's step channel connections offer shared slots: where the coordinator
    polls (spin_s > 0: waiting for a frame on the socket would gain nothing), the CPU allows polling
    them (shared_slots.SPIN) and SPECDEC_STEP_SHM is not 0; not again once a server refused (until
    it restarts: reset)."""

    def __init__(self, spin_s: float):
        self.spin_s = spin_s
        self.refused: str | None = None

    def wanted(self) -> bool:
        return (self.spin_s > 0 and shared_slots.SPIN and shared_slots.AVAILABLE and self.refused is None
                and shared_slots.enabled())

    def refuse(self, reason: str) -> None:
        log.info("step channel: socket frames (no shared memory): %s", reason)
        self.refused = reason

    def reset(self) -> None:
        self.refused = None


def channel_host(address: str) -> str | None:
    """The host of a gRPC target "host:port" (IPv6 in brackets), where the step channel listens;
    None for other target forms (unix:..., dns:///...), which keep the gRPC stream."""
    if "/" in address or address.startswith("unix:"):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def status_from_code(code: int) -> grpc.StatusCode:
    """The StatusCode of a numeric code (google.rpc.Code); INTERNAL for an unknown one."""
    return next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.INTERNAL)


def status_name(e: BaseException) -> str:
    """The gRPC status a failed call counts under in specdec_errors_total."""
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name
    if isinstance(e, StepFailed):
        return e.code if e.code in grpc.StatusCode.__members__ else "INTERNAL"
    if isinstance(e, asyncio.TimeoutError):
        return "DEADLINE_EXCEEDED"
    if isinstance(e, ConnectionError):
        return "UNAVAILABLE"
    return "INTERNAL"


class ModelServer:
    """One model server as the coordinator sees it. Step and Release round trips go into
    specdec_rpc_seconds{role="coordinator"}, their failures into specdec_errors_total."""

    def __init__(self, role: str, address: str, metrics: CoordinatorMetrics | None = None,
                 step_channel: bool = True, poll_s: float = 0.0):
        """step_channel: step over the server's step channel where its Info names one. poll_s: how
        long the coordinator polls for an answer (its --busy-poll-ms): > 0 offers the channel's
        server shared slots (SharedFrames)."""
        if role not in ("draft", "target"):
            raise ValueError(f"role: expected draft or target, got {role!r}")
        self.role, self.address, self.metrics = role, address, metrics
        self.rpc = "Propose" if role == "draft" else "Verify"
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub_cls = pb_grpc.DraftStub if role == "draft" else pb_grpc.TargetStub
        self.stub = stub_cls(self.channel)
        self._response_cls = pb.ProposeResponse if role == "draft" else pb.VerifyResponse
        self._channel_host = channel_host(address) if step_channel else None
        self.step_port = 0  # the server's step channel as its last Info named it (0: none)
        # The channel could not be reached: steps go over gRPC until an Info names another port
        # or answers after a failed call (a server back from a restart on the same port).
        self._channel_off = False
        self._failed_since_info = False
        self._call = None
        self._stale = False  # an Info named another channel: the next step opens a new call
        self._deadlines = StepDeadlines()
        self.shared = SharedFrames(poll_s)
        # Named in every step (its `owner`): the server frees this ModelServer's sequences once
        # none of its connections has been open for the server's --orphan-timeout (the process
        # died without releasing them; specdec/serving/owners.py). Nonzero: 0 names no owner.
        self.owner = secrets.randbits(63) + 1
        self._ended_seen = None  # the ended step call needs_info() last took note of

    @property
    def transport(self) -> str:
        """What the next step goes over: "channel" or "grpc"."""
        return "channel" if self._channel_host is not None and self.step_port and not self._channel_off else "grpc"

    async def info(self, timeout: float = 5.0) -> pb.ModelInfo:
        info = await self.stub.Info(pb.InfoRequest(), timeout=timeout)
        if info.step_port != self.step_port:  # a server restarted on another port, or with none
            # Not reset() here: a step may be in flight on the call (over gRPC after the old port
            # refused), and cancelling it would fail that step for nothing. The next step reopens.
            self._stale = True
            self.step_port = info.step_port
            self._channel_off = False
            self.shared.reset()
        elif self._failed_since_info:
            self._channel_off = False
        self._failed_since_info = False
        return info

    def needs_info(self) -> bool:
        """Whether the server may have restarted since its last answered Info: a step or Release
        failed since (the step loop's own recovery reads it again, or gave up waiting), or the step
        connection ended between steps (the server closed it: it stopped or restarted). True until
        an Info is answered."""
        call = self._call
        if call is not None and call is not self._ended_seen and call.done():
            self._ended_seen = call
            self._failed_since_info = True
        return self._failed_since_info

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

    async def step(self, request, timeout: float | None = None, on_sent=None):
        """Writes one step request on the persistent stream and reads its response, both within
        `timeout` seconds (None: no limit); a server that takes longer counts as failed.
        on_sent() runs once the request is written, before the answer is awaited: work for the
        time the server takes (called again if the request goes again, over gRPC)."""
        t0 = time.perf_counter()
        request.owner = self.owner
        try:
            response = await self._step(request, timeout, on_sent)
        except Exception as e:
            self._failed(e)
            raise
        if self.metrics is not None:
            # Recorded once the caller waits next (after its next request is written): a histogram
            # observation is ~4 us, on the step's critical path here. The same value.
            asyncio.get_running_loop().call_soon(self.metrics.observe_rpc, self.rpc, time.perf_counter() - t0)
        return response

    async def _step(self, request, timeout: float | None, on_sent=None):
        if self._stale:
            self._stale = False
            self.reset()
        if self._call is not None and self._call.done():
            # Ended between steps (e.g. the connection dropped while idle): no request was in
            # flight, so a new stream loses nothing (a server that lost sequences says NOT_FOUND).
            self._call = None
        if self._call is None:
            self._call = self._new_call(timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            try:
                if deadline is not None and timeout > 0 and _DEADLINES:
                    response = await self._deadlines.run(self._exchange(request, on_sent), loop, deadline)
                else:
                    response = await asyncio.wait_for(self._exchange(request, on_sent), timeout)
            except ChannelUnreachable as e:
                self.reset()
                self._channel_off = True
                log.warning("%s server's step channel unreachable (%s): stepping over gRPC", self.role, e)
                self._call = self._new_call(timeout)
                # The request never left: the same one over gRPC, in what is left of the step's time.
                left = None if deadline is None else max(deadline - loop.time(), 0.0)
                response = await asyncio.wait_for(self._exchange(request, on_sent), left)
        except asyncio.CancelledError:
            self.reset()
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation
            # The call was cancelled under the step (not by its caller): a failed step the loop
            # handles, never a CancelledError that would end the loop's task.
            raise StreamBroken(f"{self.role} server's step call was cancelled") from None
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

    def _new_call(self, timeout: float | None = None):
        if self.transport == "channel":
            # A channel that takes no connection is given up in time for gRPC to serve the step
            # within its timeout: half of it at most.
            connect = CHANNEL_CONNECT_TIMEOUT_S if timeout is None else min(CHANNEL_CONNECT_TIMEOUT_S, timeout / 2)
            return ChannelCall(self._channel_host, self.step_port, self._response_cls, connect, self.shared,
                               self._on_path)
        self._on_path("grpc")
        return self.stub.Propose() if self.role == "draft" else self.stub.Verify()

    def _on_path(self, transport: str) -> None:
        """specdec_step_transport_state: how this server's steps travel from here on."""
        if self.metrics is not None:
            self.metrics.set_step_transport(self.role, transport)

    async def _exchange(self, request, on_sent=None):
        await self._call.write(request)
        if on_sent is not None:
            on_sent()
        return await self._call.read()

    def _observe(self, rpc: str, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_rpc(rpc, time.perf_counter() - t0)

    def _failed(self, e: BaseException) -> None:
        self._failed_since_info = True
        if self.metrics is not None:
            self.metrics.count_error(status_name(e))

    def reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        self.reset()
        self._deadlines.close()
        await self.channel.close()
