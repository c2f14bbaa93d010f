"""Review tests (session 21) of head graphs (ModelRunner.fed_chain, GraphedForward.head_chain,
GraphSets.head_chain / can_head, DraftEngine._fed_chain), of argmax rows read from a graph's output
(runner.forward / step_flat argmax=True, TargetEngine._score) and of staging.current_stream.

Every fed chain is checked against eager step-by-step greedy decoding on a second runner over the
same model: the tokens, each sequence's KV and token count, and that KV blocks no sequence owns
stay zero (padding writes nothing). Graphs are the CPU stand-ins (tests/helpers/cpu_graphs.py: a
replay re-runs the captured function on the same static buffers).

Attention: the Triton kernels run under the interpreter here at ~0.3 s a forward, so most tests use
DeviceAttention, a torch attention that is graph-safe as the Triton kernel is: it reads query
spans, context lengths, block tables and slots from the batch's tensors (what a replay sees), never
the host lists (a static batch's are its capture's), and it checks what the kernel would only
assume (each real query within the host bounds the graph was planned for, tables wide enough, no
slot out of range). test_device_attention_is_the_triton_kernels_on_these_batches ties it to the
Triton kernels on the same kinds of batches, a fed chain included."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specdec.block_manager import OutOfBlocks
from specdec.config import CacheConfig, EngineConfig
from specdec.cuda_graphs import CHAIN_MAX, GraphedForward, GraphSets
from specdec.kernels.reference import paged_attention_ref
from specdec.kernels.triton_attention import TritonAttention
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.cpu_graphs import CpuGraphs, warm_record
from tests.helpers.op_sets import tiny_config
from tests.helpers import threads
from tests.unit.test_graph_staging import seq_kv

BLOCK, V = 4, 61
one_thread = threads.one_thread   # autouse here: single-threaded


class DeviceAttention:
    """Paged attention and KV store in torch, reading only the batch's device tensors (see the
    module docstring); slot -1 writes nothing, as the Triton store kernel skips it."""

    name = "device-torch"

    def store(self, k, v, k_cache, v_cache, batch) -> None:
        nb, bs = k_cache.shape[:2]
        keep = (batch.slot_mapping >= 0).nonzero().squeeze(1)
        slots = batch.slot_mapping.index_select(0, keep)
        if slots.numel():
            assert int(slots.max()) < nb * bs, "a KV slot past the cache"
        for src, cache in ((k, k_cache), (v, v_cache)):
            cache.view(nb * bs, *cache.shape[2:]).index_copy_(0, slots, src.index_select(0, keep).to(cache.dtype))

    def attend(self, q, k_cache, v_cache, batch, scale: float) -> torch.Tensor:
        starts = batch.query_start_loc.tolist()
        ctx = batch.context_lens.tolist()
        lens = [e - s for s, e in zip(starts, starts[1:])]
        assert starts[0] == 0 and min(lens) >= 0 and starts[-1] <= q.shape[0], starts
        bs, width = k_cache.shape[1], batch.block_tables.shape[1]
        real = [i for i, n in enumerate(lens) if n]
        for i in real:  # what the kernel's grid (planned from the host bounds) covers
            assert lens[i] <= batch.max_query_len and lens[i] <= ctx[i] <= batch.max_context_len, (lens, ctx)
            assert -(-ctx[i] // bs) <= width
        out = torch.zeros_like(q)
        t = starts[-1]
        if real:
            out[:t] = paged_attention_ref(q[:t], k_cache, v_cache, batch.block_tables[real],
                                          [ctx[i] for i in real], [lens[i] for i in real], scale)
        return out


def make(num_blocks: int = 64, bounds: tuple[int, ...] = (), max_model_len: int = 64, backend=DeviceAttention,
         **kw) -> tuple[ModelRunner, ModelRunner]:
    """(eager, graphed) runners over one tiny random model; graphed has CpuGraphs (GraphSets with
    `bounds` below max_model_len), query lengths 1, 2, 4, batch sizes 1, 2, 4 and chains (heads)."""
    model = init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1)

    def runner():
        return ModelRunner(model, CacheConfig(num_blocks=num_blocks, block_size=BLOCK, dtype=torch.float32),
                           backend=backend())
    eager, graphed = runner(), runner()
    kw = {"query_lens": (1, 2, 4), "batch_sizes": (1, 2, 4), "chains": True, **kw}
    if bounds:
        graphed.graphs = GraphSets.build(graphed, max_model_len, bounds, factory=CpuGraphs, **kw)
    else:
        graphed.graphs = CpuGraphs(graphed, max_model_len=max_model_len, **kw)
    return eager, graphed


def ids(rng, n: int) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


def add(runners, prompts: dict) -> None:
    """New sequences with their prompts, one eager forward per prompt on both runners."""
    for r in runners:
        for s, p in prompts.items():
            r.add_sequence(s)
            r.step([SeqInput(s, p)], graphs=False)


def sets_of(graphed) -> list:
    g = graphed.graphs
    return g.sets if isinstance(g, GraphSets) else [g]


def replays(graphed) -> list[int]:
    return [s.replays for s in sets_of(graphed)]


def same_kv(eager, graphed, seqs) -> None:
    for s in seqs:
        assert graphed.num_tokens(s) == eager.num_tokens(s), s
        torch.testing.assert_close(seq_kv(graphed, s), seq_kv(eager, s), atol=1e-5, rtol=0)


def unowned_zero(runner) -> None:
    owned = {b for s in runner.blocks.seq_ids() for b in runner.blocks.block_table(s)}
    unowned = [b for b in range(runner.kv.num_blocks) if b not in owned]
    assert not runner.kv.data[:, :, unowned].any(), "KV written into blocks no sequence owns"


def eager_fed(eager, items, steps: int) -> list[list[int]]:
    """What fed_chain must give: the feeds as one eager step, each sequence's argmax, then
    steps - 1 greedy single-token steps."""
    fed = [int(x.argmax(-1)) for x in eager.step(items)]
    want = [fed]
    for _ in range(steps - 1):
        fed = [int(x.argmax(-1)) for x in eager.step([SeqInput(i.seq_id, [t]) for i, t in zip(items, fed)])]
        want.append(fed)
    return want


def fed(eager, graphed, items, steps: int, on: int | None = None) -> int:
    """A fed chain on the graphed runner against eager greedy steps: the same tokens and KV, every
    replay (the head's and the chain's) on one set; returns that set's index (checked if `on`)."""
    assert graphed.can_fed_chain(items, steps)
    want = eager_fed(eager, items, steps)
    before, eager_before = replays(graphed), graphed.eager_forwards
    got = graphed.fed_chain(items, steps)
    assert got.shape == (steps, len(items)) and got.dtype == torch.int64
    assert got.tolist() == want
    ran = [a - b for a, b in zip(replays(graphed), before)]
    assert sorted(ran) == [0] * (len(ran) - 1) + [steps], ran
    assert graphed.eager_forwards == eager_before
    same_kv(eager, graphed, [i.seq_id for i in items])
    where = ran.index(steps)
    if on is not None:
        assert where == on, (where, on)
    return where


