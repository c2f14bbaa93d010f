"""The cost coefficient c = t_draft(b, 1 token) / t_target(b, 1 token) (Leviathan et al. 2023, Def. 3.7)
for three public draft shapes against the Llama-7B shape, as our runner measures it (the graphed
single-token forward a server times), with each kernel set of bench/common.KERNEL_SETS on the same
weights in one run ("default" is the servers' CUDA default), beside the weight-bytes ratio and
transformers eager.

    python3 bench/cost_coefficient.py [--batches 1 8 32] [--sets default no_pdl cublas torch_ops] [--no-hf]
    python3 bench/cost_coefficient.py --batches 1 8 --sets default default@4096 default@4096+256 --no-hf

Writes bench/results/cost_coefficient.json.
"""
from __future__ import annotations

import argparse
import time

from common import (KERNEL_SETS, environment, graph_variant, graphed_decode, hf_config, kernel_set, model_config, table,
                    variant_arg, write_result)

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from specdec.models.loader import build_model, init_random  # noqa: E402

TARGET = "llama-7b"
DRAFTS = ("llama-68m", "llama-160m", "tinyllama-1.1b")
CONTEXT = 128
BLOCK = 16


def _graphed_forward_ms(model, batches: list[int], max_model_len: int = 0,
                        context_lens: tuple[int, ...] = ()) -> dict[int, float]:
    times = {}
    for b in batches:
        runner, batch = graphed_decode(model, b, CONTEXT, BLOCK, max_model_len, context_lens)
        # The batch is staged into its graph's static inputs once (prepare: one host-to-device
        # copy); each timed forward is the replay and the copy of the logits it returns. (Runs
        # before the staging landed timed device-side copies into the graph's buffers as well.)
        times[b] = do_bench(lambda: runner.forward(batch), warmup=10, rep=100, return_mode="median")
        del runner
    return times


def ours_forward_ms(shape: str, batches: list[int], sets: list[str]) -> tuple[dict, dict, int]:
    """({kernel set: {batch: ms}}, {kernel set: error}, weight bytes): every set on the same weights."""
    model = init_random(build_model(model_config(shape), torch.bfloat16, "cuda"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    times, errors = {}, {}
    for name in sets:
        try:
            kset, max_model_len, context_lens = graph_variant(name)
            with kernel_set(model, kset):
                times[name] = _graphed_forward_ms(model, batches, max_model_len, context_lens)
        except Exception as exc:  # keep the run useful: say why, measure the other sets
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{shape} {name}: {errors[name]}", flush=True)
    del model
    torch.cuda.empty_cache()
    return times, errors, weight_bytes


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
    ap.add_argument("--sets", nargs="+", default=list(KERNEL_SETS), type=variant_arg,
                    help="kernel sets to time; c is reported for each, the first is the main column. "
                         "NAME@MAX_MODEL_LEN[+C...] times a server's graph bounds (default@4096: graphs "
                         "for 4096-token sequences, as a server's --max-model-len 4096; default@4096+256: "
                         "with --graph-context-lens 256); plain names use the context + 64")
    args = ap.parse_args()
    sets = ["default"] + [n for n in args.sets if n != "default"]
    env = environment()
    ours, sizes, hf, errors = {}, {}, {}, {}
    for shape in (TARGET, *DRAFTS):
        ours[shape], errs, sizes[shape] = ours_forward_ms(shape, args.batches, sets)
        if errs:
            errors[shape] = errs
        print(f"ours {shape}: {ours[shape]}", flush=True)
        if not args.no_hf:
            try:
                hf[shape] = hf_forward_ms(shape, args.batches)
            except Exception as exc:
                hf[shape] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"transformers eager {shape}: {hf[shape]}", flush=True)
    rows = []
    for shape in DRAFTS:
        for b in args.batches:
            r = {"draft": shape, "batch": b, "weight_ratio": sizes[shape] / sizes[TARGET]}
            for name in sets:
                if name in ours[shape] and name in ours[TARGET]:
                    sfx = "" if name == "default" else "_" + name
                    r["draft_ms" + sfx], r["target_ms" + sfx] = ours[shape][name][b], ours[TARGET][name][b]
                    r["c" + sfx] = ours[shape][name][b] / ours[TARGET][name][b]
            if b in hf.get(shape, {}) and b in hf.get(TARGET, {}):
                r["hf_draft_ms"], r["hf_target_ms"] = hf[shape][b], hf[TARGET][b]
                r["hf_c"] = hf[shape][b] / hf[TARGET][b]
            rows.append(r)
    result = {"benchmark": "cost_coefficient", "target": TARGET, "context": CONTEXT, "environment": env,
              "kernel_sets": {n: KERNEL_SETS[graph_variant(n)[0]] for n in sets}, "weight_bytes": sizes, "rows": rows,
              "forward_ms": ours, "transformers_eager_ms": hf, "errors": errors}
    path = write_result("cost_coefficient", result)
    columns = [("draft", "draft", "s"), ("batch", "batch", "d"), ("draft_ms", "draft ms", ".3f"),
               ("target_ms", "target ms", ".3f"), ("c", "c", ".3f")]
    for name in sets[1:]:
        columns += [("draft_ms_" + name, "draft ms " + name, ".3f"), ("c_" + name, "c " + name, ".3f")]
    columns += [("weight_ratio", "weight ratio", ".3f"), ("hf_c", "c (HF eager)", ".2f")]
    print()
    print(table(rows, columns))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
