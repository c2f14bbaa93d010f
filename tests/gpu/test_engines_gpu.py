"""The engines on CUDA (Triton attention, CUDA-event timing): greedy speculation stays exact."""
from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import DraftEngine, TargetEngine
from tests.helpers.tiny_models import make_pair
from tests.unit.test_engines import PROMPTS, plain_greedy, speculative

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculation_on_cuda(tmp_path, dtype):
    target_path, draft_path = make_pair(tmp_path)

    def config(path):
        return EngineConfig(model=path, device="cuda", dtype=dtype, num_blocks=256, block_size=16,
                            warmup_batch_sizes=(1, 2, 4))

    draft, target = DraftEngine(config(draft_path)), TargetEngine(config(target_path))
    for engine in (draft, target):
        assert all(t > 0 for t in engine.warm_up().values())
    reference = plain_greedy(target, PROMPTS, 16)
    got, drafted, accepted = speculative(draft, target, PROMPTS, [4, 2, 0, 5], 16)
    if dtype == torch.float32:
        assert got == reference  # bf16 may flip near-ties between a k+1 verify and 1-token steps
    assert 0 < accepted <= drafted
    assert draft.num_free_blocks == target.num_free_blocks == 256
