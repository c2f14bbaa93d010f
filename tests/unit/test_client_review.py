"""Review of the Python client (coordinator/client.py) and the `specdec generate` CLI (coordinator/cli.py),
against a small in-process fake Generation server (grpc.aio in a thread, canned responses / errors /
delays); no models, no real servers.

The fake's behaviour is chosen by the request's prompt text:
  canned          3 chunks ("hé", "llo", " wörld"), then a last chunk "!" with finish LENGTH and usage
  error-mid       2 chunks, then UNAVAILABLE "target server lost"
  error-first     INVALID_ARGUMENT before any chunk
  slow[:delay]    one chunk every `delay` seconds (default 0.05), for ever
  stall           nothing for 60 s
  unknown-finish  one chunk with a finish_reason this client does not know (7) and usage
Each call is recorded by request_id: chunks sent, whether it ended early (cancelled / closed by the
client), whether it ran to its end, and the deadline it saw.

The tests under "Found by the review" failed on the code as reviewed (each docstring says how);
the fixes are in client.py and cli.py. The others pin behaviour that worked already.
"""
from __future__ import annotations

import asyncio
import io
import math
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import grpc
import numpy as np
import pytest

from coordinator.cli import main
from coordinator.client import FINISH_REASONS, AsyncClient, Chunk, Client, build_request
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
CANNED = ["hé", "llo", " wörld", "!"]
CANNED_USAGE = pb.Usage(prompt_tokens=1, completion_tokens=4, draft_tokens=4, accepted_tokens=2, steps=3)


class FakeGeneration(pb_grpc.GenerationServicer):
    def __init__(self):
        self.calls: dict[str, dict] = {}

    async def Generate(self, request, context):
        rid = request.request_id or "anon"
        mode = request.text
        rec = self.calls[rid] = dict(sent=0, ended_early=False, done=False, mode=mode,
                                     started=time.monotonic(), time_remaining=context.time_remaining())
        try:
            if mode == "canned":
                for i, text in enumerate(CANNED[:-1]):
                    yield pb.GenerateResponse(text=text, token_ids=[i], request_id=rid)
                    rec["sent"] += 1
                yield pb.GenerateResponse(text=CANNED[-1], token_ids=[9], request_id=rid,
                                          finish_reason=pb.FINISH_REASON_LENGTH, usage=CANNED_USAGE)
                rec["sent"] += 1
            elif mode == "error-mid":
                for i in range(2):
                    yield pb.GenerateResponse(text="a", token_ids=[i], request_id=rid)
                    rec["sent"] += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "target server lost")
            elif mode == "error-first":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be positive")
            elif mode.startswith("slow"):
                delay = float(mode.split(":")[1]) if ":" in mode else 0.05
                i = 0
                while True:
                    yield pb.GenerateResponse(text="x", token_ids=[i], request_id=rid)
                    rec["sent"] += 1
                    i += 1
                    await asyncio.sleep(delay)
            elif mode == "stall":
                await asyncio.sleep(60)
            elif mode == "unknown-finish":
                yield pb.GenerateResponse(text="a", token_ids=[1], request_id=rid, finish_reason=7,
                                          usage=pb.Usage(prompt_tokens=1, completion_tokens=1, steps=1))
                rec["sent"] += 1
            rec["done"] = True
        except BaseException:   # CancelledError (cancel while awaiting) or GeneratorExit (at a yield)
            rec["ended_early"] = True
            raise

    async def Info(self, request, context):
        return pb.GenerationInfo(default_num_draft=4, max_batch_size=8)


