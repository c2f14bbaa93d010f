"""The coordinator's step loop against model servers that misbehave, in-process: a draft whose
proposals are malformed (the request degrades to plain decoding, with exactly its output), Release
calls that fail while the loop is idle (the ids are released later, with backoff, not dropped),
and a loop iteration or the whole loop task dying (every client gets INTERNAL, nobody hangs).

The fake servers share one deterministic "model" (next token = f(context)), so plain greedy
decoding has a known answer and a good draft is accepted."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from coordinator.app import Coordinator
from coordinator.config import CoordinatorConfig
from coordinator.scheduler import KVCapacity, Scheduler
from coordinator.sequence import Abort, Finish, GenParams, Sampling, Sequence
from coordinator.spec_loop import SpecLoop
from coordinator.tokenizer import TextTokenizer
from protos import specdec_pb2 as pb
from protos.wire import pack_ids, unpack_ids
from specdec.metrics import CoordinatorMetrics
from tests.helpers.fake_servers import QuietServer
from tests.helpers.tiny_models import _tokenizer_json

V = 320
MAX_LEN = 512
PROMPT = (5, 17, 42)
NEW = 24
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


def model(ctx: list[int]) -> int:
    return (ctx[-1] * 31 + len(ctx) * 7) % V


def plain_greedy(prompt, n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(model(ctx))
    return ctx[len(prompt):]


def rpc_error(code=grpc.StatusCode.UNAVAILABLE) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "fake server down")


class FakeServer(QuietServer):
    def __init__(self, role: str):
        self.role = role
        self.held: dict[int, list[int]] = {}
        self.release_failures = 0  # the next this many Release calls fail
        self.release_calls = 0

    async def release(self, seq_ids, timeout: float = 5.0):
        self.release_calls += 1
        if self.release_failures:
            self.release_failures -= 1
            raise rpc_error()
        for i in seq_ids:
            self.held.pop(i, None)
        return pb.ReleaseResponse()


class FakeTarget(FakeServer):
    """Verifies drafts greedily against model(); records anything a real target would refuse."""

    def __init__(self):
        super().__init__("target")
        self.violations: list[str] = []
        self.accepted = 0

    async def step(self, request: pb.VerifyRequest, timeout=None, on_sent=None) -> pb.VerifyResponse:
        await asyncio.sleep(0)  # a real call suspends: other tasks run between steps
        for i in request.release:
            self.held.pop(i, None)
        response = pb.VerifyResponse(step=request.step)
        for s in request.seqs:
            r = response.results.add(seq_id=s.seq_id)
            if not s.first and s.seq_id not in self.held:
                r.error.code, r.error.message = NOT_FOUND, "not held"
                continue
            ctx = [] if s.first else self.held[s.seq_id]
            ctx += unpack_ids(s.new_tokens)
            self.held[s.seq_id] = ctx
            drafts = unpack_ids(s.draft_tokens)
            if any(not 0 <= d < V for d in drafts):
                self.violations.append(f"draft ids {drafts}")
            if s.HasField("draft_probs") and s.draft_probs.encoding:
                p = s.draft_probs
                if (p.rows, p.vocab_size, len(p.values)) != (len(drafts), V, 2 * len(drafts) * V):
                    self.violations.append(f"probs {p.rows} x {p.vocab_size} for {len(drafts)} drafts")
                else:  # each draft was drawn from its row: its weight there is > 0
                    w = np.frombuffer(p.values, dtype="<f2").reshape(len(drafts), V)
                    if any(w[i, d] <= 0 for i, d in enumerate(drafts) if 0 <= d < V):
                        self.violations.append(f"a draft of {drafts} has no weight in its row")
            elif s.sampling.temperature > 0 and drafts:
                self.violations.append("sampled drafts without probs")
            if s.partial_prefill:
                continue
            self.accepted += verify_greedily(ctx, drafts, r)
        return response


def verify_greedily(ctx: list[int], drafts: list[int], r: pb.VerifyResult) -> int:
    """What a greedy target does with one sequence's drafts against model(): the accepted ones go
    onto ctx, r gets accepted and next_token; returns accepted."""
    for d in drafts:
        if d != model(ctx):
            break
        ctx.append(d)
        r.accepted += 1
    r.next_token = model(ctx)
    return r.accepted


def one_hot(tokens: list[int]) -> pb.Probs:
    w = np.zeros((len(tokens), V), dtype="<f2")
    w[np.arange(len(tokens)), tokens] = 1
    return pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=len(tokens), vocab_size=V,
                    values=w.tobytes())


class FakeDraft(FakeServer):
    """Drafts draft_model()'s continuation (model()'s by default, so it is accepted), then applies
    `spoil` to the result. Holds (confirmed tokens, proposal) per sequence, as the real draft."""

    def __init__(self, spoil=None, draft_model=model, delay: float = 0.0, max_num_draft: int = 0):
        super().__init__("draft")
        self.spoil = spoil
        self.draft_model = draft_model
        self.delay = delay  # seconds each step takes (a draft slower than the target's answer)
        self.max_num_draft = max_num_draft  # > 0: more is refused (INVALID_ARGUMENT), as the engine does
        self.proposals: dict[int, tuple[list[int], list[int]]] = {}
        self.requests: list[pb.ProposeRequest] = []
        self.violations: list[str] = []
        self.longest: dict[int, int] = {}  # per sequence: the most tokens it held (KV reservation)
        self.in_flight = 0

    async def step(self, request: pb.ProposeRequest, timeout=None, on_sent=None) -> pb.ProposeResponse:
        self.requests.append(request)
        self.in_flight += 1
        try:
            if self.in_flight > 1:
                self.violations.append(f"step {request.step} sent while another was in flight")
            if self.delay:
                await asyncio.sleep(self.delay)
            return self._answer(request)
        finally:
            self.in_flight -= 1

    def _answer(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        for i in request.release:
            self.held.pop(i, None)
            self.proposals.pop(i, None)
        response = pb.ProposeResponse(step=request.step)
        for s in request.seqs:
            r = response.results.add(seq_id=s.seq_id)
            if self.max_num_draft and s.num_draft > self.max_num_draft:
                r.error.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                r.error.message = f"num_draft: {s.num_draft} outside 0..{self.max_num_draft}"
                continue
            if s.first:
                ctx, rest = [], []
            elif s.seq_id in self.held:
                before, proposal = self.proposals.get(s.seq_id, (self.held[s.seq_id], []))
                if not 0 <= s.keep <= len(proposal):
                    self.violations.append(f"keep {s.keep} of a proposal of {len(proposal)}")
                ctx = before + proposal[:s.keep]
                rest = proposal[s.keep:] if s.extend else []
                if s.extend and s.new_tokens:
                    self.violations.append("new_tokens with extend")
            else:
                r.error.code, r.error.message = NOT_FOUND, "not held"
                continue
            ctx = ctx + unpack_ids(s.new_tokens)
            self.held[s.seq_id] = ctx
            tokens = []
            for _ in range(s.num_draft):
                tokens.append(self.draft_model(ctx + rest + tokens))
            self.proposals[s.seq_id] = (ctx, rest + tokens)
            self.longest[s.seq_id] = max(self.longest.get(s.seq_id, 0), len(ctx + rest + tokens))
            r.tokens = pack_ids(tokens)
            if s.sampling.temperature > 0:
                r.probs.CopyFrom(one_hot(tokens))
            if self.spoil is not None:
                self.spoil(r, s)
        return response


def tokenizer(tmp_path) -> TextTokenizer:
    path = tmp_path / "tokenizer.json"
    path.write_text(_tokenizer_json(V))
    return TextTokenizer(path)


def config(**kw) -> CoordinatorConfig:
    return CoordinatorConfig(target="fake:1", draft="fake:2", num_draft=4, draft_retry_s=0.05, **kw)


def target_info() -> pb.ModelInfo:
    return pb.ModelInfo(vocab_size=V, max_model_len=MAX_LEN, kv_blocks_total=1000, block_size=16)


def make_loop(draft: FakeDraft | None, target: FakeTarget | None = None, **config_kw):
    target = target or FakeTarget()
    sched = Scheduler(8, 8, KVCapacity("target", 1000, 16), KVCapacity("draft", 1000, 16))

    async def check_draft():
        return None

    metrics = CoordinatorMetrics(CollectorRegistry(), max_positions=8)
    loop = SpecLoop(config(**config_kw), sched, target, draft, metrics, vocab_size=V, draft_max_len=MAX_LEN,
                    check_draft=check_draft if draft is not None else None)
    return loop, sched, target


def new_seq(tok, seq_id: int, temperature: float = 0.0, speculate: bool = True,
            max_new_tokens: int = NEW) -> Sequence:
    params = GenParams(request_id=str(seq_id), prompt_ids=PROMPT, max_new_tokens=max_new_tokens,
                       sampling=Sampling(temperature=temperature, seed=seq_id), speculate=speculate)
    return Sequence(seq_id=seq_id, params=params, max_len=MAX_LEN, tokenizer=tok)


async def collect(seq: Sequence, timeout: float = 10.0) -> tuple[list[int], object]:
    """The sequence's tokens and how it ended: a Finish, or the Abort."""
    tokens = []
    while True:
        item = await asyncio.wait_for(seq.queue.get(), timeout)
        if isinstance(item, Abort):
            return tokens, item
        tokens += item.token_ids
        if item.finish is not None:
            return tokens, item.finish


