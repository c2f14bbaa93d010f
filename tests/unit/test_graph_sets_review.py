"""Review tests of cuda_graphs.GraphSets (context-bound graph sets) on the CPU stand-in graphs: three
shorter bounds (8, 16, 32) beside max_model_len 64 (block size 4). Every replay is checked against
an eager runner over the same model (every logit, KV of every live sequence) AND for where it ran:
the shortest set whose block tables hold the step's widest table (prompt chunks: the full set), with
that set's bound reaching the attention as its host context bound. Covers random ragged steps with
prompt chunks, rollbacks and freed sequences; chains ending at / just past every bound and at
max_model_len; stale batches when every set holds the same (b, q) key; sampled chains on both sets
of a DraftEngine; and the runner's enable_cuda_graphs(context_lens=...) wiring."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specdec.config import CacheConfig, EngineConfig
from specdec.cuda_graphs import CHAIN_MAX, GraphedForward, GraphSets
from specdec.kernels.triton_attention import TritonAttention, launch_plan
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.cpu_graphs import CpuGraphs, CpuSampler
from tests.helpers.op_sets import tiny_config
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)

BLOCK, MML, BOUNDS, V = 4, 64, (8, 16, 32), 61


class Recording(TritonAttention):
    """The GPU's attention, noting the host bounds (context, table width) each call was planned for
    and the KV splits of every call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, int]] = []
        self.splits: list[int] = []

    def attend(self, q, k_cache, v_cache, batch, scale):
        self.calls.append((batch.max_context_len, batch.block_tables.shape[1]))
        self.splits.append(launch_plan(len(batch.context_lens), q.shape[1], k_cache.shape[2], q.shape[2],
                                       batch.max_query_len, batch.max_context_len, q.device,
                                       elem_size=k_cache.element_size())["num_splits"])
        return super().attend(q, k_cache, v_cache, batch, scale)


def make(context_lens=BOUNDS, num_blocks=96, **kw) -> tuple[ModelRunner, ModelRunner]:
    model = init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1)
    cache = CacheConfig(num_blocks=num_blocks, block_size=BLOCK, dtype=torch.float32)
    eager = ModelRunner(model, cache, backend=TritonAttention())
    graphed = ModelRunner(model, cache, backend=Recording())
    kw = {"query_lens": (1, 2, 4), "batch_sizes": (1, 2, 4), "chains": True, "prefill_lens": (8, 16), **kw}
    graphed.graphs = GraphSets.build(graphed, MML, context_lens, factory=CpuGraphs, **kw)
    return eager, graphed


def replays(graphed) -> list[int]:
    return [s.replays for s in graphed.graphs.sets]


def one_hot(i: int, n: int, k: int = 1) -> list[int]:
    return [k if j == i else 0 for j in range(n)]


def tightest(graphed, width: int, prefill: bool = False) -> int:
    sets = graphed.graphs.sets
    return len(sets) - 1 if prefill else next(i for i, s in enumerate(sets) if s.max_blocks >= width)


def seq_kv(runner, seq_id) -> torch.Tensor:
    table = torch.tensor(runner.blocks.block_table(seq_id), dtype=torch.long)
    return runner.kv.data[:, :, table].flatten(2, 3)[:, :, :runner.num_tokens(seq_id)]


def same_kv(eager, graphed, seqs) -> None:
    for s in seqs:
        assert graphed.num_tokens(s) == eager.num_tokens(s)
        torch.testing.assert_close(seq_kv(graphed, s), seq_kv(eager, s), atol=1e-5, rtol=0)


