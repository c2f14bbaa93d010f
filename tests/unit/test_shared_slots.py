"""protos/shared_slots.py: the step channel's shared-memory frames, in one process.

- a mapping made by one side and opened from its offer by the other carries frames both ways,
  each read back as written, with its sequence number, also once the maker closed the descriptor
  the offer named; a frame larger than the slot is refused (None: it goes over the socket);
  neither side can shrink the mapping (sealed: a cut page would kill a reader with SIGBUS);
  offers are refused whose nonce does not match, whose descriptor is closed or is a file without
  seals, or of another size or length;
- the Inbox delivers every frame once, in order: from the slot while it polls (the doorbell that
  follows is dropped), from the doorbell when it does not poll, socket frames in between, and the
  connection's end after the frames before it; a doorbell out of order ends the connection.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
import time

import pytest

from protos import shared_slots
from protos.shared_slots import TO_CLIENT, TO_SERVER, Inbox, SharedSlots, SharedSlotsError
from protos.wire import FRAME_ERROR, FRAME_MESSAGE, FRAME_SHARED, FrameError, frame

pytestmark = pytest.mark.skipif(not shared_slots.AVAILABLE, reason="no sealed memfd on this host (Linux only)")


@pytest.fixture
def pair():
    a = SharedSlots.create(slot_bytes=1024)
    b = SharedSlots.attach(a.offer())
    yield a, b
    a.close()
    b.close()


def test_frames_cross_both_ways_with_their_numbers(pair):
    a, b = pair
    a.close_offer()                              # both hold the mapping: the descriptor is not needed
    assert a.fd is None
    for n, payload in enumerate([b"x" * 1024, b"", b"hello", bytes(range(256))], 1):
        assert a.put(TO_SERVER, payload) == n
        assert b.seq(TO_SERVER) == n and b.get(TO_SERVER, n) == payload
        assert b.put(TO_CLIENT, payload[::-1]) == n
        assert a.seq(TO_CLIENT) == n and a.get(TO_CLIENT, n) == payload[::-1]
    assert a.put(TO_SERVER, b"y" * 1025) is None  # over the slot: the socket's
    assert b.seq(TO_SERVER) == 4
    with pytest.raises(FrameError, match="holds frame 4"):
        b.get(TO_SERVER, 5)
    c = SharedSlots.create(slot_bytes=1024)
    try:
        with pytest.raises(PermissionError):    # sealed: not even its maker can shrink or grow it
            os.ftruncate(c.fd, 64)
        with pytest.raises(PermissionError):
            os.ftruncate(c.fd, 1 << 20)
    finally:
        c.close()


def _offer(slot_bytes: int, nonce: bytes, fd: int, pid: int | None = None) -> bytes:
    return shared_slots._OFFER.pack(slot_bytes, nonce, os.getpid() if pid is None else pid, fd)


def test_offers_that_do_not_name_this_mapping_are_refused(pair):
    a, _ = pair
    offer = a.offer()
    with pytest.raises(SharedSlotsError, match="not the mapping offered"):
        SharedSlots.attach(_offer(1024, bytes(16), a.fd))                       # another nonce
    with pytest.raises(SharedSlotsError, match="not .* bytes of shared memory"):
        SharedSlots.attach(_offer(2048, a.nonce, a.fd))                         # another size
    with tempfile.TemporaryFile() as f:                                         # a file without seals
        f.truncate(64 + 2 * 1024)
        with pytest.raises(SharedSlotsError, match="not sealed"):
            SharedSlots.attach(_offer(1024, a.nonce, f.fileno()))
    with pytest.raises(SharedSlotsError, match="cannot open"):
        SharedSlots.attach(_offer(1024, a.nonce, a.fd, pid=2 ** 31 - 1))        # no such process
    with pytest.raises(SharedSlotsError, match="offer of 3 bytes"):
        SharedSlots.attach(b"abc")
    with pytest.raises(SharedSlotsError, match="0-byte slots"):
        SharedSlots.attach(_offer(0, a.nonce, a.fd))
    a.close_offer()
    with pytest.raises(SharedSlotsError, match="cannot open"):
        SharedSlots.attach(offer)                                               # closed by its maker


def _inbox_run(pair, spin_s: float, script):
    """Runs script(a, feed, inbox) in a loop with an Inbox on b's TO_CLIENT side."""
    a, b = pair

    async def main():
        reader = asyncio.StreamReader()
        inbox = Inbox(reader, a, TO_CLIENT, spin_s)
        try:
            return await script(b, reader, inbox)
        finally:
            inbox.close()
    return asyncio.run(main())


def _doorbell(seq: int) -> bytes:
    return frame(seq.to_bytes(8, "little"), FRAME_SHARED)