async def until(cond, timeout: float = 5.0) -> None:
    async def poll():
        while not cond():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout)


def spoil_out_of_vocab(r, s):
    r.tokens = pack_ids([V + 3] * s.num_draft)


def spoil_negative(r, s):
    r.tokens = pack_ids([-1] * s.num_draft)


def spoil_count(r, s):
    r.tokens = pack_ids(unpack_ids(r.tokens)[:-1])


def spoil_extra(r, s):
    r.tokens = pack_ids(unpack_ids(r.tokens) + [1])


def spoil_bytes(r, s):
    r.tokens = r.tokens + b"\x01"


def spoil_rows(r, s):
    r.probs.CopyFrom(one_hot(unpack_ids(r.tokens)[:-1]))


def spoil_vocab(r, s):
    r.probs.vocab_size = V + 64


def spoil_values(r, s):
    r.probs.values = r.probs.values[:-2]


def spoil_no_probs(r, s):
    r.ClearField("probs")


def spoil_greedy_probs(r, s):
    # A greedy sequence may get probabilities, but they must describe the drafts.
    r.probs.CopyFrom(one_hot(unpack_ids(r.tokens) + [0]))


def spoil_seq_id(r, s):
    r.seq_id = s.seq_id + 1000


# Each spoil breaks the sampled sequence's proposal; these also break the greedy one's (the others
# touch only probabilities, which a greedy proposal without them does not have).
SPOILS = [spoil_out_of_vocab, spoil_negative, spoil_count, spoil_extra, spoil_bytes, spoil_rows,
          spoil_vocab, spoil_values, spoil_no_probs, spoil_greedy_probs, spoil_seq_id]
