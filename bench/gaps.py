"""Where the GPU waits during speculative steps, and what the host is doing meanwhile.

    python3 bench/gaps.py [--target llama-7b] [--draft llama-68m] [--batches 1 8] [--k 4] [--steps 16]

The draft and target engines in one process (anatomy.py's engines and loop, no gRPC) run
speculative steps under torch.profiler. Engine methods are wrapped in named ranges (WRAPPED); from
the trace, per step: the GPU's busy time (the union of kernels, copies and memsets), its idle
time, and each idle microsecond charged to the innermost named range open on the host at that
moment ("(none)": between ranges, e.g. the loop's own Python). Session 18's anatomy had a
speculative step at b 8 take 6.7 ms in process for ~4.9 ms of device work, and the target's forward
span 0.2-0.4 ms longer than its prepare plus a replay; this says which host work the GPU waits on.
Medians per step over --steps steps. Writes bench/results/gaps.json (and keeps the Chrome trace of
the first batch size in bench/results/gaps_trace_b<B>.json.gz with --keep-trace).
Without the profiler (session 35): every CUDAGraph.replay() timed on the host by graph, and by
whether the stream had work queued (launch_split_steps; `--launch-variants`: for plain steps too),
and a CUDA-event timeline of bare steps (event_timeline_steps: the GPU-idle host work before each
launch, each launch's span, the work after the last replay), both printed as tables.
`--compare A=a1.json B=b1.json A=a2.json ...` runs nothing: it prints the bare host splits of
earlier results side by side (medians per label, ratios to the first label); `gpu_suite.sh gaps-ab`
runs gaps.py over another commit's packages and this tree in turn and compares them so.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import ROOT, environment, table, write_result

import torch  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")   # Chrome-trace categories of device activity
STEP = "spec_step"
# (label, module, class, method): the ranges each step is cut into.
WRAPPED = [
    ("draft.propose", "specdec.engine.draft", "DraftEngine", "propose"),
    ("target.verify", "specdec.engine.target", "TargetEngine", "verify"),
    ("admit_step", "specdec.engine.base", "ModelEngine", "admit_step"),
    ("draft._draft", "specdec.engine.draft", "DraftEngine", "_draft"),
    ("draft._to_host", "specdec.engine.draft", "DraftEngine", "_to_host"),
    ("target._score", "specdec.engine.target", "TargetEngine", "_score"),
    ("runner.prepare", "specdec.runner", "ModelRunner", "prepare"),
    ("graphs.stage", "specdec.cuda_graphs", "GraphedForward", "stage"),
    ("graphs.replay", "specdec.cuda_graphs", "GraphedForward", "_replay_staged"),
    ("graphs.chain", "specdec.cuda_graphs", "GraphedForward", "chain"),
    ("runner.greedy_chain", "specdec.runner", "ModelRunner", "greedy_chain"),
    ("graphs.head_chain", "specdec.cuda_graphs", "GraphedForward", "head_chain"),
    ("runner.fed_chain", "specdec.runner", "ModelRunner", "fed_chain"),
]


# Finer host ranges for the bare split only: the graph launch itself, the pinning and the packed
# copy a stage makes, the logits a replay hands back.
SPLIT_EXTRA = [
    ("cuda.launch", "torch.cuda", "CUDAGraph", "replay"),
    ("pin_memory", "torch", "Tensor", "pin_memory"),
    ("packed.fill", "specdec.staging", "PackedBuffer", "fill"),
    ("graphs.outputs", "specdec.cuda_graphs", "GraphedForward", "_outputs"),
]
# The host's blocking waits for the device (the bare breakdown's "wait"): a step's results come
# to the host through tolist; the clock's event synchronize follows it (nothing left to wait for).
WAITS = [
    ("wait", "torch", "Tensor", "tolist"),
    ("wait", "torch.cuda", "Event", "synchronize"),
]


@contextlib.contextmanager
def wrapped(specs=WRAPPED, scope=None):
    """Each method runs inside scope(label) for the block's duration (default
    torch.profiler.record_function); methods the class lacks are left out. A method a class
    inherits (not in its own __dict__) is wrapped on the class and the override removed afterwards."""
    import importlib
    scope = scope or torch.profiler.record_function
    saved = []
    try:
        for label, module, cls_name, method in specs:
            cls = getattr(importlib.import_module(module), cls_name)
            if not hasattr(cls, method):   # another commit's code (gaps-ab) may not have it
                continue
            own = method in cls.__dict__
            original = cls.__dict__[method] if own else getattr(cls, method)

            def make(fn, name):
                @functools.wraps(fn)
                def inner(*args, **kwargs):
                    with scope(name):
                        return fn(*args, **kwargs)
                return inner
            if isinstance(original, staticmethod):
                setattr(cls, method, staticmethod(make(original.__func__, label)))
            else:
                setattr(cls, method, make(original, label))
            saved.append((cls, method, original if own else None))
        yield
    finally:
        for cls, method, original in reversed(saved):
            if original is None:
                delattr(cls, method)
            else:
                setattr(cls, method, original)


class HostSplit:
    """Exclusive host time per label (a range's time minus that of the ranges opened inside it),
    from perf_counter alone: no profiler, no device events. Use as `scope` of wrapped()."""

    def __init__(self):
        self.exclusive: dict[str, float] = {}
        self._children: list[float] = []   # per open range: time spent in ranges opened inside it

    @contextlib.contextmanager
    def __call__(self, label: str):
        t0 = time.perf_counter()
        self._children.append(0.0)
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            inside = self._children.pop()
            self.exclusive[label] = self.exclusive.get(label, 0.0) + took - inside
            if self._children:
                self._children[-1] += took

    def take(self) -> dict[str, float]:
        """The exclusive seconds so far, reset."""
        out, self.exclusive = self.exclusive, {}
        return out


def host_split_steps(loop, steps: int) -> dict:
    """Bare speculative steps (no profiler) cut into the host's exclusive time per wrapped range,
    "wait" (blocked in tolist / an event synchronize: the GPU still working) and "(loop)" (the loop's
    own Python between the engine calls); medians in us per step, and the step's wall time. The
    host time outside "wait" is what the GPU can wait on: at b 1 a step's device work is serial
    behind it."""
    split = HostSplit()
    per: list[dict[str, float]] = []
    with wrapped(WRAPPED + SPLIT_EXTRA + WAITS, scope=split):
        for _ in range(steps):
            with split("(loop)"):
                loop.spec()
            per.append(split.take())
    labels = sorted({k for s in per for k in s})
    med = {k: 1e6 * statistics.median(s.get(k, 0.0) for s in per) for k in labels}
    step_us = 1e6 * statistics.median(sum(s.values()) for s in per)
    host_us = 1e6 * statistics.median(sum(v for k, v in s.items() if k != "wait") for s in per)
    return {"step_us": step_us, "host_us": host_us, "exclusive_us": med}


def graph_names(engines: dict) -> dict[int, str]:
    """id(CUDAGraph) -> "role kind bucket" for every graph of each engine's runner (every context
    bound's set: the same name for a bucket in each, as a step picks its set by context)."""
    names = {}
    for role, engine in engines.items():
        graphs = engine.runner.graphs
        for s in getattr(graphs, "sets", [graphs] if graphs is not None else []):
            for (b, q), g in s.graphs.items():
                names[id(g.graph)] = f"{role} {'decode' if q == 1 else 'q' + str(q)} b{b}"
            for kind, table_ in (("chain", s.chains), ("sampled chain", s.sampled_chains), ("head", s.heads)):
                for b, g in table_.items():
                    names[id(getattr(g, "graph", g))] = f"{role} {kind} b{b}"
    return names


def launch_split_steps(step, steps: int, names: dict[int, str]) -> list[dict]:
    """Bare steps (step(): e.g. an anatomy.Loop's spec) with every CUDAGraph.replay() call timed on the host, by graph, and
    whether the stream still had work queued when it was called (busy: the launch queues behind
    it; idle: the GPU waits on this call). Per graph name: launches a step, median us a launch
    by idle / busy stream, and us a step (medians over the steps). Where a step's host time in
    cuda.launch goes, graph by graph (gaps' host split has it as one sum)."""
    calls: list[tuple[str, bool, float]] = []

    def timed(replay, graph):
        busy = not torch.cuda.current_stream().query()
        t0 = time.perf_counter()
        replay(graph)
        calls.append((names.get(id(graph), "?"), busy, time.perf_counter() - t0))

    per: list[list[tuple[str, bool, float]]] = []
    with replays_through(timed):
        for _ in range(steps):
            step()
            per.append(calls[:])
            calls.clear()
    return launch_rows(per)


@contextlib.contextmanager
def replays_through(fn):
    """Every CUDAGraph.replay() of the block goes through fn(replay, graph), which calls replay(graph)."""
    original = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = lambda graph: fn(original, graph)
    try:
        yield
    finally:
        torch.cuda.CUDAGraph.replay = original


@contextlib.contextmanager
def _no_clock_events():
    """The engines' ForwardClock without CUDA events (every forward timed 0): whether the two timing
    events a forward records (made new each step) change what a graph launch costs."""
    from specdec.engine.timing import ForwardClock
    forward, seconds = ForwardClock.forward, ForwardClock.seconds

    @contextlib.contextmanager
    def untimed(self, count: int = 1):
        yield
        self._host.append((0.0, count))
    ForwardClock.forward = untimed
    ForwardClock.seconds = lambda self: [0.0 for _, n in self._host for _ in range(n)]
    try:
        yield
    finally:
        ForwardClock.forward, ForwardClock.seconds = forward, seconds


@contextlib.contextmanager
def _gc_off():
    import gc
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# --launch-variants: plain steps as they are, and with one thing taken away.
PLAIN_VARIANTS = {"plain steps": contextlib.nullcontext, "plain, no clock events": _no_clock_events,
                  "plain, gc off": _gc_off}


def launch_rows(per: list[list[tuple[str, bool, float]]]) -> list[dict]:
    """launch_split_steps' rows from its steps' (graph, stream busy, seconds) calls: per graph,
    launches a step and us a step (medians over the steps, 0 in a step without it), and the
    median us of a launch on an idle and on a busy stream with how many there were."""
    rows = []
    for name in sorted({c[0] for step in per for c in step}):
        mine = [[c for c in step if c[0] == name] for step in per]
        row = {"graph": name, "per_step": statistics.median(len(m) for m in mine),
               "us_per_step": 1e6 * statistics.median(sum(c[2] for c in m) for m in mine)}
        for state, flag in (("idle", False), ("busy", True)):
            took = [c[2] for m in mine for c in m if c[1] == flag]
            row[f"{state}_n"] = len(took)
            row[f"{state}_us"] = 1e6 * statistics.median(took) if took else None
        rows.append(row)
    return rows


def event_timeline_steps(loop, steps: int, names: dict[int, str]) -> list[dict]:
    """Bare speculative steps with a CUDA event recorded where each engine call begins and ends
    and just before and after each CUDAGraph.replay() call. An event recorded while the stream is
    idle completes when it is recorded; one recorded after a replay, when the replay's work is done.
    So the time between consecutive events is GPU-idle host work (propose> -> replay>: what the
    draft does before its first launch), or a launch's exposure plus the graph's device time
    (replay> -> replay<), or queued device time (replay< -> replay<). Per segment (label of its
    two ends, in step order): median us over the steps. Adds ~3 us of host time per event."""
    stream = torch.cuda.current_stream()
    marks: list[tuple[str, torch.cuda.Event]] = []

    def mark(label: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        marks.append((label, e))

    @contextlib.contextmanager
    def marked(label: str):
        mark(f"{label}>")
        yield
        mark(f"{label}<")

    def timed(replay, graph):
        name = names.get(id(graph), "?")
        mark(f"replay> {name}")
        replay(graph)
        mark(f"replay< {name}")

    calls = [("propose", "specdec.engine.draft", "DraftEngine", "propose"),
             ("verify", "specdec.engine.target", "TargetEngine", "verify")]
    per: list[list[tuple[str, float]]] = []
    with replays_through(timed), wrapped(calls, scope=marked):
        for _ in range(steps):
            with marked("step"):
                loop.spec()
            marks[-1][1].synchronize()
            t0 = marks[0][1]
            per.append([(label, 1e3 * t0.elapsed_time(e)) for label, e in marks])
            marks.clear()
    return segments(per)


def segments(per: list[list[tuple[str, float]]]) -> list[dict]:
    """Per step its marks (label, us since the step's first mark), in order: the median us
    between each two consecutive marks, by position, over the steps that took the most common
    path (the same sequence of labels: a draft step may chain from a head graph or not; the
    first such path on a tie), then the whole step (first mark to last) with how many steps."""
    shapes = [tuple(label for label, _ in p) for p in per]
    shape = max(dict.fromkeys(shapes), key=shapes.count)
    same = [p for p, sh in zip(per, shapes) if sh == shape]
    rows = []
    for i in range(1, len(shape)):
        rows.append({"segment": f"{shape[i - 1]} -> {shape[i]}",
                     "us": statistics.median(p[i][1] - p[i - 1][1] for p in same)})
    rows.append({"segment": f"step ({shape[0]} -> {shape[-1]})",
                 "us": statistics.median(p[-1][1] - p[0][1] for p in same), "steps": len(same)})
    return rows


def trace_events(trace: dict) -> tuple[list[tuple[float, float, str]], list[tuple[str, float, float]]]:
    """(device intervals, host ranges) of a Chrome trace: (start, end, name) in us of every kernel,
    copy and memset; (name, start, end) of every record_function range on the host."""
    device, host = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if e.get("cat") in GPU_CATS:
            device.append((start, end, e.get("name", "?")))
        elif e.get("cat") == "user_annotation":
            host.append((e["name"], start, end))
    return device, host


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def attribute(window: tuple[float, float], device: list[tuple[float, float, str]],
              ranges: list[tuple[str, float, float]]) -> dict:
    """Within `window`: device busy time, idle time, and the idle time charged to the innermost
    (shortest) host range open at each instant ("(none)" where none is). Times in us. `waits`: each
    idle gap between two device ops (not the window's edges) as (us, label, the op that ended it
    began, the op that ends it), label the range charged most of it: what the GPU waited between."""
    w0, w1 = window
    busy = [(max(s, w0), min(e, w1)) for s, e in merge([(s, e) for s, e, _ in device]) if e > w0 and s < w1]
    idle, t = [], w0
    for s, e in busy:
        if s > t:
            idle.append((t, s))
        t = max(t, e)
    if t < w1:
        idle.append((t, w1))
    inside = [(n, max(s, w0), min(e, w1)) for n, s, e in ranges if e > w0 and s < w1]
    ended = {e: n for s, e, n in sorted(device, key=lambda d: d[1] - d[0])}   # the longest op ending there
    began = {s: n for s, e, n in sorted(device, key=lambda d: d[1] - d[0])}
    charged: dict[str, float] = {}
    waits = []
    for g0, g1 in idle:
        cuts = sorted({g0, g1} | {x for _, s, e in inside for x in (s, e) if g0 < x < g1})
        mine: dict[str, float] = {}
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            open_ = [(e - s, n) for n, s, e in inside if s <= mid < e]
            label = min(open_)[1] if open_ else "(none)"
            mine[label] = mine.get(label, 0.0) + (b - a)
        for label, us in mine.items():
            charged[label] = charged.get(label, 0.0) + us
        if g0 in ended and g1 in began:
            waits.append((g1 - g0, max(mine, key=mine.get), ended[g0], began[g1]))
    return {"window_us": w1 - w0, "busy_us": sum(e - s for s, e in busy),
            "idle_us": sum(e - s for s, e in idle), "idle_by_range_us": charged, "waits": waits}


def per_step(trace: dict) -> list[dict]:
    """attribute() for each STEP range of the trace, in time order."""
    device, host = trace_events(trace)
    steps = sorted((s, e) for n, s, e in host if n == STEP)
    ranges = [r for r in host if r[0] != STEP]
    return [attribute(w, device, ranges) for w in steps]


def short(name: str, width: int = 36) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def summarize(steps: list[dict], top: int = 10) -> dict:
    """Medians per step: window, busy, idle, and idle per range (0 where a step had none); `waits`:
    the `top` (range, after, before) kinds of gap by idle time per step, with gaps per step."""
    labels = sorted({k for s in steps for k in s["idle_by_range_us"]})
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    kinds: dict[tuple[str, str, str], list[float]] = {}
    for s in steps:
        for us, label, after, before in s.get("waits", []):
            kinds.setdefault((label, short(after), short(before)), []).append(us)
    n = max(1, len(steps))
    waits = sorted(({"range": k[0], "after": k[1], "before": k[2], "us_per_step": sum(v) / n,
                     "gaps_per_step": len(v) / n, "median_gap_us": statistics.median(v)}
                    for k, v in kinds.items()), key=lambda w: -w["us_per_step"])[:top]
    return {"steps": len(steps), "window_us": med([s["window_us"] for s in steps]),
            "busy_us": med([s["busy_us"] for s in steps]), "idle_us": med([s["idle_us"] for s in steps]),
            "idle_by_range_us": {k: med([s["idle_by_range_us"].get(k, 0.0) for s in steps]) for k in labels},
            "waits": waits}


def bare_steps(loop, steps: int) -> dict:
    """Speculative steps without the profiler or any wrapping, medians in us: the step's wall time
    (how much the trace's instrumentation stretches the steps above), and per engine call (the
    draft's propose, the target's verify) its wall time, its forwards' device time by the engine's
    own clock, and the rest: the host time of the call with no gRPC around it, the in-process
    counterpart of e2e.py's "draft host" / "target host" (server step minus forwards)."""
    times, calls = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        calls.append(loop.spec())
        times.append((time.perf_counter() - t0) * 1e6)
    out = {"step_us": statistics.median(times)}
    for role in ("draft", "target"):
        wall = [c[f"{role}_wall"] for c in calls]
        fwd = [c[f"{role}_fwd"] for c in calls]
        out[f"{role}_wall_us"] = 1e6 * statistics.median(wall)
        out[f"{role}_fwd_us"] = 1e6 * statistics.median(fwd)
        out[f"{role}_host_us"] = 1e6 * statistics.median(w - f for w, f in zip(wall, fwd))
    return out


IDLE_US = (0, 100, 300, 1000, 3000)


def replay_after_idle(graph, device, idle_us=IDLE_US, reps: int = 15) -> dict[int, float]:
    """Median device ms of one replay started after the GPU sat idle for each of idle_us
    (anatomy.timed_launch): whether a step's forward runs slower after the host work and
    transport that idle the GPU between steps (clocks or power states coming back up), against
    idle 0 (launched right after the synchronize)."""
    from anatomy import timed_launch
    return {us: timed_launch(graph, device, reps, idle_us=us)[1] for us in idle_us}


def launch_after(graphs: dict, device, reps: int = 15) -> list[dict]:
    """Host us of a graph's replay() call (cudaGraphLaunch) started on an idle GPU, right after a
    replay of itself and right after one of each other graph (each pair: replay the first,
    synchronize, time the second's launch, synchronize): whether launching a graph costs more
    when another graph ran last, as every graph does in a speculative step."""
    rows = []
    for name, g in graphs.items():
        for prev_name, prev in graphs.items():
            took = []
            for _ in range(reps):
                prev.replay()
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                g.replay()
                took.append(time.perf_counter() - t0)
                torch.cuda.synchronize(device)
            rows.append({"graph": name, "after": prev_name, "launch_us": 1e6 * statistics.median(took)})
    return rows


def profile_steps(loop, steps: int) -> dict:
    """A Chrome trace (as a dict) of `steps` speculative steps of an anatomy.Loop."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with wrapped(), profile(activities=acts) as prof:
        for _ in range(steps):
            with torch.profiler.record_function(STEP):
                loop.spec()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def compare(runs: list[tuple[str, dict]]) -> list[dict]:
    """Bare host splits of several gaps.json results side by side: per (batch, range) the median
    over each label's runs of the range's exclusive us a step (the step and the host time outside
    waits as ranges too), and each label's ratio to the first label's. runs: (label, result) in
    the order the labels should appear (an A/B: runs of one code alternating with another's)."""
    labels = list(dict.fromkeys(label for label, _ in runs))
    values: dict[tuple[int, str], dict[str, list[float]]] = {}
    for label, result in runs:
        for r in result["rows"]:
            split = r["host_split"]
            ranges = {**split["exclusive_us"], "step": split["step_us"], "host outside wait": split["host_us"]}
            for name, us in ranges.items():
                values.setdefault((r["batch"], name), {}).setdefault(label, []).append(us)
    rows = []
    for (batch, name), by in sorted(values.items(), key=lambda kv: (kv[0][0], -max(max(v) for v in kv[1].values()))):
        row = {"batch": batch, "range": name, **{lab: statistics.median(by[lab]) if lab in by else None for lab in labels}}
        base = row[labels[0]]
        for lab in labels[1:]:
            row[f"{lab}/{labels[0]}"] = row[lab] / base if base and row[lab] is not None else None
        rows.append(row)
    return rows


def main_compare(specs: list[str]) -> int:
    runs = []
    for spec in specs:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--compare takes LABEL=PATH, got {spec!r}")
        runs.append((label, json.loads(Path(path).read_text())))
    rows = compare(runs)
    labels = list(dict.fromkeys(label for label, _ in runs))
    n = {lab: sum(1 for label, _ in runs if label == lab) for lab in labels}
    print("host us a speculative step without the profiler, exclusive per range: median over each side's runs "
          + ", ".join(f"{lab} ({n[lab]} runs)" for lab in labels))
    print(table(rows, [("batch", "b", "d"), ("range", "range", "s")] + [(lab, lab, ".0f") for lab in labels]
                + [(f"{lab}/{labels[0]}", f"{lab}/{labels[0]}", ".2f") for lab in labels[1:]]))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs="+", metavar="LABEL=PATH",
                   help="no run: the bare host splits of earlier gaps.json results side by side")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (no device events)")
    p.add_argument("--keep-trace", action="store_true")
    p.add_argument("--launch-variants", action="store_true",
                   help="also the replay() split for plain steps (the target alone)")
    from anatomy import pair_args
    pair_args(p, steps=16)
    a = p.parse_args()
    if a.compare:
        return main_compare(a.compare)
    from anatomy import Loop, PROMPT, engines
    from services import write_shape_folder
    # 4 warm-up steps, then three runs of --steps: bare, split, profiled
    max_len = PROMPT + (3 * a.steps + 8) * (a.k + 1) + 64
    with tempfile.TemporaryDirectory() as tmp:
        t_dir = write_shape_folder(Path(tmp) / "target", a.target)
        d_dir = write_shape_folder(Path(tmp) / "draft", a.draft)
        draft, target = engines(t_dir, d_dir, a.agreement, max_len, a.k, a.device, a.batches, None)
    rows = []
    for i, b in enumerate(a.batches):
        loop = Loop(draft, target, b, a.k, seed=i)
        for _ in range(4):
            loop.spec()
        bare = bare_steps(loop, a.steps)
        split = host_split_steps(loop, a.steps)
        names = graph_names({"draft": draft, "target": target})
        launch_split = launch_split_steps(loop.spec, a.steps, names) if a.device != "cpu" else []
        timeline = event_timeline_steps(loop, a.steps, names) if a.device != "cpu" else []
        trace = profile_steps(loop, a.steps)
        if a.launch_variants and a.device != "cpu":
            # The same split for plain steps (the target alone; last: the draft no longer follows
            # these sequences).
            for variant, context in PLAIN_VARIANTS.items():
                with context():
                    launch_split += [{**r, "variant": variant} for r in launch_split_steps(loop.plain, a.steps, names)]
        loop.close()
        if a.keep_trace and i == 0:
            with gzip.open(ROOT / "bench" / "results" / f"gaps_trace_b{b}.json.gz", "wt") as f:
                json.dump(trace, f)
        idle, graphs = {}, {}
        if a.device != "cpu":
            for name, engine, q in (("target_verify", target, a.k + 1), ("target_decode", target, 1),
                                    ("draft_decode", draft, 1)):
                g = engine.runner.graphs.graphs.get((b, q)) if engine.runner.graphs is not None else None
                if g is not None:
                    idle[name] = replay_after_idle(g.graph, engine.runner.device)
                    graphs[name] = g.graph
        launches = launch_after(graphs, target.runner.device) if graphs else []
        rows.append({"batch": b, "unprofiled_step_us": bare["step_us"], "bare": bare, "host_split": split,
                     "replay_ms_after_idle_us": idle, "launch_after": launches,
                     "launch_split": launch_split, "event_timeline": timeline, **summarize(per_step(trace))})
        print(f"batch {b}: { {k: v for k, v in rows[-1].items() if k != 'waits'} }", flush=True)
    path = write_result("gaps", {"benchmark": "gaps", "environment": environment(), "target": a.target,
                                 "draft": a.draft, "k": a.k, "steps": a.steps, "rows": rows})
    labels = sorted({k for r in rows for k in r["idle_by_range_us"]},
                    key=lambda k: -max(r["idle_by_range_us"].get(k) or 0.0 for r in rows))
    flat = [{"batch": r["batch"], "bare": r["unprofiled_step_us"], "window": r["window_us"],
             "busy": r["busy_us"], "idle": r["idle_us"], **{k: r["idle_by_range_us"].get(k) for k in labels}}
            for r in rows]
    for r in rows:
        print(f"\nbatch {r['batch']}: the GPU's longest waits by kind (gap between two device ops; "
              "range: the host range charged most of it)")
        print(table(r["waits"], [("range", "range", "s"), ("after", "after", "s"), ("before", "before", "s"),
                                 ("us_per_step", "us/step", ".0f"), ("gaps_per_step", "gaps/step", ".1f"),
                                 ("median_gap_us", "median gap", ".1f")]))
    split_labels = sorted({k for r in rows for k in r["host_split"]["exclusive_us"]},
                          key=lambda k: -max(r["host_split"]["exclusive_us"].get(k, 0.0) for r in rows))
    print("\nus per speculative step without the profiler (medians): the host's exclusive time in each "
          "wrapped range (wait: blocked on the GPU in tolist / an event synchronize; (loop): the loop's own Python)")
    print(table([{"range": k, **{f"b{r['batch']}": r["host_split"]["exclusive_us"].get(k, 0.0) for r in rows}}
                 for k in split_labels]
                + [{"range": "step (timed here)", **{f"b{r['batch']}": r["host_split"]["step_us"] for r in rows}},
                   {"range": "host outside wait", **{f"b{r['batch']}": r["host_split"]["host_us"] for r in rows}}],
                [("range", "range", "s")] + [(f"b{r['batch']}", f"b {r['batch']}", ".0f") for r in rows]))
    print("\nengine calls in bare steps (medians, us): wall, forwards' device time, and the rest, the host "
          "time of the call without gRPC (e2e.py's draft / target host is the same through the servers)")
    print(table([{"batch": r["batch"], **r["bare"]} for r in rows],
                [("batch", "b", "d"), ("step_us", "step", ".0f")]
                + [(f"{role}_{part}_us", f"{role} {part}", ".0f") for role in ("draft", "target")
                   for part in ("wall", "fwd", "host")]))
    idle_rows = [{"graph": f"b {r['batch']} {name}", **{f"i{us}": ms for us, ms in by.items()}}
                 for r in rows for name, by in r["replay_ms_after_idle_us"].items()]
    if idle_rows:
        print("\nms of one replay launched after the GPU sat idle for N us (median of 15; ratio to idle 0)")
        print(table([{**r, **{f"x{us}": r[f"i{us}"] / r["i0"] for us in IDLE_US[1:]}} for r in idle_rows],
                    [("graph", "graph", "s")] + [(f"i{us}", f"idle {us}", ".3f") for us in IDLE_US]
                    + [(f"x{us}", f"x {us}", ".3f") for us in IDLE_US[1:]]))
    launch_rows = [{"batch": r["batch"], **x} for r in rows for x in r["launch_after"]]
    if launch_rows:
        print("\nhost us of a graph's launch (replay() call) on an idle GPU, by the graph replayed just before it")
        print(table(launch_rows, [("batch", "b", "d"), ("graph", "graph", "s"), ("after", "after", "s"),
                                  ("launch_us", "launch us", ".1f")]))
    split_rows = [{"batch": r["batch"], **x} for r in rows for x in r["launch_split"]]
    if split_rows:
        print("\nhost us of each replay() call in bare steps, by graph and by whether the stream had work "
              "queued (busy) or not (idle) when it was called (medians)")
        print(table(split_rows, [("batch", "b", "d"), ("variant", "variant", "s"), ("graph", "graph", "s"), ("per_step", "a step", ".0f"),
                                 ("us_per_step", "us a step", ".1f"), ("idle_n", "idle n", "d"),
                                 ("idle_us", "idle us", ".1f"), ("busy_n", "busy n", "d"), ("busy_us", "busy us", ".1f")]))
    for r in rows:
        if r["event_timeline"]:
            print(f"\nbatch {r['batch']}: us between consecutive CUDA events of a bare step (medians; "
                  "'>' before, '<' after a call; idle stream: host time, after a replay: its device work)")
            print(table(r["event_timeline"], [("segment", "segment", "s"), ("us", "us", ".1f")]))
    print("\nus per speculative step (medians): the step's wall time without the profiler and under it, "
          "the GPU's busy and idle time, and the idle time by the innermost host range open meanwhile")
    print(table(flat, [("batch", "b", "d"), ("bare", "step bare", ".0f"), ("window", "step traced", ".0f"), ("busy", "GPU busy", ".0f"),
                       ("idle", "GPU idle", ".0f")] + [(k, k, ".0f") for k in labels]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
