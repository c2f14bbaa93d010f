"""Busy polling of an asyncio loop for a short window after activity.

A speculative step is two gRPC round trips between processes that sit idle in between. On the
H200 host a round trip with both sides idle took ~590 us against ~260 us back to back, and ~410
us when both event loops were polling instead of sleeping in epoll (bench/hostpath.py, session
6): waking a sleeping thread is a large part of the transport. So after each step the loop polls
(select with a zero timeout, through `await asyncio.sleep(0)`) for `window` seconds, and sleeps
again once traffic stops: the cost is one busy core per process while requests are served.

`paused()` stops polling around work on another thread (a prefill on the engine thread): a
polling loop holds the GIL most of the time and would slow that thread down.
"""
from __future__ import annotations

import asyncio
import contextlib
import time


class BusyPoll:
    def __init__(self, window_s: float):
        if window_s < 0:
            raise ValueError(f"busy-poll window must be >= 0, got {window_s}")
        self.window_s = window_s
        self._until = 0.0
        self._paused = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.polls = 0  # loop iterations spent polling (tests, and to see it work)

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def kick(self) -> None:
        """Poll for the next window_s seconds (on the loop's thread)."""
        if not self.enabled:
            return
        self._until = time.monotonic() + self.window_s
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="busy-poll")
        self._wake.set()

    def is_paused(self) -> bool:
        return self._paused > 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            if self._wake is not None:
                self._wake.set()

    async def _run(self) -> None:
        while True:
            if self._paused or time.monotonic() >= self._until:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.polls += 1
            await asyncio.sleep(0)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