GREEDY_TOO = {spoil_out_of_vocab, spoil_negative, spoil_count, spoil_extra, spoil_bytes, spoil_rows,
              spoil_greedy_probs, spoil_seq_id}


def run_batch(tmp_path, draft: FakeDraft, temperatures=(0.0, 0.7), target: FakeTarget | None = None):
    async def main():
        loop, sched, target_ = make_loop(draft, target)
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        seqs = [new_seq(tok, i + 1, t) for i, t in enumerate(temperatures)]
        for seq in seqs:
            sched.submit(seq)
        try:
            results = await asyncio.gather(*(collect(s) for s in seqs))
        finally:
            task.cancel()
        return results, seqs, target_
    return asyncio.run(main())


def test_good_draft_is_accepted(tmp_path):
    """The harness itself: the fake draft's proposals are accepted and the output is exact."""
    results, seqs, target = run_batch(tmp_path, FakeDraft())
    for tokens, end in results:
        assert tokens == plain_greedy(PROMPT, NEW) and end == Finish.LENGTH
    assert target.accepted > NEW and not target.violations
    assert all(seq.use_draft for seq in seqs)


@pytest.mark.parametrize("spoil", SPOILS, ids=lambda f: f.__name__.removeprefix("spoil_"))
def test_malformed_proposal_degrades_to_plain_decoding(tmp_path, spoil):
    results, seqs, target = run_batch(tmp_path, FakeDraft(spoil))
    for tokens, end in results:
        assert end == Finish.LENGTH  # no Abort reached the client
        assert tokens == plain_greedy(PROMPT, NEW)
    assert not target.violations  # nothing malformed reached the target
    greedy, sampled = seqs
    assert not sampled.use_draft  # its draft failed once: plain decoding from then on
    assert greedy.use_draft is (spoil not in GREEDY_TOO)


