"""Scratch (session 30): host time of every CUDAGraph.replay() inside bare speculative steps (gaps.py's
Loop, 7B + 68m), by graph, and whether the GPU was idle when the call began; which replay makes
gaps.py's cuda.launch 485 us a step at b 8 against 39 at b 1."""
import statistics, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
sys.path.insert(0, "bench")
import torch
from anatomy import Loop, PROMPT, engines
from services import write_shape_folder

steps, k = 24, 4
max_len = PROMPT + (3 * steps + 8) * (k + 1) + 64
with tempfile.TemporaryDirectory() as tmp:
    t_dir = write_shape_folder(Path(tmp) / "target", "llama-7b")
    d_dir = write_shape_folder(Path(tmp) / "draft", "llama-68m")
    draft, target = engines(t_dir, d_dir, 0.8, max_len, k, "cuda", [1, 8], None)
names = {}
for role, e in (("draft", draft), ("target", target)):
    for i, gs in enumerate(getattr(e.runner.graphs, "sets", [e.runner.graphs])):
        for (b, q), g in gs.graphs.items():
            names[id(g.graph)] = f"{role} {b}x{q} set{i}"
        for b, c in gs.chains.items():
            names[id(c.graph)] = f"{role} chain {b} set{i}"
        for b, h in gs.heads.items():
            names[id(h)] = f"{role} head {b} set{i}"
orig = torch.cuda.CUDAGraph.replay
rec = []
last_stage = [None]   # exit time of the latest GraphedForward.stage, until a replay takes it
gaps = defaultdict(list)
def timed(self):
    idle = torch.cuda.current_stream().query()
    t0 = time.perf_counter()
    name = names.get(id(self), "other")
    if last_stage[0] is not None:
        gaps[name].append((t0 - last_stage[0]) * 1e6)
        last_stage[0] = None
    orig(self)
    rec.append((name, idle, time.perf_counter() - t0))
from specdec.cuda_graphs import GraphedForward
orig_stage = GraphedForward.stage
def staged(self, *a, **kw):
    out = orig_stage(self, *a, **kw)
    last_stage[0] = time.perf_counter()
    return out
for i, b in enumerate((1, 8)):
    loop = Loop(draft, target, b, k, seed=i)
    for _ in range(4):
        loop.spec()
    torch.cuda.synchronize()
    torch.cuda.CUDAGraph.replay = timed
    GraphedForward.stage = staged
    rec.clear(); gaps.clear()
    walls, outs = [], []
    for _ in range(steps):
        t0 = time.perf_counter(); outs.append(loop.spec()); walls.append(time.perf_counter() - t0)
    torch.cuda.CUDAGraph.replay = orig
    GraphedForward.stage = orig_stage
    med = lambda xs: 1e6 * statistics.median(xs)
    print(f"b {b}: draft wall {med([o['draft_wall'] for o in outs]):.0f} us (fwd {med([o['draft_fwd'] for o in outs]):.0f}), "
          f"target wall {med([o['target_wall'] for o in outs]):.0f} (fwd {med([o['target_fwd'] for o in outs]):.0f})")
    for name, v in sorted(gaps.items()):
        print(f"  stage exit -> {name} replay entry: median {statistics.median(v):.1f} us over {len(v)}")
    by = defaultdict(list)
    for name, idle, dt in rec:
        by[(name, idle)].append(dt * 1e6)
    print(f"b {b}: step {1e6 * statistics.median(walls):.0f} us, replays/step {len(rec) / steps:.1f}, "
          f"replay host us/step {sum(d for *_, d in rec) * 1e6 / steps:.0f}")
    print("graph | GPU idle at call | calls/step | median us | max us")
    for (name, idle), v in sorted(by.items()):
        print(f"{name} | {idle} | {len(v) / steps:.2f} | {statistics.median(v):.1f} | {max(v):.1f}")
    loop.close()
