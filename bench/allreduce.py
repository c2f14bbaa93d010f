"""The tensor-parallel all-reduce on its own: NCCL against the one-shot all-reduce over symmetric
memory (specdec/collectives.py), side by side in one run, inside CUDA graphs as the servers replay
them.

    python3 bench/allreduce.py [--gpus 2] [--kib 8 40 64 160 256 512 1024 2048] [--calls 64]

One process per GPU. Per size: `--calls` all-reduces captured back to back in one graph (a 7B
forward makes 64: o_proj and down_proj of 32 layers), the graph replayed `--replays` times; the
figure is the median replay time / calls, per all-reduce. 8 KiB is one token of a 4096-wide bf16
hidden state, 40 KiB a 5-token verify, 320 KiB a batch of 8 verifies, 1280 KiB a batch of 32.
Before timing, each path's sum of random inputs is checked against the float64 sum and, where
two ranks sum (one rounding either way), the two paths against each other bit for bit.
Writes bench/results/allreduce.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from common import environment, table, write_result

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from specdec.collectives import OneShotAllReduce  # noqa: E402


def inputs(rank: int, numel: int, calls: int, dtype, device) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(1000 * rank + numel % 997)
    return [torch.randn(numel, generator=g).to(dtype=dtype, device=device) for _ in range(calls)]


def check(size: int, numel: int, dtype, device, one_shot: OneShotAllReduce) -> dict:
    """Both paths' sums of the same random inputs against the float64 sum of every rank's input."""
    mine = inputs(dist.get_rank(), numel, 1, dtype, device)[0]
    want = sum(inputs(r, numel, 1, dtype, device)[0].double() for r in range(size))
    nccl = mine.clone()
    dist.all_reduce(nccl)
    fast = one_shot(mine)
    scale = want.norm().item()
    return {"nccl_rel_err": (nccl.double() - want).norm().item() / scale,
            "one_shot_rel_err": (fast.double() - want).norm().item() / scale,
            "bits_equal": bool(torch.equal(nccl, fast)), "finite": bool(torch.isfinite(fast).all())}


def graph_us(fn, xs: list[torch.Tensor], replays: int) -> float:
    """Median of `replays` replays of one graph holding fn(x) for every x, per call, in us."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in xs[:2]:
            fn(x)  # warm-up outside the graph (NCCL's and the one-shot's first launches)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in xs:
            fn(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(xs))
    del graph
    return statistics.median(times)


def nccl_in_place(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def rank_main(rank: int, size: int, rendezvous: str, a, conn) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    dist.all_reduce(torch.ones(1, device=device))
    dtype = getattr(torch, a.dtype)
    one_shot = OneShotAllReduce(device, dtype, max_bytes=max(a.kib) * 1024)
    rows = []
    for kib in a.kib:
        numel = kib * 1024 // dtype.itemsize
        row = {"kib": kib, "numel": numel, "dtype": a.dtype, **check(size, numel, dtype, device, one_shot)}
        xs = inputs(rank, numel, a.calls, dtype, device)
        for p in range(a.passes):  # alternating passes: the two paths see the same machine state
            row.setdefault("nccl_us_passes", []).append(graph_us(nccl_in_place, xs, a.replays))
            row.setdefault("one_shot_us_passes", []).append(graph_us(one_shot, xs, a.replays))
        row["nccl_us"] = statistics.median(row["nccl_us_passes"])
        row["one_shot_us"] = statistics.median(row["one_shot_us_passes"])
        row["one_shot_vs_nccl"] = row["one_shot_us"] / row["nccl_us"]
        rows.append(row)
    if rank == 0:
        conn.send(rows)  # written before send returns (a Queue's feeder thread may not be, at _exit)
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)  # NCCL's teardown after graph capture may never return on this host (tensor_parallel.leave_group)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--kib", type=int, nargs="+", default=[8, 40, 64, 160, 256, 320, 512, 1024, 1280, 2048])
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args()
    if torch.cuda.device_count() < a.gpus:
        print(f"needs {a.gpus} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, a.gpus, os.path.join(tmp, "group"), a, sender))
                 for r in range(a.gpus)]
        for proc in procs:
            proc.start()
        if not receiver.poll(600):
            print("rank 0 sent no rows in 600 s", file=sys.stderr)
            return 1
        rows = receiver.recv()
        for proc in procs:
            proc.join(60)
    result = {"benchmark": "allreduce", "environment": environment(), "gpus": a.gpus, "calls_per_graph": a.calls,
              "replays": a.replays, "passes": a.passes, "rows": rows}
    path = write_result("allreduce", result)
    print(table(rows, [("kib", "KiB", "d"), ("nccl_us", "NCCL us", ".2f"), ("one_shot_us", "one-shot us", ".2f"),
                       ("one_shot_vs_nccl", "one-shot / NCCL", ".2f"), ("nccl_rel_err", "NCCL rel err", ".1e"),
                       ("one_shot_rel_err", "one-shot rel err", ".1e"), ("bits_equal", "same bits", "")]))
    print(f"wrote {path}")
    return 0 if all(r["finite"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
