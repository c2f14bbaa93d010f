"""The committed demo pair (models/target, models/draft) and the tools that made and measured it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import make_pair

MODELS = Path(__file__).resolve().parents[2] / "models"
sys.path.insert(0, str(MODELS))
import pair_eval  # noqa: E402
import pair_pack  # noqa: E402

committed = pytest.mark.skipif(
    not ((MODELS / "target" / "config.json").is_file() and (MODELS / "draft" / "config.json").is_file()),
    reason="the demo pair is not committed yet: make it with models/make_pair.py on the GPU machine, then "
           "`python3 models/pair_pack.py unpack OUTDIR`")


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@committed
def test_committed_pair_loads_and_keeps_the_issue_bounds():
    from transformers import AutoTokenizer

    from specdec.models.loader import load_model

    target, tcfg = load_model(MODELS / "target")
    draft, dcfg = load_model(MODELS / "draft")
    assert tcfg.architecture == dcfg.architecture == "LlamaForCausalLM"
    assert tcfg.vocab_size == dcfg.vocab_size
    assert 7_000 <= tcfg.vocab_size <= 9_000
    t_tok = AutoTokenizer.from_pretrained(MODELS / "target")
    d_tok = AutoTokenizer.from_pretrained(MODELS / "draft")
    assert t_tok.get_vocab() == d_tok.get_vocab()
    assert len(t_tok) <= tcfg.vocab_size
    text = "def area(r):\n    return 3.14159 * r ** 2\n"
    ids = t_tok(text)["input_ids"]
    assert ids == d_tok(text)["input_ids"] and t_tok.decode(ids) == text
    assert t_tok.eos_token_id in tcfg.eos_token_ids
    t, d = _n_params(target), _n_params(draft)
    assert 9_500_000 <= t <= 15_500_000, t
    assert d * 4 <= t, (d, t)
    size = pair_pack.folder_bytes(MODELS / "target") + pair_pack.folder_bytes(MODELS / "draft")
    assert size <= 30_000_000, size


@committed
def test_committed_model_card_matches_its_metrics():
    metrics = json.loads((MODELS / "pair_metrics.json").read_text())
    card = (MODELS / "README.md").read_text()
    assert card == pair_pack.model_card(metrics)
    assert (MODELS / "corpus_manifest.tsv.gz").is_file()
    assert 0.0 <= metrics["eval"]["alpha_greedy"] <= 1.0 and 0.0 <= metrics["eval"]["alpha_t1"] <= 1.0


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    t_path, d_path = make_pair(tmp_path_factory.mktemp("pair"), vocab_size=320, noise=0.05)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
    return load(t_path), load(d_path)


def _prompts(n: int, length: int, vocab: int = 320) -> torch.Tensor:
    return torch.randint(1, vocab, (n, length), generator=torch.Generator().manual_seed(3))


def test_greedy_speculative_decoding_reproduces_target_greedy(hf_pair):
    target, draft = hf_pair
    prompts = _prompts(4, 6)
    res = pair_eval.speculative_decode(target, draft, prompts, 12, 4, True, torch.Generator().manual_seed(0))
    assert torch.equal(res["tokens"], pair_eval.greedy_decode(target, prompts, 12))
    assert 0.0 < res["alpha"] < 1.0  # the noisy draft agrees often but not always
    acc = res["accepted_at_position"]
    assert all(a >= b for a, b in zip(acc, acc[1:]))  # position i+1 is reached only through i


def test_a_draft_equal_to_the_target_is_always_accepted(hf_pair):
    target, _ = hf_pair
    prompts = _prompts(3, 5)
    for greedy in (True, False):
        res = pair_eval.speculative_decode(target, target, prompts, 10, 4, greedy, torch.Generator().manual_seed(1))
        assert res["alpha"] == 1.0 and res["tau"] == 5.0


def test_evaluate_pair_reports_every_card_number(hf_pair):
    target, draft = hf_pair
    stream = torch.randint(1, 320, (600,), generator=torch.Generator().manual_seed(5))
    ev = pair_eval.evaluate_pair(target, draft, stream, seq_len=31, max_windows=4, batch=2, n_prompts=3,
                                 prompt_len=8, n_new=8, gamma=4, seed=0)
    assert ev["heldout_tokens_scored"] == 4 * 31 and ev["spec_prompts"] == 3
    assert ev["greedy_spec_equals_target_tokens"] == 1.0
    assert 0.0 <= ev["overlap_min_pq"] <= 1.0 and ev["kl_target_draft"] >= 0.0
    assert ev["target_ppl"] > 1.0 and ev["draft_ppl"] > 1.0


def test_pack_splits_and_unpack_restores(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "target").mkdir(parents=True)
    payload = torch.randint(0, 256, (300_000,), generator=torch.Generator().manual_seed(0))
    (src / "target" / "model.bin").write_bytes(bytes(payload.to(torch.uint8).tolist()))
    (src / "README.md").write_text("card\n")
    monkeypatch.setattr(pair_pack, "PART_BYTES", 100_000)
    out = tmp_path / "out"
    out.mkdir()
    packed = pair_pack.pack(src, ["target", "README.md"], out)
    assert len(packed["parts"]) >= 3  # random bytes do not compress
    dest = tmp_path / "dest"
    names = pair_pack.unpack(out, dest)
    assert "target/model.bin" in names
    assert (dest / "target" / "model.bin").read_bytes() == (src / "target" / "model.bin").read_bytes()
    (out / "models.tar.gz.sha256").write_text("0" * 64 + "  models.tar.gz\n")
    with pytest.raises(SystemExit, match="sha256"):
        pair_pack.unpack(out, dest)


def test_default_shapes_keep_the_issue_bounds():
    import make_pair

    s = make_pair.parse_args(["--out", "unused"])
    with torch.device("meta"):
        target, draft = make_pair.llama(s.target, s, 0), make_pair.llama(s.draft, s, 1)
    make_pair.check_budget(target, draft, s)  # raises SystemExit when over
    assert 10_000_000 <= make_pair.n_params(target) <= 15_000_000
    assert s.vocab_size == 8192 and s.gamma == 4


def test_corpus_is_deterministic_and_its_split_disjoint(tmp_path):
    import gzip

    import pair_corpus

    a = pair_corpus.build_corpus(400_000, 100, stdlib_only=True)
    b = pair_corpus.build_corpus(400_000, 100, stdlib_only=True)
    assert a.digest == b.digest and a.train and a.heldout
    train_keys = {f.key for f, _ in a.train}
    assert train_keys.isdisjoint(f.key for f, _ in a.heldout)
    assert all(k.startswith("stdlib/") and "site-packages" not in k for k in train_keys)
    pair_corpus.write_manifest(a, tmp_path / "m.tsv.gz", {"max_chars": 400_000})
    rows = [r for r in gzip.open(tmp_path / "m.tsv.gz", "rt").read().splitlines() if not r.startswith("#")]
    assert rows == a.manifest_lines and len(rows) == len(a.train) + len(a.heldout)
    tok = pair_corpus.train_tokenizer([t for _, t in a.train], 300, 200_000)
    ids = pair_corpus.encode_documents(tok, [t for _, t in a.heldout[:2]])
    assert ids[0] == ids[-1] == tok.token_to_id(pair_corpus.EOT) == 0
    assert tok.decode(ids[1:].tolist()).startswith(a.heldout[0][1][:50])
