"""One forward over a flat varlen batch: several sequences, each with any number of new tokens
(a prompt chunk, one decode token, or k+1 tokens to verify), written into the paged KV cache."""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from specdec.block_manager import BlockManager, OutOfBlocks
from specdec.config import CacheConfig
from specdec.kernels.reference import TorchAttention
from specdec.kv_cache import KVCache
from specdec.models.llama import LlamaModel
from specdec.staging import pack_to_device


@dataclass(slots=True)  # not frozen: made per sequence per step (engine/types.py)
class SeqInput:
    seq_id: Hashable
    token_ids: Sequence[int]
    num_logits: int = 1  # logits for this many trailing new tokens (0: a prompt chunk that is not last)

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"sequence {self.seq_id!r}: no new tokens")
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(f"sequence {self.seq_id!r}: num_logits {self.num_logits} outside "
                             f"0..{len(self.token_ids)}")


class _Feed:
    """A SeqInput of one token with its logits, for greedy_chain's _host_arrays: the same fields,
    without the frozen dataclass's construction and checks (a few us a sequence)."""
    __slots__ = ("seq_id", "token_ids", "num_logits")

    def __init__(self, seq_id: Hashable, token_ids: list[int]):
        self.seq_id, self.token_ids, self.num_logits = seq_id, token_ids, 1


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64, new tokens of all sequences back to back
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64, flat KV slot of each new token
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor     # [B] int32, tokens in cache after this step (new ones included)
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with 0
    logits_indices: torch.Tensor   # [N] int64, rows of T whose logits are returned
    query_lens_host: list[int]
    context_lens_host: list[int]
    # Set when the tensors are a CUDA graph's static inputs, staged by prepare(): (batch bucket,
    # query bucket, stamp). The graph replays them as they are (no copies; input_ids alone may be
    # replaced by device ids); a later step on the same bucket overwrites them, which forward()
    # detects.
    graph_key: tuple[int, int, int] | None = None

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host)


def padded_table(tables: Sequence[Sequence[int]], width: int, num_rows: int | None = None) -> list[int]:
    """Block tables as one row-major [num_rows, width] list: each row padded with block 0, then
    rows of zeros up to num_rows (default: one row per table)."""
    table: list[int] = []
    for t in tables:
        table += t
        table += [0] * (width - len(t))
    return table + [0] * (width * ((num_rows or len(tables)) - len(tables)))


def default_backend(device: torch.device):
    if device.type == "cuda":
        from specdec.kernels.triton_attention import TritonAttention
        return TritonAttention()
    return TorchAttention()


