"""Where a graphed decode forward's device time goes, kernel by kernel: one CUDA-graph replay of the
(b, 1) bucket traced by torch.profiler (CUPTI), for each model shape.

    python3 bench/timeline.py [--shapes llama-7b llama-160m tinyllama-1.1b] [--batches 1] [--replays 7]
                              [--kernel-sets default no_norm] [--query-lens 1 5]

--query-lens traces the (b, q) buckets too: a verification of q - 1 drafts (q tokens a sequence,
logits for each), so a verify forward can be set beside the decode forward kernel by kernel.

With programmatic dependent launch a kernel starts while its predecessor still runs (it waits in
griddepcontrol.wait), so a kernel's own duration overlaps the one before it. This charges each
kernel its marginal time instead: how much later the forward's last finished kernel ends once it
has ended (end_i - max(end_<i)), which sums to the replay's span. Kernels are grouped by their
place in a layer (the pattern of kernel names repeats once per layer), the GEMVs named by their
projection, with each GEMV's weight-read floor (bytes / copy bandwidth measured in the run) beside
it. Medians over --replays traced replays. --kernel-sets traces each of bench/common.KERNEL_SETS on
the same weights (with add + RMSNorm folded into the GEMVs there are no norm kernels to find the
layers by, so kernels are grouped by kind only). Writes bench/results/timeline.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
from pathlib import Path

from common import (SHAPES, copy_bandwidth, environment, graph_variant, graphed_decode, kernel_set, model_config,
                    table, variant_arg, write_result)

import torch  # noqa: E402

from specdec.models.loader import build_model, init_random  # noqa: E402

CONTEXT = 128
BLOCK = 16


def trace_replay(replay) -> list[dict]:
    """The kernels of one replay, in start order: name, start and end in us (trace clock)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"]
                  if e.get("cat") == "kernel" and e.get("ph") == "X"]
    events.sort(key=lambda e: e["ts"])
    return [{"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
             "dur": float(e["dur"])} for e in events]


def marginals(kernels: list[dict]) -> list[float]:
    out, last = [], kernels[0]["start"]
    for k in kernels:
        out.append(max(k["end"] - last, 0.0))
        last = max(last, k["end"])
    return out


def short(name: str) -> str:
    for key in ("gemv", "attention", "merge", "rmsnorm", "rope", "silu", "embedding", "copy", "gemm",
                "nvjet", "elementwise", "index", "cat", "sampl"):
        if key in name.lower():
            return key
    return name[:40]


def label(kernels: list[dict], num_layers: int) -> list[str]:
    """Each kernel's role: pre (before the first norm), in a layer its kind (GEMVs by projection:
    qkv, o, gate_up, down in order; a norm by the projection it feeds: attn / mlp), post (after the
    last layer's down projection). The pattern is found from the GEMVs, four per layer and the LM
    head, so it holds with add + RMSNorm as kernels of their own and folded into the GEMVs."""
    kinds = [short(k["name"]) for k in kernels]
    gemvs = [i for i, k in enumerate(kinds) if k in ("gemv", "gemm", "nvjet")]
    if len(gemvs) != 4 * num_layers + 1:
        return kinds
    proj = ("qkv", "o", "gate_up", "down")
    labels = list(kinds)
    role = {i: proj[n % 4] for n, i in enumerate(gemvs[:-1])}
    norms = [i for i, k in enumerate(kinds) if k == "rmsnorm"]
    first = min(norms[:1] + gemvs[:1])
    for i in range(first):
        labels[i] = "pre " + kinds[i]
    for i in range(first, gemvs[-2] + 1):
        if i in role:
            labels[i] = "gemv " + role[i]
        elif kinds[i] == "rmsnorm":
            feeds = role[next(g for g in gemvs if g > i)]
            labels[i] = "rmsnorm " + ("attn" if feeds == "qkv" else "mlp")
    for i in range(gemvs[-2] + 1, len(kinds)):
        labels[i] = "post " + kinds[i]
    return labels


def weight_bytes(shape: str) -> dict[str, int]:
    s = SHAPES[shape]
    h, inter = s["hidden_size"], s["intermediate_size"]
    d = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * d
    return {"gemv qkv": 2 * h * (h + 2 * kv), "gemv o": 2 * h * h, "gemv gate_up": 2 * h * 2 * inter,
            "gemv down": 2 * inter * h, "post gemv": 2 * h * s["vocab_size"]}


