"""Our runtime against transformers' own implementation, on tiny random checkpoints."""
import json

import pytest
import torch
import transformers

from specdec.config import CacheConfig, ConfigError, ModelConfig
from specdec.models.loader import CheckpointError, load_model
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.tiny_models import make_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-tied-mha": dict(arch="llama", tie=True, kv_heads=4),
    "llama3-rope": dict(arch="llama", rope_parameters=LLAMA3_ROPE),
    "llama-linear-rope": dict(arch="llama", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 10000.0}),
    "mistral": dict(arch="mistral", kv_heads=1),
    "qwen2": dict(arch="qwen2"),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), with_tokenizer=False,
                           **VARIANTS[request.param])
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, ref


def hf_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def test_qwen2_checkpoint_really_has_qkv_biases(tmp_path):
    path = make_checkpoint(tmp_path, arch="qwen2", with_tokenizer=False)
    model, cfg = load_model(path)
    assert cfg.qkv_bias and not cfg.o_bias
    assert model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0


def test_mixed_batch_prefill_decode_verify_matches_transformers(checkpoint):
    name, path, ref = checkpoint
    model, cfg = load_model(path)
    runner = ModelRunner(model, CacheConfig(num_blocks=64, block_size=4))
    gen = torch.Generator().manual_seed(0)
    seqs = {s: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
            for s, n in [("a", 23), ("b", 9), ("c", 14)]}
    # Step 1: a and b prefill part of their prompt (a in a non-final chunk without logits).
    for s in seqs:
        runner.add_sequence(s)
    runner.step([SeqInput("a", seqs["a"][:7], 0), SeqInput("b", seqs["b"][:5], 5)])
    # Step 2, one mixed batch: a's next prompt chunk with all logits, b decodes 1 token,
    # c prefills its whole prompt, then more steps verifying several tokens at once.
    out = runner.step([SeqInput("a", seqs["a"][7:19], 12), SeqInput("b", seqs["b"][5:6], 1),
                       SeqInput("c", seqs["c"][:10], 10)])
    out2 = runner.step([SeqInput("c", seqs["c"][10:], 4), SeqInput("a", seqs["a"][19:], 4),
                        SeqInput("b", seqs["b"][6:], 3)])
    expected = {s: hf_logits(ref, ids) for s, ids in seqs.items()}
    torch.testing.assert_close(out[0], expected["a"][7:19], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], expected["b"][5:6], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[2], expected["c"][:10], atol=1e-4, rtol=0)
    torch.testing.assert_close(out2[0], expected["c"][10:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out2[1], expected["a"][19:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out2[2], expected["b"][6:], atol=1e-4, rtol=0)


def test_greedy_64_tokens_equals_transformers_generate(checkpoint):
    name, path, ref = checkpoint
    model, cfg = load_model(path)
    runner = ModelRunner(model, CacheConfig(num_blocks=32, block_size=16))
    prompt = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        # No EOS: the comparison runs the full 64 tokens (min_new_tokens would mask EOS logits instead).
        ref.generation_config.eos_token_id = None
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert len(hf) == 64
    runner.add_sequence(0)
    ours, new = [], prompt
    for _ in range(64):
        token = int(runner.step([SeqInput(0, new)])[0][-1].argmax())
        ours.append(token)
        new = [token]
    assert ours == hf


def test_truncate_then_reappend_equals_never_having_the_rejected_tokens(checkpoint):
    name, path, _ = checkpoint
    model, cfg = load_model(path)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, cfg.vocab_size, (11,), generator=gen).tolist()
    rejected = torch.randint(0, cfg.vocab_size, (6,), generator=gen).tolist()
    accepted = torch.randint(0, cfg.vocab_size, (5,), generator=gen).tolist()

    rolled = ModelRunner(model, CacheConfig(num_blocks=16, block_size=4))
    rolled.add_sequence(0)
    rolled.step([SeqInput(0, prompt + rejected, 1)])
    free_with_rejected = rolled.blocks.num_free
    rolled.truncate(0, len(prompt))
    assert rolled.blocks.num_free > free_with_rejected  # the blocks only the drafts used came back
    after_rollback = rolled.step([SeqInput(0, accepted, len(accepted))])[0]

    clean = ModelRunner(model, CacheConfig(num_blocks=16, block_size=4))
    clean.add_sequence(0)
    clean.step([SeqInput(0, prompt, 1)])
    never = clean.step([SeqInput(0, accepted, len(accepted))])[0]
    torch.testing.assert_close(after_rollback, never, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_load_is_close_to_fp32(tmp_path, dtype):
    path = make_checkpoint(tmp_path, with_tokenizer=False)
    ids = list(range(1, 20))
    logits = {}
    for dt in (torch.float32, dtype):
        model, _ = load_model(path, dtype=dt)
        assert model.embed_tokens.weight.dtype == dt
        runner = ModelRunner(model, CacheConfig(num_blocks=8, block_size=16, dtype=dt))
        runner.add_sequence(0)
        logits[dt] = runner.step([SeqInput(0, ids, len(ids))])[0]
    ref = logits[torch.float32]
    rel = (logits[dtype] - ref).norm() / ref.norm()
    assert rel < 3e-2, rel


def test_sharded_checkpoint_loads(tmp_path):
    path = make_checkpoint(tmp_path / "src", with_tokenizer=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model, cfg = load_model(tmp_path / "sharded")
    runner = ModelRunner(model, CacheConfig(num_blocks=8, block_size=16))
    runner.add_sequence(0)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.testing.assert_close(runner.step([SeqInput(0, ids, 8)])[0], hf_logits(ref, ids), atol=1e-4, rtol=0)


def test_unknown_architecture_is_named(tmp_path):
    path = make_checkpoint(tmp_path, with_tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="GPTNeoXForCausalLM"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path, with_tokenizer=False)
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path, with_tokenizer=False)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: shape \(7,\)"):
        load_model(path)


def test_config_validation_names_the_field():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 2}
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig.from_hf(hf)
    with pytest.raises(ConfigError, match="rope_type"):
        ModelConfig.from_hf({**hf, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
