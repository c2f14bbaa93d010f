"""CUDA-graph staging on the CPU: GraphedForward with its capture replaced by a "graph" that runs
the model on the bucket's static inputs, which is exactly what a captured graph reads. So the
staging (padding to the bucket, one packed fill, the rows returned, ids replaced on the device,
stale batches refused) is checked against eager steps without a GPU; the GPU tests add the real
capture. Ragged steps matter most: a graph that read its logits rows from the staged buffer passed
every uniform test and failed here."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specdec.config import CacheConfig
from specdec.cuda_graphs import CHAIN_MAX, GraphedForward
from specdec.kernels.triton_attention import TritonAttention
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.cpu_graphs import CpuGraphs
from tests.helpers.op_sets import tiny_config
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)


def eager_and_cpu_graphed(num_blocks: int, **graphs) -> tuple[ModelRunner, ModelRunner]:
    """Two runners over one tiny random model: eager, and with CpuGraphs (max_model_len 64, query
    lengths 1, 2, 4, batch sizes 1, 2, 4, and `graphs`)."""
    model = init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1)

    def runner():
        return ModelRunner(model, CacheConfig(num_blocks=num_blocks, block_size=4, dtype=torch.float32),
                           backend=TritonAttention())
    eager, graphed = runner(), runner()
    graphed.graphs = CpuGraphs(graphed, max_model_len=64, query_lens=(1, 2, 4), batch_sizes=(1, 2, 4),
                               **graphs)
    return eager, graphed


@pytest.fixture
def runners():
    eager, graphed = eager_and_cpu_graphed(64, chains=True)
    rng = random.Random(1)
    prompts = {s: [rng.randrange(61) for _ in range(3 + 2 * s)] for s in range(4)}
    for r in (eager, graphed):
        for s in prompts:
            r.add_sequence(s)
        r.step([SeqInput(s, ids) for s, ids in prompts.items()])  # 9 tokens: eager on both
    return eager, graphed, rng


def test_ragged_staged_steps_match_eager(runners):
    eager, graphed, rng = runners
    for _ in range(12):
        chosen = rng.sample(range(4), rng.randint(1, 4))
        items = []
        for s in chosen:
            n = rng.choice([1, 2, 3, 4])
            items.append(SeqInput(s, [rng.randrange(61) for _ in range(n)], rng.randint(0, n)))
        before = graphed.graphs.replays
        for want, got in zip(eager.step(items), graphed.step(items)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert graphed.graphs.replays == before + 1  # every step fitted a bucket
    torch.testing.assert_close(graphed.kv.data, eager.kv.data, atol=1e-5, rtol=0)  # padding wrote nothing


def test_argmax_steps_give_the_argmax_of_the_logits_rows(runners, prefill_runners):
    """step_flat(argmax=True): the argmax of each requested row, read from the graph's output (all
    rows, a subset of them, a prefill bucket's gathered rows, no rows) and from an eager forward."""
    eager, graphed, rng = runners
    for _ in range(8):
        items = []
        for s in rng.sample(range(4), rng.randint(1, 4)):
            n = rng.choice([1, 2, 4])
            items.append(SeqInput(s, [rng.randrange(61) for _ in range(n)], rng.choice([0, n, rng.randint(0, n)])))
        want = eager.step_flat(items).argmax(-1)
        before = graphed.graphs.replays
        got = graphed.step_flat(items, argmax=True)
        assert graphed.graphs.replays == before + 1 and got.dtype == torch.int64
        assert got.tolist() == want.tolist()
    prompts = [SeqInput(5, [rng.randrange(61) for _ in range(30)]), SeqInput(6, [rng.randrange(61) for _ in range(70)])]
    for p in prompts:
        eager.add_sequence(p.seq_id)
        graphed.add_sequence(p.seq_id)
    # 70 tokens: past every bucket, eager on both
    assert graphed.step_flat(prompts, argmax=True).tolist() == eager.step_flat(prompts).argmax(-1).tolist()
    eager_p, graphed_p, _ = prefill_runners
    for r in (eager_p, graphed_p):
        r.add_sequence(0)
        r.add_sequence(1)
        r.step([SeqInput(0, [1, 2, 3])])
    chunk = [SeqInput(1, [rng.randrange(61) for _ in range(6)], 2), SeqInput(0, [4, 5], 1)]
    before = graphed_p.graphs.replays
    got = graphed_p.step_flat(chunk, argmax=True)
    assert graphed_p.graphs.replays == before + 1     # a prefill bucket: the graph gathered the rows
    assert got.tolist() == eager_p.step_flat(chunk).argmax(-1).tolist()


