"""Tensor-parallel model servers: one process per GPU, rank 0 serving gRPC (DESIGN section 4).

`--tensor-parallel-size N` on a model server: the process that serves gRPC is rank 0 and holds the
first device (`--device cuda:i`); it spawns ranks 1..N-1 on cuda:i+1..i+N-1. Every rank builds the
same engine over its shard of the weights (llama.py: q/k/v and gate/up column-sharded, o and down
row-sharded and all-reduced over NCCL; embedding and LM head replicated) and its shard of the KV
heads. The engine calls that change state or run forwards (warm_up, propose, verify, release) are
mirrored: rank 0 sends the call with its arguments down a pipe to every other rank, then runs it
itself; the forwards meet in their all-reduces. Everything after the all-reduced hidden state is
replicated and deterministic (the LM head, greedy picks, seeded sampling, acceptance; rank 0
seeds the sampled sequences that come without a seed, pin_seeds), so every rank takes the same
decisions and keeps the same KV bookkeeping without a second message. Each mirrored call carries
rank 0's bookkeeping (sequences, free blocks, held tokens); a rank that finds its own different
stops the group instead of running a forward whose all-reduce would never meet.

Reads (info, metrics gauges, the profile) stay on rank 0. A rank that dies, or whose mirrored
call raises (status 4; bookkeeping that differs: 3), takes the server down (exit status 1), from
the spawn on: the others would wait in their next all-reduce (or in the
rendezvous) for ever. Ranks 1..N-1 ignore SIGINT and SIGTERM (rank 0 stops them once it has
drained) and exit when rank 0 is gone. On the CPU the ranks use gloo (tests); the rendezvous is a
file, so no port can collide.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import multiprocessing
import os
import pickle
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from specdec import collectives
from specdec.config import EngineConfig, rank_devices
from specdec.models.llama import TensorParallel

log = logging.getLogger("specdec.tensor_parallel")

# Engine methods every rank runs; anything else is read or set on rank 0 only.
MIRRORED = frozenset({"warm_up", "propose", "verify", "release"})
WATCH_INTERVAL_S = 1.0
GROUP_TIMEOUT = timedelta(minutes=10)  # a collective waits this long for a rank (loading a 70B shard)


def init_rank(rank: int, size: int, rendezvous: str, config: EngineConfig) -> None:
    """Joins the group (NCCL on GPUs, gloo on the CPU), runs one all-reduce, so that the
    communicators exist before any CUDA graph captures a collective, and chooses the all-reduce
    path of the row-parallel projections with the other ranks (collectives.setup)."""
    device = config.device
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=size,
                            timeout=GROUP_TIMEOUT)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != size:
        raise RuntimeError(f"tensor-parallel rank {rank}: the group's first all-reduce gave {probe.item()}, "
                           f"expected {size}")
    collectives.setup(torch.device(device), config.dtype, config.tp_all_reduce)


def leave_group(timeout: float = 10.0) -> None:
    """Tears the group down. gloo: destroyed. NCCL: aborted, on a thread given `timeout` seconds:
    on the H200 host destroy_process_group never returned once CUDA graphs had captured the
    group's all-reduces (tests/helpers/tp_probe.py, session 14), and a server that is shutting down
    must not wait for ever; the process exit frees what is left."""
    if not dist.is_initialized():
        return
    collectives.reset()
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    done = threading.Thread(target=dist.distributed_c10d._abort_process_group, name="tp-abort", daemon=True)
    done.start()
    done.join(timeout)
    if done.is_alive():
        log.warning("the NCCL group did not abort within %.0fs; leaving it to the process exit", timeout)


def bookkeeping(engine) -> tuple:
    """What every rank must agree on before a mirrored call: its sequences, their KV lengths and
    the free blocks (the acceptance of the last verify decides the KV lengths)."""
    runner = engine.runner
    ids = sorted(runner.blocks.seq_ids())
    return runner.blocks.num_free, tuple((s, runner.num_tokens(s)) for s in ids)


def pin_seeds(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of a propose or verify call with a seed drawn here for every sampled sequence
    that has none: each rank would draw its own (resolve_seeds), and their samples, acceptances
    and so KV would part (the target's ranks stop the group; the draft's would feed each rank its
    own drafted tokens, silently). A fresh seed per call is what the engine draws itself."""
    if name not in ("propose", "verify"):
        return args, kwargs

    def pinned(seqs):
        return [dataclasses.replace(s, sampling=dataclasses.replace(s.sampling, seed=secrets.randbits(64)))
                if s.sampling.seed is None and not s.sampling.greedy else s for s in seqs]
    if args:
        return (pinned(args[0]), *args[1:]), kwargs
    if "seqs" in kwargs:
        return args, {**kwargs, "seqs": pinned(kwargs["seqs"])}
    return args, kwargs


