"""The tokenizer fingerprint ignores file layout (key order, merges format) but not content."""
from __future__ import annotations

import json

from specdec.tokenizer_info import fingerprint_from_json, tokenizer_fingerprint

BASE = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]},
        "added_tokens": [], "normalizer": None}


def test_layout_does_not_matter_content_does():
    fp = fingerprint_from_json(BASE)
    reordered = {"model": {"merges": ["a b"], "vocab": {"ab": 2, "b": 1, "a": 0}, "type": "BPE"}}
    assert fingerprint_from_json(reordered) == fp and len(fp) == 64
    changed = json.loads(json.dumps(BASE))
    changed["model"]["vocab"]["ab"] = 3
    assert fingerprint_from_json(changed) != fp
    no_merge = json.loads(json.dumps(BASE))
    no_merge["model"]["merges"] = []
    assert fingerprint_from_json(no_merge) != fp


def test_reads_a_model_folder_or_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(BASE))
    assert tokenizer_fingerprint(tmp_path) == tokenizer_fingerprint(tmp_path / "tokenizer.json") \
        == fingerprint_from_json(BASE)
    assert tokenizer_fingerprint(tmp_path / "missing") == ""