def step(eager, graphed, items) -> int:
    """One step on both runners: the same logits, replayed on the tightest set (checked before the
    step: the widest table after it), planned for that set's bound; returns the set's index."""
    width = max(graphed.blocks.blocks_needed(graphed.num_tokens(i.seq_id) + len(i.token_ids)) for i in items)
    on = tightest(graphed, width, prefill=max(len(i.token_ids) for i in items) > graphed.graphs.query_lens[-1])
    before, eager_before = replays(graphed), graphed.eager_forwards
    graphed.backend.calls.clear()
    want, got = eager.step(items), graphed.step(items)
    assert [g.shape for g in got] == [w.shape for w in want]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert [a - b for a, b in zip(replays(graphed), before)] == one_hot(on, len(before)), (width, on)
    assert graphed.eager_forwards == eager_before
    s = graphed.graphs.sets[on]
    assert set(graphed.backend.calls) == {(s.max_context, s.max_blocks)}
    return on


def greedy(eager, seqs, first, steps) -> list[list[int]]:
    want, fed = [], list(first)
    for _ in range(steps):
        fed = [int(x.argmax(-1)) for x in eager.step([SeqInput(s, [t]) for s, t in zip(seqs, fed)])]
        want.append(fed)
    return want


def chain(eager, graphed, seqs, first, steps) -> int:
    """A greedy chain on the graphed runner, step by step on the eager one: the same tokens, all
    `steps` replays on the set holding the chain's last position; returns that set's index."""
    on = tightest(graphed, max(graphed.blocks.blocks_needed(graphed.num_tokens(s) + steps) for s in seqs))
    assert graphed.can_chain(seqs, steps)
    want = greedy(eager, seqs, first, steps)
    before = replays(graphed)
    graphed.backend.calls.clear()
    assert graphed.greedy_chain(seqs, first, steps).tolist() == want
    assert [a - b for a, b in zip(replays(graphed), before)] == one_hot(on, len(before), steps)
    s = graphed.graphs.sets[on]
    assert set(graphed.backend.calls) == {(s.max_context, s.max_blocks)}
    return on


def ids(rng, n) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


# --- building ------------------------------------------------------------------------------------
def test_bounds_round_to_blocks_dedupe_and_stop_below_max_model_len():
    _, graphed = make((3, 8, 7, 13, 16, 0, 62, 64, 100), prefill_lens=(2, 8, 16, 128))
    gs = graphed.graphs
    assert gs.context_bounds == (4, 8, 16, 64)      # 3 -> 4; 7, 8 -> 8; 13, 16 -> 16; 62, 64, 100: the full set
    assert [s.max_blocks for s in gs.sets] == [1, 2, 4, 16]
    assert [s.prefill_lens for s in gs.sets] == [(), (), (), (8, 16)] and gs.prefill_lens == (8, 16)
    full = gs.sets[-1]
    for s in gs.sets:
        assert s.query_lens == (1, 2, 4) and s.batch_sizes == (1, 2, 4) and set(s.chains) == {1, 2, 4}
        assert set(s.graphs) == {(b, q) for b in (1, 2, 4) for q in s.query_lens + s.prefill_lens}
        assert s._logits is full._logits and s._pool is full._pool
        for (b, q), g in s.graphs.items():
            assert g.batch.context_lens_host == [s.max_context] * b          # the bound the kernel plans for
            assert tuple(g.batch.block_tables.shape) == (b, s.max_blocks)
            assert g.logits.data_ptr() == full._logits.data_ptr()
    assert (gs.num_graphs == sum(len(s.graphs) + len(s.chains) + len(s.heads) for s in gs.sets)
            == 3 * (9 + 3 + 3) + 15 + 3 + 3)   # heads: query length 2 is graphed
    assert (gs.graphs, gs.chains, gs.max_context, gs.max_blocks) == (full.graphs, full.chains, 64, 16)
    with pytest.raises(AttributeError):
        gs.no_such_attribute
    # A max_model_len that is not a whole number of blocks: bounds rounding into its last block are it.
    _, odd = make(())
    odd.graphs = GraphSets.build(odd, 62, (57, 60, 61, 62), factory=CpuGraphs, query_lens=(1,), batch_sizes=(1,))
    assert odd.graphs.context_bounds == (60, 64)


