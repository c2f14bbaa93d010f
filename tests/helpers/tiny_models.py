"""Tiny random Hugging Face checkpoints (with a real byte-level BPE tokenizer) made by the tests."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

TRAINING_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding is lossless.\n",
] * 20


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return tok.to_str()


def save_tokenizer(path: Path, vocab_size: int) -> None:
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
                                   bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(path)


def make_checkpoint(path: Path, arch: str = "llama", *, vocab_size: int = 320, hidden: int = 64,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                    seed: int = 0, tie: bool = False, rope_parameters: dict | None = None,
                    max_position: int = 512, with_tokenizer: bool = True,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Saves a random model of the given architecture with save_pretrained; returns the folder."""
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
    config_cls, model_cls = classes[arch]
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_position, tie_word_embeddings=tie,
                  bos_token_id=0, eos_token_id=0)
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # Larger-than-default weights make the random model's distributions peaked, so greedy
    # decoding is not dominated by ties and acceptance between two models is informative.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif name.endswith(".bias"):  # HF zero-inits biases; random ones test that they load
                p.normal_(0.0, 0.1)
    path = Path(path)
    model.save_pretrained(path)
    if with_tokenizer:
        save_tokenizer(path, vocab_size)
    return path


def make_pair(root: Path, vocab_size: int = 320, noise: float = 0.005) -> tuple[Path, Path]:
    """(target, draft): the draft is the target with noise added, so it agrees often but not always."""
    from safetensors.torch import load_file, save_file

    target = make_checkpoint(Path(root) / "target", vocab_size=vocab_size, layers=2, seed=1)
    draft = make_checkpoint(Path(root) / "draft", vocab_size=vocab_size, layers=2, seed=1)
    weights = load_file(str(draft / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    noisy = {k: v + noise * torch.randn(v.shape, generator=gen) * (v.dim() == 2) for k, v in weights.items()}
    save_file(noisy, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return target, draft
