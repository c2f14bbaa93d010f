"""bench/anatomy.py's in-process loop on CPU engines: plain, speculative and joining steps keep both
engines consistent and give every KV block back, so a GPU run measures what it says."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `anatomy` and `services` are top-level

import anatomy  # noqa: E402
from services import write_shape_folder  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import DraftEngine, TargetEngine  # noqa: E402

SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=9000, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def test_anatomy_loop_steps_and_releases(tmp_path, monkeypatch):
    monkeypatch.setattr(anatomy, "PROMPT", 12)
    monkeypatch.setattr(anatomy, "JOIN_PROMPT", 9)
    t_dir = write_shape_folder(tmp_path / "t", SHAPE, dtype="float32")
    d_dir = write_shape_folder(tmp_path / "d", {**SHAPE, "num_hidden_layers": 1}, dtype="float32")

    def config(path, agree):
        return EngineConfig(model=path, num_blocks=64, random_weights=True, random_agreement=agree,
                            max_num_draft=3)
    target, draft = TargetEngine(config(t_dir, 1.0)), DraftEngine(config(d_dir, 0.8))
    loop = anatomy.Loop(draft, target, b=3, k=3, seed=0)
    plain = [loop.plain() for _ in range(2)]
    assert loop.tokens == 2 * 3 and all(p["target_fwd"] > 0 for p in plain)
    loop.close()                           # plain steps left the draft behind: a fresh loop for spec
    loop = anatomy.Loop(draft, target, b=3, k=3, seed=1)
    spec = [loop.spec() for _ in range(3)]
    assert all(3 <= s["tokens"] <= 3 * 4 for s in spec)   # 1..k+1 tokens per sequence per step
    join = loop.spec(join=list(range(9)))                  # the newcomer takes the last place
    assert 2 <= join["tokens"] <= 2 * 4 and target.num_sequences() == 3
    loop.spec()                                            # the sequence that sat out goes on
    loop.close()
    for engine in (draft, target):
        assert engine.num_sequences() == 0
        assert engine.num_free_blocks == engine.runner.blocks.num_blocks
    assert torch.isfinite(torch.tensor([s["draft_wall"] for s in spec])).all()
