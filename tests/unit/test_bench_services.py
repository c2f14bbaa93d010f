"""Helpers of the service benchmarks (bench/services.py): weightless shape folders serve through
--random-weights engines and load in transformers, and α solved from tokens per step."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` and `services` are top-level

from services import has_weights, leviathan_alpha, write_shape_folder  # noqa: E402

SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=9000, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def test_shape_folder_serves_random_weights(tmp_path):
    import transformers
    from specdec.config import EngineConfig
    from specdec.engine import TargetEngine, VerifySeqInput
    from specdec.tokenizer_info import tokenizer_fingerprint

    path = write_shape_folder(tmp_path / "t", SHAPE, dtype="float32")
    other = write_shape_folder(tmp_path / "d", {**SHAPE, "num_hidden_layers": 1}, dtype="float32")
    assert not has_weights(path)
    assert tokenizer_fingerprint(path) == tokenizer_fingerprint(other) != ""  # one shared tokenizer
    engine = TargetEngine(EngineConfig(model=path, num_blocks=8, random_weights=True))
    assert engine.model_config.vocab_size == 9000 and engine.model_config.num_layers == 2
    # ids past the borrowed tokenizer's 8192 are fine for the model
    out = engine.verify([VerifySeqInput(1, [5, 17, 8191, 8999, 3], first=True)]).outputs[0]
    assert out.error is None and 0 <= out.next_token < 9000
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    assert hf.config.vocab_size == 9000 and hf.config.num_hidden_layers == 2


@pytest.mark.parametrize("alpha, gamma", [(0.0, 4), (0.3, 1), (0.835, 4), (0.99, 8)])
def test_alpha_from_tokens_per_step(alpha, gamma):
    tau = sum(alpha ** i for i in range(gamma + 1))
    assert leviathan_alpha(tau, gamma) == pytest.approx(alpha, abs=1e-9)
    assert leviathan_alpha(gamma + 2, gamma) is None


def test_scrape_of_nothing_is_empty():
    from coordinator.launch import free_port
    from specdec.metrics import scrape
    assert scrape(f"127.0.0.1:{free_port()}") == {} and scrape(None) == {}