def plain_step(eager, graphed, items, bucket=None) -> None:
    """An ordinary step on both runners: the same logits (staged on `bucket` if given)."""
    staged = graphed.prepare(items)
    if bucket is not None:
        assert staged.graph_key is not None and staged.graph_key[:2] == bucket
    got = graphed.forward(staged).split([i.num_logits for i in items])
    for w, g in zip(eager.step(items), got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def plain_chain(eager, graphed, seqs, first, steps: int) -> None:
    want, f = [], list(first)
    for _ in range(steps):
        f = [int(x.argmax(-1)) for x in eager.step([SeqInput(s, [t]) for s, t in zip(seqs, f)])]
        want.append(f)
    assert graphed.greedy_chain(list(seqs), list(first), steps).tolist() == want


# --- the stand-in attention ----------------------------------------------------------------------
def test_device_attention_is_the_triton_kernels_on_these_batches():
    """DeviceAttention against the Triton kernels (interpreted) on the same model: a ragged eager
    step, then a fed chain on CpuGraphs with each backend (a padding sequence, feeds across a
    block boundary): the same logits, tokens and KV."""
    rng = random.Random(0)
    fast, tri = make(backend=DeviceAttention), make(backend=TritonAttention)   # the same seeded weights
    prompts = [SeqInput(0, ids(rng, 7)), SeqInput(1, ids(rng, 2)), SeqInput(2, ids(rng, 3))]
    ragged = [SeqInput(1, ids(rng, 2), 2), SeqInput(0, ids(rng, 1)), SeqInput(2, ids(rng, 4), 0)]
    for r in (*fast, *tri):
        for i in prompts:
            r.add_sequence(i.seq_id)
        r.step(prompts)
    for x, y in zip(fast[0].step(ragged), tri[0].step(ragged)):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
    fast[1].step(ragged)
    tri[1].step(ragged)
    assert [tri[1].num_tokens(s) % BLOCK for s in range(3)] == [0, 0, 3]
    items = [SeqInput(0, ids(rng, 2)), SeqInput(1, ids(rng, 1)), SeqInput(2, ids(rng, 2))]  # 3 of bucket 4
    want = eager_fed(tri[0], items, 3)
    assert fast[1].fed_chain(items, 3).tolist() == tri[1].fed_chain(items, 3).tolist() == want
    for s in range(3):
        torch.testing.assert_close(seq_kv(fast[1], s), seq_kv(tri[1], s), atol=1e-5, rtol=0)
        torch.testing.assert_close(seq_kv(tri[1], s), seq_kv(tri[0], s), atol=1e-5, rtol=0)
    unowned_zero(tri[1])


# --- GraphSets -----------------------------------------------------------------------------------
def test_fed_chains_on_graph_sets_pick_the_set_of_the_last_position_and_spend_only_its_batches():
    """Bounds 16 and 64: a fed chain whose tables (after its last step) fit 16 tokens runs on the
    short set, one that passes 16 on the full set; exactly 16 is still short. Batches staged
    before on the head's buckets (b, 1) and (b, 2) of the set that ran it are refused afterwards;
    those staged on the same buckets of the other set still replay as they were."""
    eager, graphed = make(bounds=(16,))
    rng = random.Random(1)
    add((eager, graphed), {0: ids(rng, 5), 1: ids(rng, 7), 2: ids(rng, 3), 5: ids(rng, 20), 6: ids(rng, 18),
                           7: ids(rng, 21)})
    short, full = graphed.graphs.sets
    # Staged on the full set's (4, 1) and then (4, 2) (3 long sequences), not yet run.
    long_1 = [SeqInput(s, ids(rng, 1)) for s in (5, 6, 7)]
    long_2 = [SeqInput(s, ids(rng, 2), 1) for s in (5, 6, 7)]
    on_full_1, on_full_2 = graphed.prepare(long_1), graphed.prepare(long_2)
    assert graphed.graphs.staged_graph(on_full_1) is full.graphs[(4, 1)]
    assert graphed.graphs.staged_graph(on_full_2) is full.graphs[(4, 2)]
    # Staged on the short set's (4, 1) and (4, 2) with the head's own sequences, then rolled back.
    on_short_1 = graphed.prepare([SeqInput(s, [1]) for s in (0, 1, 2)])
    on_short_2 = graphed.prepare([SeqInput(s, [1, 2]) for s in (0, 1, 2)])
    assert graphed.graphs.staged_graph(on_short_2) is short.graphs[(4, 2)]
    for s in (0, 1, 2):
        graphed.truncate(s, eager.num_tokens(s))
    items = [SeqInput(0, ids(rng, 2)), SeqInput(1, ids(rng, 1)), SeqInput(2, ids(rng, 2))]
    assert fed(eager, graphed, items, 5, on=0) == 0                        # 11, 12, 9 tokens
    for stale in (on_short_1, on_short_2):
        with pytest.raises(RuntimeError, match="overwritten"):
            graphed.forward(stale)
    for staged, its in ((on_full_1, long_1), (on_full_2, long_2)):  # the full set's: untouched
        got = graphed.forward(staged)
        for w, g in zip(eager.step(its), got.split([i.num_logits for i in its])):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    # Now the other way round: the short set's (4, 1) holds a batch, a fed chain runs on the full set.
    on_short_1 = graphed.prepare([SeqInput(s, [3]) for s in (0, 2)] + [SeqInput(1, [4])])
    assert graphed.graphs.staged_graph(on_short_1) is short.graphs[(4, 1)]
    on_full_1 = graphed.prepare([SeqInput(s, [5]) for s in (5, 6, 7)])
    for s in (5, 6, 7):
        graphed.truncate(s, eager.num_tokens(s))
    assert fed(eager, graphed, [SeqInput(5, ids(rng, 2)), SeqInput(7, ids(rng, 1)), SeqInput(6, ids(rng, 2))],
               3, on=1) == 1
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.forward(on_full_1)
    got = graphed.forward(on_short_1)
    for w, g in zip(eager.step([SeqInput(s, [3]) for s in (0, 2)] + [SeqInput(1, [4])]), got.split(1)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    # 12, 13 and 10 tokens now: one that ends at 16 runs short, one more step runs on the full set.
    assert [graphed.num_tokens(s) for s in (0, 1, 2)] == [12, 13, 10]
    assert fed(eager, graphed, [SeqInput(2, ids(rng, 2)), SeqInput(0, ids(rng, 1))], 4) == 0   # 15 and 16
    assert fed(eager, graphed, [SeqInput(1, ids(rng, 2))], 3) == 1                             # 13 + 2 + 2
    assert fed(eager, graphed, [SeqInput(0, ids(rng, 2))], 1) == 1                             # a head alone: 18
    unowned_zero(graphed)


# --- the end of the context and block boundaries ------------------------------------------------
@pytest.mark.parametrize("bounds", [(), (16,)])
def test_a_fed_chain_may_end_exactly_at_max_model_len(bounds):
    """Feeds of 2 and 1 tokens whose chain's last step writes position 63 of max_model_len 64 (the
    inputs then move past the table: never written), and a head alone (steps 1) whose feed fills
    the context; can_fed_chain refuses one token more. With GraphSets, on the full set."""
    eager, graphed = make(bounds=bounds)
    rng = random.Random(2)
    add((eager, graphed), {9: ids(rng, 58), 8: ids(rng, 59), 7: ids(rng, 62), 6: ids(rng, 3)})
    items = [SeqInput(9, ids(rng, 2)), SeqInput(8, ids(rng, 1)), SeqInput(6, ids(rng, 2))]
    assert graphed.can_fed_chain(items, 5) and not graphed.can_fed_chain(items, 6)
    assert not graphed.can_fed_chain(items[:2], 6) and graphed.can_fed_chain(items[2:], 6)
    assert fed(eager, graphed, items, 5) == len(bounds)                      # 64, 64 and 9 tokens
    assert graphed.num_tokens(9) == graphed.num_tokens(8) == 64
    head = [SeqInput(7, ids(rng, 2))]
    assert graphed.can_fed_chain(head, 1) and not graphed.can_fed_chain(head, 2)
    assert not graphed.can_fed_chain([SeqInput(7, ids(rng, 2)), SeqInput(9, ids(rng, 1))], 1)   # 9 is full
    assert fed(eager, graphed, head, 1) == len(bounds)                       # 62 + 2 = 64: no chain replay
    with pytest.raises(ValueError, match="no head"):
        graphed.fed_chain([SeqInput(6, ids(rng, 2))], CHAIN_MAX + 1)
    assert graphed.num_tokens(6) == eager.num_tokens(6)                      # refused before reserving
    # The sequences at the limit still take ordinary verifies after a rollback.
    for r in (eager, graphed):
        r.truncate(9, 61)
    plain_step(eager, graphed, [SeqInput(9, ids(rng, 3), 3), SeqInput(6, ids(rng, 1))])
    same_kv(eager, graphed, (9, 8, 7, 6))
    unowned_zero(graphed)


def test_feeds_across_block_boundaries_and_chains_across_several_blocks():
    """Sequences at every offset in their last block (so a 2-token feed straddles a boundary or
    starts a block), tables interleaved by earlier growth, chains of up to CHAIN_MAX steps crossing
    several blocks; then the same sequences with their roles swapped."""
    eager, graphed = make(num_blocks=96, max_model_len=128)
    rng = random.Random(3)
    add((eager, graphed), {s: ids(rng, 1 + s) for s in range(4)})           # 1..4 tokens
    for _ in range(3):                                                        # interleave their blocks
        plain_step(eager, graphed, [SeqInput(s, ids(rng, 4), 1) for s in range(4)])
    assert [graphed.num_tokens(s) % BLOCK for s in range(4)] == [1, 2, 3, 0]
    tables = [graphed.blocks.block_table(s) for s in range(4)]
    assert any(b - a != 1 for t in tables for a, b in zip(t, t[1:]))       # not contiguous
    lens = [2, 2, 2, 1]                                                       # seq 2 (3 mod 4): straddles
    fed(eager, graphed, [SeqInput(s, ids(rng, n)) for s, n in zip(range(4), lens)], 13)
    fed(eager, graphed, [SeqInput(s, ids(rng, n)) for s, n in zip((3, 1, 0), (2, 1, 2))], CHAIN_MAX)
    fed(eager, graphed, [SeqInput(2, ids(rng, 2)), SeqInput(3, ids(rng, 2))], 7)
    assert max(graphed.num_tokens(s) for s in range(4)) > 40
    unowned_zero(graphed)


# --- KV reservation: all or none ------------------------------------------------------------------
def test_a_fed_chain_out_of_kv_blocks_changes_nothing():
    """When the step's blocks are not free, fed_chain raises OutOfBlocks before any reservation
    (the first sequence's alone would fit: a partial reservation would show), can_fed_chain
    changes nothing, and a batch staged before on the head's bucket still replays; a chain that
    fits then matches eager."""
    eager, graphed = make(num_blocks=12)
    rng = random.Random(4)
    add((eager, graphed), {0: ids(rng, 10), 1: ids(rng, 9), 2: ids(rng, 3), 3: ids(rng, 2)})  # 3+3+1+1 blocks
    staged_items = [SeqInput(2, ids(rng, 2), 2), SeqInput(3, ids(rng, 1))]
    staged = graphed.prepare(staged_items)                                    # bucket (2, 2); 3 blocks free
    assert staged.graph_key[:2] == (2, 2) and graphed.blocks.num_free == 3
    items = [SeqInput(0, ids(rng, 2)), SeqInput(1, ids(rng, 2))]             # 7 steps: 2 + 2 blocks more

    def state():
        return (graphed.blocks.num_free, [graphed.num_tokens(s) for s in range(4)],
                [graphed.blocks.block_table(s) for s in range(4)])
    before = state()
    assert graphed.can_fed_chain(items, 7)                                   # the graphs fit it, the KV not
    assert state() == before
    with pytest.raises(OutOfBlocks):
        graphed.fed_chain(items, 7)
    assert state() == before
    got = graphed.forward(staged)                                             # not overwritten
    for w, g in zip(eager.step(staged_items), got.split([2, 1])):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    fed(eager, graphed, items, 5)                                             # 1 + 1 blocks: fits
    assert graphed.blocks.num_free == 1
    unowned_zero(graphed)


# --- padding turned into fed sequences and back ---------------------------------------------------
def test_heads_of_one_to_four_sequences_on_bucket_four_between_other_steps():
    """Only bucket size 4: heads of 1, 2, 3 and 4 sequences (and back to 1) on (4, 2) / (4, 1),
    each after an ordinary step of another size on (4, 1) or (4, 2), so the head's inputs turn
    padding sequences into fed ones and fed ones into padding; plain chains and ordinary steps
    afterwards; every token and KV as eager, nothing written outside the sequences' blocks."""
    eager, graphed = make(num_blocks=96, max_model_len=128, batch_sizes=(4,), query_lens=(1, 2))
    rng = random.Random(5)
    add((eager, graphed), {s: ids(rng, 2 + 3 * s) for s in range(4)})
    rounds = [((0, 1, 2), 1, [(3, 2)], 3),
              ((0, 1, 2, 3), 2, [(1, 1), (0, 2)], 4),
              ((2, 3), 1, [(3, 1), (1, 2), (2, 2)], 2),
              ((1,), 2, [(0, 2), (2, 1), (3, 1), (1, 2)], 5),
              ((0, 1, 2, 3), 1, [(2, 2)], 6),
              ((3, 0), 2, [(1, 2), (3, 2), (0, 1)], 1)]
    for ordinary, q, feeds, steps in rounds:
        plain_step(eager, graphed, [SeqInput(s, ids(rng, q), q) for s in ordinary], bucket=(4, q))
        fed(eager, graphed, [SeqInput(s, ids(rng, n)) for s, n in feeds], steps)
    plain_chain(eager, graphed, (2, 0, 3), ids(rng, 3), 4)
    plain_chain(eager, graphed, (1,), ids(rng, 1), 2)
    plain_step(eager, graphed, [SeqInput(s, ids(rng, 1)) for s in range(4)], bucket=(4, 1))
    plain_step(eager, graphed, [SeqInput(s, ids(rng, 2), 2) for s in (3, 1)], bucket=(4, 2))
    same_kv(eager, graphed, range(4))
    unowned_zero(graphed)


# --- argmax rows ---------------------------------------------------------------------------------
def test_argmax_rows_on_graph_sets_equal_the_eager_logits_argmax():
    """runner.forward(batch, argmax=True) on both sets of GraphSets: ragged steps asking for all,
    some or none of their rows, ids replaced on the device, steps too long for any bucket (eager);
    the argmax of the eager logits' rows every time (int64, one per requested row), and the KV."""
    eager, graphed = make(bounds=(16,))
    rng = random.Random(9)
    add((eager, graphed), {s: ids(rng, 2 + 5 * s) for s in range(4)})        # 2, 7, 12, 17 tokens
    used = set()
    for t in range(12):
        items = []
        for s in rng.sample(range(4), rng.randint(1, 4)):
            n = 6 if t == 5 else rng.choice([1, 2, 3, 4])
            items.append(SeqInput(s, ids(rng, n), rng.choice([0, n, rng.randint(0, n)])))
        want = eager.step_flat(items).argmax(-1)
        staged = graphed.prepare(items)
        if staged.graph_key is not None and t % 3 == 0:                         # ids replaced on the device
            staged = dataclasses.replace(staged, input_ids=torch.tensor([x for i in items for x in i.token_ids]))
        before = replays(graphed)
        got = graphed.forward(staged, argmax=True)
        ran = [a - b for a, b in zip(replays(graphed), before)]
        used.add(ran.index(1) if 1 in ran else None)
        assert (staged.graph_key is None) == (t == 5) and sum(ran) == (t != 5)
        assert got.dtype == torch.int64 and got.shape == want.shape and got.tolist() == want.tolist()
    assert used == {0, 1, None}
    same_kv(eager, graphed, range(4))


# --- engines -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.helpers.tiny_models import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), with_tokenizer=False)


def engine_pair(path, cls, **graph_kw):
    """Two engines of one checkpoint on DeviceAttention, the second on CpuGraphs sets for 16 and
    64 tokens (longer steps eager)."""
    config = EngineConfig(model=path, num_blocks=160, block_size=BLOCK, warmup_batch_sizes=(1,), max_num_draft=8)
    plain, graphed = cls(config), cls(config)
    for e in (plain, graphed):
        e.runner.backend = DeviceAttention()
    graphed.runner.graphs = GraphSets.build(graphed.runner, 64, (16,), factory=CpuGraphs, batch_sizes=(1, 2, 4),
                                            chains=True, **graph_kw)
    return plain, graphed


def test_draft_engine_drafts_the_same_through_heads_over_random_accept_patterns(checkpoint):
    """Random proposals: each sequence keeps a random number of its drafts (all of them half the
    time: a feed of 2 tokens), num_draft mostly uniform across the step (a head and a chain),
    sometimes ragged; a sequence released mid-way, one restarted (first=True) with a 2-token
    prompt beside running ones (it joins a head), one restarted with a long prompt, a new one
    joining. The graphed engine drafts what the plain one drafts, with the same forwards, token
    counts and KV, and writes nothing into blocks no sequence ever held."""
    from specdec.engine import DraftEngine
    from specdec.engine.types import DraftSeqInput
    plain, graphed = engine_pair(checkpoint, DraftEngine, query_lens=(1, 2))
    heads = []
    fed_chain = graphed.runner.fed_chain
    graphed.runner.fed_chain = lambda items, n: heads.append((now[0], sorted(len(i.token_ids) for i in items), n)) \
        or fed_chain(items, n)
    now, head_sets = [0], []
    for i, gs in enumerate(graphed.runner.graphs.sets):
        gs.head_chain = lambda batch, steps, i=i, real=gs.head_chain: head_sets.append(i) or real(batch, steps)
    rng = random.Random(7)
    drafted = {s: 0 for s in range(4)}
    step = [DraftSeqInput(s, 0, [rng.randrange(320) for _ in range(n)], 3, first=True)
            for s, n in zip(range(4), (2, 1, 2, 2))]                          # 2-token prompts: a head at once
    held: set[int] = set()
    for t in range(16):
        now[0] = t
        release = [1] if t == 6 else []
        a, b = plain.propose(step, release), graphed.propose(step, release)
        assert [o.error for o in b.outputs] == [None] * len(step)
        assert [o.tokens for o in b.outputs] == [o.tokens for o in a.outputs]
        assert b.timing.num_forwards == a.timing.num_forwards
        for s in step:
            drafted[s.seq_id] = s.num_draft
            assert graphed.runner.num_tokens(s.seq_id) == plain.runner.num_tokens(s.seq_id)
            torch.testing.assert_close(seq_kv(graphed.runner, s.seq_id), seq_kv(plain.runner, s.seq_id),
                                       atol=1e-5, rtol=0)
        held |= {x for s in graphed.runner.blocks.seq_ids() for x in graphed.runner.blocks.block_table(s)}
        if t == 5:
            drafted.pop(1)                                                     # released with the next step
        live = sorted(drafted)
        k = rng.randint(1, 6)
        ragged = rng.random() < 0.25 and t not in (8, 10, 11)   # the steps of the restarts and the newcomer
        step = []
        for s in live:
            keep = drafted[s] if rng.random() < 0.5 else rng.randint(0, drafted[s])
            step.append(DraftSeqInput(s, keep, [rng.randrange(320)], rng.randint(1, 6) if ragged else k))
        if t == 8:
            step[1] = DraftSeqInput(step[1].seq_id, 0, [rng.randrange(320) for _ in range(2)], k, first=True)
        if t == 10:
            step[0] = DraftSeqInput(step[0].seq_id, 0, [rng.randrange(320) for _ in range(6)], k, first=True)
        if t == 11:
            drafted[9] = 0
            step.append(DraftSeqInput(9, 0, [rng.randrange(320)], k, first=True))
    unused = [x for x in range(graphed.runner.kv.num_blocks) if x not in held]
    assert not graphed.runner.kv.data[:, :, unused].any()
    # The heads ran, with feeds of 1 and 2 tokens mixed, on both sets (16 and 64 tokens); the
    # restart with a 2-token prompt (proposed in step 9) fed it in a head, the one with 6 tokens
    # (step 11) could not, the new sequence (step 12) joined one.
    at = {t: f for t, f, _ in heads}
    assert len(at) >= 6 and any(1 in f and 2 in f for f in at.values()), heads
    assert at[9] == [2, 2, 2] and 11 not in at and len(at[12]) == 4, heads   # restarts, a newcomer
    assert len(head_sets) == len(heads) and set(head_sets) == {0, 1}, head_sets


def test_target_engine_greedy_verifies_read_the_argmax_rows_from_the_graphs(checkpoint, monkeypatch):
    """Greedy verifies on a graphed TargetEngine (sets for 16 and 64 tokens, verify and prefill
    buckets) against one without graphs, with drafts from a draft engine of the same model (so
    most are accepted) corrupted at random positions, prompts joining in chunks without logits
    (partial_prefill) beside verifies, a step of nothing but a chunk, and verifies too long for
    any bucket: the same accepted counts and next tokens, KV and token counts; every graph replay
    returned argmaxes (all rows, a subset of them, a prefill bucket's gathered rows)."""
    from specdec.engine import DraftEngine, TargetEngine
    from specdec.engine.types import DraftSeqInput, VerifySeqInput
    plain, graphed = engine_pair(checkpoint, TargetEngine, query_lens=(1, 2, 3, 4), prefill_lens=(8,))
    drafter = DraftEngine(plain.config)
    drafter.runner.backend = DeviceAttention()
    outputs = []
    real_outputs = GraphedForward._outputs

    def spy(self, g, batch, t, argmax=False):
        out = real_outputs(self, g, batch, t, argmax)
        outputs.append((argmax, batch.logits_indices.numel(), t, self.shape(*batch.graph_key[:2]).logit_rows is not None))
        return out
    monkeypatch.setattr(GraphedForward, "_outputs", spy)
    rng = random.Random(8)

    def toks(n):
        return [rng.randrange(320) for _ in range(n)]
    prompts = {s: toks(n) for s, n in zip(range(3), (3, 6, 2))}
    to_draft = {s: (0, p, True) for s, p in prompts.items()}     # the drafter's keep, new tokens, first
    to_verify = {s: (p, True) for s, p in prompts.items()}      # the target's new tokens, first
    chunks = {5: (toks(7), toks(5)), 6: (toks(6), toks(3))}
    accepted, ran = [], []
    for t in range(10):
        seqs = []
        if t != 5:
            ks = {s: 5 if t == 7 else rng.choice([0, 1, 2, 3, 3]) for s in to_draft}   # step 7: past every bucket
            proposal = drafter.propose([DraftSeqInput(s, keep, new, ks[s], first=first)
                                        for s, (keep, new, first) in to_draft.items()]).outputs
            for s, o in zip(to_draft, proposal):
                d = list(o.tokens)
                if d and rng.random() < 0.4:
                    d[rng.randrange(len(d))] = rng.randrange(320)             # a rejection there
                seqs.append(VerifySeqInput(s, to_verify[s][0], d, first=to_verify[s][1]))
        if t == 2:
            seqs.insert(1, VerifySeqInput(5, chunks[5][0], partial_prefill=True, first=True))
        if t == 3:
            seqs.append(VerifySeqInput(5, chunks[5][1]))
        if t == 5:
            seqs = [VerifySeqInput(6, chunks[6][0], partial_prefill=True, first=True)]   # no logits at all
        if t == 6:
            seqs.append(VerifySeqInput(6, chunks[6][1]))
        release = [0] if t == 6 else []                              # 4 sequences again
        if release:
            seqs = [x for x in seqs if x.seq_id not in release]
            del to_draft[0], to_verify[0]
        before = (graphed.graph_replays, graphed.eager_forwards)
        a, b = plain.verify(seqs, release), graphed.verify(seqs, release)
        ran.append((graphed.graph_replays - before[0], graphed.eager_forwards - before[1]))
        assert [(o.error, o.accepted, o.next_token) for o in b.outputs] == \
               [(o.error, o.accepted, o.next_token) for o in a.outputs]
        assert all(o.error is None for o in b.outputs)
        for o, s in zip(a.outputs, seqs):
            assert graphed.runner.num_tokens(s.seq_id) == plain.runner.num_tokens(s.seq_id)
            if s.partial_prefill:
                assert o.next_token == -1
                continue
            if s.seq_id in to_draft:
                accepted.append(o.accepted)
                to_draft[s.seq_id] = (o.accepted, [o.next_token], False)
            else:                                                              # its prompt is in: it drafts next
                to_draft[s.seq_id] = (0, chunks[s.seq_id][0] + chunks[s.seq_id][1] + [o.next_token], True)
            to_verify[s.seq_id] = ([o.next_token], False)
    for s in list(plain.runner.blocks.seq_ids()):
        torch.testing.assert_close(seq_kv(graphed.runner, s), seq_kv(plain.runner, s), atol=1e-5, rtol=0)
    assert max(accepted) >= 2 and 0 in accepted
    assert ran[7] == (0, 1) and ran.count((1, 0)) == 9, ran                # step 7 alone ran eagerly
    assert outputs and all(argmax for argmax, *_ in outputs)
    assert any(n == t and not p for _, n, t, p in outputs)                   # every row
    assert any(0 < n < t and not p for _, n, t, p in outputs)                # a subset (a chunk beside)
    assert any(p and n for _, n, t, p in outputs)                            # a prefill bucket's rows
    assert any(n == 0 for _, n, t, p in outputs)                             # a chunk alone: no rows


# --- staging.current_stream -----------------------------------------------------------------------
def test_current_stream_is_looked_up_again_only_when_the_raw_handle_changes(monkeypatch):
    """The Stream object is cached per device index and kept while the raw current-stream handle
    is the same; a device without an index is the current device; a new handle (another stream
    made current) is looked up, and so is the old one again."""
    from specdec import staging

    class FakeStream:
        def __init__(self, raw):
            self.cuda_stream = raw
    raw = {0: 100, 1: 200}
    lookups = []
    monkeypatch.setattr(staging, "_streams", {})
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: raw[i], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i=None: lookups.append(i) or FakeStream(raw[i]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    s0 = staging.current_stream(torch.device("cuda", 0))
    assert s0.cuda_stream == 100 and staging.current_stream(torch.device("cuda:0")) is s0
    s1 = staging.current_stream(torch.device("cuda"))                       # the current device: 1
    assert s1.cuda_stream == 200 and s1 is not s0 and staging.current_stream(torch.device("cuda", 1)) is s1
    assert lookups == [0, 1]
    raw[0] = 101                                                             # a side stream made current
    s0b = staging.current_stream(torch.device("cuda", 0))
    assert s0b.cuda_stream == 101 and staging.current_stream(torch.device("cuda", 1)) is s1
    raw[0] = 100
    assert staging.current_stream(torch.device("cuda", 0)).cuda_stream == 100
    assert lookups == [0, 1, 0, 0]


# --- capture: the GPU's warm-up runs ----------------------------------------------------------------
class WarmCpuGraphs(CpuGraphs):
    """CpuGraphs whose chain and head graphs go through GraphedForward's own capture methods, with
    GraphCaptures._record's warm-up as on the GPU: the function runs twice for real (reset after
    each run) before the capture, which does not run it."""

    _record = staticmethod(warm_record)
    _capture_chain = GraphedForward._capture_chain
    _capture_head = GraphedForward._capture_head


def argmax_pick(b):
    tokens = torch.zeros(CHAIN_MAX, b, dtype=torch.int64)

    def pick(logits, at):
        ids = logits.argmax(-1)
        tokens.index_copy_(0, at, ids[None])
        return ids
    return pick, tokens


def warm_captured(query_lens, sampled: bool):
    _, graphed = make(num_blocks=16)
    graphed.graphs = GraphSets.build(graphed, 64, (16,), factory=WarmCpuGraphs, query_lens=query_lens,
                                     batch_sizes=(1, 2), chains=True)
    if sampled:
        graphed.graphs.capture_sampled_chains(argmax_pick)
    return graphed


def test_capture_warm_ups_write_no_kv_without_sampled_chains_or_heads():
    """The capture's warm-up runs (graphs, chains, heads; sampled chains without heads) write no
    KV: their static inputs hold padding (slot -1). Fed chains on such graphs still match eager."""
    for query_lens, sampled in (((1, 2), False), ((1,), True)):
        graphed = warm_captured(query_lens, sampled)
        assert bool(graphed.graphs.heads) == (2 in query_lens)
        assert not graphed.kv.data.any()
    eager, graphed = make(num_blocks=16)
    graphed.graphs = WarmCpuGraphs(graphed, max_model_len=64, query_lens=(1, 2), batch_sizes=(1, 2), chains=True)
    add((eager, graphed), {0: [1, 2, 3], 1: [4]})
    fed(eager, graphed, [SeqInput(0, [5, 6]), SeqInput(1, [7])], 3)
    unowned_zero(graphed)


def test_sampled_chain_capture_after_heads_writes_no_kv():
    """The review's bug (a strict xfail before the fix): the head capture's warm-up runs left bucket
    (b, 1)'s static inputs with real KV slots (block 0), and the sampled chains, captured later on
    those inputs unstaged, wrote KV there in their warm-up runs. _capture_chain now puts the slots
    back to -1 before it captures."""
    graphed = warm_captured((1, 2), sampled=True)
    assert not graphed.kv.data.any()