def test_idle_release_failure_is_retried(tmp_path):
    """A finished request's Release fails while the loop is idle: its ids are kept and released
    on a later try (target: after a backoff; draft: once the draft is found again)."""
    async def main():
        draft = FakeDraft()
        loop, sched, target = make_loop(draft)
        target.release_failures = draft.release_failures = 1
        task = asyncio.create_task(loop.run())
        seq = new_seq(tokenizer(tmp_path), 1)
        sched.submit(seq)
        tokens, end = await collect(seq)
        assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW)
        await until(lambda: not target.held and not draft.held)
        assert target.release_calls == 2 and draft.release_calls == 2
        assert not sched.release_target and not sched.release_draft and not loop.draft_orphans
        assert loop.draft_up
        task.cancel()
    asyncio.run(main())


def test_release_retry_backs_off(tmp_path):
    """A target that refuses every Release is not hammered by the idle loop; a new request still
    runs, and its steps carry the pending release."""
    async def main():
        loop, sched, target = make_loop(None)
        target.release_failures = 10**6
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        first = new_seq(tok, 1, speculate=False)
        sched.submit(first)
        assert (await collect(first))[1] == Finish.LENGTH
        await asyncio.sleep(1.6)  # tries at ~0, 0.5, 1.5 s
        assert 2 <= target.release_calls <= 4
        assert 1 in target.held and sched.release_target == {1}
        second = new_seq(tok, 2, speculate=False)
        sched.submit(second)
        assert (await collect(second))[1] == Finish.LENGTH
        assert 1 not in target.held  # went in the second request's first step
        task.cancel()
    asyncio.run(main())


def test_failing_iteration_fails_requests_and_loop_goes_on(tmp_path):
    """An exception outside _step (here: admit) ends the running and waiting requests with
    INTERNAL instead of killing the loop; later requests are served."""
    async def main():
        loop, sched, target = make_loop(FakeDraft())
        admit = sched.admit
        calls = {"n": 0}

        def failing_admit():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("admit broke")
            return admit()
        sched.admit = failing_admit
        tok = tokenizer(tmp_path)
        victim = new_seq(tok, 1)
        sched.submit(victim)
        task = asyncio.create_task(loop.run())
        tokens, end = await collect(victim, timeout=5)
        assert isinstance(end, Abort) and end.code == grpc.StatusCode.INTERNAL.value[0]
        assert "admit broke" in end.message
        survivor = new_seq(tok, 2)
        sched.submit(survivor)
        tokens, end = await collect(survivor)
        assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW)
        task.cancel()
    asyncio.run(main())


class LoopKilled(BaseException):
    """Escapes the loop's own `except Exception`: the task dies."""