def measure(shape: str, b: int, replays: int, bw: float, ksets=("default",), max_model_len: int = 0,
            query_lens: tuple[int, ...] = (1,), context: int = CONTEXT) -> list[dict]:
    """One result per kernel set and query length, all on the same weights. ksets: kernel sets,
    each optionally with a server's graph bounds (common.graph_variant: "default@4096+256");
    max_model_len is the bound of those without."""
    cfg = model_config(shape)
    model = init_random(build_model(cfg, torch.bfloat16, "cuda"))
    results = []
    for spec in ksets:
        kset, mml, context_lens = graph_variant(spec)
        with kernel_set(model, kset):
            for q in query_lens:
                results.append({**_measure(model, cfg, shape, b, replays, bw, mml or max_model_len, context_lens, q,
                                           context), "kernel_set": spec})
    del model
    torch.cuda.empty_cache()
    return results


def _measure(model, cfg, shape: str, b: int, replays: int, bw: float, max_model_len: int,
             context_lens: tuple[int, ...] = (), query_len: int = 1, context: int = CONTEXT) -> dict:
    runner, staged = graphed_decode(model, b, context, BLOCK, max_model_len, context_lens, query_len)
    graph = runner.graphs.staged_graph(staged).graph
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    traces = [trace_replay(graph.replay) for _ in range(replays)]
    n = min(len(t) for t in traces)
    traces = [t[:n] for t in traces]
    labels = label(traces[0], cfg.num_layers)
    spans = [t[-1]["end"] - t[0]["start"] for t in traces]
    charged = [marginals(t) for t in traces]
    per_kernel = [statistics.median(m[i] for m in charged) for i in range(n)]
    own = [statistics.median(t[i]["dur"] for t in traces) for i in range(n)]
    groups = collections.OrderedDict()
    for lab, m, d in zip(labels, per_kernel, own):
        g = groups.setdefault(lab, {"role": lab, "count": 0, "marginal_us": 0.0, "own_us": 0.0})
        g["count"] += 1
        g["marginal_us"] += m
        g["own_us"] += d
    floors = weight_bytes(shape)
    span = statistics.median(spans)
    for g in groups.values():
        g["marginal_us_each"] = g["marginal_us"] / g["count"]
        g["share"] = g["marginal_us"] / span
        if g["role"] in floors:
            g["floor_us_each"] = floors[g["role"]] / bw * 1e6
            g["frac_of_floor"] = g["floor_us_each"] / g["marginal_us_each"]
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del runner
    return {"shape": shape, "batch": b, "query_len": query_len, "context": context, "max_model_len": max_model_len or context + 64,
            "context_lens": list(context_lens),
            "kernels": n, "span_us": span,
            "weight_floor_us": total_bytes / bw * 1e6, "groups": list(groups.values())}


def _print(r: dict) -> None:
    print(f"\n{r['shape']} b {r['batch']} q {r['query_len']} [{r['kernel_set']}] max_model_len {r['max_model_len']}: "
          f"{r['kernels']} kernels, replay span "
          f"{r['span_us']:.1f} us, weight floor {r['weight_floor_us']:.1f} us "
          f"({r['weight_floor_us'] / r['span_us']:.0%})")
    print(table(r["groups"], [("role", "kernel", ""), ("count", "n", ""),
                              ("marginal_us", "marginal us", ".1f"), ("share", "share", ".1%"),
                              ("marginal_us_each", "each us", ".2f"), ("own_us", "own us", ".1f"),
                              ("floor_us_each", "floor each", ".2f"), ("frac_of_floor", "of floor", ".2f")]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-7b", "llama-160m", "tinyllama-1.1b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--kernel-sets", nargs="+", default=["default"], type=variant_arg,
                    help="bench/common.KERNEL_SETS to trace, each on the same weights (e.g. default no_norm); "
                         "NAME@MAX_MODEL_LEN[+C...] also sets a server's graph bounds (default@4096 "
                         "default@4096+256: --max-model-len 4096, without and with --graph-context-lens 256)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the graph bucket's longest sequence (a server's --max-model-len; default context + 64)")
    ap.add_argument("--query-lens", type=int, nargs="+", default=[1],
                    help="tokens a sequence per traced forward: 1 decode, q > 1 a verification of q - 1 drafts")
    ap.add_argument("--context", type=int, default=CONTEXT,
                    help="tokens each sequence holds before the traced forward (within the graph bound: --max-model-len or a kernel set's @bound)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    results = []
    for shape in args.shapes:
        for b in args.batches:
            for r in measure(shape, b, args.replays, bw, args.kernel_sets, args.max_model_len,
                             tuple(args.query_lens), args.context):
                results.append(r)
                _print(r)
    write_result("timeline", {"benchmark": "timeline", "environment": environment(),
                              "copy_bandwidth_GBps": bw / 1e9, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
