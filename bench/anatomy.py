"""Where a step's time goes inside the engines, with no gRPC: the same draft and target engines the
servers run, driven in one process by a minimal coordinator loop.

    python3 bench/anatomy.py [--target llama-7b] [--draft llama-68m] [--batches 1 8] [--k 4]
                             [--steps 48] [--agreement 0.8] [--profile]

Per batch size, side by side in one run on the same engines:
- replay: device time of one CUDA-graph replay (do_bench) of the target's (b, 1) and (b, k+1)
  buckets and of the draft's (b, 1) bucket and chain;
- plain: target.verify with no drafts (what a plain decode step costs the target server), wall
  time per call, and the engine's own forward span (StepTiming.forward_seconds, what the servers
  export as `forward`);
- spec: draft.propose then target.verify per step, each timed the same way;
- join: a speculative step in which a new request's 100-token prompt takes one sequence's place
  (the step continuous batching runs whenever a request arrives; --graph-prefill-lens none
  for the eager path).
`in-process speedup` = (tokens per spec step / spec step ms) / (1 / plain step ms): the speedup the
services would reach with free transport. `verify / decode` compares the target's wall times.
--profile adds a torch.profiler table of 8 speculative steps at the first batch size (top device
kernels and host ops). Writes bench/results/anatomy.json.

    python3 bench/anatomy.py --tensor-parallel 1 2 2:nccl [--draft-device cuda:1]

runs the same rows once per target tensor-parallel size, with an optional all-reduce mode after
a colon (collectives.py), each size in a process of its own (serving/tensor_parallel.py: ranks on
cuda:0.., rank 0 in that process, the mirrored calls sent to the others as a server sends them),
side by side with ratios to the first size, into bench/results/anatomy_tp.json. Replays are not
timed there: a rank-0 replay alone would wait for the other ranks in its all-reduce.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import environment, table, write_result

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from services import write_shape_folder  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import DraftEngine, TargetEngine  # noqa: E402
from specdec.engine.types import DraftSeqInput, VerifySeqInput  # noqa: E402
from specdec.runner import SeqInput  # noqa: E402

PROMPT = 128
JOIN_PROMPT = 100  # a request joining a running batch: its prompt beside the others' verifies


def engines(target_dir: Path, draft_dir: Path, agreement: float, max_model_len: int, k: int,
            device: str, batches: list[int], prefill_lens: tuple[int, ...] | None,
            tensor_parallel: int = 1, draft_device: str | None = None, tp_all_reduce: str = "auto"):
    def config(path, agree, **kw):
        return EngineConfig(model=str(path), dtype=torch.bfloat16, random_weights=True,
                            random_agreement=agree, max_model_len=max_model_len,
                            kv_memory=(8 << 30) if device.startswith("cuda") else (64 << 20),
                            max_num_draft=k, graph_batch_sizes=tuple(sorted(set(batches))),
                            warmup_batch_sizes=tuple(sorted(set(batches))),
                            graph_prefill_lens=prefill_lens, **kw)
    agree_t = 1.0 if agreement >= 0 else None
    agree_d = agreement if agreement >= 0 else None
    if tensor_parallel == 1:
        target = TargetEngine(config(target_dir, agree_t, device=device))
    else:
        from specdec.serving import tensor_parallel as tp
        target = tp.start(TargetEngine, config(target_dir, agree_t, device=device,
                                               tensor_parallel_size=tensor_parallel,
                                               tp_all_reduce=tp_all_reduce))
    draft = DraftEngine(config(draft_dir, agree_d, device=draft_device or device))
    for e in (target, draft):
        e.warm_up()
    return draft, target


class Loop:
    """A minimal coordinator over b sequences: plain steps (verify without drafts) or speculative
    steps (propose k, verify), each call timed on the host and by the engine's own clock."""

    def __init__(self, draft: DraftEngine, target: TargetEngine, b: int, k: int, seed: int):
        self.draft, self.target, self.k = draft, target, k
        rng = random.Random(seed)
        self.ids = [10_000 * (seed + 1) + i for i in range(b)]
        prompts = [[rng.randrange(target.vocab_size) for _ in range(PROMPT)] for _ in range(b)]
        out = target.verify([VerifySeqInput(s, p, first=True) for s, p in zip(self.ids, prompts)])
        prop = draft.propose([DraftSeqInput(s, 0, p, 0, first=True) for s, p in zip(self.ids, prompts)])
        assert all(o.error is None for o in out.outputs + prop.outputs)
        self.next = [o.next_token for o in out.outputs]
        self.keep = [0] * b
        self.tokens = 0

    def plain(self) -> dict:
        t0 = time.perf_counter()
        res = self.target.verify([VerifySeqInput(s, [t]) for s, t in zip(self.ids, self.next)])
        wall = time.perf_counter() - t0
        self.next = [o.next_token for o in res.outputs]
        self.tokens += len(self.ids)
        # The draft must follow the plain tokens too, or the next spec step would diverge: skipped
        # here (plain and spec runs use separate sequences).
        return {"target_wall": wall, "target_fwd": res.timing.forward_seconds}

    def spec(self, join: list[int] | None = None) -> dict:
        """One speculative step; join: a new sequence's prompt that takes the last sequence's
        place in this step's verify (what the target runs when a request arrives; the last
        sequence sits the step out, and the newcomer is released after it)."""
        n = len(self.ids) - (join is not None)
        ids, keep, nxt = self.ids[:n], self.keep[:n], self.next[:n]
        t0 = time.perf_counter()
        prop = self.draft.propose([DraftSeqInput(s, kp, [t], self.k) for s, kp, t in zip(ids, keep, nxt)])
        t1 = time.perf_counter()
        seqs = [VerifySeqInput(s, [t], d.tokens) for s, t, d in zip(ids, nxt, prop.outputs)]
        if join is not None:
            seqs.append(VerifySeqInput(-1, join, first=True))
        res = self.target.verify(seqs)
        t2 = time.perf_counter()
        assert all(o.error is None for o in prop.outputs + res.outputs)
        if join is not None:
            self.target.release([-1])
        outs = res.outputs[:n]
        self.keep[:n] = [o.accepted for o in outs]
        self.next[:n] = [o.next_token for o in outs]
        emitted = sum(o.accepted + 1 for o in outs)
        self.tokens += emitted
        return {"draft_wall": t1 - t0, "draft_fwd": prop.timing.forward_seconds,
                "target_wall": t2 - t1, "target_fwd": res.timing.forward_seconds,
                "tokens": emitted}

    def close(self) -> None:
        self.draft.release(self.ids)
        self.target.release(self.ids)


