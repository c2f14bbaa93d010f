"""Unrolled chains (cuda_graphs.CHAIN_UNROLL): a greedy chain of 2..CHAIN_UNROLL steps, and a head
with its chain, captured as one graph each, replayed once where the one-step graphs replay once per
position. They must give the same tokens and KV as those replays (and as eager greedy steps), be
the graphs that run for the step counts they cover, leave longer chains to the one-step graphs,
and write nothing while they are captured. CPU stand-ins (CpuGraphs) here; the real capture in the
gpu cases at the end."""
from __future__ import annotations

import random

import pytest

from specdec import cuda_graphs
from specdec.runner import SeqInput
from tests.unit.test_session21_review import add, fed, ids, make, plain_chain, same_kv, sets_of, unowned_zero

UNROLL = 4


@pytest.fixture
def unroll(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "CHAIN_UNROLL", UNROLL)


def _count_replays(graphed) -> dict:
    """Wraps every chain, head and unrolled graph's replay of every set with a counter:
    {(set index, kind, key): replays}."""
    counts: dict = {}

    def wrap(obj, key):
        real = obj.replay

        def replay():
            counts[key] = counts.get(key, 0) + 1
            real()
        obj.replay = replay
    for i, s in enumerate(sets_of(graphed)):
        for b, c in s.chains.items():
            wrap(c.graph, (i, "chain", b))
        for b, h in s.heads.items():
            wrap(h, (i, "head", b))
        for key, g in s.unrolled.items():
            wrap(g, (i, "unrolled", key))
        for key, g in s.unrolled_heads.items():
            wrap(g, (i, "unrolled_head", key))
    return counts


@pytest.mark.parametrize("bounds", [(), (16,)])
def test_unrolled_graphs_are_captured_per_bucket_and_step_count_and_write_nothing(unroll, bounds):
    eager, graphed = make(bounds=bounds)
    for s in sets_of(graphed):
        assert set(s.unrolled) == {(b, n) for b in (1, 2, 4) for n in range(2, UNROLL + 1)}
        assert set(s.unrolled_heads) == set(s.unrolled)
        assert s.num_graphs == len(s.graphs) + 2 * len(s.chains) + 2 * len(s.unrolled)
    # The captures' warm-up runs (CpuGraphs runs each captured function twice) fed nothing.
    assert not graphed.kv.data.any()


def test_without_unroll_there_are_none(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "CHAIN_UNROLL", 1)
    _, graphed = make()
    assert graphed.graphs.unrolled == {} and graphed.graphs.unrolled_heads == {}


@pytest.mark.parametrize("bounds", [(), (16,)])
def test_chains_of_every_length_give_eager_tokens_and_kv_on_the_graph_that_covers_them(unroll, bounds):
    """greedy_chain of 1..UNROLL + 2 steps: the eager greedy tokens and KV; up to UNROLL steps one
    replay of the unrolled graph for that count (the one-step chain graph not at all), beyond it
    the one-step graph once per step; a chain of 1 step is the one-step graph."""
    eager, graphed = make(bounds=bounds)
    rng = random.Random(3)
    add((eager, graphed), {0: ids(rng, 5), 1: ids(rng, 3), 2: ids(rng, 6)})
    counts = _count_replays(graphed)
    for steps in range(1, UNROLL + 3):
        seqs = [0, 2] if steps % 2 else [1, 0, 2]
        before = dict(counts)
        plain_chain(eager, graphed, seqs, ids(rng, len(seqs)), steps)
        ran = {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}
        b = 2 if len(seqs) == 2 else 4
        kinds = {(k[1], k[2]): v for k, v in ran.items()}
        if 2 <= steps <= UNROLL:
            assert kinds == {("unrolled", (b, steps)): 1}, (steps, ran)
        else:
            assert kinds == {("chain", b): steps}, (steps, ran)
        same_kv(eager, graphed, (0, 1, 2))
    unowned_zero(graphed)


@pytest.mark.parametrize("bounds", [(), (16,)])
def test_heads_of_every_length_give_eager_tokens_and_kv_on_the_graph_that_covers_them(unroll, bounds):
    """fed_chain (feeds of 1 and 2 tokens) of 1..UNROLL + 2 steps: the eager tokens and KV, every
    replay on one set; up to UNROLL steps one replay of the unrolled head graph, beyond it the
    head graph and steps - 1 one-step chain replays."""
    eager, graphed = make(bounds=bounds)
    rng = random.Random(5)
    add((eager, graphed), {0: ids(rng, 4), 1: ids(rng, 7), 2: ids(rng, 2)})
    counts = _count_replays(graphed)
    for steps in range(1, UNROLL + 3):
        items = [SeqInput(s, ids(rng, n)) for s, n in zip((2, 0, 1), (2, 1, 2) if steps % 2 else (1, 2, 2))]
        before = dict(counts)
        fed(eager, graphed, items, steps)
        ran = {(k[1], k[2]): v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}
        if 2 <= steps <= UNROLL:
            assert ran == {("unrolled_head", (4, steps)): 1}, (steps, ran)
        elif steps == 1:
            assert ran == {("head", 4): 1}, (steps, ran)
        else:
            assert ran == {("head", 4): 1, ("chain", 4): steps - 1}, (steps, ran)
    same_kv(eager, graphed, (0, 1, 2))
    unowned_zero(graphed)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.helpers.tiny_models import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), with_tokenizer=False)


def test_the_draft_engine_drafts_the_same_with_unrolled_chains(unroll, checkpoint):
    """Session 21's random-accept-pattern draft test (heads, chains, ragged steps, restarts, a
    release, a newcomer) with the unrolled graphs captured: the same drafts, forwards and KV as
    the engine without graphs."""
    from tests.unit.test_session21_review import test_draft_engine_drafts_the_same_through_heads_over_random_accept_patterns as run
    run(checkpoint)


# --- the real capture ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_unrolled_chains_and_heads_on_cuda_graphs_equal_greedy_steps(monkeypatch, tmp_path):
    """The GPU chain and head tests (tests/gpu/test_cuda_graphs_gpu.py) with chains of up to 8
    steps unrolled into one graph: chains of 7 and 1 steps, heads of 5, 1 and 4 on them, a chain
    of 12 and a head of 11 past them, all giving eager greedy tokens and KV."""
    from tests.gpu import test_cuda_graphs_gpu as g
    monkeypatch.setattr(cuda_graphs, "CHAIN_UNROLL", 8)
    made = []
    real = g.eager_and_graphed

    def keep(*a, **kw):
        runners, prompts = real(*a, **kw)
        # No capture's warm-up wrote KV (the head capture leaves real slots in bucket (b, 1)'s
        # inputs, which an unrolled capture must reset before its chain steps run).
        assert not runners[1].kv.data.any()
        made.append(runners[1].graphs)
        return runners, prompts
    monkeypatch.setattr(g, "eager_and_graphed", keep)
    g.test_greedy_chain_replays_equal_greedy_steps(tmp_path / "a")
    g.test_fed_chain_head_graphs_equal_greedy_steps(tmp_path / "b")
    for graphs in made:
        for s in getattr(graphs, "sets", [graphs]):
            assert len(s.unrolled) == len(s.unrolled_heads) == 3 * 7    # buckets 1, 2, 4 x 2..8 steps
