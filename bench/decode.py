"""Target-only decode on the GPU: our runner (CUDA graphs) against the HBM floor and transformers.

    python3 bench/decode.py [--shape llama-7b] [--batches 1 8 32] [--steps 128] [--hf-static]
                            [--sets default silu_gemv no_pdl cublas torch_ops]

For each batch size: the device time of one graphed decode forward (graph replay) with each kernel
set of bench/common.KERNEL_SETS on the same weights in the same run ("default" is what the servers
run: fused layer kernels, the Triton GEMV, programmatic dependent launch; silu_gemv adds SiLU * up
in the gate_up projection's GEMV epilogue, opt-in until measured; the others drop one piece each,
or all of Triton); the step time and tokens/s of a full greedy loop with each set through
ModelRunner.step (host prepare + replay + argmax + one copy to the host per step: where a set
changes what a launch costs, it shows here and not in the replays); the floor
(weight bytes / copy bandwidth measured in this run); and transformers' eager generate on the same
weights. --hf-static adds transformers' static cache, which torch.compiles on first use: its
warm-up runs the same max_new_tokens so compilation stays outside the timing, and it can take minutes.
Writes bench/results/decode.json after our rows, then again after each comparison, so a comparison
that fails or is killed by a time limit leaves our numbers on disk.
"""
from __future__ import annotations

import argparse
import time

from common import KERNEL_SETS, copy_bandwidth, environment, hf_config, kernel_set, model_config, table, write_result

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from specdec.config import CacheConfig  # noqa: E402
from specdec.models.loader import build_model, init_random  # noqa: E402
from specdec.runner import ModelRunner, SeqInput  # noqa: E402

PROMPT = 128
BLOCK = 16


