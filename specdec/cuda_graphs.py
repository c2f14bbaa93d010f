"""CUDA graphs of short-query forwards (decode: 1 token per sequence, verify: k+1), bucketed by batch
size and longest query. On the device hosts the Python and launch overhead of an eager step is
larger than the step itself; a replay costs one launch.

A graph is captured on static input buffers (views of one PackedBuffer); ModelRunner.prepare()
writes a step that fits a graph straight into them (`stage`, one host-to-device copy), and only
such staged batches replay. A batch of n sequences whose query lengths are at most
q replays the bucket (b >= n, q) with the smallest q, then the smallest b. The batch need not be
uniform: the attention kernel reads each sequence's query span from query_start_loc on the device,
so a ragged batch (a draft feeding 1 or 2 tokens per sequence, verifies of mixed k) is packed into
the bucket's first tokens and its padding sequences get empty spans. Padding tokens write no KV
(slot -1, which the store kernel skips) and their rows are dropped. The attention grid is sized at
capture from the bucket and a context bound of max_model_len, so nothing about a replay depends on
host values.

Prefill buckets (steps with a prompt chunk): a step whose longest query exceeds every decode/verify
length would run eagerly, and an eager Llama-7B forward costs ~30 ms of host time (hundreds of
Python-side kernel launches) against ~4 ms on the device; with continuous batching every request
that joins makes one such step for the whole batch. So for each prefill length p (a query bound)
and batch size b there is a bucket of p + (b - 1) x qv token rows (qv: the longest decode/verify
query): one prompt chunk of up to p tokens beside b - 1 decode or verify sequences, or any other
batch within those bounds. Its graph returns logits only for the rows a step asks for (at most
b x qv, gathered inside the graph from a static index segment), not for every prompt token.

Chains (the draft's greedy steps): for bucket (b, 1) a second graph runs one single-token forward,
takes the argmax of every row and moves the static inputs on to the next position (ids = the
argmax, positions and context lengths + 1, slots looked up in the staged block tables). A draft
step of k greedy tokens then costs one staged copy and k - 1 replays after its first forward,
with no host work between them; the KV slots of all k - 1 positions are reserved before the copy
(ModelRunner.greedy_chain). A step whose first forward feeds 2 tokens for some sequences (the last
draft and the bonus token after all drafts were accepted) starts on a head graph instead: bucket
(b, 2)'s forward, each sequence's argmax into the chain's first row, and bucket (b, 1)'s static
inputs set up on the device from (b, 2)'s, so the chain goes on from there (ModelRunner.fed_chain:
one staged copy and one head launch where a staged forward, its logits, an argmax and a second
staged copy were). Sampled chains (capture_sampled_chains, opt-in) are the same graphs
with the draft's sampler in place of the argmax: each step draws its tokens with the sampler's
staged parameters and that position's staged uniforms, writing the sampler's output rows
(sampling/graphs.GraphedSampler.chain_pick).

Context bounds (GraphSets, --graph-context-lens): the attention's KV split count is planned at
capture from the context bound, so graphs for max_model_len split a short context as if it were
that long. GraphSets keeps the decode/verify buckets once more for each shorter bound and stages a
step on the shortest set whose block tables hold it.
"""
from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdec.runner import ForwardBatch
from specdec.staging import PackedBuffer, Rows, inference

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CHAIN_MAX = 16  # most steps one chain runs (a draft step's k - 1)
# A chain step's bookkeeping as one Triton kernel on the GPU (kernels/chain.py) instead of ~15 torch
# kernels; SPECDEC_CHAIN_KERNEL=0 takes the torch ops. On by default since session 36 (H200, 7B + 68m,
# e2e A/B in both orders: speculative tok/s +1-9% at b 8, +1-3% at b 1). Read at capture: graphs
# keep what they captured.
CHAIN_KERNEL = os.environ.get("SPECDEC_CHAIN_KERNEL", "1") != "0"
# Stamps of what a graph's static inputs hold, unique across every GraphedForward of the process: a
# staged batch replays only while its graph still holds it (and only on the graphs that staged it).
_STAMPS = itertools.count(1)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch       # the static input buffers (views of `packed`)
    packed: PackedBuffer      # ... refilled by one host-to-device copy per staged step
    logits: torch.Tensor      # [rows, V] static output (Shape.logit_rows rows, else one per token):
                              # a view of the one buffer every graph writes (GraphedForward._logits)
    stamp: int = 0            # what the static inputs hold now (a staged batch carries its stamp)


