"""Graph replays give the eager forward's logits, for decode and verify buckets with padding."""
import dataclasses

import pytest
import torch

from specdec.runner import SeqInput
from tests.helpers.graph_runners import eager_and_graphed

pytestmark = pytest.mark.gpu


def eager_prefill_then(runners, prompts, steps) -> None:
    """On each runner: the prompts as one eager prefill, then steps(runner)'s list of logits; the
    graphed runner's logits equal the eager one's, and so does every K/V (padding rows wrote
    nothing: slot -1)."""
    outs = []
    for runner in runners:
        for s in prompts:
            runner.add_sequence(s)
        outs.append(runner.step([SeqInput(s, ids, 1) for s, ids in prompts.items()]) + steps(runner))
    assert runners[1].graphs is not None
    for eager, graphed in zip(*outs):
        assert torch.isfinite(graphed).all()
        torch.testing.assert_close(graphed, eager, atol=2e-4, rtol=0)
    torch.testing.assert_close(runners[1].kv.data, runners[0].kv.data, atol=2e-4, rtol=0)


def test_graph_replay_matches_eager(tmp_path):
    runners, prompts = eager_and_graphed(tmp_path, query_lens=(1, 4), batch_sizes=(1, 2, 4, 8))

    def steps(runner):
        got = []
        for step in range(3):
            got += runner.step([SeqInput(s, [step + 1]) for s in prompts])              # decode, bucket 4
            got += runner.step([SeqInput(s, [7, 8, 9, step], 4) for s in prompts])     # verify q=4
            got += runner.step([SeqInput(1, [3])])                                      # bucket 1
        return got
    eager_prefill_then(runners, prompts, steps)


def test_prefill_graphs_match_eager_for_prompts_beside_verifies(tmp_path):
    """Prefill buckets on real graphs: prompts alone (sequence 2's 40 tokens: bucket (1, 64)), and
    a joining prompt chunk beside verify and decode sequences, give the eager logits (only the
    rows asked for) and the same KV; a step beyond every bucket still runs eagerly."""
    runners, prompts = eager_and_graphed(tmp_path, query_lens=(1, 4), batch_sizes=(1, 2, 4),
                                         prefill_lens=(16, 64))
    outs, replays = [], []
    for runner in runners:
        got = []
        for s in (0, 1, 2, 3):
            runner.add_sequence(s)
        got += runner.step([SeqInput(2, prompts[2], 1)])                                 # (1, 64)
        got += runner.step([SeqInput(0, prompts[0][:16], 0), SeqInput(2, [7, 8, 9, 1], 4)])  # (2, 16)
        got += runner.step([SeqInput(1, prompts[1], 1), SeqInput(0, prompts[0][16:], 1),
                            SeqInput(2, [4])])                                               # (4, 16)
        got += runner.step([SeqInput(3, list(range(70)), 1)])                             # eager
        for step in range(2):
            got += runner.step([SeqInput(s, [step + 3, 5, 6, 7], 4) for s in (0, 1, 2, 3)])
        outs.append(got)
        replays.append(runner.graphs.replays if runner.graphs else 0)
    assert replays[1] == 5
    for eager, graphed in zip(*outs):
        assert torch.isfinite(graphed).all() and graphed.shape == eager.shape
        torch.testing.assert_close(graphed, eager, atol=2e-4, rtol=0)
    torch.testing.assert_close(runners[1].kv.data, runners[0].kv.data, atol=2e-4, rtol=0)


def test_prepare_stages_into_the_graph_and_catches_an_overwritten_batch(tmp_path):
    """prepare() writes a graph-sized step straight into that graph's static inputs (one copy);
    device-side input ids (the draft loop's) replace the staged ones; a batch whose inputs a
    later prepare() overwrote is refused instead of replaying someone else's step."""
    runners, prompts = eager_and_graphed(tmp_path, query_lens=(1,), batch_sizes=(2, 4))
    eager, graphed = runners
    for runner in runners:
        for s, ids in prompts.items():
            runner.add_sequence(s)
        runner.step([SeqInput(s, ids, 1) for s, ids in prompts.items()])
    staged = graphed.prepare([SeqInput(0, [5]), SeqInput(1, [6])])
    key = staged.graph_key
    assert key is not None and key[:2] == (2, 1)
    static = graphed.graphs.graphs[(2, 1)].batch
    assert staged.slot_mapping.data_ptr() == static.slot_mapping.data_ptr()
    fed = torch.tensor([9, 10], device="cuda")                           # ids produced on the device
    got = graphed.forward(dataclasses.replace(staged, input_ids=fed))
    want = eager.forward(eager.prepare([SeqInput(0, [9]), SeqInput(1, [10])]))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    first = graphed.prepare([SeqInput(0, [1]), SeqInput(1, [2])])
    second = graphed.prepare([SeqInput(2, [3]), SeqInput(1, [4])])
    with pytest.raises(RuntimeError, match="overwritten"):
        graphed.forward(first)
    assert torch.isfinite(graphed.forward(second)).all()


