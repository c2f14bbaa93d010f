"""A process-wide kernel setting read at launch (a CUDA graph keeps what it was captured with): PDL
on or off, the GEMV's split-K reduce, the GEMV's dispatch bound, the attention's split-merge warps
and small split tiles (a plan is made at launch). Its value, a checked set, and
forced(value) for the length of a block (benchmarks compare settings in one process)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Switch(Generic[T]):
    def __init__(self, value: T, check: Callable[[T], T]):
        """check returns the value to keep (normalised) or raises ValueError; the first value too."""
        self._check = check
        self.value = check(value)

    def set(self, value: T) -> None:
        self.value = self._check(value)

    @contextlib.contextmanager
    def forced(self, value: T) -> Iterator[None]:
        """This value inside the block (checked before anything changes), the old one after it,
        whatever the block raises."""
        old = self.value
        self.set(value)
        try:
            yield
        finally:
            self.value = old
