"""Online serving through the gRPC services: Poisson arrivals at several request rates, mixed prompt
and output lengths, the demo pair; throughput, TTFT and TPOT (p50, p99) with and without
speculation on the same services.

    python3 bench/serving.py            # GPU: rates 4 16 48 req/s, 10 s of arrivals each (~2 min)
    python3 bench/serving.py --smoke    # CPU plumbing check (~1 min)

Both modes see the same requests in the same order at the same arrival times. Greedy, ignore_eos
(every request runs to its max_new_tokens). TTFT: request sent to the first chunk with tokens;
TPOT: (last chunk - first chunk) / (tokens - 1); throughput: output tokens over the time from the
first arrival to the last finish. Progress goes to stderr; a plot to bench/results/serving.png
(when matplotlib is installed). Writes bench/results/serving.json (and $OUT copies).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, environment, table, write_result

import torch  # noqa: E402

from services import (DEMO_DRAFT, DEMO_TARGET, code_prompts, coordinator, decode_profile,  # noqa: E402
                      graphs_captured, model_servers, run_concurrent, run_poisson, summarize)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def workload(n: int, a) -> list[tuple[str, int]]:
    """Mixed lengths: prompts of 50..1200 characters of code (about 15..400 tokens), outputs
    uniform in [min_out, max_out]."""
    rng = random.Random(7)
    prompts = code_prompts(n, 50, a.max_prompt_chars, seed=3)
    return [(p, rng.randint(a.min_out, a.max_out)) for p in prompts]


def progress_bar(label: str):
    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r{label:<22} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


def run_rate(address: str, requests, rate: float, speculate: bool, a) -> dict:
    label = f"{'spec' if speculate else 'plain'} {rate:g} req/s"
    recs, wall = run_poisson(address, requests, rate, seed=int(rate * 100), timeout=a.request_timeout,
                             progress=progress_bar(label), speculate=speculate, ignore_eos=True,
                             **({"num_draft": a.gamma} if speculate else {}))
    s = summarize(recs, wall)
    ok = [r for r in recs if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    row = {"mode": "spec" if speculate else "plain", "rate": rate, "throughput_tok_s": s["tok_s"],
           "requests": s["requests"], "errors": s["errors"], "first_error": s["first_error"],
           "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
           "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
           "acceptance": s["acceptance"], "tau": s["tau"], "wall_s": wall, "tokens": s["tokens"]}
    print(f"{label}: {_f(row['throughput_tok_s'])} tok/s, TTFT p50 {_f(row['ttft_p50_ms'], '.1f')} ms, "
          f"TPOT p50 {_f(row['tpot_p50_ms'], '.2f')} ms, errors {row['errors']}", flush=True)
    return row


def _ms(x):
    return None if x is None else 1e3 * x


def _f(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("throughput_tok_s", None, "output tokens/s"), ("ttft_p50_ms", "ttft_p99_ms", "TTFT ms"),
              ("tpot_p50_ms", "tpot_p99_ms", "TPOT ms")]
    for ax, (p50, p99, title) in zip(axes, panels):
        for mode, color in (("plain", "tab:blue"), ("spec", "tab:orange")):
            rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["rate"])
            xs = [r["rate"] for r in rs]
            ax.plot(xs, [r[p50] for r in rs], "o-", color=color, label=f"{mode}" + (" p50" if p99 else ""))
            if p99:
                ax.plot(xs, [r[p99] for r in rs], "s--", color=color, label=f"{mode} p99")
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.set_xscale("log")
        rates = sorted({r["rate"] for r in rows})
        ax.set_xticks(rates, [f"{x:g}" for x in rates])
        ax.minorticks_off()
        if p99:
            ax.set_yscale("log")
            for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis_format(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("specdec serving, demo pair: Poisson arrivals, greedy, mixed lengths")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    if os.environ.get("OUT"):
        fig.savefig(Path(os.environ["OUT"]) / path.name, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check with small settings")
    p.add_argument("--rates", type=float, nargs="+", help="request rates per second (default 4 16 48)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate (default 10; smoke 3)")
    p.add_argument("--max-requests", type=int, default=400, help="cap on requests per rate")
    p.add_argument("--min-out", type=int, default=16)
    p.add_argument("--max-out", type=int, help="longest output (default 128; smoke 12)")
    p.add_argument("--max-prompt-chars", type=int, default=1200)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--draft-device", help="default: the target's device (cuda:0 or cpu)")
    p.add_argument("--kv-memory", default="8GiB", help="KV cache of each server on cuda")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--work-dir", type=Path)
    a = p.parse_args(argv)
    a.device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda:0"
    a.rates = a.rates or ([1, 3] if a.smoke else [4, 16, 48])
    a.duration = a.duration or (3.0 if a.smoke else 10.0)
    a.max_out = a.max_out or (12 if a.smoke else 128)
    a.min_out = min(a.min_out, a.max_out) if not a.smoke else 4
    if a.smoke:
        a.max_prompt_chars = min(a.max_prompt_chars, 400)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="specdec-serving-"))
    args = ["--max-model-len", "2048", "--max-num-draft", "8"]
    if a.device.startswith("cuda"):
        args += ["--kv-memory", a.kv_memory]
    specs = [("target", DEMO_TARGET, a.device, args), ("draft", DEMO_DRAFT, a.draft_device or a.device, args)]
    rows = []
    with model_servers(specs, work / "logs", a.startup_timeout) as (target, draft), \
            coordinator(target, draft, work / "logs", ["--max-batch-size", str(a.max_batch_size),
                                                       "--max-waiting", "100000",
                                                       "--num-draft", str(a.gamma)]) as coord:
        print(f"services up in {time.monotonic() - t_start:.0f}s", flush=True)
        warm = [p for p, _ in workload(a.max_batch_size, a)]
        # Warm-up: the prefill shapes of full and of single-request batches compile their Triton
        # kernels here, not inside the measurements.
        singles = sorted(warm, key=len)[::max(1, len(warm) // 6)]
        for speculate in (False, True):
            run_concurrent(coord.address, warm, a.max_batch_size, max_new_tokens=4, speculate=speculate,
                           ignore_eos=True)
            run_concurrent(coord.address, singles, 1, max_new_tokens=4, speculate=speculate,
                           ignore_eos=True)
        for rate in a.rates:
            n = max(2, min(a.max_requests, round(rate * a.duration)))
            requests = workload(n, a)
            for speculate in (False, True):
                rows.append(run_rate(coord.address, requests, rate, speculate, a))
        profiles = {"target": decode_profile(target), "draft": decode_profile(draft)}
        graphs = {"target": graphs_captured(target), "draft": graphs_captured(draft)}
    result = {"benchmark": "serving", "environment": environment(), "device": a.device,
              "settings": {"rates": a.rates, "duration_s": a.duration, "output_tokens": [a.min_out, a.max_out],
                           "prompt_chars": [50, a.max_prompt_chars], "gamma": a.gamma,
                           "max_batch_size": a.max_batch_size, "sampling": "greedy", "smoke": a.smoke,
                           "pair": "demo (models/target, models/draft)"},
              "decode_profile_s": profiles, "graphs_captured": graphs, "rows": rows,
              "elapsed_s": time.monotonic() - t_start}
    name = "serving_smoke" if a.smoke else "serving"
    path = write_result(name, result)
    png = plot(rows, ROOT / "bench" / "results" / f"{name}.png")
    print()
    print(table(rows, [("mode", "mode", "s"), ("rate", "req/s", "g"), ("requests", "n", "d"),
                       ("throughput_tok_s", "tok/s", ".0f"), ("ttft_p50_ms", "TTFT p50 ms", ".1f"),
                       ("ttft_p99_ms", "TTFT p99 ms", ".1f"), ("tpot_p50_ms", "TPOT p50 ms", ".2f"),
                       ("tpot_p99_ms", "TPOT p99 ms", ".2f"), ("acceptance", "acc/drafted", ".3f"),
                       ("errors", "errors", "d")]))
    print(f"wrote {path}" + (f" and {png}" if png else "") + f" ({result['elapsed_s']:.0f}s)")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
