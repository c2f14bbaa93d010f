"""The Python-source corpus of the demo pair: which files, in what order, which are held out, and the BPE.

The corpus is this interpreter's standard library plus every site-packages folder on sys.path, so it
is exactly reproducible on the same machine image and the manifest says what was read on another.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import platform
import site
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

EOT = "<|endoftext|>"


@dataclass(frozen=True)
class SourceFile:
    key: str        # "<root label>/<path relative to the root>", what the order and split hash
    path: Path
    nbytes: int


@dataclass(frozen=True)
class Corpus:
    roots: dict[str, str]                   # root label -> absolute folder
    train: list[tuple[SourceFile, str]]     # (file, text) in selection order
    heldout: list[tuple[SourceFile, str]]
    manifest_lines: list[str]               # one TSV row per selected file
    skipped: dict[str, int]                 # reason -> count
    digest: str                             # sha256 over the manifest rows: one name for the whole corpus

    @property
    def train_chars(self) -> int:
        return sum(len(t) for _, t in self.train)

    @property
    def heldout_chars(self) -> int:
        return sum(len(t) for _, t in self.heldout)


def _h(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def source_roots(stdlib_only: bool = False) -> dict[str, str]:
    """stdlib plus each site/dist-packages folder of this interpreter (venv or system), deduplicated."""
    roots = {"stdlib": os.path.realpath(sysconfig.get_paths()["stdlib"])}
    if stdlib_only:
        return roots
    candidates = list(site.getsitepackages()) + [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    candidates += [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    seen = set(roots.values())
    for p in candidates:
        real = os.path.realpath(p)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            roots[f"site{len(roots)}"] = real
    return roots


def list_files(roots: dict[str, str], max_file_bytes: int) -> tuple[list[SourceFile], dict[str, int]]:
    skipped = {"too_large": 0, "empty": 0}
    all_roots = set(roots.values())
    files: list[SourceFile] = []
    for label, root in sorted(roots.items()):
        for dirpath, dirnames, filenames in os.walk(root):
            # A stdlib folder holds the base interpreter's site-packages: installed packages are read
            # only from this interpreter's own roots, each once, under its own label.
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "site-packages", "dist-packages")
                                 and os.path.join(dirpath, d) not in all_roots)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = Path(dirpath, name)
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if size == 0:
                    skipped["empty"] += 1
                elif size > max_file_bytes:
                    skipped["too_large"] += 1  # generated tables (unicode data, vendored blobs), not code
                else:
                    files.append(SourceFile(f"{label}/{path.relative_to(root).as_posix()}", path, size))
    return files, skipped


def build_corpus(max_chars: int, heldout_permille: int, max_file_bytes: int = 1_000_000,
                 stdlib_only: bool = False) -> Corpus:
    """Files in an order fixed by a hash of their key (a mix of all packages, not alphabetical),
    read until max_chars; duplicates by content are dropped so no text is both trained and held out."""
    roots = source_roots(stdlib_only)
    files, skipped = list_files(roots, max_file_bytes)
    skipped.update(not_utf8=0, duplicate=0)
    files.sort(key=lambda f: (_h("order:" + f.key), f.key))
    seen: set[bytes] = set()
    train, heldout, rows, chars = [], [], [], 0
    for f in files:
        if chars >= max_chars:
            break
        try:
            raw = f.path.read_bytes()
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        except OSError:
            continue
        digest = hashlib.sha256(raw).digest()
        if digest in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        split = "heldout" if _h("split:" + f.key) % 1000 < heldout_permille else "train"
        (heldout if split == "heldout" else train).append((f, text))
        rows.append(f"{split}\t{f.key}\t{len(raw)}\t{len(text)}\t{digest.hex()}")
        chars += len(text)
    whole = hashlib.sha256("\n".join(rows).encode()).hexdigest()
    return Corpus(roots, train, heldout, rows, skipped, whole)


def environment() -> dict[str, object]:
    dists = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                    if d.metadata["Name"]}, key=str.lower)
    return {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "platform": platform.platform(), "executable": sys.executable, "distributions": dists}


def write_manifest(corpus: Corpus, path: Path, settings: dict[str, object]) -> None:
    env = environment()
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(f"# corpus sha256 (of the rows below, newline-joined): {corpus.digest}\n")
        for k, v in settings.items():
            f.write(f"# setting {k}: {v}\n")
        for label, root in corpus.roots.items():
            f.write(f"# root {label}: {root}\n")
        for k, v in corpus.skipped.items():
            f.write(f"# skipped {k}: {v}\n")
        for k in ("python", "implementation", "platform", "executable"):
            f.write(f"# {k}: {env[k]}\n")
        for d in env["distributions"]:
            f.write(f"# installed {d}\n")
        f.write("# split\tkey\tbytes\tchars\tsha256\n")
        for row in corpus.manifest_lines:
            f.write(row + "\n")


def train_tokenizer(texts: list[str], vocab_size: int, max_chars: int):
    """Byte-level BPE (GPT-2 pre-tokenizer, so indentation runs become tokens) on the first max_chars."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        used = 0
        for t in texts:
            if used >= max_chars:
                return
            used += len(t)
            yield t

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample(), trainer=trainer)
    return tok


def encode_documents(tok, texts: list[str], chunk: int = 4096):
    """One uint16 stream: <|endoftext|> before every file (the BOS of a document, the EOS of the last)."""
    import numpy as np

    eot = tok.token_to_id(EOT)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: no offsets, same ids
    parts = []
    for i in range(0, len(texts), chunk):
        for enc in encode(texts[i:i + chunk], add_special_tokens=False):
            parts.append(np.array([eot] + enc.ids, dtype=np.uint16))
    parts.append(np.array([eot], dtype=np.uint16))
    return np.concatenate(parts)


def save_hf_tokenizer(tok, folder: Path, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   model_max_length=model_max_length)
    fast.save_pretrained(str(folder))
