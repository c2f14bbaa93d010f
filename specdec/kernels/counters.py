"""Arrival counters of the kernels whose last program of a tile to arrive finishes the tile's work
(the attention's inline merge, the GEMV's inline split-K reduce): zeroed int32s, one buffer per
device and capacity, kept for the process's life.

A CUDA graph that captured a launch replays with the buffer's address, and every launch leaves its
counters zero (a tile's last program resets its own), so no memset is ever launched. Kernels of
both kinds may share a buffer: launches on one device run one at a time (the runner issues them on
one stream; each kernel's enter() waits for the one before it, kernels/pdl.py), so no two touch it
at once. Launches that ran concurrently on two streams of a device must not share it."""
from __future__ import annotations

import functools

import torch


def arrival_counters(device: torch.device, capacity: int) -> torch.Tensor:
    """The device's zeroed counters, at least `capacity` of them ("cuda" is the current CUDA
    device: one buffer per GPU however the device is named)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _buffer(device, capacity)


@functools.lru_cache(maxsize=None)
def _buffer(device: torch.device, capacity: int) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("arrival counters: make one eager call before capturing a CUDA graph (the "
                           "counters are zeroed once, outside any graph)")
    return torch.zeros(capacity, dtype=torch.int32, device=device)
