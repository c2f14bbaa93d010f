"""The tensor-parallel all-reduce of the row-parallel projections (models/llama.py: o_proj and
down_proj, two a layer).

By default (`mode` "auto") a GPU group sends activations of up to ONE_SHOT_MAX_BYTES through a
one-shot all-reduce over symmetric memory (torch.distributed._symmetric_memory, PyTorch's own
kernel): each rank copies its partial sums into a buffer every other rank of the host can read
over NVLink, meets the others at a barrier, reads all the buffers and sums them itself; one kernel,
no ring, no NCCL launch. Decode and verify steps move 8 KB to a few hundred KB per all-reduce (a
4096-wide hidden state per token), which is latency, not bandwidth: where a 7B forward makes 64 of
them, NCCL's latency per call is what two GPUs lose (bench/allreduce.py measures both, in CUDA
graphs as the servers replay them). Larger activations (prefill chunks), other dtypes (fp16: the
kernel has none) and the CPU (gloo) go through torch.distributed.all_reduce.

The path is chosen once per process, after the group has formed, by every rank together: a rank
that cannot set the buffer up (no peer access, no kernel) makes all of them keep NCCL, since ranks
that took different paths would wait for each other for ever. Which path a call takes then depends
on its size and dtype only, which every rank shares. `mode` "nccl" keeps NCCL for everything;
"one-shot" fails the start where the one-shot path is not available.

Two ranks sum in the same order either way (one addition, rounded once), so the one-shot path
gives NCCL's bits there; with more ranks the order of the sums may differ.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from specdec.config import TP_ALL_REDUCE_MODES, ConfigError

log = logging.getLogger("specdec.collectives")

ONE_SHOT_MAX_BYTES = 512 * 1024     # at or below: one-shot (bench/allreduce.py); above: NCCL
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what PyTorch's one-shot kernel is built for


class OneShotAllReduce:
    """One symmetric buffer of `max_bytes` per process (every rank allocates and registers its own:
    a collective call), reused by every call; the kernel's barriers at its start and end keep a
    call from overwriting a buffer another rank still reads."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int = ONE_SHOT_MAX_BYTES,
                 group=None):
        import torch.distributed._symmetric_memory as symm_mem
        group = group if group is not None else dist.group.WORLD
        self.group_name = group.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes this way: by dtype and size only, which every rank's call shares."""
        return x.dtype == self.dtype and x.numel() <= self.max_numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks of x, as a new tensor (x is left as it was)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buffer[:x.numel()].view(x.shape), x, "sum",
                                                        self.group_name, out)
        return out


_one_shot: OneShotAllReduce | None = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the default process group's ranks: x itself, summed in place (NCCL /
    gloo), or a new tensor (one-shot). Callers use the value returned."""
    if _one_shot is not None and _one_shot.takes(x):
        return _one_shot(x)
    dist.all_reduce(x)
    return x


def path() -> str:
    """'one-shot' or 'nccl'/'gloo' (the default group's backend): what all_reduce uses for small
    activations in this process."""
    return "one-shot" if _one_shot is not None else dist.get_backend()


def setup(device: torch.device, dtype: torch.dtype, mode: str = "auto",
          max_bytes: int = ONE_SHOT_MAX_BYTES) -> str:
    """Chooses this process's path; every rank of the (initialised) default group calls it, in the
    same order relative to the group's other collectives. Returns path()."""
    global _one_shot
    if mode not in TP_ALL_REDUCE_MODES:
        raise ConfigError(f"tp_all_reduce: expected one of {', '.join(TP_ALL_REDUCE_MODES)}, got {mode!r}")
    _one_shot = None
    device = torch.device(device)
    if mode == "nccl" or device.type != "cuda":
        if mode == "one-shot":
            raise ConfigError("tp_all_reduce one-shot needs GPUs (symmetric memory); this group is on the CPU")
        return path()
    why = None
    if dtype not in ONE_SHOT_DTYPES:  # the same on every rank: no vote needed
        why = f"no one-shot kernel for {dtype}"
    else:
        candidate, why = _try_one_shot(device, dtype, max_bytes)
        ok = torch.tensor([0 if why else 1], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if int(ok.item()) == 1:
            _one_shot = candidate
        elif not why:
            why = "another rank could not set it up"
    if why:
        if mode == "one-shot":
            raise ConfigError(f"tp_all_reduce one-shot is not available here: {why}")
        log.info("tensor-parallel all-reduce: NCCL for every size (one-shot: %s)", why)
    else:
        log.info("tensor-parallel all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above",
                 max_bytes // 1024)
    return path()


def _try_one_shot(device, dtype, max_bytes) -> tuple[OneShotAllReduce | None, str | None]:
    """A set-up buffer and None, or None and why not. The buffer's first call is checked against
    the sum it must give (each rank contributes rank + 1 at every element)."""
    try:
        candidate = OneShotAllReduce(device, dtype, max_bytes)
        size, rank = dist.get_world_size(), dist.get_rank()
        got = candidate(torch.full((1024,), rank + 1, dtype=dtype, device=device))
        want = size * (size + 1) // 2
        if not bool((got == want).all()):
            return None, f"the first one-shot all-reduce gave {got.unique().tolist()[:4]}, expected {want}"
        return candidate, None
    except Exception as e:  # no symmetric memory / peer access / kernel on this host or build
        return None, f"{type(e).__name__}: {e}"


def reset() -> None:
    """Back to torch.distributed.all_reduce for every call (before a group is left)."""
    global _one_shot
    _one_shot = None
