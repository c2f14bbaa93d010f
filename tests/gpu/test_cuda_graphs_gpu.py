"""Graph replays give the eager forward's logits, for decode and verify buckets with padding."""
import pytest
import torch

from specdec.runner import SeqInput
from tests.helpers.graph_runners import eager_and_graphed

pytestmark = pytest.mark.gpu


def test_graph_replay_matches_eager(tmp_path):
    runners, prompts = eager_and_graphed(tmp_path, query_lens=(1, 4), batch_sizes=(1, 2, 4, 8))
    outs = []
    for runner in runners:
        got = []
        for s, ids in prompts.items():
            runner.add_sequence(s)
        got += runner.step([SeqInput(s, ids, 1) for s, ids in prompts.items()])          # eager prefill
        for step in range(3):
            got += runner.step([SeqInput(s, [step + 1]) for s in prompts])              # decode, bucket 4
            got += runner.step([SeqInput(s, [7, 8, 9, step], 4) for s in prompts])     # verify q=4
            got += runner.step([SeqInput(1, [3])])                                      # bucket 1
        outs.append(got)
    assert runners[1].graphs is not None
    for eager, graphed in zip(*outs):
        assert torch.isfinite(graphed).all()
        torch.testing.assert_close(graphed, eager, atol=2e-4, rtol=0)
    # padding rows wrote nothing (slot -1): both caches hold exactly the same K/V everywhere
    torch.testing.assert_close(runners[1].kv.data, runners[0].kv.data, atol=2e-4, rtol=0)
