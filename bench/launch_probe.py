"""What a CUDA graph's launch costs on the host, and what the graph holds: per captured graph of the
7B target and its draft at batch sizes --batches (every query-length and prefill bucket), the nodes by type
(kernel, memset, memcpy, event, ...), the kernels by name, and the host microseconds of one
replay() (cudaGraphLaunch) on an idle GPU, right after a replay of the same graph.

    python3 bench/launch_probe.py [--batches 1 8]
    python3 bench/launch_probe.py --conditions [--batches 1 8]   # replay() after staging, waits, syncs

Session 34's gaps.py found the b 8 verify graph's replay() at 168 us of host against 72 us for
b 1's, with about as many kernels; this lists what differs. Nodes come from cuda.bindings
(cudaGraphGetNodes, cudaGraphNodeGetType, cuFuncGetName) where torch kept the graph
(keep_graph=True), else from the device ops of one replay under torch.profiler (kernels, memsets,
memcopies); where a lookup fails the row says so. Writes bench/results/launch_probe.json.
H200, session 34 (`results/logs/s34/call8_launch_probe.log`, from this script before its last
edits: its own copy of the launch timing, the draft's chain graphs still in, where it aborted):
every 7B graph was kernels only (266 at b 1 up to 16 tokens, 329 above; 234 at b 8 up to 2 tokens,
297 above) and launched in 65-153 us with no order by size (b 1 q 5 133 us, b 8 q 5 138): ~0.25-0.5
us a node. The script as it is has not run on a GPU yet.

Each graph's row also has, from 10 replays under torch.profiler (launch_gaps), the launch call's
host time there, when its first device op started and when its last ended, all from the call's
start: whether the GPU waits for a whole graph to be submitted before it starts (session 38: a
draft step as one graph of every position lost to a graph per position launched in turn).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

from common import environment, table, write_result

import torch  # noqa: E402


def graph_ops(graph: torch.cuda.CUDAGraph) -> tuple[dict, dict, str | None]:
    """graph_nodes where the graph can be read, else the device ops of one replay under
    torch.profiler: ({"kernel" / "memset" / "memcpy": count}, {name: count}, None)."""
    kinds, names, problem = graph_nodes(graph)
    if kinds:
        return kinds, names, problem
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kinds, names = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        kinds["memset" if name.startswith("Memset") else "memcpy" if name.startswith("Memcpy") else "kernel"] += 1
        names[name] += 1
    return dict(kinds), dict(names), f"from a profiled replay ({problem})"


def graph_nodes(graph: torch.cuda.CUDAGraph) -> tuple[dict, dict, str | None]:
    """({node type: count}, {kernel name: count}, error): the nodes of a captured graph (torch
    keeps the cudaGraph_t only for graphs made with keep_graph=True)."""
    try:
        graph.raw_cuda_graph()
    except RuntimeError as e:
        return {}, {}, str(e)[:80]
    try:
        from cuda.bindings import driver, runtime
    except ImportError as e:
        return {}, {}, f"cuda.bindings: {e}"
    handle = runtime.cudaGraph_t(init_value=graph.raw_cuda_graph())
    err, _, n = runtime.cudaGraphGetNodes(handle, 0)
    if err != runtime.cudaError_t.cudaSuccess:
        return {}, {}, f"cudaGraphGetNodes: {err}"
    err, nodes, n = runtime.cudaGraphGetNodes(handle, n)
    kinds: collections.Counter = collections.Counter()
    names: collections.Counter = collections.Counter()
    problem = None
    for node in nodes:
        err, kind = runtime.cudaGraphNodeGetType(node)
        kind_name = str(kind).split(".")[-1].replace("cudaGraphNodeType", "")
        kinds[kind_name] += 1
        if kind != runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel:
            continue
        try:
            err, params = runtime.cudaGraphKernelNodeGetParams(node)
            err, name = driver.cuFuncGetName(driver.CUfunction(init_value=int(params.func)))
            names[name.decode() if isinstance(name, bytes) else str(name)] += 1
        except Exception as e:  # the name is a nicety: the counts by type stand without it
            problem = problem or f"kernel names: {type(e).__name__}: {e}"
            names["?"] += 1
    return dict(kinds), dict(names), problem


_ONES = torch.ones(1024)


def launch_gaps(events: list[tuple[str, float, float]]) -> list[dict]:
    """Per graph launch in a profiled run: how long the launch call took on the host, and when the
    device started and ended the graph's work, in us from the call's start. events: (kind, start,
    end) in one time base (torch.profiler's: CUPTI aligns host and device), kind "launch" for a
    cudaGraphLaunch call and "device" for a device op; a launch's device ops are those that start
    after it and before the next launch (replays are synchronised in between). A first op that
    starts about when the call returns says the GPU waited for the whole graph to be submitted; one
    that starts well before, that the launch streams its nodes while the GPU runs the first ones."""
    launches = sorted((s, e) for kind, s, e in events if kind == "launch")
    device = sorted((s, e) for kind, s, e in events if kind == "device")
    out = []
    for i, (start, end) in enumerate(launches):
        until = launches[i + 1][0] if i + 1 < len(launches) else float("inf")
        ops = [(s, e) for s, e in device if start <= s < until]
        if not ops:
            continue
        out.append({"launch_call_us": end - start, "first_op_us": ops[0][0] - start,
                    "last_op_end_us": max(e for _, e in ops) - start, "ops": len(ops)})
    return out


def first_op_delay(graph: torch.cuda.CUDAGraph, reps: int = 10) -> dict:
    """launch_gaps' medians over `reps` profiled replays of `graph`, each on an idle GPU (the
    profiler's own callbacks make each launch call somewhat longer than unprofiled)."""
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
            torch.cuda.synchronize()
    events = []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            events.append(("device", *span))
        elif e.name == "cudaGraphLaunch":
            events.append(("launch", *span))
    gaps = launch_gaps(events)
    if not gaps:
        return {}
    return {k: statistics.median(g[k] for g in gaps) for k in ("launch_call_us", "first_op_us", "last_op_end_us")}


def _spin(us: float) -> None:
    until = time.perf_counter() + us * 1e-6
    while time.perf_counter() < until:
        pass


# What runs on the host between the last sync and a graph's replay() (conditions()): the staging
# of the step's inputs (a pinned host-to-device copy) or not, then a wait of some kind or none.
CONDITIONS = {
    "staged": lambda stage, sync: stage(),  # (each takes an `other` too where it names it)
    "staged, spin 50 us": lambda stage, sync: (stage(), _spin(50)),
    "staged, spin 300 us": lambda stage, sync: (stage(), _spin(300)),
    "staged, synchronize": lambda stage, sync: (stage(), sync()),
    "tolist, staged": lambda stage, sync: (_ONES.cuda().sum().tolist(), stage()),
    # as a step reads its forward's result: the argmax of the last replay's logits, by tolist
    "own argmax, tolist, staged": lambda stage, sync, own: (own(), stage()),
    # and as in back-to-back steps: the same graph replayed, its argmax read, the next staged
    "own replay, argmax, tolist, staged": lambda stage, sync, own: (own(True), stage()),
    # as in a speculative step: the other server's forward ran last, its result read by tolist
    "other's replay, tolist, staged": lambda stage, sync, other: (other(), _ONES.cuda().sum().tolist(), stage()),
    "other's replay, synchronize, staged": lambda stage, sync, other: (other(), sync(), stage()),
    "not staged": lambda stage, sync: None,
    "not staged, event recorded": lambda stage, sync: torch.cuda.Event().record(),
}


def conditions(engine, items_of, b: int, q: int, other, reps: int = 20) -> list[dict]:
    """Host us of the replay() of bucket (b, q) after each of CONDITIONS, each rep starting on an
    idle GPU (synchronize), and the wall us from the condition's start until the replay's work is
    done (synchronize): what the step's critical path pays for staging + launch + the forward.
    items_of(): the b sequences' SeqInputs of q tokens (their KV grows by q each prepare; cut
    back after each rep). other(): a replay of the other engine's graph."""
    runner = engine.runner
    rows = []
    for name, before in CONDITIONS.items():
        host, wall = [], []
        for i in range(reps + 2):
            items = items_of()
            lens = [runner.num_tokens(it.seq_id) for it in items]
            batch = runner.prepare(items)          # staged once outside the timing for "not staged"
            if batch.graph_key is None:
                return []
            g = runner.graphs.staged_graph(batch)
            torch.cuda.synchronize()
            restage = lambda: runner.graphs.staged_graph(runner.prepare(  # noqa: E731
                [type(it)(it.seq_id, it.token_ids, it.num_logits) for it in items_after_cut(runner, items, lens)]))
            t0 = time.perf_counter()
            staged = {}
            args = (lambda: staged.setdefault("g", restage()), torch.cuda.synchronize)
            if "own" in name:
                before(*args, lambda replay=False: (replay and g.graph.replay(), g.logits.argmax(-1).tolist()))
            else:
                before(*args, other) if "other" in name else before(*args)
            graph = staged.get("g", g).graph
            t1 = time.perf_counter()
            graph.replay()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            for it, n in zip(items, lens):
                runner.truncate(it.seq_id, n)
            if i >= 2:
                host.append(t2 - t1)
                wall.append(t3 - t0)
        rows.append({"batch": b, "query_len": q, "condition": name,
                     "launch_us": 1e6 * statistics.median(host), "wall_us": 1e6 * statistics.median(wall)})
    return rows


def items_after_cut(runner, items, lens):
    """items again, after cutting each sequence back to its length before the first prepare."""
    for it, n in zip(items, lens):
        runner.truncate(it.seq_id, n)
    return items


def main_conditions(a) -> int:
    from anatomy import Loop, PROMPT, engines
    from services import write_shape_folder
    from specdec.runner import SeqInput
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t_dir = write_shape_folder(Path(tmp) / "target", a.target)
        d_dir = write_shape_folder(Path(tmp) / "draft", a.draft)
        draft, target = engines(t_dir, d_dir, a.agreement, PROMPT + 256, a.k, "cuda", a.batches, None)
    for i, b in enumerate(a.batches):
        loop = Loop(draft, target, b, a.k, seed=i)
        for _ in range(4):
            loop.spec()
        graph = lambda engine, q: engine.runner.graphs.graphs[(b, q)].graph  # noqa: E731
        for role, engine, q, other in (("target", target, a.k + 1, graph(draft, 1)), ("target", target, 1, graph(draft, 1)),
                                       ("draft", draft, 1, graph(target, a.k + 1))):
            got = conditions(engine, lambda: [SeqInput(s, [1] * q, q) for s in loop.ids], b, q, other.replay)
            rows += [{"role": role, **r} for r in got]
            for r in got:
                print(f"{role} b {b} q {q} {r['condition']}: launch {r['launch_us']:.1f} us, "
                      f"wall {r['wall_us']:.1f} us", flush=True)
        loop.close()
    write_result("launch_probe", {"benchmark": "launch_probe", "mode": "conditions", "environment": environment(),
                                  "target": a.target, "draft": a.draft, "rows": rows})
    print(table(rows, [("role", "role", "s"), ("batch", "b", "d"), ("query_len", "q", "d"),
                       ("condition", "before replay()", "s"), ("launch_us", "replay() us", ".1f"),
                       ("wall_us", "wall us", ".1f")]))
    return 0


def main() -> int:
    from anatomy import PROMPT, engines, pair_args
    from gaps import launch_after
    from services import write_shape_folder
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_args(p, steps=4)
    p.add_argument("--conditions", action="store_true",
                   help="instead: replay() host time after staging, waits and syncs (conditions())")
    a = p.parse_args()
    if a.conditions:
        return main_conditions(a)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t_dir = write_shape_folder(Path(tmp) / "target", a.target)
        d_dir = write_shape_folder(Path(tmp) / "draft", a.draft)
        draft, target = engines(t_dir, d_dir, a.agreement, PROMPT + 256, a.k, "cuda", a.batches, None)
        for role, engine in (("target", target), ("draft", draft)):
            graphs = engine.runner.graphs
            # (not the draft's chain and head graphs: a replay of those on inputs nobody staged
            # indexes out of bounds, session 34's second call)
            captured = [((b, q), g.graph) for (b, q), g in sorted(graphs.graphs.items())]
            for (b, q), graph in captured:
                if b not in a.batches:
                    continue
                kinds, names, problem = graph_ops(graph)
                rows.append({"role": role, "batch": b, "query_len": q, "nodes": sum(kinds.values()),
                             "kinds": kinds, "kernels": names, "names_error": problem,
                             # replay() on an idle GPU right after a replay of the same graph
                             "launch_us": launch_after({"self": graph}, engine.runner.device, reps=30)[0]["launch_us"],
                             # under the profiler: when the GPU starts the graph, against the launch call
                             **first_op_delay(graph)})
                top = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
                print(f"{role} b {b} q {q}: {rows[-1]['nodes']} nodes ({top}), launch "
                      f"{rows[-1]['launch_us']:.1f} us, profiled: call {rows[-1].get('launch_call_us', float('nan')):.1f} "
                      f"us, first op at {rows[-1].get('first_op_us', float('nan')):.1f} us"
                      + (f" [{problem}]" if problem else ""), flush=True)
    write_result("launch_probe", {"benchmark": "launch_probe", "environment": environment(),
                                  "target": a.target, "draft": a.draft, "rows": rows})
    print(table([{**r, "top": ", ".join(f"{n[:28]} {c}" for n, c in sorted(r["kernels"].items(),
                                                                          key=lambda kv: -kv[1])[:4])}
                 for r in rows],
                [("role", "role", "s"), ("batch", "b", "d"), ("query_len", "q", "d"), ("nodes", "nodes", "d"),
                 ("launch_us", "launch us", ".1f"), ("launch_call_us", "profiled call us", ".1f"),
                 ("first_op_us", "first op at us", ".1f"), ("last_op_end_us", "last op ends us", ".1f"),
                 ("top", "kernels (most)", "s")]))
    kernel_names = sorted({n for r in rows for n in r["kernels"]})
    print("kernels per graph:")
    print(table([{"kernel": n[:60], **{f"{r['role'][0]}{r['batch']}x{r['query_len']}": r["kernels"].get(n, 0)
                                        for r in rows}} for n in kernel_names],
                [("kernel", "kernel", "s")] + [(f"{r['role'][0]}{r['batch']}x{r['query_len']}",
                                                 f"{r['role'][0]}{r['batch']}x{r['query_len']}", "d") for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
