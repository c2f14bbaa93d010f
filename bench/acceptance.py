"""Measured acceptance rate of the rejection sampler beside the theory, alpha = sum_x min(p(x), q(x)).

For each (p, q) pair the draft samples n tokens from q (draft_sample, fp16 transport rounding), the
target rejection-samples them against p (one draft token per sequence), and the script reports the
accepted fraction, its standard error, and a chi-square p-value of the emitted tokens against p.

    python -m bench.acceptance [--samples 200000] [--device cpu] [--out bench/results/acceptance.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import chisquare

from specdec.sampling import SamplingParams, SamplingTensors, draft_sample, logits_to_probs
from specdec.sampling.rejection import rejection_sample_probs
from specdec.sampling.transport import normalize


def case_logits(vocab: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(vocab, generator=g) * 2.0
    return target, target + noise * torch.randn(vocab, generator=g)


def cases() -> list[tuple[str, int, torch.Tensor, SamplingParams, torch.Tensor, SamplingParams]]:
    """(name, vocab, target logits, target params, draft logits, draft params)."""
    t1 = SamplingParams(temperature=1.0)
    out = []
    tgt, drf = case_logits(32, 0.0, 0)
    out.append(("p == q (q then rounded to fp16)", 32, tgt, t1, drf, t1))
    for noise in (0.5, 1.0, 2.0):
        tgt, drf = case_logits(32, noise, 1)
        out.append((f"q = p + logit noise {noise}", 32, tgt, t1, drf, t1))
    tgt, drf = case_logits(32, 0.5, 2)
    out.append(("p T=0.7, q T=1.3 (same logits + noise 0.5)", 32, tgt, SamplingParams(temperature=0.7),
                drf, SamplingParams(temperature=1.3)))
    out.append(("p top-k 5, q untruncated", 32, tgt, SamplingParams(temperature=1.0, top_k=5), drf, t1))
    out.append(("p top-p 0.8 + min-p 0.05, q top-k 8", 32, tgt,
                SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05), drf,
                SamplingParams(temperature=1.0, top_k=8)))
    out.append(("greedy p, sampled q", 32, tgt, SamplingParams(), drf, t1))
    disjoint_t = torch.full((16,), -1e4)
    disjoint_t[:8] = torch.randn(8, generator=torch.Generator().manual_seed(3))
    disjoint_d = torch.full((16,), -1e4)
    disjoint_d[8:] = 0.0
    out.append(("disjoint supports", 16, disjoint_t, t1, disjoint_d, t1))
    tgt, drf = case_logits(32000, 1.0, 4)
    out.append(("V=32000, q = p + logit noise 1.0", 32000, tgt, t1, drf, t1))
    return out


def measure(vocab, tgt, tp, drf, dp, n, device) -> dict:
    target_t = SamplingTensors.from_params([tp], device)
    p = logits_to_probs(tgt[None].to(device), target_t)[0]                         # [V]
    chunk = max(1, min(n, 8_000_000 // vocab))  # bounds the [rows, V] float64 CDF's memory
    accepted, emitted, seconds = 0, [], 0.0
    for first in range(0, n, chunk):
        rows = min(chunk, n - first)
        draft_t = SamplingTensors.from_params([dp] * rows, device, seeds=list(range(first, first + rows)))
        positions = torch.zeros(rows, dtype=torch.int64, device=device)
        start = time.perf_counter()
        x, q = draft_sample(drf.to(device).expand(rows, -1), draft_t, positions)
        out = rejection_sample_probs(p.expand(2 * rows, -1), x, q, [1] * rows, draft_t.seeds, positions)
        host = out.to_host()
        seconds += time.perf_counter() - start
        accepted += sum(host.accepted)
        emitted += [t[0] for t in host.tokens]
    q_row = normalize(q[:1])[0]  # the rounded q the draft sampled from (same for every row)
    alpha = float(torch.minimum(p.double(), q_row.double()).sum())
    measured = accepted / n
    emitted = np.array(emitted)
    pv = None
    if vocab <= 1024:
        pn = p.double().cpu().numpy()
        counts = np.bincount(emitted, minlength=vocab)
        keep = pn * n >= 5
        if counts[pn == 0].sum():
            pv = 0.0
        elif keep.sum() < 2:
            pv = 1.0
        else:
            obs = np.append(counts[keep], counts[~keep].sum())
            exp = np.append(pn[keep], pn[~keep].sum()) * n
            pv = float(chisquare(obs[exp > 0], exp[exp > 0] * obs[exp > 0].sum() / exp[exp > 0].sum()).pvalue)
    return dict(vocab=vocab, alpha_theory=alpha, alpha_measured=measured,
                stderr=float(np.sqrt(max(alpha * (1 - alpha), 1e-12) / n)), samples=n,
                chi2_pvalue_vs_p=pv, seconds=seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench/results/acceptance.json")
    args = ap.parse_args()
    rows = []
    print(f"{'pair':46s} {'V':>6s} {'alpha theory':>12s} {'measured':>9s} {'+-1se':>7s} {'chi2 p':>7s}")
    for name, vocab, tgt, tp, drf, dp in cases():
        n = args.samples
        r = dict(pair=name, **measure(vocab, tgt, tp, drf, dp, n, args.device))
        rows.append(r)
        pv = "-" if r["chi2_pvalue_vs_p"] is None else f"{r['chi2_pvalue_vs_p']:.3f}"
        print(f"{name:46s} {vocab:6d} {r['alpha_theory']:12.4f} {r['alpha_measured']:9.4f} "
              f"{r['stderr']:7.4f} {pv:>7s}")
    device = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
              else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    result = dict(benchmark="acceptance", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  device=device, versions=dict(python=platform.python_version(), torch=torch.__version__,
                                               numpy=np.__version__),
                  transport="float16", draft_tokens_per_sequence=1, rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