class _CallPickler(pickle.Pickler):
    """Pickles CPU tensors by value (their bytes), not as multiprocessing's shared-memory handles:
    one file descriptor passed per tensor made a call with 32 small draft-probability tensors take
    15 ms to reach a rank on this CPU (the review of session 14), against ~3 ms pickled plainly."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            return _tensor_from_bytes, (t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape))
        return NotImplemented


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def dumps_call(call) -> bytes:
    buf = io.BytesIO()
    _CallPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(call)
    return buf.getvalue()


def _exit_after_failed_call(name: str, error: BaseException) -> None:
    log.error("%s raised on rank 0 (%s: %s) after it went to the other ranks: they may have run it "
              "to its end, or wait in an all-reduce rank 0 left; the ranks cannot be trusted to agree, "
              "so the server exits", name, type(error).__name__, error)
    logging.shutdown()
    os._exit(1)


def _exit_server(rank: int, status) -> None:
    log.error("tensor-parallel rank %d exited (status %s): the server cannot go on without it; exiting",
              rank, status)
    logging.shutdown()
    os._exit(1)


class TensorParallelEngine:
    """Rank 0's engine: the engine's attributes, with the MIRRORED calls sent to every rank first.
    A mirrored call that raises on rank 0 is handed to on_call_failed(name, error), which by default
    ends the process (engine calls do not raise on bad input: the servicers convert requests before
    the call, and the engines answer a sequence's problem in its result)."""

    def __init__(self, engine, senders: list, workers: list, rendezvous_dir: str, closing: threading.Event,
                 on_call_failed: Callable[[str, BaseException], None] = _exit_after_failed_call):
        self.engine = engine
        self._on_call_failed = on_call_failed
        self._senders = senders
        self._workers = workers
        self._rendezvous_dir = rendezvous_dir
        self._closing = closing  # set: the ranks' watch (started with them, see start) stops

    def __getattr__(self, name):
        value = getattr(self.engine, name)
        if name in MIRRORED:
            def mirrored(*args, **kwargs):
                args, kwargs = pin_seeds(name, args, kwargs)
                # Pickled once, before anything is sent: a call that cannot be sent reaches no rank.
                message = dumps_call((name, args, kwargs, bookkeeping(self.engine)))
                for conn in self._senders:
                    conn.send_bytes(message)
                try:
                    return value(*args, **kwargs)
                except Exception as e:
                    self._on_call_failed(name, e)
                    raise
            return mirrored
        return value

    def close(self, timeout: float = 30.0) -> None:
        """Stops the other ranks (they leave their loop and the group) and waits for them."""
        if self._closing.is_set():
            return
        self._closing.set()
        for conn in self._senders:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._workers:
            proc.join(timeout)
            if proc.exitcode is None:
                proc.kill()
        leave_group()
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)


def _watch_ranks(workers: list, closing: threading.Event, on_rank_lost: Callable[[int, object], None]) -> None:
    """on_rank_lost(rank, exit status) once a rank has exited, unless `closing` was set first. It
    watches from the spawn on, not only once serving: a rank lost before it joined the group
    would leave rank 0 in the rendezvous for GROUP_TIMEOUT."""
    while not closing.wait(WATCH_INTERVAL_S):
        lost = next(((r, p.exitcode) for r, p in enumerate(workers, start=1) if p.exitcode is not None), None)
        if lost is not None and not closing.is_set():
            on_rank_lost(*lost)
            return


