"""Review of continuous batching (coordinator/scheduler.py driven by coordinator/spec_loop.py).

The real Scheduler and SpecLoop run against in-process fake servers that answer from the
deterministic "model" of test_spec_loop_faults and that keep their KV the way the real engines do
(specdec/engine/base.py admit_step, target.py and draft.py plans) in the real paged BlockManager
(specdec/block_manager.py): the target holds new_tokens + drafts during a step and keeps
new_tokens + accepted; the draft truncates to its surviving tokens and holds tokens +
num_draft - 1 (the last draft is never fed); `extend` drafts after the whole proposal. Each server
records a violation when a sequence would hold more blocks than the scheduler reserved for it on
that server, when a sequence without a reservation reaches it, or when it would run out of blocks
(the real engine's per-sequence RESOURCE_EXHAUSTED) - so the reservation arithmetic (block
rounding, drafts beyond the output, the bonus token, pipelined extensions, resends after a loss)
is checked against what the servers really allocate, not against the scheduler's own numbers.

Expectations checked (randomized simulations plus one targeted test each): FIFO admission and no
starvation; the batch never above --max-batch-size; the queue bound and RESOURCE_EXHAUSTED;
reservations that let every admitted request finish; requests without draft room running plainly
and never touching the draft; capacity returned on finish / cancel / error / loss; requests that
can never fit refused up front; a cancelled waiting request leaving the queue at once; chunked
prefill not stalling the decode of the others. Tests marked `# FINDING:` fail on purpose: each
describes a deviation from those expectations (--max-waiting not bounding a KV-limited queue; a
draft reservation kept by a sequence whose draft was turned off).
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry

from coordinator.config import CoordinatorConfig
from coordinator.scheduler import KVCapacity, Rejected, Scheduler
from coordinator.sequence import Abort, Finish, GenParams, Sampling, Sequence
from coordinator.spec_loop import SpecLoop
from coordinator.tokenizer import TextTokenizer
from protos import specdec_pb2 as pb
from protos.wire import pack_ids, unpack_ids
from specdec.block_manager import BlockManager
from specdec.metrics import CoordinatorMetrics
from tests.helpers.fake_servers import QuietServer
from tests.helpers.tiny_models import _tokenizer_json
from tests.unit.test_spec_loop_faults import V, model, one_hot, rpc_error, verify_greedily

MAX_LEN = 128
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def noisy(ctx: list[int]) -> int:
    """The draft's model: model() except at about one position in seven (rejections happen)."""
    t = model(ctx)
    return (t + 1) % V if (ctx[-1] + 3 * len(ctx)) % 7 == 0 else t


