"""Programmatic dependent launch changes when kernels start, never what they compute: graphed and
eager steps give the same bits with it on and off. A kernel that read its predecessor's output
before `griddepcontrol.wait` (or wrote where the predecessor still reads) would race and differ."""
import os

import pytest
import torch

from specdec.config import CacheConfig
from specdec.kernels import pdl
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.op_sets import tiny_config

pytestmark = pytest.mark.gpu


def test_pdl_is_on_by_default_on_hopper():
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.active(torch.device("cuda")) == (hopper and os.environ.get("SPECDEC_PDL", "1") != "0")
    assert not pdl.active(torch.device("cpu"))
    with pdl.forced(False):
        assert pdl.options(torch.device("cuda")) == {"USE_PDL": False, "launch_pdl": False}


def _logits(model, on: bool) -> list[torch.Tensor]:
    """Eager prefill of long prompts (the attention splits its keys, so the merge kernel runs; the
    GEMV splits K for these narrow projections), then graphed decode and verify steps."""
    gen = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, 61, (n,), generator=gen).tolist() for s, n in [(0, 700), (1, 333)]}
    out = []
    with pdl.forced(on):
        runner = ModelRunner(model, CacheConfig(num_blocks=160, block_size=16, dtype=torch.bfloat16))
        runner.enable_cuda_graphs(max_model_len=1024, query_lens=(1, 4), batch_sizes=(2,))
        for s in prompts:
            runner.add_sequence(s)
        out += runner.step([SeqInput(s, ids, 1) for s, ids in prompts.items()])
        for step in range(6):
            out += runner.step([SeqInput(s, [step + 1]) for s in prompts])
            out += runner.step([SeqInput(s, [5, 6, 7, step], 4) for s in prompts])
        torch.cuda.synchronize()
        assert runner.graphs.replays == 12
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs compute capability >= 9 (both runs would launch without it)")
def test_graphed_and_eager_steps_are_bit_identical_with_and_without_pdl():
    cfg = tiny_config(hidden_size=256, intermediate_size=688, num_heads=8, num_kv_heads=2, head_dim=32,
                      num_layers=4, max_position=1024)
    model = init_random(build_model(cfg, torch.bfloat16, "cuda"), std=0.05)
    with_pdl, without = _logits(model, True), _logits(model, False)
    assert len(with_pdl) == len(without) == 26
    for a, b in zip(with_pdl, without):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