def test_dead_loop_task_fails_every_client(tmp_path):
    async def main():
        target, draft = FakeTarget(), FakeDraft()
        coord = Coordinator(config(max_batch_size=1), tokenizer(tmp_path), target, draft,
                            target_info(), target_info(), CoordinatorMetrics(CollectorRegistry()))
        failures = []

        async def on_failure(message):
            failures.append(message)
        step = coord.loop._step
        running, waiting = coord.new_sequence(gen_params()), coord.new_sequence(gen_params())

        async def dying_step(seqs, started):
            if running.output:  # one step done; `waiting` is queued behind it (batch size 1)
                raise LoopKilled("gone")
            await step(seqs, started)
        coord.loop._step = dying_step
        coord.scheduler.submit(running)
        coord.scheduler.submit(waiting)
        coord.start(on_failure=on_failure)
        for seq in (running, waiting):
            _, end = await collect(seq, timeout=5)
            assert isinstance(end, Abort) and end.code == grpc.StatusCode.INTERNAL.value[0]
        await until(lambda: failures)
        assert coord.failure and "LoopKilled" in coord.failure
        await coord.close()
    asyncio.run(main())


def gen_params() -> GenParams:
    return GenParams(request_id="r", prompt_ids=PROMPT, max_new_tokens=NEW, sampling=Sampling())


def test_steps_above_spec_max_batch_decode_plainly(tmp_path):
    """--spec-max-batch 2: while three sequences run, no step drafts; once one has finished the
    other two draft again, the draft catching up on the tokens it missed; every output is exact."""
    class CountingDraft(FakeDraft):
        def __init__(self):
            super().__init__()
            self.batches: list[int] = []

        async def step(self, request, timeout=None, on_sent=None):
            self.batches.append(len(request.seqs))
            return await super().step(request, timeout)

    draft = CountingDraft()

    async def main():
        loop, sched, target = make_loop(draft, spec_max_batch=2)
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        seqs = [new_seq(tok, 1, max_new_tokens=6), new_seq(tok, 2), new_seq(tok, 3, temperature=0.7)]
        for seq in seqs:
            sched.submit(seq)
        try:
            return await asyncio.gather(*(collect(s) for s in seqs)), target
        finally:
            task.cancel()

    results, target = asyncio.run(main())
    assert [tokens for tokens, _ in results] == [plain_greedy(PROMPT, 6), plain_greedy(PROMPT, NEW),
                                                 plain_greedy(PROMPT, NEW)]
    assert draft.batches and max(draft.batches) <= 2     # nothing drafted while three ran
    assert target.accepted > 0 and not target.violations  # and the proposals after it were good


def test_spec_max_batch_on_the_command_line():
    from coordinator.__main__ import parse_args
    from coordinator.config import ConfigError
    assert parse_args(["--target", "t:1", "--spec-max-batch", "4"]).spec_max_batch == 4
    assert parse_args(["--target", "t:1"]).spec_max_batch == 0   # no limit by default
    with pytest.raises(ConfigError, match="spec_max_batch"):
        CoordinatorConfig(target="t:1", spec_max_batch=-1)


class RefusingTarget(FakeTarget):
    """Refuses, as INVALID_ARGUMENT with `message` and without touching the sequence, every
    sequence whose draft probabilities hold a NaN (what the real target's decode_probs does with
    the dense rows the coordinator does not scan); `always`: every sequence with drafts."""

    def __init__(self, message: str, always: bool = False):
        super().__init__()
        self.message, self.always, self.refused = message, always, 0

    async def step(self, request, timeout=None, on_sent=None):
        bad = set()
        for i, s in enumerate(request.seqs):
            p = s.draft_probs
            nan = p.encoding and np.isnan(np.frombuffer(p.values, dtype="<f2")).any()
            if (nan or (self.always and s.draft_tokens)):
                bad.add(i)
        keep = pb.VerifyRequest(step=request.step, release=request.release,
                                seqs=[s for i, s in enumerate(request.seqs) if i not in bad])
        answered = iter((await super().step(keep)).results)
        response = pb.VerifyResponse(step=request.step)
        for i, s in enumerate(request.seqs):
            if i in bad:
                self.refused += 1
                r = response.results.add(seq_id=s.seq_id, next_token=-1)
                r.error.code, r.error.message = grpc.StatusCode.INVALID_ARGUMENT.value[0], self.message.format(i=i)
            else:
                response.results.add().CopyFrom(next(answered))
        return response


