"""What one sampled draft position and one sampled verify cost on the GPU, beside greedy argmax:
the fused sampling kernel (specdec/kernels/sampling.py) against torch's ops, in one run.

    python3 bench/sampling.py [--vocab 32000] [--batches 1 8] [--kmax 4]

For each batch size: the graphed sampler's replay (device time, CUDA events) and its sample() call
(host wall time, staging included, synchronised), the graphed verifier's replay and verify() call,
and argmax. A kernel table (torch.profiler over eager draft_sample) says which ops hold the time.
Temperature 0.8 with top-k 50 (the e2e sampled setting), with top-p 0.9, and alone.
Writes bench/results/sampling.json.
"""
from __future__ import annotations

import argparse
import statistics

from common import environment, table, wall_ms, write_result

import torch  # noqa: E402

from specdec.kernels import sampling as fused  # noqa: E402
from specdec.sampling.draft import draft_sample  # noqa: E402
from specdec.sampling.graphs import GraphedSampler, GraphedVerifier  # noqa: E402
from specdec.sampling.params import SamplingParams  # noqa: E402
from specdec.sampling.probs import SamplingTensors  # noqa: E402


def device_ms(fn, n: int = 200) -> float:
    """Median device ms of fn() between CUDA events (fn launches work, no sync inside)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def kernel_table(logits, params, top: int = 12) -> list[dict]:
    tensors = SamplingTensors.from_params(params, logits.device, seeds=[1] * len(params))
    pos = torch.zeros(len(params), dtype=torch.int64)
    for _ in range(3):
        draft_sample(logits, tensors, pos)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            draft_sample(logits, tensors, pos)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)]
    rows = []
    for e in events:
        us = getattr(e, "self_device_time_total", 0) / 10
        if us > 0:
            rows.append({"kernel": e.key[:70], "us_per_call": round(us, 2), "launches": e.count // 10})
    rows.sort(key=lambda r: -r["us_per_call"])
    total = sum(r["us_per_call"] for r in rows)
    return [{"kernel": "TOTAL", "us_per_call": round(total, 2), "launches": sum(r["launches"] for r in rows)}] + rows[:top]


def sweep(v: int, batches: list[int]) -> list[dict]:
    """The fused kernel alone (one eager call captured in a graph) at several chunk sizes and warp
    counts: device us per call, top-k 50 / top-p 0.9 / temperature only."""
    dev = torch.device("cuda")
    out = []
    for b in batches:
        logits = torch.randn(b, v, device=dev) * 3
        u = torch.rand(b, dtype=torch.float64, device=dev)
        q = torch.empty(b, v, dtype=torch.float16, device=dev)
        tok = torch.empty(b, dtype=torch.int64, device=dev)
        for name, sp in {"topk50": SamplingParams(temperature=0.8, top_k=50),
                         "topp": SamplingParams(temperature=0.8, top_p=0.9),
                         "temp": SamplingParams(temperature=0.8)}.items():
            t = SamplingTensors.from_params([sp] * b, dev, [1] * b)
            row = {"batch": b, "setting": name}
            for chunk in (1024, 2048, 4096, 8192):
                for warps in (8, 16, 32):
                    cfg = {"CHUNK": chunk, "num_warps": warps}
                    call = lambda: fused.fused_sample(logits, *t.filters(), u, q, tok, config=cfg)  # noqa: E731
                    try:
                        call()
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            call()
                        row[f"c{chunk}w{warps}"] = 1e3 * device_ms(g.replay, 100)
                    except Exception as e:  # noqa: BLE001 - e.g. out of registers: report and go on
                        row[f"c{chunk}w{warps}"] = None
                        print("config", cfg, "failed:", repr(e)[:200])
            out.append(row)
    keys = [k for k in out[0] if k.startswith("c")]
    print("\nfused kernel alone, device us per call (cCHUNK wWARPS):")
    print(table(out, [("batch", "b", "d"), ("setting", "setting", "s")] + [(k, k, ".1f") for k in keys]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kmax", type=int, default=4)
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's chunk / warp configs")
    args = ap.parse_args()
    dev = torch.device("cuda")
    v, kmax = args.vocab, args.kmax
    settings = {"topk50": SamplingParams(temperature=0.8, top_k=50),
                "topp": SamplingParams(temperature=0.8, top_p=0.9),
                "temp": SamplingParams(temperature=0.8)}
    rows, kernels = [], {}
    for path in ("fused", "torch"):   # the same inputs through both, side by side
        fused.set_enabled(path == "fused")
        gen = torch.Generator(device=dev).manual_seed(0)
        sampler = GraphedSampler(v, args.batches, kmax + 1, torch.float16, dev)
        verifier = GraphedVerifier(v, args.batches, kmax, dev)
        for b in args.batches:
            logits = torch.randn(b, v, device=dev, generator=gen) * 3
            tlogits = torch.randn(b * (kmax + 1), v, device=dev, generator=gen) * 3
            row = {"path": path, "batch": b, "argmax_us": 1e3 * device_ms(lambda: logits.argmax(-1))}
            for name, sp in settings.items():
                params = [sp] * b
                # The calls stage this setting's parameters; the replays after them reuse them.
                row[f"sampler_{name}_call_us"] = 1e3 * wall_ms(
                    lambda: sampler.sample(logits, params, [1] * b, [5] * b, None, 0))
                g, _ = sampler._graph_for(b, params)
                row[f"sampler_{name}_replay_us"] = 1e3 * device_ms(g.graph.replay)
                tokens, q = sampler.sample(logits, params, [1] * b, [5] * b, None, 0)
                drafts = tokens.repeat_interleave(kmax).tolist()
                dprobs = q.float().repeat_interleave(kmax, 0)
                row[f"verifier_{name}_call_us"] = 1e3 * wall_ms(
                    lambda: verifier.verify(tlogits, drafts, dprobs, [kmax] * b, params, [1] * b, [5] * b))
                vg, _ = verifier._graph_for(b, params)
                row[f"verifier_{name}_replay_us"] = 1e3 * device_ms(vg.graph.replay)
                if b == args.batches[0]:
                    kernels[f"{path}_{name}"] = kernel_table(logits, params)
            rows.append(row)
    fused.set_enabled(True)
    cols = [("path", "path", "s"), ("batch", "b", "d"), ("argmax_us", "argmax", ".1f")]
    for name in settings:
        cols += [(f"sampler_{name}_replay_us", f"S {name}", ".1f"), (f"sampler_{name}_call_us", "call", ".1f"),
                 (f"verifier_{name}_replay_us", f"V {name}", ".1f"), (f"verifier_{name}_call_us", "call", ".1f")]
    for name, ks in kernels.items():
        print(f"\neager draft_sample kernels, {name}, b={args.batches[0]} (us per call):")
        print(table(ks[:6], [("kernel", "kernel", "s"), ("us_per_call", "us", ".2f"), ("launches", "n", "d")]))
    ratios = []
    for f, t in zip(rows[:len(args.batches)], rows[len(args.batches):]):
        ratios.append({"batch": f["batch"], **{k: t[k] / f[k] for k in f if k.endswith("_us")}})
    print("\nus; S = graphed sampler (one drafted position), V = graphed verifier (kmax drafts per sequence);"
          " replay = device time, call = host wall incl. staging and sync")
    print(table(rows, cols))
    print("\ntorch / fused:")
    print(table(ratios, [(c[0], c[1], ".2f") for c in cols[1:]]))
    swept = sweep(v, args.batches) if args.sweep else None
    write_result("sampling", {"environment": environment(), "vocab": v, "kmax": kmax,
                              "settings": {k: vars(s) for k, s in settings.items()},
                              "rows": rows, "torch_over_fused": ratios, "kernels": kernels,
                              "fused_config": {"CHUNK": fused.CHUNK, "num_warps": fused.NUM_WARPS},
                              "sweep": swept})


if __name__ == "__main__":
    main()
