"""Review of the step channel's shared-memory frames (protos/shared_slots.py, the offer in
specdec/serving/step_channel.py, ChannelCall / SharedFrames in coordinator/servers.py): a real
target server on the CPU, abused by raw clients that offer a mapping of their own (a sealed memfd
named by pid and descriptor), and driven by the coordinator's ModelServer.

- a raw client whose offer is taken steps through the slots (doorbell on the socket, frame in the
  slot), mixes in frames too large for its slot, and gets the same answers, in order, as over plain
  socket frames; duplicate and stale doorbells are dropped (one answer per frame);
- misbehaviour after a good step (a doorbell ahead of the frames, a doorbell of the wrong size, a
  doorbell before its frame, garbage in the slot, a slot length over the slot, a second offer): an
  INVALID_ARGUMENT error frame saying what was wrong, and a close; a client that leaves mid-step:
  the sequences are kept as the step made them and Release frees them;
- offers the server must refuse (another nonce, another size, a regular file or a memfd without the
  shrink and grow seals, a memfd sealed against writes, a pid or descriptor that does not exist, a
  socket, a directory, a FIFO, an offer of the wrong length, 0-byte slots): a non-empty FRAME_OFFER
  answer saying why, and socket frames on the same connection; an offer of a file under a lease
  must not stall the server's event loop;
- a client cannot shrink or grow its sealed mapping under the server, and one that never reads its
  answers is throttled: the server neither dies nor reads without bound;
- ModelServer(poll_s > 0): a step that times out, then the next step through a new connection and a
  new mapping answers as before; frames over a small slot's size mixed with slot frames answer as
  plain socket frames;
- after each test the server maps and holds no step-channel memfd, and at the end this process
  holds no descriptor of one either.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import struct
import subprocess
import sys
import time

import pytest

from coordinator.launch import spawn_server, start_healthy, stop_all
from coordinator.servers import ModelServer
from protos import shared_slots
from protos import specdec_pb2 as pb
from protos.shared_slots import TO_CLIENT, TO_SERVER, SharedSlots
from protos.wire import FRAME_ERROR, FRAME_MESSAGE, FRAME_OFFER, FRAME_SHARED, frame, pack_ids
from tests.helpers.tiny_models import make_pair
from tests.integration.test_step_channel_review import (Served, assert_healthy_and_clean, connect, greedy_step,
                                                       is_closed, long_prompt, recv_answer, recv_frame,
                                                       reference_request, reset_close, results, send)

pytestmark = pytest.mark.skipif(not (shared_slots.SPIN and shared_slots.AVAILABLE),
                                reason="shared-memory frames need sealed memfds (Linux) and an x86 CPU (polled slots)")

V = 320
PROMPT = [5, 17, 42, 99, 7, 3]
_SEQ = struct.Struct("<Q")
_HEAD = struct.Struct("<QI")
MEMFD = "/memfd:specdec-step"          # how a step-channel mapping (and this file's own memfds) shows in /proc


def _memfd_fds(pid: int | str) -> list[str]:
    """The process's open descriptors of step-channel memfds."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(MEMFD):
            out.append(f"{fd} -> {target}")
    return out


def my_memfds() -> list[str]:
    return _memfd_fds("self")


