"""CPU stand-ins for CUDA graphs: a "graph" whose replay runs the captured function again on the
same static buffers, which is exactly what a captured graph reads. Staging, chains and the
samplers are then checked against eager steps without a GPU; the GPU tests add the real capture."""
from __future__ import annotations

import torch

from specdec.cuda_graphs import GraphedForward, _Chain, _Graph
from specdec.sampling.graphs import GraphedSampler


class _ModelReplay:
    """graph.replay(): the model over the static batch, into the static logits."""

    def __init__(self, graphs: "CpuGraphs", batch, logits):
        self.graphs, self.batch, self.logits = graphs, batch, logits

    def replay(self):
        g = self.graphs
        self.logits.copy_(g._model(self.batch, g._kv, g._backend))


class _ChainReplay:
    """A chain graph's replay(): its step on the bucket's static inputs."""

    def __init__(self, graphs: "CpuGraphs", g, tokens, at, pick=None):
        self.step = lambda: graphs._chain_step(g, tokens, at, pick)

    def replay(self):
        self.step()


class CpuGraphs(GraphedForward):
    _check_device = staticmethod(lambda device: None)
    _new_pool = staticmethod(lambda: None)

    def _capture(self, b, q, pool):
        with torch.inference_mode():
            batch, packed = self._static_batch(b, q)
            logits = self._logits_out(b, q)   # the real capture's output: a view of the shared buffer
        return _Graph(_ModelReplay(self, batch, logits), batch, packed, logits)

    def _capture_chain(self, b, pool, pick=None, tokens=None):
        with torch.inference_mode():
            own, at = self._chain_buffers(b)
        tokens = own if tokens is None else tokens
        return _Chain(_ChainReplay(self, self.graphs[(b, 1)], tokens, at, pick), tokens, at)

    def _capture_head(self, b, pool):
        g2, g1, c = self.graphs[(b, 2)], self.graphs[(b, 1)], self.chains[b]
        return _Replay(lambda: self._head_step(g2, g1, c))


class _Replay:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def warm_record(fn, pool, reset=None):
    """What GraphCaptures._record executes, on the CPU: fn() twice (the warm-up on the side stream,
    reset() after each run), then a "graph" whose replay re-runs fn on the same buffers (the
    capture itself runs nothing). For stand-ins that go through GraphedForward's own captures."""
    for _ in range(2):
        fn()
        if reset is not None:
            reset()
    return _Replay(fn), None


class CpuCaptures:
    """Graphs whose 'replay' calls the captured function again on the same buffers."""
    _check_device = staticmethod(lambda device: None)
    _new_pool = staticmethod(lambda: None)

    @staticmethod
    def _record(fn, pool, reset=None):
        fn()  # as the real capture's warm-up does
        if reset is not None:
            reset()
        return _Replay(fn), None


class CpuSampler(CpuCaptures, GraphedSampler):
    pass