def test_greedy_chain_replays_equal_greedy_steps(tmp_path):
    """The draft's chain graphs on the GPU: k greedy single-token steps as k replays (argmax fed
    back, positions, lengths and slots advanced on the device, across block boundaries of 16)
    give the tokens of k eager greedy steps, and the same KV per sequence."""
    from tests.unit.test_graph_staging import seq_kv
    runners, prompts = eager_and_graphed(tmp_path, query_lens=(1, 2), batch_sizes=(1, 2, 4), chains=True)
    eager, graphed = runners
    for runner in runners:
        for s, ids in prompts.items():
            runner.add_sequence(s)
        runner.step([SeqInput(s, ids, 1) for s, ids in prompts.items()])
    assert set(graphed.graphs.chains) == {1, 2, 4}
    for seqs, steps in (((0, 1, 2), 7), ((1,), 1), ((2, 0), 12)):
        first = [3 + s for s in seqs]
        want, fed = [], first
        for _ in range(steps):
            logits = eager.step([SeqInput(s, [t]) for s, t in zip(seqs, fed)])
            fed = [int(x.argmax(-1)) for x in logits]
            want.append(fed)
        # First ids on the device (a chain after the draft's first forward) or from the host.
        ids = first if len(seqs) == 1 else torch.tensor(first, device="cuda")
        got = graphed.greedy_chain(list(seqs), ids, steps)
        assert got.tolist() == want
        for s in seqs:
            assert graphed.num_tokens(s) == eager.num_tokens(s)
            torch.testing.assert_close(seq_kv(graphed, s), seq_kv(eager, s), atol=2e-4, rtol=0)


def test_fed_chain_head_graphs_equal_greedy_steps(tmp_path):
    """The head graphs on the GPU: feeds of 1 or 2 tokens on bucket (b, 2), each sequence's
    argmax and the chain's inputs set up inside the graph, then the chain: the tokens of eager
    greedy steps and the same KV, with padding sequences (3 in bucket 4) and a bucket (4, 1) that
    held fewer sequences before."""
    from tests.unit.test_graph_staging import seq_kv
    runners, prompts = eager_and_graphed(tmp_path, query_lens=(1, 2), batch_sizes=(1, 2, 4), chains=True)
    eager, graphed = runners
    prompts[3] = prompts[1][:3]
    for runner in runners:
        for s, ids in prompts.items():
            runner.add_sequence(s)
        runner.step([SeqInput(s, ids, 1) for s, ids in prompts.items()])
    assert set(graphed.graphs.heads) == {1, 2, 4}
    seqs = sorted(prompts)
    for feeds, steps in (([2, 1, 2], 5), ([2], 1), ([1, 2], 11), ([2, 2, 1, 2], 4)):
        ordinary = [SeqInput(s, [5 + s]) for s in seqs[:3]]
        for want, got in zip(eager.step(ordinary), graphed.step(ordinary)):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        items = [SeqInput(s, [7 + s, 9][:n]) for s, n in zip(seqs, feeds)]
        fed = [int(x.argmax(-1)) for x in eager.step(items)]
        want = [fed]
        for _ in range(steps - 1):
            fed = [int(x.argmax(-1)) for x in eager.step([SeqInput(i.seq_id, [t]) for i, t in zip(items, fed)])]
            want.append(fed)
        assert graphed.fed_chain(items, steps).tolist() == want
        for i in items:
            assert graphed.num_tokens(i.seq_id) == eager.num_tokens(i.seq_id)
            torch.testing.assert_close(seq_kv(graphed, i.seq_id), seq_kv(eager, i.seq_id), atol=2e-4, rtol=0)


def test_short_context_graph_set_matches_eager_and_plans_fewer_splits(tmp_path):
    """GraphSets on real graphs: a set planned for 64-token contexts beside the 256 one. Steps whose
    tables fit 64 tokens replay there, longer ones on the full set, chains pick the set of their
    last position, and every logit and the KV equal the eager runner's. On this GPU the short
    set's attention is planned with fewer KV splits for one sequence (the reason it exists)."""
    from specdec.kernels.triton_attention import launch_plan
    runners, prompts = eager_and_graphed(tmp_path, query_lens=(1, 4), batch_sizes=(1, 2, 4), chains=True,
                                         context_lens=(64,))
    eager, graphed = runners
    short, full = graphed.graphs.sets
    assert (short.max_context, full.max_context) == (64, 256)
    cfg = graphed.config
    plans = [launch_plan(1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1, c, "cuda") for c in (64, 256)]
    assert plans[0]["num_splits"] < plans[1]["num_splits"]

    def steps(runner):
        got = []
        for step in range(8):   # sequence 2 (40 tokens) crosses 64 after a few verifies
            got += runner.step([SeqInput(s, [step + 1, 5, 6, 7], 4) for s in (0, 1, 2)])
            got += runner.step([SeqInput(1, [step + 2])])
        return got
    eager_prefill_then(runners, prompts, steps)
    assert short.replays and full.replays
    first = torch.tensor([3], device="cuda")
    # Sequence 1 holds 5 + 8 x 5 = 45 tokens: a chain of 4 ends at 49 (the 64 set), one of 16 then at 65.
    for n, on in ((4, 0), (16, 1)):
        before = [s.replays for s in graphed.graphs.sets]
        fed, want = [3], []
        for _ in range(n):
            fed = [int(eager.step([SeqInput(1, fed)])[0].argmax(-1))]
            want.append(fed)
        assert graphed.greedy_chain([1], first, n).tolist() == want
        ran = [s.replays - b for s, b in zip(graphed.graphs.sets, before)]
        assert ran == [n if i == on else 0 for i in range(2)], (n, ran)
