"""Frozen configuration objects, built once in each process's __main__ and passed explicitly."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names it."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise ConfigError(f"dtype: unknown {name!r}, expected one of {sorted(DTYPES)}")
    return DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling.rope_type: unsupported {self.type!r}, expected one of {ROPE_TYPES}")
        if self.theta <= 0 or self.factor <= 0:
            raise ConfigError("rope_theta and rope factor must be positive")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "RopeConfig":
        # transformers 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        kwargs: dict[str, Any] = {"theta": float(theta), "type": rope_type}
        if rope_type in ("linear", "llama3"):
            kwargs["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kwargs["low_freq_factor"] = float(params["low_freq_factor"])
            kwargs["high_freq_factor"] = float(params["high_freq_factor"])
            kwargs["original_max_position"] = int(params["original_max_position_embeddings"])
        return cls(**kwargs)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architectures: {self.architecture!r} is not supported, expected one of {SUPPORTED_ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_key_value_heads ({self.num_kv_heads}) must divide "
                              f"num_attention_heads ({self.num_heads})")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' entry")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {arch!r} is not supported, expected one of {SUPPORTED_ARCHITECTURES}")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position=hf.get("max_position_embeddings", 2048),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o bias; Llama/Mistral say so in attention_bias.
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model path {path}: no config.json")
        return cls.from_hf(json.loads(config_file.read_text()))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    num_blocks: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size
