"""Device time of forwards, and the live profile of one single-token forward per batch size (the
t(b, 1 token) that the cost coefficient c is defined on)."""
from __future__ import annotations

import bisect
import time
from contextlib import contextmanager

import torch


class ForwardClock:
    """Times the forwards of one step. On CUDA it records events and reads them only after the
    step's final device-to-host copy has synchronised, so timing adds no sync inside the step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host: list[float] = []

    @contextmanager
    def forward(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host.append(time.perf_counter() - t0)

    def seconds(self) -> list[float]:
        """Per-forward seconds; call after the step's results were copied to the host."""
        if self.cuda:
            if self._events:
                self._events[-1][1].synchronize()
            return [s.elapsed_time(e) / 1000.0 for s, e in self._events]
        return list(self._host)


class DecodeProfile:
    """Seconds of one single-token forward by batch size: a warm-up table, then an exponential
    moving average of live decode forwards. Sizes never measured are interpolated between the
    nearest measured ones (flat beyond the ends)."""

    def __init__(self, ema: float = 0.1):
        self.ema = ema
        self._table: dict[int, float] = {}

    def set(self, batch_size: int, seconds: float) -> None:
        self._table[batch_size] = seconds

    def update(self, batch_size: int, seconds: float) -> None:
        old = self._table.get(batch_size)
        self._table[batch_size] = seconds if old is None else old + self.ema * (seconds - old)

    def table(self) -> dict[int, float]:
        return dict(sorted(self._table.items()))

    def __call__(self, batch_size: int) -> float:
        if not self._table:
            return 0.0
        if batch_size in self._table:
            return self._table[batch_size]
        sizes = sorted(self._table)
        i = bisect.bisect_left(sizes, batch_size)
        if i == 0:
            return self._table[sizes[0]]
        if i == len(sizes):
            return self._table[sizes[-1]]
        lo, hi = sizes[i - 1], sizes[i]
        w = (batch_size - lo) / (hi - lo)
        return self._table[lo] * (1 - w) + self._table[hi] * w
