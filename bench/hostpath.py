"""Where a step's host time outside the forwards goes: the layers of one RPC, measured apart.

    python3 bench/hostpath.py [--batches 1 8] [--steps 400]
    python3 bench/hostpath.py --baseline COMMIT [--passes 4]   # loop and servers' Python, against COMMIT

e2e.py reports "transport" per step: the coordinator's step time minus both servers' step_seconds
(1.4-2.3 ms per speculative step on the H200 host, session 5). This splits it, on the host alone
(no GPU is used, so the figures are the host CPU's):
- bare: a bidi gRPC round trip with the step messages of a batch, to an echo servicer in another
  process (grpc.aio on both sides, nothing of ours): the floor of one RPC;
- server: a round trip to a real target server (tiny random model on the CPU) through the
  coordinator's ModelServer, minus the step_seconds the server reports: what our server stack
  (interceptor, runtime, conversion, response) and client wrapper add to the bare round trip;
  and the server's host time inside the step (step_seconds minus its forward seconds); the same
  over the server's step channel (a plain socket, specdec/serving/step_channel.py) beside it;
- loop: the coordinator's step loop (SpecLoop) against in-process servers that answer at once
  (every draft accepted), with a task draining each sequence's queue as a client stream would:
  the coordinator's own Python per step (planning, requests, applying results, emission,
  statistics); and of it, what lies on the step's critical path: against servers that take 2 ms
  a call, the loop's time between a Verify's answer and the next Verify's request less the
  Propose call (what waits for servers meanwhile, as the statistics and the client streams do,
  is off the path);
- server Python: a step through the target's and the draft's servicer step functions with the model
  forward replaced by constant logits (server_python_us): conversion, validation, admission,
  batch preparation, acceptance and results, on the CPU path and on the GPU servers' graph path
  (CPU stand-ins for the graphs over a model that costs nothing: staging, chains, head graphs);
  and the graph path's steps in trace_steps.py's parts (s_pre .. s_post: the stamps specdec/trace.py
  makes inside a server's step), to set beside the same parts of an e2e-trace on a GPU host.
Medians over --steps steps after a warm-up. Writes bench/results/hostpath.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, baseline_tree, environment, table, write_result
from services import write_shape_folder

import grpc  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from coordinator.config import CoordinatorConfig  # noqa: E402
from coordinator.launch import free_port, spawn_server, stop_all, wait_healthy  # noqa: E402
from coordinator.scheduler import KVCapacity, Scheduler  # noqa: E402
from coordinator.sequence import GenParams, Sampling, Sequence  # noqa: E402
from coordinator.servers import ModelServer  # noqa: E402
from coordinator.spec_loop import SpecLoop  # noqa: E402
from coordinator.tokenizer import TextTokenizer  # noqa: E402
from protos import specdec_pb2 as pb  # noqa: E402
from protos import specdec_pb2_grpc as pb_grpc  # noqa: E402
from protos.wire import pack_ids  # noqa: E402
from specdec.metrics import CoordinatorMetrics  # noqa: E402

WARMUP = 50
GAP_S = 0.003  # between two steps of one server (see server_rtt)
SERVER_DELAY_S = 0.002  # per call of the loop's in-process servers when its critical path is timed
GAMMA = 4
TOKEN = 1000  # what the in-process servers draft and emit: a whole word of the demo tokenizer, no EOS
TINY_TARGET = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=False)


def median_us(samples: list[float]) -> float:
    return statistics.median(samples[WARMUP:] if len(samples) > 2 * WARMUP else samples) * 1e6


def verify_request(step: int, batch: int, first: bool = False, prompt: int = 1) -> pb.VerifyRequest:
    req = pb.VerifyRequest(step=step)
    for j in range(batch):
        req.seqs.add(seq_id=j, new_tokens=pack_ids([TOKEN] * prompt), first=first,
                     draft_tokens=b"" if first else pack_ids([TOKEN] * GAMMA), sampling=pb.SamplingParams())
    return req


# --- bare gRPC ----------------------------------------------------------------------------------
class Echo(pb_grpc.TargetServicer):
    async def Verify(self, request_iterator, context):
        async for req in request_iterator:
            r = pb.VerifyResponse(step=req.step)
            for s in req.seqs:
                r.results.add(seq_id=s.seq_id, accepted=GAMMA, next_token=TOKEN)
            yield r


async def spin() -> None:
    """Keeps the event loop from sleeping in epoll: every iteration polls with a zero timeout."""
    while True:
        await asyncio.sleep(0)


async def serve_echo(port: int, spinning: bool = False) -> None:
    if spinning:
        asyncio.get_running_loop().create_task(spin())
    server = grpc.aio.server()
    pb_grpc.add_TargetServicer_to_server(Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def bare_rtt(address: str, batch: int, steps: int, spinning: bool = False) -> float:
    spinner = asyncio.get_running_loop().create_task(spin()) if spinning else None
    async with grpc.aio.insecure_channel(address) as channel:
        # The echo process may still be starting: a stream opened before it listens ends at once
        # ("RPC already finished" at the first write).
        await asyncio.wait_for(channel.channel_ready(), 30)
        call = pb_grpc.TargetStub(channel).Verify()
        samples = []
        for i in range(steps):
            req = verify_request(i, batch)
            await asyncio.sleep(GAP_S)  # idle between steps, as the servers are (see server_rtt)
            t0 = time.perf_counter()
            await call.write(req)
            await call.read()
            samples.append(time.perf_counter() - t0)
        call.cancel()
    if spinner is not None:
        spinner.cancel()
    return median_us(samples)


# --- the real target server ---------------------------------------------------------------------
async def server_rtt(address: str, batch: int, steps: int, channel: bool = False) -> dict:
    """channel: over the server's step channel (specdec/serving/step_channel.py) instead of gRPC;
    the keys then start with channel_."""
    server = ModelServer("target", address, step_channel=channel)
    await server.info()
    assert server.transport == ("channel" if channel else "grpc")
    await server.step(verify_request(1, batch, first=True, prompt=4), timeout=30)
    rtt, step_s, host_s, serving_s = [], [], [], []
    for i in range(steps):
        req = verify_request(i + 2, batch)
        # The coordinator works between two steps of one server (the other server's step): the
        # server's after-answer accounting is done by then, as in service.
        await asyncio.sleep(GAP_S)
        t0 = time.perf_counter()
        r = await server.step(req, timeout=30)
        rtt.append(time.perf_counter() - t0)
        step_s.append(r.timing.step_seconds)
        host_s.append(r.timing.step_seconds - r.timing.forward_seconds)
        if r.timing.engine_seconds:   # the server's handling around the engine's call
            serving_s.append(r.timing.step_seconds - r.timing.engine_seconds)
        # Keep the sequences short: drop the accepted tokens again by releasing and restarting
        # them every 100 steps (a 4096-token limit otherwise ends the run).
        if i % 100 == 99:
            await server.release(range(batch))
            await server.step(verify_request(0, batch, first=True, prompt=4), timeout=30)
    await server.release(range(batch))
    await server.close()
    prefix = "channel" if channel else "server"
    return {f"{prefix}_rtt_us": median_us(rtt), f"{prefix}_step_us": median_us(step_s),
            f"{prefix}_outside_us": median_us([a - b for a, b in zip(rtt, step_s)]),
            f"{prefix}_host_us": median_us(host_s),
            f"{prefix}_serving_us": median_us(serving_s) if serving_s else None}


# --- the coordinator's loop ---------------------------------------------------------------------
class InstantServer:
    """Answers every step at once: the draft proposes TOKEN x num_draft, the target accepts all.
    delay: seconds each call waits before it answers, as a server's step does: the loop's
    deferred work (statistics, the client streams) runs then; calls records (role, entered, left)."""

    def __init__(self, role: str, delay: float = 0.0, calls: list | None = None):
        self.role, self.delay, self.calls = role, delay, calls

    async def step(self, request, timeout=None, on_sent=None):
        entered = time.perf_counter()
        if on_sent is not None:
            on_sent()  # (a real server's call: written, then the work for its time)
        await asyncio.sleep(0)  # a real call suspends: the client streams drain meanwhile
        while time.perf_counter() - entered < self.delay:
            await asyncio.sleep(0)  # spins: a loop woken from an idle CPU would add its own noise
        if self.calls is not None:
            self.calls.append((self.role, entered, time.perf_counter()))
        if self.role == "draft":
            r = pb.ProposeResponse(step=request.step)
            for s in request.seqs:
                r.results.add(seq_id=s.seq_id, tokens=pack_ids([TOKEN] * s.num_draft))
            return r
        r = pb.VerifyResponse(step=request.step)
        for s in request.seqs:
            r.results.add(seq_id=s.seq_id, accepted=len(s.draft_tokens) // 4, next_token=TOKEN)
        return r

    async def release(self, seq_ids, timeout: float = 5.0):
        return pb.ReleaseResponse()

    def reset(self) -> None:
        pass


def critical_us(calls: list[tuple[str, float, float]]) -> float:
    """The loop's own time per step outside the server calls: from one target call's entry to the
    next, less the time inside the calls made in between (a Propose and a Verify)."""
    entries = [i for i, (role, _, _) in enumerate(calls) if role == "target"]
    outside = []
    for i, j in zip(entries, entries[1:]):
        span = calls[j][1] - calls[i][1]
        outside.append(span - sum(left - entered for _, entered, left in calls[i:j]))
    return median_us(outside)


async def loop_step_us(batch: int, steps: int, delay: float = 0.0) -> float:
    """delay 0: the loop's whole host time per step (every task's work between two chunks of one
    stream); delay > 0: critical_us of servers that take `delay` per call."""
    tok = TextTokenizer(ROOT / "models" / "target")
    sched = Scheduler(batch, batch, KVCapacity("target", 100_000, 16), KVCapacity("draft", 100_000, 16))
    config = CoordinatorConfig(target="-", draft="-", num_draft=GAMMA)
    calls: list = []
    loop = SpecLoop(config, sched, InstantServer("target", delay, calls), InstantServer("draft", delay, calls),
                    CoordinatorMetrics(CollectorRegistry(), max_positions=8), vocab_size=tok.vocab_size,
                    draft_max_len=1 << 20)
    new = (steps + WARMUP) * (GAMMA + 1)
    seqs = [Sequence(seq_id=i, params=GenParams(request_id=str(i), prompt_ids=(1, 2, 3), max_new_tokens=new,
                                                sampling=Sampling()), max_len=1 << 20, tokenizer=tok)
            for i in range(batch)]
    for s in seqs:
        sched.submit(s)
    stamps: list[float] = []

    async def client(seq: Sequence) -> None:
        while True:
            chunk = await seq.queue.get()
            chunk.text  # noqa: B018 -- read as the client stream does (the chunk's text is rendered then)
            if seq is seqs[0]:
                stamps.append(time.perf_counter())
            if getattr(chunk, "finish", None) is not None:
                return

    task = asyncio.create_task(loop.run())
    await asyncio.gather(*(client(s) for s in seqs))
    task.cancel()
    if delay:
        return critical_us(calls)
    return median_us([b - a for a, b in zip(stamps, stamps[1:])])


# --- a server's Python per step -----------------------------------------------------------------
PYTHON_SHAPE = dict(TINY_TARGET, vocab_size=256)  # a vocabulary small enough that the CPU argmax is nothing


def _nothing() -> None:
    pass


class _FreeModel:
    """A model whose forward costs nothing: zero logits for the batch's logit rows (every row
    when the batch asks for all), the same tensor each time."""

    def __init__(self, model):
        self.config, self.vocab, self._zeros = model.config, model.config.vocab_size, {}

    def __call__(self, batch, kv=None, backend=None, out=None):
        if out is not None:
            return out.zero_()
        n = batch.logits_indices.numel()
        if n not in self._zeros:
            import torch
            self._zeros[n] = torch.zeros(n, self.vocab)
        return self._zeros[n]


def server_python_us(role: str, batch: int, steps: int, graphed: bool = False, seen: dict | None = None,
                     ahead: bool = False, parts: dict | None = None) -> float | None:
    """Host microseconds of one step through a servicer's step function (pb request -> engine ->
    pb response: conversion, validation, admission, batch preparation, acceptance, results) with
    the model forward replaced by constant logits: the Python a server adds to a step.
    graphed=False: the CPU path (the runner prepares eager batches and the draft loops over its
    positions). graphed=True: the path a GPU server runs, on tests/helpers' CPU stand-ins for CUDA
    graphs over a model that costs nothing: steps staged into the graphs' static inputs, the
    draft's chains and head graphs, the verify's argmax rows from the graph's output.
    seen: filled with the timed steps' graph replays and eager forwards (what path they took).
    ahead (target): each step staged ahead after the one before (TargetEngine.prepare_ahead,
    --verify-ahead; untimed: the server does it once the answer is out) and the request made the
    step it expects (each sequence's last next token), so what is timed is the step that takes it;
    None where the engine has no prepare_ahead (an older commit in loop_ab).
    parts: filled with the medians (us) of the timed steps' parts, trace_steps.STEP_PARTS (the stamps
    specdec/trace.py makes inside a server's step, here with the step function as the server)."""
    import torch
    from draft_server.servicer import propose
    from specdec.config import EngineConfig
    from specdec.engine.draft import DraftEngine
    from specdec.engine.target import TargetEngine
    from target_server.servicer import verify
    if ahead:
        try:
            from target_server.servicer import expected_next
        except ImportError:   # a commit before --verify-ahead (loop_ab's baseline)
            return None

    folder = write_shape_folder(Path(tempfile.mkdtemp(prefix="hostpath-py-")) / "m", PYTHON_SHAPE, dtype="float32")
    config = EngineConfig(model=folder, random_weights=True, max_model_len=4096, num_blocks=4096)
    engine = (TargetEngine if role == "target" else DraftEngine)(config)
    vocab = PYTHON_SHAPE["vocab_size"]
    if graphed:
        if str(ROOT) not in sys.path:   # tests.helpers, from the checkout this script runs in
            sys.path.insert(0, str(ROOT))
        from tests.helpers.cpu_graphs import CpuGraphs
        engine.runner.model = _FreeModel(engine.runner.model)   # before the graphs take the runner's model
        graphs = engine.runner.graphs = CpuGraphs(engine.runner, max_model_len=config.max_model_len,
                                                  query_lens=engine.graph_query_lens(), batch_sizes=(batch,),
                                                  chains=engine.graph_chains)
        # Replays cost nothing either: on the GPU they are launches of work the device does (the
        # stand-ins would run the chain's and head's input updates as CPU ops).
        for replayed in ([g.graph for g in graphs.graphs.values()] + [c.graph for c in graphs.chains.values()]
                         + list(graphs.heads.values())):
            replayed.replay = _nothing
    else:
        engine.runner.forward = lambda b, argmax=False: (torch.zeros(b.logits_indices.numel(), dtype=torch.int64)
                                                         if argmax else torch.zeros(b.logits_indices.numel(), vocab))
    step_fn = verify if role == "target" else propose
    if ahead and (role != "target" or not hasattr(engine, "prepare_ahead")):
        return None
    nxt = [TOKEN % vocab] * batch    # (ahead) each sequence's next token: the last answer's

    def request(step: int, first: bool):
        ids = pack_ids([5, 6, 7, 8] if first else [TOKEN % vocab])
        if role == "target":
            r = pb.VerifyRequest(step=step)
            for j in range(batch):
                r.seqs.add(seq_id=j, new_tokens=pack_ids([nxt[j]]) if ahead and not first else ids,
                           draft_tokens=b"" if first else pack_ids([0] * GAMMA),
                           sampling=pb.SamplingParams(seed=j), first=first)
        else:
            r = pb.ProposeRequest(step=step)
            for j in range(batch):
                r.seqs.add(seq_id=j, new_tokens=ids, keep=0 if first else GAMMA, num_draft=GAMMA,
                           sampling=pb.SamplingParams(seed=j), first=first)
        return r
    samples = []
    replays = eager = 0
    for i in range(steps):
        if i % 100 == 0:  # short sequences: release and start them again
            engine.release(range(batch))
            first = request(i, True)
            response, _ = step_fn(engine, first)
            if ahead:
                nxt = [r.next_token for r in response.results]
                engine.prepare_ahead([(j, t, GAMMA) for j, t in enumerate(nxt)])   # (the prompt step had no drafts)
            continue
        req = request(i, False)
        r0, e0 = engine.graph_replays, engine.eager_forwards
        t0 = time.perf_counter()
        if parts is None:
            response, _ = step_fn(engine, req)
        else:
            response, _ = _stamped(step_fn, engine, req, role, i)
        samples.append(time.perf_counter() - t0)
        if ahead:
            nxt = [r.next_token for r in response.results]
            engine.prepare_ahead(expected_next(req, response))
        replays += engine.graph_replays - r0
        eager += engine.eager_forwards - e0
        failed = [r.error.message for r in response.results if r.HasField("error")]
        if failed:
            raise RuntimeError(f"{role} step {i} failed: {failed[0]}")
    if seen is not None:
        seen.update(replays=replays, eager=eager, steps=len(samples),
                    **({"ahead_taken": engine.ahead_taken} if ahead else {}))
    if parts is not None:
        parts.update(_stamped_parts())
    return median_us(samples)


def _stamped(step_fn, engine, request, role: str, step: int):
    """step_fn(engine, request) with the trace's stamps of a server's step around and inside it."""
    from specdec import trace
    rpc = "Propose" if role == "draft" else "Verify"
    was, trace.enabled = trace.enabled, True
    trace.begin_step(rpc, step)
    trace.mark("s_parsed", rpc, step)
    try:
        out = step_fn(engine, request)
        trace.mark("s_ready", rpc, step)
        return out
    finally:
        trace.begin_step(None)
        trace.enabled = was


def _stamped_parts() -> dict:
    """The medians (us) of trace_steps.STEP_PARTS over the stamps _stamped made (taken from the
    trace: the next call starts afresh)."""
    from specdec import trace
    from trace_steps import STEP_PARTS
    calls: dict[int, dict] = {}
    for point, _, step, _, t in trace._events:
        calls.setdefault(step, {})[point] = t
    trace._events.clear()
    out = {}
    for name, a, b in STEP_PARTS:
        vals = [c[b] - c[a] for c in calls.values() if a in c and b in c]
        out[f"{name}_us"] = median_us(vals) if vals else None
    return out


def loop_rows(batches: list[int], steps: int) -> list[dict]:
    """The coordinator's loop and the servers' Python per step, per batch size."""
    return [{"batch": b, "loop_step_us": asyncio.run(loop_step_us(b, steps)),
             "loop_critical_us": asyncio.run(loop_step_us(b, steps, delay=SERVER_DELAY_S)),
             "target_python_us": server_python_us("target", b, steps),
             "draft_python_us": server_python_us("draft", b, steps),
             "target_graphed_us": server_python_us("target", b, steps, graphed=True),
             "draft_graphed_us": server_python_us("draft", b, steps, graphed=True),
             "target_ahead_us": server_python_us("target", b, steps, graphed=True, ahead=True)} for b in batches]


def parts_rows(batches: list[int], steps: int) -> list[dict]:
    """The graph path's server Python per step in parts (server_python_us' parts): the draft, and
    the target's step staged ahead (what a GPU target runs), per batch size."""
    rows = []
    for b in batches:
        for role, ahead, label in (("draft", False, "draft"), ("target", True, "target, staged ahead")):
            parts: dict = {}
            total = server_python_us(role, b, steps, graphed=True, ahead=ahead, parts=parts)
            rows.append({"batch": b, "server": label, "total_us": total, **parts})
    return rows


# loop_rows' figures, as loop_ab's table names them
LOOP_FIGURES = {"loop_step_us": "loop", "loop_critical_us": "critical", "target_python_us": "target py",
                "draft_python_us": "draft py", "target_graphed_us": "target graphed py",
                "draft_graphed_us": "draft graphed py", "target_ahead_us": "target staged ahead py"}


def loop_ab(baseline: str, batches: list[int], steps: int, passes: int) -> int:
    """The loop's and the servers' Python figures of this checkout (B) against the commit
    `baseline` (A): A runs from a temporary git worktree of that commit, with this checkout's bench
    scripts copied in (the same measurement over the other code). Each pass runs A and B at the
    same time, one process each (single-threaded: one core each on a 2-core host), so both see the
    host in the same state: on these VMs a process's speed can halve from one run to the next,
    which alternating passes do not cancel. Each pass gives a B / A ratio; the table's ratio is
    their median."""
    with baseline_tree(baseline) as (tree, commit):
        args = ["--loop-only", "--steps", str(steps), "--batches", *map(str, batches)]
        runs: dict[str, list[list[dict]]] = {"A": [], "B": []}
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for i in range(passes):
            sides = [("A", tree), ("B", ROOT)][::1 if i % 2 == 0 else -1]   # who starts first alternates
            procs = {side: subprocess.Popen([sys.executable, str(root / "bench" / "hostpath.py"), *args],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                            cwd=root, env=env) for side, root in sides}
            for side, proc in procs.items():
                out, err = proc.communicate()
                if proc.returncode:
                    raise RuntimeError(f"side {side} failed:\n{err[-2000:]}")
                runs[side].append(json.loads(out.strip().splitlines()[-1]))
            print(f"pass {i + 1}: A {runs['A'][-1]}\n        B {runs['B'][-1]}", flush=True)
    rows = []
    for j, b in enumerate(batches):
        row = {"batch": b}
        for key in LOOP_FIGURES:
            if any(r[j].get(key) is None for side in ("A", "B") for r in runs[side]):
                continue   # a figure one side's code cannot give (the table shows "-")
            for side in ("A", "B"):
                vals = [r[j][key] for r in runs[side]]
                row[f"{key}_{side.lower()}_values"] = vals
                row[f"{key}_{side.lower()}"] = statistics.median(vals)
                row[f"{key}_{side.lower()}_best"] = min(vals)
            row[f"{key}_ratio_values"] = [b / a for a, b in zip(row[f"{key}_a_values"], row[f"{key}_b_values"])]
            row[f"{key}_ratio"] = statistics.median(row[f"{key}_ratio_values"])   # paired, per pass
            row[f"{key}_best_ratio"] = row[f"{key}_b_best"] / row[f"{key}_a_best"]
        rows.append(row)
    result = {"benchmark": "hostpath_loop_ab", "environment": environment(), "baseline": commit,
              "b": "this checkout", "passes": passes, "steps": steps, "gamma": GAMMA, "rows": rows}
    path = write_result("hostpath_loop_ab", result)
    columns = [("batch", "batch", "d")]
    for key, name in LOOP_FIGURES.items():
        columns += [(f"{key}_a", f"{name} us A", ".0f"), (f"{key}_b", f"{name} us B", ".0f"),
                    (f"{key}_ratio", "B/A", ".2f")]
    print(f"A = {commit}, B = this checkout, side by side in each of {passes} passes: medians, and the "
          "median of the passes' B / A")
    print(table(rows, columns))
    print(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--baseline", help="a commit, or a folder with a commit's coordinator, protos, specdec, "
                    "draft_server and target_server (its COMMIT file names it): only the loop's and the "
                    "servers' Python figures, this checkout against that commit in alternating passes "
                    "(writes results/hostpath_loop_ab.json)")
    ap.add_argument("--passes", type=int, default=4, help="with --baseline: passes per side")
    ap.add_argument("--loop-only", action="store_true", help=argparse.SUPPRESS)  # one pass, JSON out
    ap.add_argument("--serve-echo", type=int, help=argparse.SUPPRESS)  # the bare echo process
    ap.add_argument("--spinning", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_echo:
        asyncio.run(serve_echo(a.serve_echo, a.spinning))
        return 0
    if a.loop_only:
        import torch
        torch.set_num_threads(1)  # one core per side (loop_ab runs two at once)
        print(json.dumps(loop_rows(a.batches, a.steps + WARMUP)))
        return 0
    if a.baseline:
        return loop_ab(a.baseline, a.batches, a.steps + WARMUP, a.passes)
    steps = a.steps + WARMUP
    work = Path(tempfile.mkdtemp(prefix="hostpath-"))
    port = free_port()
    echo = subprocess.Popen([sys.executable, __file__, "--serve-echo", str(port)])
    spin_port = free_port()  # the same echo with both event loops spinning instead of sleeping
    spinning_echo = subprocess.Popen([sys.executable, __file__, "--serve-echo", str(spin_port), "--spinning"])
    folder = write_shape_folder(work / "tiny", TINY_TARGET, dtype="float32")
    target = spawn_server("target", folder, work, args=["--random-weights", "--max-model-len", "4096"])
    rows = []
    try:
        wait_healthy(target, 120)
        for b in a.batches:
            row = {"batch": b, "bare_rtt_us": asyncio.run(bare_rtt(f"127.0.0.1:{port}", b, steps)),
                   "bare_rtt_spinning_us": asyncio.run(bare_rtt(f"127.0.0.1:{spin_port}", b, steps, True))}
            row.update(asyncio.run(server_rtt(target.address, b, steps)))
            row.update(asyncio.run(server_rtt(target.address, b, steps, channel=True)))
            row["channel_vs_grpc"] = row["channel_outside_us"] / row["server_outside_us"]
            row["stack_over_bare_us"] = row["server_outside_us"] - row["bare_rtt_us"]
            row.update(loop_rows([b], steps)[0])
            rows.append(row)
            print(row, flush=True)
    finally:
        stop_all([target])
        echo.terminate()
        spinning_echo.terminate()
    parts = parts_rows(a.batches, steps)
    result = {"benchmark": "hostpath", "environment": environment(), "gamma": GAMMA, "steps": a.steps,
              "rows": rows, "server_parts": parts}
    path = write_result("hostpath", result)
    print(table(rows, [("batch", "batch", "d"), ("bare_rtt_us", "bare gRPC RTT us", ".0f"),
                       ("bare_rtt_spinning_us", "spinning loops us", ".0f"),
                       ("server_outside_us", "server RTT - step us", ".0f"),
                       ("channel_outside_us", "same, step channel us", ".0f"),
                       ("channel_vs_grpc", "channel / gRPC", ".2f"),
                       ("stack_over_bare_us", "our stack over bare us", ".0f"),
                       ("server_host_us", "server host in step us", ".0f"),
                       ("server_serving_us", "of it around the engine us", ".0f"),
                       ("loop_step_us", "coordinator loop us/step", ".0f"),
                       ("loop_critical_us", "of it between server calls", ".0f"),
                       ("target_python_us", "target Python us/step", ".0f"),
                       ("draft_python_us", "draft Python us/step", ".0f"),
                       ("target_graphed_us", "same, graph path", ".0f"),
                       ("draft_graphed_us", "draft, graph path", ".0f"),
                       ("target_ahead_us", "target, graph path, staged ahead", ".0f")]))
    from trace_steps import STEP_PARTS
    print("\nthe graph path's server Python in parts (us per step; trace_steps.py's parts; e_wait is only the "
          "copy out here: the stand-in graphs launch nothing)")
    print(table(parts, [("batch", "batch", "d"), ("server", "server", "s"), ("total_us", "step", ".0f")]
                + [(f"{name}_us", name, ".0f") for name, _, _ in STEP_PARTS]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
