"""Which BLAS library torch's matrix products use on CUDA.

The linears of steps above the GEMV's rows (gemv.SERVE_MAX_M: a verify of 8 sequences x 5 tokens
is 40 rows, a decode at batch 32 is 32, prompt chunks more) and the ops outside the GEMV go to
F.linear, which torch hands to cuBLAS by default. At 32 and 40 rows cuBLAS (torch 2.11, CUDA
13.0, H200) runs the 7B's o and down projections as split-K with a separate reduce kernel: 6
kernels for a layer's four projections. Through cuBLASLt, torch gives the library a smaller
workspace and its heuristic picks kernels without the split: 4 kernels, o 13.5 -> 11.6 us, down
27.9 -> 25.4 us, the four projections 117.0 -> 112.2 us a layer (session 29,
`bench/results/logs/s29/call2_cublas_opts.json`, products alone). The servers take the library
from EngineConfig.blas (`--blas`); the default stays cuBLAS until cuBLASLt is timed in the
servers' graphs (bench kernel set `blas_cublaslt` against `default`) and at prompt sizes.

Process-wide (torch's own setting, read at each product; a CUDA graph keeps the kernels it was
captured with). A CPU build of torch refuses cuBLASLt, so only CUDA engines set it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

LIBRARIES = ("cublas", "cublaslt")
DEFAULT = "cublas"


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
