"""The greedy draft step's host-time cuts: chains run from a StagedKey (stage(key_only=True)) instead
of a staged ForwardBatch; greedy_chain / fed_chain check a call on the width their reservation check
finds (no second pass of can_chain) and still refuse a wrong call before reserving anything;
GraphedForward._bucket without Shape objects; CostProfile / DecodeProfile.update_many and
DraftEngine._update_profile built on it; DraftEngine._to_host reading a greedy chain's positions
from one [n, rows] entry. Runners and graphs are session 21's review stand-ins (CpuGraphs,
DeviceAttention)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specdec.block_manager import OutOfBlocks
from specdec.cost_model import CostProfile
from specdec.cuda_graphs import CHAIN_MAX, GraphedForward, StagedKey
from specdec.engine.draft import DraftEngine
from specdec.engine.timing import DecodeProfile
from specdec.runner import SeqInput
from tests.unit.test_session21_review import add, eager_fed, ids, make, same_kv, sets_of, unowned_zero


def _state(graphed, seqs):
    return (graphed.blocks.num_free, [graphed.num_tokens(s) for s in seqs],
            [graphed.blocks.block_table(s) for s in seqs])


def _eager_chain(eager, seqs, first, steps):
    want, f = [], list(first)
    for _ in range(steps):
        f = [int(x.argmax(-1)) for x in eager.step([SeqInput(s, [t]) for s, t in zip(seqs, f)])]
        want.append(f)
    return want


# --- StagedKey ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bounds", [(), (16,)])
def test_a_staged_key_runs_the_chain_and_head_a_batch_would(bounds):
    """stage(key_only=True) gives the bucket, stamp and sequence count; chain / head_chain from the
    key give the eager greedy tokens and KV, on the set whose inputs hold it."""
    eager, graphed = make(bounds=bounds)
    rng = random.Random(11)
    add((eager, graphed), {0: ids(rng, 5), 1: ids(rng, 3), 2: ids(rng, 6)})
    seqs, first = [0, 2], [7, 9]
    key = graphed.graphs.stage(*graphed._host_arrays([SeqInput(s, [t]) for s, t in zip(seqs, first)], ahead=2),
                               key_only=True)
    assert isinstance(key, StagedKey) and (key.b, key.q, key.n) == (2, 1, 2)
    holder = [s for s in sets_of(graphed) if s.graphs[(2, 1)].stamp == key.stamp]
    assert len(holder) == 1 and holder[0] is sets_of(graphed)[0]        # 10 tokens: the shortest set
    assert graphed.graphs.chain(key, None, 3).tolist() == _eager_chain(eager, seqs, first, 3)
    items = [SeqInput(1, ids(rng, 2)), SeqInput(0, ids(rng, 1)), SeqInput(2, ids(rng, 2))]
    want = eager_fed(eager, items, 2)
    key2 = graphed.graphs.stage(*graphed._host_arrays(items, ahead=1), key_only=True)
    assert (key2.b, key2.q, key2.n) == (4, 2, 3)
    assert graphed.graphs.head_chain(key2, 2).tolist() == want
    same_kv(eager, graphed, (0, 1, 2))
    unowned_zero(graphed)


@pytest.mark.parametrize("bounds", [(), (16,)])
def test_a_staged_key_is_refused_once_a_later_stage_overwrote_it(bounds):
    """A key replays only while its bucket's inputs still hold it, as a staged batch does: a later
    stage on that bucket (a prepare, a greedy_chain, a fed chain's head writing bucket (b, 1))
    refuses it; a stage on another set's bucket of the same shape does not."""
    eager, graphed = make(bounds=bounds)
    rng = random.Random(12)
    add((graphed,), {0: ids(rng, 3), 1: ids(rng, 2), 2: ids(rng, 2), 3: ids(rng, 30)})

    def key_for(seq, n=1, ahead=1):
        return graphed.graphs.stage(*graphed._host_arrays([SeqInput(seq, ids(rng, n))], ahead=ahead),
                                    key_only=True)
    key = key_for(0)
    graphed.prepare([SeqInput(1, [5])])                                   # bucket (1, 1) again
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.graphs.chain(key, None, 1)
    key = key_for(0)
    graphed.greedy_chain([1], [5], 2)
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.graphs.chain(key, None, 2)
    key = key_for(0, n=2)
    graphed.fed_chain([SeqInput(1, [4, 5])], 2)                           # bucket (1, 2) and (1, 1)
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.graphs.head_chain(key, 2)
    key = key_for(0)
    graphed.fed_chain([SeqInput(2, [4, 5])], 2)                           # its head rewrites (1, 1)
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.graphs.chain(key, None, 1)
    with pytest.raises(RuntimeError, match="overwritten"):                # a stamp no graph held
        graphed.graphs.chain(StagedKey(key.b, key.q, -1, key.n), None, 1)
    if bounds:
        key = key_for(0)                                                  # the short set's (1, 1)
        graphed.prepare([SeqInput(3, [5])])                               # 31 tokens: the full set's (1, 1)
        assert key.stamp == sets_of(graphed)[0].graphs[(1, 1)].stamp
        assert graphed.graphs.chain(key, None, 1).shape == (1, 1)


def test_a_key_for_the_wrong_bucket_is_refused_as_a_batch_is():
    _, graphed = make()
    rng = random.Random(13)
    add((graphed,), {0: ids(rng, 3)})
    key = graphed.graphs.stage(*graphed._host_arrays([SeqInput(0, ids(rng, 2))], ahead=1), key_only=True)
    assert key.q == 2
    with pytest.raises(ValueError, match="no chain of 2 steps"):
        graphed.graphs.chain(key, None, 2)                                # a (1, 2) bucket has no chain
    with pytest.raises(ValueError, match="no head and chain of 17 steps"):
        graphed.graphs.head_chain(key, CHAIN_MAX + 1)


# --- wrong calls: refused before anything is reserved -------------------------------------------
@pytest.mark.parametrize("bounds", [(), (16,)])
def test_wrong_greedy_and_fed_chains_raise_and_reserve_nothing(bounds):
    eager, graphed = make(bounds=bounds)
    rng = random.Random(14)
    add((eager, graphed), {0: ids(rng, 60), 1: ids(rng, 5), 2: ids(rng, 2)})
    seqs = (0, 1, 2)
    before = _state(graphed, seqs)
    for call, match in [
            (lambda: graphed.greedy_chain([0], [3], 5), "no chain graph"),          # 65 > 64 tokens
            (lambda: graphed.greedy_chain([1, 0], [3, 4], 5), "no chain graph"),
            (lambda: graphed.greedy_chain([1], [3], CHAIN_MAX + 1), "no chain graph"),
            (lambda: graphed.greedy_chain([1], [3], 0), "no chain graph"),
            (lambda: graphed.greedy_chain([], [], 2), "no chain graph"),
            (lambda: graphed.greedy_chain([1, 1], [3, 3], 2), "twice"),
            (lambda: graphed.fed_chain([SeqInput(0, [1, 2])], 4), "no head"),     # 60 + 2 + 3 > 64
            (lambda: graphed.fed_chain([SeqInput(1, [1, 2, 3])], 2), "no head"),  # 3 tokens
            (lambda: graphed.fed_chain([SeqInput(1, [1])], 2), "no head"),        # no 2-token feed
            (lambda: graphed.fed_chain([SeqInput(1, [1, 2], 2)], 2), "no head"),  # 2 logit rows
            (lambda: graphed.fed_chain([SeqInput(1, [1, 2])], CHAIN_MAX + 1), "no head"),
            (lambda: graphed.fed_chain([], 2), "no head"),
            (lambda: graphed.fed_chain([SeqInput(1, [1, 2]), SeqInput(1, [3])], 2), "twice")]:
        with pytest.raises(ValueError, match=match):
            call()
        assert _state(graphed, seqs) == before
    with pytest.raises(KeyError, match="unknown sequence"):
        graphed.greedy_chain([1, 9], [3, 3], 2)
    with pytest.raises(KeyError, match="unknown sequence"):
        graphed.fed_chain([SeqInput(1, [1, 2]), SeqInput(9, [3])], 2)
    assert _state(graphed, seqs) == before
    # Right calls after all that: the eager tokens and KV.
    assert graphed.greedy_chain([1, 2], [3, 4], 4).tolist() == _eager_chain(eager, [1, 2], [3, 4], 4)
    items = [SeqInput(2, ids(rng, 2)), SeqInput(0, ids(rng, 1))]
    want = eager_fed(eager, items, 3)
    assert graphed.fed_chain(items, 3).tolist() == want
    same_kv(eager, graphed, seqs)
    unowned_zero(graphed)


def test_a_chain_that_fits_no_graph_is_refused_before_the_kv_is_found_short():
    """A call that neither fits a graph nor finds its blocks free raises the graphs' refusal (as
    can_chain, checked first, did), not OutOfBlocks; one that fits raises OutOfBlocks; neither
    reserves anything."""
    _, graphed = make(num_blocks=16)
    rng = random.Random(15)
    add((graphed,), {0: ids(rng, 60)})                                     # 15 of 16 blocks
    before = _state(graphed, (0,))
    with pytest.raises(ValueError, match="no chain graph"):
        graphed.greedy_chain([0], [1], 5)                                 # 17 blocks: too wide, 2 short
    with pytest.raises(ValueError, match="no head"):
        graphed.fed_chain([SeqInput(0, [1, 2])], 4)
    assert _state(graphed, (0,)) == before
    graphed.add_sequence(1)
    graphed.step([SeqInput(1, ids(rng, 4))], graphs=False)                # the 16th block
    with pytest.raises(OutOfBlocks):
        graphed.greedy_chain([1], [1], 2)                                 # fits the graphs, not the KV
    with pytest.raises(OutOfBlocks):
        graphed.fed_chain([SeqInput(1, [1, 2])], 2)
    assert _state(graphed, (0, 1))[1:] == ([60, 4], [before[2][0], graphed.blocks.block_table(1)])


# --- _bucket --------------------------------------------------------------------------------------
def test_bucket_is_the_shape_rule():
    """_bucket without Shape objects: the smallest q, then b, whose shape fits (the rule it had)."""
    def reference(g, n, q_max, width, num_tokens=0, num_logits=0):
        if width > g.max_blocks:
            return None
        for q in g.query_lens + g.prefill_lens:
            if q >= q_max:
                for b in g.batch_sizes:
                    if b >= n and g.shape(b, q).fits(num_tokens, num_logits):
                        return (b, q)
        return None
    g = object.__new__(GraphedForward)
    g.query_lens, g.batch_sizes, g.max_blocks, g.prefill_lens = (1, 2, 4), (1, 2, 4, 8), 16, (8, 32)
    for n in range(1, 10):
        for q in range(1, 34):
            for width in (3, 16, 17):
                for tokens in sorted({0, n, n * q, n * q + 1, 40, 70}):
                    for logits in sorted({0, n, tokens, 33}):
                        assert g._bucket(n, q, width, tokens, logits) == reference(g, n, q, width, tokens, logits)


# --- profiles -------------------------------------------------------------------------------------
def _recording(costs: CostProfile) -> tuple[DecodeProfile, list]:
    calls: list = []
    costs.subscribe(lambda b, q, s: calls.append(("entry", b, q, s)))
    profile = DecodeProfile(costs)
    profile.on_sample.append(lambda b, s: calls.append(("sample", b, s)))
    return profile, calls


def test_update_many_is_update_of_each_sample_in_turn():
    """The same entries (bit for bit) and listener calls, in the same order, as update() per
    sample: the first sample of a bucket taken as is, the clamp, another bucket, no samples."""
    runs = [(3, [0.004, 0.004, 0.004]), (3, [0.02, 0.0001]), (8, [0.01]), (5, []), (1, [0.003, 0.0031])]
    one, one_calls = _recording(CostProfile())
    many, many_calls = _recording(CostProfile())
    for b, samples in runs:
        for s in samples:
            one.update(b, s)
        many.update_many(b, samples)
    assert one_calls == many_calls and len(one_calls) == 2 * 8
    assert one.costs.table() == many.costs.table()
    assert many.costs.update_many(3, 1, []) is None
    assert many.costs.update_many(3, 1, [0.004]) == one.costs.update(3, 1, 0.004)
    with pytest.raises(ValueError, match="non-negative"):
        many.costs.update_many(3, 1, [-1.0])


@pytest.mark.parametrize("seed", range(6))
def test_update_profile_updates_as_the_per_forward_loop_did(seed):
    """DraftEngine._update_profile (runs of forwards at one batch, update_many each) against the
    loop it replaced (update per forward after the first), over ragged num_draft and forwards."""
    rng = random.Random(seed)
    for _ in range(30):
        counts = [rng.choice([0, 1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 6))]
        forwards = [rng.random() for _ in range(max(counts) + rng.choice([0, 0, 1]))]
        plans = [SimpleNamespace(seq=SimpleNamespace(num_draft=k)) for k in counts]
        want, got = [], []
        ordered = sorted((k for k in counts if k), reverse=True)
        for step, seconds in enumerate(forwards[1:], start=1):          # the old loop
            batch = sum(1 for k in ordered if k > step)
            if batch:
                want.append((batch, seconds))
        engine = SimpleNamespace(profile=SimpleNamespace(
            update_many=lambda b, samples: got.extend((b, s) for s in samples)))
        DraftEngine._update_profile(engine, plans, forwards)
        assert got == want, (counts, len(forwards))


# --- _to_host -------------------------------------------------------------------------------------
def test_to_host_reads_a_chain_entry_as_its_positions():
    """A greedy chain's entry (tokens [n, rows]) gives what its n per-position entries gave, beside
    single positions of other rows (a step whose first forward ran alone)."""
    plans = [SimpleNamespace(seq=SimpleNamespace(sampling=SimpleNamespace(greedy=True))) for _ in range(4)]
    active = [0, 1, 3]                                                   # plan 2 drafts nothing
    first = torch.tensor([5, 6, 7])
    chain = torch.tensor([[10, 11], [20, 21], [30, 31]])                  # rows 2 and 0, 3 positions
    one_entry = [([0, 1, 2], first, None), ([2, 0], chain, None)]
    per_position = [([0, 1, 2], first, None)] + [([2, 0], t, None) for t in chain]
    want = [[5, 11, 21, 31], [6], [], [7, 10, 20, 30]]
    assert DraftEngine._to_host(plans, active, per_position) == (want, [None] * 4)
    assert DraftEngine._to_host(plans, active, one_entry) == (want, [None] * 4)
    whole = torch.tensor([[10, 20, 30], [11, 21, 31]])                   # a whole step's chain: 2 x 3
    assert DraftEngine._to_host(plans, active, [([0, 1, 2], whole, None)]) == (
        [[10, 11], [20, 21], [], [30, 31]], [None] * 4)