def test_enable_cuda_graphs_builds_the_sets(monkeypatch):
    """runner.enable_cuda_graphs itself (its capture swapped for the CPU stand-in): bounds below
    max_model_len get sets with the same buckets and chains; prefill buckets only in the full set."""
    for name in ("_check_device", "_new_pool"):
        monkeypatch.setattr(GraphedForward, name, staticmethod(getattr(CpuGraphs, name)))
    monkeypatch.setattr(GraphedForward, "_capture", CpuGraphs._capture)
    monkeypatch.setattr(GraphedForward, "_capture_chain", CpuGraphs._capture_chain)
    monkeypatch.setattr(GraphedForward, "_capture_head", CpuGraphs._capture_head)
    eager, graphed = make(())
    graphed.enable_cuda_graphs(62, query_lens=(1, 2), batch_sizes=(1, 2), chains=True, prefill_lens=(8,),
                               context_lens=(5, 8, 61, 100))
    gs = graphed.graphs
    assert isinstance(gs, GraphSets) and gs.context_bounds == (8, 64)
    assert [s.prefill_lens for s in gs.sets] == [(), (8,)] and all(set(s.chains) == {1, 2} for s in gs.sets)
    for r in (eager, graphed):
        r.add_sequence(0)
    assert step(eager, graphed, [SeqInput(0, [1, 2, 3, 4, 5])]) == 1   # a prompt chunk: the full set's (1, 8)
    assert step(eager, graphed, [SeqInput(0, [6, 7])]) == 0            # 7 tokens: within 8
    assert chain(eager, graphed, [0], [9], 2) == 1                     # ends at 9
    graphed.enable_cuda_graphs(62, context_lens=(62, 64))
    assert isinstance(graphed.graphs, GraphedForward) and graphed.graphs.context_bounds == (64,)


# --- steps ---------------------------------------------------------------------------------------
def test_random_ragged_steps_prompts_rollbacks_and_frees_match_eager():
    eager, graphed = make()
    rng = random.Random(11)
    live, next_id, used, high = [], 0, [0] * 4, 0
    for _ in range(30):
        op = rng.random()
        if (op < 0.2 and len(live) < 5) or not live:       # a prompt joins (a chunk over 4: prefill bucket)
            for r in (eager, graphed):
                r.add_sequence(next_id)
            n = rng.randint(1, 14)
            items = [SeqInput(next_id, ids(rng, n), rng.randint(0, 1))]
            items += [SeqInput(s, ids(rng, 1)) for s in rng.sample(live, min(2, len(live)))
                      if graphed.num_tokens(s) < MML]
            live.append(next_id)
            next_id += 1
        elif op < 0.32:                                    # a rollback (rejected drafts), maybe a long one
            s = rng.choice(live)
            keep = rng.randint(0, graphed.num_tokens(s))
            for r in (eager, graphed):
                r.truncate(s, keep)
            continue
        elif op < 0.38 and len(live) > 1:
            s = live.pop(rng.randrange(len(live)))
            for r in (eager, graphed):
                r.free(s)
            continue
        else:                                              # a ragged decode / verify step
            items = []
            for s in rng.sample(live, rng.randint(1, min(4, len(live)))):
                n = min(rng.choice([1, 2, 3, 4, 4]), MML - graphed.num_tokens(s))
                if n:
                    items.append(SeqInput(s, ids(rng, n), rng.randint(0, n)))
            if not items:
                continue
        rng.shuffle(items)
        used[step(eager, graphed, items)] += 1
        high = max([high] + [b for s in live for b in graphed.blocks.block_table(s)])
    assert all(used), used                                 # every set served steps
    same_kv(eager, graphed, live)
    assert not graphed.kv.data[:, :, high + 1:].any()      # padding rows (slot -1) wrote nothing


def test_device_ids_replace_the_staged_ones_on_a_short_set():
    eager, graphed = make()
    for r in (eager, graphed):
        for s in (0, 1):
            r.add_sequence(s)
        r.step([SeqInput(0, list(range(1, 6))), SeqInput(1, list(range(7, 16)))])  # 5 and 9 tokens
    for fed in ([3, 4], [5, 6]):
        items = [SeqInput(0, [0]), SeqInput(1, [0])]
        staged = graphed.prepare(items)
        assert graphed.graphs.staged_graph(staged) is graphed.graphs.sets[1].graphs[(2, 1)]
        got = graphed.forward(dataclasses.replace(staged, input_ids=torch.tensor(fed)))
        want = eager.forward(dataclasses.replace(eager.prepare(items), input_ids=torch.tensor(fed)))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    same_kv(eager, graphed, (0, 1))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # empty splits (masked)
