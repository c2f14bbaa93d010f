"""An eager and a CUDA-graphed runner over the same tiny checkpoint, for graph-replay tests."""
from __future__ import annotations

from pathlib import Path

import torch

from specdec.config import CacheConfig
from specdec.models.loader import load_model
from specdec.runner import ModelRunner
from tests.helpers.tiny_models import make_checkpoint


def eager_and_graphed(tmp_path: Path, query_lens: tuple[int, ...], batch_sizes: tuple[int, ...],
                      chains: bool = False, prefill_lens: tuple[int, ...] = (),
                      context_lens: tuple[int, ...] = ()) -> tuple[list[ModelRunner], dict[int, list[int]]]:
    """([eager runner, graphed runner] on cuda, prompts of 17, 5 and 40 tokens keyed by sequence id).
    Graphs are captured for max_model_len 256 at the given query lengths and batch sizes."""
    path = make_checkpoint(tmp_path, with_tokenizer=False, heads=4, kv_heads=2, hidden=128)
    runners = []
    for graphs in (False, True):
        model, cfg = load_model(path, device="cuda")
        runner = ModelRunner(model, CacheConfig(num_blocks=64, block_size=16))
        if graphs:
            runner.enable_cuda_graphs(max_model_len=256, query_lens=query_lens, batch_sizes=batch_sizes,
                                      chains=chains, prefill_lens=prefill_lens, context_lens=context_lens)
        runners.append(runner)
    gen = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
               for s, n in [(0, 17), (1, 5), (2, 40)]}
    return runners, prompts
