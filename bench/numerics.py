"""Does an op set change what the demo pair computes? Greedy agreement in bf16 on the GPU for each op
set (torch ops, fused kernels, fused + GEMV), against the same models in fp32 on the torch ops.

Along the fp32 target's own greedy continuation of real prompts (the frozen Python source windows
of bench/data/code_windows.json; the first run, in bench/results/numerics.json, used the live
specdec/*.py files), every
token is fed one decode step at a time (M = 1, what plain decoding and the draft run) to:
- the target in bf16: top-1 agreement with the fp32 target (1.0 = no rounding flip);
- the draft in bf16: top-1 agreement with the fp32 target's token (the greedy acceptance a
  speculative step would see, position by position);
and the same target tokens once more as 5-token verify chunks (M = 5: what verification runs).

    python3 bench/numerics.py [--prompts 16] [--tokens 64] [--device cuda]

Writes bench/results/numerics.json.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common import environment, table, write_result

import torch  # noqa: E402

from specdec.config import CacheConfig  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.runner import ModelRunner, SeqInput  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OP_SETS = {"torch-ops": dict(fused_kernels=False, gemv_kernels=False),
           "fused": dict(fused_kernels=True, gemv_kernels=False),
           "fused+gemv": dict(fused_kernels=True, gemv_kernels=True),
           # decode and verify steps replayed from CUDA graphs, bucketed as a server captures them
           "torch-ops graphed": dict(fused_kernels=False, gemv_kernels=False, graphs=True),
           "fused+gemv graphed": dict(fused_kernels=True, gemv_kernels=True, graphs=True)}
VERIFY = 5


def prompts(n: int, length: int = 48) -> list[list[int]]:
    import json
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(ROOT / "models" / "target" / "tokenizer.json"))
    windows = json.loads((ROOT / "bench" / "data" / "code_windows.json").read_text())["windows"]
    out = [ids[:length] for ids in (tok.encode(w["text"]).ids for w in windows) if len(ids) >= length]
    return out[:n]


def runner_for(name: str, dtype: torch.dtype, device: str, graphs: bool = False, **ops) -> ModelRunner:
    model, _ = load_model(ROOT / "models" / name, dtype, device, **ops)
    runner = ModelRunner(model, CacheConfig(num_blocks=512, block_size=16, dtype=dtype))
    if graphs:
        runner.enable_cuda_graphs(max_model_len=1024, query_lens=(1, VERIFY), batch_sizes=(1, 2, 4, 8))
    return runner


def argmax_steps(runner: ModelRunner, prompt: list[int], cont: list[int], chunk: int) -> list[int]:
    """Prefill the prompt, then feed cont in chunks of `chunk` tokens; the argmax after the prompt and
    after each fed token (len(cont) + 1 predictions)."""
    runner.add_sequence("s")
    try:
        preds = runner.step([SeqInput("s", prompt)])[0].argmax(-1).tolist()
        for i in range(0, len(cont), chunk):
            piece = cont[i:i + chunk]
            preds += runner.step([SeqInput("s", piece, num_logits=len(piece))])[0].argmax(-1).tolist()
        return preds
    finally:
        runner.free("s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    ps = prompts(args.prompts)
    ref = runner_for("target", torch.float32, args.device, fused_kernels=False, gemv_kernels=False)
    conts = []
    for p in ps:  # the fp32 target's greedy continuation
        seq = []
        ref.add_sequence("g")
        logits = ref.step([SeqInput("g", p)])[0]
        for _ in range(args.tokens):
            seq.append(int(logits[-1].argmax()))
            logits = ref.step([SeqInput("g", [seq[-1]])])[0]
        ref.free("g")
        conts.append(seq)
    want = [c + [None] for c in conts]  # prediction i should be cont[i]; the last one is unchecked
    rows = []
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for name, ops in OP_SETS.items():
        if args.device != "cuda" and name != "torch-ops":
            continue
        target, draft = runner_for("target", dtype, args.device, **ops), runner_for("draft", dtype, args.device, **ops)
        agree = {"target_m1": [0, 0], "target_verify": [0, 0], "draft_m1": [0, 0]}
        for p, c, w in zip(ps, conts, want):
            for key, runner, chunk in (("target_m1", target, 1), ("target_verify", target, VERIFY),
                                       ("draft_m1", draft, 1)):
                got = argmax_steps(runner, p, c, chunk)
                pairs = [(g, x) for g, x in zip(got, w) if x is not None]
                agree[key][0] += sum(g == x for g, x in pairs)
                agree[key][1] += len(pairs)
        row = {"op_set": name, "dtype": str(dtype).removeprefix("torch."),
               "graph_replays": target.graphs.replays if target.graphs else 0}
        row.update({k: a / n for k, (a, n) in agree.items()})
        rows.append(row)
        print(row, flush=True)
        del target, draft
    result = {"benchmark": "numerics", "environment": environment(), "device": args.device,
              "prompts": len(ps), "tokens": args.tokens, "rows": rows}
    path = write_result("numerics", result)
    print(table(rows, [("op_set", "op set", "s"), ("dtype", "dtype", "s"),
                       ("target_m1", "target top-1 = fp32 (M=1)", ".4f"),
                       ("target_verify", f"target top-1 = fp32 (M={VERIFY})", ".4f"),
                       ("draft_m1", "draft top-1 = fp32 target", ".4f")]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