def test_with_split_kv_planned_from_each_bound_replays_still_match_eager(monkeypatch):
    """The GPU's split plans on the CPU (132 SMs, 8 keys a split at least): each set's graphs split
    the KV by their own bound (1, 2, 4 and 8 splits for 8, 16, 32 and 64 tokens; a short context on
    a long bound leaves most splits empty); every replay equals the eager forward."""
    import specdec.kernels.triton_attention as ta
    monkeypatch.setattr(ta, "MIN_KEYS_PER_SPLIT", 8)
    monkeypatch.setattr(ta, "_num_sms", lambda device: 132)
    ta._plan.cache_clear()
    try:
        eager, graphed = make()
        splits = [ta.choose_splits(2, s.max_context, 132) for s in graphed.graphs.sets]
        assert splits == [1, 2, 4, 8], splits
        rng = random.Random(8)
        for r in (eager, graphed):
            for sid in (0, 1):
                r.add_sequence(sid)
        assert step(eager, graphed, [SeqInput(0, ids(rng, 10)), SeqInput(1, ids(rng, 2))]) == 3
        assert step(eager, graphed, [SeqInput(1, ids(rng, 2), 2)]) == 0          # 4 tokens
        assert chain(eager, graphed, [1, 0], ids(rng, 2), 3) == 1               # 7 and 13 tokens
        assert step(eager, graphed, [SeqInput(0, ids(rng, 4), 3), SeqInput(1, ids(rng, 1))]) == 2  # 17
        same_kv(eager, graphed, (0, 1))
        # Two layers a forward: the full set's 8 splits, the 8-token set's 1, a chain of 3 on 2, then 4.
        assert graphed.backend.splits == [8, 8, 1, 1] + [2] * 6 + [4, 4]
    finally:
        ta._plan.cache_clear()


# --- chains --------------------------------------------------------------------------------------
def test_chains_end_at_and_just_past_every_bound_and_at_max_model_len():
    eager, graphed = make()
    for r in (eager, graphed):
        r.add_sequence(0)
    step(eager, graphed, [SeqInput(0, [1, 2, 3, 4, 5])])                 # 5 tokens (prefill bucket)
    rng = random.Random(0)
    on = [chain(eager, graphed, [0], [7], 3),                            # ends at 8: the 8-token set
          chain(eager, graphed, [0], [8], 1),                            # 9: the 16-token set
          chain(eager, graphed, [0], [9], 7),                            # 16: still
          chain(eager, graphed, [0], [10], 1),                           # 17
          step(eager, graphed, [SeqInput(0, ids(rng, 4), 4)]),           # 21 (verify)
          step(eager, graphed, [SeqInput(0, ids(rng, 4), 2)]),           # 25
          step(eager, graphed, [SeqInput(0, ids(rng, 4), 0)]),           # 29
          chain(eager, graphed, [0], torch.tensor([11]), 3),             # 32, ids on the device
          chain(eager, graphed, [0], [12], 1)]                           # 33: the full set
    assert on == [0, 1, 1, 2, 2, 2, 2, 2, 3]
    step(eager, graphed, [SeqInput(0, ids(rng, 15))])                  # 48: a prompt-sized chunk, full set
    step(eager, graphed, [SeqInput(0, ids(rng, 12), 3)])               # 60
    assert graphed.can_chain([0], 4) and not graphed.can_chain([0], 5)
    assert chain(eager, graphed, [0], [13], 4) == 3                     # ends at max_model_len
    assert graphed.num_tokens(0) == MML and not graphed.can_chain([0], 1)
    assert not graphed.can_chain([0], CHAIN_MAX + 1)
    same_kv(eager, graphed, [0])
    # Rolled back to 6 tokens, the sequence is short again: steps and chains go back to the first set.
    for r in (eager, graphed):
        r.truncate(0, 6)
    assert step(eager, graphed, [SeqInput(0, [14])]) == 0
    assert chain(eager, graphed, [0], [15], 1) == 0
    same_kv(eager, graphed, [0])
    assert not graphed.kv.data[:, :, 16:].any()


