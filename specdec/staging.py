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

from collections.abc import Sequence

import torch


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
