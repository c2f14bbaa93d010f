"""Which BLAS library torch's matrix products use on CUDA.

The linears the GEMV does not take (steps above gemv.SERVE_MAX_M rows, prompt chunks; above 16
rows the projections wider than gemv.WIDE_MAX_N, such as the 7B's gate_up and LM head in a verify
of 8 sequences x 5 tokens, 40 rows) and the ops outside the GEMV go to
F.linear, which torch hands to cuBLAS by default. At 32 and 40 rows cuBLAS (torch 2.11, CUDA 13.0,
H200) runs the 7B's o and down projections as split-K with a separate reduce kernel. Through
cuBLASLt the heuristic picks kernels without the split (as cuBLAS does without a workspace:
CUBLAS_WORKSPACE_CONFIG=:0:0 gave the same kernels in session 29's call 2). Session 29
(`bench/results/logs/s29/`), products alone (a graph over 32 weight copies): a layer's four
projections at 40 rows 118.5 -> 113.5 us (o 14.3 -> 11.9, down 28.0 -> 25.3), at 160 rows 141.8 ->
136.3; even at 512 and 2048 rows (0.995, 1.002) and at 24 (1.006). In the servers' graphs
(timeline.py, both orders, replay span): the 7B's b 8 verify 4572 / 4569 -> 4474 / 4482 us (361 ->
297 kernels), its b 32 decode 5435 / 5440 -> 5354 / 5350, b 32 verify 6624 / 6608 -> 6415 / 6379;
TinyLlama within 1% either way. So the servers ask for cuBLASLt on CUDA (EngineConfig.blas, `--blas
cublas` for the old path).

Process-wide (torch's own setting, read at each product; a CUDA graph keeps the kernels it was
captured with). A CPU build of torch refuses cuBLASLt, so only CUDA engines set it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

LIBRARIES = ("cublas", "cublaslt")
DEFAULT = "cublaslt"


def check(name: str) -> str:
    if name not in LIBRARIES:
        raise ValueError(f"blas: expected one of {', '.join(LIBRARIES)}, got {name!r}")
    return name


def current() -> str:
    """The library torch prefers now ("cublas" or "cublaslt"; "ck" on ROCm builds)."""
    return torch.backends.cuda.preferred_blas_library().name.lower()


def use(name: str) -> None:
    torch.backends.cuda.preferred_blas_library(check(name))


@contextlib.contextmanager
def forced(name: str) -> Iterator[None]:
    """`name` inside the block (checked before anything changes), the library before it after,
    whatever the block raises."""
    check(name)
    old = current()
    use(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old)
