"""The coordinator's critical-path cuts (session 23): what they must keep.

- ModelServer's step deadlines (coordinator/servers.py StepDeadlines: one timer for many steps
  instead of asyncio.wait_for's timer per call) time a step out at its own deadline, also after
  many quick steps armed the timer for an earlier one, and in a second event loop; a caller's
  own cancellation stays a CancelledError, and a timed-out task is not left cancelled.
- The rpc histogram is still observed once per step (deferred to the caller's next wait).
- Sequence.emit's shortcut (no finishing id in the step and budget left after it), draft_proposed
  and draft_confirm give what the per-token code before them gave.
- The running-sequences gauge is set when it changes only, and ends where len(running) is.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from prometheus_client import CollectorRegistry

from coordinator.sequence import Finish, GenParams, Proposed, Sampling, Sequence
from coordinator.servers import ModelServer, StepDeadlines
from protos import specdec_pb2 as pb
from specdec.metrics import CoordinatorMetrics
from tests.unit.test_spec_loop_faults import PROMPT, FakeDraft, collect, make_loop, new_seq, plain_greedy, tokenizer


# --- step deadlines -----------------------------------------------------------------------------
class HangingCall:
    """A step call whose answer takes `hang` seconds (None: never)."""

    def __init__(self, owner: "Server"):
        self.owner = owner

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass

    async def write(self, request) -> None:
        self.step = request.step

    async def read(self):
        hang = self.owner.hang
        await asyncio.sleep(3600 if hang is None else hang)
        return pb.VerifyResponse(step=self.step)


class Server(ModelServer):
    def __init__(self, metrics=None):
        super().__init__("target", "127.0.0.1:1", metrics, step_channel=False)
        self.hang: float | None = 0.0

    def _new_call(self, timeout=None):
        return HangingCall(self)


def test_a_step_times_out_at_its_own_deadline_after_quick_steps():
    """Quick steps arm the timer for the first one's deadline; a later step that hangs must not
    time out at that earlier deadline (the timer re-arms) nor go on past its own."""
    async def main():
        ms = Server()
        for i in range(20):  # 20 quick steps over ~0.2 s, each with a 0.5 s timeout
            await ms.step(pb.VerifyRequest(step=i + 1), timeout=0.5)
            await asyncio.sleep(0.01)
        ms.hang = None
        t0 = time.perf_counter()
        with pytest.raises(asyncio.TimeoutError):
            await ms.step(pb.VerifyRequest(step=99), timeout=0.5)
        took = time.perf_counter() - t0
        task = asyncio.current_task()
        assert task.cancelling() == 0     # the timeout's cancellation was taken back
        await asyncio.sleep(0.01)          # ... so the task goes on
        ms.hang = 0.0
        assert (await ms.step(pb.VerifyRequest(step=100), timeout=0.5)).step == 100
        await ms.close()
        return took
    took = asyncio.run(asyncio.wait_for(main(), 10))
    assert 0.45 <= took < 1.5, took


def test_a_slow_step_within_its_deadline_is_answered():
    async def main():
        ms = Server()
        ms.hang = 0.15
        r = await ms.step(pb.VerifyRequest(step=3), timeout=0.3)
        await ms.close()
        return r
    assert asyncio.run(main()).step == 3


def test_the_callers_cancellation_stays_a_cancellation():
    """Cancelled from outside while in flight: CancelledError (not TimeoutError, not the
    StreamBroken of a call cancelled under the step)."""
    async def main():
        ms = Server()
        ms.hang = None
        task = asyncio.create_task(ms.step(pb.VerifyRequest(step=1), timeout=5.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await ms.close()
    asyncio.run(main())


def test_a_cancellation_at_the_deadline_wins_over_the_timeout():
    """The deadline and a cancellation from outside in the same loop iteration (the timer first):
    CancelledError, as asyncio.timeout gives."""
    deadlines = StepDeadlines()

    async def main():
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.02
        task = asyncio.create_task(deadlines.run(asyncio.sleep(3600), loop, deadline))
        await asyncio.sleep(0)            # the task registers its deadline and waits
        loop.call_at(deadline + 0.001, task.cancel)
        time.sleep(0.05)                  # both timers are due at the next iteration, in this order
        with pytest.raises(asyncio.CancelledError):
            await task
        # the same without the cancellation: the timeout
        task = asyncio.create_task(deadlines.run(asyncio.sleep(3600), loop, loop.time() + 0.02))
        await asyncio.sleep(0)
        time.sleep(0.05)
        with pytest.raises(TimeoutError):
            await task
    asyncio.run(main())


def test_deadlines_in_a_second_event_loop():
    """The timer of a loop that is gone never fires: a step in a new loop arms its own."""
    deadlines = StepDeadlines()

    async def hang():
        await asyncio.sleep(3600)

    async def quick():
        return 7

    async def first():
        loop = asyncio.get_running_loop()
        assert await deadlines.run(quick(), loop, loop.time() + 0.2) == 7  # arms a timer in this loop

    async def second():
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            await deadlines.run(hang(), loop, loop.time() + 0.3)
        return time.perf_counter() - t0
    asyncio.run(first())
    took = asyncio.run(asyncio.wait_for(second(), 5))
    assert 0.25 <= took < 2


def test_a_step_that_swallows_its_timeout_leaves_the_task_uncancelled():
    """As asyncio.timeout: an expired deadline whose cancellation the awaited code swallowed is
    taken back, so the task's later awaits are not cancelled."""
    deadlines = StepDeadlines()

    async def swallowing():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return 5

    async def main():
        loop = asyncio.get_running_loop()
        got = await deadlines.run(swallowing(), loop, loop.time() + 0.05)
        task = asyncio.current_task()
        cancelling = task.cancelling()
        await asyncio.sleep(0.01)
        return got, cancelling
    assert asyncio.run(asyncio.wait_for(main(), 10)) == (5, 0)


