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

from array import array
from collections.abc import Sequence

import torch

# Segment offsets in a packed buffer: 16 bytes, the alignment Triton specialises pointer arguments
# on, so a view at such an offset compiles to the same kernel variant as a separate allocation.
PACK_ALIGN = 16
# What a packed buffer holds: integer index arrays, and the float32 / bool sampling parameters of
# the graphed sampler (sampling/graphs.py), and its float64 uniforms.
_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d", torch.bool: "B"}


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


# Host staging buffers per PackedBuffer: a fill writes one while the copy out of the other may
# still be queued behind the GPU's work (a step stages a bucket at most once before its tokens come
# back; a third fill before the first copy ran waits for it).
HOST_BUFFERS = 2


class PackedBuffer:
    """Fixed device views of integer arrays of fixed lengths in one buffer, laid out as
    pack_to_device lays them out, refilled by one host-to-device copy (`fill`). CUDA graphs keep
    their static inputs here: a replay's inputs arrive in one copy, with no device-side copies
    into the graph's buffers.

    The bytes are written straight into a host buffer of the same layout that lives as long as
    this one (pinned on CUDA, HOST_BUFFERS of them in turn), so a fill allocates and pins nothing
    and converts only the values it is given; an event recorded after each copy keeps a host
    buffer from being rewritten before its copy has read it."""

    def __init__(self, layout: Sequence[tuple[int, torch.dtype]], device: torch.device | str):
        self.layout = [(n, dtype) for n, dtype in layout]
        zeros, self.spans = _pack_host([([0] * n, dtype) for n, dtype in self.layout])
        self.buffer = torch.zeros(len(zeros), dtype=torch.uint8, device=device)  # padded to PACK_ALIGN
        self.views = _views(self.buffer, self.spans)
        self._cuda = self.buffer.is_cuda
        self._hosts = [torch.zeros(len(zeros), dtype=torch.uint8, pin_memory=self._cuda)
                       for _ in range(HOST_BUFFERS if self._cuda else 1)]
        self._bytes = [h.numpy().data for h in self._hosts]  # writable memoryviews of the host buffers
        self._copied: list = [None] * len(self._hosts)        # CUDA event after each buffer's last copy
        self._turn = 0
        self._pads: dict[tuple[int, int], bytes] = {}         # (slot, pad) -> the slot's bytes all pad
        self._stream = None                                   # the last current stream seen (CUDA)

    def _current_stream(self):
        """The buffer's device's current stream, where copy_ queued the copy: the Stream seen last
        while the raw handle is the same (torch.cuda.current_stream took ~8 us a call on the H200
        host, bench/staging.py, against well under 1 for the raw handle)."""
        raw = torch._C._cuda_getCurrentRawStream(self.buffer.device.index)
        if self._stream is None or self._stream.cuda_stream != raw:
            self._stream = torch.cuda.current_stream(self.buffer.device)
        return self._stream

    def _pad_bytes(self, slot: int, pad) -> bytes:
        key = (slot, pad)
        if key not in self._pads:
            n, dtype = self.layout[slot]
            self._pads[key] = array(_TYPECODES[dtype], [pad] * n).tobytes()
        return self._pads[key]

    @torch.inference_mode()  # the buffer may be an inference tensor (made during graph capture)
    def fill(self, arrays: Sequence, pads: Sequence | None = None) -> list[torch.Tensor]:
        """Writes each array into its slot in one staged copy; returns the views. Without pads
        every array has exactly its slot's length; with pads, a shorter array (or a Rows) is
        padded with its slot's pad value (None: exact length required for that slot)."""
        if len(arrays) != len(self.layout) or any(
                len(a) > n or (len(a) < n or isinstance(a, Rows)) and (pads is None or pads[i] is None)
                for i, (a, (n, _)) in enumerate(zip(arrays, self.layout))):
            raise ValueError(f"PackedBuffer.fill: lengths {[len(a) for a in arrays]}, "
                             f"layout {[n for n, _ in self.layout]}"
                             + ("" if pads is None else f", pads {list(pads)}"))
        turn = self._turn
        self._turn = (turn + 1) % len(self._hosts)
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()   # done long ago unless fills come faster than copies
        mv = self._bytes[turn]
        for i, (a, (off, n, dtype)) in enumerate(zip(arrays, self.spans)):
            code, size = _TYPECODES[dtype], dtype.itemsize
            if len(a) < n or isinstance(a, Rows):
                mv[off:off + n * size] = self._pad_bytes(i, pads[i])
            if isinstance(a, Rows):
                for r, row in enumerate(a.rows):
                    if len(row) > a.width:
                        raise ValueError(f"PackedBuffer.fill: a row of {len(row)} values, width {a.width}")
                    at = off + r * a.width * size
                    mv[at:at + len(row) * size] = memoryview(array(code, row)).cast("B")
            elif len(a):
                mv[off:off + len(a) * size] = memoryview(array(code, a)).cast("B")
        # Pinned: a DMA queued on the stream (after any replay still reading the buffer), no sync.
        self.buffer.copy_(self._hosts[turn], non_blocking=self._cuda)
        if self._cuda:
            if self._copied[turn] is None:
                self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record(self._current_stream())
        return self.views
