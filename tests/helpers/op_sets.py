"""A tiny model driven through prefill, decode and verify steps, for comparing two op sets
(fused vs torch, GEMV vs cuBLAS) on the same weights."""
from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.kernels.paged_inputs import rel_error
from specdec.runner import ModelRunner, SeqInput


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=61, hidden_size=64, intermediate_size=96,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position=512)
    return ModelConfig(**{**base, **kw})


STEPS = [
    [SeqInput("a", [1, 2, 3, 4, 5]), SeqInput("b", list(range(7, 18)), num_logits=3)],  # prefill
    [SeqInput("a", [9]), SeqInput("b", [4])],                                          # decode
    [SeqInput("a", [11, 12, 13, 14], num_logits=4), SeqInput("b", [6])],                # verify
]


def run_steps(runner: ModelRunner) -> list[torch.Tensor]:
    for s in ("a", "b"):
        runner.add_sequence(s)
    return [torch.cat(runner.step(items)) for items in STEPS]


def new_runner(model, dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(model, CacheConfig(num_blocks=32, block_size=4, dtype=dtype))


def assert_switch_keeps_logits(model, dtype: torch.dtype, switch_off: Callable[[object], None], tol: float,
                               runner: ModelRunner | None = None) -> None:
    """Logits of STEPS with the model as built (on `runner`, e.g. a graphed one, or a fresh runner)
    against a fresh runner after switch_off(model): finite, and within `tol` relative error."""
    got = run_steps(runner or new_runner(model, dtype))
    switch_off(model)
    want = run_steps(new_runner(model, dtype))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        err = rel_error(g, w)
        assert err < tol, (dtype, err)