def test_two_steps_in_flight_each_keep_their_deadline():
    """(The loop sends one step at a time per server; the deadlines hold regardless.)"""
    deadlines = StepDeadlines()

    async def main():
        loop = asyncio.get_running_loop()

        async def guarded(timeout):
            t0 = time.perf_counter()
            try:
                await deadlines.run(asyncio.sleep(3600), loop, loop.time() + timeout)
            except TimeoutError:
                return time.perf_counter() - t0
        return await asyncio.gather(guarded(0.4), guarded(0.1))
    late, early = asyncio.run(asyncio.wait_for(main(), 10))
    assert 0.08 <= early < 0.3 and 0.35 <= late < 1.0


def test_rpc_histogram_observed_once_per_step_after_the_callers_next_wait():
    async def main():
        metrics = CoordinatorMetrics(CollectorRegistry(), max_positions=8)
        ms = Server(metrics)
        ms.hang = 0.02
        child = metrics._child("specdec_rpc_seconds", role="coordinator", rpc="Verify")
        t0 = time.perf_counter()
        await ms.step(pb.VerifyRequest(step=1), timeout=5)
        took = time.perf_counter() - t0
        await asyncio.sleep(0)
        count = metrics.registry.get_sample_value("specdec_rpc_seconds_count",
                                                  {"role": "coordinator", "rpc": "Verify"})
        await ms.close()
        return count, child._sum.get(), took
    count, total, took = asyncio.run(main())
    assert count == 1 and 0.02 <= total <= took


# --- sequence bookkeeping: the same as the per-token code ---------------------------------------
def old_emit_ids(seq: Sequence, tokens: list[int]):
    """Sequence._emit_ids' cut before the shortcut (every token through _token_finish)."""
    budget = seq.remaining
    finish, n = None, len(tokens)
    for i, tok in enumerate(tokens):
        finish = seq._token_finish(tok, budget - (i + 1))
        if finish is not None:
            n = i + 1
            break
    return list(tokens[:n]), finish


def test_emit_shortcut_matches_the_per_token_cut(tmp_path):
    tok = tokenizer(tmp_path)
    rng = random.Random(7)
    seen, shortcuts = set(), 0
    for trial in range(400):
        stop, eos = frozenset(rng.sample(range(20), rng.randint(0, 2))), frozenset(rng.sample(range(20), rng.randint(0, 2)))
        params = GenParams(request_id="x", prompt_ids=PROMPT, max_new_tokens=rng.randint(1, 12), sampling=Sampling(),
                           stop_token_ids=stop, eos_token_ids=eos)
        a = Sequence(seq_id=1, params=params, max_len=rng.choice([10, 512]), tokenizer=tok)
        b = Sequence(seq_id=1, params=params, max_len=a.max_len, tokenizer=tok)
        while not a.done:
            step = [rng.randrange(20) for _ in range(rng.randint(1, 6))]
            shortcuts += len(step) < b.remaining and not (stop | eos) & set(step)
            want_ids, want_finish = old_emit_ids(b, step)
            b.output.extend(want_ids)
            chunk = a.emit(step)
            assert (chunk.token_ids, chunk.finish) == (want_ids, want_finish), (trial, step)
            assert a.output == b.output
            if chunk.finish is not None:
                seen.add(chunk.finish)
                break
    # what the comparison covered: every way to finish, and steps that took the shortcut
    assert seen == {Finish.STOP, Finish.EOS, Finish.LENGTH} and shortcuts > 100


