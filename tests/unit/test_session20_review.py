"""Review of session 20's PackedBuffer.fill rewrite (specdec/staging.py: persistent host buffers,
pads, Rows, HostRing, the cached current stream) and of GraphedForward._fill built on it: the bytes
against the old packing (_pack_host / the old _fill of ba818e6), validation, errors mid-fill, and
the CUDA-only bookkeeping driven on the CPU through fake events and streams."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from specdec.cuda_graphs import GraphedForward
from specdec.runner import padded_table
from specdec.staging import HostRing, PackedBuffer, Rows, _pack_host
from specdec import staging

I64, I32, F32, F64, BOOL = torch.int64, torch.int32, torch.float32, torch.float64, torch.bool


def _bytes(buf: PackedBuffer) -> bytes:
    return bytes(buf.buffer.numpy())


def _old_bytes(arrays, layout) -> bytes:
    """What the old fill copied: _pack_host of the (already padded) arrays."""
    return bytes(_pack_host([(a, d) for a, (_, d) in zip(arrays, layout)])[0])


# --- bytes against the old packing ------------------------------------------------------------

ALL = [(3, I64), (5, I32), (1, F32), (7, F64), (9, BOOL), (2, I32)]   # odd lengths: alignment gaps


def _values(rng: random.Random):
    return [[rng.randint(-2**63, 2**63 - 1) for _ in range(3)],
            [-(2**31), 2**31 - 1, -1, 0, rng.randint(-2**31, 2**31 - 1)],
            [-2.5e-3],
            [float("inf"), -float("inf"), -0.0, 5e-324, -1.0, 1e308, rng.random()],
            [rng.random() < 0.5 for _ in range(9)],
            [-7, 7]]


def test_exact_fills_of_every_dtype_are_the_old_bytes_fill_after_fill():
    buf, rng = PackedBuffer(ALL, "cpu"), random.Random(0)
    for _ in range(5):
        arrays = _values(rng)
        buf.fill(arrays)
        assert _bytes(buf) == _old_bytes(arrays, ALL)


def test_padded_fills_of_every_dtype_are_the_old_padded_bytes():
    buf = PackedBuffer(ALL, "cpu")
    buf.fill(_values(random.Random(1)))                                # stale values to overwrite
    pads = (-5, -(2**31), 1.5, -1e300, True, 0)
    short = [[2**62], [], [], [1.0, -2.0], [False, True], [3, -3]]
    padded = [a + [p] * (n - len(a)) for a, p, (n, _) in zip(short, pads, ALL)]
    buf.fill(short, pads=pads)
    assert _bytes(buf) == _old_bytes(padded, ALL)
    # Rows of a bool and a float64 slot: each row padded, then the rows after the last
    layout = [(6, BOOL), (6, F64)]
    buf = PackedBuffer(layout, "cpu")
    buf.fill([[True] * 6, [9.0] * 6])
    buf.fill([Rows([[True], [False, True]], 2), Rows([[-1.0, 2.0]], 3)], pads=(True, -0.5))
    assert _bytes(buf) == _old_bytes([[True, True, False, True, True, True],
                                      [-1.0, 2.0, -0.5, -0.5, -0.5, -0.5]], layout)


@pytest.mark.parametrize("arrays,pads", [
    ([[0, 2**31], [0]], None),                     # an int32 value
    ([[-(2**31) - 1, 0], [0]], None),
    ([[1, 1], [2**63]], None),                     # an int64 value
    ([[1], [0]], (2**31, None)),                   # an int32 pad
    ([Rows([[0], [2**31]], 1), [0]], (0, None)),   # a row's value
])
def test_out_of_range_values_raise_overflow_as_array_did_and_leave_the_buffer(arrays, pads):
    layout = [(2, I32), (1, I64)]
    buf = PackedBuffer(layout, "cpu")
    buf.fill([[11, 12], [13]])
    with pytest.raises(OverflowError):
        buf.fill(arrays, pads=pads)
    assert [v.tolist() for v in buf.views] == [[11, 12], [13]]
    with pytest.raises(OverflowError):
        _pack_host([([-1], BOOL)])                 # bool: 'B' refuses -1 in both paths
    with pytest.raises(OverflowError):
        PackedBuffer([(1, BOOL)], "cpu").fill([[-1]])


# --- validation ---------------------------------------------------------------------------------

def test_validation_of_lengths_pads_and_rows():
    layout = [(4, I64), (2 * 3, I32), (0, I64)]
    buf = PackedBuffer(layout, "cpu")
    # Rows of exactly the slot's length: written (its pad first, then the rows)
    out = buf.fill([[1, 2, 3, 4], Rows([[1, 2, 3], [4, 5, 6]], 3), []], pads=(None, 0, None))
    assert out[1].tolist() == [1, 2, 3, 4, 5, 6] and out[2].tolist() == []
    out = buf.fill([[1, 2, 3, 4], Rows([[7], [8, 9]], 3), []], pads=(None, -1, None))
    assert out[1].tolist() == [7, -1, -1, 8, 9, -1]
    # a Rows always needs a pad (its rows may be ragged), even at exactly the slot's length
    for pads in (None, (0, None, 0)):
        with pytest.raises(ValueError, match="lengths"):
            buf.fill([[1, 2, 3, 4], Rows([[1, 2, 3], [4, 5, 6]], 3), []], pads=pads)
    # empty arrays: all pad where the slot has one, refused where it has none
    assert buf.fill([[], Rows([], 3), []], pads=(5, 6, None))[0].tolist() == [5] * 4
    assert buf.views[1].tolist() == [6] * 6
    with pytest.raises(ValueError, match="lengths"):
        buf.fill([[], Rows([], 3), []], pads=(None, 6, None))
    # a pad of 0 / False is a pad, not "no pad"
    assert buf.fill([[1], Rows([], 3), []], pads=(0, False, None))[0].tolist() == [1, 0, 0, 0]
    with pytest.raises(ValueError, match="lengths"):   # more rows than the slot holds
        buf.fill([[1], Rows([[1]] * 3, 3), []], pads=(0, 0, 0))
    assert [v.tolist() for v in buf.views] == [[1, 0, 0, 0], [0] * 6, []]


def test_pads_of_the_wrong_length_are_a_value_error():
    buf = PackedBuffer([(2, I64), (2, I64)], "cpu")
    with pytest.raises(ValueError):
        buf.fill([[1], [2]], pads=(0,))
    with pytest.raises(ValueError):
        buf.fill([[1, 1], [2, 2]], pads=(0, 0, 0))


# --- the pad cache --------------------------------------------------------------------------------

def test_equal_pads_of_other_types_give_the_same_bytes_for_every_dtype():
    """Pads that compare equal share a cache entry: harmless wherever they convert to the same
    bytes (every case but a signed zero, below); an unequal pad still gets its own bytes."""
    for dtype, pads, other in ((I64, (1, True), 3), (I32, (0, False), -3), (BOOL, (True, 1), False),
                               (F32, (1, 1.0, True), 0.5), (F64, (0, 0.0, False), 2**53 + 1)):
        fresh = [_bytes_of_pad(dtype, p, cached=False) for p in pads]
        assert len(set(fresh)) == 1, (dtype, pads)
        assert _bytes_of_pad(dtype, (other,) + pads, cached=True) == fresh[-1]
        assert _bytes_of_pad(dtype, pads + (other,), cached=True) == _bytes_of_pad(dtype, other, False)


def _bytes_of_pad(dtype, pad, cached: bool) -> bytes:
    """The slot's bytes after a padded fill: with cached, each pad in turn on one buffer (the last
    one's bytes); else the pad alone on a fresh buffer."""
    buf = PackedBuffer([(3, dtype)], "cpu")
    for p in (pad if cached else (pad,)):
        buf.fill([[]], pads=(p,))
    return _bytes(buf)[:3 * dtype.itemsize]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("first,second", [(0.0, -0.0), (-0.0, 0)])