def replay_ms(engine, b: int, q: int) -> float | None:  # None: no such graph (or on the CPU)
    g = engine.runner.graphs.graphs.get((b, q)) if engine.runner.graphs is not None else None
    return do_bench(g.graph.replay, warmup=5, rep=40, return_mode="median") if g is not None else None


def timed_launch(graph, device, reps: int = 20, idle_us: float = 0) -> tuple[float, float]:
    """A replay started on an idle GPU, `idle_us` after a synchronize (the host spins meanwhile):
    (median host ms of the replay() call, median device ms from an event recorded just before it
    to one just after)."""
    host, spans = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        until = time.perf_counter() + idle_us * 1e-6
        while time.perf_counter() < until:
            pass
        start.record(torch.cuda.current_stream(device))
        t0 = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t0)
        end.record(torch.cuda.current_stream(device))
        end.synchronize()
        spans.append(start.elapsed_time(end))
    return 1e3 * statistics.median(host), statistics.median(spans)


def launch_ms(engine, b: int, q: int, reps: int = 20) -> tuple[float | None, float | None]:
    """A replay started on an idle GPU, as a server's step starts one (timed_launch): (host ms of
    the replay() call, device ms of its span). The span's excess over replay_ms (back-to-back
    replays, where each launch hides behind the previous replay) is what launching the graph
    costs the step. None without the graph."""
    g = engine.runner.graphs.graphs.get((b, q)) if engine.runner.graphs is not None else None
    if g is None:
        return None, None
    return timed_launch(g.graph, engine.runner.device, reps)