def test_device_ids_replace_the_staged_ones(runners):
    eager, graphed, rng = runners
    for _ in range(4):
        items = [SeqInput(s, [0]) for s in (0, 2, 3)]
        fed = torch.tensor([rng.randrange(61) for _ in items])
        staged = graphed.prepare(items)
        assert staged.graph_key is not None
        got = graphed.forward(dataclasses.replace(staged, input_ids=fed))
        want = eager.forward(dataclasses.replace(eager.prepare(items), input_ids=fed))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_stale_or_altered_staged_batches_are_refused(runners):
    _, graphed, _ = runners
    first = graphed.prepare([SeqInput(0, [1]), SeqInput(1, [2])])
    second = graphed.prepare([SeqInput(2, [3]), SeqInput(1, [4])])     # same bucket (2, 1)
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.forward(first)
    altered = dataclasses.replace(second, positions=second.positions.clone())
    with pytest.raises(ValueError, match="only input_ids"):
        graphed.forward(altered)
    assert graphed.graphs.forward(dataclasses.replace(second, graph_key=None)) is None  # unstaged: eager
    out = graphed.forward(second)
    assert out.shape == (2, 61) and torch.isfinite(out).all()
    kept = out.clone()  # the result is the caller's: the next replay (other inputs) leaves it alone
    nxt = graphed.forward(graphed.prepare([SeqInput(2, [5]), SeqInput(1, [6])]))
    assert torch.equal(out, kept) and not torch.equal(nxt, out)


def seq_kv(runner: ModelRunner, seq_id) -> torch.Tensor:
    """A sequence's K and V in token order: [layers, 2, tokens, heads, dim]."""
    table = torch.tensor(runner.blocks.block_table(seq_id))
    kv = runner.kv.data[:, :, table]                       # [layers, 2, blocks, block_size, heads, dim]
    return kv.flatten(2, 3)[:, :, :runner.num_tokens(seq_id)]


