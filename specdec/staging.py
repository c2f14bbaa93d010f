"""Host-to-device copies of the small tensors a step builds on the host (index layouts, positions,
sampling parameters), without a host-device sync.

A plain `.to("cuda")` of a pageable host tensor is torch's memcpy_and_sync: a copy and a stream
synchronize (what torch.cuda.set_sync_debug_mode flags). non_blocking=True from pageable memory
avoids the explicit sync, but the driver stages pageable bytes through a bounded buffer and can
wait for the GPU to drain earlier copies. From pinned memory the copy is a DMA queued on the stream
and the host goes on at once; torch's caching host allocator records an event on the pinned block,
so it is not reused before the copy has read it and the host tensor may be dropped right away.

Pinning needs CUDA (pin_memory fails on CPU-only machines), so only the CUDA path pins.
"""
from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence

import torch

# Segment offsets in a packed buffer: 16 bytes, the alignment Triton specialises pointer arguments
# on, so a view at such an offset compiles to the same kernel variant as a separate allocation.
PACK_ALIGN = 16
# What a packed buffer holds: integer index arrays, and the float32 / bool sampling parameters of
# the graphed sampler (sampling/graphs.py), and its float64 uniforms.
_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d", torch.bool: "B"}


_streams: dict[int, torch.cuda.Stream] = {}   # per device index: the current stream seen last


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device), without its cost while the current stream stays the
    same: the raw handle is compared with the Stream seen last (on the H200 host
    torch.cuda.current_stream took ~10 us a call, the raw handle 0.3; bench/staging.py)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    raw = torch._C._cuda_getCurrentRawStream(index)
    stream = _streams.get(index)
    if stream is None or stream.cuda_stream != raw:
        stream = _streams[index] = torch.cuda.current_stream(index)
    return stream


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device`: itself when already there, through pinned memory from the host to a GPU.
    Device to device stays ordered on the stream; a copy to the host blocks (it is read next)."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=device.type != "cpu")


def as_device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`, staged as to_device does."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _pack_host(arrays: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[bytearray, list[tuple[int, int, torch.dtype]]]:
    """The packed host bytes of integer arrays and each one's (byte offset, length, dtype)."""
    buf, spans = bytearray(), []
    for values, dtype in arrays:
        if dtype not in _TYPECODES:
            raise ValueError(f"pack: {dtype} is not one of {list(_TYPECODES)}")
        spans.append((len(buf), len(values), dtype))
        buf += array(_TYPECODES[dtype], values).tobytes()
        buf += bytes(-len(buf) % PACK_ALIGN)
    return buf, spans


def _views(packed: torch.Tensor, spans) -> list[torch.Tensor]:
    return [packed[off:off + n * dtype.itemsize].view(dtype) for off, n, dtype in spans]


def pack_to_device(arrays: Sequence[tuple[Sequence[int], torch.dtype]],
                   device: torch.device | str) -> list[torch.Tensor]:
    """Integer arrays (int64 or int32) on `device` through one host-to-device copy instead of one
    per array: packed into one host buffer, each at a PACK_ALIGN-byte offset, staged as to_device
    does, and returned as 1-D views of the copy in the given order. (A step's index tensors are
    seven small arrays: on the GPU each separate copy is a pin and a cudaMemcpyAsync of host time.)"""
    buf, spans = _pack_host(arrays)
    if not buf:
        return [torch.empty(0, dtype=dtype, device=device) for _, _, dtype in spans]
    # On the CPU the views share `buf` (frombuffer keeps it alive); it is never touched again here.
    return _views(to_device(torch.frombuffer(buf, dtype=torch.uint8), device), spans)


class Rows:
    """A 2-D slot's contents for PackedBuffer.fill: `rows` (each at most `width` values) written
    row-major at `width` values a row, each row padded with the slot's pad; rows past the last
    are padded too. Block tables are a few real entries in a wide, mostly padded row: writing the
    rows as they are spares building (and converting) the padded list."""

    __slots__ = ("rows", "width")

    def __init__(self, rows: Sequence[Sequence[int]], width: int):
        self.rows, self.width = rows, width

    def __len__(self) -> int:
        return len(self.rows) * self.width