def greedy(prompt, n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(model(ctx))
    return ctx[len(prompt):]


def expected_output(params: GenParams, max_len: int) -> tuple[list[int], Finish]:
    """What the request must return: greedy decoding, cut at a stop token or the budget."""
    budget = min(params.max_new_tokens, max_len - len(params.prompt_ids))
    out = []
    for tok in greedy(params.prompt_ids, budget):
        out.append(tok)
        if tok in params.stop_token_ids:
            return out, Finish.STOP
    return out, Finish.LENGTH


def blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Refuse(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


# --- fake servers with real KV bookkeeping --------------------------------------------------------
class KVServer(QuietServer):
    """What both fakes share: a BlockManager as large as the KV the coordinator was told about,
    the reservations the scheduler made per sequence (filled in by the harness at admission), and
    the violations a real server would turn into failures."""

    def __init__(self, role: str, num_blocks: int, block_size: int, max_model_len: int, promised: dict):
        self.role = role
        self.bm = BlockManager(num_blocks, block_size)
        self.max_model_len = max_model_len
        self.promised = promised         # seq_id -> blocks the scheduler reserved on this server
        self.violations: list[str] = []
        self.seen: set[int] = set()      # every seq_id that ever reached this server
        self.peak_used = 0
        self.release_calls = 0
        self.rng = random.Random(0)
        self.lose_p = 0.0                # per step: forget a held sequence (target) / everything (draft)
        self.err_p = 0.0                 # per sequence: refuse it with a per-sequence error
        self.injected: set[int] = set()  # sequences that got an injected error or loss
        self.on_step = None              # called with each step request (the simulation's clock)

    def held(self) -> list[int]:
        return self.bm.seq_ids()

    def _forget(self, seq_id: int) -> None:
        self.bm.free(seq_id)

    async def release(self, seq_ids, timeout: float = 5.0):
        self.release_calls += 1
        for i in seq_ids:
            self._forget(i)
        return pb.ReleaseResponse()


    def _admit(self, seq_id: int, kv_len_after: int, budget: list[int], what: str) -> None:
        """The engine's admit(): the blocks to reach kv_len_after must be free (not promised to
        an earlier sequence of the step); and, the review's check, within the reservation."""
        bm = self.bm
        total = bm.blocks_needed(kv_len_after)
        reserved = self.promised.get(seq_id)
        if reserved is None or reserved == 0:
            self.violations.append(f"{self.role}: sequence {seq_id} ({what}) reached the server "
                                   f"without a KV reservation there")
        elif total > reserved:
            self.violations.append(f"{self.role}: sequence {seq_id} ({what}) would hold {kv_len_after} "
                                   f"tokens = {total} blocks of {bm.block_size}, over its reservation of "
                                   f"{reserved}")
        have = len(bm.block_table(seq_id)) if seq_id in bm else 0
        need = max(0, total - have)
        if need > budget[0]:
            self.violations.append(f"{self.role}: out of KV: sequence {seq_id} ({what}) needs {need} more "
                                   f"blocks, {budget[0]} free of {bm.num_blocks}")
            raise Refuse(RESOURCE_EXHAUSTED, f"kv cache: sequence {seq_id} needs {need} more blocks")
        budget[0] -= need
        if seq_id not in bm:
            bm.allocate(seq_id)

    def _grow(self, seq_id: int, n: int) -> None:
        self.bm.append(seq_id, n)  # OutOfBlocks here would be a bug of the fake's budget
        self.peak_used = max(self.peak_used, self.bm.num_used)


class KVTarget(KVServer):
    def __init__(self, num_blocks, block_size, max_model_len, promised):
        super().__init__("target", num_blocks, block_size, max_model_len, promised)
        self.ctx: dict[int, list[int]] = {}     # the tokens in each sequence's KV
        self.requests: list[pb.VerifyRequest] = []
        self.steps = 0
        self.accepted = 0

    def _forget(self, seq_id):
        super()._forget(seq_id)
        self.ctx.pop(seq_id, None)

    async def step(self, request: pb.VerifyRequest, timeout=None, on_sent=None) -> pb.VerifyResponse:
        await asyncio.sleep(0)  # a real call suspends
        self.steps += 1
        self.requests.append(request)
        if self.on_step is not None:
            self.on_step(request)
        for i in request.release:
            self._forget(i)
        if self.lose_p and self.held() and self.rng.random() < self.lose_p:
            victim = self.rng.choice(self.held())
            self.injected.add(victim)
            self._forget(victim)
        response = pb.VerifyResponse(step=request.step)
        plans = []
        promised = 0
        for s in request.seqs:
            r = response.results.add(seq_id=s.seq_id)
            self.seen.add(s.seq_id)
            new, drafts = unpack_ids(s.new_tokens), unpack_ids(s.draft_tokens)
            try:
                if self.err_p and not s.first and self.rng.random() < self.err_p:
                    self.injected.add(s.seq_id)
                    raise Refuse(INVALID_ARGUMENT, "new_tokens: injected refusal")
                if not new:
                    raise Refuse(INVALID_ARGUMENT, "new_tokens: empty")
                if s.partial_prefill and drafts:
                    raise Refuse(INVALID_ARGUMENT, "draft_tokens: must be empty with partial_prefill")
                if s.first:
                    start = 0
                elif s.seq_id in self.bm:
                    start = self.bm.num_tokens(s.seq_id)
                else:
                    raise Refuse(NOT_FOUND, f"sequence {s.seq_id} not held")
                emitted = 0 if s.partial_prefill else 1
                if start + len(new) + len(drafts) + emitted > self.max_model_len:
                    self.violations.append(f"target: sequence {s.seq_id} over max_model_len")
                    raise Refuse(INVALID_ARGUMENT, "over max_model_len")
                if s.first and s.seq_id in self.bm:
                    self._forget(s.seq_id)  # a resend from the start drops what was held
                available = [self.bm.num_free - promised]
                before = available[0]
                self._admit(s.seq_id, start + len(new) + len(drafts), available,
                            f"{start} + {len(new)} new + {len(drafts)} drafts")
                promised += before - available[0]
                plans.append((s, r, start, new, drafts))
            except Refuse as e:
                r.error.code, r.error.message = e.code, e.message
        for s, r, start, new, drafts in plans:  # the forward: every plan's tokens at once
            self._grow(s.seq_id, len(new) + len(drafts))
            self.ctx[s.seq_id] = self.ctx.get(s.seq_id, [])[:start] + new
        for s, r, start, new, drafts in plans:
            ctx = self.ctx[s.seq_id]
            if not s.partial_prefill:
                self.accepted += verify_greedily(ctx, drafts, r)
            self.bm.truncate(s.seq_id, len(ctx))  # rejected drafts roll back
        return response


@dataclass
class DraftState:
    tokens: list[int] = field(default_factory=list)  # confirmed + the last proposal
    base: int = 0                                     # how many of tokens are confirmed


class KVDraft(KVServer):
    def __init__(self, num_blocks, block_size, max_model_len, promised, draft_model=noisy):
        super().__init__("draft", num_blocks, block_size, max_model_len, promised)
        self.draft_model = draft_model
        self.states: dict[int, DraftState] = {}
        self.requests: list[pb.ProposeRequest] = []
        self.fed: list[int] = []  # per Propose: the most tokens fed for one sequence

    def _forget(self, seq_id):
        super()._forget(seq_id)
        self.states.pop(seq_id, None)

    async def step(self, request: pb.ProposeRequest, timeout=None, on_sent=None) -> pb.ProposeResponse:
        await asyncio.sleep(0)
        self.requests.append(request)
        for i in request.release:
            self._forget(i)
        if self.lose_p and self.rng.random() < self.lose_p:  # the server restarted: holds nothing
            for i in self.held():
                self.injected.add(i)
                self._forget(i)
        response = pb.ProposeResponse(step=request.step)
        plans = []
        promised = 0
        for s in request.seqs:
            r = response.results.add(seq_id=s.seq_id)
            self.seen.add(s.seq_id)
            new, k = unpack_ids(s.new_tokens), s.num_draft
            try:
                if self.err_p and not s.first and self.rng.random() < self.err_p:
                    self.injected.add(s.seq_id)
                    raise Refuse(INTERNAL, "injected draft failure")
                state = None if s.first else self.states.get(s.seq_id)
                if state is None:
                    if not s.first:
                        raise Refuse(NOT_FOUND, f"sequence {s.seq_id} not held")
                    if not new:
                        raise Refuse(INVALID_ARGUMENT, "new_tokens: empty for a new sequence")
                    tokens = list(new)
                else:
                    drafted = len(state.tokens) - state.base
                    if not 0 <= s.keep <= drafted:
                        self.violations.append(f"draft: keep {s.keep} outside 0..{drafted}")
                        raise Refuse(INVALID_ARGUMENT, "keep")
                    if s.extend:
                        if new:
                            raise Refuse(INVALID_ARGUMENT, "new_tokens: must be empty with extend")
                        tokens = list(state.tokens)
                    else:
                        tokens = state.tokens[:state.base + s.keep] + list(new)
                if len(tokens) + k > self.max_model_len:
                    self.violations.append(f"draft: sequence {s.seq_id} over max_model_len")
                    raise Refuse(INVALID_ARGUMENT, "over max_model_len")
                if state is None:
                    if s.seq_id in self.bm:
                        self._forget(s.seq_id)
                    base, kv_len = len(tokens), 0
                else:
                    base = state.base + s.keep if s.extend else len(tokens)
                    kv_len = min(self.bm.num_tokens(s.seq_id), len(tokens) if s.extend else state.base + s.keep)
                    if kv_len == len(tokens) and k:
                        kv_len -= 1  # drafting needs the last token's logits
                    self.bm.truncate(s.seq_id, kv_len)
                after = len(tokens) + max(k - 1, 0)  # the last draft is never fed
                available = [self.bm.num_free - promised]
                before = available[0]
                self._admit(s.seq_id, after, available, f"{len(tokens)} tokens + {k} drafts"
                            + (" (extend)" if s.extend else ""))
                promised += before - available[0]
                plans.append((s, r, tokens, base, kv_len, after))
            except Refuse as e:
                r.error.code, r.error.message = e.code, e.message
        self.fed.append(max((len(p[2]) - p[4] for p in plans), default=0))
        for s, r, tokens, base, kv_len, after in plans:
            self._grow(s.seq_id, after - kv_len)
        for s, r, tokens, base, kv_len, after in plans:
            drafts = []
            for _ in range(s.num_draft):
                drafts.append(self.draft_model(tokens + drafts))
            self.states[s.seq_id] = DraftState(tokens + drafts, base)
            r.tokens = pack_ids(drafts)
            if s.sampling.temperature > 0 and drafts:
                r.probs.CopyFrom(one_hot(drafts))
        return response


# --- the harness --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(_tokenizer_json(V))
    return TextTokenizer(path)


def would_wait(sched: Scheduler, seq: Sequence) -> int:
    """Requests that would still wait, `seq` queued last, after a FIFO admission now: a batch slot
    and the target KV for each, admission stopping at the first that does not fit."""
    slots = sched.max_batch_size - len(sched.running)
    free = sched.target.blocks_total - sched.reserved_target
    queue = [s for s in (*sched.waiting, seq) if not s.done]
    for k, s in enumerate(queue):
        need = sched.target.blocks_for(sched.longest(s))
        if slots <= 0 or need > free:
            return len(queue) - k
        slots, free = slots - 1, free - need
    return 0


class Harness:
    """The real Scheduler + SpecLoop with KV-tracking fakes; records admissions and checks the
    scheduler's invariants at every step boundary (violations are collected, not raised: the loop
    turns exceptions into INTERNAL for everyone)."""

    def __init__(self, *, max_batch=4, max_waiting=4, target_blocks=1000, block_size=16,
                 draft_blocks: int | None = 1000, draft_block_size=None, max_len=MAX_LEN,
                 draft_max_len=None, pipeline=False, draft_model=noisy, **config_kw):
        self.max_len = max_len
        self.promised_t: dict[int, int] = {}
        self.promised_d: dict[int, int] = {}
        self.target = KVTarget(target_blocks, block_size, max_len, self.promised_t)
        dbs = draft_block_size or block_size
        self.draft = (KVDraft(draft_blocks, dbs, draft_max_len or max_len, self.promised_d, draft_model)
                      if draft_blocks else None)
        self.sched = Scheduler(max_batch, max_waiting, KVCapacity("target", target_blocks, block_size),
                               KVCapacity("draft", draft_blocks, dbs) if draft_blocks else None)
        self.config = CoordinatorConfig(target="fake:1", draft="fake:2" if self.draft else None,
                                        max_batch_size=max_batch, max_waiting=max_waiting,
                                        draft_retry_s=0.01, pipeline="on" if pipeline else "off", **config_kw)

        async def check_draft():
            return None
        metrics = CoordinatorMetrics(CollectorRegistry(), max_positions=self.config.max_num_draft)
        self.loop = SpecLoop(self.config, self.sched, self.target, self.draft, metrics, vocab_size=V,
                             draft_max_len=draft_max_len or max_len,
                             check_draft=check_draft if self.draft else None)
        self.violations: list[str] = []
        self.admitted: list[Sequence] = []
        self.boundaries: list[tuple[int, int]] = []  # (running, waiting) after each admission
        self._admit = self.sched.admit
        self.sched.admit = self._checked_admit
        self.target.on_step = self._check_step
        self.task: asyncio.Task | None = None
        self.ends: dict[int, object] = {}
        self.outputs: dict[int, list[int]] = {}
        self._collectors: dict[int, asyncio.Task] = {}

    def _checked_admit(self) -> list[Sequence]:
        got = self._admit()
        s, v = self.sched, self.violations
        for seq in got:
            self.promised_t[seq.seq_id] = seq.reserved_target
            self.promised_d[seq.seq_id] = seq.reserved_draft
            longest = min(len(seq.params.prompt_ids) + seq.params.max_new_tokens, seq.max_len)
            if seq.reserved_target != blocks(longest, s.target.block_size):  # the documented formula
                v.append(f"sequence {seq.seq_id}: reserved {seq.reserved_target} target blocks")
            if seq.use_draft and seq.reserved_draft != blocks(longest, s.draft.block_size):
                v.append(f"sequence {seq.seq_id}: reserved {seq.reserved_draft} draft blocks")
        self.admitted += got
        if len(s.running) > s.max_batch_size:
            v.append(f"{len(s.running)} running, max_batch_size {s.max_batch_size}")
        if s.reserved_target != sum(x.reserved_target for x in s.running) or s.reserved_target > s.target.blocks_total:
            v.append(f"target reservations {s.reserved_target} / {s.target.blocks_total}")
        if s.draft is not None and (s.reserved_draft != sum(x.reserved_draft for x in s.running)
                                    or s.reserved_draft > s.draft.blocks_total):
            v.append(f"draft reservations {s.reserved_draft} / {s.draft.blocks_total}")
        if s.waiting and len(s.running) < s.max_batch_size:
            head = s.waiting[0]
            need = s.target.blocks_for(s.longest(head))
            if s.reserved_target + need <= s.target.blocks_total:
                v.append(f"sequence {head.seq_id} waits with a free slot and room for its {need} blocks")
        if len(s.waiting) > s.max_waiting:  # after admission: only what the KV or slots hold back
            v.append(f"{len(s.waiting)} waiting with max_waiting {s.max_waiting} ({len(s.running)} running)")
        self.boundaries.append((len(s.running), len(s.waiting)))
        return got

    def _check_step(self, request: pb.VerifyRequest) -> None:
        ids = [s.seq_id for s in request.seqs]
        v = self.violations
        if len(ids) > self.config.max_batch_size:
            v.append(f"step {request.step}: {len(ids)} sequences, max_batch_size {self.config.max_batch_size}")
        if len(set(ids)) != len(ids):
            v.append(f"step {request.step}: a sequence twice")
        # Every running sequence takes part in every step, except prompts once the step's prompt
        # tokens (--prefill-chunk, all prompts together) are spent; the first prompt always does.
        running = self.sched.running
        decoding = {s.seq_id for s in running if not s.prefilling}
        prompts = [s.seq_id for s in running if s.prefilling]
        if not decoding <= set(ids) or not set(ids) <= {s.seq_id for s in running} \
                or (prompts and prompts[0] not in ids):
            v.append(f"step {request.step}: verifies {sorted(ids)}, running {sorted(s.seq_id for s in running)}")
        fed = [len(unpack_ids(s.new_tokens)) for s in request.seqs]
        prompt_tokens = sum(n for n in fed if n > 1)
        if prompt_tokens > self.config.prefill_chunk:
            v.append(f"step {request.step}: {prompt_tokens} prompt tokens, prefill_chunk {self.config.prefill_chunk}")

    # --- driving ---
    def start(self) -> None:
        self.task = asyncio.create_task(self.loop.run())

    def submit(self, seq: Sequence) -> None:
        """Raises Rejected like the servicer's submit; on success a task collects the stream."""
        self.sched.submit(seq)
        self._collectors[seq.seq_id] = asyncio.create_task(self._collect(seq))

    async def _collect(self, seq: Sequence) -> None:
        out = self.outputs.setdefault(seq.seq_id, [])
        while True:
            item = await seq.queue.get()
            if isinstance(item, Abort):
                self.ends[seq.seq_id] = item
                return
            out += item.token_ids
            if item.finish is not None:
                self.ends[seq.seq_id] = item.finish
                return

    def cancel(self, seq: Sequence) -> None:
        """The client went away (the servicer's `finally`)."""
        self.sched.cancel(seq)
        task = self._collectors.pop(seq.seq_id, None)
        if task is not None:
            task.cancel()

    async def finish(self, timeout: float = 10.0) -> None:
        """Every stream not cancelled has ended (requests may be cancelled meanwhile)."""
        async def all_ended():
            while pending := [t for t in self._collectors.values() if not t.done()]:
                await asyncio.wait(pending)
        await asyncio.wait_for(all_ended(), timeout)

    def clean(self) -> bool:
        s = self.sched
        return (not s.running and not s.waiting and s.reserved_target == 0 and s.reserved_draft == 0
                and not s.has_releases and not self.loop.draft_orphans and not self.target.held()
                and (self.draft is None or not self.draft.held()))

    async def settle(self, timeout: float = 5.0) -> None:
        """Everything ended: the servers hold nothing and no reservation is left."""
        await until(self.clean, timeout)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        for t in self._collectors.values():
            t.cancel()

    def all_violations(self) -> list[str]:
        return self.violations + self.target.violations + (self.draft.violations if self.draft else [])


async def until(cond, timeout: float = 5.0) -> None:
    """Yields to the loop one event-loop turn at a time until cond() holds: the test acts within
    a step of the moment it waits for (a real-time poll would let the loop run many steps)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not reached in {timeout}s")
        await asyncio.sleep(0)


async def steps(h: Harness, n: int) -> None:
    """Lets the loop run n more target steps (or until it goes idle)."""
    goal = h.target.steps + n
    await until(lambda: h.target.steps >= goal or (not h.sched.running and not h.sched.waiting))


def make_seq(tok, seq_id: int, prompt_len: int, max_new: int, *, temperature=0.0, speculate=True,
             num_draft=0, stop=(), max_len=MAX_LEN) -> Sequence:
    prompt = tuple((seq_id * 37 + i * 11 + 5) % V for i in range(prompt_len))
    params = GenParams(request_id=str(seq_id), prompt_ids=prompt, max_new_tokens=max_new,
                       sampling=Sampling(temperature=temperature, seed=seq_id), stop_token_ids=frozenset(stop),
                       speculate=speculate, num_draft=num_draft)
    return Sequence(seq_id=seq_id, params=params, max_len=max_len, tokenizer=tok)


def assert_exact(h: Harness, seq: Sequence) -> None:
    want, how = expected_output(seq.params, h.max_len)
    assert h.ends.get(seq.seq_id) == how, (seq.seq_id, h.ends.get(seq.seq_id))
    assert h.outputs[seq.seq_id] == want, seq.seq_id


def run(coro):
    return asyncio.run(coro)


# --- randomized simulation ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(60))
def test_randomized_continuous_batching(tok, seed):
    """Seeded arrivals (bursts and gaps, measured in target steps), cancellations of waiting,
    running and finished requests, prompts and budgets around block boundaries and the model
    length, KV sizes from one request to a few, a draft with less KV than the target or none,
    per-request speculation off / sampled / num_draft, --spec-max-batch, --prefill-chunk,
    --pipeline, and servers that lose sequences or refuse one. Checked throughout: no server ever
    holds more than was reserved for a sequence or runs out of blocks; the batch, the queue bound,
    FIFO admission, work conservation (a head that fits is admitted); every request that was not
    cancelled ends with exactly its greedy output (or, when a server lost it too often / refused
    it, the matching error); the refusals are exactly the requests that can never fit or found the
    queue full; at the end nothing is reserved or held."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4, 5, 8, 16])
    max_len = rng.choice([48, 64, 96, MAX_LEN])
    per_req = blocks(rng.randint(max_len // 3, max_len), block_size)  # roughly one request's need
    target_blocks = max(1, int(per_req * rng.uniform(0.8, 3.5)))
    draft_block_size = rng.choice([block_size, 1, 4, 16])
    per_req_d = blocks(rng.randint(max_len // 3, max_len), draft_block_size)
    draft_blocks = rng.choice([None, max(1, int(per_req_d * rng.uniform(0.3, 1.5))),
                               max(1, int(per_req_d * rng.uniform(1.0, 4.0))),
                               max(1, int(per_req_d * rng.uniform(1.0, 4.0)))])
    faults = rng.random() < 0.4
    kw = dict(max_batch=rng.randint(1, 5), max_waiting=rng.randint(0, 4), target_blocks=target_blocks,
              block_size=block_size, draft_blocks=draft_blocks, draft_block_size=draft_block_size,
              max_len=max_len, draft_max_len=rng.choice([None, None, max_len - 10, max_len // 2]),
              pipeline=rng.random() < 0.5,
              num_draft=rng.randint(1, 6), spec_max_batch=rng.choice([0, 0, 2, 3]),
              prefill_chunk=rng.choice([1, 3, 8, 16, 512]))
    n_requests = rng.randint(10, 22)

    async def main():
        h = Harness(**kw)
        if faults:
            h.target.rng = random.Random(seed + 1000)
            h.target.lose_p, h.target.err_p = rng.choice([0.0, 0.03]), rng.choice([0.0, 0.01])
            if h.draft is not None:
                h.draft.rng = random.Random(seed + 2000)
                h.draft.lose_p, h.draft.err_p = rng.choice([0.0, 0.03]), rng.choice([0.0, 0.02])
        h.start()
        sched = h.sched
        seqs: dict[int, Sequence] = {}
        accepted: list[Sequence] = []
        rejected: dict[int, str] = {}
        cancelled: set[int] = set()
        events = []
        at = 0
        for i in range(1, n_requests + 1):
            at += rng.choice([0, 0, 0, 1, 2, 3, 6])
            prompt_len = rng.choice([rng.randint(1, 8), rng.randint(1, max_len // 2), rng.randint(1, max_len - 1)])
            max_new = rng.choice([1, 2, rng.randint(1, 20), rng.randint(1, max_len),
                                  max(1, blocks(prompt_len, block_size) * block_size - prompt_len)])
            stop = ()
            if rng.random() < 0.2:
                cont = greedy(make_seq(tok, i, prompt_len, 1).params.prompt_ids, max_new)
                stop = (rng.choice(cont),)
            seq = make_seq(tok, i, prompt_len, max_new, temperature=rng.choice([0.0, 0.0, 0.7]),
                           speculate=rng.random() < 0.85, num_draft=rng.choice([0, 0, 1, 3, 8]),
                           stop=stop, max_len=max_len)
            seqs[i] = seq
            events.append((at, "submit", seq))
            if rng.random() < 0.2:
                events.append((at + rng.choice([0, 1, 2, 5, 12]), "cancel", seq))
        events.sort(key=lambda e: e[0])  # stable: submits before their cancels at the same step
        for when, kind, seq in events:
            while h.target.steps < when and (sched.running or sched.waiting):
                await asyncio.sleep(0)
            if kind == "submit":
                need = blocks(min(len(seq.params.prompt_ids) + seq.params.max_new_tokens, max_len), block_size)
                full = would_wait(sched, seq) > sched.max_waiting
                try:
                    h.submit(seq)
                except Rejected as e:
                    rejected[seq.seq_id] = str(e)
                    if need > target_blocks:
                        assert str(e).startswith("kv cache") and f"needs {need} KV blocks" in str(e)
                    else:
                        assert full and str(e).startswith("capacity"), str(e)
                    continue
                assert need <= target_blocks and not full, "accepted a request it should refuse"
                accepted.append(seq)
            elif seq.seq_id not in rejected and seq.seq_id not in h.ends:
                was_waiting = seq in sched.waiting
                h.cancel(seq)
                cancelled.add(seq.seq_id)
                if was_waiting:  # leaves the queue at once, never reaches a server
                    assert seq not in sched.waiting and seq.done
        await h.finish()
        await h.settle()
        await h.stop()
        return h, accepted, rejected, cancelled

    h, accepted, rejected, cancelled = run(main())
    assert not h.all_violations(), h.all_violations()[:5]
    # FIFO: admissions keep the arrival order.
    order = [s.seq_id for s in h.admitted]
    assert order == sorted(order), order
    for seq in accepted:
        if seq.seq_id in cancelled:
            if seq.seq_id not in {s.seq_id for s in h.admitted}:
                assert seq.seq_id not in h.target.seen  # cancelled while waiting
            continue
        end = h.ends[seq.seq_id]
        if isinstance(end, Abort):  # only a server that lost / refused it may end it
            assert seq.seq_id in h.target.injected and end.code in (UNAVAILABLE, INVALID_ARGUMENT), (seq.seq_id, end)
            continue
        assert_exact(h, seq)
        if h.promised_d.get(seq.seq_id, 0) == 0 and h.draft is not None:
            assert seq.seq_id not in h.draft.seen  # no draft room: plain decoding, never on the draft
    assert h.target.peak_used <= h.target.bm.num_blocks


# --- targeted tests -----------------------------------------------------------------------------
def test_fifo_a_large_head_is_not_overtaken(tok):
    """A (large) runs; B (large) waits for KV; C (small) would fit now but arrived after B: it is
    not admitted before B (no starvation of large requests), and all finish exactly."""
    async def main():
        # a and b: 100 tokens = 13 blocks each of 14; c: 1 block, which is free while a runs
        h = Harness(max_batch=4, max_waiting=4, target_blocks=14, block_size=8, draft_blocks=None)
        h.start()
        a, b, c = make_seq(tok, 1, 40, 60), make_seq(tok, 2, 40, 60), make_seq(tok, 3, 4, 4)
        h.submit(a)
        await steps(h, 1)
        h.submit(b)
        h.submit(c)
        await steps(h, 3)
        assert [s.seq_id for s in h.sched.running] == [1] and list(h.sched.waiting) == [b, c]
        await h.finish()
        await h.settle()
        await h.stop()
        return h, (a, b, c)
    h, seqs = run(main())
    assert [s.seq_id for s in h.admitted] == [1, 2, 3] and not h.all_violations()
    for s in seqs:
        assert_exact(h, s)


def test_batch_is_bounded_and_filled(tok):
    """10 requests, --max-batch-size 3, KV for all: every step verifies 3 sequences while at least
    3 are left (slots are refilled at the next boundary), never more."""
    async def main():
        h = Harness(max_batch=3, max_waiting=7, draft_blocks=1000)
        h.start()
        seqs = [make_seq(tok, i, 5, 3 + i) for i in range(1, 11)]
        for s in seqs:
            h.submit(s)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, seqs
    h, seqs = run(main())
    sizes = [len(r.seqs) for r in h.target.requests]
    assert max(sizes) == 3 and sizes[0] == 3 and sizes.count(3) >= 4  # (and no slot idle: violations)
    assert not h.all_violations()
    for s in seqs:
        assert_exact(h, s)


def test_full_queue_is_resource_exhausted_and_a_cancel_frees_a_place(tok):
    """--max-batch-size 2 --max-waiting 2: a fifth request gets RESOURCE_EXHAUSTED naming both
    limits; cancelling a waiting request makes room at once, and the canceled one never reaches a
    server."""
    async def main():
        h = Harness(max_batch=2, max_waiting=2)
        h.start()
        seqs = [make_seq(tok, i, 4, 40) for i in range(1, 5)]
        for s in seqs:
            h.submit(s)
        await steps(h, 1)
        assert len(h.sched.running) == 2 and len(h.sched.waiting) == 2
        extra = make_seq(tok, 5, 4, 4)
        with pytest.raises(Rejected) as e:
            h.submit(extra)
        msg = str(e.value)
        assert msg.startswith("capacity") and "max_batch_size 2" in msg and "max_waiting 2" in msg
        assert "retry later" in msg
        victim = seqs[3]
        h.cancel(victim)
        assert victim not in h.sched.waiting and victim.done  # at once, not at a step boundary
        h.submit(extra)  # the freed place is usable immediately
        await h.finish()
        await h.settle()
        await h.stop()
        return h, seqs, extra, victim
    h, seqs, extra, victim = run(main())
    assert victim.seq_id not in h.target.seen and victim.seq_id not in h.draft.seen
    assert [s.seq_id for s in h.admitted] == [1, 2, 3, 5]
    for s in seqs[:3] + [extra]:
        assert_exact(h, s)
    assert not h.all_violations()


def test_waiting_never_exceeds_max_waiting_under_kv_pressure(tok):
    # Found by this review (fixed: Scheduler._left_waiting): --max-waiting did not bound the queue
    # when KV, not the batch, is the limit.
    # Scheduler.submit (coordinator/scheduler.py:56) refuses only when running + waiting >=
    # max_batch_size + max_waiting, i.e. it counts every free batch slot as a place a queued
    # request will take at the next boundary. When the target's KV is what keeps requests out of
    # the batch, those slots never fill: here --max-batch-size 4 --max-waiting 1 and KV for one
    # request at a time, so one runs and FOUR wait (max_waiting + max_batch_size - 1 in general;
    # with the defaults 32 / 64, up to 95 queue behind a KV-full batch). Expected: at most
    # max_waiting requests wait after admission at a step boundary, the others get
    # RESOURCE_EXHAUSTED at submit. Actual: 4 wait, and the fifth's message says
    # "1 requests running (max_batch_size 4) and 4 waiting (max_waiting 1)".
    async def main():
        h = Harness(max_batch=4, max_waiting=1, target_blocks=4, block_size=16, draft_blocks=None)
        h.start()
        first = make_seq(tok, 1, 10, 50)  # 4 blocks: the whole KV
        h.submit(first)
        await steps(h, 1)
        refused = []
        for i in range(2, 7):
            try:
                h.submit(make_seq(tok, i, 10, 50))
            except Rejected as e:
                refused.append(str(e))
        await steps(h, 2)
        waiting = len(h.sched.waiting)
        await h.finish(timeout=20)
        await h.stop()
        return waiting, refused, h
    waiting, refused, h = run(main())
    assert not h.all_violations()
    assert waiting <= 1, f"{waiting} requests wait with max_waiting 1; refused: {refused}"


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipeline"])
@pytest.mark.parametrize("block_size", [1, 4, 5, 16])
@pytest.mark.parametrize("prompt_len, max_new", [(3, 13), (3, 14), (16, 16), (17, 15), (1, 1), (1, 2),
                                                 (30, 98), (100, 60)])
def test_reservation_is_enough_with_zero_slack(tok, pipeline, block_size, prompt_len, max_new):
    """The servers have exactly the KV of the reservation (ceil(min(prompt + max_new_tokens,
    max_model_len) / block_size) blocks; (100, 60) is capped by the model length 128) and the draft
    drafts up to 8 tokens, mostly accepted: neither server ever needs a block more, with or
    without pipelined extensions, and the output is exact."""
    need = blocks(min(prompt_len + max_new, MAX_LEN), block_size)

    async def main():
        h = Harness(max_batch=2, max_waiting=2, target_blocks=need, draft_blocks=need, block_size=block_size,
                    pipeline=pipeline, num_draft=8, draft_model=noisy)
        h.start()
        seq = make_seq(tok, 1, prompt_len, max_new)
        h.submit(seq)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, seq
    h, seq = run(main())
    assert h.promised_t[1] == need and h.promised_d[1] == need and seq.use_draft
    assert not h.all_violations(), h.all_violations()
    assert_exact(h, seq)
    if max_new > 2:
        assert h.target.accepted > 0  # the drafts really reached the end of the budget


def test_two_requests_share_a_kv_of_exactly_their_reservations(tok):
    """Two requests of 5 and 7 blocks (block size 4, odd lengths) run side by side on a target
    and a draft of exactly 12 blocks, while pipelining and resending after the target loses one."""
    async def main():
        h = Harness(max_batch=2, max_waiting=0, target_blocks=12, draft_blocks=12, block_size=4,
                    pipeline=True, num_draft=6)
        h.target.lose_p, h.target.rng = 0.1, random.Random(4)
        h.start()
        a, b = make_seq(tok, 1, 7, 11), make_seq(tok, 2, 9, 17, temperature=0.7)
        h.submit(a)
        h.submit(b)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, (a, b)
    h, seqs = run(main())
    assert (h.promised_t[1], h.promised_t[2]) == (5, 7) and h.target.peak_used <= 12
    assert not h.all_violations(), h.all_violations()
    for s in seqs:
        assert_exact(h, s)


def test_never_fitting_request_is_refused_up_front(tok):
    """prompt + max_new_tokens over the whole target KV: RESOURCE_EXHAUSTED at submit, naming the
    blocks and what to lower; it never waits, and the request behind it runs at once. Exactly the
    whole KV is accepted; a budget over the model length is capped (not refused); a request too
    large for the draft alone still runs, plainly."""
    async def main():
        h = Harness(max_batch=2, max_waiting=2, target_blocks=6, block_size=8, draft_blocks=3, max_len=64)
        h.start()
        big = make_seq(tok, 1, 20, 29, max_len=64)  # 49 tokens = 7 blocks > 6
        with pytest.raises(Rejected) as e:
            h.submit(big)
        msg = str(e.value)
        assert "needs 7 KV blocks on the target" in msg and "has 6 in all" in msg and "max_new_tokens" in msg
        assert big not in h.sched.waiting
        exact = make_seq(tok, 2, 20, 28, max_len=64)     # 48 tokens = 6 blocks: fits exactly
        capped = make_seq(tok, 3, 40, 500, max_len=64)   # min(540, 64) = 64 tokens = 8 blocks > 6
        with pytest.raises(Rejected, match="needs 8 KV blocks"):
            h.submit(capped)
        capped_ok = make_seq(tok, 4, 10, 10_000, max_len=40 + 8)  # min(..., 48) = 6 blocks
        h.submit(exact)
        h.submit(capped_ok)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, exact, capped_ok
    h, exact, capped_ok = run(main())
    assert not h.all_violations(), h.all_violations()
    assert h.target.seen == {2, 4}
    assert exact.seq_id not in h.draft.seen and not exact.use_draft  # 6 blocks > the draft's 3: plain
    h.max_len = 48
    assert_exact(h, capped_ok)
    h.max_len = 64
    assert_exact(h, exact)


def test_no_draft_room_runs_plainly_and_later_requests_get_the_draft(tok):
    """Draft KV for one request: the first speculates, the second (admitted beside it) decodes
    plainly and never reaches the draft; a third admitted after the first finished gets the draft
    reservation back."""
    async def main():
        h = Harness(max_batch=2, max_waiting=2, target_blocks=100, draft_blocks=4, block_size=8)
        h.start()
        a, b = make_seq(tok, 1, 10, 20), make_seq(tok, 2, 10, 60)
        h.submit(a)
        h.submit(b)
        await until(lambda: 1 in h.ends)
        await steps(h, 1)
        c = make_seq(tok, 3, 10, 20)
        h.submit(c)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, (a, b, c)
    h, (a, b, c) = run(main())
    assert a.use_draft and not b.use_draft and c.use_draft
    assert h.draft.seen == {1, 3} and h.promised_d[2] == 0
    assert not h.all_violations(), h.all_violations()
    for s in (a, b, c):
        assert_exact(h, s)


class ScriptedTarget(KVTarget):
    """Refuses (script[seq_id] == 'refuse') or loses ('lose': every step) a sequence."""

    def __init__(self, *a, script=None, **kw):
        super().__init__(*a, **kw)
        self.script = script or {}

    async def step(self, request, timeout=None, on_sent=None):
        for s in request.seqs:
            if self.script.get(s.seq_id) == "lose" and not s.first:
                self._forget(s.seq_id)
        response = await super().step(request, timeout)
        for s, r in zip(request.seqs, response.results):
            if self.script.get(s.seq_id) == "refuse" and s.seq_id in self.bm and not s.partial_prefill:
                r.Clear()
                r.seq_id = s.seq_id
                r.error.code, r.error.message = INVALID_ARGUMENT, "new_tokens: refused"
        return response


@pytest.mark.parametrize("how", ["finish", "stop_token", "cancel_running", "error", "lost_for_good"])
def test_capacity_comes_back(tok, how):
    """The first request holds the whole KV of both servers; however it ends (finishes, hits a
    stop token, is cancelled while running, is refused by the target, is lost by the target more
    often than it may be resent), its reservation returns, the servers are told to release it,
    and the second request - which needs the whole KV too - is admitted and finishes exactly."""
    async def main():
        # prefill_chunk 4: a resend is chunked, so a target that keeps losing the sequence between
        # chunks makes it fail (UNAVAILABLE) instead of emitting a token at every resend.
        h = Harness(max_batch=2, max_waiting=2, target_blocks=6, draft_blocks=6, block_size=8, prefill_chunk=4)
        if how in ("error", "lost_for_good"):
            t = ScriptedTarget(6, 8, MAX_LEN, h.promised_t, script={1: "refuse" if how == "error" else "lose"})
            t.on_step = h._check_step
            h.target = h.loop.target = t
        h.start()
        stop = ()
        if how == "stop_token":
            stop = (greedy(make_seq(tok, 1, 8, 1).params.prompt_ids, 40)[5],)
        first, second = make_seq(tok, 1, 8, 40, stop=stop), make_seq(tok, 2, 8, 40)
        h.submit(first)
        await steps(h, 2)
        h.submit(second)
        await steps(h, 2)
        if how == "cancel_running":
            h.cancel(first)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, first, second
    h, first, second = run(main())
    assert not h.all_violations(), h.all_violations()
    assert_exact(h, second)
    end = h.ends.get(1)
    if how in ("finish", "stop_token"):
        assert_exact(h, first)
    elif how == "error":
        assert isinstance(end, Abort) and end.code == INVALID_ARGUMENT
    elif how == "lost_for_good":
        assert isinstance(end, Abort) and end.code == UNAVAILABLE
    else:
        assert end is None
    assert [s.seq_id for s in h.admitted] == [1, 2]


def test_draft_reservation_returns_when_the_draft_is_turned_off_for_a_sequence(tok):
    # Found by this review (fixed: Scheduler.drop_draft from SpecLoop._draft_failed): a sequence
    # whose draft failed kept its draft KV reservation until it ended.
    # SpecLoop._draft_failed (coordinator/spec_loop.py:319-325, "seq.use_draft = False",
    # release_draft.add) turns speculation off for the sequence for good and has the draft server
    # release it, but leaves seq.reserved_draft and Scheduler.reserved_draft untouched (only
    # Scheduler.retire, coordinator/scheduler.py:96, returns them). The same happens after a draft NOT_FOUND beyond
    # MAX_DRAFT_RESENDS and after the target refuses its draft fields. Until that request ends,
    # the draft capacity is neither used nor available: requests admitted meanwhile run without
    # speculation although the draft server has the room. Reproduce: draft KV for one request;
    # the draft fails for request 1 (per-sequence error); request 2 arrives while 1 still runs.
    # Expected: 2 is admitted with the draft (use_draft True). Actual: 2 decodes plainly, and
    # Scheduler.reserved_draft still counts 1's blocks.
    async def main():
        # the draft has room for a (110 tokens = 14 blocks) and nothing else
        h = Harness(max_batch=2, max_waiting=2, target_blocks=100, draft_blocks=14, block_size=8)
        h.start()
        a = make_seq(tok, 1, 10, 100)
        h.submit(a)
        await steps(h, 2)
        h.draft.err_p, h.draft.rng = 1.0, random.Random(0)
        await until(lambda: not a.use_draft)
        h.draft.err_p = 0.0
        await steps(h, 1)
        b = make_seq(tok, 2, 10, 20)
        h.submit(b)
        await until(lambda: 2 in h.ends)
        held = (h.sched.reserved_draft, b.use_draft)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, a, b, held
    h, a, b, (reserved_draft, b_drafted) = run(main())
    assert not h.all_violations(), h.all_violations()
    assert_exact(h, a)
    assert_exact(h, b)
    assert b_drafted, (f"request 2 ran without speculation; the scheduler still reserved {reserved_draft} "
                       f"draft blocks for request 1, whose draft was turned off")


def test_cancelled_running_request_is_released_at_the_next_boundary(tok):
    """A running request cancelled while its step is in flight gets nothing more (not even that
    step's tokens), leaves the batch at the next step boundary, and that next step carries its
    release; the draft lets it go too, and the other request is unaffected."""
    async def main():
        h = Harness(max_batch=2, max_waiting=2)
        a, b = make_seq(tok, 1, 6, 80), make_seq(tok, 2, 6, 60)
        marks = {}

        def on_step(request):
            h._check_step(request)
            if len(h.target.requests) == 4:  # inside the 4th step: the client goes away
                marks["index"], marks["out"] = len(h.target.requests), len(a.output)
                h.cancel(a)
        h.target.on_step = on_step
        h.start()
        h.submit(a)
        h.submit(b)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, a, b, marks
    h, a, b, marks = run(main())
    after = h.target.requests[marks["index"]]  # the step after the one the cancel came in
    assert 1 in after.release and [s.seq_id for s in after.seqs] == [2]
    assert len(a.output) == marks["out"] and 1 not in h.ends
    assert 1 not in h.target.held() and 1 not in h.draft.held()
    assert_exact(h, b)
    assert not h.all_violations(), h.all_violations()


def test_chunked_prefill_does_not_stall_the_others(tok):
    """Two requests decode; a 100-token prompt arrives with --prefill-chunk 16: it is fed 16
    tokens a step (the last 4 with the first decode), and every one of those steps also decodes
    both other requests, each a single new token (no step without their progress)."""
    async def main():
        h = Harness(max_batch=3, max_waiting=2, prefill_chunk=16, draft_blocks=None)
        h.start()
        a, b = make_seq(tok, 1, 5, 60), make_seq(tok, 2, 5, 60)
        h.submit(a)
        h.submit(b)
        await steps(h, 2)
        long = make_seq(tok, 3, 100, 5)
        h.submit(long)
        await h.finish()
        await h.settle()
        await h.stop()
        return h, (a, b, long)
    h, seqs = run(main())
    with_long = [r for r in h.target.requests if 3 in {s.seq_id for s in r.seqs}]
    fed = [len(unpack_ids(s.new_tokens)) for r in with_long for s in r.seqs if s.seq_id == 3]
    assert fed[:7] == [16] * 6 + [4] and set(fed[7:]) <= {1}
    for r in with_long[:7]:
        others = {s.seq_id: s for s in r.seqs if s.seq_id != 3}
        assert set(others) == {1, 2}
        assert all(not s.partial_prefill and len(unpack_ids(s.new_tokens)) == 1 for s in others.values())
    assert not h.all_violations(), h.all_violations()
    for s in seqs:
        assert_exact(h, s)


def test_draft_outage_keeps_reservations_and_releases_afterwards(tok):
    """The draft fails (call error) while requests run: they go on plainly, their reservations
    stay theirs, and a request finishing during the outage is released on the draft once it is
    back (no block stays held); nothing overflows when speculation resumes."""
    class FlakyDraft(KVDraft):
        down = False

        async def step(self, request, timeout=None, on_sent=None):
            if self.down:
                raise rpc_error()
            return await super().step(request, timeout)

    async def main():
        h = Harness(max_batch=3, max_waiting=2, target_blocks=30, draft_blocks=12, block_size=8)
        d = FlakyDraft(12, 8, MAX_LEN, h.promised_d)
        h.draft = h.loop.draft = d
        h.start()
        a, b = make_seq(tok, 1, 10, 12), make_seq(tok, 2, 10, 40)  # 3 + 7 of the draft's 12 blocks
        h.submit(a)
        h.submit(b)
        await steps(h, 2)
        d.down = True
        await until(lambda: not h.loop.draft_up)
        await until(lambda: 1 in h.ends)
        c = make_seq(tok, 3, 10, 30)
        h.submit(c)  # 5 blocks: a's draft reservation went back, c gets it
        await steps(h, 2)
        d.down = False
        await h.finish()
        await h.settle()
        await h.stop()
        return h, (a, b, c)
    h, seqs = run(main())
    assert seqs[2].use_draft and h.loop.draft_up
    assert not h.all_violations(), h.all_violations()
    for s in seqs:
        assert_exact(h, s)
