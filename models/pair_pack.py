"""Packaging of the demo pair: the model card, and the tarball split into parts small enough for the
device tool (at most 8 files of 16 MiB come back), plus its reassembly here.

    python3 models/pair_pack.py unpack DIR_WITH_PARTS [--dest models]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
from pathlib import Path

PART_BYTES = 15 * 1024 * 1024
PREFIX = "models.tar.gz.part"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def pack(src: Path, names: list[str], out: Path) -> dict[str, object]:
    """tar.gz of src/<names>, split into PREFIX00, PREFIX01, ... under out; returns sha256 and parts."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in names:
            tar.add(src / name, arcname=name)
    data = buf.getvalue()
    parts = []
    for i in range(0, len(data), PART_BYTES):
        part = out / f"{PREFIX}{i // PART_BYTES:02d}"
        part.write_bytes(data[i:i + PART_BYTES])
        parts.append(part.name)
    digest = hashlib.sha256(data).hexdigest()
    (out / "models.tar.gz.sha256").write_text(f"{digest}  models.tar.gz\n")
    return {"sha256": digest, "bytes": len(data), "parts": parts}


def unpack(parts_dir: Path, dest: Path) -> list[str]:
    parts = sorted(parts_dir.glob(PREFIX + "*"))
    if not parts:
        raise SystemExit(f"{parts_dir}: no {PREFIX}* files")
    data = b"".join(p.read_bytes() for p in parts)
    want = parts_dir / "models.tar.gz.sha256"
    if want.is_file() and want.read_text().split()[0] != hashlib.sha256(data).hexdigest():
        raise SystemExit(f"{parts_dir}: sha256 of the joined parts does not match models.tar.gz.sha256")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = tar.getnames()
        if any(n.startswith(("/", "..")) or "/../" in n for n in names):
            raise SystemExit("refusing a tar member outside the destination")
        tar.extractall(dest, filter="data")
    return names