def server_maps_mine(proc) -> list[str]:
    """The server's mappings and descriptors of step-channel memfds (all of them made by this process)."""
    with open(f"/proc/{proc.popen.pid}/maps") as f:
        maps = [line.strip() for line in f if MEMFD in line]
    return maps + _memfd_fds(proc.popen.pid)


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# --- a raw client that shares slots with the server ------------------------------------------------
class ShmClient:
    """A plain socket whose offer the server took: requests through the slot (where they fit) with a
    doorbell, answers read from the slot at their doorbell. The offered descriptor is closed once
    the offer is answered (as ChannelCall does), unless keep_fd."""

    def __init__(self, port: int, slot_bytes: int = 64 << 10, keep_fd: bool = False, timeout: float = 15.0):
        self.sock = connect(port, timeout)
        self.slots = SharedSlots.create(slot_bytes=slot_bytes)
        try:
            self.sock.sendall(frame(self.slots.offer(), FRAME_OFFER))
            kind, body = recv_frame(self.sock)
        finally:
            if not keep_fd:
                self.slots.close_offer()
        assert (kind, body) == (FRAME_OFFER, b""), f"offer not taken: {kind} {body!r}"

    def doorbell(self, seq: int) -> None:
        self.sock.sendall(frame(_SEQ.pack(seq), FRAME_SHARED))

    def send_payload(self, payload: bytes) -> str:
        seq = self.slots.put(TO_SERVER, payload)
        if seq is None:
            self.sock.sendall(frame(payload))
            return "socket"
        self.doorbell(seq)
        return "slot"

    def send(self, request) -> str:
        return self.send_payload(request.SerializeToString())

    def recv(self) -> tuple[int, bytes, str]:
        kind, body = recv_frame(self.sock)
        if kind == FRAME_SHARED:
            assert len(body) == 8
            (seq,) = _SEQ.unpack(body)
            return FRAME_MESSAGE, self.slots.get(TO_CLIENT, seq), "slot"
        return kind, body, "socket"

    def answer(self, cls=pb.VerifyResponse):
        kind, body, via = self.recv()
        assert kind == FRAME_MESSAGE, f"an error frame where an answer was due: {body!r}"
        return cls.FromString(body), via

    def close(self, rst: bool = False) -> None:
        if rst:
            reset_close(self.sock)
        else:
            self.sock.close()
        self.slots.close()            # (the offered descriptor too, where it is still open)


@pytest.fixture
def clients():
    made: list[ShmClient] = []

    def make(*args, **kwargs) -> ShmClient:
        made.append(ShmClient(*args, **kwargs))
        return made[-1]
    yield make
    for c in made:
        try:
            c.close()
        except OSError:
            pass


def nothing_more(sock: socket.socket, wait: float = 0.3) -> bool:
    """True when nothing arrives within `wait` seconds (the connection still open)."""
    sock.settimeout(wait)
    try:
        sock.recv(1, socket.MSG_PEEK)
        return False
    except socket.timeout:
        return True
    finally:
        sock.settimeout(15.0)


# --- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("shared_review"))


def _spawn(pair, log_dir, args=()):
    proc = spawn_server("target", pair[0], log_dir, device="cpu", args=["--warmup-batch-sizes", "1", *args],
                        cpu_threads=1)
    start_healthy(proc, 120)
    return proc


def _served(proc) -> Served:
    t = Served(proc, "target")
    with connect(t.port) as sock:                 # the reference: a normal step over socket frames
        send(sock, reference_request(1))
        t.reference = results(recv_answer(sock))
    t.release([1])
    return t


@pytest.fixture(scope="module")
def served(pair, tmp_path_factory):
    """The main target: it waits for each request's doorbell (no busy-poll on the CPU)."""
    proc = _spawn(pair, tmp_path_factory.mktemp("shared_review_logs"))
    try:
        yield _served(proc)
    finally:
        stop_all([proc])


@pytest.fixture(scope="module")
def polled(pair, tmp_path_factory):
    """A target that busy-polls 5 ms after each step, so it polls the request slot too (Inbox.next)."""
    proc = _spawn(pair, tmp_path_factory.mktemp("shared_review_polled"), ["--busy-poll-ms", "5"])
    try:
        yield _served(proc)
    finally:
        stop_all([proc])


def _after(t: Served) -> None:
    assert t.proc.popen.poll() is None, f"the server died:\n{t.proc.log_tail()}"
    assert wait_until(lambda: not server_maps_mine(t.proc), 5), \
        f"the server still maps or holds memfds of closed connections: {server_maps_mine(t.proc)}"


@pytest.fixture
def target(served):
    yield served
    _after(served)


@pytest.fixture(params=["doorbells", "polling"])
def any_target(request):
    t = request.getfixturevalue("served" if request.param == "doorbells" else "polled")
    yield t
    _after(t)