def test_signed_zero_pads_keep_their_sign(dtype, first, second):
    buf = PackedBuffer([(3, dtype)], "cpu")
    buf.fill([[1.0]], pads=(first,))
    out = buf.fill([[1.0]], pads=(second,))[0]
    assert torch.signbit(out).tolist() == [False] + [math.copysign(1, second) < 0] * 2


# --- an error half-way through a fill ------------------------------------------------------------

def test_a_row_too_wide_half_way_leaves_the_buffer_and_later_fills_exact():
    layout = [(4, I64), (3, I32), (2 * 3, I32), (2, I64)]
    buf = PackedBuffer(layout, "cpu")
    first = [[1, 2, 3, 4], [5, 6, 7], [1, 1, 1, 2, 2, 2], [8, 9]]
    buf.fill(first)
    before = _bytes(buf)
    with pytest.raises(ValueError, match="width"):     # slots 0 and 1 written to the host first
        buf.fill([[-9] * 4, [-9] * 3, Rows([[3], [4, 4, 4, 4]], 3), [-9, -9]], pads=(0, 0, 0, 0))
    assert _bytes(buf) == before
    out = buf.fill([[5], [], Rows([[6]], 3), [7, 7]], pads=(0, -1, -2, None))
    assert _bytes(buf) == _old_bytes([[5, 0, 0, 0], [-1] * 3, [6, -2, -2, -2, -2, -2], [7, 7]], layout)
    assert [v.tolist() for v in out][2] == [6, -2, -2, -2, -2, -2]