def test_chains_of_several_sequences_run_on_the_set_of_the_widest():
    eager, graphed = make()
    rng = random.Random(4)
    for r in (eager, graphed):
        for s in range(3):
            r.add_sequence(s)
    step(eager, graphed, [SeqInput(0, ids(rng, 3)), SeqInput(1, ids(rng, 2)), SeqInput(2, ids(rng, 1))])
    assert chain(eager, graphed, [2, 0, 1], ids(rng, 3), 5) == 0         # 8, 7, 6 tokens: the set of 8
    assert chain(eager, graphed, [1, 2], ids(rng, 2), 2) == 1            # 8 and 10 tokens
    assert chain(eager, graphed, [0, 1, 2], ids(rng, 3), 6) == 1         # 14, 15, 14
    step(eager, graphed, [SeqInput(1, ids(rng, 4), 2)])                  # 18: the 32-token set
    assert chain(eager, graphed, [0, 2], ids(rng, 2), 3) == 2            # 17 and 17
    for r in (eager, graphed):
        r.free(1)
    assert chain(eager, graphed, [0, 2], ids(rng, 2), 1) == 2
    for r in (eager, graphed):                                           # both roll back under 8
        r.truncate(0, 3)
        r.truncate(2, 7)
    assert chain(eager, graphed, [2, 0], ids(rng, 2), 1) == 0
    same_kv(eager, graphed, (0, 2))


