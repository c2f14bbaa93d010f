"""Graph replays give the eager forward's logits, for decode and verify buckets with padding."""
import pytest
import torch

from specdec.config import CacheConfig
from specdec.models.loader import load_model
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.tiny_models import make_checkpoint

pytestmark = pytest.mark.gpu


def test_graph_replay_matches_eager(tmp_path):
    path = make_checkpoint(tmp_path, with_tokenizer=False, heads=4, kv_heads=2, hidden=128)
    runners = []
    for graphs in (False, True):
        model, cfg = load_model(path, device="cuda")
        runner = ModelRunner(model, CacheConfig(num_blocks=64, block_size=16))
        if graphs:
            runner.enable_cuda_graphs(max_model_len=256, query_lens=(1, 4), batch_sizes=(1, 2, 4, 8))
        runners.append(runner)
    gen = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
               for s, n in [(0, 17), (1, 5), (2, 40)]}
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