def spoil_nan(r, s):
    if r.HasField("probs"):
        w = np.frombuffer(r.probs.values, dtype="<f2").copy()
        w[0] = np.nan
        r.probs.values = w.tobytes()


@pytest.mark.parametrize("message", ["seqs[{i}].draft_probs.values: must be finite and >= 0",
                                     "draft_probs: mass on ids outside the target vocabulary of 320",
                                     "draft_tokens: 9 outside 0..8"])
def test_drafts_the_target_refuses_degrade_to_plain_decoding(tmp_path, message):
    """The coordinator does not scan dense draft rows; the target refuses a NaN there for that
    sequence (INVALID_ARGUMENT naming the draft's field). That is the draft failing, not the
    request: the sequence goes on by plain decoding with exactly its output, the other one is
    untouched, and the draft server is told to release it."""
    target = RefusingTarget(message)
    draft = FakeDraft(spoil_nan)
    results, (greedy, sampled), _ = run_batch(tmp_path, draft, target=target)
    for tokens, end in results:
        assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW)
    assert target.refused == 1 and not target.violations
    assert greedy.use_draft and not sampled.use_draft
    assert sampled.seq_id not in draft.held  # released on the draft


def test_other_refusals_still_fail_the_request(tmp_path):
    """A refusal of what the request itself sent (not a draft field) still ends it with that status."""
    target = RefusingTarget("new_tokens: token id 999 outside the vocabulary", always=True)
    results, _, _ = run_batch(tmp_path, FakeDraft(), (0.0,), target)
    (tokens, end), = results
    assert isinstance(end, Abort) and end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "new_tokens" in end.message


def test_prefill_chunk_bounds_the_prompt_tokens_of_a_whole_step(tmp_path):
    """--prefill-chunk is the step's budget of prompt tokens, all joining prompts together (three
    100-token prompts at chunk 16 put 48 in one step before): every step stays within it, the
    first prompt in the batch always gets some, a decoding sequence takes part in every step, and
    every output is exact."""
    prompts = {i: tuple((7 * i + j) % V for j in range(100)) for i in (2, 3, 4)}

    async def main():
        loop, sched, target = make_loop(FakeDraft(), prefill_chunk=16)
        fed, real_step = [], target.step

        async def step(request, timeout=None, on_sent=None):
            fed.append({s.seq_id: len(unpack_ids(s.new_tokens)) for s in request.seqs})
            return await real_step(request, timeout)
        target.step = step
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        first = new_seq(tok, 1, max_new_tokens=300)
        sched.submit(first)
        while not fed:
            await asyncio.sleep(0)
        seqs = [first]
        for i, p in prompts.items():
            params = GenParams(request_id=str(i), prompt_ids=p, max_new_tokens=8, sampling=Sampling(seed=i))
            seqs.append(Sequence(seq_id=i, params=params, max_len=MAX_LEN, tokenizer=tok))
            sched.submit(seqs[-1])
        try:
            results = await asyncio.gather(*(collect(s) for s in seqs))
        finally:
            task.cancel()
        return fed, results
    fed, results = asyncio.run(main())
    assert results[0][0] == plain_greedy(PROMPT, 300)
    for (tokens, end), i in zip(results[1:], prompts):
        assert end == Finish.LENGTH and tokens == plain_greedy(prompts[i], 8)
    prompt_steps = [f for f in fed if any(n > 1 and k in prompts for k, n in f.items())]
    assert len(prompt_steps) >= 300 // 16
    for f in prompt_steps:
        assert sum(n for k, n in f.items() if k in prompts and n > 1) <= 16, f  # 1: decoding already
        assert 1 in f  # the decoding request is in every step


