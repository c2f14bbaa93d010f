"""Make the demo pair: a ~11M Llama target and a draft of at most a quarter of it, on Python source.

    PYTHONUNBUFFERED=1 python3 models/make_pair.py --out OUTDIR          # the pair (H200: ~7 min)
    .venv/bin/python models/make_pair.py --smoke --out /tmp/pair         # the pipeline in ~1 min, CPU

Phases: corpus (this interpreter's stdlib + site-packages) -> BPE -> target training, with the draft
learning KL to the target's current logits alongside -> draft distillation from the final target ->
held-out perplexity and speculative-decoding acceptance -> bf16 HF folders, model card, and a tarball
split into parts under OUTDIR (`python3 models/pair_pack.py unpack OUTDIR` puts them in models/).
Every training phase stops on time and keeps its best held-out checkpoint.
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pair_corpus  # noqa: E402
import pair_eval  # noqa: E402
import pair_pack  # noqa: E402
import pair_train  # noqa: E402

MAX_PAIR_BYTES = 30_000_000


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    head_dim: int = 64

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """'hidden,layers,heads,kv_heads,intermediate'."""
        return cls(*(int(v) for v in text.split(",")))


@dataclass(frozen=True)
class Settings:
    out: str
    seed: int
    max_chars: int
    tokenizer_chars: int
    heldout_permille: int
    max_file_bytes: int
    stdlib_only: bool
    vocab_size: int
    target: Shape
    draft: Shape
    seq_len: int
    batch: int
    target_seconds: float
    draft_seconds: float
    gen_seconds: float
    deadline_seconds: float
    cotrain: bool
    target_lr: float
    draft_lr: float
    warmup_steps: int
    weight_decay: float
    eval_every_seconds: float
    val_windows: int
    gen_batch: int
    gen_prompt_len: int
    gen_mix: float
    test_windows: int
    spec_prompts: int
    spec_prompt_len: int
    spec_new_tokens: int
    gamma: int
    device: str

    def __post_init__(self) -> None:
        if self.vocab_size > 65535:
            raise ValueError("vocab_size must fit uint16")
        if not 0 <= self.gen_mix < 1:
            raise ValueError("gen_mix must be in [0, 1)")
        if self.gen_prompt_len >= self.seq_len:
            raise ValueError("gen_prompt_len must be shorter than seq_len")


class Log:
    def __init__(self, path: Path):
        self.t0 = time.perf_counter()
        self.file = path.open("a", encoding="utf-8")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        line = f"[{self.elapsed():7.1f}s] {msg}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def llama(shape: Shape, s: Settings, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.inter,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                      max_position_embeddings=max(2048, s.seq_len), rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied embedding is one parameter


def check_budget(target, draft, s: Settings) -> None:
    """Fail before any training if the pair breaks the issue's bounds (tokenizer files ~1.2 MB)."""
    t, d = n_params(target), n_params(draft)
    if d * 4 > t:
        raise SystemExit(f"draft has {d:,} parameters, more than a quarter of the target's {t:,}")
    if 2 * (t + d) + 1_500_000 > MAX_PAIR_BYTES:
        raise SystemExit(f"{t + d:,} bf16 parameters will not fit {MAX_PAIR_BYTES:,} bytes")


