"""Step frames through shared memory, for a coordinator and a model server on one host.

Over the step channel's TCP socket a frame takes 36-48 us from the writer's write to the reader's
read on the H200 host with both event loops busy-polling (bench/wakeup.py; bench/trace_steps.py's
wire_in / wire_out), four such hops a speculative step: the kernel's loopback path, not Python.
Written into a shared mapping instead, the frame is there for the reader as soon as the writer's
copy is done; a reader that polls sees it within one turn of its event loop.

A connection's two processes share one mapping: anonymous shared memory the coordinator makes
(memfd_create), sealed against shrinking or growing, so that neither side can cut the pages from
under the other's mapping (a mapped page that is gone kills its reader with SIGBUS), its pages
reserved up front. The coordinator names it in an offer frame (FRAME_OFFER) before the first step:
its pid and descriptor. The server opens it through /proc/<pid>/fd/<n>, which exists only for a
process of its own host and pid namespace that it may inspect, checks that it is a sealed regular
file of the size offered holding the nonce the coordinator wrote into it, and answers; the
coordinator then closes its descriptor. Nothing has a name, so nothing is left behind when a
process dies. Either side falls back to the plain socket frames: another host or container,
another user, no memfd_create, or SPECDEC_STEP_SHM=0 on either side.

The mapping holds one slot per direction (coordinator -> server requests, server -> coordinator
answers). A step channel carries one request at a time, answered in order, so a slot is never
written while its last frame is being read: the writer of request n + 1 has read answer n, which
was written after request n was read. A frame too large for its slot goes over the socket as it
always did.

Every frame written into a slot is followed by a doorbell frame on the socket (FRAME_SHARED, the
frame's sequence number): a reader asleep in epoll wakes on it and reads the slot after it, which
is safe on any CPU (the socket's system calls order the memory accesses). A polling reader looks
at the slot's sequence number instead and drops the doorbell when it comes. That is only right
where the CPU keeps stores in order (x86's total store order: the frame's bytes are visible before
the sequence number written after them); elsewhere (SPIN False) readers wait for the doorbell.
"""
from __future__ import annotations

import asyncio
import collections
import fcntl
import mmap
import os
import platform
import secrets
import stat
import struct
import time

from protos.wire import FRAME_MESSAGE, FRAME_SHARED, MAX_MESSAGE_BYTES, FrameError, frame, read_frame

# Polling a slot's sequence number is right only under total store order (see above).
SPIN = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# Sealed anonymous shared memory (Linux >= 3.17).
AVAILABLE = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) if AVAILABLE else 0
SLOT_BYTES = 4 << 20       # per direction: a Verify of 64 sequences with sparse draft rows fits
TO_SERVER, TO_CLIENT = 0, 1
_NONCE = 16
_SLOT_HEAD = struct.Struct("<QI")            # sequence number, payload length
_DATA = 64                                   # nonce, two slot heads, padding
_OFFER = struct.Struct(f"<I{_NONCE}sII")     # slot bytes, nonce, the coordinator's pid and descriptor
_SEQ = struct.Struct("<Q")


def enabled() -> bool:
    """SPECDEC_STEP_SHM=0 turns shared-memory frames off on this side (read at each connection)."""
    return os.environ.get("SPECDEC_STEP_SHM", "1") != "0"


class SharedSlotsError(OSError):
    """The mapping could not be made or opened here; the connection keeps socket frames."""


