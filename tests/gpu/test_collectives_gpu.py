"""The one-shot all-reduce over symmetric memory (specdec/collectives.py) on two GPUs, one process
each: chosen by setup where every rank can, sums of random inputs as NCCL sums them (bit for bit
with two ranks), eagerly and replayed from a CUDA graph on new inputs; activations over the
buffer and fp16 go through NCCL; a forced one-shot with fp16 is refused."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="an all-reduce between GPUs needs two")]

MAX_BYTES = 64 * 1024


def _rank(rank: int, rendezvous: str, conn) -> None:
    import torch.distributed as dist

    from specdec import collectives
    from specdec.config import ConfigError
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
        dist.all_reduce(torch.ones(1, device=device))
        report = {"fp16": collectives.setup(device, torch.float16, "auto")}
        try:
            collectives.setup(device, torch.float16, "one-shot")
            report["forced_fp16"] = "accepted"
        except ConfigError as e:
            report["forced_fp16"] = str(e)
        report["bf16"] = collectives.setup(device, torch.bfloat16, "auto", max_bytes=MAX_BYTES)

        def inputs(seed, numel, dtype):
            g = torch.Generator().manual_seed(seed)
            return [torch.randn(numel, generator=g).to(dtype) for _ in range(2)]  # rank 0's, rank 1's

        checks = []
        for dtype in (torch.bfloat16, torch.float16):
            for numel in (4096, 5 * 4096, MAX_BYTES // 2, MAX_BYTES // 2 + 8, 3 * 4096 + 8):
                xs = inputs(numel, numel, dtype)
                mine = xs[rank].to(device)
                nccl = mine.clone()
                dist.all_reduce(nccl)
                got = collectives.all_reduce(mine.clone().view(-1, 8))
                checks.append((str(dtype), numel, bool(torch.equal(got.view(-1), nccl)),
                               bool(torch.isfinite(got).all())))
        # In a graph: 6 all-reduces of 2 sizes, replayed on new inputs (copied into the captured ones)
        static = [torch.zeros(n, dtype=torch.bfloat16, device=device) for n in (4096, 4096 * 5) * 3]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            [collectives.all_reduce(x) for x in static]
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [collectives.all_reduce(x) for x in static]
        replays = []
        for seed in range(3):
            wants = []
            for i, x in enumerate(static):
                xs = inputs(100 * seed + i, x.numel(), torch.bfloat16)
                x.copy_(xs[rank])
                wants.append((xs[0].to(device).float() + xs[1].to(device).float()).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            replays.append(all(torch.equal(o, w) for o, w in zip(outs, wants)))
        report.update(checks=checks, replays=replays, path=collectives.path())
        conn.send(report)  # a pipe's send is written before it returns (a Queue's may not be, at _exit)
    except BaseException as e:  # reported, not lost in the child's stderr
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        os._exit(0)  # no NCCL teardown after graph capture (tensor_parallel.leave_group)


def test_one_shot_all_reduce_sums_as_nccl_eagerly_and_in_graphs(tmp_path):
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "group"), pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    reports = {}
    for rank, (receiver, _) in enumerate(pipes):
        assert receiver.poll(90), f"rank {rank} sent no report in 90 s"
        reports[rank] = receiver.recv()
    for p in procs:
        p.join(30)
    for rank, report in reports.items():
        assert "error" not in report, (rank, report)
        assert report["fp16"] == "nccl" and "no one-shot kernel" in report["forced_fp16"]
        assert report["bf16"] == "one-shot" and report["path"] == "one-shot"
        assert all(same and finite for _, _, same, finite in report["checks"]), report["checks"]
        assert report["replays"] == [True, True, True]
