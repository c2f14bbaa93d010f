"""Column/row sharding: two CPU ranks (gloo) give the logits of the unsharded model."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec.config import CacheConfig
from specdec.models.llama import TensorParallel
from specdec.models.loader import load_model
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.tiny_models import make_checkpoint

PROMPTS = {"a": [5, 9, 2, 7, 1, 3], "b": [11, 4]}


def _logits(path, tp: TensorParallel) -> list[torch.Tensor]:
    model, _ = load_model(path, tp=tp)
    runner = ModelRunner(model, CacheConfig(num_blocks=16, block_size=4))
    for s in PROMPTS:
        runner.add_sequence(s)
    first = runner.step([SeqInput(s, ids, len(ids)) for s, ids in PROMPTS.items()])
    second = runner.step([SeqInput("a", [8, 8], 2), SeqInput("b", [6], 1)])
    return first + second


def _rank(rank: int, world: int, port: int, path: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        logits = _logits(path, TensorParallel(rank, world))
        out[rank] = [t.clone() for t in logits]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_rank_tensor_parallel_matches_one_rank(tmp_path, arch):
    path = make_checkpoint(tmp_path, arch=arch, heads=4, kv_heads=2, intermediate=128,
                           with_tokenizer=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.start_processes(_rank, args=(2, port, str(path), out), nprocs=2, join=True, start_method="spawn")
    expected = _logits(path, TensorParallel())
    for rank in (0, 1):
        for got, want in zip(out[rank], expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_shard_sizes_must_divide():
    with pytest.raises(ValueError, match="num_key_value_heads \\(2\\) is not divisible"):
        TensorParallel(0, 4).split(2, "num_key_value_heads")