def _f(x: object, nd: int = 3) -> str:
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def model_card(m: dict[str, object]) -> str:
    """README.md of models/, every number taken from the metrics dict that make_pair.py writes."""
    s, e, c = m["settings"], m["eval"], m["corpus"]
    t, d = m["target"], m["draft"]
    arch = lambda x: (f"{x['num_hidden_layers']} layers, hidden {x['hidden_size']}, "
                      f"{x['num_attention_heads']} heads / {x['num_key_value_heads']} KV heads of "
                      f"{x['head_dim']}, MLP {x['intermediate_size']}, tied embeddings")
    pos = lambda k: ", ".join(f"{v:.2f}" for v in e[k])
    return f"""# Demo model pair: a Python-code target and its draft

Made by `models/make_pair.py` (settings below; re-make with the same command on the same machine
image, see "Re-making"). Both are `LlamaForCausalLM` checkpoints in Hugging Face format (bf16
safetensors, `config.json`, tokenizer files), loadable by `specdec.models.loader.load_model` and
`transformers.AutoTokenizer.from_pretrained` offline.

| | target (`models/target`) | draft (`models/draft`) |
|---|---|---|
| parameters (embeddings included, counted once) | {t['params']:,} | {d['params']:,} ({d['params'] / t['params']:.3f} of the target) |
| shape | {arch(t['config'])} | {arch(d['config'])} |
| training | next-token cross-entropy, {_f(t['train_seconds'], 0)} s, {t['train_tokens']:,} tokens | KL(target ‖ draft) at temperature 1: {_f(d['cotrain_seconds'], 0)} s alongside the target's training, then {_f(d['distill_seconds'], 0)} s from the final target ({d['train_tokens']:,} tokens in all) |
| best held-out loss at step | {t['best_step']} of {t['steps']} | {d['best_step']} of {d['steps']} |
| held-out perplexity | **{e['target_ppl']:.2f}** | **{e['draft_ppl']:.2f}** |
| size on disk | {t['bytes']:,} bytes | {d['bytes']:,} bytes |

## Acceptance on held-out code (γ = {e['gamma']})

Measured by running speculative decoding itself on {e['spec_prompts']} held-out prompts of
{e['spec_prompt_len']} tokens, {e['spec_new_tokens']} new tokens each; α = accepted / drafted.

| | α | tokens per target step τ | P(position i accepted), i = 1..γ |
|---|---|---|---|
| greedy | **{e['alpha_greedy']:.3f}** | {e['tau_greedy']:.2f} | {pos('accepted_at_position_greedy')} |
| temperature 1 | **{e['alpha_t1']:.3f}** | {e['tau_t1']:.2f} | {pos('accepted_at_position_t1')} |

On real held-out text (teacher-forced, {e['heldout_tokens_scored']:,} tokens): argmax agreement
{e['top1_agreement']:.3f}, mean Σ min(p, q) {e['overlap_min_pq']:.3f}, KL(p ‖ q) {e['kl_target_draft']:.3f} nats.
Check of the measuring loop: greedy speculative output equals the target's own greedy output on
{e['greedy_spec_equals_target_tokens']:.4f} of tokens ({e['greedy_spec_equals_target_rows']:.3f} of rows; fp32 ties aside, 1.0).

## Tokenizer

Byte-level BPE (GPT-2 pre-tokenizer, `tokenizers` BpeTrainer, min frequency 2), vocabulary
{s['vocab_size']}, trained on the first {c['tokenizer_chars']:,} characters of the training files.
`<|endoftext|>` (id 0) is BOS, EOS and padding; training put it before every file. No token is
added by the tokenizer itself.

## Corpus

Python source (`*.py`) of the interpreter that ran the script: its standard library and every
site-packages folder on its path ({c['python']}, {c['platform']}). Files were ordered by a hash of
`root/relative path`, read until {c['max_chars']:,} characters, skipping files that are not UTF-8
({c['skipped'].get('not_utf8', 0)}), empty ({c['skipped'].get('empty', 0)}), over {s['max_file_bytes']:,} bytes
({c['skipped'].get('too_large', 0)}) or byte-identical to one already taken ({c['skipped'].get('duplicate', 0)}).
A second hash of the path holds out {s['heldout_permille']}‰ of files.

| | files | characters | tokens |
|---|---|---|---|
| train | {c['train_files']:,} | {c['train_chars']:,} | {c['train_tokens']:,} |
| held out | {c['heldout_files']:,} | {c['heldout_chars']:,} | {c['heldout_tokens']:,} |

`corpus_manifest.tsv.gz` lists every file taken (split, root/path, bytes, characters, sha256), the
roots, the skip counts and every installed distribution with its version. Corpus sha256:
`{c['sha256']}`.

## Re-making

```
{m['command']}
```

Seed {s['seed']}; torch {m['versions']['torch']}, transformers {m['versions']['transformers']},
tokenizers {m['versions']['tokenizers']}, on {m['device']}. Training stops on time, so a re-make on
other hardware sees a different number of steps; the corpus and the tokenizer are exact given the
same machine image. Then `python3 models/pair_pack.py unpack OUTDIR` puts the pair here.
All settings: `pair_metrics.json`.

## Limits

A few-minute code model: it completes Python plausibly for a few lines and repeats itself after.
Trained with 512-token windows; longer contexts work (RoPE) but degrade.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("unpack", help="join the parts, check the sha256 and extract")
    up.add_argument("parts_dir", type=Path)
    up.add_argument("--dest", type=Path, default=Path(__file__).resolve().parent)
    card = sub.add_parser("card", help="rewrite README.md from pair_metrics.json")
    card.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args()
    if args.cmd == "unpack":
        for name in unpack(args.parts_dir, args.dest):
            print(args.dest / name)
    else:
        metrics = json.loads((args.dir / "pair_metrics.json").read_text())
        (args.dir / "README.md").write_text(model_card(metrics))


if __name__ == "__main__":
    main()