@dataclass(frozen=True)
class Shape:
    """What bucket (b, q) holds: `tokens` rows; logits of every row (logit_rows None: decode and
    verify buckets) or of at most logit_rows requested rows (prefill buckets)."""
    tokens: int
    logit_rows: int | None = None

    def fits(self, num_tokens: int, num_logits: int) -> bool:
        return num_tokens <= self.tokens and (self.logit_rows is None or num_logits <= self.logit_rows)


@dataclass
class _Chain:
    graph: torch.cuda.CUDAGraph  # a step on bucket (b, 1)'s static inputs, then the next's inputs
    tokens: torch.Tensor         # [rows, b] int64: row `at` is the token the replay picked
    at: torch.Tensor             # [1] int64: the row the next replay writes


class StagedKey(NamedTuple):
    """What stage(..., key_only=True) returns in place of a ForwardBatch, for the chains
    (chain, head_chain), which read nothing else of a staged batch: its bucket (b, q), the stamp
    of what the bucket's static inputs held once staged, and the number of sequences. Refused, as
    a staged batch is, once a later stage overwrote the static inputs."""
    b: int
    q: int
    stamp: int
    n: int


class GraphCaptures:
    """Where graphs come from (GraphedForward, and the samplers of sampling/graphs.py): CPU tests
    replace these with a stand-in that re-runs the captured function on the same static buffers."""

    @staticmethod
    def _check_device(device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")

    @staticmethod
    def _new_pool():
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def _record(fn, pool, reset=None) -> tuple[torch.cuda.CUDAGraph, object]:
        """fn() run twice on a side stream (Triton kernels compile and allocations settle outside
        the capture), then captured into a graph on `pool`: (the graph, what the captured call
        returned). reset(), if given, runs after each warm-up run: for a function that advances
        state of its own (a chain's row counter) and must not run past its buffers."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
                if reset is not None:
                    reset()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out


class GraphedForward(GraphCaptures):
    def __init__(self, runner, max_model_len: int, query_lens: tuple[int, ...] = (1,),
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, chains: bool = False,
                 prefill_lens: tuple[int, ...] = (), share: GraphedForward | None = None):
        """share: another set of the same runner (GraphSets) whose memory pool and logits buffer
        this one uses too (their graphs never replay at the same time)."""
        self._check_device(runner.device)
        # Hold the runner's parts, not the runner: runner -> graphs -> runner would be a reference
        # cycle, freed by the garbage collector at an arbitrary time, and a CUDA graph freed while
        # another capture is in progress invalidates that capture (seen on the H200).
        self._model, self._kv, self._backend = runner.model, runner.kv, runner.backend
        self.device = runner.device
        gc.collect()  # free graphs of runners already dropped before we start capturing
        self.block_size = runner.cache_config.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_context = self.max_blocks * self.block_size
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.query_lens = tuple(sorted(set(query_lens)))
        # Prefill buckets only above the decode/verify lengths (a shorter bound is one of those) and
        # within max_model_len (a longer chunk cannot happen; its capture would read past the table).
        self.prefill_lens = tuple(sorted({p for p in prefill_lens
                                          if self.query_lens[-1] < p <= self.max_context}))
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0  # forwards served by a graph (tests and logs check the GPU path uses them)
        # One fp32 logits buffer for all graphs, outside their pool: graphs replay one at a time and
        # _outputs copies a replay's rows out before the next, so a buffer per graph (~0.8 GB for a
        # 7B target with 32k ids and the default buckets; 4x that with 128k) would only hold stale rows.
        rows = max((self._rows(b, q) for q in self.query_lens + self.prefill_lens for b in self.batch_sizes),
                   default=0)
        if share is None:
            self._logits = torch.empty(rows, runner.model.config.vocab_size, dtype=torch.float32,
                                       device=self.device)
            pool = self._new_pool()
        else:
            if share._logits.shape[0] < rows:
                raise ValueError(f"the shared logits buffer has {share._logits.shape[0]} rows, "
                                 f"this set needs {rows}")
            self._logits, pool = share._logits, share._pool
        self._pool = pool
        # Longest queries and largest batches first: later, smaller captures mostly reuse the pool's
        # memory (not strictly by rows: (32, 256) has more than (1, 512); that costs pool memory only).
        for q in reversed(self.query_lens + self.prefill_lens):
            for b in reversed(self.batch_sizes):
                self.graphs[(b, q)] = self._capture(b, q, pool)
        self.chains: dict[int, _Chain] = {}
        self.sampled_chains: dict[int, _Chain] = {}
        self.heads: dict[int, torch.cuda.CUDAGraph] = {}   # bucket b -> its head graph (fed_chain)
        if chains and 1 in self.query_lens:
            for b in reversed(self.batch_sizes):
                self.chains[b] = self._capture_chain(b, pool)
            if 2 in self.query_lens:
                for b in reversed(self.batch_sizes):
                    self.heads[b] = self._capture_head(b, pool)

    @property
    def context_bounds(self) -> tuple[int, ...]:
        return (self.max_context,)

    @property
    def num_graphs(self) -> int:
        return len(self.graphs) + len(self.chains) + len(self.sampled_chains) + len(self.heads)

    def shape(self, b: int, q: int) -> Shape:
        """Bucket (b, q)'s rows: b x q for a decode/verify length q; for a prefill length q, one
        q-token chunk plus b - 1 sequences of up to qv tokens, and logits of up to b x qv rows."""
        if q in self.query_lens:
            return Shape(b * q)
        qv = self.query_lens[-1]
        return Shape(q + (b - 1) * qv, b * qv)

    def _rows(self, b: int, q: int) -> int:
        """Logit rows bucket (b, q)'s graph writes."""
        shape = self.shape(b, q)
        return shape.logit_rows or shape.tokens

    def _logits_out(self, b: int, q: int) -> torch.Tensor:
        return self._logits[:self._rows(b, q)]

    def _layout(self, b: int, q: int) -> list[tuple[int, torch.dtype]]:
        """The static inputs of bucket (b, q) in one packed buffer: input ids, positions, slots,
        query_start_loc, context_lens, block tables (row-major); then the rows whose logits a
        staged step returns (a prefill bucket's graph gathers them; a decode/verify bucket's
        graph computes every row and _outputs selects them after the replay)."""
        t, i64, i32 = self.shape(b, q).tokens, torch.int64, torch.int32
        return [(t, i64), (t, i64), (t, i64), (b + 1, i32), (b, i32), (b * self.max_blocks, i32),
                (self._rows(b, q), i64)]

    def _fill(self, packed: PackedBuffer, b: int, q: int, ids, positions, slots, starts, ctx_lens,
              tables, logit_rows) -> list[torch.Tensor]:
        """Pads one step's host arrays to bucket (b, q) and writes them in one copy. Padding tokens
        get slot -1 (no KV write), padding sequences empty query spans, padding logit rows row 0."""
        return packed.fill([ids, positions, slots, starts, ctx_lens, Rows(tables, self.max_blocks), logit_rows],
                           pads=(0, 0, -1, len(ids), q, 0, 0))

    def _static_batch(self, b: int, q: int) -> tuple[ForwardBatch, PackedBuffer]:
        packed = PackedBuffer(self._layout(b, q), self.device)
        shape = self.shape(b, q)
        t = shape.tokens
        # Capture-time contents: sequence 0 has q tokens, the others t - q split evenly (all
        # padding: slot -1). Only the grid's host bounds (b sequences, query bound q, context
        # bound max_context) are baked into the graph.
        lens = [q] + [(t - q) // (b - 1)] * (b - 1) if b > 1 else [q]
        starts = [sum(lens[:i]) for i in range(b + 1)]
        rows = list(range(self._rows(b, q)))
        v = self._fill(packed, b, q, [0] * t, [0] * t, [-1] * t, starts, lens,
                       [[0] * self.max_blocks] * b, rows)
        if shape.logit_rows is None:
            # The graph computes logits for every row; the packed rows segment (v[6]) only tells
            # _outputs which of them a staged step asked for, so the graph must not read it.
            logits_indices = torch.arange(t, dtype=torch.int64, device=self.device)
        else:
            logits_indices = v[6]  # read by the graph: logits of the staged rows only
        batch = ForwardBatch(input_ids=v[0], positions=v[1], slot_mapping=v[2], query_start_loc=v[3],
                             context_lens=v[4], block_tables=v[5].view(b, self.max_blocks),
                             logits_indices=logits_indices,
                             query_lens_host=[q] * b, context_lens_host=[self.max_context] * b)
        return batch, packed

    def stage(self, ids, positions, slots, starts, ctx_lens, tables, logit_rows,
              query_lens: list[int], width: int, key_only: bool = False) -> ForwardBatch | StagedKey | None:
        """A step's host arrays (runner.prepare's; width = its longest block table) written
        straight into the static inputs of the graph that will run it, in one copy; None when no
        graph fits (the step runs eagerly). key_only: a StagedKey instead of the batch (the
        chains need no more; building the batch's views is most of a stage's own host time)."""
        n = len(query_lens)
        key = self._bucket(n, max(query_lens), width, len(ids), len(logit_rows))
        if key is None:
            return None
        b, q = key
        g = self.graphs[key]
        v = self._fill(g.packed, b, q, ids, positions, slots, starts, ctx_lens, tables, logit_rows)
        g.stamp = next(_STAMPS)
        if key_only:
            return StagedKey(b, q, g.stamp, n)
        t = len(ids)
        return ForwardBatch(input_ids=v[0][:t], positions=v[1][:t], slot_mapping=v[2][:t],
                            query_start_loc=v[3][:n + 1], context_lens=v[4][:n],
                            block_tables=v[5].view(b, self.max_blocks)[:n], logits_indices=v[6][:len(logit_rows)],
                            query_lens_host=list(query_lens), context_lens_host=list(ctx_lens),
                            graph_key=(b, q, g.stamp))

    @torch.inference_mode()
    def _capture(self, b: int, q: int, pool) -> _Graph:
        batch, packed = self._static_batch(b, q)
        out = self._logits_out(b, q)
        graph, _ = self._record(lambda: self._model(batch, self._kv, self._backend, out=out), pool)
        return _Graph(graph, batch, packed, out)

    def _chain_step(self, g: _Graph, tokens: torch.Tensor, at: torch.Tensor, pick=None) -> None:
        """What a chain graph runs: the forward of bucket (b, 1), each row's token into tokens[at]
        (the argmax, or pick(logits, at), which writes them and returns them), and the static inputs
        advanced to the next position (slots from the block tables, table_slots). Padding rows
        keep slot -1 (no KV writes)."""
        s = g.batch
        logits = self._model(s, self._kv, self._backend)
        ids = logits.argmax(-1) if pick is None else pick(logits, at)
        # With CHAIN_KERNEL one kernel on the GPU (kernels/chain.py), else the torch ops.
        if s.input_ids.is_cuda and CHAIN_KERNEL:
            from specdec.kernels.chain import advance
        else:
            advance = advance_reference
        advance(ids, tokens if pick is None else None, at, s.input_ids, s.positions, s.context_lens,
                s.slot_mapping, s.block_tables, self.block_size)

    def _chain_buffers(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(CHAIN_MAX, b, dtype=torch.int64, device=self.device),
                torch.zeros(1, dtype=torch.int64, device=self.device))

    @torch.inference_mode()
    def _capture_chain(self, b: int, pool, pick=None, tokens: torch.Tensor | None = None) -> _Chain:
        g = self.graphs[(b, 1)]
        own, at = self._chain_buffers(b)
        tokens = own if tokens is None else tokens
        # The warm-up runs advance the static inputs, which must hold padding (slot -1) so that
        # nothing is written: a head capture before a sampled chain's leaves real slots there (a
        # session 21 review case), so every slot goes back to -1 first; every chain stages its own
        # inputs. `at` goes back to row 0 after each run: a sampled chain's rows are the sampler's
        # (max_num_draft of them, possibly 1).
        g.batch.slot_mapping.fill_(-1)
        graph, _ = self._record(lambda: self._chain_step(g, tokens, at, pick), pool, reset=at.zero_)
        return _Chain(graph, tokens, at)

    def _head_step(self, g2: _Graph, g1: _Graph, c: _Chain) -> None:
        """What a head graph runs: bucket (b, 2)'s forward (each sequence's feed of 1 or 2 tokens;
        padding sequences have empty query spans), each sequence's argmax at its last row into
        the chain's row 0 (and `at` to row 1), and bucket (b, 1)'s static inputs for the next
        position: the argmax as its ids, positions at the context lengths after the feed, the same
        block tables, one query token per fed sequence and none for padding, whose slot is -1."""
        s2, s1 = g2.batch, g1.batch
        logits = self._model(s2, self._kv, self._backend)        # every row of the bucket
        qsl = s2.query_start_loc
        fed = qsl[1:] > qsl[:-1]
        ids = logits.index_select(0, (qsl[1:] - 1).clamp(min=0).to(torch.int64)).argmax(-1)
        c.tokens[0].copy_(ids)
        c.at.fill_(1)
        s1.input_ids.copy_(ids)
        positions = s2.context_lens.to(torch.int64)
        s1.positions.copy_(positions)
        s1.context_lens.copy_(s2.context_lens + 1)
        s1.block_tables.copy_(s2.block_tables)
        s1.query_start_loc[1:].copy_(fed.cumsum(0))               # [0] is 0 in every staged batch
        slot = table_slots(positions, s1.block_tables, self.block_size)
        s1.slot_mapping.copy_(torch.where(fed, slot, torch.full_like(slot, -1)))

    @torch.inference_mode()
    def _capture_head(self, b: int, pool) -> torch.cuda.CUDAGraph:
        g2, g1, c = self.graphs[(b, 2)], self.graphs[(b, 1)], self.chains[b]
        # The capture's runs leave bucket (b, 1)'s inputs as the head set them (the capture batch's
        # sequences fed, with real slots in block 0): invalidate what it held (_capture_chain puts
        # the slots back to padding before the sampled chains are captured on these inputs).
        graph, _ = self._record(lambda: self._head_step(g2, g1, c), pool, reset=c.at.zero_)
        g1.stamp = next(_STAMPS)
        return graph

    def capture_sampled_chains(self, pick_for) -> None:
        """Sampled chain graphs for every bucket (b, 1) where pick_for(b) gives (pick, tokens):
        pick(logits [b, V], at) draws row `at` of tokens [rows, b] and returns it (the draft's
        sampler; its parameters and uniforms are staged before each chain)."""
        if 1 not in self.query_lens:
            return
        for b in reversed(self.batch_sizes):
            picked = pick_for(b)
            if picked is not None:
                self.sampled_chains[b] = self._capture_chain(b, self._pool, *picked)

    def can_chain(self, n: int, steps: int, width: int, sampled: bool = False) -> bool:
        """Whether `steps` chained steps of n sequences (block tables `width` wide after the last)
        fit a chain graph (a sampled one: its bucket is the smallest that holds n)."""
        return self._can_chain(self._bucket(n, 1, width), steps, sampled)

    def _can_chain(self, key: tuple[int, int] | None, steps: int, sampled: bool = False) -> bool:
        chains = self.sampled_chains if sampled else self.chains
        return 1 <= steps <= CHAIN_MAX and key is not None and key[1] == 1 and key[0] in chains

    @inference
    def chain(self, batch: ForwardBatch | StagedKey, first_ids: torch.Tensor | None, steps: int,
              sampled: bool = False, start: int = 0) -> torch.Tensor:
        """Runs `steps` single-token steps from a batch (or StagedKey) staged on bucket (b, 1), the
        first fed first_ids (on the device; None: the staged ids), each later one the token picked
        before it; [steps, n] ids: the argmaxes, or with `sampled` the draws of the sampled chain,
        written to rows start .. start + steps - 1 of its token rows. The static inputs move on, so
        the batch is spent afterwards."""
        g, b, q, n = self._staged(batch)
        c = (self.sampled_chains if sampled else self.chains).get(b)
        if q != 1 or c is None or not 1 <= steps <= CHAIN_MAX or not 0 <= start <= c.tokens.shape[0] - steps:
            raise ValueError(f"no {'sampled ' if sampled else ''}chain of {steps} steps from row {start} "
                             f"on graph {b}x{q}")
        if first_ids is not None:
            g.batch.input_ids[:n].copy_(first_ids, non_blocking=True)
        c.at.fill_(start)
        for _ in range(steps):
            c.graph.replay()
        self.replays += steps
        g.stamp = next(_STAMPS)
        return c.tokens[start:start + steps, :n].clone()

    def can_head(self, n: int, steps: int, width: int) -> bool:
        """Whether n sequences feeding up to 2 tokens, then `steps` - 1 chained steps (block
        tables `width` wide after the last), fit a head graph and its chain."""
        return self._can_head(self._bucket(n, 2, width), steps)

    def _can_head(self, key: tuple[int, int] | None, steps: int) -> bool:
        return (1 <= steps <= CHAIN_MAX and key is not None and key[1] == 2 and key[0] in self.heads
                and key[0] in self.chains)

    @inference
    def head_chain(self, batch: ForwardBatch | StagedKey, steps: int) -> torch.Tensor:
        """The head graph of a batch (or StagedKey) staged on bucket (b, 2), then `steps` - 1
        replays of chain b: [steps, n] ids, the argmax of each sequence's last fed token first.
        Both buckets' static inputs are spent afterwards."""
        g2, b, q, n = self._staged(batch)
        head = self.heads.get(b)
        if q != 2 or head is None or not 1 <= steps <= CHAIN_MAX:
            raise ValueError(f"no head and chain of {steps} steps on graph {b}x{q}")
        c = self.chains[b]
        head.replay()
        for _ in range(steps - 1):
            c.graph.replay()
        self.replays += steps
        g2.stamp = next(_STAMPS)
        self.graphs[(b, 1)].stamp = next(_STAMPS)
        return c.tokens[:steps, :n].clone()

    def _bucket(self, n: int, q_max: int, width: int, num_tokens: int = 0,
                num_logits: int = 0) -> tuple[int, int] | None:
        """Every query within a captured length, no more sequences than the bucket, a context
        within max_model_len, and the step's tokens and logit rows within the bucket's (which
        only a prefill bucket can refuse): the smallest such q, then the smallest b."""
        if width > self.max_blocks:
            return None
        for q in self.query_lens:          # shape(b, q): b x q rows, logits of every row
            if q >= q_max:
                for b in self.batch_sizes:
                    if b >= n and num_tokens <= b * q:
                        return (b, q)
        for q in self.prefill_lens:        # all longer than the query lens: the same order as before
            if q >= q_max:
                for b in self.batch_sizes:
                    if b >= n and self.shape(b, q).fits(num_tokens, num_logits):
                        return (b, q)
        return None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, argmax: bool = False) -> torch.Tensor | None:
        """The logits of a batch prepare() staged into a graph; None for any other batch (it runs
        eagerly: every batch that fits a graph is staged by prepare). argmax: the argmax of each
        requested row instead, read from the graph's output (no copy of the logits)."""
        return None if batch.graph_key is None else self._replay_staged(batch, argmax)

    def staged_graph(self, batch: ForwardBatch) -> _Graph:
        """The graph whose static inputs hold `batch` as prepare() staged it (input_ids aside;
        benchmarks replay its .graph directly)."""
        b, q, stamp = batch.graph_key
        g = self._holding(b, q, stamp)
        # A prefill graph gathers its logit rows from the staged segment too (none asked: no check,
        # an empty view has no address of its own).
        gathers = self.shape(b, q).logit_rows is not None and batch.logits_indices.numel()
        fields = _STAGED_ONLY + (("logits_indices",) if gathers else ())
        if any(getattr(batch, f).data_ptr() != getattr(g.batch, f).data_ptr() for f in fields):
            raise ValueError(f"a staged batch may replace only input_ids; {', '.join(fields)} "
                             "are the graph's static inputs as staged")
        return g

    def put_ids(self, batch: ForwardBatch, ids: Sequence[int]) -> None:
        """Replaces a staged batch's token ids in its graph's static inputs (one copy of just the
        ids; positions, slots and tables stay as staged): the batch then replays with them."""
        g = self.staged_graph(batch)
        if len(ids) != batch.input_ids.numel():
            raise ValueError(f"put_ids: {len(ids)} ids for a staged batch of {batch.input_ids.numel()} tokens")
        g.packed.put(0, ids)

    def _staged(self, staged: ForwardBatch | StagedKey) -> tuple[_Graph, int, int, int]:
        """(graph, b, q, sequences) of what a chain runs from: a staged batch (staged_graph's
        checks) or a StagedKey, refused as staged_graph refuses a batch once its graph's inputs
        were overwritten (a key replaces nothing: there is no view of its own to check)."""
        if isinstance(staged, ForwardBatch):
            b, q, _ = staged.graph_key
            return self.staged_graph(staged), b, q, len(staged.query_lens_host)
        b, q, stamp, n = staged
        return self._holding(b, q, stamp), b, q, n

    def _holding(self, b: int, q: int, stamp: int) -> _Graph:
        """Graph (b, q), refused unless its static inputs still hold what was staged under stamp."""
        g = self.graphs.get((b, q))
        if g is None or stamp != g.stamp:
            raise RuntimeError(f"this batch's static inputs (graph {b}x{q}) were overwritten by a later step, "
                               "or it was staged by another runner: forward a staged batch on its runner "
                               "before preparing the next one")
        return g

    def _replay_staged(self, batch: ForwardBatch, argmax: bool = False) -> torch.Tensor:
        g = self.staged_graph(batch)
        s = g.batch
        t = batch.input_ids.numel()
        if batch.input_ids.data_ptr() != s.input_ids.data_ptr():  # ids replaced on the device
            s.input_ids[:t].copy_(batch.input_ids, non_blocking=True)
        self.replays += 1
        g.graph.replay()
        return self._outputs(g, batch, t, argmax)

    def _outputs(self, g: _Graph, batch: ForwardBatch, t: int, argmax: bool = False) -> torch.Tensor:
        """The requested rows as a tensor of their own (the static output is overwritten by the
        graph's next replay), or their argmaxes [n] (int64)."""
        n = batch.logits_indices.numel()
        if self.shape(*batch.graph_key[:2]).logit_rows is not None or n == t:
            # A prefill bucket's graph gathered the rows; else logits of every token (rows are
            # sorted and unique)
            rows = g.logits[:n]
            return rows.argmax(-1) if argmax else rows.clone()
        if argmax:
            return g.logits[:t].argmax(-1).index_select(0, batch.logits_indices)
        return g.logits.index_select(0, batch.logits_indices)


_STAGED_ONLY = ("positions", "slot_mapping", "query_start_loc", "context_lens", "block_tables")


def table_slots(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV slot of each row's position [b] in its block table row [b, max_blocks] (on the
    device, for the graphs that move their inputs on); the block index is clamped so that a
    position past the context stays in the table (its slot is never written: no step follows the
    last)."""
    block = torch.clamp(positions // block_size, max=block_tables.shape[1] - 1)
    return (block_tables.gather(1, block[:, None]).squeeze(1).to(torch.int64) * block_size
            + positions % block_size)


def advance_reference(ids: torch.Tensor, tokens: torch.Tensor | None, at: torch.Tensor,
                      input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                      slot_mapping: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> None:
    """kernels.chain.advance in torch ops: the CPU path, and what the kernel is tested against."""
    if tokens is not None:
        tokens.index_copy_(0, at, ids[None])
    input_ids.copy_(ids)
    at.add_(1)
    positions.add_(1)
    context_lens.add_(1)
    slot_mapping.copy_(torch.where(slot_mapping >= 0, table_slots(positions, block_tables, block_size),
                                   slot_mapping))


class GraphSets:
    """A runner's CUDA graphs for rising context bounds, used as one GraphedForward.

    The attention kernel's KV split count is fixed at capture, planned from the graph's context
    bound (triton_attention.choose_splits). With the one bound of max_model_len a short-context
    step pays for many mostly empty splits and for merging them: the Llama-7B at batch 1 and a
    128-token context took 3799 us a forward with a 4096-token bound against 3716 us with 192 (H200,
    bench/timeline.py --max-model-len, bench/README.md session 12); a small draft plans more splits
    still (fewer heads). So sets[-1] is planned for max_model_len and holds every bucket (prefill
    ones too); each earlier set holds the decode/verify buckets and chains again, planned for a
    shorter bound, with block tables only that wide. A step is staged on the first set whose tables
    hold its widest table and that has a bucket for it, and runs there. Memory: the sets share one
    pool and one logits buffer; capture time grows by a decode/verify set per bound."""

    def __init__(self, sets: list[GraphedForward]):
        self.sets = sets

    @classmethod
    def build(cls, runner, max_model_len: int, context_lens: tuple[int, ...], factory=GraphedForward,
              **kwargs) -> GraphSets:
        """The full set for max_model_len (kwargs as GraphedForward's), then one set per shorter
        bound of context_lens (rounded up to whole KV blocks; bounds at or over max_model_len are
        the full set already)."""
        full = factory(runner, max_model_len, **kwargs)
        block = full.block_size
        bounds = sorted({-(-c // block) * block for c in context_lens if c > 0})
        kwargs["prefill_lens"] = ()
        return cls([*(factory(runner, c, share=full, **kwargs) for c in bounds if c < full.max_context), full])

    # What engines, benchmarks and tests read: the full set's buckets (every set has its decode /
    # verify buckets and chains too).
    def __getattr__(self, name):
        if name in ("graphs", "query_lens", "batch_sizes", "prefill_lens", "max_context", "max_blocks",
                    "block_size", "shape"):
            return getattr(self.sets[-1], name)
        raise AttributeError(name)

    # The full set's chain and head graphs too, as properties: read on every chained step, where
    # __getattr__ would first fail the ordinary lookup.
    @property
    def chains(self) -> dict[int, _Chain]:
        return self.sets[-1].chains

    @property
    def sampled_chains(self) -> dict[int, _Chain]:
        return self.sets[-1].sampled_chains

    @property
    def heads(self) -> dict[int, torch.cuda.CUDAGraph]:
        return self.sets[-1].heads

    @property
    def replays(self) -> int:
        return sum(s.replays for s in self.sets)

    @property
    def context_bounds(self) -> tuple[int, ...]:
        return tuple(s.max_context for s in self.sets)

    @property
    def num_graphs(self) -> int:
        return sum(s.num_graphs for s in self.sets)

    def stage(self, ids, positions, slots, starts, ctx_lens, tables, logit_rows, query_lens, width,
              key_only: bool = False):
        for s in self.sets:
            staged = s.stage(ids, positions, slots, starts, ctx_lens, tables, logit_rows, query_lens, width,
                             key_only)
            if staged is not None:
                return staged
        return None

    def _holder(self, batch: ForwardBatch | StagedKey) -> GraphedForward:
        """The set whose graph holds the staged batch or key (stamps are unique across sets); the
        full set when none does, whose check then says why."""
        b, q, stamp = batch.graph_key if isinstance(batch, ForwardBatch) else batch[:3]
        for s in self.sets:
            g = s.graphs.get((b, q))
            if g is not None and g.stamp == stamp:
                return s
        return self.sets[-1]

    def forward(self, batch: ForwardBatch, argmax: bool = False) -> torch.Tensor | None:
        return None if batch.graph_key is None else self._holder(batch).forward(batch, argmax)

    def staged_graph(self, batch: ForwardBatch) -> _Graph:
        return self._holder(batch).staged_graph(batch)

    def put_ids(self, batch: ForwardBatch, ids) -> None:
        self._holder(batch).put_ids(batch, ids)

    def chain(self, batch: ForwardBatch | StagedKey, first_ids, steps: int, sampled: bool = False,
              start: int = 0) -> torch.Tensor:
        return self._holder(batch).chain(batch, first_ids, steps, sampled, start)

    def head_chain(self, batch: ForwardBatch | StagedKey, steps: int) -> torch.Tensor:
        return self._holder(batch).head_chain(batch, steps)

    def _staging_set(self, n: int, q: int, width: int) -> tuple[GraphedForward, tuple[int, int]] | None:
        """The set stage() would pick for n sequences of up to q tokens (tables `width` wide), with
        the bucket it would stage them on."""
        for s in self.sets:
            key = s._bucket(n, q, width)
            if key is not None:
                return s, key
        return None

    def can_head(self, n: int, steps: int, width: int) -> bool:
        # The set that stage() would pick for the head's (n, 2) feed must have the head and chain.
        found = self._staging_set(n, 2, width)
        return found is not None and found[0]._can_head(found[1], steps)

    def can_chain(self, n: int, steps: int, width: int, sampled: bool = False) -> bool:
        # The set that stage() would pick for the chain's (n, 1) step must have the chain.
        found = self._staging_set(n, 1, width)
        return found is not None and found[0]._can_chain(found[1], steps, sampled)

    def capture_sampled_chains(self, pick_for) -> None:
        # One pick per bucket for all sets: pick_for(b) makes the sampler's staged parameter
        # buffers for b, which every set's chain of bucket b then reads.
        picks: dict[int, object] = {}

        def once(b: int):
            if b not in picks:
                picks[b] = pick_for(b)
            return picks[b]
        for s in reversed(self.sets):
            s.capture_sampled_chains(once)
