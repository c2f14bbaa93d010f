"""Frozen configuration objects, built once in each process's __main__ and passed explicitly."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protos.wire import InvalidInput

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ConfigError(InvalidInput):
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


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str | int) -> int:
    """Bytes from '4GiB', '512MB', '1.5gib' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower()
    num = s.rstrip("abgikm")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"kv_memory: cannot read {text!r} as a size (e.g. 4GiB)") from None
    if unit not in _SIZE_UNITS or value <= 0:
        raise ConfigError(f"kv_memory: cannot read {text!r} as a positive size (e.g. 4GiB)")
    return int(value * _SIZE_UNITS[unit])


# Prompt-chunk lengths with a CUDA graph each (per batch size) when EngineConfig does not say: up
# to the coordinator's default 512-token chunk; a chunk over the largest runs eagerly.
DEFAULT_GRAPH_PREFILL_LENS = (16, 32, 64, 128, 256, 512)
# One shorter decode/verify graph set by default: on the H200 (session 14, bench/timeline.py) the 7B's
# b 1 forward at a 128-token context took 3837 us on graphs planned for a 4096 bound and 3747 us on
# a 256 set (the attention's split merge 112 -> 27 us over 32 layers).
DEFAULT_GRAPH_CONTEXT_LENS = (256,)
TP_ALL_REDUCE_MODES = ("auto", "nccl", "one-shot")  # EngineConfig.tp_all_reduce (collectives.py)


def rank_devices(device: str, size: int, rank: int = 0) -> list[str]:
    """The device of every rank of a tensor-parallel group of `size` (serving/tensor_parallel.py),
    given rank `rank`'s: consecutive GPUs from rank 0's, or the CPU for every rank."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1 or not device.startswith("cuda"):
        return [device] * size
    first = (torch.device(device).index or 0) - rank
    available = torch.cuda.device_count()
    if first + size > available:
        raise ConfigError(f"tensor_parallel_size {size} from {device} needs GPUs {first}..{first + size - 1}; "
                          f"{available} visible")
    return [f"cuda:{first + r}" for r in range(size)]


@dataclass(frozen=True)
class EngineConfig:
    """What a model server's engine needs: model, device, KV sizing, limits of a step."""
    model: Path
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    num_blocks: int | None = None     # exactly this many KV blocks, or
    kv_memory: int | None = None      # this many bytes of KV; neither: see default_kv_memory()
    max_model_len: int | None = None  # None: the model's max_position
    max_num_draft: int = 16           # largest num_draft (and verify length - 1) a step accepts
    probs_dtype: torch.dtype = torch.float16  # draft probability transport (fp16 or bf16)
    warmup_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    cuda_graphs: bool = True          # on cuda: capture decode/verify graphs at start-up
    sampler_graphs: bool = True       # with cuda_graphs, sampling and rejection on graphs (sampling/graphs.py)
    sampled_chains: bool = True       # with sampler_graphs, the draft chains sampled positions (cuda_graphs.py)
    gemv_kernels: bool | None = None  # Triton GEMV for linears of <= 16-token steps; None: on cuda
    pdl: bool | None = None           # programmatic dependent launch (kernels/pdl.py, process-wide);
                                      # None: leave the process default (on for Hopper+, SPECDEC_PDL=0 off)
    blas: str | None = None           # on cuda, the library of torch's matrix products (kernels/blas.py:
                                      # cublas or cublaslt); None: blas.DEFAULT (cublaslt)
    graph_query_lens: tuple[int, ...] | None = None  # None: the engine's own (draft 1,2; target 1..k+1)
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # larger batches run eagerly
    # Prompt-chunk bounds of the prefill graphs (steps mixing a prompt with decode/verify tokens,
    # cuda_graphs.py); () none; None: DEFAULT_GRAPH_PREFILL_LENS up to max_model_len
    graph_prefill_lens: tuple[int, ...] | None = None
    # Shorter context bounds, each with a decode/verify graph set of its own, planned for that
    # bound (cuda_graphs.GraphSets: fewer KV splits at short contexts); () only max_model_len's;
    # None: DEFAULT_GRAPH_CONTEXT_LENS (bounds at or over max_model_len are dropped)
    graph_context_lens: tuple[int, ...] | None = None
    # target: after answering a step, admit and stage the step that usually follows (the same
    # greedy sequences, each with its next token and the step's most drafts), so that the next verify skips
    # that host work when it matches (TargetEngine.prepare_ahead). The servers turn it on for cuda
    # (session 36, H200, 7B + 68m: +4-6% speculative tok/s at b 8 in both orders of an A/B, b 1 even)
    verify_ahead: bool = False
    random_weights: bool = False      # random weights of config.json's shape, no checkpoint (benchmarks)
    # with random_weights: weights whose greedy next token agrees with a shared reference map on this
    # fraction of the vocabulary (models/synthetic.py; the target 1.0, a draft its α); None: plain
    random_agreement: float | None = None
    # Ranks of a tensor-parallel group, one process per GPU from `device` on (serving/tensor_parallel.py)
    tensor_parallel_size: int = 1
    # The row-parallel projections' all-reduce with tensor_parallel_size > 1 (collectives.py):
    # auto (one-shot over symmetric memory for small activations where every rank can, else
    # NCCL), nccl, or one-shot (fail the start where it cannot)
    tp_all_reduce: str = "auto"

    def __post_init__(self) -> None:
        if not self.device.startswith(("cpu", "cuda")):
            raise ConfigError(f"device: expected cpu or cuda[:n], got {self.device!r}")
        if self.num_blocks is not None and self.kv_memory is not None:
            raise ConfigError("num_blocks and kv_memory: give one, not both")
        for name in ("num_blocks", "kv_memory", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if not 1 <= self.max_num_draft <= 256:
            raise ConfigError(f"max_num_draft must be in 1..256, got {self.max_num_draft}")
        if self.probs_dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"probs_dtype: expected float16 or bfloat16, got {self.probs_dtype}")
        if self.blas is not None:
            from specdec.kernels.blas import check
            try:
                check(self.blas)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_all_reduce not in TP_ALL_REDUCE_MODES:
            raise ConfigError(f"tp_all_reduce: expected one of {', '.join(TP_ALL_REDUCE_MODES)}, "
                              f"got {self.tp_all_reduce!r}")
        if not self.warmup_batch_sizes or min(self.warmup_batch_sizes) < 1:
            raise ConfigError(f"warmup_batch_sizes must be positive, got {self.warmup_batch_sizes}")
        for name in ("graph_query_lens", "graph_batch_sizes"):
            value = getattr(self, name)
            if value is not None and (not value or min(value) < 1):
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.graph_context_lens is None:
            object.__setattr__(self, "graph_context_lens", DEFAULT_GRAPH_CONTEXT_LENS)
        for name in ("graph_prefill_lens", "graph_context_lens"):
            value = getattr(self, name)
            if value and min(value) < 1:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.random_agreement is not None:
            if not self.random_weights:
                raise ConfigError("random_agreement needs random_weights")
            if not 0.0 <= self.random_agreement <= 1.0:
                raise ConfigError(f"random_agreement must be in [0, 1], got {self.random_agreement}")
        CacheConfig(num_blocks=1, block_size=self.block_size)  # block_size check

    def default_kv_memory(self, free_device_bytes: int | None) -> int:
        # CPU (tests, demo): a small fixed cache; GPU: most of what is left after the weights.
        if free_device_bytes is None:
            return 64 * 2**20
        return int(free_device_bytes * 0.85)