def chain_ms(engine, b: int) -> float | None:
    chains = engine.runner.graphs.chains if engine.runner.graphs is not None else {}
    c = chains.get(b)
    if c is None:
        return None

    @torch.inference_mode()  # `at` was made under capture, in inference mode
    def run():
        c.at.zero_()   # the chain's row counter: keep it in range (contents do not matter here)
        c.graph.replay()
    return do_bench(run, warmup=5, rep=40, return_mode="median")


def prepare_ms(engine, seq_ids: list[int], q: int, reps: int = 30) -> float:
    """Host milliseconds of the runner's prepare for q new tokens of each sequence (slot
    reservation, the batch's host lists, staging into a graph's inputs where one fits), median of
    reps; each sequence is truncated back after every call. Inside the engine's forward span the
    GPU waits for it: the span's excess over a graph replay."""
    runner = engine.runner
    items = [SeqInput(s, [1] * q, q) for s in seq_ids]
    before = [runner.num_tokens(s) for s in seq_ids]
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.prepare(items)
        samples.append(time.perf_counter() - t0)
        for s, n in zip(seq_ids, before):
            runner.truncate(s, n)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return 1e3 * statistics.median(samples)


def med_ms(samples: list[dict], key: str) -> float:
    return 1e3 * statistics.median(s[key] for s in samples)


def measure(draft, target, b: int, k: int, steps: int, seed: int, replays: bool = True) -> dict:
    row = {"batch": b, "k": k,
           "replay_t1_ms": replay_ms(target, b, 1) if replays else None,
           "replay_tk_ms": replay_ms(target, b, k + 1) if replays else None,
           "replay_d1_ms": replay_ms(draft, b, 1), "chain_d_ms": chain_ms(draft, b)}
    if replays:
        row["launch_tk_host_ms"], row["launch_tk_span_ms"] = launch_ms(target, b, k + 1)
        row["launch_d1_host_ms"], row["launch_d1_span_ms"] = launch_ms(draft, b, 1)
    loop = Loop(draft, target, b, k, seed)
    for _ in range(4):
        loop.plain()
    plain = [loop.plain() for _ in range(steps)]
    loop.close()
    loop = Loop(draft, target, b, k, seed + 1)
    for _ in range(4):
        loop.spec()
    spec = [loop.spec() for _ in range(steps)]
    rng = random.Random(seed)
    joins = [loop.spec(join=[rng.randrange(target.vocab_size) for _ in range(JOIN_PROMPT)])
             for _ in range(8)]
    if replays:   # (a tensor-parallel target is a proxy of its ranks: no runner here)
        row.update(prepare_t1_ms=prepare_ms(target, loop.ids, 1), prepare_tk_ms=prepare_ms(target, loop.ids, k + 1),
                   prepare_d1_ms=prepare_ms(draft, loop.ids, 1))
    loop.close()
    row.update(plain_wall_ms=med_ms(plain, "target_wall"), plain_fwd_ms=med_ms(plain, "target_fwd"),
               draft_wall_ms=med_ms(spec, "draft_wall"), draft_fwd_ms=med_ms(spec, "draft_fwd"),
               verify_wall_ms=med_ms(spec, "target_wall"), verify_fwd_ms=med_ms(spec, "target_fwd"),
               tokens_per_step=sum(s["tokens"] for s in spec) / len(spec) / b)
    row.update(join_wall_ms=med_ms(joins, "target_wall"), join_fwd_ms=med_ms(joins, "target_fwd"),
               join_graphed=target.runner.graphs is not None and target.runner.graphs.prefill_lens != ())
    row["spec_wall_ms"] = row["draft_wall_ms"] + row["verify_wall_ms"]
    row["verify_over_decode"] = row["verify_wall_ms"] / row["plain_wall_ms"]
    row["in_process_speedup"] = row["tokens_per_step"] * row["plain_wall_ms"] / row["spec_wall_ms"]
    return row


def profile(draft, target, b: int, k: int) -> str:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    cuda = target.device.type == "cuda"
    loop = Loop(draft, target, b, k, seed=99)
    for _ in range(4):
        loop.spec()
    with torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(8):
            loop.spec()
    loop.close()
    avg = prof.key_averages()
    tables = [avg.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)] if cuda else []
    return "\n".join(tables + [avg.table(sort_by="self_cpu_time_total", row_limit=15,
                                          max_name_column_width=60)])