def test_a_draft_back_with_other_limits_is_taken_at_its_word(tmp_path):
    """A draft server that comes back (after a restart) with a smaller KV and a shorter
    max_model_len: the coordinator reserves against the new limits, so a request the new draft
    cannot hold runs by plain decoding instead of being refused by it step after step."""
    async def main():
        target, draft = FakeTarget(), FakeDraft()
        coord = Coordinator(config(), tokenizer(tmp_path), target, draft, target_info(), target_info(),
                            CoordinatorMetrics(CollectorRegistry()))
        smaller = pb.ModelInfo(vocab_size=V, max_model_len=MAX_LEN // 2, kv_blocks_total=1, block_size=16)

        async def info(timeout=None):
            return smaller
        draft.info = info
        await coord._check_draft()
        assert coord.scheduler.draft.blocks_total == 1 and coord.loop.draft_max_len == MAX_LEN // 2
        seq = coord.new_sequence(gen_params())        # 3 + 24 tokens: two blocks of 16
        coord.scheduler.submit(seq)
        assert coord.scheduler.admit() == [seq] and not seq.use_draft
        await coord.close()
    asyncio.run(main())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_long_prompt_reaches_the_draft_in_chunks_beside_decoding_sequences(tmp_path, temperature):
    """A 100-token prompt joins while another sequence decodes, --prefill-chunk 16: the draft gets
    the prompt chunk by chunk (appends, num_draft 0) in the Proposes the decoding sequence sends
    anyway, not all at once in the prompt's last step; both outputs stay exact."""
    async def main():
        draft = FakeDraft()
        loop, sched, target = make_loop(draft, prefill_chunk=16)
        tok = tokenizer(tmp_path)
        first = new_seq(tok, 1, max_new_tokens=80)   # 3 prompt tokens: decoding from the first step
        prompt = tuple((7 * i + 3) % V for i in range(100))
        params = GenParams(request_id="2", prompt_ids=prompt, max_new_tokens=NEW,
                           sampling=Sampling(temperature=temperature, seed=2), speculate=True)
        joining = Sequence(seq_id=2, params=params, max_len=MAX_LEN, tokenizer=tok)
        sched.submit(first)
        sched.submit(joining)
        task = asyncio.create_task(loop.run())
        got, end = await collect(joining)
        assert end == Finish.LENGTH and got == plain_greedy(prompt, NEW)
        got, end = await collect(first)
        assert end == Finish.LENGTH and got == plain_greedy(PROMPT, 80)
        fed = [(s.num_draft, unpack_ids(s.new_tokens)) for r in draft.requests for s in r.seqs if s.seq_id == 2]
        appended = [tokens for k, tokens in fed if k == 0]
        assert len(appended) >= 3 and all(len(t) <= 16 for t in appended)
        assert [t for tokens, in zip(appended) for t in tokens] == list(prompt[:sum(map(len, appended))])
        assert max(len(tokens) for _, tokens in fed) <= 16
        assert not draft.violations and not target.violations
        task.cancel()
    asyncio.run(main())


class RestartingTarget(FakeTarget):
    """A target whose step fails once (a crash mid-step); it answers Info afterwards with `back`
    (a restart under other flags, or with another model) and forgets every sequence."""

    def __init__(self, back: pb.ModelInfo, fail_at_step: int = 3):
        super().__init__()
        self.back, self.fail_at_step, self.steps = back, fail_at_step, 0
        self.seen_after_restart: list = []  # the sequences of every Verify after the crash

    async def step(self, request, timeout=None, on_sent=None):
        self.steps += 1
        if self.steps == self.fail_at_step:
            self.held.clear()
            raise rpc_error()
        if self.steps > self.fail_at_step:
            self.seen_after_restart += request.seqs
        return await super().step(request, timeout)

    async def wait_ready(self, timeout: float):
        return self.back


@pytest.mark.parametrize("same_model", [True, False])
def test_a_target_back_after_a_crash_is_read_afresh(tmp_path, same_model):
    """Same model with a smaller KV and a lower --max-num-draft: the coordinator takes the new limits
    (reservations, drafts per step) and the request completes exactly. Another vocabulary: the
    request fails with FAILED_PRECONDITION naming the change, instead of going on against it, and
    the coordinator stops serving."""
    async def main():
        back = pb.ModelInfo(vocab_size=V if same_model else V + 1, max_model_len=MAX_LEN, kv_blocks_total=40,
                            block_size=16, max_num_draft=2, model_name="restarted")
        target, draft = RestartingTarget(back), FakeDraft()
        coord = Coordinator(config(), tokenizer(tmp_path), target, draft, target_info(), target_info(),
                            CoordinatorMetrics(CollectorRegistry()))
        seq = coord.new_sequence(gen_params())
        coord.scheduler.submit(seq)
        stopped = []

        async def on_failure(message):
            stopped.append(message)
        coord.start(on_failure=on_failure)
        tokens, end = await collect(seq)
        if same_model:
            assert end == Finish.LENGTH and tokens == plain_greedy(PROMPT, NEW) and not stopped
            assert coord.scheduler.target.blocks_total == 40 and coord.loop.target_max_num_draft == 2
            assert max(len(unpack_ids(s.draft_tokens)) for s in target.seen_after_restart) <= 2
        else:
            assert isinstance(end, Abort) and end.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            assert "another model" in end.message and coord.scheduler.target.blocks_total == 1000
            await until(lambda: stopped)    # NOT_SERVING: new requests are refused (service.py)
            assert coord.failure and "another model" in coord.failure and "another model" in stopped[0]
        await coord.close()
    asyncio.run(main())


class _FailsOnce(FakeDraft):
    """Its call number `fail_at` takes `hang` seconds, then fails (a draft timing out)."""

    def __init__(self, fail_at: int, hang: float):
        super().__init__()
        self.calls, self.fail_at, self.hang = 0, fail_at, hang

    async def step(self, request, timeout=None, on_sent=None):
        self.calls += 1
        if self.calls == self.fail_at:
            await asyncio.sleep(self.hang)
            raise rpc_error()
        return await super().step(request, timeout, on_sent)


def test_a_step_whose_propose_failed_is_no_plain_step(tmp_path):
    """The step whose Propose failed verifies no drafts, but its time holds the draft's timeout:
    the loop tells the statistics it was to speculate, so the plain step time (c_system's and the
    measured speedup's denominator) comes from the steps that decoded plainly while the draft was
    down, not from it."""
    hang = 0.3
    loop, sched, _ = make_loop(_FailsOnce(fail_at=3, hang=hang))
    observed = []
    real = loop.metrics.observe_step

    def spy(drafted, accepted, emitted=None, **kw):
        observed.append((tuple(drafted), kw.get("planned_spec"), kw["step_seconds"]))
        return real(drafted, accepted, emitted, **kw)
    loop.metrics.observe_step = spy

    async def run():
        task = asyncio.create_task(loop.run())
        seq = new_seq(tokenizer(tmp_path), 1, max_new_tokens=60)
        sched.submit(seq)
        tokens, end = await collect(seq)
        task.cancel()
        return tokens, end
    tokens, end = asyncio.run(run())
    assert tokens == plain_greedy(PROMPT, 60) and end is not None
    failed = [o for o in observed if o[2] >= hang]
    assert len(failed) == 1 and failed[0][:2] == ((0,), True), observed
    assert any(o[:2] == ((0,), False) for o in observed)      # plain steps while the draft was down
    plain = loop.metrics.stats.plain_step_seconds(1)
    assert plain is not None and plain < hang / 10, plain
