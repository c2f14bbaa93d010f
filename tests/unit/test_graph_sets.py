"""cuda_graphs.GraphSets on the CPU (CpuGraphs stand-ins): a decode/verify set planned for a short
context bound beside the full max_model_len set. Steps whose block tables fit the short bound
replay there, longer ones on the full set, prompt chunks on the full set's prefill buckets; every
result equals an eager step; chains pick the set that holds their last position; stale batches are
refused per set; the sets share one logits buffer and one pick per sampled-chain bucket."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.config import DEFAULT_GRAPH_CONTEXT_LENS, CacheConfig, ConfigError, EngineConfig
from specdec.cuda_graphs import GraphedForward, GraphSets
from specdec.kernels.triton_attention import TritonAttention
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput
from specdec.serving.server import config_from_args
from tests.helpers.cpu_graphs import CpuGraphs
from tests.helpers.op_sets import tiny_config
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)

BLOCK = 4
SHORT = 14  # rounded up to 16: four blocks


def pair(**kwargs) -> tuple[ModelRunner, ModelRunner]:
    model = init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1)

    def runner():
        return ModelRunner(model, CacheConfig(num_blocks=64, block_size=BLOCK, dtype=torch.float32),
                           backend=TritonAttention())
    eager, graphed = runner(), runner()
    graphed.graphs = GraphSets.build(graphed, 64, (SHORT, 64, 100), factory=CpuGraphs, query_lens=(1, 2, 4),
                                     batch_sizes=(1, 2, 4), **kwargs)
    return eager, graphed


@pytest.fixture
def runners():
    eager, graphed = pair(chains=True, prefill_lens=(8,))
    for r in (eager, graphed):
        for s in range(3):
            r.add_sequence(s)
    return eager, graphed


def replays(graphed) -> list[int]:
    return [s.replays for s in graphed.graphs.sets]


def test_sets_and_their_bounds(runners):
    _, graphed = runners
    gs = graphed.graphs
    short, full = gs.sets
    assert gs.context_bounds == (16, 64)  # 14 rounded up to whole blocks; 64 and 100 are the full set's
    assert (short.max_blocks, full.max_blocks) == (4, 16)
    assert short.prefill_lens == () and full.prefill_lens == (8,) and gs.prefill_lens == (8,)
    assert set(short.graphs) == {(b, q) for b in (1, 2, 4) for q in (1, 2, 4)}
    assert set(short.chains) == set(full.chains) == {1, 2, 4}
    assert set(short.heads) == set(full.heads) == {1, 2, 4}     # query length 2 is graphed: heads too
    assert gs.num_graphs == len(short.graphs) + len(full.graphs) + 6 + 6
    # Each set's graphs were captured with its own bound as the host context bound (what plans the
    # attention's KV splits), and all of them write one logits buffer.
    for s in gs.sets:
        for g in s.graphs.values():
            assert set(g.batch.context_lens_host) == {s.max_context}
            assert g.logits.data_ptr() == full._logits.data_ptr()
    assert short._logits is full._logits


def test_steps_replay_on_the_shortest_set_that_holds_them_and_match_eager(runners):
    eager, graphed = runners
    rng = random.Random(3)
    prompts = {s: [rng.randrange(61) for _ in range(3 + s)] for s in range(3)}
    for want, got in zip(eager.step([SeqInput(s, p) for s, p in prompts.items()]),
                         graphed.step([SeqInput(s, p) for s, p in prompts.items()])):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert replays(graphed) == [0, 1]  # a 5-token prompt chunk: the full set's prefill bucket (8)
    seen = []
    for _ in range(14):
        items = [SeqInput(s, [rng.randrange(61) for _ in range(rng.choice([1, 2, 4]))]) for s in range(3)]
        width = max(graphed.blocks.blocks_needed(graphed.num_tokens(i.seq_id) + len(i.token_ids)) for i in items)
        before = replays(graphed)
        for want, got in zip(eager.step(items), graphed.step(items)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        ran = [a - b for a, b in zip(replays(graphed), before)]
        assert ran == ([1, 0] if width <= 4 else [0, 1]), (width, ran)
        seen.append(width <= 4)
    assert True in seen and False in seen  # both sets served steps
    torch.testing.assert_close(graphed.kv.data, eager.kv.data, atol=1e-5, rtol=0)


def test_chains_run_on_the_set_that_holds_their_last_position(runners):
    eager, graphed = runners
    for r in (eager, graphed):
        r.step([SeqInput(0, list(range(1, 10)))])             # 9 tokens; the chain's 5th ends at 14
    assert graphed.can_chain([0], 7) and graphed.can_chain([0], 8)
    for steps, on in ((5, 0), (6, 1)):                         # 9 + 5 = 14 <= 16; then 14 + 6 = 20 > 16
        want, fed = [], [7]
        for _ in range(steps):
            fed = [int(eager.step([SeqInput(0, fed)])[0].argmax(-1))]
            want.append(fed)
        before = replays(graphed)
        assert graphed.greedy_chain([0], [7], steps).tolist() == want
        ran = [a - b for a, b in zip(replays(graphed), before)]
        assert ran == [steps if i == on else 0 for i in range(2)], (steps, ran)


def test_stale_batches_are_refused_per_set(runners):
    _, graphed = runners
    for r in range(3):
        graphed.step([SeqInput(r, [1, 2, 3])])                 # bucket (1, 4) of the short set
    on_short = graphed.prepare([SeqInput(0, [4])])             # 4 tokens: bucket (1, 1) of the short set
    graphed.step([SeqInput(1, list(range(20)))])               # eager: 23 tokens, past every bucket
    on_full = graphed.prepare([SeqInput(1, [5])])              # bucket (1, 1) of the full set
    out = graphed.forward(on_short)                            # not overwritten by the full set's staging
    assert out.shape == (1, 61) and torch.isfinite(out).all()
    graphed.forward(on_full)
    first = graphed.prepare([SeqInput(2, [6])])                # short (1, 1) again, then once more
    graphed.prepare([SeqInput(0, [7])])
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.forward(first)


def test_one_sampled_chain_pick_per_bucket_for_all_sets():
    _, graphed = pair(chains=True)
    calls = []

    def pick_for(b):
        calls.append(b)
        tokens = torch.zeros(4, b, dtype=torch.int64)
        return (lambda logits, at: tokens[at]), tokens
    graphed.graphs.capture_sampled_chains(pick_for)
    assert sorted(calls) == [1, 2, 4]
    short, full = graphed.graphs.sets
    for b in (1, 2, 4):
        assert short.sampled_chains[b].tokens is full.sampled_chains[b].tokens


def test_context_lens_in_config_and_on_the_command_line(tmp_path):
    config, _, _ = config_from_args("target", ["--model", str(tmp_path), "--graph-context-lens", "256,1024"])
    assert config.engine.graph_context_lens == (256, 1024)
    config, _, _ = config_from_args("draft", ["--model", str(tmp_path)])
    assert config.engine.graph_context_lens == DEFAULT_GRAPH_CONTEXT_LENS == (256,)
    config, _, _ = config_from_args("target", ["--model", str(tmp_path), "--graph-context-lens", "none"])
    assert config.engine.graph_context_lens == ()
    assert EngineConfig(model=tmp_path, graph_context_lens=None).graph_context_lens == (256,)
    assert EngineConfig(model=tmp_path, graph_context_lens=()).graph_context_lens == ()
    with pytest.raises(ConfigError, match="graph_context_lens"):
        EngineConfig(model=tmp_path, graph_context_lens=(0, 256))


def test_enable_cuda_graphs_builds_sets_only_below_max_model_len(monkeypatch):
    runner = ModelRunner(init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1),
                         CacheConfig(num_blocks=8, block_size=BLOCK, dtype=torch.float32))
    built = []
    monkeypatch.setattr(GraphSets, "build", classmethod(lambda cls, r, mml, ctx, **kw: built.append((mml, ctx))))
    monkeypatch.setattr(GraphedForward, "__init__", lambda self, r, mml, **kw: built.append(("one set", mml)))
    runner.enable_cuda_graphs(64, context_lens=(64, 128))
    runner.enable_cuda_graphs(64, context_lens=(16, 128))
    assert built == [("one set", 64), (64, (16, 128))]


def test_draft_engine_drafts_the_same_across_the_bound(tmp_path):
    """A DraftEngine on (emulated) graph sets for 16 and 128 tokens drafts what the eager engine
    drafts, chains and single replays alike, as its sequences grow past 16 tokens."""
    from specdec.engine import DraftEngine
    from specdec.engine.types import DraftSeqInput
    from tests.helpers.tiny_models import make_pair
    _, draft_path = make_pair(tmp_path)
    config = EngineConfig(model=draft_path, num_blocks=64, block_size=BLOCK, warmup_batch_sizes=(1,),
                          max_num_draft=8)
    plain, graphed = DraftEngine(config), DraftEngine(config)
    for engine in (plain, graphed):
        engine.runner.backend = TritonAttention()
    graphed.runner.graphs = GraphSets.build(graphed.runner, 128, (16,), factory=CpuGraphs, query_lens=(1, 2),
                                            batch_sizes=(1, 2, 4), chains=True)
    steps = [[DraftSeqInput(1, 0, [3, 4, 5], 4, first=True), DraftSeqInput(2, 0, [7, 1], 4, first=True)]]
    steps += [[DraftSeqInput(1, keep, [t], 4), DraftSeqInput(2, 4 - keep, [t + 1], 4)]
              for t, keep in zip(range(2, 9), (4, 1, 2, 3, 4, 0, 2))]
    for step in steps:
        a, b = plain.propose(step), graphed.propose(step)
        assert [o.tokens for o in b.outputs] == [o.tokens for o in a.outputs]
        assert all(o.error is None for o in b.outputs)
    short, full = graphed.runner.graphs.sets
    assert short.replays and full.replays
    assert max(graphed.runner.num_tokens(s) for s in (1, 2)) > 16
