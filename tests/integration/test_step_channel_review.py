"""Review of the model servers' step channel (specdec/serving/step_channel.py, protos/wire.py
frame / read_frame) against DESIGN.md section 6: nothing is lost (KV blocks come back on finish,
cancel, error and a lost client), bad input gets a clear status naming what was wrong, no server dies
of a request, and shutdown answers the steps in flight.

Real target and draft servers on the CPU (tiny model pair) are abused over raw sockets:

- a client that sends a step and goes away before the answer (RST while an executor step runs, FIN
  after an inline one): the server stays up, the sequence holds exactly the KV the step gave it (its
  next step answers as the same requests over gRPC do) and a Release frees every block;
- frames after a valid one (pipelined steps then garbage, a frame cut short), a header claiming
  1 GiB then a close, a length over the limit, a client FRAME_ERROR, an unknown kind byte, a
  partial header: the answers due first, then INVALID_ARGUMENT naming the problem, then a close;
- an empty payload (an empty step, answered as over gRPC); a step naming an unknown sequence or a
  token outside the vocabulary, or asking more KV than there is: a per-sequence NOT_FOUND /
  INVALID_ARGUMENT / RESOURCE_EXHAUSTED and the connection goes on;
- two channel connections and a gRPC stream interleaving steps of different sequences: the same
  answers as the same requests sent one sequence after another over gRPC;
- hundreds of idle and half-sent connections, and a client that never reads its answers (the
  server stops reading it: bounded buffers), while other clients are answered at once;
- the draft server's Propose over the channel: the same tokens and probabilities as over gRPC;
- a step sent while the model is still loading: an UNAVAILABLE error frame and a close;
- SIGTERM with an idle connection, one stuck inside a frame and one with a step in flight: the
  first two are closed at once, the step is answered within the grace period, the process exits 0,
  and (StepChannel's contract) the connection is not kept open for new steps and shutdown logs no
  ERROR.

After each abuse the server still answers a reference step exactly, and Info's kv_blocks_free is
back to its start value with no sequence held.
"""
from __future__ import annotations

import asyncio
import signal
import socket
import struct
import time

import grpc
import pytest

from coordinator.launch import free_port, spawn_server, start_healthy, stop_all
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from protos.wire import FRAME_ERROR, FRAME_MESSAGE, MAX_MESSAGE_BYTES, frame, pack_ids, read_frame, unpack_ids
from tests.helpers.cluster import server_info
from tests.helpers.streams import StepStream
from tests.helpers.tiny_models import make_pair

V = 320                      # make_pair's vocabulary
NUM_BLOCKS = 256             # the main target's KV: 4096 tokens, so RESOURCE_EXHAUSTED is reachable
PROMPT = [5, 17, 42, 99, 7, 3]
NOT_FOUND, INVALID, EXHAUSTED = 5, 3, 8
GRACE = 6.0                  # the shutdown server's --grace


