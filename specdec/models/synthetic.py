"""Random weights that agree: a target and a draft of any two shapes (same vocabulary) whose greedy
next token agrees on a chosen fraction of the vocabulary, for benchmarks of model shapes that have
no checkpoint here (Llama-7B with a 68m draft). Plain random weights agree on nothing (α = 0), which
leaves speculation nothing to gain; these give a measured α near the chosen one while every matmul,
attention read and KV write costs exactly what it costs with real weights of the shape.

How: every model's next token is a function of its last input token only. The embedding rows are
random vectors e_v; the layers' output projections (o_proj, down_proj) are scaled down so that the
residual stream stays ~e_v through all layers; the LM head row of token sigma(v) is e_v, so the
logits peak at sigma(v) with a margin of ~sqrt(hidden) against the other rows' ~N(0, 1) scores.
pi is one permutation of the vocabulary shared by every model (from `shared_seed`): the target
uses sigma = pi. A model with agreement a uses sigma = pi on a random fraction a of the tokens and
pi after a derangement of the rest, so it disagrees with pi exactly there (one leftover token,
where a derangement of one is impossible, agrees). A target generating from such weights walks the
cycles of pi, which visit the vocabulary near-uniformly, so the per-token agreement along its
output comes out near a, and greedy speculation with k drafts accepts (a + a^2 + ... + a^k) / k of
them on average over walks (0.59 for a = 0.8, k = 4). A few short requests start from a few
tokens and can land well above or below that (the CPU smoke of bench/e2e.py, 4 prompts x 64
tokens at a = 0.8: 0.787 measured, 0.726 by replaying the same walks through the two maps).
"""
from __future__ import annotations

import torch

from specdec.models.llama import LlamaModel
from specdec.models.loader import init_random

LAYER_OUTPUT_SCALE = 1e-2  # o_proj / down_proj relative to init_random's std


def next_token_map(vocab_size: int, agreement: float, seed: int = 0, shared_seed: int = 0) -> torch.Tensor:
    """sigma as a [V] int64 tensor: sigma[v] is the greedy successor of token v."""
    if not 0.0 <= agreement <= 1.0:
        raise ValueError(f"agreement: must be in [0, 1], got {agreement}")
    pi = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(shared_seed))
    gen = torch.Generator().manual_seed(10_007 + seed)
    order = torch.randperm(vocab_size, generator=gen)
    rest = order[round(agreement * vocab_size):]          # the tokens where sigma differs from pi
    source = torch.arange(vocab_size)
    if len(rest) >= 2:
        source[rest] = rest.roll(1)                      # a cyclic shift: no token maps to itself
    return pi[source]


def init_agreeing(model: LlamaModel, agreement: float = 1.0, seed: int = 0, shared_seed: int = 0,
                  std: float = 0.02) -> LlamaModel:
    """init_random, then the embedding, layer outputs and LM head as the module docstring says."""
    if model.lm_head is None:
        raise ValueError("init_agreeing: the LM head must not be tied to the embedding "
                         "(tie_word_embeddings) — the head is a permutation of the embedding rows")
    init_random(model, seed, std)
    weight = model.embed_tokens.weight
    vocab, hidden = weight.shape
    sigma = next_token_map(vocab, agreement, seed, shared_seed).to(weight.device)
    gen = torch.Generator(device=weight.device).manual_seed(20_011 + seed)
    with torch.no_grad():
        emb = torch.randn(vocab, hidden, generator=gen, device=weight.device, dtype=torch.float32)
        weight.copy_(emb)
        head = torch.empty_like(emb)
        head[sigma] = emb / hidden ** 0.5                # row sigma(v) is e_v: logits peak at sigma(v)
        model.lm_head.weight.copy_(head)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(LAYER_OUTPUT_SCALE)
    return model
