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


class PackedBuffer:
    """Fixed device views of integer arrays of fixed lengths in one buffer, laid out as
    pack_to_device lays them out, refilled by one host-to-device copy (`fill`). CUDA graphs keep
    their static inputs here: a replay's inputs arrive in one copy, with no device-side copies
    into the graph's buffers."""

    def __init__(self, layout: Sequence[tuple[int, torch.dtype]], device: torch.device | str):
        self.layout = [(n, dtype) for n, dtype in layout]
        zeros, self.spans = _pack_host([([0] * n, dtype) for n, dtype in self.layout])
        self.buffer = torch.zeros(len(zeros), dtype=torch.uint8, device=device)  # padded to PACK_ALIGN
        self.views = _views(self.buffer, self.spans)

    @torch.inference_mode()  # the buffer may be an inference tensor (made during graph capture)
    def fill(self, arrays: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Writes each array (exactly its slot's length) in one staged copy; returns the views."""
        if len(arrays) != len(self.layout) or any(len(a) != n for a, (n, _) in zip(arrays, self.layout)):
            raise ValueError(f"PackedBuffer.fill: lengths {[len(a) for a in arrays]}, "
                             f"layout {[n for n, _ in self.layout]}")
        buf, _ = _pack_host([(a, dtype) for a, (_, dtype) in zip(arrays, self.layout)])
        host = torch.frombuffer(buf, dtype=torch.uint8)
        cuda = self.buffer.is_cuda
        # Pinned: a DMA queued on the stream (after any replay still reading the buffer), no sync.
        self.buffer[:len(buf)].copy_(host.pin_memory() if cuda else host, non_blocking=cuda)
        return self.views
