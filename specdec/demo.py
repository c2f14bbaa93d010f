"""`make demo`: the embedded model pair (models/target, models/draft) served by all three services on
this machine, one code-completion request streamed, then the measured acceptance, c and speedups.

The same prompt is run twice through the same services: with speculation (streamed) and with
speculation off (plain decoding through the same Verify path). Greedy speculative decoding is
lossless, so the two completions must be identical; the demo checks it.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from coordinator.client import Client
from coordinator.launch import local_cluster
from specdec.cost_model import expected_speedup
from specdec.metrics import Samples, histogram_mean, sample_value, scrape

ROOT = Path(__file__).resolve().parent.parent
PROMPT = '''import os
import sys


def count_lines(path):
    """Return the number of lines in the file at path."""
    with open(path) as f:'''


@dataclass
class Run:
    text: str
    tokens: int
    seconds: float
    ttft: float
    drafted: int
    accepted: int
    steps: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def generate(client: Client, prompt: str, max_new_tokens: int, speculate: bool, stream: bool) -> Run:
    start = time.perf_counter()
    ttft, parts, usage = None, [], None
    for chunk in client.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, speculate=speculate,
                                 timeout=300):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - start
        parts.append(chunk.text)
        if stream:
            print(chunk.text, end="", flush=True)
        usage = chunk.usage or usage
    elapsed = time.perf_counter() - start
    return Run("".join(parts), usage.completion_tokens, elapsed, ttft or elapsed, usage.draft_tokens,
               usage.accepted_tokens, usage.steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "models" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "draft"))
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args(argv)
    device = args.device
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"specdec demo: target {args.target}, draft {args.draft}, device {device}", flush=True)
    t0 = time.perf_counter()
    with local_cluster(args.target, args.draft, device=device,
                       coordinator_args=["--num-draft", str(args.num_draft)]) as cluster:
        print(f"services up in {time.perf_counter() - t0:.1f}s: coordinator {cluster.coordinator}, "
              f"target {cluster.target}, draft {cluster.draft}\n", flush=True)
        with Client(cluster.coordinator) as client:
            generate(client, args.prompt, 8, speculate=True, stream=False)    # warm-up
            generate(client, args.prompt, 8, speculate=False, stream=False)
            print("─" * 72 + "\n" + args.prompt, end="", flush=True)
            spec = generate(client, args.prompt, args.max_new_tokens, speculate=True, stream=True)
            print("\n" + "─" * 72, flush=True)
            plain = generate(client, args.prompt, args.max_new_tokens, speculate=False, stream=False)
        metrics = scrape(cluster.metrics.get("coordinator"))
    report(spec, plain, args.num_draft, metrics)
    return 0 if spec.text == plain.text else 1


def report(spec: Run, plain: Run, gamma: int, metrics: Samples) -> None:
    alpha = spec.accepted / spec.drafted if spec.drafted else float("nan")
    tau = spec.tokens / spec.steps if spec.steps else float("nan")
    c = sample_value(metrics, "specdec_cost_coefficient", batch="1")
    c_system = sample_value(metrics, "specdec_system_cost_coefficient", batch="1")
    # Per-token acceptance probability for Leviathan's formula: accepted / (accepted + rejections).
    alpha_tok = sample_value(metrics, "specdec_alpha")
    lines = [
        f"speculative: {spec.tokens} tokens in {spec.seconds:.2f}s = {spec.tokens_per_second:.1f} tok/s "
        f"(first token {1e3 * spec.ttft:.0f} ms)",
        f"plain:       {plain.tokens} tokens in {plain.seconds:.2f}s = {plain.tokens_per_second:.1f} tok/s",
        f"identical output (lossless): {'yes' if spec.text == plain.text else 'NO'}",
        f"acceptance rate α (accepted/drafted): {alpha:.3f}  ({spec.accepted}/{spec.drafted}, γ = {gamma})",
        f"mean accepted length τ (tokens per target step): {tau:.2f}",
    ]
    if c is not None:
        a = alpha_tok if alpha_tok is not None else alpha
        lines.append(f"cost coefficient c (draft/target forward, batch 1): {c:.3f}"
                     + (f"; c_system (with RPC): {c_system:.3f}" if c_system is not None else ""))
        if 0.0 <= a <= 1.0:  # NaN (nothing drafted) has no expected speedup
            lines.append(f"expected speedup (Leviathan, α={a:.3f}, γ={gamma}, c={c:.3f}): "
                         f"{expected_speedup(a, gamma, c):.2f}x")
    else:
        lines.append("cost coefficient c: not exported by this coordinator (no metrics endpoint)")
    lines.append(f"measured speedup (speculative / plain tok/s): "
                 f"{spec.tokens_per_second / plain.tokens_per_second:.2f}x")
    overhead = histogram_mean(metrics, "specdec_step_overhead_seconds", mode="spec")
    step = histogram_mean(metrics, "specdec_step_seconds", mode="spec")
    if overhead is not None and step:
        lines.append(f"RPC + coordinator overhead per speculative step: {1e3 * overhead:.2f} ms "
                     f"({overhead / step:.0%} of the step's {1e3 * step:.1f} ms)")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