def plain_answers(port: int, requests) -> list:
    with connect(port) as sock:
        out = []
        for r in requests:
            send(sock, r)
            out.append(results(recv_answer(sock)))
        return out


# --- a raw client stepping through the slots -------------------------------------------------------
MIXED_STEPS = 7


def mixed_request(step: int, base: int, last: dict) -> pb.VerifyRequest:
    """Steps whose frames are under and over a 100-byte slot: small first steps, a long prompt, a
    batch of 12 prompts, then decode steps of seq `base` alone and of all 14 sequences in turn."""
    if step == 1:
        return greedy_step(1, [(base, PROMPT, [9, 9], True)])
    if step == 2:
        return greedy_step(2, [(base + 1, long_prompt(1, 400), [9], True)])
    if step == 3:
        return greedy_step(3, [(base + 10 + i, long_prompt(i, 20), [9, 9], True) for i in range(12)])
    ids = [base] if step % 2 == 0 else [base, base + 1, *range(base + 10, base + 22)]
    return greedy_step(step, [(s, [last[s]], [last[s], (last[s] * 3) % V], False) for s in ids])


def mixed_ids(base: int) -> list[int]:
    return [base, base + 1, *range(base + 10, base + 22)]


def run_mixed(step_fn, base: int) -> list:
    last, got = {}, []
    for step in range(1, MIXED_STEPS + 1):
        request = mixed_request(step, base, last)
        answer = step_fn(request)
        assert answer.step == step
        got.append(results(answer))
        for s, r in zip(request.seqs, answer.results):
            assert not r.HasField("error"), r.error
            last[s.seq_id] = r.next_token
    return got


def test_a_raw_client_steps_through_the_slots_with_socket_frames_mixed_in(any_target, clients):
    c = clients(any_target.port, slot_bytes=100)
    vias = []

    def over_slots(request):
        vias.append(("request", c.send(request), len(request.SerializeToString())))
        answer, via = c.answer()
        vias.append(("answer", via, len(answer.SerializeToString())))
        return answer
    got = run_mixed(over_slots, 1000)
    kinds = {(d, via) for d, via, _ in vias}
    assert kinds == {("request", "slot"), ("request", "socket"), ("answer", "slot"), ("answer", "socket")}, vias
    assert server_maps_mine(any_target.proc), "the server maps no memfd of this connection"
    assert c.slots.fd is None                       # the offered descriptor closed once answered

    with connect(any_target.port) as sock:
        def plain(request):
            send(sock, request)
            return recv_answer(sock)
        assert got == run_mixed(plain, 2000)
    assert got[0] == any_target.reference
    c.close()
    assert_healthy_and_clean(any_target, mixed_ids(1000) + mixed_ids(2000))


def test_duplicate_and_stale_doorbells_are_dropped(any_target, clients):
    c = clients(any_target.port)
    seq = c.slots.put(TO_SERVER, reference_request(1100).SerializeToString())
    c.doorbell(seq)
    c.doorbell(seq)                   # the same frame rung twice
    c.doorbell(0)                     # a number before any frame
    answer, via = c.answer()
    assert via == "slot" and answer.step == 1 and results(answer) == any_target.reference
    assert nothing_more(c.sock), "a second answer to a frame rung twice"
    request = greedy_step(2, [(1100, [any_target.reference[0][1]], [], False)])
    assert c.send(request) == "slot"
    c.doorbell(1)                     # a stale doorbell between frames
    answer, via = c.answer()
    assert answer.step == 2 and answer.results[0].next_token >= 0 and not answer.results[0].HasField("error")
    assert nothing_more(c.sock)
    c.close()
    assert_healthy_and_clean(any_target, [1100])


# --- misbehaviour after a good step ----------------------------------------------------------------
def _doorbell_ahead(c):
    c.slots.put(TO_SERVER, reference_request(1201).SerializeToString())
    c.doorbell(5)


def _doorbell_wrong_size(c):
    c.sock.sendall(frame(b"\x02\x00\x00", FRAME_SHARED))


def _doorbell_before_frame(c):
    c.doorbell(2)                      # frame 2 is not in the slot yet