def test_greedy_chain_equals_step_by_step_greedy(runners):
    """A chain of replays (argmax fed back, positions, context lengths and slots advanced on the
    device, across block boundaries) gives the tokens and KV of one greedy step at a time."""
    eager, graphed, rng = runners
    for seqs, steps in (((0, 2, 3), 6), ((1,), 1), ((3, 0), 9)):
        first = [rng.randrange(61) for _ in seqs]
        want, fed = [], first
        for _ in range(steps):
            logits = eager.step([SeqInput(s, [t]) for s, t in zip(seqs, fed)])
            fed = [int(x.argmax(-1)) for x in logits]
            want.append(fed)
        before = graphed.graphs.replays
        got = graphed.greedy_chain(list(seqs), torch.tensor(first), steps)
        assert got.tolist() == want
        assert graphed.graphs.replays == before + steps
        for s in seqs:  # the same KV, in blocks the chain reserved in another order
            assert graphed.num_tokens(s) == eager.num_tokens(s)
            torch.testing.assert_close(seq_kv(graphed, s), seq_kv(eager, s), atol=1e-5, rtol=0)
    owned = {b for s in range(4) for b in graphed.blocks.block_table(s)}
    unowned = [b for b in range(graphed.kv.num_blocks) if b not in owned]
    assert not graphed.kv.data[:, :, unowned].any()  # padding rows (slot -1) wrote nothing
    # Ordinary staged steps go on from where the chains left the sequences.
    items = [SeqInput(s, [rng.randrange(61)]) for s in (0, 1, 2, 3)]
    for want, got in zip(eager.step(items), graphed.step(items)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_fed_chain_equals_step_by_step_greedy(runners):
    """A head graph (the feeds of 1 or 2 tokens on bucket (b, 2), each sequence's argmax, the
    chain's inputs set up on the device) and its chain give the tokens and KV of one greedy step
    at a time: ragged feeds, fewer sequences than the bucket (padding), block boundaries, a single
    step (no chain replay)."""
    eager, graphed, rng = runners
    for feeds, steps in ((((0, 2), (2, 1), (3, 2)), 5), (((1, 2),), 1), (((3, 1), (0, 2)), 7),
                         (((0, 2), (1, 2), (2, 2), (3, 2)), 3)):
        # An ordinary step of 3 sequences first: bucket (4, 1) then holds one padding sequence,
        # which the head must turn into a fed one when 4 sequences feed.
        ordinary = [SeqInput(s, [rng.randrange(61)]) for s in (0, 1, 2)]
        for want, got in zip(eager.step(ordinary), graphed.step(ordinary)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        items = [SeqInput(s, [rng.randrange(61) for _ in range(n)]) for s, n in feeds]
        logits = eager.step(items)
        fed = [int(x.argmax(-1)) for x in logits]
        want = [fed]
        for _ in range(steps - 1):
            logits = eager.step([SeqInput(s, [t]) for (s, _), t in zip(feeds, fed)])
            fed = [int(x.argmax(-1)) for x in logits]
            want.append(fed)
        before = graphed.graphs.replays
        assert graphed.can_fed_chain(items, steps)
        got = graphed.fed_chain(items, steps)
        assert got.tolist() == want
        assert graphed.graphs.replays == before + steps
        for s, _ in feeds:
            assert graphed.num_tokens(s) == eager.num_tokens(s)
            torch.testing.assert_close(seq_kv(graphed, s), seq_kv(eager, s), atol=1e-5, rtol=0)
    owned = {b for s in range(4) for b in graphed.blocks.block_table(s)}
    unowned = [b for b in range(graphed.kv.num_blocks) if b not in owned]
    assert not graphed.kv.data[:, :, unowned].any()  # padding sequences wrote nothing
    # Ordinary staged steps and plain chains go on from where the head chains left the sequences.
    items = [SeqInput(s, [rng.randrange(61)]) for s in (0, 1, 2, 3)]
    for want, got in zip(eager.step(items), graphed.step(items)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    first = [rng.randrange(61) for _ in range(2)]
    want, fed = [], first
    for _ in range(3):
        fed = [int(x.argmax(-1)) for x in eager.step([SeqInput(s, [t]) for s, t in zip((2, 0), fed)])]
        want.append(fed)
    assert graphed.greedy_chain([2, 0], first, 3).tolist() == want


def test_fed_chains_only_where_a_head_fits(runners):
    _, graphed, _ = runners
    two = [SeqInput(0, [1, 2]), SeqInput(1, [3])]
    assert graphed.can_fed_chain(two, 4)
    assert not graphed.can_fed_chain([SeqInput(0, [1]), SeqInput(1, [3])], 4)   # no 2-token feed: a plain chain
    assert not graphed.can_fed_chain([SeqInput(0, [1, 2, 3])], 2)                # 3 tokens: no head
    assert not graphed.can_fed_chain([SeqInput(0, [1, 2], num_logits=2)], 2)     # one argmax per sequence
    assert not graphed.can_fed_chain(two, CHAIN_MAX + 1)
    assert not graphed.can_fed_chain(two, 60)                                    # past max_model_len (64)
    tokens = graphed.num_tokens(0)
    with pytest.raises(ValueError, match="no head"):
        graphed.fed_chain([SeqInput(0, [1, 2])], CHAIN_MAX + 1)
    assert graphed.num_tokens(0) == tokens   # refused before anything was reserved
    staged = graphed.prepare([SeqInput(2, [1, 2])])                              # bucket (1, 2)
    graphed.fed_chain([SeqInput(3, [4, 5])], 2)                                  # overwrites it
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.forward(staged)
    no_heads = eager_and_cpu_graphed(64, chains=False)[1]
    no_heads.add_sequence(0)
    assert not no_heads.graphs.heads and not no_heads.can_fed_chain([SeqInput(0, [1, 2])], 2)


def test_a_chain_may_end_at_max_model_len(runners):
    """The last step of a chain that fills the context moves the inputs past the last block;
    that position is never written, and its block index stays inside the table."""
    eager, graphed, rng = runners
    prompt = [rng.randrange(61) for _ in range(60)]
    for r in (eager, graphed):
        r.add_sequence(9)
        r.step([SeqInput(9, prompt)])                              # eager: 60 tokens of max 64
    assert graphed.can_chain([9], 4) and not graphed.can_chain([9], 5)
    want, fed = [], [7]
    for _ in range(4):
        fed = [int(eager.step([SeqInput(9, fed)])[0].argmax(-1))]
        want.append(fed)
    assert graphed.greedy_chain([9], [7], 4).tolist() == want
    assert graphed.num_tokens(9) == 64
    torch.testing.assert_close(seq_kv(graphed, 9), seq_kv(eager, 9), atol=1e-5, rtol=0)


def test_chains_only_where_a_chain_graph_fits(runners):
    _, graphed, _ = runners
    assert graphed.can_chain([0, 1, 2, 3], 2)
    assert not graphed.can_chain([0, 1, 2, 3], CHAIN_MAX + 1)         # longer than any chain
    assert not graphed.can_chain([0], 64)                             # past max_model_len (64)
    staged = graphed.prepare([SeqInput(0, [1])])
    graphed.greedy_chain([1], torch.tensor([5]), 2)                   # same bucket (1, 1): overwrites it
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.forward(staged)
    with pytest.raises(ValueError, match="no chain graph"):
        graphed.greedy_chain([0], torch.tensor([5]), CHAIN_MAX + 1)


def test_draft_engine_drafts_the_same_through_chains(tmp_path):
    """DraftEngine's greedy steps on (emulated) graphs with chains: the same drafts and KV use as
    without graphs, over uniform steps (chained), ragged ones (one position at a time), feeds of
    1 and 2 tokens and sampled sequences mixed in (no chain), and one forward counted per token."""
    from specdec.config import EngineConfig
    from specdec.engine import DraftEngine
    from specdec.engine.types import DraftSeqInput, SamplingParams
    from tests.helpers.tiny_models import make_pair
    _, draft_path = make_pair(tmp_path)
    config = EngineConfig(model=draft_path, num_blocks=64, block_size=4, warmup_batch_sizes=(1,),
                          max_num_draft=8)
    plain, chained = DraftEngine(config), DraftEngine(config)
    for engine in (plain, chained):  # the GPU's attention (graph-safe: it reads lengths on the device)
        engine.runner.backend = TritonAttention()
    chained.runner.graphs = CpuGraphs(chained.runner, max_model_len=128, query_lens=(1, 2),
                                      batch_sizes=(1, 2, 4), chains=True)
    sampled = SamplingParams(temperature=0.9, seed=3)
    steps = [
        [DraftSeqInput(1, 0, [3, 4, 5], 4, first=True), DraftSeqInput(2, 0, [7, 1], 4, first=True)],
        [DraftSeqInput(1, 4, [9], 4), DraftSeqInput(2, 1, [8], 4)],        # feeds of 2 and 1 tokens
        [DraftSeqInput(1, 1, [5], 4), DraftSeqInput(2, 2, [3], 4)],        # 1-token feeds: one chain
        [DraftSeqInput(1, 2, [6], 5), DraftSeqInput(2, 4, [2], 3)],        # ragged: no chain
        [DraftSeqInput(1, 5, [1], 3), DraftSeqInput(2, 0, [4], 3, sampled)],  # sampled: no chain
        [DraftSeqInput(1, 3, [2], 6)],
    ]
    replays, fed_chains = [], []
    fed_chain = chained.runner.fed_chain
    chained.runner.fed_chain = lambda items, n: fed_chains.append([len(i.token_ids) for i in items]) or fed_chain(items, n)
    for step in steps:
        before = chained.runner.graphs.replays
        a, b = plain.propose(step), chained.propose(step)
        replays.append(chained.runner.graphs.replays - before)
        assert [o.tokens for o in b.outputs] == [o.tokens for o in a.outputs]
        assert all(o.error is None for o in b.outputs)
        assert b.timing.num_forwards == a.timing.num_forwards == max(s.num_draft for s in step)
        for s in step:
            assert chained.runner.num_tokens(s.seq_id) == plain.runner.num_tokens(s.seq_id)
    # Prompts run eagerly, then a chain of 3; feeds of 2 tokens: the (2, 2) head graph, then a chain of 3;
    # 1-token feeds: one chain of 4 (the first forward included); ragged: one replay per position
    # (5); sampled: no chains (3); a single sequence feeding 2 tokens: a head and a chain of 5.
    assert replays == [3, 4, 4, 5, 3, 6]
    assert fed_chains == [[2, 1], [2]]   # steps 2 and 6 (all 3 drafts accepted): a head graph, then a chain


# --- prefill buckets: steps that mix a prompt chunk with decode/verify tokens -------------------
@pytest.fixture
def prefill_runners():
    return (*eager_and_cpu_graphed(96, prefill_lens=(2, 8, 16)), random.Random(5))


def test_prefill_bucket_shapes():
    g = object.__new__(GraphedForward)
    g.query_lens, g.prefill_lens = (1, 2, 4), (8, 16)
    assert g.shape(4, 2).tokens == 8 and g.shape(4, 2).logit_rows is None    # decode/verify: b x q
    assert (g.shape(1, 8).tokens, g.shape(1, 8).logit_rows) == (8, 4)        # one chunk alone
    assert (g.shape(4, 16).tokens, g.shape(4, 16).logit_rows) == (16 + 3 * 4, 16)
    assert g.shape(4, 16).fits(28, 16) and not g.shape(4, 16).fits(29, 1)
    assert not g.shape(4, 16).fits(20, 17)


def test_steps_with_prompt_chunks_replay_prefill_graphs(prefill_runners):
    eager, graphed, rng = prefill_runners
    assert graphed.graphs.prefill_lens == (8, 16)  # 2 is a decode/verify length already
    live = []
    for step in range(10):
        items = []
        # A new sequence joins with a chunk of 5..16 tokens (some steps: none), beside up to three
        # running ones feeding 1..4 tokens; logits of the chunk's last token or of none of it.
        if step % 3 != 2:
            new = 100 + step
            for r in (eager, graphed):
                r.add_sequence(new)
            n = rng.randint(5, 16)
            items.append(SeqInput(new, [rng.randrange(61) for _ in range(n)], rng.choice([0, 1])))
        for s in rng.sample(live, min(3, len(live))):
            n = rng.randint(1, 4)
            items.append(SeqInput(s, [rng.randrange(61) for _ in range(n)], rng.randint(0, n)))
        rng.shuffle(items)
        before = graphed.graphs.replays
        want, got = eager.step(items), graphed.step(items)
        assert [g.shape for g in got] == [w.shape for w in want]
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        assert graphed.graphs.replays == before + 1  # every step fitted a bucket
        live += [i.seq_id for i in items if i.seq_id not in live]
    for s in live:
        torch.testing.assert_close(seq_kv(graphed, s), seq_kv(eager, s), atol=1e-5, rtol=0)
    torch.testing.assert_close(graphed.kv.data, eager.kv.data, atol=1e-5, rtol=0)  # padding wrote nothing


def test_steps_beyond_the_prefill_buckets_run_eagerly(prefill_runners):
    eager, graphed, rng = prefill_runners
    for r in (eager, graphed):
        for s in range(3):
            r.add_sequence(s)
    cases = [[SeqInput(0, list(range(17)))],                                   # chunk over 16
             [SeqInput(1, list(range(16))), SeqInput(2, list(range(16)))]]      # 32 tokens > 16 + 4
    for items in cases:
        before, eager_before = graphed.graphs.replays, graphed.eager_forwards
        for w, g in zip(eager.step(items), graphed.step(items)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        assert graphed.graphs.replays == before and graphed.eager_forwards == eager_before + 1
    # Two chunks that fit together (12 + 4 <= 16 + 4 tokens, 2 sequences) do replay.
    for r in (eager, graphed):
        r.add_sequence(7)
        r.add_sequence(8)
    items = [SeqInput(7, list(range(12))), SeqInput(8, list(range(4)), 4)]
    before, eager_before = graphed.graphs.replays, graphed.eager_forwards
    for w, g in zip(eager.step(items), graphed.step(items)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert graphed.graphs.replays == before + 1 and graphed.eager_forwards == eager_before


@pytest.fixture
def prefill_chain_runners():
    return eager_and_cpu_graphed(96, prefill_lens=(8, 16), chains=True)


def _step_on(eager, graphed, items, bucket):
    """One step on both runners: the same logits, on `bucket` (None: eagerly)."""
    before = graphed.graphs.replays
    want = eager.step(items)
    staged = graphed.prepare(items)
    assert (staged.graph_key[:2] if staged.graph_key else None) == bucket
    got = graphed.forward(staged).split([i.num_logits for i in items])
    assert [g.shape for g in got] == [w.shape for w in want]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert graphed.graphs.replays == before + (bucket is not None)


def test_prefill_buckets_at_their_limits(prefill_chain_runners):
    """Logit rows decide the bucket as much as tokens do: more than qv rows for one sequence moves
    to a larger b (padding sequences), rows over every bucket run eagerly; chunks without logits,
    two chunks together, and plain decode steps beside them."""
    eager, graphed = prefill_chain_runners
    rng = random.Random(7)
    for r in (eager, graphed):
        for s in range(8):
            r.add_sequence(s)

    def ids(n):
        return [rng.randrange(61) for _ in range(n)]
    _step_on(eager, graphed, [SeqInput(0, ids(8), 8)], (2, 8))            # 8 rows > 1 x 4
    _step_on(eager, graphed, [SeqInput(1, ids(16), 16)], (4, 16))         # 16 rows: 3 padding seqs
    _step_on(eager, graphed, [SeqInput(2, ids(7), 3), SeqInput(3, ids(7), 0)], (4, 8))
    _step_on(eager, graphed, [SeqInput(0, ids(3), 3), SeqInput(1, ids(4), 4), SeqInput(2, ids(9), 0)],
             (4, 16))
    _step_on(eager, graphed, [SeqInput(4, ids(5), 0)], (1, 8))            # no logits at all
    _step_on(eager, graphed, [SeqInput(5, ids(16), 16), SeqInput(6, ids(1), 1)], None)  # 17 rows
    _step_on(eager, graphed, [SeqInput(s, ids(1)) for s in range(3)], (4, 1))
    for s in range(7):
        torch.testing.assert_close(seq_kv(graphed, s), seq_kv(eager, s), atol=1e-5, rtol=0)
    torch.testing.assert_close(graphed.kv.data, eager.kv.data, atol=1e-5, rtol=0)


def test_prefill_lens_leave_decode_and_verify_buckets_alone():
    def graphs(prefill):
        g = object.__new__(GraphedForward)
        g.query_lens, g.batch_sizes, g.max_blocks, g.prefill_lens = (1, 2, 4), (1, 2, 4, 8), 16, prefill
        return g
    old, new = graphs(()), graphs((8, 16, 64))
    for n in range(1, 10):
        for q in range(1, 5):
            assert new._bucket(n, q, 3) == old._bucket(n, q, 3)
            for tokens in range(n, n * q + 1):
                assert new._bucket(n, q, 3, tokens, tokens) == old._bucket(n, q, 3, tokens, tokens)


def test_static_batches_are_consistent_and_prefill_lens_stay_within_max_model_len():
    _, graphed = eager_and_cpu_graphed(96, prefill_lens=(2, 16, 64, 128), chains=True)
    g = graphed.graphs
    assert g.prefill_lens == (16, 64)   # 2 is a verify length, 128 > max_model_len 64
    for (b, q), graph in g.graphs.items():
        s = graph.batch
        starts = s.query_start_loc.tolist()
        lens = [e - a for a, e in zip(starts, starts[1:])]
        assert starts[0] == 0 and min(lens) >= 0 and starts[-1] == g.shape(b, q).tokens
        assert all(c >= n for c, n in zip(s.context_lens.tolist(), lens)) and max(lens) <= q
        assert max(s.context_lens.tolist()) <= g.max_context
        assert s.query_lens_host == [q] * b and int(s.logits_indices.max()) < starts[-1]


def test_a_prefill_batch_keeps_its_staged_logit_rows(prefill_chain_runners):
    _, graphed = prefill_chain_runners
    graphed.add_sequence(0)
    staged = graphed.prepare([SeqInput(0, list(range(10)), 1)])
    assert staged.graph_key[:2] == (1, 16)
    with pytest.raises(ValueError, match="logits_indices"):
        graphed.forward(dataclasses.replace(staged, logits_indices=staged.logits_indices.clone()))


def test_draft_engine_drafts_the_same_on_prefill_buckets(tmp_path):
    """Prompts, and a prompt joining running sequences, replay prefill graphs in the draft engine
    (beside its chains) and draft what the eager engine drafts."""
    from specdec.config import EngineConfig
    from specdec.engine import DraftEngine
    from specdec.engine.types import DraftSeqInput
    from tests.helpers.tiny_models import make_pair
    _, draft_path = make_pair(tmp_path)
    config = EngineConfig(model=draft_path, num_blocks=64, block_size=4, warmup_batch_sizes=(1,),
                          max_num_draft=8)
    plain, graphed = DraftEngine(config), DraftEngine(config)
    for e in (plain, graphed):
        e.runner.backend = TritonAttention()
    graphed.runner.graphs = CpuGraphs(graphed.runner, max_model_len=128, query_lens=(1, 2),
                                      batch_sizes=(1, 2, 4), chains=True, prefill_lens=(8, 16))
    steps = [
        [DraftSeqInput(1, 0, [3, 4, 5], 4, first=True), DraftSeqInput(2, 0, [7, 1], 4, first=True)],
        [DraftSeqInput(1, 4, [9], 4), DraftSeqInput(3, 0, list(range(3, 15)), 3, first=True),
         DraftSeqInput(2, 1, [8], 4)],
        [DraftSeqInput(1, 2, [6], 5), DraftSeqInput(2, 4, [2], 3), DraftSeqInput(3, 3, [5, 6], 2)],
    ]
    for step in steps:
        before = graphed.runner.graphs.replays
        a, b = plain.propose(step), graphed.propose(step)
        assert [o.tokens for o in b.outputs] == [o.tokens for o in a.outputs]
        assert graphed.runner.graphs.replays > before


def test_every_graph_writes_one_shared_logits_buffer(prefill_runners):
    """All graphs' static logits are views of one buffer (as large as the largest bucket's rows),
    so a step's logits must be, and are, copied out before the next replay."""
    eager, graphed, rng = prefill_runners
    g = graphed.graphs
    storages = {graph.logits.untyped_storage().data_ptr() for graph in g.graphs.values()}
    assert storages == {g._logits.untyped_storage().data_ptr()}
    assert g._logits.shape[0] == max(g._rows(b, q) for b, q in g.graphs)
    for r in (eager, graphed):
        for s in range(3):
            r.add_sequence(s)
    first = [SeqInput(0, list(range(12)), 1), SeqInput(1, [3, 4], 2)]          # prefill bucket
    second = [SeqInput(2, [5]), SeqInput(1, [6])]                               # decode bucket
    got_first, want_first = graphed.step(first), eager.step(first)
    graphed.step(second)
    eager.step(second)
    for w, got in zip(want_first, got_first):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=0)
