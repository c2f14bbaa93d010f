"""CUDA graphs of short-query forwards (decode: 1 token per sequence, verify: k+1), bucketed by batch
size and longest query. On the device hosts the Python and launch overhead of an eager step is
larger than the step itself; a replay costs one launch.

A graph is captured on static input buffers. A batch of n sequences whose query lengths are at most
q replays the bucket (b >= n, q) with the smallest q, then the smallest b. The batch need not be
uniform: the attention kernel reads each sequence's query span from query_start_loc on the device,
so a ragged batch (a draft feeding 1 or 2 tokens per sequence, verifies of mixed k) is packed into
the bucket's first tokens and its padding sequences get empty spans. Padding tokens write no KV
(slot -1, which the store kernel skips) and their rows are dropped. The attention grid is sized at
capture from the bucket and a context bound of max_model_len, so nothing about a replay depends on
host values.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from specdec.runner import ForwardBatch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch       # the static input buffers
    logits: torch.Tensor      # [bucket * q, V] static output


class GraphedForward:
    def __init__(self, runner, max_model_len: int, query_lens: tuple[int, ...] = (1,),
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES):
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        # Hold the runner's parts, not the runner: runner -> graphs -> runner would be a reference
        # cycle, freed by the garbage collector at an arbitrary time, and a CUDA graph freed while
        # another capture is in progress invalidates that capture (seen on the H200).
        self._model, self._kv, self._backend = runner.model, runner.kv, runner.backend
        self.device = runner.device
        gc.collect()  # free graphs of runners already dropped before we start capturing
        self.max_blocks = -(-max_model_len // runner.cache_config.block_size)
        self.max_context = self.max_blocks * runner.cache_config.block_size
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.query_lens = tuple(sorted(set(query_lens)))
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0  # forwards served by a graph (tests and logs check the GPU path uses them)
        pool = torch.cuda.graph_pool_handle()
        # Largest first: later, smaller captures reuse the pool's memory.
        for q in reversed(self.query_lens):
            for b in reversed(self.batch_sizes):
                self.graphs[(b, q)] = self._capture(b, q, pool)

    def _static_batch(self, b: int, q: int) -> ForwardBatch:
        dev, t = self.device, b * q
        return ForwardBatch(
            input_ids=torch.zeros(t, dtype=torch.int64, device=dev),
            positions=torch.zeros(t, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.arange(0, t + 1, q, dtype=torch.int32, device=dev),
            context_lens=torch.full((b,), q, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev),
            logits_indices=torch.arange(t, dtype=torch.int64, device=dev),
            query_lens_host=[q] * b, context_lens_host=[self.max_context] * b)

    @torch.inference_mode()
    def _capture(self, b: int, q: int, pool) -> _Graph:
        batch = self._static_batch(b, q)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                self._model(batch, self._kv, self._backend)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._model(batch, self._kv, self._backend)
        return _Graph(graph, batch, logits)

    def bucket(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The graph that can run this batch, or None (eager): every query within a captured length,
        no more sequences than the largest bucket, a context within max_model_len."""
        q_max = max(batch.query_lens_host)
        n = len(batch.query_lens_host)
        if batch.block_tables.shape[1] > self.max_blocks:
            return None
        for q in self.query_lens:
            if q < q_max:
                continue
            for b in self.batch_sizes:
                if b >= n:
                    return (b, q)
        return None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        key = self.bucket(batch)
        if key is None:
            return None
        g = self.graphs[key]
        s = g.batch
        n, t = len(batch.query_lens_host), batch.input_ids.numel()
        self.replays += 1
        s.input_ids[:t].copy_(batch.input_ids, non_blocking=True)
        s.positions[:t].copy_(batch.positions, non_blocking=True)
        s.slot_mapping[:t].copy_(batch.slot_mapping, non_blocking=True)
        s.slot_mapping[t:].fill_(-1)
        s.query_start_loc[:n + 1].copy_(batch.query_start_loc, non_blocking=True)
        s.query_start_loc[n + 1:].fill_(t)  # padding sequences: empty query spans
        s.context_lens[:n].copy_(batch.context_lens, non_blocking=True)
        s.context_lens[n:].fill_(key[1])
        width = batch.block_tables.shape[1]
        s.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        g.graph.replay()
        if batch.logits_indices.numel() == t:  # logits of every token (rows are sorted and unique)
            return g.logits[:t]
        return g.logits.index_select(0, batch.logits_indices)