class ModelRunner:
    """Owns a model, its KV cache and the block bookkeeping of the sequences in it."""

    def __init__(self, model: LlamaModel, cache: CacheConfig, backend=None):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.cache_config = cache
        self.kv = KVCache(model.config, cache, self.device, model.num_kv_heads_local)
        self.blocks = BlockManager(cache.num_blocks, cache.block_size)
        self.backend = backend or default_backend(self.device)
        self.graphs = None
        self.eager_forwards = 0  # forwards that ran op by op (graph replays: graphs.replays)

    def enable_cuda_graphs(self, max_model_len: int, query_lens: tuple[int, ...] = (1,),
                           batch_sizes: tuple[int, ...] | None = None, chains: bool = False,
                           prefill_lens: tuple[int, ...] = (), context_lens: tuple[int, ...] = ()) -> None:
        """Capture decode/verify graphs; forward() replays one whenever a batch fits a bucket.
        chains: also the greedy chain graphs that greedy_chain() runs; prefill_lens: buckets for
        steps with a prompt chunk of up to that many tokens; context_lens: shorter context bounds
        with a decode/verify set of their own (cuda_graphs.GraphSets)."""
        from specdec.cuda_graphs import DEFAULT_BATCH_SIZES, GraphedForward, GraphSets
        kwargs = dict(query_lens=query_lens, batch_sizes=batch_sizes or DEFAULT_BATCH_SIZES, chains=chains,
                      prefill_lens=prefill_lens)
        if any(0 < c < max_model_len for c in context_lens):
            self.graphs = GraphSets.build(self, max_model_len, context_lens, **kwargs)
        else:
            self.graphs = GraphedForward(self, max_model_len, **kwargs)

    # --- sequence lifetime -------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable) -> None:
        self.blocks.allocate(seq_id)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        self.blocks.truncate(seq_id, num_tokens)

    def free(self, seq_id: Hashable) -> None:
        self.blocks.free(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.blocks.num_tokens(seq_id)

    # --- forward -----------------------------------------------------------------------------
    def _host_arrays(self, items: Sequence[SeqInput], ahead: int = 0, checked: bool = False) -> tuple[list, ...]:
        """Reserves KV slots for every item's new tokens and `ahead` more per item (all or none;
        a chain's later steps, whose slots the graph finds in the block tables) and returns the
        step's host arrays: ids, positions, slots, query starts, context lengths, block tables
        (after the reservation; the sequences' live lists, so the caller stages or copies them
        before any sequence's KV changes again) and logit rows, with the query lengths and the
        widest table.
        checked: the caller checked the reservation already (_reserve_need, _check_free)."""
        if not checked:
            self._reserve_check(items, ahead)
        ids, positions, slots, starts, ctx_lens, tables, logit_rows = [], [], [], [0], [], [], []
        query_lens = []
        blocks = self.blocks
        end = width = 0
        for item in items:
            held = blocks.held(item.seq_id)
            start = held.num_tokens
            n = len(item.token_ids)
            slots += blocks.append(item.seq_id, n + ahead)[:n]
            ids += item.token_ids
            positions += range(start, start + n)
            logit_rows += range(end + n - item.num_logits, end + n)
            end += n
            starts.append(end)
            ctx_lens.append(start + n)
            query_lens.append(n)
            tables.append(held.blocks)   # live: staged (copied) by the caller before the KV changes again
            if len(held.blocks) > width:
                width = len(held.blocks)
        return ids, positions, slots, starts, ctx_lens, tables, logit_rows, query_lens, width

    def prepare(self, items: Sequence[SeqInput], graphs: bool = True) -> ForwardBatch:
        """Reserves KV slots for every item's new tokens (all or none) and builds the batch;
        graphs=False builds an eager batch even where a CUDA graph fits."""
        arrays = self._host_arrays(items)
        if graphs and self.graphs is not None:  # straight into a graph's static inputs, when one fits
            staged = self.graphs.stage(*arrays)
            if staged is not None:
                return staged
        ids, positions, slots, starts, ctx_lens, tables, logit_rows, query_lens, width = arrays
        table = padded_table(tables, width)
        # One packed host-to-device copy for all seven (pinned on CUDA: it queues behind the previous
        # step's kernels instead of waiting for them; staging.pack_to_device keeps each view aligned
        # as a separate allocation would be, so Triton compiles no extra variants).
        ids_t, pos_t, slots_t, starts_t, ctx_t, table_t, rows_t = pack_to_device(
            [(ids, torch.int64), (positions, torch.int64), (slots, torch.int64), (starts, torch.int32),
             (ctx_lens, torch.int32), (table, torch.int32),
             (logit_rows, torch.int64)], self.device)
        return ForwardBatch(
            input_ids=ids_t, positions=pos_t, slot_mapping=slots_t, query_start_loc=starts_t,
            context_lens=ctx_t, block_tables=table_t.view(len(items), width), logits_indices=rows_t,
            query_lens_host=query_lens, context_lens_host=ctx_lens)

    def can_chain(self, seq_ids: Sequence[Hashable], steps: int, sampled: bool = False) -> bool:
        """Whether greedy_chain(seq_ids, ..., steps) (or a sampled chain) runs on a chain graph."""
        if self.graphs is None or not (self.graphs.sampled_chains if sampled else self.graphs.chains) or not seq_ids:
            return False
        width = max(self.blocks.blocks_needed(self.blocks.num_tokens(s) + steps) for s in seq_ids)
        return self.graphs.can_chain(len(seq_ids), steps, width, sampled)

    def greedy_chain(self, seq_ids: Sequence[Hashable], first_ids: torch.Tensor | Sequence[int],
                     steps: int, sampled: bool = False, start: int = 0) -> torch.Tensor:
        """`steps` greedy single-token forwards of seq_ids on a chain graph (see can_chain): the
        first feeds first_ids (host ids, or ids on the device; one per sequence), each later one
        the argmax of the one before. The KV slots of all steps are reserved here, then one staged
        copy and `steps` replays run them with no host work in between. Returns the
        [steps, len(seq_ids)] argmaxes on the device: what `steps` rounds of prepare, forward and
        argmax would give. sampled: the sampled chain instead (its sampler's parameters and
        uniforms staged by the caller), drawing into its rows start .. start + steps - 1."""
        refused = f"no chain graph for {len(seq_ids)} sequences x {steps} steps"
        if self.graphs is None or not (self.graphs.sampled_chains if sampled else self.graphs.chains) or not seq_ids:
            raise ValueError(refused)
        on_device = isinstance(first_ids, torch.Tensor) and first_ids.device == self.device
        if isinstance(first_ids, torch.Tensor) and not on_device:
            first_ids = first_ids.tolist()
        feeds = [0] * len(seq_ids) if on_device else list(first_ids)
        items = [_Feed(s, [t]) for s, t in zip(seq_ids, feeds)]
        arrays = self._chain_arrays(items, steps, lambda width: self.graphs.can_chain(len(items), steps, width, sampled),
                                    refused)
        # Inference mode once for the staging copy and the replays (each would enter it itself);
        # the chain reads only the staged bucket and stamp (StagedKey), not a batch of views.
        with torch.inference_mode():
            staged = self.graphs.stage(*arrays, key_only=True)
            return self.graphs.chain(staged, first_ids if on_device else None, steps, sampled, start)

    def can_fed_chain(self, items: Sequence[SeqInput], steps: int) -> bool:
        """Whether fed_chain(items, steps) runs on a head graph and a chain graph."""
        if self.graphs is None or not self.graphs.heads or not items:
            return False
        if max(len(i.token_ids) for i in items) != 2 or any(i.num_logits != 1 for i in items):
            return False
        width = max(self.blocks.blocks_needed(self.blocks.num_tokens(i.seq_id) + len(i.token_ids) + steps - 1)
                    for i in items)
        return self.graphs.can_head(len(items), steps, width)

    def fed_chain(self, items: Sequence[SeqInput], steps: int) -> torch.Tensor:
        """greedy_chain for a first forward that feeds 1 or 2 tokens per sequence (a draft step
        after all drafts were accepted feeds the last draft and the bonus token; see can_fed_chain):
        the feeds run on bucket (b, 2)'s head graph, which picks each sequence's argmax and sets up
        the chain's inputs on the device, then `steps` - 1 chain replays. One staged copy for the
        whole step; KV slots for all of it reserved here. Returns the [steps, len(items)] argmaxes
        on the device."""
        refused = f"no head and chain graph for {len(items)} sequences x {steps} steps"
        if (self.graphs is None or not self.graphs.heads or not items
                or max(len(i.token_ids) for i in items) != 2 or any(i.num_logits != 1 for i in items)):
            raise ValueError(refused)
        arrays = self._chain_arrays(items, steps, lambda width: self.graphs.can_head(len(items), steps, width),
                                    refused)
        with torch.inference_mode():   # as in greedy_chain
            return self.graphs.head_chain(self.graphs.stage(*arrays, key_only=True), steps)

    def _chain_arrays(self, items: Sequence[SeqInput], steps: int, fits, refused: str) -> tuple[list, ...]:
        """A chain's host arrays (_host_arrays with steps - 1 ahead), after its graph check:
        fits(width) on the widest table the reservation's check finds (one pass over the
        sequences, not two), ValueError(refused) before anything is reserved, then OutOfBlocks."""
        need, width = self._reserve_need(items, steps - 1)
        if not fits(width):
            raise ValueError(refused)
        self._check_free(need)
        return self._host_arrays(items, steps - 1, checked=True)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, argmax: bool = False) -> torch.Tensor:
        """The logits of the batch's requested rows [N, V] (float32), or with argmax their argmaxes
        [N] (int64; from a graph's output without copying the logits out)."""
        if self.graphs is not None:
            out = self.graphs.forward(batch, argmax)  # a copy: the graph's output is overwritten next replay
            if out is not None:
                return out
        self.eager_forwards += 1
        logits = self.model(batch, self.kv, self.backend)
        return logits.argmax(-1) if argmax else logits

    def step(self, items: Sequence[SeqInput], graphs: bool = True) -> list[torch.Tensor]:
        """prepare + forward; returns each item's logits [num_logits, V] (float32)."""
        return list(self.step_flat(items, graphs).split([i.num_logits for i in items]))

    def step_flat(self, items: Sequence[SeqInput], graphs: bool = True, argmax: bool = False) -> torch.Tensor:
        """step's logits as one [sum(num_logits), V] tensor, the items' rows in order (argmax: the
        rows' argmaxes, [sum(num_logits)])."""
        return self.forward(self.prepare(items, graphs), argmax)

    def _reserve_check(self, items: Sequence[SeqInput], ahead: int = 0) -> None:
        self._check_free(self._reserve_need(items, ahead)[0])

    def _reserve_need(self, items: Sequence[SeqInput], ahead: int = 0) -> tuple[int, int]:
        """(the KV blocks that reserving every item's tokens and `ahead` more per item takes
        beyond what the items hold, the widest block table after it); raises for a sequence that
        is unknown or in items twice."""
        seen = set()
        need = width = 0
        for item in items:
            if item.seq_id in seen:
                raise ValueError(f"sequence {item.seq_id!r} appears twice in one batch")
            seen.add(item.seq_id)
            if item.seq_id not in self.blocks:
                raise KeyError(f"unknown sequence {item.seq_id!r}")
            held = self.blocks.held(item.seq_id)
            blocks = self.blocks.blocks_needed(held.num_tokens + len(item.token_ids) + ahead)
            need += blocks - len(held.blocks)
            if blocks > width:
                width = blocks
        return need, width

    def _check_free(self, need: int) -> None:
        if need > self.blocks.num_free:
            raise OutOfBlocks(f"batch needs {need} more KV blocks, {self.blocks.num_free} free "
                              f"of {self.blocks.num_blocks}")