ORPHAN_TIMEOUT_S = 5.0  # ServerConfig.orphan_timeout_s's default (the servers' --orphan-timeout)


@dataclass(frozen=True)
class ServerConfig:
    """A model server process: which engine it runs and where it listens."""
    role: str  # "draft" or "target"
    engine: EngineConfig
    host: str = "[::]"
    port: int = 50051
    grace_seconds: float = 5.0  # in-flight steps may finish this long after SIGTERM
    torch_threads: int | None = None  # CPU intra-op threads; None: torch's default
    # After each step the event loop polls instead of sleeping for this long (specdec/busy_poll.py);
    # None: 20 ms on cuda, 0 (off) on cpu, where the cores are the forward's.
    busy_poll_ms: float | None = None
    # TCP port of the step channel (serving/step_channel.py): 0 any free port, -1 none
    step_port: int = 0
    # A coordinator's sequences are freed once no step connection has carried its id this long
    # (serving/owners.py: it died without releasing them)
    orphan_timeout_s: float = ORPHAN_TIMEOUT_S

    def __post_init__(self) -> None:
        if not -1 <= self.step_port < 65536:
            raise ConfigError(f"step_port must be in -1..65535, got {self.step_port}")
        if self.busy_poll_ms is not None and self.busy_poll_ms < 0:
            raise ConfigError(f"busy_poll_ms must be >= 0, got {self.busy_poll_ms}")
        if self.role not in ("draft", "target"):
            raise ConfigError(f"role: expected draft or target, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not 0 <= self.orphan_timeout_s < float("inf"):
            raise ConfigError(f"orphan_timeout_s must be a finite number >= 0, got {self.orphan_timeout_s}")
        if self.grace_seconds < 0:
            raise ConfigError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError(f"torch_threads must be >= 1, got {self.torch_threads}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def busy_poll_s(self) -> float:
        if self.busy_poll_ms is None:
            return 0.02 if self.engine.device.startswith("cuda") else 0.0
        return self.busy_poll_ms / 1e3