# --- raw-socket helpers ----------------------------------------------------------------------------
def connect(port: int, timeout: float = 15.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def send(sock: socket.socket, request) -> None:
    sock.sendall(frame(request.SerializeToString()))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    length, kind = struct.unpack("<IB", recv_exact(sock, 5))
    return kind, recv_exact(sock, length - 1)


def recv_answer(sock: socket.socket, cls=pb.VerifyResponse):
    kind, body = recv_frame(sock)
    assert kind == FRAME_MESSAGE, f"an error frame where an answer was due: {body!r}"
    return cls.FromString(body)


def recv_error(sock: socket.socket) -> str:
    kind, body = recv_frame(sock)
    assert kind == FRAME_ERROR, f"a message frame where an error was due ({len(body)} bytes)"
    return body.decode()


def is_closed(sock: socket.socket) -> bool:
    """True when the peer closed (EOF or reset) with nothing more to read."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def reset_close(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): the server's writes to it fail."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def greedy_step(step: int, seqs) -> pb.VerifyRequest:
    """seqs: (seq_id, new_tokens, draft_tokens, first)."""
    request = pb.VerifyRequest(step=step)
    for seq_id, new, drafts, first in seqs:
        request.seqs.add(seq_id=seq_id, new_tokens=pack_ids(new), draft_tokens=pack_ids(drafts), first=first)
    return request


def reference_request(seq_id: int) -> pb.VerifyRequest:
    return greedy_step(1, [(seq_id, PROMPT, [9, 9], True)])


def results(response) -> list[tuple[int, int]]:
    return [(r.accepted, r.next_token) for r in response.results]


def long_prompt(i: int, n: int = 500) -> list[int]:
    return [(i * 7 + j) % (V - 1) + 1 for j in range(n)]


# --- the servers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("review_channel"))


class Served:
    """A running model server: its process, the step port, the start values of its KV, and stubs."""

    def __init__(self, proc, role: str):
        self.proc, self.role = proc, role
        info = server_info(proc.address, role)
        self.port, self.kv_start, self.kv_total = info.step_port, info.kv_blocks_free, info.kv_blocks_total
        assert self.port > 0 and info.num_sequences == 0

    def info(self) -> pb.ModelInfo:
        return server_info(self.proc.address, self.role)

    def release(self, seq_ids) -> pb.ReleaseResponse:
        with grpc.insecure_channel(self.proc.address) as ch:
            stub = (pb_grpc.DraftStub if self.role == "draft" else pb_grpc.TargetStub)(ch)
            return stub.Release(pb.ReleaseRequest(seq_ids=sorted(seq_ids)), timeout=10)

    def grpc_stream(self) -> StepStream:
        ch = grpc.insecure_channel(self.proc.address)
        stub = (pb_grpc.DraftStub if self.role == "draft" else pb_grpc.TargetStub)(ch)
        stream = StepStream(stub.Propose if self.role == "draft" else stub.Verify)
        stream.grpc_channel = ch
        return stream


def end_stream(stream: StepStream) -> None:
    stream.send(None)
    assert stream.receive() == "end"
    stream.grpc_channel.close()


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory):
    """The main target (NUM_BLOCKS KV blocks) and a draft, started together."""
    logs = tmp_path_factory.mktemp("review_channel_logs")
    procs = [spawn_server("target", pair[0], logs, args=["--warmup-batch-sizes", "1", "--num-blocks",
                                                         str(NUM_BLOCKS)], cpu_threads=1),
             spawn_server("draft", pair[1], logs, args=["--warmup-batch-sizes", "1"], cpu_threads=1)]
    try:
        for proc in procs:
            start_healthy(proc, 120)
        yield {"target": Served(procs[0], "target"), "draft": Served(procs[1], "draft")}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def target(servers):
    t = servers["target"]
    stream = t.grpc_stream()       # the reference answer of a normal step, over gRPC
    t.reference = results(stream.step(reference_request(1)))
    end_stream(stream)
    t.release([1])
    return t


def assert_healthy_and_clean(t: Served, seq_ids=()) -> None:
    """After an abuse: the ids released, every KV block back, a normal step answered exactly."""
    t.release(list(seq_ids) + [777])
    info = t.info()
    assert (info.kv_blocks_free, info.num_sequences) == (t.kv_start, 0), \
        f"KV leaked: {info.kv_blocks_free} of {t.kv_start} blocks free, {info.num_sequences} sequences held"
    with connect(t.port) as sock:
        send(sock, reference_request(777))
        assert results(recv_answer(sock)) == t.reference
    t.release([777])
    assert t.info().kv_blocks_free == t.kv_start


# --- a client that goes away -----------------------------------------------------------------------
def test_a_step_abandoned_by_its_client_keeps_the_kv_consistent_and_release_frees_it(target):
    n = 6                                 # 6 x ~400 tokens: ~156 of the 256 blocks
    def batch(step, base, prev=None):
        if prev is None:
            return greedy_step(step, [(base + i, long_prompt(i, 400), [9, 9], True) for i in range(n)])
        return greedy_step(step, [(base + i, [tok], [tok, (tok + 1) % V], False)
                                  for i, (_, tok) in enumerate(prev)])

    stream = target.grpc_stream()                 # the reference: the same four steps over gRPC
    ref = [results(stream.step(batch(1, 100)))]
    ref_held = target.kv_start - target.info().kv_blocks_free
    assert ref_held >= n * 25                     # 400 tokens or more each, in blocks of 16
    for step in (2, 3, 4):
        ref.append(results(stream.step(batch(step, 100, ref[-1]))))
    end_stream(stream)
    target.release(range(100, 100 + n))

    # Step 1 (a prefill: on the engine thread) and the client resets the connection before the answer.
    sock = connect(target.port)
    send(sock, batch(1, 200))
    time.sleep(0.05)
    reset_close(sock)
    deadline = time.monotonic() + 20
    while target.info().num_sequences < n and time.monotonic() < deadline:
        time.sleep(0.05)
    info = target.info()
    assert info.num_sequences == n
    held = target.kv_start - info.kv_blocks_free
    assert held == ref_held, f"the abandoned step holds {held} blocks, the same step over gRPC {ref_held}"
    with connect(target.port) as sock:            # the sequences go on as if the answer had arrived
        send(sock, batch(2, 200, ref[0]))
        assert results(recv_answer(sock)) == ref[1]
    # Step 3 (decode: inline on the loop) and the client half-closes and leaves at once.
    sock = connect(target.port)
    send(sock, batch(3, 200, ref[1]))
    sock.close()
    time.sleep(0.5)
    with connect(target.port) as sock:
        send(sock, batch(4, 200, ref[2]))
        assert results(recv_answer(sock)) == ref[3]
    released = target.release(range(200, 200 + n))
    assert released.released == n and released.kv_blocks_free == target.kv_start
    assert_healthy_and_clean(target)


# --- bad frames ------------------------------------------------------------------------------------
def _valid(step: int, seq_id: int) -> bytes:
    return frame(greedy_step(step, [(seq_id, PROMPT, [9, 9], True)]).SerializeToString())


BAD = {
    # name: (bytes to send, half-close after, answers due before the error, words of the error)
    "garbage after two pipelined steps": (_valid(1, 301) + _valid(2, 302) + frame(b"\xff\xff\xff"),
                                          False, 2, "not a valid VerifyRequest"),
    "a frame cut short after a step": (_valid(1, 303) + _valid(2, 304)[:12], True, 1, "inside a frame"),
    "a header claiming 1 GiB, then a close": (struct.pack("<IB", MAX_MESSAGE_BYTES, FRAME_MESSAGE) + b"abc",
                                              True, 0, "inside a frame"),
    "a length over the limit": (struct.pack("<IB", MAX_MESSAGE_BYTES + 1, FRAME_MESSAGE), False, 0,
                                f"length {MAX_MESSAGE_BYTES + 1}"),
    "a length of 0xffffffff after a step": (_valid(1, 305) + b"\xff\xff\xff\xff\x00", False, 1,
                                            "not a step channel frame"),
    "a client's error frame": (frame(b"CANCELLED: bye", FRAME_ERROR), False, 0, "a frame of kind 1"),
    "an unknown kind byte": (struct.pack("<IB", 3, 7) + b"ab", False, 0, "kind 7"),
    "a partial header, then a close": (b"\x10\x00\x00", True, 0, "inside a frame"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_frames_get_the_answers_due_then_invalid_argument_and_a_close(target, case):
    data, half_close, answers, words = BAD[case]
    with connect(target.port) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        for step in range(1, answers + 1):
            response = recv_answer(sock)
            assert response.step == step and results(response) == target.reference
        error = recv_error(sock)
        assert error.startswith("INVALID_ARGUMENT: ") and words in error, error
        assert is_closed(sock)
    assert_healthy_and_clean(target, range(300, 306))


def test_an_empty_payload_is_an_empty_step_and_the_connection_goes_on(target):
    stream = target.grpc_stream()
    over_grpc = stream.step(pb.VerifyRequest())
    end_stream(stream)
    with connect(target.port) as sock:
        sock.sendall(frame(b""))
        empty = recv_answer(sock)
        assert (empty.step, len(empty.results)) == (over_grpc.step, len(over_grpc.results)) == (0, 0)
        send(sock, reference_request(310))          # the same connection serves the next step
        assert results(recv_answer(sock)) == target.reference
    assert_healthy_and_clean(target, [310])


# --- per-sequence errors ---------------------------------------------------------------------------
def test_per_sequence_errors_leave_the_connection_serving(target):
    with connect(target.port) as sock:
        send(sock, greedy_step(1, [(320, PROMPT, [9, 9], True),       # served
                                   (424242, [5], [], False),          # never seen here
                                   (321, [5, V + 3], [], True)]))     # a token outside the vocabulary
        got = recv_answer(sock)
        assert results(got)[0] == target.reference[0]
        unknown, bad = got.results[1], got.results[2]
        assert unknown.error.code == NOT_FOUND and "424242" in unknown.error.message
        assert bad.error.code == INVALID and "new_tokens" in bad.error.message
        assert target.info().num_sequences == 1                       # the refused ones hold nothing
        # More KV than the server has: 9 prompts of 500 tokens need 288 of its 256 blocks.
        send(sock, greedy_step(2, [(330 + i, long_prompt(i), [], True) for i in range(9)]))
        got = recv_answer(sock)
        codes = [r.error.code for r in got.results]
        assert codes.count(EXHAUSTED) >= 1 and codes.count(0) >= 1, codes
        assert all("kv cache" in r.error.message for r in got.results if r.error.code)
        send(sock, greedy_step(3, [(320, [target.reference[0][1]], [], False)]))
        assert recv_answer(sock).results[0].next_token >= 0          # still the same connection
    assert_healthy_and_clean(target, [320, 321, *range(330, 339)])


# --- concurrency -----------------------------------------------------------------------------------
PROMPTS = {0: [5, 17, 42, 99, 7, 3], 1: [11, 12, 13, 14], 2: [200, 3, 77, 150, 9, 9, 31]}
STEPS = 6


def _next_request(step: int, seq_id: int, prompt, last) -> pb.VerifyRequest:
    if last is None:
        return greedy_step(step, [(seq_id, prompt, [prompt[-1], 9], True)])
    tok = last[1]
    return greedy_step(step, [(seq_id, [tok], [tok, (tok * 3) % V], False)])


def test_interleaved_connections_and_grpc_answer_as_sequential_steps(target):
    # Reference: each sequence alone, one after another, over one gRPC stream.
    reference = {}
    stream = target.grpc_stream()
    for k, prompt in PROMPTS.items():
        last, got = None, []
        for step in range(1, STEPS + 1):
            last = results(stream.step(_next_request(step, 400 + k, prompt, last)))[0]
            got.append(last)
        reference[k] = got
    end_stream(stream)

    async def over_channel(k):
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        last, got = None, []
        for step in range(1, STEPS + 1):
            writer.write(frame(_next_request(step, 500 + k, PROMPTS[k], last).SerializeToString()))
            await writer.drain()
            kind, payload = await asyncio.wait_for(read_frame(reader), 20)
            assert kind == FRAME_MESSAGE, payload
            last = results(pb.VerifyResponse.FromString(payload))[0]
            got.append(last)
            await asyncio.sleep(0)
        writer.close()
        return got

    async def over_grpc(k):
        async with grpc.aio.insecure_channel(target.proc.address) as ch:
            call = pb_grpc.TargetStub(ch).Verify()
            last, got = None, []
            for step in range(1, STEPS + 1):
                await call.write(_next_request(step, 500 + k, PROMPTS[k], last))
                last = results(await asyncio.wait_for(call.read(), 20))[0]
                got.append(last)
            await call.done_writing()
            return got

    async def main():
        return await asyncio.gather(over_channel(0), over_channel(1), over_grpc(2))
    interleaved = asyncio.run(main())
    assert interleaved == [reference[0], reference[1], reference[2]]
    assert_healthy_and_clean(target, [400, 401, 402, 500, 501, 502])


def test_hundreds_of_idle_and_half_sent_connections_do_not_stall_a_step(target):
    idle = [connect(target.port) for _ in range(250)]
    half = []
    for _ in range(50):
        sock = connect(target.port)
        sock.sendall(struct.pack("<IB", 101, FRAME_MESSAGE) + b"\x08\x01")  # 2 of 100 payload bytes
        half.append(sock)
    try:
        t0 = time.monotonic()
        with connect(target.port) as sock:
            send(sock, reference_request(600))
            assert results(recv_answer(sock)) == target.reference
        assert time.monotonic() - t0 < 5
    finally:
        for sock in idle + half:
            sock.close()
    assert_healthy_and_clean(target, [600])


def test_a_client_that_never_reads_is_throttled_without_stalling_others(target):
    # Each step names 50 unknown sequences: a small request, a ~5 KB answer of NOT_FOUND errors.
    request = pb.VerifyRequest(step=1)
    for i in range(50):
        request.seqs.add(seq_id=10**6 + i, new_tokens=pack_ids([5]))
    data = frame(request.SerializeToString()) * 20
    hog = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.connect(("127.0.0.1", target.port))
    hog.settimeout(1.0)
    blocked = False
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            try:
                hog.sendall(data)
            except socket.timeout:
                blocked = True                  # the server stopped reading the hog: its answers are unread
                break
        assert blocked, "the server kept reading a client that reads none of its answers (unbounded buffers)"
        t0 = time.monotonic()
        with connect(target.port) as sock:      # meanwhile other clients are served at once
            send(sock, reference_request(610))
            assert results(recv_answer(sock)) == target.reference
        assert time.monotonic() - t0 < 5
        assert target.info().num_sequences == 1
    finally:
        reset_close(hog)
    time.sleep(0.3)
    assert_healthy_and_clean(target, [610])


def test_no_error_logged_by_the_target_under_this_abuse(target):
    log = target.proc.log_since_start()
    bad = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not bad, "\n".join(bad[:20])
    assert target.proc.popen.poll() is None


# --- the draft -------------------------------------------------------------------------------------
def _proposal(step: int, base: int, prev=None) -> pb.ProposeRequest:
    request = pb.ProposeRequest(step=step)
    for i, temperature in enumerate((0.0, 1.0)):
        if prev is None:
            seq = request.seqs.add(seq_id=base + i, new_tokens=pack_ids(PROMPT[: 4 + i]), num_draft=4, first=True)
        else:
            seq = request.seqs.add(seq_id=base + i, keep=2, new_tokens=pack_ids([unpack_ids(prev[i].tokens)[2]]),
                                   num_draft=3)
        if temperature:
            seq.sampling.temperature = temperature
            seq.sampling.seed = 1234
    return request


def test_the_draft_proposes_over_the_channel_as_over_grpc(servers):
    draft = servers["draft"]
    stream = draft.grpc_stream()
    first = stream.step(_proposal(1, 700))
    second = stream.step(_proposal(2, 700, first.results))
    end_stream(stream)
    with connect(draft.port) as sock:
        send(sock, _proposal(1, 710))
        c_first = recv_answer(sock, pb.ProposeResponse)
        send(sock, _proposal(2, 710, c_first.results))
        c_second = recv_answer(sock, pb.ProposeResponse)
        send(sock, pb.ProposeRequest(step=3, seqs=[pb.DraftSeq(seq_id=99999, new_tokens=pack_ids([4]),
                                                               num_draft=2)]))
        unknown = recv_answer(sock, pb.ProposeResponse).results[0]
        assert unknown.error.code == NOT_FOUND and "99999" in unknown.error.message
    for a, b in ((first, c_first), (second, c_second)):
        assert [r.tokens for r in a.results] == [r.tokens for r in b.results]
        assert [r.probs for r in a.results] == [r.probs for r in b.results]
        assert not any(r.HasField("error") for r in b.results)
    assert not c_first.results[0].HasField("probs") and c_first.results[1].probs.rows == 4
    assert len(unpack_ids(c_second.results[1].tokens)) == 3
    # A Propose whose client leaves before the answer: the sequence is held, and released.
    sock = connect(draft.port)
    send(sock, _proposal(1, 720))
    reset_close(sock)
    deadline = time.monotonic() + 20
    while draft.info().num_sequences < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert draft.info().num_sequences == 6
    draft.release([700, 701, 710, 711, 720, 721])
    info = draft.info()
    assert (info.kv_blocks_free, info.num_sequences) == (draft.kv_start, 0)


# --- loading and shutdown --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shutdown_run(pair, tmp_path_factory):
    """A target of its own: a step while it loads; then SIGTERM with a connection idle, one stuck
    inside a frame and one with a prefill step in flight. Returns what each client saw."""
    seen: dict = {}
    port = free_port()
    proc = spawn_server("target", pair[0], tmp_path_factory.mktemp("review_shutdown"),
                        args=["--warmup-batch-sizes", "1", "--step-port", str(port), "--grace", str(GRACE)],
                        cpu_threads=1)
    try:
        deadline = time.monotonic() + 120
        while True:                                    # the channel listens before the model loads
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=15)
                break
            except OSError:
                assert proc.popen.poll() is None and time.monotonic() < deadline, proc.log_tail()
                time.sleep(0.01)
        with sock:
            send(sock, reference_request(1))
            seen["loading"] = recv_frame(sock)
            seen["loading_closed"] = is_closed(sock)
        start_healthy(proc, 120)
        seen["info_port"] = server_info(proc.address, "target").step_port

        idle = connect(port)
        stuck = connect(port)
        stuck.sendall(struct.pack("<IB", 50, FRAME_MESSAGE) + b"\x08")
        busy = connect(port)
        big = greedy_step(1, [(10 + i, long_prompt(i), [], True) for i in range(64)])  # ~1 s of prefill
        send(busy, big)
        time.sleep(0.25)
        t0 = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        seen["idle_closed"] = (is_closed(idle), time.monotonic() - t0)
        seen["stuck_closed"] = (is_closed(stuck), time.monotonic() - t0)
        kind, body = recv_frame(busy)
        seen["in_flight"] = (kind, pb.VerifyResponse.FromString(body) if kind == FRAME_MESSAGE else body,
                             time.monotonic() - t0)
        # The step in flight is answered; a step sent on its connection after that, during the grace:
        try:
            send(busy, greedy_step(2, [(900, [4, 5, 6], [], True)]))
            kind, body = recv_frame(busy)
            seen["after_answer"] = ("answered", kind, time.monotonic() - t0)
        except (EOFError, ConnectionError) as e:
            seen["after_answer"] = ("closed", repr(e), time.monotonic() - t0)
        try:
            seen["exit"] = (proc.popen.wait(GRACE + 20), time.monotonic() - t0)
        except Exception:
            seen["exit"] = (None, time.monotonic() - t0)
        for sock in (idle, stuck, busy):
            sock.close()
        seen["log"] = proc.log_since_start()
        yield seen
    finally:
        stop_all([proc])


def test_a_step_while_the_model_loads_gets_unavailable_and_a_close(shutdown_run):
    kind, body = shutdown_run["loading"]
    assert kind == FRAME_ERROR and body.decode().startswith("UNAVAILABLE: "), body
    assert "loading" in body.decode()
    assert shutdown_run["loading_closed"]
    assert shutdown_run["info_port"] > 0


def test_sigterm_drops_idle_connections_answers_the_step_in_flight_and_exits(shutdown_run):
    closed, after = shutdown_run["idle_closed"]
    assert closed and after < 2.0, f"idle connection closed={closed} after {after:.2f}s"
    closed, after = shutdown_run["stuck_closed"]
    assert closed and after < 2.0, f"connection stuck in a frame closed={closed} after {after:.2f}s"
    kind, response, after = shutdown_run["in_flight"]
    assert kind == FRAME_MESSAGE, f"the step in flight got {response!r}"
    assert response.step == 1 and len(response.results) == 64
    assert all(r.next_token >= 0 and not r.HasField("error") for r in response.results)
    assert after < GRACE
    code, after = shutdown_run["exit"]
    assert code == 0, shutdown_run["log"][-3000:]
    assert after < GRACE + 10


def test_sigterm_does_not_take_new_steps_on_the_connection_of_the_step_in_flight(shutdown_run):
    """Found by this review, fixed (StepChannel.close sets a flag the connection reads before each
    step). Before: StepChannel.close(grace) only waited for the connection task; after its step was
    answered the connection read and served the next step (a new sequence allocated after SIGTERM) until the
    grace runs out, and the process exits only then. Its docstring: idle connections are dropped at
    once, steps in flight get the grace."""
    outcome, detail, after = shutdown_run["after_answer"]
    assert outcome == "closed", \
        f"a new step sent after the in-flight answer was served during shutdown ({after:.2f}s after SIGTERM)"
    code, exit_after = shutdown_run["exit"]
    assert exit_after < GRACE, f"exited {exit_after:.2f}s after SIGTERM, grace {GRACE}s, though nothing was in flight"


def test_sigterm_logs_no_error_for_the_connections_it_drops(shutdown_run):
    """Found by this review, fixed (StepChannel._connection ends normally when cancelled). Before,
    on Python 3.11 (which the venv runs and pyproject allows): close() cancelled the connection
    tasks asyncio.start_server made; their done callback called task.exception() on a cancelled
    task, and asyncio logged "Exception in callback ... CancelledError" at ERROR, one traceback per dropped
    connection, on every clean shutdown."""
    bad = [line for line in shutdown_run["log"].splitlines() if " ERROR " in line or "Traceback" in line]
    assert not bad, "\n".join(bad[:6])