def inference(fn):
    """fn in torch.inference_mode(), entered only where the caller is not in it already (entering
    costs a few us: a chain step enters it once for its staging copy and replays)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return wrapped


# Host staging buffers per PackedBuffer (HostRing): most buckets are staged once a step, but a
# draft that cannot chain stages its single-token bucket at every position, with no sync between.
MAX_HOST_BUFFERS = 16


class HostRing:
    """The host staging buffers of one PackedBuffer, taken in turn. A buffer whose last copy may
    not have run yet (its event not complete) is passed over, and the ring grows by one (up to
    `limit`) rather than wait for it; only a full ring waits, for the oldest copy. Fills faster than
    the GPU takes their copies then neither block nor overwrite bytes a queued copy still reads.
    Without events (the CPU: copies are done when copy_ returns) one buffer serves."""

    def __init__(self, nbytes: int, pinned: bool, limit: int = MAX_HOST_BUFFERS):
        self.nbytes, self.pinned, self.limit = nbytes, pinned, limit
        self.hosts: list[torch.Tensor] = []
        self.bytes: list[memoryview] = []    # writable views of the hosts' memory
        self.events: list = []               # per host, the event recorded after its last copy
        self.order: list[int] = []           # per host, when its last copy was queued (a count)
        self.turn = 0
        self._queued = 0
        self._grow()

    def _grow(self) -> None:
        host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.hosts.append(host)
        self.bytes.append(host.numpy().data)
        self.events.append(None)
        self.order.append(0)

    def take(self) -> int:
        """The index of a host buffer free to write."""
        n = len(self.hosts)
        for i in range(n):
            j = (self.turn + i) % n
            if self.events[j] is None or self.events[j].query():
                break
        else:
            if n < self.limit:
                self._grow()
                j = n
            else:
                j = min(range(n), key=self.order.__getitem__)   # the oldest copy still queued
                self.events[j].synchronize()
        self.turn = (j + 1) % len(self.hosts)
        return j

    def copied(self, j: int, event_factory, stream) -> None:
        """The copy out of host j is queued on `stream`: j is busy until an event after it."""
        if self.events[j] is None:
            self.events[j] = event_factory()
        self.events[j].record(stream)
        self._queued += 1
        self.order[j] = self._queued


class PackedBuffer:
    """Fixed device views of integer arrays of fixed lengths in one buffer, laid out as
    pack_to_device lays them out, refilled by one host-to-device copy (`fill`). CUDA graphs keep
    their static inputs here: a replay's inputs arrive in one copy, with no device-side copies
    into the graph's buffers.

    The bytes are written straight into a host buffer of the same layout that lives as long as
    this one (pinned on CUDA; a HostRing of them), so a fill allocates and pins nothing and
    converts only the values it is given; an event recorded after each copy keeps a host buffer
    from being rewritten before its copy has read it."""

    def __init__(self, layout: Sequence[tuple[int, torch.dtype]], device: torch.device | str):
        self.layout = [(n, dtype) for n, dtype in layout]
        zeros, self.spans = _pack_host([([0] * n, dtype) for n, dtype in self.layout])
        self.buffer = torch.zeros(len(zeros), dtype=torch.uint8, device=device)  # padded to PACK_ALIGN
        self.views = _views(self.buffer, self.spans)
        self._cuda = self.buffer.is_cuda
        self.ring = HostRing(len(zeros), pinned=self._cuda)
        self._pads: dict[tuple, bytes] = {}                   # (slot, pad) -> the slot's bytes all pad
        # Per slot: (byte offset, length, typecode, item size); per host buffer of the ring, each
        # slot's memory as a typed memoryview (an array of the slot's typecode is written into it
        # without converting it to bytes first), made when fill first writes that host buffer.
        self._slots = [(off, n, _TYPECODES[dtype], dtype.itemsize) for off, n, dtype in self.spans]
        self._typed: list[list[memoryview]] = []

    def _pad_bytes(self, slot: int, pad) -> bytes:
        # Keyed by the pad's type and repr, not its value: -0.0 == 0.0 == 0 would share bytes (the
        # sign of a float pad), and a NaN never equals itself (a new entry per fill). An int (the
        # type exactly: not a bool) is keyed by its value, which says as much as its repr.
        key = (slot, pad) if type(pad) is int else (slot, type(pad), repr(pad))
        cached = self._pads.get(key)
        if cached is None:
            n, dtype = self.layout[slot]
            cached = self._pads[key] = array(_TYPECODES[dtype], [pad] * n).tobytes()
        return cached

    def _typed_views(self, turn: int) -> list[memoryview]:
        while len(self._typed) <= turn:
            mv = self.ring.bytes[len(self._typed)]
            self._typed.append([mv[off:off + n * size].cast(code) for off, n, code, size in self._slots])
        return self._typed[turn]

    @inference  # the buffer may be an inference tensor (made during graph capture)
    def fill(self, arrays: Sequence, pads: Sequence | None = None) -> list[torch.Tensor]:
        """Writes each array into its slot in one staged copy; returns the views. Without pads
        every array has exactly its slot's length; with pads, a shorter array (or a Rows) is
        padded with its slot's pad value (None: exact length required for that slot)."""
        slots = self._slots
        if len(arrays) != len(slots) or (pads is not None and len(pads) != len(arrays)):
            self._refuse(arrays, pads)
        for i, a in enumerate(arrays):
            k, n = len(a), slots[i][1]
            if k > n or (k < n or isinstance(a, Rows)) and (pads is None or pads[i] is None):
                self._refuse(arrays, pads)
        turn = self.ring.take()
        mv = self.ring.bytes[turn]
        typed = self._typed_views(turn)
        for i, a in enumerate(arrays):
            off, n, code, size = slots[i]
            rows = isinstance(a, Rows)
            if rows or len(a) < n:
                mv[off:off + n * size] = self._pad_bytes(i, pads[i])
            if rows:
                view, width = typed[i], a.width
                for r, row in enumerate(a.rows):
                    if len(row) > width:
                        raise ValueError(f"PackedBuffer.fill: a row of {len(row)} values, width {width}")
                    view[r * width:r * width + len(row)] = array(code, row)
            elif len(a):
                typed[i][:len(a)] = array(code, a)
        self._copy(turn, self.buffer, self.ring.hosts[turn])
        return self.views

    def _copy(self, turn: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queues the copy of host buffer `turn`'s bytes `src` into `dst` (pinned: a DMA on the
        stream, after any replay still reading the buffer, no sync) and marks that host buffer
        busy until it has run."""
        dst.copy_(src, non_blocking=self._cuda)
        if self._cuda:
            self.ring.copied(turn, torch.cuda.Event, current_stream(self.buffer.device))

    @inference
    def put(self, slot: int, values: Sequence[int]) -> torch.Tensor:
        """Overwrites the first len(values) entries of one slot and nothing else, in one copy of
        just those bytes (a staged step whose ids alone change: TargetEngine's step staged ahead).
        The rest of the buffer keeps what the last fill left. Returns the slot's view."""
        off, n, code, size = self._slots[slot]
        if len(values) > n:
            raise ValueError(f"PackedBuffer.put: {len(values)} values for slot {slot} of {n}")
        turn = self.ring.take()
        self._typed_views(turn)[slot][:len(values)] = array(code, values)
        end = off + len(values) * size
        self._copy(turn, self.buffer[off:end], self.ring.hosts[turn][off:end])
        return self.views[slot]

    def _refuse(self, arrays: Sequence, pads: Sequence | None):
        raise ValueError(f"PackedBuffer.fill: lengths {[len(a) for a in arrays]}, "
                         f"layout {[n for n, _ in self.layout]}"
                         + ("" if pads is None else f", pads {list(pads)}"))
