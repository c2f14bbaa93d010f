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
from specdec.cuda_graphs import GraphedForward, _Graph
from specdec.kernels.triton_attention import TritonAttention
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.op_sets import tiny_config
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)


class _ModelReplay:
    """graph.replay(): the model over the static batch, into the static logits."""

    def __init__(self, graphs: "CpuGraphs", batch, logits):
        self.graphs, self.batch, self.logits = graphs, batch, logits

    def replay(self):
        g = self.graphs
        self.logits.copy_(g._model(self.batch, g._kv, g._backend))


class CpuGraphs(GraphedForward):
    _check_device = staticmethod(lambda device: None)
    _new_pool = staticmethod(lambda: None)

    def _capture(self, b, q, pool):
        with torch.inference_mode():
            batch, packed = self._static_batch(b, q)
            logits = torch.zeros(b * q, self._model.config.vocab_size)
        return _Graph(_ModelReplay(self, batch, logits), batch, packed, logits)


@pytest.fixture
def runners():
    model = init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1)

    def runner():
        return ModelRunner(model, CacheConfig(num_blocks=64, block_size=4, dtype=torch.float32),
                           backend=TritonAttention())
    eager, graphed = runner(), runner()
    graphed.graphs = CpuGraphs(graphed, max_model_len=64, query_lens=(1, 2, 4), batch_sizes=(1, 2, 4))
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