class FakeServer:
    def __init__(self):
        self.fake = FakeGeneration()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(20), "fake server did not start"

    def _run(self):
        asyncio.set_event_loop(self.loop)

        async def serve():
            self.server = grpc.aio.server()
            pb_grpc.add_GenerationServicer_to_server(self.fake, self.server)
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await self.server.stop(0)

        self.loop.run_until_complete(serve())
        self.loop.close()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, rid: str) -> dict:
        return self.fake.calls[rid]

    def wait_for(self, rid: str, pred, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            rec = self.fake.calls.get(rid)
            if rec is not None and pred(rec):
                return True
            time.sleep(0.02)
        return False

    def close(self):
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = FakeServer()
    yield s
    s.close()


@pytest.fixture
def client(server):
    with Client(server.addr) as c:
        yield c


def run_cli(argv: list[str]) -> tuple[object, str, str]:
    """main(argv) in-process: (return code, or the exception it raised; stdout; stderr)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            rc: object = main(argv)
    except SystemExit as e:   # argparse refusing an argument: a clean exit
        rc = e.code
    except Exception as e:    # noqa: BLE001 - what the user would see as a traceback
        rc = e
    return rc, out.getvalue(), err.getvalue()


def cli_subprocess(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


# ---------------------------------------------------------------------------------------------
# Found by the review (fixed)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--seed", "-1"), ("--max-new-tokens", str(2**31)),
                                         ("--top-k", str(2**40)), ("--num-draft", str(2**40))])
def test_cli_refuses_out_of_range_integers(server, flag, value):
    """argparse's type=int takes any integer; build_request then assigns it to an int32 / uint64
    proto field and protobuf raises ValueError('Value out of range'), which escapes _generate
    (only grpc.RpcError and KeyboardInterrupt are caught): a traceback instead of a usage error."""
    rc, _, err = run_cli(["generate", "canned", "--addr", server.addr, flag, value])
    assert not isinstance(rc, BaseException), f"{flag} {value}: uncaught {rc!r}"
    assert rc == 2 or (rc == 1 and err.startswith("specdec: ")), (rc, err)


def test_cli_stops_quietly_when_its_reader_goes(server):
    """`specdec generate ... | head -c 10`: once the reader goes, sys.stdout.write raises
    BrokenPipeError, which _generate does not catch: a traceback on stderr."""
    p = cli_subprocess(["generate", "slow:0.005", "--addr", server.addr])
    try:
        assert p.stdout.read(3) == b"xxx"
        p.stdout.close()
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode(errors="replace")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-1500:]


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
def test_cli_refuses_a_timeout_not_positive_and_finite(server, timeout):
    """--timeout takes any float: -1, 0 and nan make a call that fails DEADLINE_EXCEEDED (0 after
    printing part of the output), and inf (which reads as "no deadline") fails at once with
    DEADLINE_EXCEEDED too: gRPC turns a huge or infinite timeout into a deadline in the past (the
    same holds for Client.generate(timeout=float('inf')), see test_an_infinite_timeout_is_no_deadline).
    A non-positive or non-finite --timeout should be refused by the parser (exit 2)."""
    rc, _, err = run_cli(["generate", "canned", "--addr", server.addr, "--timeout", timeout])
    assert rc == 2, (rc, err)


def test_an_infinite_timeout_is_no_deadline(client):
    """Client.generate(timeout=float('inf')) fails at once with DEADLINE_EXCEEDED (so do timeouts
    from about 9.2e9 s up): grpc turns them into a deadline in the past. math.inf should mean no
    deadline (pass None to gRPC)."""
    chunks = list(client.generate("canned", timeout=math.inf, request_id="inf-timeout"))
    assert [c.text for c in chunks] == CANNED


def test_cli_refuses_a_port_out_of_range(server):
    """--addr 127.0.0.1:<port + 65536> is not refused: gRPC's resolver wraps the port modulo 65536
    (127.0.0.1:99999 is dialled as 127.0.0.1:34463), so the CLI talks to whatever listens on the
    wrapped port, here the fake server, and exits 0."""
    rid_before = set(server.fake.calls)
    rc, out, err = run_cli(["generate", "canned", "--addr", f"127.0.0.1:{server.port + 65536}"])
    assert rc != 0 and "port" in err.lower(), (rc, out, err)
    assert set(server.fake.calls) == rid_before


def test_a_bytes_prompt_is_refused():
    """build_request(b'hi') takes the non-str branch and extends token_ids with the bytes' values:
    a bytes prompt silently generates from token ids [104, 105]. It should be refused (TypeError)
    or decoded as UTF-8 text."""
    try:
        req = build_request(b"hi")
    except TypeError:
        return
    assert req.WhichOneof("prompt") == "text" and req.text == "hi", \
        (req.WhichOneof("prompt"), list(req.token_ids.ids))


@pytest.mark.parametrize("ids", [[1, 2, 3], []])
def test_numpy_token_prompts(ids):
    """build_request(np.array([1, 2, 3])) raises 'The truth value of an array ... is ambiguous':
    `if not prompt` (client.py:71) is evaluated on the caller's array (same for torch tensors:
    'Boolean value of Tensor with more than one value is ambiguous')."""
    req = build_request(np.array(ids, dtype=np.int64))
    assert req.WhichOneof("prompt") == "token_ids" and list(req.token_ids.ids) == ids


def test_an_unknown_finish_reason_still_ends_the_stream(client):
    """A finish_reason this client does not know (proto3 enums are open: a newer server's reason)
    maps to None, so the last chunk, usage and all, reads as "more chunks follow" and the CLI
    prints finish=None."""
    chunks = list(client.generate("unknown-finish", request_id="unknown-finish"))
    assert chunks[-1].usage is not None
    assert chunks[-1].finish_reason is not None


OUTSIDE_LOOP = """
import asyncio, sys
from coordinator.client import AsyncClient
client = AsyncClient(sys.argv[1])   # at import time, as a module-level client would be

async def main():
    async with client:
        print("".join([c.text async for c in client.generate("canned", request_id="outside-loop")]))

asyncio.run(main())
"""


def test_an_async_client_made_outside_the_running_loop_works(server):
    """AsyncClient made before asyncio.run (a module-level client, in a fresh interpreter) binds its
    grpc.aio channel to the default loop that get_event_loop() makes; the first generate() inside
    asyncio.run then fails with "Task ... got Future ... attached to a different loop" (made in one
    asyncio.run and used in the next: "Event loop is closed"). The client should make its channel
    lazily in the running loop (or refuse at construction with a clear message)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", OUTSIDE_LOOP, server.addr], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "héllo wörld!\n", r.stderr[-1500:]


def test_held_stream_is_not_cancelled_by_break(server, client):
    """A break cancels the call only when nothing else refers to the generator (CPython frees it
    at once): with `stream = client.generate(...)` the call runs on until stream.close() (or
    contextlib.closing), as client.py's docstring now says (it promised the cancel for any break)."""
    stream = client.generate("slow:0.01", request_id="held-break")
    for _ in stream:
        break
    time.sleep(0.5)
    rec = server.call("held-break")
    assert not rec["ended_early"] and rec["sent"] > 10   # still generating after the break
    stream.close()
    assert server.wait_for("held-break", lambda r: r["ended_early"])


# ---------------------------------------------------------------------------------------------
# What works
# ---------------------------------------------------------------------------------------------

def test_stream_chunks_finish_and_usage_on_last_only(client):
    chunks = list(client.generate("canned", request_id="canned-1"))
    assert "".join(c.text for c in chunks) == "héllo wörld!"
    assert [c.token_ids for c in chunks] == [(0,), (1,), (2,), (9,)]
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.acceptance_ratio == 0.5
    assert {c.request_id for c in chunks} == {"canned-1"}


def test_chunk_from_pb_missing_and_unknown_fields():
    c = Chunk.from_pb(pb.GenerateResponse())
    assert c == Chunk("", (), "", None, None)
    # every FinishReason but UNSPECIFIED has a name
    named = {v.number for v in pb.FinishReason.DESCRIPTOR.values if v.number}
    assert named == set(FINISH_REASONS)
    # a field this client does not know (a newer server's) is skipped by protobuf
    raw = pb.GenerateResponse(text="é", token_ids=[3]).SerializeToString() + b"\xa0\x06\x01"  # field 100
    assert Chunk.from_pb(pb.GenerateResponse.FromString(raw)).text == "é"
    u = Chunk.from_pb(pb.GenerateResponse(usage=pb.Usage())).usage
    assert u is not None and u.acceptance_ratio is None


@pytest.mark.parametrize("mode, code, details, before", [
    ("error-mid", grpc.StatusCode.UNAVAILABLE, "target server lost", 2),
    ("error-first", grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be positive", 0)])
def test_errors_reach_the_caller_with_code_and_message(server, client, mode, code, details, before):
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for c in client.generate(mode, request_id=f"sync-{mode}"):
            got.append(c)
    assert e.value.code() == code and e.value.details() == details and len(got) == before

    async def run():
        seen = []
        async with AsyncClient(server.addr) as ac:
            with pytest.raises(grpc.aio.AioRpcError) as ae:
                async for c in ac.generate(mode, request_id=f"async-{mode}"):
                    seen.append(c)
        return ae.value, seen
    err, seen = asyncio.run(run())
    assert isinstance(err, grpc.RpcError)
    assert err.code() == code and err.details() == details and len(seen) == before


def test_deadline_covers_the_whole_stream(server, client):
    """timeout is the call's deadline: a stream still flowing is ended DEADLINE_EXCEEDED at it."""
    t0, got = time.monotonic(), 0
    with pytest.raises(grpc.RpcError) as e:
        for _ in client.generate("slow:0.05", request_id="deadline-sync", timeout=0.5):
            got += 1
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.4 < time.monotonic() - t0 < 3 and got >= 3
    # (gRPC sends the deadline as a timeout, rounded up, that the server adds to its own clock: it
    # may read a few ms over the client's 0.5 s; the clean clone at 47e6d55 saw 0.50035)
    assert 0 < server.call("deadline-sync")["time_remaining"] <= 0.55
    assert server.wait_for("deadline-sync", lambda r: r["ended_early"])

    async def run():
        async with AsyncClient(server.addr) as ac:
            with pytest.raises(grpc.aio.AioRpcError) as ae:
                async for _ in ac.generate("slow:0.05", request_id="deadline-async", timeout=0.3):
                    pass
            return ae.value.code()
    assert asyncio.run(run()) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_break_and_close_cancel_the_call(server, client):
    for _ in client.generate("slow:0.01", request_id="anon-break"):
        break   # the generator is freed at once: its finally cancels the call
    assert server.wait_for("anon-break", lambda r: r["ended_early"], timeout=2)
    stream = client.generate("slow:0.01", request_id="sync-close")
    next(stream)
    stream.close()
    assert server.wait_for("sync-close", lambda r: r["ended_early"], timeout=2)
    assert server.call("sync-close")["sent"] < 20


def test_async_break_aclose_and_task_cancel_cancel_the_call(server):
    async def run():
        async with AsyncClient(server.addr) as ac:
            async for _ in ac.generate("slow:0.01", request_id="async-break"):
                break   # freed: asyncio's asyncgen finalizer schedules aclose()
            stream = ac.generate("slow:0.01", request_id="async-aclose")
            await stream.__anext__()
            await stream.aclose()

            async def consume():
                async for _ in ac.generate("slow:0.01", request_id="async-task"):
                    pass
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
    asyncio.run(run())
    for rid in ("async-break", "async-aclose", "async-task"):
        assert server.wait_for(rid, lambda r: r["ended_early"], timeout=2), rid


def test_async_client_shared_by_many_tasks(server):
    async def run():
        async with AsyncClient(server.addr) as ac:
            async def one(i):
                return [c async for c in ac.generate("canned", request_id=f"many-{i}")]
            return await asyncio.gather(*(one(i) for i in range(20)), ac.info())
    *results, info = asyncio.run(run())
    assert info.max_batch_size == 8
    for i, chunks in enumerate(results):
        assert [c.text for c in chunks] == CANNED and {c.request_id for c in chunks} == {f"many-{i}"}


def test_close_double_close_and_reuse(server):
    c = Client(server.addr)
    stream = c.generate("slow:0.01", request_id="closed-under")
    next(stream)
    c.close()
    with pytest.raises(grpc.RpcError) as e:   # an open stream ends CANCELLED, and the server sees it
        list(stream)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert server.wait_for("closed-under", lambda r: r["ended_early"])
    c.close()   # twice: fine
    with pytest.raises(ValueError, match="[Cc]losed"):
        next(c.generate("canned"))

    async def run():
        ac = AsyncClient(server.addr)
        async with ac:
            assert [x.text async for x in ac.generate("canned")] == CANNED
        await ac.close()   # twice: fine
        with pytest.raises(Exception, match="[Cc]losed"):
            async for _ in ac.generate("canned"):
                pass
    asyncio.run(run())


def test_cli_streams_and_summarises(server):
    rc, out, err = run_cli(["generate", "canned", "--addr", server.addr])
    assert rc == 0 and out == "héllo wörld!\n"
    assert err.startswith("[4 tokens, finish=length, accepted/drafted=0.50, tau=1.67,")


@pytest.mark.parametrize("mode, message", [("error-mid", "specdec: UNAVAILABLE: target server lost"),
                                           ("error-first", "specdec: INVALID_ARGUMENT: max_new_tokens")])
def test_cli_server_error(server, mode, message):
    rc, _, err = run_cli(["generate", mode, "--addr", server.addr])
    assert rc == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("addr", ["127.0.0.1:1", "nonsense", "[::1"])
def test_cli_server_down_or_bad_addr(addr):
    t0 = time.monotonic()
    rc, out, err = run_cli(["generate", "hi", "--addr", addr, "--timeout", "10"])
    assert rc == 1 and out == "" and err.startswith("\nspecdec: UNAVAILABLE: ")
    assert time.monotonic() - t0 < 5


def test_cli_refuses_a_port_that_is_not_a_number():
    rc, out, err = run_cli(["generate", "hi", "--addr", "localhost:notaport"])
    assert rc == 2 and out == "" and "port" in err


@pytest.mark.parametrize("mode, wait_first", [("slow:0.02", True), ("stall", False)])
def test_cli_ctrl_c_cancels(server, mode, wait_first):
    rid = "anon"   # the CLI sends no request_id: the fake records it as "anon"
    t0 = time.monotonic()
    p = cli_subprocess(["generate", mode, "--addr", server.addr])
    try:
        if wait_first:
            assert p.stdout.read(3) == b"xxx"
        else:
            assert server.wait_for(rid, lambda r: r["mode"] == "stall" and r["started"] > t0, timeout=20)
            time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode()
    assert p.returncode == 130 and "specdec: cancelled" in err and "Traceback" not in err
    assert server.wait_for(rid, lambda r: r["mode"] == mode and r["started"] > t0 and r["ended_early"])
