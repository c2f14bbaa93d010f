"""Sampled chains (config.sampled_chains): a sampled draft step's positions after the first run as
one chain of graph replays whose steps draw with the draft's sampler (cuda_graphs.py,
sampling/graphs.GraphedSampler.chain_pick / stage_chain). On the CPU with the stand-in graphs
(tests/helpers/cpu_graphs.py): the drafts and their distributions must be those of the same engine
drafting position by position on the same graphs, bit for bit (and the tokens those of an engine
without graphs), and the chain must actually run where it fits."""
from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import DraftEngine, DraftSeqInput
from specdec.kernels.triton_attention import TritonAttention
from specdec.sampling.params import SamplingParams
from specdec.sampling.transport import dense_weights
from tests.helpers.cpu_graphs import CpuGraphs, CpuSampler
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import make_pair

SIZES = (1, 2, 4)


def _engines(tmp_path, dtype=torch.float16) -> tuple[DraftEngine, DraftEngine]:
    """Two engines of one draft on the stand-in graphs and sampler: without and with sampled
    chains (so both forward on the same graph buckets: their logits are the same bits)."""
    _, draft_path = make_pair(tmp_path)
    config = EngineConfig(model=draft_path, num_blocks=96, block_size=4, warmup_batch_sizes=(1,),
                          max_num_draft=6, probs_dtype=dtype)     # sampled chains: the default
    plain, chained = DraftEngine(config), DraftEngine(config)
    for engine in (plain, chained):
        engine.runner.backend = TritonAttention()   # the GPU's attention (graph-safe)
        engine.runner.graphs = CpuGraphs(engine.runner, max_model_len=128, query_lens=(1, 2),
                                         batch_sizes=SIZES, chains=True)
        engine.sampler = CpuSampler(engine.vocab_size, SIZES, config.max_num_draft, dtype, engine.device)
    chained._capture_sampled_chains()
    assert set(chained.runner.graphs.sampled_chains) == set(SIZES) and not plain.runner.graphs.sampled_chains
    return plain, chained


def _same(a, b) -> None:
    assert [o.error for o in a.outputs] == [o.error for o in b.outputs] == [None] * len(a.outputs)
    assert [o.tokens for o in a.outputs] == [o.tokens for o in b.outputs]
    for x, y in zip(a.outputs, b.outputs):
        assert (x.probs is None) == (y.probs is None)
        if x.probs is not None:
            assert torch.equal(dense_weights(x.probs), dense_weights(y.probs))


T = [SamplingParams(temperature=0.9, top_k=20, seed=7), SamplingParams(temperature=1.2, seed=8),
     SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=9), SamplingParams()]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sampled_chains_draft_what_the_plain_engine_drafts(tmp_path, dtype):
    """Uniform sampled steps (chained after their first position, or from it where every sequence
    feeds one token), a greedy row among sampled ones (chained too: the sampler draws greedy rows
    as argmaxes), ragged num_draft (no chain), an extension whose first token is a guess (chained
    from its second), 3 rows in a bucket of 4, steps of 2 drafts (a chain of 1) and of 6 (up to
    the sampler's last row)."""
    plain, chained = _engines(tmp_path, dtype)
    steps = [
        [DraftSeqInput(1, 0, [3, 4, 5], 4, T[0], first=True), DraftSeqInput(2, 0, [7, 1], 4, T[1], first=True)],
        [DraftSeqInput(1, 4, [9], 4, T[0]), DraftSeqInput(2, 1, [8], 4, T[1])],
        [DraftSeqInput(1, 1, [5], 3, T[0]), DraftSeqInput(2, 2, [3], 3, T[3]),
         DraftSeqInput(3, 0, [6, 6, 2], 3, T[2], first=True)],
        [DraftSeqInput(1, 2, [6], 5, T[0]), DraftSeqInput(2, 3, [2], 2, T[1]), DraftSeqInput(3, 1, [4], 4, T[2])],
        [DraftSeqInput(1, 2, [], 3, T[0], extend=True), DraftSeqInput(3, 0, [9], 3, T[2])],
        [DraftSeqInput(1, 0, [5], 2, T[0]), DraftSeqInput(3, 3, [1], 2, T[2])],
        [DraftSeqInput(2, 0, [4], 6, T[1])],
    ]
    chains = []
    for step in steps:
        before = (chained.runner.graphs.replays, chained.sampler.replays)
        a, b = plain.propose(step), chained.propose(step)
        _same(a, b)
        assert b.timing.num_forwards == a.timing.num_forwards == max(s.num_draft for s in step)
        for s in step:
            assert chained.runner.num_tokens(s.seq_id) == plain.runner.num_tokens(s.seq_id)
        replays = chained.runner.graphs.replays - before[0]
        sampler_replays = chained.sampler.replays - before[1]
        chains.append((replays, sampler_replays))
    # (forward replays incl. chain steps, sampler replays): a chained step samples its first
    # position on the sampler graph and the rest in the chain; a ragged one samples every position.
    # Step 1: the prompts run eagerly (no graph), then the chain of 3. Step 2: feeds of 2 and 1
    # tokens (graph (2, 2)), then a chain of 3. Step 3: the new sequence's prompt is eager, then a
    # chain of 2. Step 4: ragged, 5 positions of 3, 2, 1 rows. Step 5: the extension (graph; its
    # first draw is a guess) and a chain of 2. Step 6: feeds of 1 and 2 tokens (graph (2, 2)), a
    # chain of 1. Step 7: one sequence feeding 1 token: the whole step is a chain of 6, its first
    # position included (no sampler replay).
    assert chains == [(3, 1), (4, 1), (2, 1), (5, 5), (3, 1), (2, 1), (6, 0)]


def test_with_the_flag_off_no_sampled_chain_is_captured_or_run(tmp_path):
    _, draft_path = make_pair(tmp_path)
    config = EngineConfig(model=draft_path, num_blocks=64, block_size=4, warmup_batch_sizes=(1,), max_num_draft=4,
                          sampled_chains=False)
    engine = DraftEngine(config)
    engine.runner.graphs = CpuGraphs(engine.runner, max_model_len=64, query_lens=(1, 2), batch_sizes=SIZES,
                                     chains=True)
    engine.sampler = CpuSampler(engine.vocab_size, SIZES, 4, torch.float16, engine.device)
    engine._capture_sampled_chains()
    assert not engine.runner.graphs.sampled_chains
    out = engine.propose([DraftSeqInput(1, 0, [3, 4], 4, T[0], first=True)])
    assert out.outputs[0].error is None and engine.sampler.replays == 4   # every position on the sampler


def test_stage_chain_refuses_what_does_not_fit():
    sampler = CpuSampler(64, (1, 2), 4, torch.float16, torch.device("cpu"))
    for b in (1, 2):
        assert sampler.chain_pick(b) is not None
    assert sampler.chain_pick(3) is None and sampler.chain_bucket(3) is None
    with pytest.raises(ValueError, match="sampled chain"):
        sampler.stage_chain(T[:1], [1], [5], start=2, steps=3)      # rows 2..4 of 4
    with pytest.raises(ValueError, match="sampled chain"):
        sampler.stage_chain(T[:3], [1, 2, 3], [5, 5, 5], start=0, steps=2)   # no bucket of 3
    sampler.stage_chain(T[:2], [1, 2], [5, 9], start=1, steps=3)
    u = sampler.chain_buffers[2].views[5].view(4, 2)
    assert (u[0] == 0).all() and (u[1:] > 0).all()
