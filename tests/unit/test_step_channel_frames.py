"""serve_connection (specdec/serving/step_channel.py) over a real loopback socket with a stand-in
servicer: what a connection answers when an answer cannot be framed, and that a closing server
takes no new step on a connection once its step in flight is answered."""
from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from protos import specdec_pb2 as pb
from protos import wire
from protos.wire import FRAME_ERROR, FRAME_MESSAGE, frame, read_frame
from specdec.serving.owners import Owners
from specdec.serving import step_channel
from specdec.serving.step_channel import serve_connection


class Servicer:
    """Answers each VerifyRequest with `results` empty results of its own step number."""
    request_cls = pb.VerifyRequest
    rpc_name = "Verify"

    def __init__(self, results: int = 1):
        self.results, self.errors, self.seen = results, [], []
        self.runtime = SimpleNamespace(metrics=SimpleNamespace(count_error=self.errors.append),
                                       owners=Owners(free=None))

    async def _steps(self, requests, connection):
        async for request in requests:
            self.seen.append(request.step)
            response = pb.VerifyResponse(step=request.step)
            for i in range(self.results):
                response.results.add(seq_id=i, next_token=i)
            yield response


async def exchange(servicer, steps, closing=lambda: False):
    """Serves one connection; the client sends `steps` one at a time and reads until the close.
    Returns the frames read."""
    served = asyncio.get_running_loop().create_future()

    async def handle(reader, writer):
        await serve_connection(servicer, reader, writer, closing=closing)
        served.set_result(None)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = []
    try:
        for step in steps:
            writer.write(frame(pb.VerifyRequest(step=step).SerializeToString()))
            await writer.drain()
            try:
                got.append(await asyncio.wait_for(read_frame(reader), 5))
            except asyncio.IncompleteReadError:
                break
        try:
            writer.write_eof()   # the client is done: a clean end of the stream
        except OSError:          # the server closed the connection first
            pass
        await asyncio.wait_for(served, 5)
    finally:
        writer.close()
        server.close()
    return got


def test_an_answer_over_the_frame_limit_is_resource_exhausted(monkeypatch):
    # (1 GiB in service; a 200-byte limit here, and an answer of 100 results)
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 200)
    servicer = Servicer(results=100)
    got = asyncio.run(exchange(servicer, [1]))
    assert [k for k, _ in got] == [FRAME_ERROR]
    assert got[0][1].decode().startswith("RESOURCE_EXHAUSTED: a ") and servicer.errors == ["RESOURCE_EXHAUSTED"]


def test_a_closing_server_answers_the_step_in_flight_and_takes_no_new_one():
    # close() while step 1 is in flight (the servicer sets the flag as it serves it): step 1 is
    # answered, then the connection closes without reading step 2. (A connection idle at close()
    # is cancelled by StepChannel.close itself.)
    flag = [False]

    class Closing(Servicer):
        async def _steps(self, requests, connection):
            async for response in super()._steps(requests, connection):
                flag[0] = True
                yield response
    servicer = Closing()
    got = asyncio.run(exchange(servicer, [1, 2], closing=lambda: flag[0]))
    assert [(k, pb.VerifyResponse.FromString(p).step) for k, p in got] == [(FRAME_MESSAGE, 1)]
    assert servicer.seen == [1]   # step 2 was never read: the connection closed after answering 1
    servicer = Servicer()
    got = asyncio.run(exchange(servicer, [1, 2, 3]))   # not closing: every step is served
    assert servicer.seen == [1, 2, 3] and len(got) == 3


def test_connections_get_tcp_keepalive(monkeypatch):
    # A coordinator whose host vanished never closes its connection: keepalive ends it, so the
    # server frees its sequences (owners.py).
    seen, original = [], step_channel.keep_alive

    def recording(sock):
        original(sock)
        seen.append((sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)))
    monkeypatch.setattr(step_channel, "keep_alive", recording)
    asyncio.run(exchange(Servicer(), [1]))
    assert seen == [(1, dict(step_channel.KEEPALIVE)["TCP_KEEPIDLE"])]