class SharedSlots:
    """One connection's mapping: a slot per direction. put() writes a frame's payload and returns its
    sequence number (None: too large for the slot); seq() reads a slot's last sequence number;
    get() reads the payload of the frame with that number."""

    def __init__(self, mm: mmap.mmap, slot_bytes: int, nonce: bytes, fd: int | None = None):
        self.mm, self.slot_bytes, self.nonce = mm, slot_bytes, nonce
        self.fd = fd   # the maker's descriptor, open until the peer has opened it (close_offer)
        self._sent = [0, 0]

    @classmethod
    def create(cls, slot_bytes: int | None = None) -> SharedSlots:
        slot_bytes = SLOT_BYTES if slot_bytes is None else slot_bytes
        if not AVAILABLE:
            raise SharedSlotsError("no memfd_create here")
        size = _DATA + 2 * slot_bytes
        try:
            fd = os.memfd_create("specdec-step", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        except OSError as e:
            raise SharedSlotsError(f"memfd_create: {e}") from None
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)   # the pages now: a full tmpfs fails here, not at a write
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            raise SharedSlotsError(f"cannot make {size} bytes of shared memory: {e}") from None
        nonce = secrets.token_bytes(_NONCE)
        mm[:_NONCE] = nonce
        return cls(mm, slot_bytes, nonce, fd)

    def offer(self) -> bytes:
        """The FRAME_OFFER payload naming this mapping."""
        return _OFFER.pack(self.slot_bytes, self.nonce, os.getpid(), self.fd)

    @classmethod
    def attach(cls, offer: bytes) -> SharedSlots:
        """The mapping an offer names, once it is a sealed regular file of the offered size holding
        the offered nonce; SharedSlotsError otherwise."""
        if len(offer) != _OFFER.size:
            raise SharedSlotsError(f"an offer of {len(offer)} bytes, not {_OFFER.size}")
        slot_bytes, nonce, pid, fd_no = _OFFER.unpack(offer)
        if not 0 < slot_bytes <= MAX_MESSAGE_BYTES:
            raise SharedSlotsError(f"an offer of {slot_bytes}-byte slots")
        if not AVAILABLE:
            raise SharedSlotsError("no memfd seals here")
        where = f"/proc/{pid}/fd/{fd_no}"
        size = _DATA + 2 * slot_bytes
        try:
            # O_NONBLOCK: a file under a lease would block the open (and the server's loop) until
            # the lease breaks; O_NOCTTY: an offered tty must not become the server's terminal.
            fd = os.open(where, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as e:   # (another pid namespace, another user, no such descriptor)
            raise SharedSlotsError(f"cannot open {where}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise SharedSlotsError(f"{where} is not {size} bytes of shared memory")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0   # (a file that takes no seals)
            if ~seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):
                raise SharedSlotsError(f"{where} is not sealed against resizing")
            try:
                mm = mmap.mmap(fd, size)
            except OSError as e:
                raise SharedSlotsError(f"cannot map {where}: {e}") from None
        finally:
            os.close(fd)
        if mm[:_NONCE] != nonce:
            mm.close()
            raise SharedSlotsError(f"{where} is not the mapping offered")
        return cls(mm, slot_bytes, nonce)

    def close_offer(self) -> None:
        """Closes the maker's descriptor once the peer has opened it (or never will): the mappings
        stay until closed."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _head(self, direction: int) -> int:
        return _NONCE + direction * _SLOT_HEAD.size

    def put(self, direction: int, payload: bytes) -> int | None:
        n = len(payload)
        if n > self.slot_bytes:
            return None
        start = _DATA + direction * self.slot_bytes
        self.mm[start:start + n] = payload
        seq = self._sent[direction] = self._sent[direction] + 1
        # The length and then the number, after the bytes (in program order: see SPIN).
        _SLOT_HEAD.pack_into(self.mm, self._head(direction), 0, n)
        _SEQ.pack_into(self.mm, self._head(direction), seq)
        return seq

    def seq(self, direction: int) -> int:
        return _SEQ.unpack_from(self.mm, self._head(direction))[0]

    def get(self, direction: int, seq: int) -> bytes:
        got, n = _SLOT_HEAD.unpack_from(self.mm, self._head(direction))
        if got != seq or n > self.slot_bytes:
            raise FrameError(f"the shared slot holds frame {got} ({n} bytes) where frame {seq} was due")
        start = _DATA + direction * self.slot_bytes
        return self.mm[start:start + n]

    def close(self) -> None:
        self.close_offer()
        self.mm.close()   # (get() returns copies: no view of the mapping outlives a call)


def send(writer: asyncio.StreamWriter, inbox: Inbox | None, payload: bytes) -> None:
    """Writes one message frame: through the slot the other way from the connection's inbox, with
    its doorbell, or on the socket (no shared slots, or too large for the slot)."""
    seq = inbox.slots.put(1 - inbox.direction, payload) if inbox is not None else None
    writer.write(frame(payload) if seq is None else frame(_SEQ.pack(seq), FRAME_SHARED))


async def receive(reader: asyncio.StreamReader, inbox: Inbox | None) -> tuple[int, bytes]:
    """The connection's next frame: from its inbox where it shares slots, else read_frame's."""
    return await (inbox.next() if inbox is not None else read_frame(reader))


class Inbox:
    """The frames a connection receives where it shares slots: read_frame's (kind, payload), from
    the socket or from the slot. A reader task takes the socket's frames (doorbells: the slot's
    frame unless it was taken already); next() polls the slot for up to spin_s seconds (SPIN only),
    not while paused() (work on another thread that a polling loop holding the GIL would slow),
    before it waits for the reader. The reader holds at most one frame that next() has not taken
    (it reads the socket no further meanwhile, so a peer that writes without reading its answers
    meets the socket's flow control, as without slots). The reader's end (a close, a bad frame:
    FrameError) is raised by next() once the frames before it are taken.

    With `timed` set (the processes' trace, specdec/trace.py), next() also says how its frame came
    (`arrival`: "waiting", there when next() was called; "poll", seen in the slot while polling;
    "socket", from the reader task: a doorbell read before the slot was seen, or a frame sent
    over the socket) and when it last found the
    slot empty before that (`missed_at`, perf_counter; None where it did not look): the time a
    polling reader took between two looks at the slot when the frame came."""

    def __init__(self, reader: asyncio.StreamReader, slots: SharedSlots, direction: int, spin_s: float,
                 paused=lambda: False):
        self.slots, self.direction = slots, direction
        self.spin_s = spin_s if SPIN else 0.0
        self._paused = paused
        self._taken = 0
        self._frames: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._room = asyncio.Event()   # set while no frame waits to be taken
        self._room.set()
        self.timed = False
        self.arrival: str | None = None
        self.missed_at: float | None = None
        self._task = asyncio.get_running_loop().create_task(self._read(reader))

    def _take(self, seq: int) -> tuple[int, bytes]:
        self._taken = seq
        return FRAME_MESSAGE, self.slots.get(self.direction, seq)

    def _put(self, item) -> None:
        self._frames.append(item)
        self._room.clear()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                await self._room.wait()
                kind, payload = await read_frame(reader)
                if kind == FRAME_SHARED:
                    if len(payload) != _SEQ.size:
                        raise FrameError(f"a doorbell of {len(payload)} bytes")
                    (seq,) = _SEQ.unpack(payload)
                    if seq <= self._taken:
                        continue   # polled from the slot already
                    if seq != self._taken + 1:
                        raise FrameError(f"doorbell {seq} after frame {self._taken}")
                    self._put(self._take(seq))
                else:
                    self._put((kind, payload))
        except asyncio.CancelledError:
            raise
        except BaseException as e:   # (the connection's end, or a frame not to read)
            self._put(e)

    def _next_item(self):
        item = self._frames.popleft()
        if isinstance(item, BaseException):
            self._frames.appendleft(item)   # every later call raises it too
            raise item
        if not self._frames:
            self._room.set()
        return item

    async def next(self) -> tuple[int, bytes]:
        timed = self.timed
        if timed:
            self.arrival, self.missed_at = "waiting", None
        if self._frames:
            return self._next_item()
        if self.spin_s > 0:
            until = time.monotonic() + self.spin_s
            while True:
                if self._frames:   # (first: the reader may have taken the slot's frame meanwhile)
                    if timed:
                        self.arrival = "socket"
                    return self._next_item()
                if self.slots.seq(self.direction) == self._taken + 1:
                    if timed:
                        self.arrival = "poll"
                    return self._take(self._taken + 1)
                if timed:
                    self.missed_at = time.perf_counter()
                if time.monotonic() >= until or self._paused():
                    break
                await asyncio.sleep(0)
        if timed:
            self.arrival = "socket"
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        return self._next_item()

    def close(self) -> None:
        self._task.cancel()
        self.slots.close()
