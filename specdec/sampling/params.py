"""Per-sequence sampling parameters as the model servers get them, validated on construction
(errors name the field). Seeds are drawn by the coordinator when a request arrives without one."""
from __future__ import annotations

import math
from dataclasses import dataclass

from protos.wire import GREEDY_BELOW_TEMPERATURE, InvalidInput

SEED_LIMIT = 2**64  # seeds are uint64 on the wire


class SamplingParamsError(InvalidInput):
    """An invalid sampling parameter; the message starts with the field name."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy (argmax); so is anything below GREEDY_BELOW_TEMPERATURE
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off; 0 (the proto3 default) is read as off too
    min_p: float = 0.0         # 0 = off
    seed: int | None = None    # None: unseeded (the coordinator always sends one)

    def __post_init__(self) -> None:
        def fail(field: str, msg: str) -> None:
            raise SamplingParamsError(f"{field}: {msg}, got {getattr(self, field)!r}")

        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 = off)")
        if not _is_number(self.top_p) or not 0 <= self.top_p <= 1:
            fail("top_p", "must be in [0, 1] (0 or 1 = off)")
        if self.top_p == 0:
            object.__setattr__(self, "top_p", 1.0)
        if self.temperature < GREEDY_BELOW_TEMPERATURE:  # greedy (protos.wire), as the coordinator reads it
            object.__setattr__(self, "temperature", 0.0)
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            fail("seed", "must be an integer in [0, 2**64) or None")
        # Floats are stored as floats so equal requests compare and hash equal.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