def test_emit_shortcut_follows_params_replaced(tmp_path):
    """The finishing ids are cached per params object: a sequence given new params uses theirs."""
    tok = tokenizer(tmp_path)
    params = GenParams(request_id="x", prompt_ids=PROMPT, max_new_tokens=50, sampling=Sampling())
    seq = Sequence(seq_id=1, params=params, max_len=512, tokenizer=tok)
    assert seq.emit([3, 4]).finish is None
    seq.params = GenParams(request_id="x", prompt_ids=PROMPT, max_new_tokens=50, sampling=Sampling(),
                           eos_token_ids=frozenset({4}))
    chunk = seq.emit([3, 4, 5])
    assert (chunk.token_ids, chunk.finish) == ([3, 4], Finish.EOS)


def old_draft_proposed(seq, tokens, extend=False, rows=None):
    rows = rows if rows is not None else [None] * len(tokens)
    guess = extend and seq.params.sampling.temperature > 0
    new = [Proposed(tok, row, guess and i == 0) for i, (tok, row) in enumerate(zip(tokens, rows))]
    seq.draft_prop = (seq.draft_prop[seq.draft_keep:] if extend else []) + new
    seq.draft_keep, seq.draft_pending = 0, []


def old_draft_confirm(seq, tokens):
    prop = seq.draft_prop
    for tok in tokens:
        if not seq.draft_pending and seq.draft_keep < len(prop) and prop[seq.draft_keep].token == tok:
            seq.draft_keep += 1
        else:
            seq.draft_pending.append(tok)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_mirror_matches_the_per_token_code(tmp_path, temperature):
    tok = tokenizer(tmp_path)
    rng = random.Random(int(temperature * 10) + 3)
    params = GenParams(request_id="x", prompt_ids=PROMPT, max_new_tokens=10_000, sampling=Sampling(temperature=temperature))
    a = Sequence(seq_id=1, params=params, max_len=100_000, tokenizer=tok)
    b = Sequence(seq_id=1, params=params, max_len=100_000, tokenizer=tok)
    guesses = kept = pending = 0
    for _ in range(2000):
        if rng.random() < 0.5:
            drafts = [rng.randrange(4) for _ in range(rng.randint(0, 5))]
            extend = rng.random() < 0.4
            rows = [(None, i) for i in range(len(drafts))] if rng.random() < 0.5 else None
            a.draft_proposed(drafts, extend=extend, rows=rows)
            old_draft_proposed(b, drafts, extend=extend, rows=rows)
        else:
            emitted = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            a.draft_confirm(emitted)
            old_draft_confirm(b, emitted)
        assert (a.draft_prop, a.draft_keep, a.draft_pending) == (b.draft_prop, b.draft_keep, b.draft_pending)
        assert all(type(p) is Proposed for p in a.draft_prop)
        guesses += any(p.guess for p in a.draft_prop)
        kept += a.draft_keep > 0
        pending += len(a.draft_pending) > 0
    assert kept and pending and (guesses > 0) == (temperature > 0)


# --- the running gauge --------------------------------------------------------------------------
def test_running_gauge_is_set_on_change_only_and_ends_at_zero(tmp_path):
    async def main():
        draft = FakeDraft()
        loop, sched, _ = make_loop(draft)
        sets: list[int] = []
        real = loop.metrics.set_running

        def spy(n):
            sets.append(n)
            real(n)
        loop.metrics.set_running = spy
        tok = tokenizer(tmp_path)
        seqs = [new_seq(tok, i + 1, max_new_tokens=n) for i, n in enumerate([24, 9])]
        task = asyncio.create_task(loop.run())
        for s in seqs:
            sched.submit(s)
        try:
            results = await asyncio.gather(*(collect(s) for s in seqs))
            await asyncio.sleep(0.02)
        finally:
            task.cancel()
        value = loop.metrics.registry.get_sample_value("specdec_running_sequences", {"role": "coordinator"})
        return results, sets, loop._step_no, value
    results, sets, steps, value = asyncio.run(main())
    assert [t for t, _ in results] == [plain_greedy(PROMPT, 24), plain_greedy(PROMPT, 9)]
    assert steps >= 4 and value == 0
    assert sets == [2, 1, 0]   # 2 from the first step on, 1 once the short one ended, 0 at the end


def test_a_step_left_pending_by_a_closed_loop_does_not_unguard_the_next_loops_steps():
    """A step whose event loop was closed under it (its task never finished) leaves its deadline
    behind; on the next loop the timer drops it and still times that loop's step out at its own
    deadline, with nothing raised in the timer's callback."""
    deadlines = StepDeadlines()

    async def hang():
        await asyncio.Event().wait()

    async def start():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(deadlines.run(hang(), loop, loop.time() + 0.05))
        await asyncio.sleep(0.01)
        return task

    old = asyncio.new_event_loop()
    old.run_until_complete(start())
    old.close()   # the step's task is left pending (no asyncio.run-style cleanup)

    async def second():
        loop = asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda lp, ctx: errors.append(ctx.get("exception")))
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(deadlines.run(hang(), loop, t0 + 0.1), 2.0)
        return loop.time() - t0, errors
    took, errors = asyncio.run(second())
    assert took < 1.0 and errors == []
    deadlines.close()
