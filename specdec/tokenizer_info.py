"""Tokenizer fingerprint: equal fingerprints mean two tokenizers map text to the same ids.

Torch-free on purpose: the coordinator (which imports no torch) computes the fingerprint of its own
tokenizer and compares it with the ones the model servers report in ModelInfo.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"


def _canonical_vocab(vocab: Any) -> Any:
    # BPE/WordPiece/WordLevel: {token: id}; listed by id so key order in the file does not matter.
    # Unigram: [[piece, score], ...] is already ordered by id.
    if isinstance(vocab, dict):
        return sorted(([tok, int(i)] for tok, i in vocab.items()), key=lambda x: x[1])
    return vocab


def _canonical_merges(merges: Any) -> list[list[str]]:
    # tokenizers < 0.20 writes merges as "a b" strings, newer versions as ["a", "b"] pairs.
    return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges or []]


def fingerprint_from_json(tokenizer: dict[str, Any]) -> str:
    """sha256 (hex) over the tokenizer model's type, vocabulary (by id) and merges."""
    model = tokenizer.get("model") or {}
    canonical = {"type": model.get("type"), "vocab": _canonical_vocab(model.get("vocab")),
                 "merges": _canonical_merges(model.get("merges"))}
    blob = json.dumps(canonical, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(path: str | Path) -> str:
    """Fingerprint of a model folder's tokenizer.json (or of that file itself); "" when absent."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        return ""
    return fingerprint_from_json(json.loads(file.read_text(encoding="utf-8")))
