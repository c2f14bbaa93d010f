"""Counter-based random numbers: u = hash(seed, position, purpose), with integer tensor ops.

Every uniform a sequence consumes is a pure function of its request seed, the absolute position of
the token being decided (prompt included) and what the number is for. So:
- a seeded request gives the same tokens whatever else shares its batch, and on CPU or CUDA;
- there is no generator state per row to carry between steps or servers, and no host sync;
- draft and target may live in different processes and still draw from disjoint streams
  (different `purpose`) of the same seed.

Reusing a (position, purpose) pair after a rejection is safe: a number drawn for position t only
ever influences the token at t, and once a step commits the token at t that position is never
decided again. A drafted token at t+1 discarded by a rejection at t leaves u(t+1, DRAFT) unobserved,
so re-drafting t+1 with the same number in the next step is still an independent draw.

One deliberate share: a pipelined extension's first token, the draft's guess of the target's token
at t, is drawn with u(t, RESAMPLE), the target's own number there (sampling/draft.py), so that the
guess agrees with the target when q is close to p. The guess is compared with the target's token,
never verified as a draft (notes/sampling.md says why that keeps the output exact).

The hash is SplitMix64 (Steele et al. 2014): state = mix(seed + golden), output i = mix(state +
i * golden) with i = 4 * position + purpose. int64 multiplication wraps modulo 2**64 on CPU and CUDA,
which is what the mixer needs; logical right shifts are emulated with a mask.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

DRAFT = 0      # the draft's sample of its token at this position
ACCEPT = 1     # the target's accept test of the drafted token at this position
RESAMPLE = 2   # the target's correction (residual) or bonus sample at this position
NUM_PURPOSES = 4


def _signed(x: int) -> int:
    return x - 2**64 if x >= 2**63 else x


GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def seed_to_int64(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (tensors are signed)."""
    return _signed(seed % 2**64)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """seeds, positions: [R] int64 (same device) -> [R] float64 uniforms in [0, 1), 53 bits."""
    state = _mix(seeds + GOLDEN)
    z = _mix(state + (positions * NUM_PURPOSES + purpose) * GOLDEN)
    return _shr(z, 11).to(torch.float64) * (2.0 ** -53)


def uniform_host(seeds: Sequence[int], positions: Sequence[int], purposes: Sequence[int]) -> np.ndarray:
    """`uniform` on the host for a few rows at once (numpy uint64 arithmetic wraps as the int64
    tensors do, and its right shifts are logical): the same float64 values, bit for bit. seeds
    are int64 bits (seed_to_int64); one purpose per row. The graphed sampler stages these rather
    than running the hash's ~30 integer kernels per row set inside its graph."""
    with np.errstate(over="ignore"):
        z = np.asarray(seeds, dtype=np.int64).astype(np.uint64) + np.uint64(GOLDEN % 2**64)
        state = _mix_host(z)
        i = np.asarray(positions, dtype=np.uint64) * np.uint64(NUM_PURPOSES) + np.asarray(purposes, dtype=np.uint64)
        z = _mix_host(state + i * np.uint64(GOLDEN % 2**64))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _mix_host(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1 % 2**64)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2 % 2**64)
    return z ^ (z >> np.uint64(31))


def uniform_reference(seed: int, position: int, purpose: int) -> float:
    """Pure-Python reference of `uniform` (arbitrary-precision ints), for tests."""
    mask = 2**64 - 1

    def mix(z: int) -> int:
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    state = mix(seed + 0x9E3779B97F4A7C15)
    z = mix(state + (position * NUM_PURPOSES + purpose) * 0x9E3779B97F4A7C15)
    return (z >> 11) * 2.0 ** -53
