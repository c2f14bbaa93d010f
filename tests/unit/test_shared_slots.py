"""protos/shared_slots.py: the step channel's shared-memory frames, in one process.

- a mapping made by one side and opened from its offer by the other carries frames both ways,
  each read back as written, with its sequence number; a frame larger than the slot is refused
  (None: it goes over the socket); an offer whose nonce does not match the file (another host's
  file of that name), a path outside /dev/shm, or a file that is gone is refused; the file can be
  unlinked once both sides hold the mapping;
- the Inbox delivers every frame once, in order: from the slot while it polls (the doorbell that
  follows is dropped), from the doorbell when it does not poll, socket frames in between, and the
  connection's end after the frames before it; a doorbell out of order ends the connection.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from protos import shared_slots
from protos.shared_slots import TO_CLIENT, TO_SERVER, Inbox, SharedSlots, SharedSlotsError
from protos.wire import FRAME_ERROR, FRAME_MESSAGE, FRAME_SHARED, frame

pytestmark = pytest.mark.skipif(not os.path.isdir(shared_slots.SHM_DIR), reason="no /dev/shm on this host")


@pytest.fixture
def pair():
    a = SharedSlots.create(slot_bytes=1024)
    b = SharedSlots.attach(a.offer())
    yield a, b
    a.unlink()
    a.close()
    b.close()


def test_frames_cross_both_ways_with_their_numbers(pair):
    a, b = pair
    a.unlink()                                   # both hold the mapping: the file is no longer needed
    assert not os.path.exists(a.path)
    for n, payload in enumerate([b"x" * 1024, b"", b"hello", bytes(range(256))], 1):
        assert a.put(TO_SERVER, payload) == n
        assert b.seq(TO_SERVER) == n and b.get(TO_SERVER, n) == payload
        assert b.put(TO_CLIENT, payload[::-1]) == n
        assert a.seq(TO_CLIENT) == n and a.get(TO_CLIENT, n) == payload[::-1]
    assert a.put(TO_SERVER, b"y" * 1025) is None  # over the slot: the socket's
    assert b.seq(TO_SERVER) == 4
    with pytest.raises(ConnectionError, match="holds frame 4"):
        b.get(TO_SERVER, 5)


def test_offers_that_do_not_name_this_mapping_are_refused(pair):
    a, _ = pair
    offer = a.offer()
    forged = offer[:4] + bytes(16) + offer[20:]   # the right path, another nonce
    with pytest.raises(SharedSlotsError, match="not the mapping offered"):
        SharedSlots.attach(forged)
    with pytest.raises(SharedSlotsError, match="offer"):
        SharedSlots.attach(offer[:4] + offer[4:20] + b"/tmp/elsewhere")
    with pytest.raises(SharedSlotsError, match="offer of 3 bytes"):
        SharedSlots.attach(b"abc")
    a.unlink()
    with pytest.raises(SharedSlotsError, match="cannot open"):
        SharedSlots.attach(offer)


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
        with pytest.raises(ConnectionError, match="doorbell 6 after frame 1"):
            await asyncio.wait_for(inbox.next(), 5)
        return got
    assert _inbox_run(pair, 0.0, script) == [(FRAME_MESSAGE, b"one"), (FRAME_MESSAGE, b"two")]
