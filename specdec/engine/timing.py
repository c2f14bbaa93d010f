"""Device time of forwards, and the live profile of one single-token forward per batch size (the
t(b, 1 token) that the cost coefficient c is defined on)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

from specdec.cost_model import CostProfile
from specdec.staging import current_stream


def host_clock(device: torch.device, ranks: int = 1) -> Callable[[], float]:
    """The clock a forward on `device` is timed with from the host. On the CPU with one torch
    thread, the calling thread's CPU time: the whole forward runs on that thread, and its CPU
    time is the CPU analogue of a CUDA event's device time. The wall clock would add what a
    shared machine takes away: preemption by other processes (the other model server, the
    coordinator, Prometheus on a 2-core machine) and waits for the GIL held by the server's own
    gRPC and metrics threads, all the larger a share of a short forward (a CI run exported c 2.4x
    the value timed in a quiet process). With several torch threads the forward's work is spread
    over threads this clock does not see, so it is the wall clock, as it is around a synchronised
    CUDA forward; so it is for a tensor-parallel rank (ranks > 1), whose forward includes its
    all-reduces, which wait for the other ranks (a CUDA event counts that wait too)."""
    if device.type == "cpu" and ranks == 1 and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


class ForwardClock:
    """Times the forwards of one step. On CUDA it records events and reads them only after the
    step's final device-to-host copy has synchronised, so timing adds no sync inside the step;
    elsewhere it reads host_clock(device, ranks). A timed span may hold several forwards of one batch
    (a chain graph's replays): each gets an equal share of its time."""

    def __init__(self, device: torch.device, ranks: int = 1):
        self.cuda = device.type == "cuda"
        self._now = None if self.cuda else host_clock(device, ranks)
        # Recorded on the stream explicitly: Event.record() looks the current stream up (and the
        # device with it) in Python on every call, tens of microseconds a forward; and found
        # through the raw handle, since a clock is made every step.
        self._stream = current_stream(device) if self.cuda else None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self._host: list[tuple[float, int]] = []

    @contextmanager
    def forward(self, count: int = 1):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._stream)
            yield
            end.record(self._stream)
            self._events.append((start, end, count))
        else:
            t0 = self._now()
            yield
            self._host.append((self._now() - t0, count))

    def seconds(self) -> list[float]:
        """Per-forward seconds; call after the step's results were copied to the host."""
        if self.cuda:
            if self._events:
                self._events[-1][1].synchronize()
            spans = [(s.elapsed_time(e) / 1000.0, n) for s, e, n in self._events]
        else:
            spans = self._host
        return [t / n for t, n in spans for _ in range(n)]


class DecodeProfile:
    """The engine's single-token view (query length 1) of a CostProfile: warm_up() sets entries
    from timed forwards, live decode forwards move them, and StepTiming.decode_forward_seconds
    reads them. The numbers live in the CostProfile (specdec/cost_model.py: batch buckets, EMA),
    the one table the engine reports, the server exports and the coordinator's c is built on.
    Batch sizes map to their bucket; a bucket never timed reads 0.0 (the proto's "unknown").

    `on_sample` listeners get every live single-token forward as (batch_size, seconds): the
    server's forward-time histogram."""

    def __init__(self, costs: CostProfile | None = None):
        self.costs = costs if costs is not None else CostProfile()
        self.on_sample: list[Callable[[int, float], None]] = []

    def set(self, batch_size: int, seconds: float) -> None:
        self.costs.set_profiled(batch_size, 1, [seconds])

    def update(self, batch_size: int, seconds: float) -> None:
        self.update_many(batch_size, (seconds,))

    def update_many(self, batch_size: int, samples: Sequence[float]) -> None:
        """Each sample in turn (a chain's forwards): into the profile, then to the listeners."""
        def sampled(seconds: float) -> None:
            for listener in self.on_sample:
                listener(batch_size, seconds)
        self.costs.update_many(batch_size, 1, samples, sampled if self.on_sample else None)

    def table(self) -> dict[int, float]:
        return {b: s for (b, q), s in sorted(self.costs.table().items()) if q == 1}

    def __call__(self, batch_size: int) -> float:
        # A step whose sequences all failed has batch 0 and ran no forward.
        return (self.costs.get(batch_size, 1) or 0.0) if batch_size > 0 else 0.0