def start(make_engine: Callable, config: EngineConfig,
          on_rank_lost: Callable[[int, object], None] = _exit_server,
          on_call_failed: Callable[[str, BaseException], None] = _exit_after_failed_call,
          torch_threads: int | None = None) -> TensorParallelEngine:
    """Spawns ranks 1..N-1, joins the group as rank 0 and builds rank 0's engine. on_rank_lost(rank,
    exit status) runs (on a watch thread) when another rank exits before close(), from the spawn
    on; by default it ends this process."""
    size = config.tensor_parallel_size
    devices = rank_devices(config.device, size)
    rendezvous_dir = tempfile.mkdtemp(prefix="specdec-tp-")
    rendezvous = os.path.join(rendezvous_dir, "group")
    ctx = multiprocessing.get_context("spawn")
    senders, workers = [], []
    level = logging.getLogger().level
    for rank in range(1, size):
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, name=f"tp-rank-{rank}", daemon=True,
                           args=(rank, size, rendezvous, dataclasses.replace(config, device=devices[rank]),
                                 make_engine, receiver, level, os.getpid(), torch_threads))
        proc.start()
        receiver.close()
        senders.append(sender)
        workers.append(proc)
    log.info("tensor parallel over %s (rank 0 serves; ranks 1..%d are pids %s)", ", ".join(devices), size - 1,
             ", ".join(str(p.pid) for p in workers))
    closing = threading.Event()
    threading.Thread(target=_watch_ranks, args=(workers, closing, on_rank_lost), name="tp-watch",
                     daemon=True).start()
    try:
        init_rank(0, size, rendezvous, dataclasses.replace(config, device=devices[0]))
        engine = make_engine(config, tp=TensorParallel(0, size))
    except BaseException:
        closing.set()  # rank 0's own failure is what gets reported, not the ranks it stops
        for proc in workers:
            proc.kill()
        with contextlib.suppress(Exception):  # the error to report is the one being raised
            leave_group()
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
        raise
    return TensorParallelEngine(engine, senders, workers, rendezvous_dir, closing, on_call_failed)


def _exit_with_parent(parent: int) -> None:
    """A rank whose server process is gone (killed, crashed) exits too, even inside a collective.
    `parent` is the pid rank 0 passed, not os.getppid() read here: a server killed while this
    rank still imported torch has already handed it to another parent by then."""
    while os.getppid() == parent:
        threading.Event().wait(WATCH_INTERVAL_S)
    log.error("the serving process (pid %d) is gone; exiting", parent)
    logging.shutdown()
    os._exit(1)


def _rank_main(rank: int, size: int, rendezvous: str, config: EngineConfig, make_engine: Callable,
               conn, log_level: int, parent: int, torch_threads: int | None = None) -> None:
    """Ranks 1..N-1: build the engine, then run every call rank 0 sends until it sends None or goes."""
    # Rank 0 decides when the group stops (after draining its streams) and this rank goes with it:
    # a signal to the whole process group (Ctrl-C in a terminal, a service manager stopping the
    # control group) must not take it away first, which ends the server with status 1 mid-drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent,), name="tp-parent", daemon=True).start()
    if torch_threads:  # the server's --torch-threads, as rank 0 runs with it
        torch.set_num_threads(torch_threads)
    log.info("rank %d of %d on %s (%d torch threads)", rank, size, config.device, torch.get_num_threads())
    if os.environ.get("SPECDEC_TP_HANG_DUMP_S"):  # diagnostics (tests/helpers/tp_probe.py): stacks of a hang
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["SPECDEC_TP_HANG_DUMP_S"]), exit=False)
    init_rank(rank, size, rendezvous, config)
    engine = make_engine(config, tp=TensorParallel(rank, size))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            log.error("rank 0 is gone; exiting")
            break
        if message is None:
            break
        name, args, kwargs, expected = message
        mine = bookkeeping(engine)
        if mine != expected:
            log.error("rank %d's KV bookkeeping differs from rank 0's before %s (%s vs %s): the ranks "
                      "diverged; stopping the group", rank, name, mine, expected)
            logging.shutdown()
            os._exit(3)
        try:
            getattr(engine, name)(*args, **kwargs)
        except Exception:
            # Rank 0 may not have raised (a failure of this GPU alone) and may wait in an all-reduce
            # this rank left; where it did raise, it ends the server itself (on_call_failed). Either
            # way the group cannot go on: exit, and rank 0's watch ends the server within a second
            # instead of hanging for GROUP_TIMEOUT.
            log.exception("mirrored %s raised on rank %d: the ranks cannot be trusted to agree; exiting",
                          name, rank)
            logging.shutdown()
            os._exit(4)
    if config.device.startswith("cuda"):
        # Nothing of NCCL's teardown (see leave_group) runs here: the process exit frees it.
        logging.shutdown()
        os._exit(0)
    leave_group()
