"""What the draft and target engines share: loading, KV sizing, per-sequence validation and
admission, release, info, and the warm-up: prefill forwards that compile the kernels' variants, then
the profile of single-token forwards.

Engines are synchronous and not thread-safe; the servers call them from one executor thread.
"""
from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from protos.wire import outside_vocab
from specdec.config import (DEFAULT_GRAPH_PREFILL_LENS, CacheConfig, ConfigError, EngineConfig, ModelConfig,
                            rank_devices)
from specdec.block_manager import OutOfBlocks
from specdec.kv_cache import KVCache
from specdec.models.llama import TensorParallel
from specdec.models.loader import build_model, init_random, load_model
from specdec.models.synthetic import init_agreeing
from specdec.runner import ModelRunner, SeqInput
from specdec.tokenizer_info import tokenizer_fingerprint
from specdec.engine.timing import DecodeProfile, ForwardClock, host_clock
from specdec.engine.types import Code, ModelInfo, SeqError, SeqFailure

log = logging.getLogger("specdec.engine")


@functools.lru_cache(maxsize=None)
def device_uuids(device: torch.device) -> tuple[str, ...]:
    """The GPU's UUID (the physical device, also inside a container that renumbers it), or ()
    on the CPU or where torch does not report one."""
    if device.type != "cuda":
        return ()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return (str(uuid),) if uuid else ()


WARMUP_CONTEXT = 16  # tokens of context behind the timed single-token forward
# Timed single-token forwards per warm-up batch size on CUDA (their median seeds the decode
# profile, the t(b, 1) that c is built on). A small draft's forward is ~0.1 ms of replay and about
# as much host work around it, so 3 of them gave a noisy median: the 68m draft's b 1 profile read
# 0.17 to 0.40 ms in four H200 e2e runs of session 18 (c at b 1 from 0.045 to 0.098). 25 cost the
# 7B target ~0.1 s per batch size. The CPU (tests, the demo) keeps 3.
WARMUP_REPEATS_CUDA = 25
# Prefill shapes run at start-up on CUDA (capped by max_model_len and the free KV). Powers of two:
# the attention tile is picked from next_power_of_2(query length x query group), so these reach
# every tile of tile_config for any group, up to past the coordinator's 512-token chunks. Batch 2
# doubles the programs, which changes the split-KV count of long prompts.
WARMUP_PROMPT_LENS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
WARMUP_PREFILL_BATCHES = (1, 2)


@dataclass
class Admission:
    """One admitted sequence of a step: whether the step created it and how long its KV was
    before the step (what an aborted step rolls back to)."""
    seq_id: int
    is_new: bool
    kv_len_before: int


class ModelEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel = TensorParallel()):
        """tp: this process's rank of a tensor-parallel group (serving/tensor_parallel.py builds one
        engine per rank, each over its shard of the weights and KV heads)."""
        self.config = config
        self.tp = tp
        # batch size -> seconds of one single-token graph replay alone (warm_up, CUDA graphs only)
        self.replay_profile: dict[int, float] = {}
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches and CUDA-graph capture use the thread's current device, not the
            # tensors': a server on cuda:1 must make it current (engine calls stay on this thread).
            torch.cuda.set_device(self.device)
        if config.pdl is not None and self.device.type == "cuda":
            from specdec.kernels import pdl  # process-wide; read at capture, so set before the graphs
            pdl.set_enabled(config.pdl)
        if self.device.type == "cuda":
            from specdec.kernels import blas  # process-wide, as PDL
            blas.use(config.blas or blas.DEFAULT)
        if config.random_weights:  # benchmarks of a shape: no checkpoint to write, read or load
            self.model_config = ModelConfig.from_path(config.model)
            model = build_model(self.model_config, config.dtype, self.device, tp,
                                gemv_kernels=config.gemv_kernels)
            if config.random_agreement is None:
                init_random(model)
            else:
                init_agreeing(model, config.random_agreement)
        else:
            model, self.model_config = load_model(config.model, config.dtype, self.device, tp,
                                                  gemv_kernels=config.gemv_kernels)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position
        if self.max_model_len > mc.max_position:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {mc.max_position}")
        cache = CacheConfig(self._num_blocks(model), config.block_size, config.dtype)
        self.runner = ModelRunner(model, cache)
        self.vocab_size = mc.vocab_size
        self.fingerprint = tokenizer_fingerprint(config.model)
        self.profile = DecodeProfile()
        if self.device.type == "cuda" and config.cuda_graphs:
            self._capture_graphs()

    def graph_query_lens(self) -> tuple[int, ...]:
        """Query lengths whose forwards are graphed when the config does not say; engines override."""
        return (1,)

    # Whether the engine runs greedy chains of single-token steps (GraphedForward's chain graphs).
    graph_chains = False

    def _capture_graphs(self) -> None:
        # Before the server reports SERVING: capture (and Triton compilation) is seconds, paid once.
        query_lens = self.config.graph_query_lens or self.graph_query_lens()
        prefill_lens = self.config.graph_prefill_lens
        if prefill_lens is None:
            prefill_lens = tuple(p for p in DEFAULT_GRAPH_PREFILL_LENS if p <= self.max_model_len)
        t0 = time.perf_counter()
        self.runner.enable_cuda_graphs(self.max_model_len, query_lens, self.config.graph_batch_sizes,
                                       chains=self.graph_chains, prefill_lens=prefill_lens,
                                       context_lens=self.config.graph_context_lens)
        graphs = self.runner.graphs
        log.info("captured %d CUDA graphs (query lengths %s, prefill lengths %s, batch sizes %s, "
                 "context bounds %s) in %.1fs", graphs.num_graphs, ",".join(map(str, graphs.query_lens)),
                 ",".join(map(str, graphs.prefill_lens)) or "none", ",".join(map(str, graphs.batch_sizes)),
                 ",".join(map(str, graphs.context_bounds)), time.perf_counter() - t0)

    @property
    def graph_replays(self) -> int:
        """Forwards served by a CUDA graph so far (0 without graphs)."""
        return self.runner.graphs.replays if self.runner.graphs is not None else 0

    @property
    def eager_forwards(self) -> int:
        """Forwards run op by op so far (warm-up included): on a GPU, steps no graph bucket fits."""
        return self.runner.eager_forwards

    def _num_blocks(self, model) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = KVCache.bytes_per_block(self.model_config, cfg.block_size, cfg.dtype,
                                            model.num_kv_heads_local)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        budget = cfg.kv_memory if cfg.kv_memory is not None else cfg.default_kv_memory(free)
        blocks = budget // per_block
        if self.tp.size > 1:  # every rank holds the same block table: the fewest blocks any GPU fits
            least = torch.tensor([blocks], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
            blocks = int(least.item())
        if blocks < 1:
            raise ConfigError(f"kv_memory: {budget} bytes is less than one KV block ({per_block} bytes)")
        return blocks

    # --- lifetime ----------------------------------------------------------------------------
    def release(self, seq_ids: Iterable[int]) -> int:
        """Frees the KV of the ids it holds (unknown ids are ignored); returns how many it held."""
        released = 0
        for seq_id in seq_ids:
            if seq_id in self.runner.blocks:
                self._forget(seq_id)
                released += 1
        return released

    def _forget(self, seq_id: int) -> None:
        self.runner.free(seq_id)

    @property
    def num_free_blocks(self) -> int:
        return self.runner.blocks.num_free

    def num_sequences(self) -> int:
        return len(self.runner.blocks.seq_ids())

    def info(self) -> ModelInfo:
        mc, blocks = self.model_config, self.runner.blocks
        return ModelInfo(
            model_name=str(self.config.model), architecture=mc.architecture, vocab_size=mc.vocab_size,
            tokenizer_fingerprint=self.fingerprint, max_model_len=self.max_model_len,
            kv_blocks_total=blocks.num_blocks, kv_blocks_free=blocks.num_free,
            block_size=blocks.block_size, device=str(self.device),
            dtype=str(self.config.dtype).removeprefix("torch."), eos_token_ids=mc.eos_token_ids,
            num_sequences=self.num_sequences(), tensor_parallel_size=self.tp.size,
            device_uuids=tuple(u for d in rank_devices(str(self.device), self.tp.size, self.tp.rank)
                               for u in device_uuids(torch.device(d))),
            max_num_draft=self.config.max_num_draft)

    # --- validation --------------------------------------------------------------------------
    def check_tokens(self, tokens: Sequence[int], field: str) -> None:
        bad = outside_vocab(tokens, self.vocab_size)
        if bad is not None:
            raise SeqFailure(Code.INVALID_ARGUMENT,
                             f"{field}: token id {bad} outside the vocabulary 0..{self.vocab_size - 1}")

    def check_length(self, total: int, what: str) -> None:
        if total > self.max_model_len:
            raise SeqFailure(Code.INVALID_ARGUMENT,
                             f"{what}: sequence would reach {total} tokens, over max_model_len "
                             f"{self.max_model_len}")

    def check_num_draft(self, n: int, field: str) -> None:
        if not 0 <= n <= self.config.max_num_draft:
            raise SeqFailure(Code.INVALID_ARGUMENT,
                             f"{field}: {n} outside 0..{self.config.max_num_draft}")

    # --- admission ---------------------------------------------------------------------------
    def admit_step(self, seqs: Sequence, plan: Callable) -> tuple[list, list[SeqError | None]]:
        """The admission loop of a step. Per sequence (each has seq_id and first): plan(index, seq)
        validates it and returns the engine's plan, raising SeqFailure and changing nothing a
        failure would have to undo; a `first` sequence the server already holds is restarted (an
        idempotent resend: the old state goes and its blocks count as free for this step); then
        the blocks to reach the plan's kv_len_after are reserved. Returns the admitted plans
        (their `admission` set) and, per sequence, its error or None.

        A sequence's budget is the blocks free at its turn less those promised to earlier ones:
        read at its turn, because its plan may have freed some (the draft rolls rejected drafts
        back) and so may the restart. (Read once before the loop, a step that needed no new block
        after its roll-back was refused for KV, and served when sent again.)"""
        plans = []
        errors: list[SeqError | None] = [None] * len(seqs)
        promised = 0
        seen: set[int] = set()
        for i, seq in enumerate(seqs):
            try:
                if seq.seq_id in seen:
                    raise SeqFailure(Code.INVALID_ARGUMENT, f"seq_id: {seq.seq_id} appears twice in one step")
                seen.add(seq.seq_id)
                p = plan(i, seq)
                if seq.first and seq.seq_id in self.runner.blocks:
                    self._forget(seq.seq_id)
                need = self.blocks_to_grow(seq.seq_id, p.kv_len_after)
                p.admission = self.admit(seq.seq_id, need, self.num_free_blocks - promised)
                promised += need
                plans.append(p)
            except SeqFailure as f:
                errors[i] = f.error
        return plans, errors

    def blocks_to_grow(self, seq_id: int, kv_len_after: int) -> int:
        blocks = self.runner.blocks
        have = len(blocks.held(seq_id).blocks) if seq_id in blocks else 0
        return max(0, blocks.blocks_needed(kv_len_after) - have)

    def admit(self, seq_id: int, need: int, available: int) -> Admission:
        """Admits a sequence that needs `need` more blocks this step, of `available` (free and not
        promised to an earlier sequence of the step); creates it if new. Raises RESOURCE_EXHAUSTED
        without side effects when they are not there, so a failing new sequence leaves nothing
        behind."""
        if need > available:
            raise SeqFailure(Code.RESOURCE_EXHAUSTED,
                             f"kv cache: sequence {seq_id} needs {need} more blocks, {available} free "
                             f"of {self.runner.blocks.num_blocks}")
        is_new = seq_id not in self.runner.blocks
        if is_new:
            self.runner.add_sequence(seq_id)
        return Admission(seq_id, is_new, self.runner.num_tokens(seq_id))

    def roll_back(self, admitted: Iterable[Admission]) -> None:
        """After a failed forward: the step leaves no trace (new sequences freed, others cut back)."""
        for a in admitted:
            if a.seq_id not in self.runner.blocks:
                continue
            if a.is_new:
                self._forget(a.seq_id)
            else:
                self.runner.truncate(a.seq_id, min(a.kv_len_before, self.runner.num_tokens(a.seq_id)))

    # --- timing ------------------------------------------------------------------------------
    def clock(self) -> ForwardClock:
        return ForwardClock(self.device, self.tp.size)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_up(self, repeats: int | None = None, prompt_lens: Sequence[int] | None = None) -> dict[int, float]:
        """Runs before the server reports SERVING. First untimed prefill forwards (see
        _warm_prefill; prompt_lens None: WARMUP_PROMPT_LENS on CUDA, none on the CPU, which
        compiles nothing), then times one single-token forward at each warm-up batch size (median
        of `repeats`, default WARMUP_REPEATS_CUDA on CUDA and 3 elsewhere, after one untimed run
        that pays for lazy initialisation) and seeds the decode profile with it."""
        t0 = time.perf_counter()
        if repeats is None:
            repeats = WARMUP_REPEATS_CUDA if self.device.type == "cuda" else 3
        if prompt_lens is None:
            prompt_lens = WARMUP_PROMPT_LENS if self.device.type == "cuda" else ()
        prefills = self._warm_prefill(prompt_lens)
        blocks = self.runner.blocks
        now = host_clock(self.device, self.tp.size)  # the live forwards' clock (they move these entries)
        for b in self.config.warmup_batch_sizes:
            if b * blocks.blocks_needed(WARMUP_CONTEXT + repeats + 1) > blocks.num_free:
                continue
            with self._scratch_sequences(b) as ids:
                self.runner.step([SeqInput(sid, [1] * WARMUP_CONTEXT) for sid in ids])
                times = []
                for r in range(repeats + 1):
                    self.synchronize()
                    t1 = now()
                    self.runner.step([SeqInput(sid, [1]) for sid in ids])
                    self.synchronize()
                    if r:
                        times.append(now() - t1)
                self.profile.set(b, statistics.median(times))
                if self.runner.graphs is not None and self.tp.size == 1:
                    replay = self._replay_seconds(ids, repeats)
                    if replay is not None:
                        self.replay_profile[b] = replay
        if self.runner.graphs is not None:
            log.info("warm-up: %d forwards replayed CUDA graphs", self.graph_replays)
        if self.replay_profile:
            log.info("decode replay profile (batch: ms): %s",
                     ", ".join(f"{b}: {s * 1e3:.3f}" for b, s in sorted(self.replay_profile.items())))
        log.info("warm-up took %.1fs: %d prefill forwards (batch x prompt length: %s), then the decode "
                 "profile", time.perf_counter() - t0, len(prefills),
                 ", ".join(f"{b}x{n}" for b, n in prefills) or "none")
        return self.profile.table()

    def _replay_seconds(self, ids: list, repeats: int) -> float | None:
        """Median device time of the single-token graph of these sequences, replayed alone (CUDA
        events around replay(): no host work inside): the forward's own cost, beside the decode
        profile's wall time of a whole step (prepare, replay, logits). The graph's inputs are staged
        once (one KV slot per sequence, rewritten by every replay). None without a graph for them.
        One rank only: a tensor-parallel rank's replay waits for the others in its all-reduce."""
        try:
            batch = self.runner.prepare([SeqInput(sid, [1]) for sid in ids])
        except OutOfBlocks:   # the timed steps took the last blocks: no replay profile at this size
            return None
        if batch.graph_key is None:
            return None
        graph = self.runner.graphs.staged_graph(batch).graph
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def _warm_prefill(self, prompt_lens: Sequence[int]) -> list[tuple[int, int]]:
        """One untimed prefill forward per (batch, prompt length) that fits max_model_len and the
        free KV; returns the (batch, length) pairs run. They run eagerly even where a prefill graph
        fits (its capture compiled the graph's variants; eager steps beyond the buckets, such as
        several prompts joining at once, need their own), and the attention kernel's compiled
        variant depends on the query length (tile_config: BLOCK_M/BLOCK_N, warps, stages), on
        batch and context (the split-KV count) and on the block-table width (Triton
        specialises on it); the fused kernels compile on first use too. Without this the first
        requests of each shape paid the compiles: TTFT p99 ~1 s at low load on the H200 while p50
        was 22-44 ms."""
        blocks, done = self.runner.blocks, []
        for n in sorted({min(n, self.max_model_len) for n in prompt_lens if n > 0}):
            for b in WARMUP_PREFILL_BATCHES:
                if b * blocks.blocks_needed(n) > blocks.num_free:
                    continue
                with self._scratch_sequences(b) as ids:
                    self.runner.step([SeqInput(sid, [1] * n) for sid in ids], graphs=False)
                done.append((b, n))
        self.synchronize()  # the compiles and forwards are done before health says SERVING
        return done

    @contextmanager
    def _scratch_sequences(self, n: int) -> Iterator[list[tuple[str, int]]]:
        """n new sequences for warm-up forwards, freed afterwards whatever happens."""
        ids = [("warmup", i) for i in range(n)]
        try:
            for sid in ids:
                self.runner.add_sequence(sid)
            yield ids
        finally:
            for sid in ids:
                if sid in self.runner.blocks:
                    self.runner.free(sid)