# --- the CUDA path's ring, on the CPU with fake events ------------------------------------------

class _Event:
    def __init__(self):
        self.done, self.waited = True, 0

    def record(self, stream):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def _cuda_like(monkeypatch, layout, limit: int) -> PackedBuffer:
    """A CPU PackedBuffer taking fill's CUDA branch: events after each copy, a ring of `limit`."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    buf = PackedBuffer(layout, "cpu")
    buf._cuda, buf.ring.limit = True, limit
    monkeypatch.setattr(staging, "current_stream", lambda device: "stream")
    return buf


def test_fills_faster_than_their_copies_never_touch_a_busy_host_buffer(monkeypatch):
    buf = _cuda_like(monkeypatch, [(4, I64), (2, I32)], limit=3)
    ring, used = buf.ring, []
    for i in range(7):                                 # no copy ever completes by itself
        busy = {j: bytes(ring.bytes[j]) for j, e in enumerate(ring.events) if e is not None and not e.done}
        waited = [e.waited if e else 0 for e in ring.events]
        out = buf.fill([[i], [i, -i]], pads=(-1, None))
        j = (ring.turn - 1) % len(ring.hosts)
        used.append(j)
        assert [v.tolist() for v in out] == [[i, -1, -1, -1], [i, -i]]
        assert all(bytes(ring.bytes[k]) == b for k, b in busy.items() if k != j)
        if j in busy:                                  # only a full ring reuses one, after waiting
            assert len(ring.hosts) == 3 and ring.events[j].waited == waited[j] + 1
    assert used == [0, 1, 2, 0, 1, 2, 0] and len(ring.hosts) == 3 and ring._queued == 7
    assert ring.order == [7, 5, 6]


def test_a_failed_fill_queues_no_copy_and_writes_no_busy_buffer(monkeypatch):
    buf = _cuda_like(monkeypatch, [(2, I64), (4, I32)], limit=2)
    buf.fill([[1, 2], [3, 4, 5, 6]])
    busy = bytes(buf.ring.bytes[0])
    with pytest.raises(ValueError, match="width"):
        buf.fill([[7, 7], Rows([[1, 2, 3]], 2)], pads=(None, 0))
    assert buf.ring._queued == 1 and bytes(buf.ring.bytes[0]) == busy and buf.ring.events[1] is None
    assert [v.tolist() for v in buf.views] == [[1, 2], [3, 4, 5, 6]]
    buf.fill([[8, 8], [9, 9, 9, 9]])                   # the grown buffer, never copied: free
    assert buf.ring.events[0].waited == 0 and buf.ring.order == [1, 2]


def test_ring_takes_freed_buffers_out_of_turn_and_waits_for_the_oldest_by_order():
    ring = HostRing(8, pinned=False, limit=3)
    for j in range(3):
        assert ring.take() == j
        ring.copied(j, _Event, None)
    ring.events[1].done = True                         # a later copy ran first (another stream)
    assert ring.take() == 1 and ring.turn == 2 and ring.events[0].waited == 0
    ring.copied(1, _Event, None)
    for oldest in (0, 2, 1, 0):                        # full: the oldest queued copy, not the turn's
        j = ring.take()
        assert j == oldest and ring.events[j].waited >= 1 and len(ring.hosts) == 3
        ring.copied(j, _Event, None)
    assert ring.order == [8, 7, 6]


# --- the cached current stream ----------------------------------------------------------------------

def test_current_stream_is_refetched_whenever_the_raw_handle_changes(monkeypatch):
    raw, calls = {"h": 0}, []

    def current_stream(device):
        calls.append(device)
        return SimpleNamespace(cuda_stream=raw["h"], n=len(calls))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda index: raw["h"] if index == 1 else -1, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(staging, "_streams", {})
    seen = []
    for h in (0, 0, 77, 77, 0, 77):
        raw["h"] = h
        s = staging.current_stream(torch.device("cuda", 1))
        assert s.cuda_stream == h
        seen.append(s.n)
    assert seen == [1, 1, 2, 2, 3, 4] and calls == [1] * 4


# --- GraphedForward._fill against the old _fill (ba818e6) ------------------------------------------

def _old_fill_arrays(g, b, q, ids, positions, slots, starts, ctx_lens, tables, logit_rows):
    cap, t, n = g.shape(b, q).tokens, len(ids), len(starts) - 1
    rows = g._rows(b, q)
    return [ids + [0] * (cap - t), positions + [0] * (cap - t), slots + [-1] * (cap - t),
            starts + [t] * (b - n), ctx_lens + [q] * (b - n), padded_table(tables, g.max_blocks, b),
            logit_rows + [0] * (rows - len(logit_rows))]


def _graphs(max_blocks: int):
    g = SimpleNamespace(query_lens=[1, 4], max_blocks=max_blocks)
    g.prefill_lens = [8]
    for name in ("shape", "_rows", "_layout", "_fill"):
        setattr(g, name, getattr(GraphedForward, name).__get__(g))
    return g


@pytest.mark.parametrize("b,q", [(4, 4), (4, 1), (2, 8)])   # decode/verify buckets, a prefill one
def test_graphed_fill_writes_the_old_fills_bytes_for_ragged_steps(b, q):
    g = _graphs(max_blocks=5)
    layout = g._layout(b, q)
    packed = PackedBuffer(layout, "cpu")
    rng = random.Random(b * 100 + q)
    steps = []
    for n in range(1, b + 1):                          # 1 .. b sequences, ragged everything
        lens = [rng.randint(1, q) for _ in range(n)]
        if q == 8:                                     # prefill bucket: one chunk, then <= qv each
            lens = [rng.randint(1, 8)] + [rng.randint(1, 4) for _ in range(n - 1)]
        t = sum(lens)
        starts = [sum(lens[:i]) for i in range(n + 1)]
        tables = [[rng.randint(0, 2**31 - 1) for _ in range(rng.randint(0, 5))] for _ in range(n)]
        rows = sorted(rng.sample(range(t), rng.randint(1, min(t, g._rows(b, q)))))
        steps.append(([rng.randint(0, 2**40) for _ in range(t)], [rng.randint(0, 999) for _ in range(t)],
                      [rng.randint(-1, 2**40) for _ in range(t)], starts,
                      [rng.randint(1, 999) for _ in range(n)], tables, rows))
    for step in steps + steps[::-1]:                   # after larger and after smaller steps
        g._fill(packed, b, q, *[list(a) for a in step])
        assert _bytes(packed) == _old_bytes(_old_fill_arrays(g, b, q, *step), layout)
