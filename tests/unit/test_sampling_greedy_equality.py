"""Speculative decoding over the real runner emits exactly target-only greedy tokens (fp32)."""
from __future__ import annotations

import random

import pytest

from specdec.config import CacheConfig
from specdec.models.loader import load_model
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from tests.helpers.spec_loop import greedy_reference, speculative_generate
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: this module runs single-threaded)
from tests.helpers.tiny_models import make_pair

VOCAB, MAX_NEW, NUM_PROMPTS = 320, 20, 50


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    target_path, draft_path = make_pair(tmp_path_factory.mktemp("pair"), vocab_size=VOCAB, noise=0.005)
    cache = CacheConfig(num_blocks=1024, block_size=16)
    target = ModelRunner(load_model(target_path)[0], cache)
    draft = ModelRunner(load_model(draft_path)[0], cache)
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 13))] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def reference(runners, prompts):
    return greedy_reference(runners[0], prompts, MAX_NEW)


@pytest.mark.parametrize("schedule", ["k1", "k3", "k5", "mixed"])
def test_greedy_speculative_equals_target_greedy(runners, prompts, reference, schedule):
    ks = [i % 6 for i in range(NUM_PROMPTS)] if schedule == "mixed" else [int(schedule[1:])] * NUM_PROMPTS
    out, counters = speculative_generate(*runners, prompts, ks, MAX_NEW, [SamplingParams()] * NUM_PROMPTS,
                                         tag=schedule, send_probs=schedule == "mixed")
    assert out == reference
    print(f"{schedule}: alpha={counters.acceptance_rate:.3f} tau={counters.mean_emitted:.2f} "
          f"per-position={[round(r, 2) for r in counters.position_rates()]}")
    assert 0.05 < counters.acceptance_rate < 0.98  # partial acceptance: both paths exercised
    assert all(not runners[0].blocks.__contains__((schedule, i)) for i in range(NUM_PROMPTS))


def test_seeded_sampling_is_batch_independent_through_the_runner(runners, prompts):
    params = [SamplingParams(temperature=0.9, top_k=20, seed=100 + i) for i in range(6)]
    ks = [2, 0, 3, 1, 4, 2]
    together, counters = speculative_generate(*runners, prompts[:6], ks, 12, params, tag="batch")
    alone = [speculative_generate(*runners, [prompts[i]], [ks[i]], 12, [params[i]], tag=f"one{i}")[0][0]
             for i in (0, 2, 5)]
    assert alone == [together[0], together[2], together[5]]
    assert counters.drafted > 0 and len({tuple(t) for t in together}) == 6