@pytest.mark.skipif(not shared_slots.SPIN, reason="polling a slot needs total store order (x86)")
def test_a_polling_inbox_takes_the_slot_before_the_doorbell_and_drops_the_doorbell(pair):
    async def script(server, reader, inbox):
        got = []
        seq = server.put(TO_CLIENT, b"first")
        got.append(await asyncio.wait_for(inbox.next(), 5))   # no doorbell yet: from the slot
        reader.feed_data(_doorbell(seq))                       # its doorbell comes late
        reader.feed_data(frame(b"over the socket"))
        got.append(await asyncio.wait_for(inbox.next(), 5))
        seq = server.put(TO_CLIENT, b"third")
        got.append(await asyncio.wait_for(inbox.next(), 5))
        reader.feed_data(_doorbell(seq) + frame(b"late", FRAME_ERROR))
        got.append(await asyncio.wait_for(inbox.next(), 5))
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await asyncio.wait_for(inbox.next(), 5)
        return got
    assert _inbox_run(pair, 10.0, script) == [(FRAME_MESSAGE, b"first"), (FRAME_MESSAGE, b"over the socket"),
                                              (FRAME_MESSAGE, b"third"), (FRAME_ERROR, b"late")]


def test_an_inbox_that_does_not_poll_reads_the_slot_at_its_doorbell(pair):
    async def script(server, reader, inbox):
        got = []
        seq = server.put(TO_CLIENT, b"one")
        waiting = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0.05)
        assert not waiting.done()                 # in the slot, but without its doorbell: not seen
        reader.feed_data(_doorbell(seq))
        got.append(await asyncio.wait_for(waiting, 5))
        reader.feed_data(frame(b"two"))
        got.append(await asyncio.wait_for(inbox.next(), 5))
        server.put(TO_CLIENT, b"three")
        reader.feed_data(_doorbell(seq + 5))      # not the frame due
        with pytest.raises(FrameError, match="doorbell 6 after frame 1"):
            await asyncio.wait_for(inbox.next(), 5)
        return got
    assert _inbox_run(pair, 0.0, script) == [(FRAME_MESSAGE, b"one"), (FRAME_MESSAGE, b"two")]


@pytest.mark.skipif(not shared_slots.SPIN, reason="polling a slot needs total store order (x86)")
def test_a_timed_inbox_says_how_each_frame_came_and_when_it_last_found_the_slot_empty(pair):
    """Inbox.timed (the trace's stamps): arrival "poll" with the last empty look (missed_at) before
    the frame, "waiting" for a frame there before next() was called, "socket" for one its reader
    took (a doorbell first, or a frame over the socket); untimed, nothing is recorded."""
    async def script(server, reader, inbox):
        seen = []
        inbox.timed = True
        waiting = asyncio.ensure_future(inbox.next())
        for _ in range(5):
            await asyncio.sleep(0)                    # a few empty looks
        put_at = time.perf_counter()
        server.put(TO_CLIENT, b"polled")
        assert await asyncio.wait_for(waiting, 5) == (FRAME_MESSAGE, b"polled")
        seen.append((inbox.arrival, inbox.missed_at is not None and inbox.missed_at < put_at))
        reader.feed_data(frame(b"over the socket"))
        await asyncio.sleep(0.01)                     # the reader holds it before next() is called
        assert await asyncio.wait_for(inbox.next(), 5) == (FRAME_MESSAGE, b"over the socket")
        seen.append((inbox.arrival, inbox.missed_at))
        waiting = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0)
        reader.feed_data(frame(b"socket while polling"))
        assert await asyncio.wait_for(waiting, 5) == (FRAME_MESSAGE, b"socket while polling")
        seen.append((inbox.arrival, inbox.missed_at is not None))
        inbox.timed = False
        server.put(TO_CLIENT, b"untimed")
        assert await asyncio.wait_for(inbox.next(), 5) == (FRAME_MESSAGE, b"untimed")
        seen.append((inbox.arrival, inbox.missed_at is not None))   # the last timed call's
        return seen
    assert _inbox_run(pair, 10.0, script) == [("poll", True), ("waiting", None), ("socket", True),
                                              ("socket", True)]


def test_a_timed_inbox_that_does_not_poll_says_its_frames_came_by_the_socket(pair):
    async def script(server, reader, inbox):
        inbox.timed = True
        seq = server.put(TO_CLIENT, b"one")
        waiting = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0.01)
        reader.feed_data(_doorbell(seq))
        assert await asyncio.wait_for(waiting, 5) == (FRAME_MESSAGE, b"one")
        return inbox.arrival, inbox.missed_at
    assert _inbox_run(pair, 0.0, script) == ("socket", None)
