"""Load Hugging Face checkpoint folders (config.json + *.safetensors, sharded or not) into LlamaModel."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.config import ModelConfig
from specdec.models.llama import LlamaModel, TensorParallel


class CheckpointError(ValueError):
    """The checkpoint folder is incomplete or does not match its config; the message names the tensor."""


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                tp: TensorParallel = TensorParallel(), fused_kernels: bool | None = None,
                gemv_kernels: bool | None = None) -> LlamaModel:
    """An uninitialised model (weights are whatever memory held) on device in dtype. fused_kernels:
    Triton norm/RoPE/SiLU kernels; gemv_kernels: the Triton GEMV for the linear layers of steps with
    <= gemv.SERVE_MAX_M (64) tokens, above 16 tokens only up to gemv.WIDE_MAX_N wide (H200, Llama-7B
    bf16: graph replay 3.91 ms vs 4.26 ms on cuBLAS at batch 1, 4.11 vs 4.37 at batch 8, session 12;
    4.31 vs 4.54 at batch 32, session 31). None = on CUDA devices only."""
    on_cuda = torch.device(device).type == "cuda"
    fused_kernels = on_cuda if fused_kernels is None else fused_kernels
    gemv_kernels = on_cuda if gemv_kernels is None else gemv_kernels
    with torch.device("meta"):
        model = LlamaModel(cfg, tp, fused_kernels, gemv_kernels)
    return model.to_empty(device=device).to(dtype).eval().requires_grad_(False)


def init_random(model: LlamaModel, seed: int = 0, std: float = 0.02) -> LlamaModel:
    """Random weights of the right scale, for benchmarks and tests of a shape (no checkpoint)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)  # on the device: a 7B model inits in seconds
    return model


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for name in files:
        with safe_open(str(path / name), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def expected_tensor_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if cfg.qkv_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if cfg.o_bias:
            names.add(p + "self_attn.o_proj.bias")
        if cfg.mlp_bias:
            names |= {p + f"mlp.{x}_proj.bias" for x in ("gate", "up", "down")}
    return names


def _place(model: LlamaModel, hf_name: str, tensor: torch.Tensor) -> bool:
    """Copy one checkpoint tensor (this rank's shard of it) into the model. False if not ours."""
    cfg, tp = model.config, model.tp
    params = dict(model.named_parameters())
    if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
        return True  # some tied checkpoints store the head too; it is the embedding
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    if parts[0] == "layers" and parts[2] in ("self_attn", "mlp"):
        layer, block, proj, kind = parts[1], parts[2], parts[3], parts[4]
        attn = model.layers[int(layer)].self_attn
        mlp = model.layers[int(layer)].mlp
        r = tp.rank
        if proj in ("q_proj", "k_proj", "v_proj"):
            heads = attn.num_heads if proj == "q_proj" else attn.num_kv_heads
            size = heads * attn.head_dim
            offset = {"q_proj": 0, "k_proj": attn.q_size, "v_proj": attn.q_size + attn.kv_size}[proj]
            dst = getattr(attn.qkv_proj, kind)[offset:offset + size]
            return _copy(dst, _shard(tensor, 0, size, tp, hf_name), hf_name)
        if proj in ("gate_proj", "up_proj"):
            offset = 0 if proj == "gate_proj" else mlp.inter
            dst = getattr(mlp.gate_up_proj, kind)[offset:offset + mlp.inter]
            return _copy(dst, _shard(tensor, 0, mlp.inter, tp, hf_name), hf_name)
        if proj in ("o_proj", "down_proj"):
            mod = attn.o_proj if proj == "o_proj" else mlp.down_proj
            if kind == "bias":
                return _copy(mod.bias, tensor, hf_name)
            return _copy(mod.weight, _shard(tensor, 1, mod.weight.shape[1], tp, hf_name), hf_name)
    if name in params:
        return _copy(params[name], tensor, hf_name)
    return False


def _shard(tensor: torch.Tensor, dim: int, size: int, tp: TensorParallel, hf_name: str) -> torch.Tensor:
    """This rank's `size` along `dim` of a checkpoint tensor that must hold exactly tp.size of them
    there: a larger tensor (config.json says fewer heads, a narrower MLP, another head_dim) is an
    error, not something to cut to the first rows."""
    if tensor.dim() <= dim or tensor.shape[dim] != size * tp.size:
        raise CheckpointError(f"tensor {hf_name}: shape {tuple(tensor.shape)} does not fit the config "
                              f"({size * tp.size} along dimension {dim})")
    return tensor.narrow(dim, tp.rank * size, size)


def _copy(dst: torch.Tensor, src: torch.Tensor, hf_name: str) -> bool:
    if dst.shape != src.shape:
        raise CheckpointError(f"tensor {hf_name}: shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)
    return True


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               tp: TensorParallel = TensorParallel(),
               fused_kernels: bool | None = None, gemv_kernels: bool | None = None) -> tuple[LlamaModel, ModelConfig]:
    path = Path(path)
    cfg = ModelConfig.from_path(path)
    model = build_model(cfg, dtype, device, tp, fused_kernels, gemv_kernels)
    expected = expected_tensor_names(cfg)
    seen: set[str] = set()
    with torch.no_grad():
        for hf_name, tensor in checkpoint_tensors(path):
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if not _place(model, hf_name, tensor):
                raise CheckpointError(f"tensor {hf_name}: not part of a {cfg.architecture} model")
            seen.add(hf_name)
    missing = sorted(expected - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{more}")
    return model, cfg