def _garbage_in_slot(c):
    c.send_payload(b"\xff\xff\xff")


def _length_over_slot(c):
    head = shared_slots._NONCE + TO_SERVER * _HEAD.size
    _HEAD.pack_into(c.slots.mm, head, 2, c.slots.slot_bytes + 1)
    c.doorbell(2)


def _second_offer(c):
    other = SharedSlots.create(slot_bytes=1024)
    try:
        c.sock.sendall(frame(other.offer(), FRAME_OFFER))
        time.sleep(0.2)
    finally:
        other.close()


MISBEHAVIOUR = {
    # name: (what the client does, words of the INVALID_ARGUMENT error frame that precedes the close)
    "a doorbell ahead of the frames": (_doorbell_ahead, "doorbell 5 after frame 1"),
    "a doorbell of the wrong size": (_doorbell_wrong_size, "a doorbell of 3 bytes"),
    "a doorbell before its frame": (_doorbell_before_frame, "the shared slot holds frame 1 ("),
    "garbage in the slot": (_garbage_in_slot, "not a valid VerifyRequest"),
    "a slot length over the slot": (_length_over_slot,
                                    "the shared slot holds frame 2 (4097 bytes) where frame 2 was due"),
    "a second offer": (_second_offer, "a frame of kind 3 where a VerifyRequest was due"),
}


@pytest.mark.parametrize("case", list(MISBEHAVIOUR))
def test_misbehaviour_after_a_good_step_gets_invalid_argument_and_a_close(target, clients, case):
    act, words = MISBEHAVIOUR[case]
    c = clients(target.port, slot_bytes=4096)
    c.send(reference_request(1200))
    answer, via = c.answer()
    assert via == "slot" and results(answer) == target.reference
    act(c)
    kind, body = recv_frame(c.sock)
    text = body.decode("utf-8", "replace")
    assert kind == FRAME_ERROR and text.startswith("INVALID_ARGUMENT: ") and words in text, (kind, body[:200])
    assert is_closed(c.sock)
    c.close()
    assert_healthy_and_clean(target, [1200, 1201])


def test_a_client_that_leaves_mid_step_leaves_the_kv_as_the_step_made_it(target, clients):
    n = 6
    first = greedy_step(1, [(1300 + i, long_prompt(i, 400), [9, 9], True) for i in range(n)])
    ref = plain_answers(target.port, [greedy_step(1, [(1400 + i, long_prompt(i, 400), [9, 9], True)
                                                      for i in range(n)])])[0]
    ref_held = target.kv_start - target.info().kv_blocks_free
    target.release(range(1400, 1400 + n))

    c = clients(target.port, slot_bytes=1 << 20)
    assert c.send(first) == "slot"
    time.sleep(0.05)
    c.close(rst=True)                 # gone before the answer
    assert wait_until(lambda: target.info().num_sequences == n, 20)
    assert target.kv_start - target.info().kv_blocks_free == ref_held
    c2 = clients(target.port)         # the sequences go on as if the answer had arrived
    second = greedy_step(2, [(1300 + i, [tok], [tok], False) for i, (_, tok) in enumerate(ref)])
    assert c2.send(second) == "slot"
    second_plain = greedy_step(2, [(1400 + i, [tok], [tok], False) for i, (_, tok) in enumerate(ref)])
    answer, _ = c2.answer()
    c2.close()
    first_again = greedy_step(1, [(1400 + i, long_prompt(i, 400), [9, 9], True) for i in range(n)])
    assert results(answer) == plain_answers(target.port, [first_again, second_plain])[1]
    released = target.release([*range(1300, 1300 + n), *range(1400, 1400 + n)])
    assert released.kv_blocks_free == target.kv_start
    assert_healthy_and_clean(target)


# --- offers to refuse ------------------------------------------------------------------------------
SLOT = 1024
SIZE = shared_slots._DATA + 2 * SLOT
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _offer(slot_bytes: int, nonce: bytes, fd: int, pid: int | None = None) -> bytes:
    return shared_slots._OFFER.pack(slot_bytes, nonce, os.getpid() if pid is None else pid, fd)


