"""The cost coefficient c = t_draft(b, 1 token) / t_target(b, 1 token) (Leviathan et al. 2023, Def. 3.7)
for three public draft shapes against the Llama-7B shape, as our runner measures it (the graphed
single-token forward a server times) with the fused layer kernels and with the torch layer ops,
beside the weight-bytes ratio and transformers eager. --gemv adds c with the Triton GEMV kernels
(kernels/gemv.py) for the linear layers of both models.

    python3 bench/cost_coefficient.py [--batches 1 8 32] [--no-torch-ops] [--no-hf] [--gemv]

Writes bench/results/cost_coefficient.json.
"""
from __future__ import annotations

import argparse
import time
import traceback

from common import environment, hf_config, model_config, table, write_result

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from specdec.config import CacheConfig  # noqa: E402
from specdec.models.loader import build_model, init_random  # noqa: E402
from specdec.runner import ModelRunner, SeqInput  # noqa: E402

TARGET = "llama-7b"
DRAFTS = ("llama-68m", "llama-160m", "tinyllama-1.1b")
CONTEXT = 128
BLOCK = 16


def _graphed_forward_ms(model, batches: list[int]) -> dict[int, float]:
    blocks_per_seq = -(-(CONTEXT + 8) // BLOCK)
    times = {}
    for b in batches:
        runner = ModelRunner(model, CacheConfig(b * blocks_per_seq + 1, BLOCK, torch.bfloat16))
        runner.enable_cuda_graphs(max_model_len=CONTEXT + 64, query_lens=(1,), batch_sizes=(b,))
        for s in range(b):
            runner.add_sequence(s)
        runner.step([SeqInput(s, list(range(1, CONTEXT))) for s in range(b)])
        batch = runner.prepare([SeqInput(s, [7]) for s in range(b)])
        # What a server times per decode step: copy into the graph's buffers + replay.
        times[b] = do_bench(lambda: runner.forward(batch), warmup=10, rep=100, return_mode="median")
        del runner
    return times


def ours_forward_ms(shape: str, batches: list[int], torch_ops: bool,
                    gemv: bool = False) -> tuple[dict, dict | None, dict | None, int, str | None]:
    """(ms per batch with the fused kernels, the same on the torch ops or None, with the fused and
    GEMV kernels or None, weight bytes, error). If the fused kernels fail, the error is returned and
    the first dict holds the torch-ops times."""
    model = init_random(build_model(model_config(shape), torch.bfloat16, "cuda", fused_kernels=True,
                                    gemv_kernels=False))  # cuBLAS first; --gemv adds the server default
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    error, with_gemv = None, None
    try:
        fused = _graphed_forward_ms(model, batches)
        if gemv:
            model.set_gemv_kernels(True)
            with_gemv = _graphed_forward_ms(model, batches)
            model.set_gemv_kernels(False)
    except Exception as exc:  # keep the run useful: say why, then measure the torch ops
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"[:500]
    model.set_fused_kernels(False)
    unfused = _graphed_forward_ms(model, batches) if torch_ops or error else None
    del model
    torch.cuda.empty_cache()
    return (unfused if error else fused), (unfused if torch_ops else None), with_gemv, weight_bytes, error


def hf_forward_ms(shape: str, batches: list[int]) -> dict[int, float]:
    import transformers
    cfg = transformers.LlamaConfig(**{k: v for k, v in hf_config(shape).items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    times = {}
    with torch.no_grad():
        for b in batches:
            ids = torch.randint(0, 32000, (b, CONTEXT), device="cuda")
            cache = transformers.DynamicCache()
            model(ids, past_key_values=cache, use_cache=True)
            step = ids[:, -1:]
            samples = []
            for i in range(30):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(step, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - t0)
                cache.crop(CONTEXT)
            times[b] = 1e3 * sorted(samples[5:])[len(samples[5:]) // 2]
    del model
    torch.cuda.empty_cache()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-torch-ops", action="store_true", help="skip the unfused comparison")
    ap.add_argument("--gemv", action="store_true", help="also time both models on the GEMV kernels")
    args = ap.parse_args()
    env = environment()
    ours, sizes, hf, unfused, gemv, errors = {}, {}, {}, {}, {}, {}
    for shape in (TARGET, *DRAFTS):
        ours[shape], torch_ops_ms, gemv_ms, sizes[shape], error = ours_forward_ms(
            shape, args.batches, not args.no_torch_ops, args.gemv)
        if error:
            errors[shape] = error
        if torch_ops_ms:
            unfused[shape] = torch_ops_ms
        if gemv_ms:
            gemv[shape] = gemv_ms
        print(f"ours {shape}: {ours[shape]} (torch ops: {torch_ops_ms}, gemv: {gemv_ms}, "
              f"fused error: {error})", flush=True)
        if not args.no_hf:
            try:
                hf[shape] = hf_forward_ms(shape, args.batches)
            except Exception as exc:
                hf[shape] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"transformers eager {shape}: {hf[shape]}", flush=True)
    rows = []
    for shape in DRAFTS:
        for b in args.batches:
            r = {"draft": shape, "batch": b, "draft_ms": ours[shape][b], "target_ms": ours[TARGET][b],
                 "c": ours[shape][b] / ours[TARGET][b], "weight_ratio": sizes[shape] / sizes[TARGET]}
            if shape in unfused and TARGET in unfused:
                r["draft_ms_torch_ops"], r["target_ms_torch_ops"] = unfused[shape][b], unfused[TARGET][b]
                r["c_torch_ops"] = unfused[shape][b] / unfused[TARGET][b]
            if shape in gemv and TARGET in gemv:
                r["draft_ms_gemv"], r["target_ms_gemv"] = gemv[shape][b], gemv[TARGET][b]
                r["c_gemv"] = gemv[shape][b] / gemv[TARGET][b]
            if b in hf.get(shape, {}) and b in hf.get(TARGET, {}):
                r["hf_draft_ms"], r["hf_target_ms"] = hf[shape][b], hf[TARGET][b]
                r["hf_c"] = hf[shape][b] / hf[TARGET][b]
            rows.append(r)
    result = {"benchmark": "cost_coefficient", "target": TARGET, "context": CONTEXT, "environment": env,
              "weight_bytes": sizes, "rows": rows, "transformers_eager_ms": hf, "torch_ops_ms": unfused,
              "gemv_ms": gemv, "fused_errors": errors}
    path = write_result("cost_coefficient", result)
    print()
    print(table(rows, [("draft", "draft", "s"), ("batch", "batch", "d"), ("draft_ms", "draft ms", ".3f"),
                       ("target_ms", "target ms", ".3f"), ("c", "c (ours)", ".3f"),
                       ("draft_ms_torch_ops", "draft ms torch ops", ".3f"), ("c_torch_ops", "c torch ops", ".3f"),
                       ("draft_ms_gemv", "draft ms gemv", ".3f"), ("target_ms_gemv", "target ms gemv", ".3f"),
                       ("c_gemv", "c gemv", ".3f"), ("weight_ratio", "weight ratio", ".3f"), ("hf_c", "c (HF eager)", ".2f")]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