def host_profile(draft, target, b: int, k: int, steps: int = 32) -> str:
    """cProfile of `steps` speculative steps at batch b (after 4 unprofiled ones): the engines'
    Python by function, top 30 by own time, then by cumulative time. Where the draft's host time
    goes (its wall time is several times its replays' device time)."""
    import cProfile
    import io
    import pstats
    loop = Loop(draft, target, b, k, seed=98)
    for _ in range(4):
        loop.spec()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        loop.spec()
    prof.disable()
    loop.close()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    return f"cProfile of {steps} speculative steps at batch {b}\n" + out.getvalue()


def pair_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The engines' arguments (shapes, batch sizes, γ, steps, agreement): this script's and gaps.py's."""
    p.add_argument("--target", default="llama-7b")
    p.add_argument("--draft", default="llama-68m")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--agreement", type=float, default=0.8,
                   help="drafts built to agree with the target this often (-1: plain random weights)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_args(p, steps=48)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--host-profile", action="store_true",
                   help="cProfile of 32 speculative steps per batch size (the engines' Python by function)")
    p.add_argument("--graph-prefill-lens", default=None,
                   help="comma-separated prompt-chunk lengths to graph, or 'none' (default: the engine's)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of small shapes (no graphs)")
    p.add_argument("--tensor-parallel", nargs="+", default=None, metavar="N[:MODE]",
                   help="target tensor-parallel sizes, each with an optional all-reduce mode "
                        "(auto, nccl, one-shot; e.g. 1 2 2:nccl), timed one after the other, each in a "
                        "process of its own (anatomy_tp.json)")
    p.add_argument("--tp-child", help=argparse.SUPPRESS)   # main_tp's child: the one spec it runs
    p.add_argument("--rows-out", help=argparse.SUPPRESS)
    p.add_argument("--draft-device", default=None, help="the draft's device (default: --device)")
    a = p.parse_args()
    max_len = PROMPT + (a.steps + 16) * (a.k + 1) + 64
    if a.tensor_parallel:
        return main_tp(a, max_len)
    with tempfile.TemporaryDirectory() as tmp:
        t_dir = write_shape_folder(Path(tmp) / "target", a.target)
        d_dir = write_shape_folder(Path(tmp) / "draft", a.draft)
        draft, target = engines(t_dir, d_dir, a.agreement, max_len, a.k, a.device, a.batches,
                                None if a.graph_prefill_lens is None else () if a.graph_prefill_lens == "none"
                                else tuple(int(x) for x in a.graph_prefill_lens.split(",")))
    rows = [measure(draft, target, b, a.k, a.steps, seed=i) for i, b in enumerate(a.batches)]
    prof = profile(draft, target, a.batches[0], a.k) if a.profile else None
    result = {"benchmark": "anatomy", "environment": environment(), "target": a.target, "draft": a.draft,
              "k": a.k, "steps": a.steps, "agreement": a.agreement, "rows": rows}
    if prof:
        print(prof)
        result["profile"] = prof
    if a.host_profile:
        result["host_profile"] = {b: host_profile(draft, target, b, a.k) for b in a.batches}
        for text in result["host_profile"].values():
            print(text)
    path = write_result("anatomy", result)
    print(table(rows, [("batch", "b", "d"), ("replay_t1_ms", "replay t q1", ".3f"),
                       ("replay_tk_ms", f"replay t q{a.k + 1}", ".3f"),
                       ("replay_d1_ms", "replay d", ".3f"), ("chain_d_ms", "chain d", ".3f"),
                       ("plain_wall_ms", "plain wall", ".3f"), ("plain_fwd_ms", "plain fwd", ".3f"),
                       ("draft_wall_ms", "draft wall", ".3f"), ("draft_fwd_ms", "draft fwd", ".3f"),
                       ("verify_wall_ms", "verify wall", ".3f"), ("verify_fwd_ms", "verify fwd", ".3f"),
                       ("prepare_t1_ms", "prepare t q1", ".3f"), ("prepare_tk_ms", f"prepare t q{a.k + 1}", ".3f"),
                       ("prepare_d1_ms", "prepare d", ".3f"),
                       ("launch_tk_host_ms", f"launch t q{a.k + 1} host", ".3f"),
                       ("launch_tk_span_ms", f"launch t q{a.k + 1} span", ".3f"),
                       ("launch_d1_host_ms", "launch d host", ".3f"), ("launch_d1_span_ms", "launch d span", ".3f"),
                       ("verify_over_decode", "verify/decode", ".2f"),
                       ("join_wall_ms", f"join {JOIN_PROMPT} wall", ".3f"),
                       ("tokens_per_step", "tok/step", ".2f"),
                       ("in_process_speedup", "in-process x", ".2f")]))
    print(f"wrote {path}")
    return 0


