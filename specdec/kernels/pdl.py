"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a forward.

Inside a CUDA graph a decode step is still a chain of ~10 kernels per layer, and each boundary
costs the GPU a drain (the last wave of one kernel runs on a few SMs while the rest idle) and a
launch (the next kernel's blocks are scheduled only after that). With PDL the next kernel is
launched while the previous one is still running: its blocks become resident as soon as every
block of the previous kernel has passed `griddepcontrol.launch_dependents`, and wait in
`griddepcontrol.wait` until the previous kernel has finished and its writes are visible.

The rule every kernel here keeps: `enter(USE_PDL)` is the first thing it does, before any load or
store. So nothing reads a predecessor's output early or overwrites memory a predecessor still
reads, and because each kernel's completion implies its predecessor's (it waited for it), the
ordering of the whole chain is the stream's. Kernels launched without the attribute (torch's,
cuBLAS, and the GEMV's norm consumers of 2..16 rows on wide models: gemv.consumer_pdl) keep plain
stream order; such a consumer may still `trigger` its successor once its K loop is done
(gemv.consumer_trigger).

One process-wide switch, read at launch: CUDA graphs keep what they were captured with. Default
on for compute capability >= 9; `SPECDEC_PDL=0` or `set_enabled(False)` (the servers'
`--no-pdl`) turns it off. The interpreter (CPU) never uses it.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from specdec.kernels.switch import Switch

_enabled: Switch[bool] = Switch(os.environ.get("SPECDEC_PDL", "1") != "0", bool)

# The one exception to "enter first": a kernel may load, before enter(), what the kernel launched
# just before it never writes. When a kernel starts, every kernel launched before its predecessor
# has finished: the predecessor reached launch_dependents only after its own wait, which returned
# when the kernel before it had finished. So inputs staged by the host or written two or more
# launches back are ready at the start. (This leans on a finished kernel's writes being visible
# to later kernels, which PTX spells out only for the immediate predecessor after the wait; and on
# no kernel here reaching launch_dependents before its wait. The immediate predecessor's writes,
# with or without PDL, are only safe to read after enter().)
# The attention kernel loads its query starts, context lengths and first page indices this way
# (its predecessor is RoPE + KV store, which writes q and the new K/V only), RoPE + KV store its
# cos / sin rows and slots (its predecessor is the qkv projection, which with the norm fusion also
# reads the norm's partial sums and weight, and writes only its output; launched without PDL, it
# starts after its own predecessor has finished and RoPE starts after it has). Stores always
# follow enter().
# Read at launch (graphs keep what they captured); SPECDEC_PDL_EARLY=0 or set_early_loads(False)
# puts every load after enter().
EARLY_LOADS: bool = os.environ.get("SPECDEC_PDL_EARLY", "1") != "0"


def set_early_loads(enabled: bool) -> None:
    global EARLY_LOADS
    EARLY_LOADS = bool(enabled)


@triton.jit
def enter(USE_PDL: tl.constexpr):
    """Wait for the previous kernel in the stream, then let the next one start launching."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def trigger(ON: tl.constexpr):
    """Let the next kernel start launching, from a kernel launched without PDL (it started after
    its predecessor had finished, so a successor resident from here still finds everything before
    this kernel finished; the successor's own enter() waits for this one)."""
    if ON:
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def active(device: torch.device) -> bool:
    return _enabled.value and _supported(device)


def options(device: torch.device, allowed: bool = True) -> dict:
    """Keyword arguments for a kernel launch: the kernel's USE_PDL constexpr and Triton's
    launch_pdl option, both on or both off (off where the caller does not allow it)."""
    on = allowed and active(device)
    return {"USE_PDL": on, "launch_pdl": on}


set_enabled = _enabled.set
# forced(on): launch (and capture) with PDL on or off inside the block; benchmarks compare both
forced = _enabled.forced


def enabled() -> bool:
    return _enabled.value