# --- staged batches ------------------------------------------------------------------------------
def test_every_set_holds_a_batch_of_the_same_key_and_stale_ones_are_refused():
    eager, graphed = make()
    gs = graphed.graphs
    lens = {0: 3, 1: 10, 2: 20, 3: 40, 4: 11}                            # widths 1, 3, 5, 10, 3 blocks
    for r in (eager, graphed):
        for s, n in lens.items():
            r.add_sequence(s)
            r.step([SeqInput(s, list(range(1, n + 1)))])
    staged = {s: graphed.prepare([SeqInput(s, [s + 1])]) for s in range(4)}  # all bucket (1, 1), one per set
    for s, batch in staged.items():
        assert batch.graph_key[:2] == (1, 1) and gs.staged_graph(batch) is gs.sets[s].graphs[(1, 1)]
    for s in (3, 1, 0, 2):                                               # any order: none overwrote another
        want = eager.step([SeqInput(s, [s + 1])])[0]
        torch.testing.assert_close(graphed.forward(staged[s]), want, atol=1e-5, rtol=0)
    # A later step on the same set's (1, 1) overwrites it; the other sets' batches are untouched.
    first, other = graphed.prepare([SeqInput(1, [7])]), graphed.prepare([SeqInput(0, [7])])
    second = graphed.prepare([SeqInput(4, [8])])                          # set 1's (1, 1) again
    for bad in (first, dataclasses.replace(first, input_ids=torch.tensor([7]))):
        for use in (graphed.forward, gs.staged_graph, lambda x: gs.chain(x, None, 1)):
            with pytest.raises(RuntimeError, match="overwritten"):
                use(bad)
    for s, batch, tok in ((4, second, 8), (0, other, 7)):
        torch.testing.assert_close(graphed.forward(batch), eager.step([SeqInput(s, [tok])])[0], atol=1e-5, rtol=0)
    graphed.truncate(1, eager.num_tokens(1))                             # `first` never ran
    # A chain on one set spends a batch staged there, not one staged on another set.
    on_short, on_mid = graphed.prepare([SeqInput(0, [9])]), graphed.prepare([SeqInput(4, [9])])
    assert chain(eager, graphed, [3], [5], 2) == 3 and chain(eager, graphed, [1], [5], 2) == 1
    torch.testing.assert_close(graphed.forward(on_short), eager.step([SeqInput(0, [9])])[0], atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.forward(on_mid)
    graphed.truncate(4, eager.num_tokens(4))
    # A batch staged by another runner's sets is refused (stamps are unique across sets and runners).
    _, stranger = make()
    stranger.add_sequence(0)
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.forward(stranger.prepare([SeqInput(0, [1])]))
    b = graphed.prepare([SeqInput(2, [3])])
    assert gs.staged_graph(b) is gs.sets[2].graphs[(1, 1)]
    with pytest.raises(ValueError, match="only input_ids"):
        graphed.forward(dataclasses.replace(b, positions=b.positions.clone()))
    torch.testing.assert_close(graphed.forward(b), eager.step([SeqInput(2, [3])])[0], atol=1e-5, rtol=0)
    same_kv(eager, graphed, range(5))


# --- sampled chains ------------------------------------------------------------------------------
def test_sampled_chains_on_both_sets_draft_what_the_sampler_draws_position_by_position(tmp_path):
    from specdec.engine import DraftEngine, DraftSeqInput
    from specdec.sampling.params import SamplingParams
    from specdec.sampling.transport import dense_weights
    from tests.helpers.tiny_models import make_pair
    _, draft_path = make_pair(tmp_path)
    config = EngineConfig(model=draft_path, num_blocks=96, block_size=BLOCK, warmup_batch_sizes=(1,),
                          max_num_draft=6, probs_dtype=torch.float16)
    plain, chained = DraftEngine(config), DraftEngine(config)
    for e in (plain, chained):
        e.runner.backend = TritonAttention()
        e.runner.graphs = GraphSets.build(e.runner, 128, (16,), factory=CpuGraphs, query_lens=(1, 2),
                                          batch_sizes=(1, 2, 4), chains=True)
        e.sampler = CpuSampler(e.vocab_size, (1, 2, 4), config.max_num_draft, torch.float16, e.device)
    chained._capture_sampled_chains()
    short, full = chained.runner.graphs.sets
    assert set(short.sampled_chains) == set(full.sampled_chains) == {1, 2, 4}
    assert not plain.runner.graphs.sampled_chains
    t = [SamplingParams(temperature=0.9, top_k=20, seed=7), SamplingParams(temperature=1.2, seed=8)]
    steps = [[DraftSeqInput(1, 0, [3, 4, 5], 4, t[0], first=True), DraftSeqInput(2, 0, [7, 1], 4, t[1], first=True)]]
    steps += [[DraftSeqInput(1, 3, [k], 5, t[0]), DraftSeqInput(2, 4, [k + 1], 5, t[1])] for k in range(2, 6)]
    ran = []
    for s in steps:
        before = [x.replays for x in chained.runner.graphs.sets] + [chained.sampler.replays]
        a, b = plain.propose(s), chained.propose(s)
        ran.append([x - y for x, y in zip([x.replays for x in chained.runner.graphs.sets]
                                           + [chained.sampler.replays], before)])
        assert [o.error for o in b.outputs] == [None] * len(s)
        assert [o.tokens for o in b.outputs] == [o.tokens for o in a.outputs]
        for x, y in zip(a.outputs, b.outputs):
            assert torch.equal(dense_weights(x.probs), dense_weights(y.probs))
    assert max(chained.runner.num_tokens(s) for s in (1, 2)) > 16
    # [short set, full set, sampler graph] replays a step: the prompts eagerly, then a chain of 3 (its
    # first draw on the sampler); a (2, 2) feed, then a chain of 4; then whole-step chains of 5, on
    # the short set until a sequence passes 16 tokens, then on the full set (no sampler replay: every
    # draw in a chain). Without the sampled chains each step would draw 5 times on the sampler.
    assert ran == [[3, 0, 1], [5, 0, 1], [5, 0, 0], [0, 5, 0], [0, 5, 0]], ran