def tp_spec(spec: str) -> tuple[int, str]:
    """'2' -> (2, 'auto'); '2:nccl' -> (2, 'nccl'): a tensor-parallel size and its all-reduce mode."""
    size, _, mode = spec.partition(":")
    return int(size), mode or "auto"


def main_tp(a, max_len: int) -> int:
    """Each --tensor-parallel spec in a process of its own (a process joins one NCCL group), one
    after the other; the table compares them with the first."""
    if a.tp_child:
        rows = tp_rows(a, max_len, *tp_spec(a.tp_child))
        Path(a.rows_out).write_text(json.dumps(rows))
        sys.stdout.flush()
        os._exit(0)  # nothing of the aborted NCCL group's teardown at exit (tensor_parallel.leave_group)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(a.tensor_parallel):
            out = Path(tmp, f"rows{i}.json")
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--tp-child", spec, "--rows-out", str(out)],
                           check=True)
            rows += json.loads(out.read_text())
    first = [r for r in rows if r["spec"] == a.tensor_parallel[0]]
    base = {r["batch"]: r for r in first}
    for r in rows:
        for key in ("plain_wall_ms", "verify_wall_ms", "spec_wall_ms", "plain_fwd_ms"):
            r[f"{key}_vs_first"] = r[key] / base[r["batch"]][key]
    result = {"benchmark": "anatomy_tp", "environment": environment(), "target": a.target, "draft": a.draft,
              "draft_device": a.draft_device or a.device, "k": a.k, "steps": a.steps,
              "agreement": a.agreement, "rows": rows}
    path = write_result("anatomy_tp", result)
    print(table(rows, [("tp", "tp", "d"), ("all_reduce", "all-reduce", "s"), ("batch", "b", "d"),
                       ("plain_wall_ms", "plain wall", ".3f"), ("plain_fwd_ms", "plain fwd", ".3f"),
                       ("plain_fwd_ms_vs_first", "fwd x first", ".2f"),
                       ("plain_wall_ms_vs_first", "plain x first", ".2f"),
                       ("draft_wall_ms", "draft wall", ".3f"),
                       ("verify_wall_ms", "verify wall", ".3f"), ("verify_fwd_ms", "verify fwd", ".3f"),
                       ("verify_wall_ms_vs_first", "verify x first", ".2f"),
                       ("tokens_per_step", "tok/step", ".2f"),
                       ("in_process_speedup", "in-process x", ".2f")]))
    print(f"wrote {path}")
    return 0


def tp_rows(a, max_len: int, size: int, mode: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t_dir = write_shape_folder(Path(tmp) / "target", a.target)
        d_dir = write_shape_folder(Path(tmp) / "draft", a.draft)
        draft, target = engines(t_dir, d_dir, a.agreement, max_len, a.k, a.device, a.batches, None,
                                size, a.draft_device, tp_all_reduce=mode)
        path = "-"
        try:
            if size > 1:
                from specdec import collectives
                path = collectives.path()
            for i, b in enumerate(a.batches):
                rows.append({"spec": a.tp_child, "tp": size, "all_reduce": path,
                             **measure(draft, target, b, a.k, a.steps, seed=i, replays=size == 1)})
        finally:
            if size > 1:
                target.close()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