def ours(model, batch: int, steps: int, max_len: int, query_len: int = 1) -> dict:
    """replay_ms: device time of the (batch, 1) graph; with query_len > 1 also verify_replay_ms,
    the (batch, query_len) graph a verification of query_len - 1 drafts replays; the greedy decode
    loop's step time and tokens/s."""
    blocks_per_seq = -(-(PROMPT + steps + 8) // BLOCK)
    runner = ModelRunner(model, CacheConfig(batch * blocks_per_seq + 1, BLOCK, torch.bfloat16))
    runner.enable_cuda_graphs(max_model_len=max_len, query_lens=tuple(sorted({1, query_len})),
                              batch_sizes=(batch,))
    gen = torch.Generator().manual_seed(batch)
    seqs = list(range(batch))
    for s in seqs:
        runner.add_sequence(s)
    logits = runner.step([SeqInput(s, torch.randint(0, 32000, (PROMPT,), generator=gen).tolist())
                          for s in seqs])
    tokens = [int(l[-1].argmax()) for l in logits]
    # Pure device time of a replay at this context (graph launches only).
    graph = runner.graphs.graphs[(batch, 1)].graph
    replay_ms = do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    out = {"replay_ms": replay_ms}
    if query_len > 1:
        out["verify_replay_ms"] = do_bench(runner.graphs.graphs[(batch, query_len)].graph.replay,
                                           warmup=10, rep=100, return_mode="median")
    # The whole loop a server runs per token.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step = runner.step([SeqInput(s, [t]) for s, t in zip(seqs, tokens)])
        tokens = torch.stack([o[-1] for o in step]).argmax(-1).tolist()
    torch.cuda.synchronize()
    loop_s = time.perf_counter() - t0
    del runner
    torch.cuda.empty_cache()
    return {**out, "step_ms": 1e3 * loop_s / steps, "tok_s": batch * steps / loop_s}


def transformers_generate(shape: str, batch: int, new_tokens: int, cache: str | None) -> float:
    import transformers
    cfg = transformers.LlamaConfig(**{k: v for k, v in hf_config(shape).items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (batch, PROMPT), device="cuda")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if cache:
        kwargs["cache_implementation"] = cache
    # A static cache is sized by max_new_tokens and compiled for it: warm up at the timed length.
    warm = kwargs if cache else {**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
    with torch.no_grad():
        model.generate(ids, **warm)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return batch * new_tokens / elapsed


def _compare(row: dict, name: str, measure) -> None:
    """A comparison column: its value, or None and the error (reported, never fatal to our rows)."""
    try:
        row[name] = measure()
    except Exception as exc:
        row[name] = None
        row[name + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
    torch.cuda.empty_cache()
    print(f"{name} batch {row['batch']}: {row[name]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-7b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--hf-tokens", type=int, default=32, help="tokens per transformers generate run")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--hf-static", action="store_true",
                    help="also time transformers with a static cache (torch.compile: slow to start)")
    ap.add_argument("--query-len", type=int, default=1,
                    help="also replay the (batch, Q) graph of a verification of Q - 1 drafts (default 1: no)")
    ap.add_argument("--sets", nargs="+", default=list(KERNEL_SETS), choices=list(KERNEL_SETS),
                    help="kernel sets to time (replay) beside the default")
    args = ap.parse_args()
    env = environment()
    bw = copy_bandwidth()
    cfg = model_config(args.shape)
    model = init_random(build_model(cfg, torch.bfloat16, "cuda"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = 1e3 * weight_bytes / bw
    rows = []
    result = {"benchmark": "decode", "shape": args.shape, "environment": env, "copy_bandwidth_GBs": bw / 1e9,
              "weight_bytes": weight_bytes, "kernel_sets": KERNEL_SETS, "prompt_len": PROMPT,
              "steps": args.steps, "rows": rows}
    max_len = PROMPT + args.steps + 64
    for b in args.batches:
        with kernel_set(model, "default"):
            r = {"batch": b, **ours(model, b, args.steps, max_len, query_len=args.query_len)}
        r["floor_ms"] = floor_ms
        r["frac_of_floor"] = floor_ms / r["step_ms"]
        r["replay_frac_of_floor"] = floor_ms / r["replay_ms"]
        rows.append(r)
        print(f"ours batch {b}: {r}", flush=True)
    path = write_result("decode", result)
    for name in (n for n in args.sets if n != "default"):
        for r in rows:
            def measure():
                with kernel_set(model, name):
                    return ours(model, r["batch"], args.steps, max_len, query_len=args.query_len)
            _compare(r, "replays_" + name, measure)
            for key in ("replay_ms", "verify_replay_ms", "step_ms"):
                other = (r.get("replays_" + name) or {}).get(key)
                r[f"{key}_{name}"] = other
                if other and r.get(key):
                    r[{"replay_ms": "x_vs_", "verify_replay_ms": "verify_x_vs_", "step_ms": "step_x_vs_"}[key]
                      + name] = other / r[key]
        write_result("decode", result)
    del model
    torch.cuda.empty_cache()
    if not args.no_hf:
        caches = ((("hf_static_tok_s", "static"),) if args.hf_static else ()) + (("hf_eager_tok_s", None),)
        for r in rows:
            for name, cache in caches:
                _compare(r, name, lambda: transformers_generate(args.shape, r["batch"], args.hf_tokens, cache))
                write_result("decode", result)
            for name, _ in caches:
                r["speedup_vs_" + name.removesuffix("_tok_s")] = r["tok_s"] / r[name] if r.get(name) else None
        write_result("decode", result)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s, weights {weight_bytes / 1e9:.2f} GB, floor {floor_ms:.2f} ms/step")
    columns = [("batch", "batch", "d"), ("replay_ms", "replay ms", ".2f"), ("floor_ms", "floor ms", ".2f"),
               ("replay_frac_of_floor", "frac floor", ".2f"), ("step_ms", "step ms", ".2f"),
               ("tok_s", "tok/s", ".0f")]
    if args.query_len > 1:
        columns += [("verify_replay_ms", f"verify q{args.query_len} ms", ".2f")]
    for name in (n for n in args.sets if n != "default"):
        columns += [("replay_ms_" + name, name + " ms", ".2f"), ("x_vs_" + name, "x vs " + name, ".2f"),
                    ("step_ms_" + name, name + " step ms", ".2f"), ("step_x_vs_" + name, "step x vs " + name, ".3f")]
        if args.query_len > 1:
            columns += [("verify_replay_ms_" + name, f"{name} verify ms", ".2f"),
                        ("verify_x_vs_" + name, "verify x vs " + name, ".2f")]
    columns += [("hf_eager_tok_s", "HF eager tok/s", ".0f"), ("speedup_vs_hf_eager", "x HF eager", ".1f"),
                ("hf_static_tok_s", "HF static tok/s", ".0f"), ("speedup_vs_hf_static", "x HF static", ".1f")]
    print(table(rows, columns))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
