"""The model servers' step channel: Propose / Verify steps over a plain TCP socket.

Every speculative step makes two round trips, coordinator -> draft and coordinator -> target. On a
gRPC stream each message is read by gRPC's core on a thread of its own and handed to the asyncio
loop, a thread wake-up per message on each side: a bare round trip between two idle processes took
~590 us on the H200 host and ~480 us on a 2-core CPU (bench/hostpath.py), against ~180 us for the
same bytes over an asyncio socket, which the event loop reads itself. So the servers also listen on
a socket (`--step-port`, 0: any free port, -1: none) and say where in Info (`step_port`); the
coordinator steps over it where it can (`--step-channel auto`) and over the gRPC stream otherwise.
Info, Release, health and reflection stay on gRPC.

One connection is one step stream, served by the same loop as the gRPC stream
(ModelServicer._steps): the same messages, one request at a time, answered in order. Frames are
protos/wire.py's. A step that fails as a whole is answered with an error frame ("<status name>:
<message>", the status the gRPC stream would have ended with) and the connection is closed; so is
a connection whose frame does not parse. Neither touches the server.

A connection's first frame may offer shared slots (protos/shared_slots.py): the server takes them
where it can open the mapping, and answers with an empty FRAME_OFFER, or with why not (socket frames
then, as before). Taken, requests and answers go through them, and the server polls for the next
request for as long as its event loop busy-polls.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time

from google.protobuf.message import DecodeError

from protos import shared_slots
from protos.shared_slots import TO_SERVER, Inbox, SharedSlots, SharedSlotsError
from protos.wire import FRAME_ERROR, FRAME_MESSAGE, FRAME_OFFER, FrameError, frame
from specdec import trace
from specdec.serving.errors import status_of
from specdec.serving.owners import Connection

log = logging.getLogger(__name__)


# A connection whose peer vanished without closing it (its host lost) ends after ~10 + 3 x 5 s of
# silence, as the gRPC stream does by its keepalive pings, so its coordinator's sequences are freed
# (serving/owners.py); or, where an answer is still unacknowledged (no keepalive probes then), 25 s
# after it was sent (TCP_USER_TIMEOUT, ms), not after the ~15 min of retransmissions.
KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 25000))


def keep_alive(sock: socket.socket | None) -> None:
    """TCP keepalive on an accepted connection (the options this platform has)."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE:
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as e:   # (not a TCP socket): the connection serves without
        log.debug("step channel: no TCP keepalive: %s", e)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host` (the servers' --host: "[::]" / "" for every address, v4 and v6
    on one socket, or v4 only where the host has no IPv6; "0.0.0.0" for every IPv4 address) and
    `port` (0: any). OSError where none can be had."""
    host = host.strip("[]")
    if host in ("", "::"):
        candidates = [(socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))]
    else:
        candidates = [(family, address) for family, _, _, _, address
                      in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    error: OSError | None = None
    for family, address in candidates:
        sock = None
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            if family == socket.AF_INET6 and address[0] == "::":
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 peers too
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(64)
            sock.setblocking(False)
            return sock
        except OSError as e:  # e.g. IPv6 off in a container: the next candidate
            error = e
            if sock is not None:
                sock.close()
    raise error if error is not None else OSError(f"no address to listen on for {host!r}")


class StepChannel:
    """The listening socket and its connections. close(grace) stops listening, drops idle
    connections at once and gives steps in flight `grace` seconds to be answered (as the gRPC
    server's stop(grace) does)."""

    def __init__(self, servicer):
        self.servicer = servicer
        self._server: asyncio.Server | None = None
        self._busy: dict[asyncio.Task, list[bool]] = {}  # connection -> [a step in flight]
        self._closing = False  # close() began: connections take no new step

    async def start(self, host: str, port: int) -> int:
        """Listens; returns the port."""
        self._server = await asyncio.start_server(self._connection, sock=listen(host, port))
        return self._server.sockets[0].getsockname()[1]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        busy = self._busy[asyncio.current_task()] = [False]
        try:
            await serve_connection(self.servicer, reader, writer, busy, lambda: self._closing)
        except asyncio.CancelledError:
            # close() dropped the connection. Ended normally: on Python 3.11 asyncio's callback
            # for start_server's tasks reads task.exception() and logs a cancelled task as an
            # ERROR with a traceback, once per connection at every shutdown.
            pass
        finally:
            self._busy.pop(asyncio.current_task(), None)

    async def close(self, grace: float) -> None:
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        for task, busy in list(self._busy.items()):
            if not busy[0]:
                task.cancel()
        pending = [t for t in self._busy if not t.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace)
            for task in late:
                task.cancel()


async def serve_connection(servicer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           busy: list[bool] | None = None, closing=lambda: False) -> None:
    """Serves one connection's steps until it closes, or until closing() says the server is shutting
    down once a step is answered; busy[0] says whether a step is in flight."""
    request_cls, rpc = servicer.request_cls, servicer.rpc_name
    busy = busy if busy is not None else [False]
    refused: list[str] = []  # why the request stream ended early, where it was the peer's fault
    inbox: Inbox | None = None  # over the connection's shared slots, once an offer is taken

    def take_offer(payload: bytes) -> bytes:
        """Opens the offered slots; the answer's payload (empty: taken). The server polls them
        while its event loop busy-polls."""
        if not shared_slots.enabled():
            return b"SPECDEC_STEP_SHM=0 on the server"
        try:
            slots = SharedSlots.attach(payload)
        except SharedSlotsError as e:
            return str(e).encode()
        nonlocal inbox
        poll = servicer.runtime.busy_poll
        inbox = Inbox(reader, slots, TO_SERVER, poll.window_s, poll.is_paused)
        inbox.timed = trace.enabled
        return b""

    async def requests():
        first = True
        while True:
            busy[0] = False
            if closing():  # shutting down: the step in flight was answered, no new one is taken
                return
            try:
                kind, payload = await shared_slots.receive(reader, inbox)
                may_offer, first = first, False
                if kind == FRAME_OFFER and may_offer:
                    writer.write(frame(take_offer(payload), FRAME_OFFER))
                    continue
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    refused.append("the connection ended inside a frame")
                return
            except FrameError as e:
                refused.append(str(e))
                return
            except ConnectionError:  # reset by the peer
                return
            read_at = time.perf_counter() if trace.enabled else 0.0
            if kind != FRAME_MESSAGE:
                refused.append(f"a frame of kind {kind} where a {request_cls.__name__} was due")
                return
            request = request_cls()
            try:
                request.ParseFromString(payload)
            except DecodeError as e:
                refused.append(f"request: not a valid {request_cls.__name__}: {e}")
                return
            busy[0] = True
            if trace.enabled:
                trace.mark("s_read", rpc, request.step, len(request.seqs), at=read_at)
                trace.mark("s_parsed", rpc, request.step)
                if inbox is not None:
                    trace.mark_arrival("s", rpc, request.step, inbox)
            yield request
    connection = Connection(servicer.runtime.owners)
    try:
        keep_alive(writer.get_extra_info("socket"))
        async for response in servicer._steps(requests(), connection):
            if trace.enabled:
                trace.mark("s_ready", rpc, response.step)
            shared_slots.send(writer, inbox, response.SerializeToString())
            if trace.enabled:
                trace.mark("s_write", rpc, response.step)
            await writer.drain()
        if refused:
            servicer.runtime.metrics.count_error("INVALID_ARGUMENT")
            log.info("step channel: INVALID_ARGUMENT %s; closing the connection", refused[0])
            writer.write(frame(f"INVALID_ARGUMENT: {refused[0]}".encode(), FRAME_ERROR))
    except FrameError as e:  # an answer over the frame limit: what gRPC says of an oversized message
        servicer.runtime.metrics.count_error("RESOURCE_EXHAUSTED")
        log.info("step channel: RESOURCE_EXHAUSTED %s", e)
        writer.write(frame(f"RESOURCE_EXHAUSTED: {e}".encode(), FRAME_ERROR))
    except ConnectionError:  # the coordinator went away mid-answer: nothing to answer
        pass
    except Exception as e:  # the step failed as a whole: what the gRPC stream would end with
        code, message = status_of(e)
        servicer.runtime.metrics.count_error(code.name)
        if code.name == "INTERNAL":
            log.exception("step channel: a %s step failed", servicer.rpc_name)
        else:
            log.info("step channel: %s %s", code.name, message)
        writer.write(frame(f"{code.name}: {message}".encode(), FRAME_ERROR))
    finally:
        connection.close()
        if inbox is not None:
            inbox.close()
        writer.close()