def round_to_bf16(model) -> None:
    """Evaluate exactly the weights that ship (bf16 safetensors), computing in fp32."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def save(model, tok, folder: Path, s: Settings) -> None:
    copy.deepcopy(model).to("cpu", torch.bfloat16).save_pretrained(str(folder))
    pair_corpus.save_hf_tokenizer(tok, folder, model_max_length=max(2048, s.seq_len))


def parse_args(argv: list[str] | None = None) -> Settings:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--out", required=True, help="folder for the parts, metrics, manifest and log")
    a("--seed", type=int, default=1234)
    a("--max-chars", type=int, default=150_000_000, help="corpus size cap, characters")
    a("--tokenizer-chars", type=int, default=150_000_000, help="characters the BPE is trained on")
    a("--heldout-permille", type=int, default=20)
    a("--max-file-bytes", type=int, default=1_000_000)
    a("--vocab-size", type=int, default=8192)
    a("--target", type=Shape.parse, default=Shape(384, 6, 6, 6, 672), help="hidden,layers,heads,kv_heads,inter")
    a("--draft", type=Shape.parse, default=Shape(192, 4, 3, 1, 352), help="hidden,layers,heads,kv_heads,inter")
    a("--seq-len", type=int, default=512)
    a("--batch", type=int, default=64)
    a("--target-seconds", type=float, default=150)
    a("--draft-seconds", type=float, default=140)
    a("--gen-seconds", type=float, default=20, help="time the target spends writing distillation data")
    a("--deadline-seconds", type=float, default=500, help="training phases shrink to end all by this")
    a("--no-cotrain", action="store_true", help="train the draft only after the target")
    a("--target-lr", type=float, default=2e-3)
    a("--draft-lr", type=float, default=3e-3)
    a("--warmup-steps", type=int, default=100)
    a("--weight-decay", type=float, default=0.1)
    a("--eval-every-seconds", type=float, default=10)
    a("--val-windows", type=int, default=64)
    a("--gen-batch", type=int, default=1024)
    a("--gen-prompt-len", type=int, default=64)
    a("--gen-mix", type=float, default=0.25, help="share of distillation batches from generated rows")
    a("--test-windows", type=int, default=1024)
    a("--spec-prompts", type=int, default=128)
    a("--spec-prompt-len", type=int, default=128)
    a("--spec-new-tokens", type=int, default=128)
    a("--gamma", type=int, default=4)
    a("--smoke", action="store_true", help="tiny stdlib corpus and tiny models on the CPU (~1 min)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.max_chars = args.tokenizer_chars = 3_000_000
        args.vocab_size, args.seq_len, args.batch = 512, 128, 8
        args.target, args.draft = Shape(128, 2, 2, 2, 256), Shape(64, 1, 1, 1, 128)
        args.target_seconds, args.draft_seconds, args.gen_seconds = 8, 6, 2
        args.eval_every_seconds, args.val_windows, args.test_windows = 3, 8, 16
        args.gen_batch, args.gen_prompt_len, args.warmup_steps = 8, 32, 10
        args.spec_prompts, args.spec_prompt_len, args.spec_new_tokens = 4, 32, 24
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Settings(out=args.out, seed=args.seed, max_chars=args.max_chars, tokenizer_chars=args.tokenizer_chars,
                    heldout_permille=args.heldout_permille, max_file_bytes=args.max_file_bytes,
                    stdlib_only=args.smoke, vocab_size=args.vocab_size, target=args.target, draft=args.draft,
                    seq_len=args.seq_len, batch=args.batch, target_seconds=args.target_seconds,
                    draft_seconds=args.draft_seconds, gen_seconds=args.gen_seconds,
                    deadline_seconds=args.deadline_seconds, cotrain=not args.no_cotrain,
                    target_lr=args.target_lr, draft_lr=args.draft_lr, warmup_steps=args.warmup_steps,
                    weight_decay=args.weight_decay, eval_every_seconds=args.eval_every_seconds,
                    val_windows=args.val_windows, gen_batch=args.gen_batch, gen_prompt_len=args.gen_prompt_len,
                    gen_mix=args.gen_mix, test_windows=args.test_windows, spec_prompts=args.spec_prompts,
                    spec_prompt_len=args.spec_prompt_len, spec_new_tokens=args.spec_new_tokens,
                    gamma=args.gamma, device=device)


def main(argv: list[str] | None = None) -> None:
    s = parse_args(argv)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "make_pair.log")
    command = "PYTHONUNBUFFERED=1 python3 models/make_pair.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    log(f"settings {asdict(s)}")
    import tokenizers
    import transformers
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__, "numpy": np.__version__, "python": sys.version.split()[0]}
    dev_name = torch.cuda.get_device_name() if s.device == "cuda" else "CPU"
    log(f"versions {versions}; device {dev_name}")
    if s.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    target = llama(s.target, s, s.seed)
    draft = llama(s.draft, s, s.seed + 1)
    check_budget(target, draft, s)
    log(f"target {n_params(target):,} parameters, draft {n_params(draft):,} "
        f"({n_params(draft) / n_params(target):.3f} of it)")

    corpus = pair_corpus.build_corpus(s.max_chars, s.heldout_permille, s.max_file_bytes, s.stdlib_only)
    log(f"corpus {len(corpus.train)} train files ({corpus.train_chars:,} chars), {len(corpus.heldout)} held out "
        f"({corpus.heldout_chars:,} chars); skipped {corpus.skipped}; roots {corpus.roots}; sha256 {corpus.digest}")
    train_texts = [t for _, t in corpus.train]
    tok = pair_corpus.train_tokenizer(train_texts, s.vocab_size, s.tokenizer_chars)
    if tok.get_vocab_size() != s.vocab_size:
        log(f"warning: the BPE stopped at {tok.get_vocab_size()} tokens; models keep {s.vocab_size} rows")
    log("tokenizer trained")
    train_ids = pair_corpus.encode_documents(tok, train_texts)
    held_ids = pair_corpus.encode_documents(tok, [t for _, t in corpus.heldout])
    log(f"tokens: train {train_ids.size:,} ({corpus.train_chars / train_ids.size:.2f} chars/token), "
        f"held out {held_ids.size:,}")

    dev = torch.device(s.device)
    gen = torch.Generator(device=dev).manual_seed(s.seed)
    ids = torch.from_numpy(train_ids.astype(np.int64)).to(dev)
    held = torch.from_numpy(held_ids.astype(np.int64)).to(dev)
    n_val = min(s.val_windows * (s.seq_len + 1), held.numel() // 2)
    val = pair_eval.windows(held[:n_val], s.seq_len + 1, s.val_windows)  # model selection
    test = held[n_val:]                                                   # the card's numbers
    stream = pair_train.Stream(ids, s, gen)
    target.to(dev)
    draft.to(dev)

    def budget(want: float, later: float) -> float:
        left = s.deadline_seconds - log.elapsed() - later - (10 if s.stdlib_only else 45)
        if left < want:
            log(f"phase shortened from {want:.0f}s to {max(left, 5):.0f}s to meet the deadline")
        return max(5.0, min(want, left))

    t_info = pair_train.train_target(target, draft if s.cotrain else None, stream, val,
                          budget(s.target_seconds, s.gen_seconds + s.draft_seconds), s, log)
    cotrain_tokens = t_info["train_tokens"] if s.cotrain else 0
    stream.generated = pair_train.generate_rows(target, stream, budget(s.gen_seconds, s.draft_seconds), s, log)
    d_info = pair_train.distill_draft(target, draft, stream, val, budget(s.draft_seconds, 0), s, log)

    for m in (target, draft):
        round_to_bf16(m)
    stage = out / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    save(target, tok, stage / "target", s)
    save(draft, tok, stage / "draft", s)
    settings = {k: (asdict(v) if isinstance(v, Shape) else v) for k, v in asdict(s).items()}
    pair_corpus.write_manifest(corpus, stage / "corpus_manifest.tsv.gz",
                               {k: settings[k] for k in ("max_chars", "heldout_permille", "max_file_bytes",
                                                         "stdlib_only", "seed")})
    names = ["target", "draft", "corpus_manifest.tsv.gz"]
    pair_pack.pack(stage, names, out)  # the trained pair comes back even if the evaluation fails
    log("saved the pair (before evaluation)")

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 evaluation: greedy ties resolve alike in both loops
    try:
        ev = pair_eval.evaluate_pair(target, draft, test, seq_len=s.seq_len, max_windows=s.test_windows,
                                     batch=max(1, s.batch // 2), n_prompts=s.spec_prompts,
                                     prompt_len=s.spec_prompt_len, n_new=s.spec_new_tokens, gamma=s.gamma,
                                     seed=s.seed)
    except Exception:
        log("evaluation failed:\n" + traceback.format_exc())
        raise
    log("eval " + json.dumps(ev))

    t_bytes, d_bytes = pair_pack.folder_bytes(stage / "target"), pair_pack.folder_bytes(stage / "draft")
    metrics = {
        "command": command, "versions": versions, "device": dev_name, "settings": settings,
        "seconds_total": round(log.elapsed(), 1),
        "corpus": {"sha256": corpus.digest, "roots": corpus.roots, "skipped": corpus.skipped,
                   "max_chars": s.max_chars, "tokenizer_chars": min(s.tokenizer_chars, corpus.train_chars),
                   "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
                   "train_chars": corpus.train_chars, "heldout_chars": corpus.heldout_chars,
                   "train_tokens": int(train_ids.size), "heldout_tokens": int(held_ids.size),
                   "val_tokens": int(val.numel()), **{k: v for k, v in pair_corpus.environment().items()
                                                     if k in ("python", "platform")}},
        "target": {**t_info, "params": n_params(target), "bytes": t_bytes,
                   "config": json.loads((stage / "target" / "config.json").read_text())},
        "draft": {**d_info, "params": n_params(draft), "bytes": d_bytes, "cotrain_tokens": cotrain_tokens,
                  "cotrain_seconds": t_info["train_seconds"] if s.cotrain else 0,
                  "train_tokens": cotrain_tokens + d_info["distill_tokens"],
                  "generated_rows": 0 if stream.generated is None else int(stream.generated.shape[0]),
                  "config": json.loads((stage / "draft" / "config.json").read_text())},
        "eval": ev,
        "pair_bytes": t_bytes + d_bytes,
    }
    if t_bytes + d_bytes > MAX_PAIR_BYTES:
        log(f"WARNING: the pair takes {t_bytes + d_bytes:,} bytes, over {MAX_PAIR_BYTES:,}")
    (out / "pair_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    shutil.copy(out / "pair_metrics.json", stage / "pair_metrics.json")
    (stage / "README.md").write_text(pair_pack.model_card(metrics))
    packed = pair_pack.pack(stage, names + ["README.md", "pair_metrics.json"], out)
    shutil.rmtree(stage)
    log(f"done: parts {packed['parts']} ({packed['bytes']:,} bytes, sha256 {packed['sha256']}); "
        f"target ppl {ev['target_ppl']:.2f}, draft ppl {ev['draft_ppl']:.2f}, "
        f"alpha greedy {ev['alpha_greedy']:.3f}, alpha T=1 {ev['alpha_t1']:.3f}")

if __name__ == "__main__":
    main()