def _memfd(size: int = SIZE, seals: int = SEALED) -> tuple[int, bytes]:
    """A memfd like SharedSlots.create's (its size and seals adjustable) holding a fresh nonce."""
    fd = os.memfd_create("specdec-step-review", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    nonce = os.urandom(16)
    os.pwrite(fd, nonce, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd, nonce


# Each makes (the offer, descriptors to close after the answer); tmp is a fresh folder, sock the connection.
def _another_nonce(tmp, sock):
    fd, _ = _memfd()
    return _offer(SLOT, os.urandom(16), fd), [fd]


def _another_size(tmp, sock):
    fd, nonce = _memfd()
    return _offer(2 * SLOT, nonce, fd), [fd]


def _regular_file(tmp, sock):
    fd = os.open(tmp / "slots", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, SIZE)
    nonce = os.urandom(16)
    os.pwrite(fd, nonce, 0)
    return _offer(SLOT, nonce, fd), [fd]


def _memfd_seals(seals):
    def make(tmp, sock):
        fd, nonce = _memfd(seals=seals)
        return _offer(SLOT, nonce, fd), [fd]
    return make


def _no_such_pid(tmp, sock):
    fd, nonce = _memfd()
    return _offer(SLOT, nonce, fd, pid=2 ** 31 - 1), [fd]          # over any pid_max


def _closed_fd(tmp, sock):
    fd, nonce = _memfd()
    os.close(fd)
    return _offer(SLOT, nonce, fd), []


def _a_socket(tmp, sock):
    return _offer(SLOT, os.urandom(16), sock.fileno()), []


def _a_directory(tmp, sock):
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return _offer(SLOT, os.urandom(16), fd), [fd]


def _a_fifo(tmp, sock):
    os.mkfifo(tmp / "fifo")
    fd = os.open(tmp / "fifo", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    return _offer(SLOT, os.urandom(16), fd), [fd]


def _too_short(tmp, sock):
    return b"\x00" * 20, []


def _too_long(tmp, sock):
    fd, nonce = _memfd()
    return _offer(SLOT, nonce, fd) + b"/dev/shm/x", [fd]               # a good offer with more after it


def _zero_slots(tmp, sock):
    fd, nonce = _memfd(size=shared_slots._DATA)
    return _offer(0, nonce, fd), [fd]


N = shared_slots._OFFER.size
REFUSE = {
    # name: (the offer's maker, words of the refusal)
    "another nonce": (_another_nonce, "is not the mapping offered"),
    "another size": (_another_size, f"is not {shared_slots._DATA + 4 * SLOT} bytes of shared memory"),
    "a regular file (no seals)": (_regular_file, "is not sealed against resizing"),
    "a memfd without seals": (_memfd_seals(0), "is not sealed against resizing"),
    "a memfd sealed against growing only": (_memfd_seals(fcntl.F_SEAL_GROW), "is not sealed against resizing"),
    "a memfd sealed against shrinking only": (_memfd_seals(fcntl.F_SEAL_SHRINK), "is not sealed against resizing"),
    "a memfd sealed against writes": (_memfd_seals(SEALED | fcntl.F_SEAL_WRITE), "cannot map"),
    "a pid that does not exist": (_no_such_pid, f"cannot open /proc/{2 ** 31 - 1}/fd/"),
    "a closed descriptor": (_closed_fd, "cannot open /proc/"),
    "a socket": (_a_socket, "cannot open /proc/"),
    "a directory": (_a_directory, "cannot open /proc/"),
    "a FIFO": (_a_fifo, f"is not {SIZE} bytes of shared memory"),
    "an offer too short": (_too_short, f"an offer of 20 bytes, not {N}"),
    "an offer too long": (_too_long, f"an offer of {N + 10} bytes, not {N}"),
    "0-byte slots": (_zero_slots, "an offer of 0-byte slots"),
}


@pytest.mark.parametrize("case", list(REFUSE))
def test_an_offer_to_refuse_gets_a_refusal_and_socket_frames_go_on(target, tmp_path, case):
    make, words = REFUSE[case]
    fds = []
    try:
        with connect(target.port) as sock:
            offer, fds = make(tmp_path, sock)
            sock.sendall(frame(offer, FRAME_OFFER))
            kind, body = recv_frame(sock)
            assert kind == FRAME_OFFER and body, f"offer answered with kind {kind}: {body!r}"
            assert words in body.decode(), body
            send(sock, reference_request(1500))        # the same connection, socket frames
            assert results(recv_answer(sock)) == target.reference
            assert not server_maps_mine(target.proc)
        assert_healthy_and_clean(target, [1500])
    finally:
        for fd in fds:
            os.close(fd)


_LEASE_HOLDER = r"""
import fcntl, os, signal, sys, time
signal.signal(signal.SIGIO, signal.SIG_IGN)    # (a lease break's signal: the lease stays until it times out)
path = sys.argv[1]
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, int(sys.argv[2]))
os.close(fd)
fd = os.open(path, os.O_RDONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
print(fd, flush=True)
time.sleep(120)
"""


def test_an_offer_of_a_leased_file_does_not_stall_the_server(target, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _LEASE_HOLDER, str(tmp_path / "leased"), str(SIZE)],
                              stdout=subprocess.PIPE)
    stalled = None
    try:
        fd = int(holder.stdout.readline())
        a = connect(target.port)
        b = None
        try:
            a.sendall(frame(_offer(SLOT, os.urandom(16), fd, pid=holder.pid), FRAME_OFFER))
            time.sleep(0.3)
            b = connect(target.port, timeout=3.0)
            send(b, reference_request(1550))       # another connection's step, meanwhile
            try:
                got = results(recv_answer(b))
                stalled = False
            except socket.timeout:
                stalled = True
        finally:
            holder.kill()                          # the lease goes with it: the server's open returns
            holder.wait()
        kind, body = recv_frame(a)
        assert kind == FRAME_OFFER and body, (kind, body)   # refused (not sealed; or EWOULDBLOCK once fixed)
        if stalled:
            b.settimeout(15.0)
            got = results(recv_answer(b))
        assert got == target.reference
        a.close()
        b.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert_healthy_and_clean(target, [1550])
    assert not stalled, "the server answered no other connection while it opened the leased file"


# --- a client that tries to resize its mapping, a client that never reads ---------------------------
def test_a_client_cannot_shrink_or_grow_its_mapping_under_the_server(target, clients):
    c = clients(target.port, slot_bytes=4096, keep_fd=True)
    c.send(reference_request(1560))
    answer, via = c.answer()
    assert via == "slot" and results(answer) == target.reference
    size = shared_slots._DATA + 2 * 4096
    for new in (0, size // 2, size - 1, size + 1, size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(c.slots.fd, new)
        with pytest.raises(PermissionError):       # reopened by name too: the seals are the file's
            os.truncate(f"/proc/self/fd/{c.slots.fd}", new)
    with pytest.raises(PermissionError):           # nor can the seals be taken off or added to
        fcntl.fcntl(c.slots.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert os.fstat(c.slots.fd).st_size == size
    c.slots.close_offer()
    request = greedy_step(2, [(1560, [answer.results[0].next_token], [], False)])
    assert c.send(request) == "slot"
    second, via = c.answer()
    assert via == "slot" and second.step == 2 and not second.results[0].HasField("error")
    time.sleep(0.2)
    assert target.proc.popen.poll() is None, f"the server died:\n{target.proc.log_tail(8)}"
    c.close()
    assert_healthy_and_clean(target, [1560])


def _unknown_seqs_request(n: int = 400) -> bytes:
    request = pb.VerifyRequest(step=1)
    for i in range(n):
        request.seqs.add(seq_id=10**6 + i, new_tokens=pack_ids([5]))
    return frame(request.SerializeToString())


@pytest.mark.parametrize("mode", ["socket frames", "shared slots"])
def test_a_client_that_never_reads_its_answers_is_throttled(target, mode):
    limit = 96 << 20                  # far over the loopback buffers of a connection the server stopped reading
    data = _unknown_seqs_request() * 64
    hog = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.connect(("127.0.0.1", target.port))
    slots = None
    try:
        if mode == "shared slots":
            slots = SharedSlots.create(slot_bytes=4096)
            hog.sendall(frame(slots.offer(), FRAME_OFFER))
            hog.settimeout(10)
            assert recv_frame(hog) == (FRAME_OFFER, b"")
            slots.close_offer()
        hog.settimeout(1.0)
        sent, blocked = 0, False
        deadline = time.monotonic() + 20
        while sent < limit and time.monotonic() < deadline:
            try:
                hog.sendall(data)
                sent += len(data)
            except socket.timeout:
                blocked = True
                break
        assert blocked, f"the server read {sent >> 20} MiB from a client that reads none of its answers"
        t0 = time.monotonic()
        with connect(target.port) as sock:   # others are served meanwhile
            send(sock, reference_request(1600))
            assert results(recv_answer(sock)) == target.reference
        assert time.monotonic() - t0 < 5
    finally:
        reset_close(hog)
        if slots is not None:
            slots.close()
    time.sleep(0.3)
    assert_healthy_and_clean(target, [1600])


# --- the coordinator's ModelServer -----------------------------------------------------------------
def test_model_server_after_a_timed_out_step_steps_through_new_slots(target):
    n = 16
    slow = greedy_step(2, [(1700 + i, long_prompt(i, 500), [9, 9], True) for i in range(n)])

    async def main():
        server = ModelServer("target", target.proc.address, poll_s=0.02)
        try:
            await server.wait_ready(30)
            a = await server.step(reference_request(1690), timeout=20)
            first_call = server._call
            assert first_call._inbox is not None and first_call._inbox._taken == 1
            assert first_call._inbox.slots.fd is None         # the offered descriptor closed once answered
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await server.step(slow, timeout=0.05)
            assert time.monotonic() - t0 < 1.0
            b = await server.step(reference_request(1691), timeout=20)
            call = server._call
            assert call is not first_call and call._inbox is not None and call._inbox._taken == 1
            assert server.shared.refused is None
            c = await server.step(greedy_step(2, [(1691, [b.results[0].next_token], [], False)]), timeout=20)
            assert call._inbox._taken == 2 and c.step == 2 and not c.results[0].HasField("error")
            return results(a), results(b)
        finally:
            await server.close()
    a, b = asyncio.run(main())
    assert a == b == target.reference
    assert my_memfds() == []
    # The timed-out step was served all the same: its sequences are the server's, and Release frees them.
    assert wait_until(lambda: target.info().num_sequences == n + 2, 20)
    assert_healthy_and_clean(target, [1690, 1691, *range(1700, 1700 + n)])


def test_model_server_frames_over_a_small_slot_mix_in_order(any_target, monkeypatch):
    create = SharedSlots.create.__func__
    monkeypatch.setattr(SharedSlots, "create", classmethod(lambda cls, slot_bytes=None: create(cls, 100)))

    async def run(base: int, poll_s: float):
        server = ModelServer("target", any_target.proc.address, poll_s=poll_s)
        try:
            await server.wait_ready(30)
            last, got = {}, []
            for step in range(1, MIXED_STEPS + 1):
                request = mixed_request(step, base, last)
                answer = await server.step(request, timeout=20)
                got.append(results(answer))
                for s, r in zip(request.seqs, answer.results):
                    last[s.seq_id] = r.next_token
            inbox = getattr(server._call, "_inbox", None)
            return got, (inbox._taken if inbox is not None else None), server.shared.refused
        finally:
            await server.close()

    shared, taken, refused = asyncio.run(run(1800, 0.02))
    plain, none, _ = asyncio.run(run(1900, 0.0))
    assert refused is None and none is None
    assert 0 < taken < len(shared), f"{taken} of {len(shared)} answers through the slot: no mix"
    assert shared == plain
    assert my_memfds() == []
    assert_healthy_and_clean(any_target, mixed_ids(1800) + mixed_ids(1900))


def test_this_process_holds_no_step_channel_memfd_at_the_end():
    assert my_memfds() == []
