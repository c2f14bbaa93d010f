"""Review of the coordinator's host-path changes (commits 01a1d04 and 0fb5329; a helper's review,
CPU only, no model servers):

- coordinator/sequence.py: a chunk of a sequence without stop strings is detokenized lazily, when
  its `text` is first read (Sequence._render_through renders every earlier unread chunk first).
  Checked against independent references: the tokenizer's one-shot decode of the emitted ids, a
  hand-written per-step detokenization (what emit() did before the change), and a Sequence with a
  stop string that never matches (which renders eagerly, token by token) — in any read order and
  read timing, across interleaved sequences, for finishing, aborted and unread chunks; and through
  the real step loop (SpecLoop over in-process fake servers) and the gRPC servicer
  (GenerationService.Generate), including a target that loses a sequence (resend from the start).
- coordinator/spec_loop.py: the cached SamplingParams message (per sequence, never shared, not
  changed by a consumer that edits the request it received) and the `first` / `partial_prefill`
  flags now set only when true.
- protos/wire.py: pack_ids / unpack_ids (struct, numpy past 4096 bytes) against numpy's '<i4'.
- coordinator/servers.py: ModelServer's fallback from an unreachable step channel to the gRPC
  stream, against an in-process gRPC target and an in-process step channel: the step is sent once
  (never lost, never duplicated), only a channel that never connected falls back, gRPC stays until
  an Info names another port or follows a failure, and then the channel is used again.

Findings, each fixed in the same session (the tests failed on the reviewed code; their
docstrings say what was wrong):
- test_blackholed_channel_with_a_step_timeout_under_5s_falls_back_in_time
- test_fallback_keeps_the_step_within_its_timeout
- test_an_info_naming_the_moved_channel_does_not_cancel_the_step_in_flight
- test_a_step_raising_cancelled_error_fails_the_clients_instead_of_hanging (its consequence)
"""
from __future__ import annotations

import asyncio
import random
import socket
import struct
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from coordinator import servers as servers_mod
from coordinator.app import Coordinator
from coordinator.sequence import Abort, Finish, GenParams, Sampling, Sequence
from coordinator.servers import ModelServer, StreamBroken
from coordinator.service import GenerationService
from coordinator.spec_loop import sampling_pb
from coordinator.tokenizer import IncrementalDetokenizer, TextTokenizer
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from protos.wire import FRAME_MESSAGE, frame, pack_ids, read_frame, unpack_ids
from specdec.metrics import CoordinatorMetrics
from tests.helpers.tiny_models import _tokenizer_json
from tests.unit.test_spec_loop_faults import (NOT_FOUND, PROMPT, FakeDraft, FakeTarget, config, make_loop,
                                              plain_greedy, target_info)

V = 320
NEVER = "\U0010FFFF\U0010FFFF"  # a stop string no output here contains: the eager (stop string) path
TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld — naïve café", "emoji 😀🚀 and 漢字 mixed in",
         "    indented\n\n\ttabs", "ünïcödé 👩‍👩‍👧 family", "The quick brown fox 😀 jumps."]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(_tokenizer_json(V))
    return TextTokenizer(path)


def make_seq(tok, prompt_ids, n, seq_id=1, stop=(), eos=frozenset(), max_len=4096) -> Sequence:
    params = GenParams(request_id=str(seq_id), prompt_ids=tuple(prompt_ids), max_new_tokens=n,
                       sampling=Sampling(), stop=tuple(stop), eos_token_ids=eos)
    return Sequence(seq_id=seq_id, params=params, max_len=max_len, tokenizer=tok)


def steps_of(rng: random.Random, ids: list[int], most: int = 9) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, most)
        out.append(ids[i:i + k])
        i += k
    return out


def per_step_reference(tok, prompt_ids, steps, finish_at: int | None) -> list[str]:
    """What emit() returned before the change, written out: each step's tokens detokenized
    together as the step is emitted, the finishing step flushed."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids))
    out = []
    for j, step in enumerate(steps):
        text = detok.push_many(step)
        if j == finish_at:
            text += detok.flush()
        out.append(text)
    return out


class CountingTokenizer:
    """Wraps a TextTokenizer's decode to count calls (the detokenizer's only tokenizer call)."""

    def __init__(self, tok: TextTokenizer):
        self._tok, self.calls = tok, 0

    def decode(self, ids):
        self.calls += 1
        return self._tok.decode(ids)


# --- Chunk.text, lazily rendered ---------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_lazy_chunks_in_any_read_order_equal_the_eager_path_and_one_shot_decode(tok, seed):
    """A finishing generation of valid text (ids: the text's encoding, cut into random steps):
    reading the lazy chunks in a random order at random times (some right after their emission,
    others much later, out of order) gives, chunk by chunk, the per-step reference and the texts of
    a sequence with a never-matching stop string (the eager path); all concatenate to decode(ids)."""
    rng = random.Random(seed)
    prompt = tok.encode(rng.choice(["x = ", "Say: ", "漢字 → "]))
    ids = tok.encode("".join(rng.sample(TEXTS, 3))) + [0]
    eos = frozenset({0})
    lazy = make_seq(tok, prompt, len(ids) + 5, eos=eos)
    eager = make_seq(tok, prompt, len(ids) + 5, seq_id=2, stop=[NEVER], eos=eos)
    steps = steps_of(rng, ids)
    chunks, eager_texts, read = [], [], {}
    for step in steps:
        c, e = lazy.emit(step), eager.emit(step)
        assert c.token_ids == e.token_ids == step and c.finish == e.finish
        chunks.append(c)
        eager_texts.append(e.text)
        if rng.random() < 0.3:  # the client reads some chunk now: this one or an older one
            k = rng.randrange(len(chunks))
            read[k] = chunks[k].text
    assert chunks[-1].finish == Finish.EOS and all(c.finish is None for c in chunks[:-1])
    for k in rng.sample(range(len(chunks)), len(chunks)):
        text = chunks[k].text
        assert read.setdefault(k, text) == text  # a chunk's text never changes once read
    texts = [read[k] for k in range(len(chunks))]
    assert texts == per_step_reference(tok, prompt, steps, len(steps) - 1)
    assert texts == eager_texts
    assert "".join(texts) == tok.decode(ids)
    assert not lazy._unrendered


@pytest.mark.parametrize("seed", range(6))
def test_lazy_chunks_equal_the_eager_path_on_arbitrary_ids(tok, seed):
    """Ids a model could emit that are not any text's encoding (split and invalid UTF-8, special
    ids), finishing by LENGTH mid-step: the lazy chunks, all read only after the last one (in
    reverse), give the eager path's texts chunk by chunk (the incomplete tail flushed at the end)."""
    rng = random.Random(100 + seed)
    ids = [rng.randrange(0, V) for _ in range(rng.randint(20, 90))]
    n = len(ids) - rng.randint(0, 5)  # max_new_tokens inside the last steps: later ids dropped
    prompt = [rng.randrange(1, V) for _ in range(rng.randint(1, 8))]
    lazy = make_seq(tok, prompt, n)
    eager = make_seq(tok, prompt, n, seq_id=2, stop=[NEVER])
    chunks, eager_texts = [], []
    for step in steps_of(rng, ids):
        c, e = lazy.emit(step), eager.emit(step)
        assert (c.token_ids, c.finish) == (e.token_ids, e.finish)
        chunks.append(c)
        eager_texts.append(e.text)
        if c.finish is not None:
            break
    assert chunks[-1].finish == Finish.LENGTH and lazy.output == ids[:n]
    texts = [c.text for c in reversed(chunks)][::-1]
    assert texts == eager_texts


def test_interleaved_sequences_render_independently(tok):
    """Three sequences emitting in turn (as one batch's steps do), their chunks read in one random
    global order: each sequence's text is its own one-shot decode, nothing crosses over."""
    rng = random.Random(7)
    gens = [tok.encode(t) + [0] for t in (TEXTS[1] + TEXTS[2], TEXTS[4] * 2, TEXTS[0] + TEXTS[5])]
    seqs = [make_seq(tok, tok.encode("p: "), 500, seq_id=i + 1, eos=frozenset({0})) for i in range(3)]
    plans = [steps_of(rng, g, 6) for g in gens]
    chunks = []
    for j in range(max(map(len, plans))):
        for i, seq in enumerate(seqs):
            if j < len(plans[i]):
                chunks.append((i, j, seq.emit(plans[i][j])))
    got: dict[int, dict[int, str]] = {0: {}, 1: {}, 2: {}}
    for i, j, c in rng.sample(chunks, len(chunks)):
        got[i][j] = c.text
    for i, g in enumerate(gens):
        assert "".join(got[i][j] for j in range(len(plans[i]))) == tok.decode(g)


def test_reading_a_chunk_renders_earlier_ones_once_and_later_ones_not_at_all(tok):
    """Emission decodes nothing; reading chunk k renders chunks 0..k (two decodes each: one
    push_many per chunk, as before the change), later chunks stay unrendered; re-reading costs
    nothing."""
    counting = CountingTokenizer(tok)
    seq = make_seq(tok, tok.encode("x = "), 500, eos=frozenset({0}))
    seq._detok._tok = counting
    ids = tok.encode(TEXTS[0] + TEXTS[2]) + [0]
    chunks = [seq.emit(s) for s in steps_of(random.Random(3), ids, 4)]
    assert counting.calls == 0 and len(chunks) >= 6
    k = len(chunks) // 2
    chunks[k].text
    assert counting.calls == 2 * (k + 1)
    assert len(seq._unrendered) == len(chunks) - k - 1
    for c in chunks[:k + 1]:
        c.text
    assert counting.calls == 2 * (k + 1)
    for c in chunks:
        c.text
    # each chunk advances once; the finishing one also flushes (a third decode pair at most)
    assert 2 * len(chunks) <= counting.calls <= 2 * len(chunks) + 2 and not seq._unrendered


def test_a_finish_mid_character_flushes_only_in_the_finishing_chunk(tok):
    """LENGTH reached inside an emoji: a chunk that ends mid-character holds the partial bytes
    (nothing, not U+FFFD), and only the finishing chunk flushes them, read lazily and late as the
    eager path and the one-shot decode give them."""
    head, emoji = tok.encode("ok "), tok.encode("😀")
    assert len(emoji) >= 3
    ids = head + emoji[:2]
    lazy = make_seq(tok, tok.encode("x"), len(ids))
    eager = make_seq(tok, tok.encode("x"), len(ids), seq_id=2, stop=[NEVER])
    steps = [head + emoji[:1], emoji[1:2] + [7, 8]]  # the 2nd step overshoots: 7, 8 dropped
    lc = [lazy.emit(s) for s in steps]
    ec = [eager.emit(s) for s in steps]
    assert lc[1].token_ids == emoji[1:2] and lc[1].finish == Finish.LENGTH
    assert [c.text for c in reversed(lc)][::-1] == [c.text for c in ec]
    assert lc[0].text == "ok " and "".join(c.text for c in lc) == tok.decode(ids)


def test_chunks_before_an_abort_keep_their_text_and_hold_an_incomplete_tail(tok):
    """A sequence aborted after chunks nobody read yet (a target failure): the chunks still read as
    the eager path's (the complete text; an incomplete character at the end is not flushed, as
    eager emission never flushes without a finish)."""
    ids = tok.encode("abc ") + tok.encode("😀")[:2]
    lazy = make_seq(tok, tok.encode("x"), 100)
    eager = make_seq(tok, tok.encode("x"), 100, seq_id=2, stop=[NEVER])
    lc = [lazy.emit(ids[:2]), lazy.emit(ids[2:])]
    ec = [eager.emit(ids[:2]), eager.emit(ids[2:])]
    lazy.queue.put_nowait(Abort(14, "target lost"))
    assert [c.text for c in lc] == [c.text for c in ec]
    assert "".join(c.text for c in lc) == "abc "


# --- through the step loop and the gRPC servicer ---------------------------------------------

class RecordingTarget(FakeTarget):
    """FakeTarget that keeps (a copy of) every VerifyRequest, edits the sampling of what it received
    (a consumer touching its request must not reach the coordinator's cached message), and can
    forget a sequence once at a given step (NOT_FOUND: the loop resends it from the start)."""

    def __init__(self, forget: dict[int, int] | None = None):
        super().__init__()
        self.requests: list[pb.VerifyRequest] = []
        self.responses: list[pb.VerifyResponse] = []
        self.forget = dict(forget or {})  # step number -> seq id to drop before answering

    async def step(self, request, timeout=None, on_sent=None):
        self.requests.append(pb.VerifyRequest.FromString(request.SerializeToString()))
        victim = self.forget.pop(request.step, None)
        if victim is not None:
            self.held.pop(victim, None)
        response = await super().step(request, timeout)
        self.responses.append(response)
        for s in request.seqs:
            s.sampling.seed += 1000
            s.sampling.temperature = 9.0
        return response


def run_loop(tok, seqs, target, draft, on_end=None, **config_kw):
    """Runs the loop over `seqs`, the client reading no text; on_end() runs when the last sequence
    ended, still inside the loop (asyncio.run's teardown reprs the main task's result, and a
    Chunk's repr renders it)."""
    async def main():
        loop, sched, _ = make_loop(draft, target, **config_kw)
        task = asyncio.create_task(loop.run())
        for seq in seqs:
            sched.submit(seq)
        try:
            items = []
            for seq in seqs:  # the client reads nothing until its sequence ended
                got = []
                while True:
                    item = await asyncio.wait_for(seq.queue.get(), 10)
                    got.append(item)
                    if isinstance(item, Abort) or item.finish is not None:
                        break
                items.append(got)
            if on_end is not None:
                on_end()
            return items
        finally:
            task.cancel()
    return asyncio.run(main())


def loop_seq(tok, seq_id, temperature=0.0, stop=(), n=24) -> Sequence:
    params = GenParams(request_id=str(seq_id), prompt_ids=PROMPT, max_new_tokens=n,
                       sampling=Sampling(temperature=temperature, top_k=seq_id, top_p=0.5 + seq_id / 100,
                                         seed=1000 + seq_id), stop=tuple(stop))
    return Sequence(seq_id=seq_id, params=params, max_len=512, tokenizer=tok)


def test_the_loop_never_detokenizes_and_the_late_read_text_equals_the_eager_sequences(tok):
    """Through SpecLoop (a fake draft and target; the target loses sequence 1 once, so it is resent
    from the start): the lazy sequences' chunks are not rendered by the loop (no tokenizer call
    while it runs), and read after the end (in reverse) they equal chunk by chunk those of the
    same requests with a never-matching stop string; every output is exact."""
    counting = CountingTokenizer(tok)
    lazy = [loop_seq(tok, 1), loop_seq(tok, 2, temperature=0.7)]
    eager = [loop_seq(tok, 3, stop=[NEVER]), loop_seq(tok, 4, temperature=0.7, stop=[NEVER])]
    for seq in lazy:
        seq._detok._tok = counting
    target = RecordingTarget(forget={4: 1})
    during = []
    items = run_loop(tok, lazy + eager, target, FakeDraft(), on_end=lambda: during.append(counting.calls))
    assert during == [0]  # the loop rendered no chunk of a sequence without stop strings
    for got in items:
        assert all(not isinstance(i, Abort) for i in got)
        assert [t for c in got for t in c.token_ids] == plain_greedy(PROMPT, 24)
        assert got[-1].finish == Finish.LENGTH
    lazy_texts = [[c.text for c in reversed(got)][::-1] for got in items[:2]]
    assert counting.calls > 0
    eager_texts = [[c.text for c in got] for got in items[2:]]
    resent = [s for r in target.requests for s in r.seqs if s.seq_id == 1 and s.first]
    assert len(resent) == 2  # the first message, and the resend after NOT_FOUND
    for lt, et, got_l, got_e in zip(lazy_texts, eager_texts, items[:2], items[2:]):
        if [c.token_ids for c in got_l] == [c.token_ids for c in got_e]:
            assert lt == et
        assert "".join(lt) == "".join(et)


def test_sampling_messages_are_each_sequences_own_and_unaffected_by_consumers(tok):
    """Every Propose and Verify message carries its own sequence's sampling (values from its
    GenParams, seed included), on every step, although the target edits the sampling of each
    request it received; the cached message itself is unchanged after the run."""
    seqs = [loop_seq(tok, i, temperature=0.3 * (i % 2)) for i in (1, 2, 3)]
    target, draft = RecordingTarget(), FakeDraft()
    run_loop(tok, seqs, target, draft)
    want = {s.seq_id: pb.SamplingParams(temperature=s.params.sampling.temperature, top_k=s.params.sampling.top_k,
                                        top_p=s.params.sampling.top_p, min_p=s.params.sampling.min_p,
                                        seed=s.params.sampling.seed) for s in seqs}
    seen = 0
    for r in list(target.requests) + list(draft.requests):
        for s in r.seqs:
            assert s.sampling == want[s.seq_id], (r.step, s.seq_id, s.sampling)
            seen += 1
    assert seen > 20
    for s in seqs:
        assert s.wire_sampling == want[s.seq_id] and sampling_pb(s) is s.wire_sampling
    assert len({id(s.wire_sampling) for s in seqs}) == len(seqs)  # no message shared between sequences
    other = loop_seq(tok, 9)  # a new sequence builds its own, from its own params
    assert other.wire_sampling is None
    assert sampling_pb(other) == pb.SamplingParams(temperature=0.0, top_k=9, top_p=0.59, seed=1009)


def test_first_and_partial_prefill_flags_only_when_true(tok):
    """--prefill-chunk 2 over 3-token prompts, and a target that loses sequence 1 at step 3 (NOT_FOUND:
    resent from the start): each Verify message carries `first` exactly on a sequence's first
    message and on the one after a NOT_FOUND; `partial_prefill` exactly on the chunks of a (re)sent
    prompt that are not its last, whose chunks then add up to prompt + output so far; other
    messages are one token. Both are proto3 fields without presence, so leaving a false flag unset
    sends the bytes that setting it false sent."""
    for name in ("first", "partial_prefill"):
        assert not pb.VerifySeq.DESCRIPTOR.fields_by_name[name].has_presence
    seqs = [loop_seq(tok, 1, n=10), loop_seq(tok, 2, n=10)]
    target = RecordingTarget(forget={3: 1})
    items = run_loop(tok, seqs, target, FakeDraft(), prefill_chunk=2)
    full = list(PROMPT) + plain_greedy(PROMPT, 10)
    for got in items:
        assert [t for c in got for t in c.token_ids] == full[len(PROMPT):]
    partials = 0
    for seq in seqs:
        msgs = [(r.step, s) for r in target.requests for s in r.seqs if s.seq_id == seq.seq_id]
        lost = {r.step for r in target.responses for x in r.results
                if x.seq_id == seq.seq_id and x.error.code == NOT_FOUND}
        assert len(lost) == (1 if seq.seq_id == 1 else 0)
        expect_first, run = True, None
        for step, m in msgs:
            new = unpack_ids(m.new_tokens)
            assert m.first == expect_first, (seq.seq_id, step)
            if m.first:
                run = []
            if m.partial_prefill:
                assert run is not None and len(new) <= 2, (seq.seq_id, step)
                run += new
                partials += 1
            elif run is not None:
                run += new
                assert len(run) >= len(PROMPT) and run == full[:len(run)], (seq.seq_id, step, run)
                run = None
            else:
                assert len(new) == 1, (seq.seq_id, step)
            expect_first = step in lost
            if step in lost:
                run = None
        assert sum(m.first for _, m in msgs) == 1 + len(lost)
        for _, m in msgs:
            explicit = pb.VerifySeq(seq_id=m.seq_id, new_tokens=m.new_tokens, draft_tokens=m.draft_tokens,
                                    sampling=m.sampling, partial_prefill=m.partial_prefill, first=m.first)
            if m.HasField("draft_probs"):
                explicit.draft_probs.CopyFrom(m.draft_probs)
            assert explicit.SerializeToString() == m.SerializeToString()
    assert partials >= 3  # both prompts, and sequence 1's resend (prompt + output), were chunked


class _Context:
    async def abort(self, code, message):
        raise AssertionError(f"aborted {code}: {message}")


def test_generate_rpc_streams_the_same_text_lazily_and_eagerly(tok, tmp_path):
    """GenerationService.Generate over a Coordinator with fake servers: two identical requests, one
    with a never-matching stop string (eager), one without (lazy), the lazy one's client reading
    only after its sequence ended: the responses' texts and ids are the same, and the text is the
    continuation of the prompt's decode by the emitted ids."""
    async def main():
        coord = Coordinator(config(), tok, FakeTarget(), FakeDraft(), target_info(), target_info(),
                            CoordinatorMetrics(CollectorRegistry()))
        made, new_sequence = [], coord.new_sequence
        coord.new_sequence = lambda params: made.append(new_sequence(params)) or made[-1]
        coord.start()
        service = GenerationService(coord)
        prompt = tok.encode("print(i) ")

        def request(stop):
            return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=30, stop=stop,
                                      sampling=pb.SamplingParams(seed=5), request_id="r")

        async def eager():
            return [r async for r in service.Generate(request([NEVER]), _Context())]

        async def late():
            gen = service.Generate(request([]), _Context())
            first = await gen.__anext__()           # the sequence exists from here on
            seq = next(s for s in made if not s.params.stop)
            while not seq.done:
                await asyncio.sleep(0.01)
            assert seq._unrendered                   # chunks were queued, none read yet
            return [first] + [r async for r in gen]

        try:
            a, b = await asyncio.wait_for(asyncio.gather(eager(), late()), 20)
        finally:
            await coord.close()
        return prompt, a, b
    prompt, eager_rs, lazy_rs = asyncio.run(main())
    ids = [t for r in lazy_rs for t in r.token_ids]
    assert ids == [t for r in eager_rs for t in r.token_ids] and len(ids) == 30
    assert "".join(r.text for r in lazy_rs) == "".join(r.text for r in eager_rs)
    if [list(r.token_ids) for r in lazy_rs] == [list(r.token_ids) for r in eager_rs]:
        assert [r.text for r in lazy_rs] == [r.text for r in eager_rs]
    full = tok.decode(prompt + ids)
    assert full.startswith(tok.decode(prompt))
    assert "".join(r.text for r in lazy_rs) == full[len(tok.decode(prompt)):]
    assert lazy_rs[-1].finish_reason == pb.FINISH_REASON_LENGTH


# --- protos/wire.py ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 2, 7, 1023, 1024, 1025, 5000])
def test_pack_and_unpack_are_numpys_le_int32(n):
    rng = np.random.default_rng(n)
    ids = rng.integers(-2**31, 2**31, size=n, dtype=np.int64).tolist()
    ids[:4] = [2**31 - 1, -2**31, 0, -1][:n]
    data = pack_ids(ids)
    assert data == np.asarray(ids, dtype="<i4").tobytes()
    got = unpack_ids(data)
    assert got == ids and all(type(x) is int for x in got)
    assert unpack_ids(memoryview(data)) == ids
    for dtype in (np.int32, np.int64, np.uint16):
        arr = np.abs(np.asarray(ids, dtype=np.int64)).clip(0, 60000).astype(dtype)
        assert pack_ids(arr) == arr.astype("<i4").tobytes()
    msg = pb.VerifySeq(new_tokens=data)  # as it comes off the wire
    assert unpack_ids(pb.VerifySeq.FromString(msg.SerializeToString()).new_tokens) == ids


def test_pack_never_wraps_an_id_outside_int32():
    """Where numpy's cast of an int64 / uint32 array wrapped silently, pack_ids refuses."""
    for bad in ([2**31], [-2**31 - 1], np.array([2**31], dtype=np.int64), np.array([2**32 - 1], dtype=np.uint32)):
        with pytest.raises(OverflowError):
            pack_ids(bad)
    assert pack_ids([True, 3]) == struct.pack("<2i", 1, 3)


# --- coordinator/servers.py: the channel -> gRPC fallback ---------------------------------------

class GrpcTarget(pb_grpc.TargetServicer):
    """An in-process target over gRPC: Info names `step_port`; each Verify is answered at once
    (or never, with `hang`) and recorded."""

    def __init__(self):
        self.step_port, self.received, self.hang, self.delay = 0, [], False, 0.0

    async def Info(self, request, context):
        return pb.ModelInfo(step_port=self.step_port, vocab_size=V)

    async def Release(self, request, context):
        return pb.ReleaseResponse()

    async def Verify(self, request_iterator, context):
        async for req in request_iterator:
            self.received.append(req.step)
            if self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay)
            yield answer(req, 7)


def answer(req: pb.VerifyRequest, token: int) -> pb.VerifyResponse:
    r = pb.VerifyResponse(step=req.step)
    for s in req.seqs:
        r.results.add(seq_id=s.seq_id, next_token=token)
    return r


class Channel:
    """An in-process step channel (protos/wire frames) on `port` (0: any); `close_after_read`: it
    reads a request and closes without answering (the request left, the answer never came)."""

    def __init__(self, close_after_read: bool = False):
        self.received, self.close_after_read, self.server = [], close_after_read, None

    async def start(self, port: int = 0) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port, reuse_address=True)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer):
        try:
            while True:
                kind, payload = await read_frame(reader)
                req = pb.VerifyRequest.FromString(payload)
                self.received.append(req.step)
                if self.close_after_read:
                    break
                writer.write(frame(answer(req, 8).SerializeToString(), FRAME_MESSAGE))
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    async def stop(self):
        self.server.close()
        await self.server.wait_closed()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(step: int) -> pb.VerifyRequest:
    r = pb.VerifyRequest(step=step)
    r.seqs.add(seq_id=1, new_tokens=pack_ids([5, 6]), first=True)
    return r


async def grpc_target():
    target = GrpcTarget()
    server = grpc.aio.server()
    pb_grpc.add_TargetServicer_to_server(target, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return target, server, f"127.0.0.1:{port}"


@pytest.fixture
def connects(monkeypatch):
    """Counts channel connection attempts per port; ports in `blackholed` never answer (a firewall
    that drops the SYN), the others connect for real."""
    real = asyncio.open_connection
    log = {"ports": [], "blackholed": set()}

    async def open_connection(host, port, **kw):
        log["ports"].append(port)
        if port in log["blackholed"]:
            await asyncio.sleep(3600)
        return await real(host, port, **kw)
    monkeypatch.setattr(asyncio, "open_connection", open_connection)
    return log


def test_refused_channel_falls_back_once_then_returns_to_the_channel(connects):
    """A refused channel: the step is answered over gRPC (sent there exactly once); later steps go
    straight to gRPC (no new connection attempt); an Info naming the same port with no failure
    keeps gRPC; an Info naming another port brings the channel back (the step goes there, not to
    gRPC); a channel gone again falls back again; after a failed call, an Info on the same port
    tries the channel again, which answers when it is back."""
    async def main():
        target, server, address = await grpc_target()
        channel = Channel()
        refused = closed_port()
        target.step_port = refused
        ms = ModelServer("target", address)
        try:
            await ms.wait_ready(5)
            assert ms.transport == "channel"
            r1 = await ms.step(request(1), timeout=5)
            assert r1.step == 1 and r1.results[0].next_token == 7 and ms.transport == "grpc"
            assert target.received == [1] and connects["ports"] == [refused]
            assert (await ms.step(request(2), timeout=5)).results[0].next_token == 7
            assert target.received == [1, 2] and connects["ports"] == [refused]
            await ms.info()
            assert ms.transport == "grpc"
            target.step_port = await channel.start()
            await ms.info()
            assert ms.transport == "channel"
            assert (await ms.step(request(3), timeout=5)).results[0].next_token == 8
            assert channel.received == [3] and target.received == [1, 2]
            port = target.step_port
            await channel.stop()              # the channel goes away between steps
            ms.reset()                        # (its connection dropped while idle)
            assert (await ms.step(request(4), timeout=5)).results[0].next_token == 7
            assert target.received == [1, 2, 4] and ms.transport == "grpc"
            target.hang = True                # a failed call ...
            with pytest.raises(asyncio.TimeoutError):
                await ms.step(request(5), timeout=0.3)
            target.hang = False
            channel = Channel()
            await channel.start(port)         # ... the server back with its channel on the same port
            await ms.wait_ready(5)
            assert ms.transport == "channel"
            assert (await ms.step(request(6), timeout=5)).results[0].next_token == 8
            assert channel.received == [6] and target.received == [1, 2, 4, 5]
        finally:
            await ms.close()
            await server.stop(None)
            if channel.server is not None:
                channel.server.close()
    asyncio.run(main())


def test_a_channel_that_took_the_request_does_not_resend_it_over_grpc(connects):
    """Only a channel that never connected falls back: one that accepted the connection and the
    request, then closed without answering, fails the step (the request may have been executed),
    and nothing reaches gRPC; the channel stays the transport."""
    async def main():
        target, server, address = await grpc_target()
        channel = Channel(close_after_read=True)
        target.step_port = await channel.start()
        ms = ModelServer("target", address)
        try:
            await ms.wait_ready(5)
            with pytest.raises(ConnectionError):
                await ms.step(request(1), timeout=5)
            assert channel.received == [1] and target.received == []
            assert ms.transport == "channel"
        finally:
            await ms.close()
            await server.stop(None)
            await channel.stop()
    asyncio.run(main())


def test_blackholed_channel_with_default_connect_timeout_falls_back(connects, monkeypatch):
    """A channel that never answers the connection (a firewall dropping it): after the connect
    timeout (shortened here) the same step is answered over gRPC, sent there once."""
    monkeypatch.setattr(servers_mod, "CHANNEL_CONNECT_TIMEOUT_S", 0.3)

    async def main():
        target, server, address = await grpc_target()
        target.step_port = closed_port()
        connects["blackholed"].add(target.step_port)
        ms = ModelServer("target", address)
        try:
            await ms.wait_ready(5)
            r = await ms.step(request(1), timeout=5)
            assert r.results[0].next_token == 7 and target.received == [1] and ms.transport == "grpc"
        finally:
            await ms.close()
            await server.stop(None)
    asyncio.run(main())


def test_blackholed_channel_with_a_step_timeout_under_5s_falls_back_in_time(connects):
    """Found by this review, fixed (coordinator/servers.py ModelServer._new_call: the connect gets
    at most half the step's timeout). Before: the connect's own 5 s timeout
    (CHANNEL_CONNECT_TIMEOUT_S) ran inside the step's wait_for. With a step timeout under
    5 s (--target-timeout / --draft-timeout 2, say) and a channel that drops the connection (the
    firewall case the fallback is for), the step's timeout fires first: asyncio.TimeoutError, not
    ChannelUnreachable, so the channel is never turned off and no step ever reaches gRPC, although
    gRPC answers at once. Here, as the loop does after a failed target step (_target_lost ->
    wait_ready, then resend), three tries: all time out and gRPC receives nothing."""
    async def main():
        target, server, address = await grpc_target()
        target.step_port = closed_port()
        connects["blackholed"].add(target.step_port)
        ms = ModelServer("target", address)
        outcomes = []
        try:
            await ms.wait_ready(5)
            for step in (1, 2, 3):
                try:
                    await ms.step(request(step), timeout=0.5)
                    outcomes.append("answered")
                except asyncio.TimeoutError:
                    outcomes.append("timed out")
                    await ms.wait_ready(5)
        finally:
            await ms.close()
            await server.stop(None)
        return outcomes, target.received, ms
    outcomes, received, ms = asyncio.run(main())
    assert received, f"gRPC never got a step: {outcomes}, transport still {ms.transport!r}"
    assert "answered" in outcomes


def test_fallback_keeps_the_step_within_its_timeout(connects, monkeypatch):
    """Found by this review, fixed (coordinator/servers.py ModelServer._step: one deadline for the
    step). Before: the gRPC retry after a channel connect that timed out got the whole `timeout` again, so a step can take the connect timeout
    (5 s) + `timeout` before it counts as failed, against step()'s "both within `timeout`
    seconds" (--target-timeout 120 is then 125 s). Connect timeout 0.5 s here, step timeout 1 s, a
    gRPC target that never answers: the step fails after ~1.5 s, not ~1 s."""
    monkeypatch.setattr(servers_mod, "CHANNEL_CONNECT_TIMEOUT_S", 0.5)

    async def main():
        target, server, address = await grpc_target()
        target.step_port = closed_port()
        target.hang = True
        connects["blackholed"].add(target.step_port)
        ms = ModelServer("target", address)
        try:
            await ms.wait_ready(5)
            t0 = time.perf_counter()
            with pytest.raises(asyncio.TimeoutError):
                await ms.step(request(1), timeout=1.0)
            return time.perf_counter() - t0
        finally:
            await ms.close()
            await server.stop(None)
    elapsed = asyncio.run(main())
    assert elapsed < 1.0 + 0.25, f"the step took {elapsed:.2f} s under a 1 s timeout"


def test_an_info_naming_the_moved_channel_does_not_cancel_the_step_in_flight(connects):
    """Found by this review, fixed (coordinator/servers.py ModelServer.info marks the call stale; the
    next step reopens it). Before: a server that moved
    its channel (restarted on the same gRPC port, --step-port elsewhere) gets its steps over gRPC
    after the old port refused one, with step_port still the old one; the loop then steps over gRPC
    back to back. The next Info from anyone (GenerationService.Info on a client's Info call) names
    the new port and info() resets the step stream, cancelling the gRPC call of the step in flight:
    that step() raises asyncio.CancelledError, which SpecLoop.run's `except Exception` does not
    catch: the loop task ends cancelled and Coordinator._loop_ended takes that for close(), so no
    client gets an answer or an error. (Before 0fb5329 the refused step failed and the loop's
    wait_ready took the new port while no step was in flight.) Expected: the step in flight is
    answered (or fails as a ConnectionError the loop handles); the channel is used from the next."""
    async def main():
        target, server, address = await grpc_target()
        channel = Channel()
        target.step_port = closed_port()
        ms = ModelServer("target", address)
        try:
            await ms.wait_ready(5)
            await ms.step(request(1), timeout=5)              # the old port refused: over gRPC
            assert ms.transport == "grpc" and target.received == [1]
            target.step_port = await channel.start()          # where the server's channel is now
            target.delay = 0.5
            step = asyncio.create_task(ms.step(request(2), timeout=5))
            await asyncio.sleep(0.2)
            await ms.info()                                   # a client's Info, while step 2 is in flight
            try:
                outcome = await step
            except BaseException as e:  # noqa: BLE001 -- what the loop would see
                outcome = e
            target.delay = 0.0
            after = await ms.step(request(3), timeout=5)
            return outcome, after, ms.transport, channel.received
        finally:
            await ms.close()
            await server.stop(None)
            await channel.stop()
    outcome, after, transport, over_channel = asyncio.run(main())
    assert after.results[0].next_token == 8 and transport == "channel" and over_channel == [3]
    assert not isinstance(outcome, asyncio.CancelledError), \
        "the step in flight was cancelled by info(): the loop task would die silently"
    assert isinstance(outcome, (pb.VerifyResponse, ConnectionError)), outcome


def test_a_step_raising_cancelled_error_fails_the_clients_instead_of_hanging(tok):
    """Found by this review, fixed (coordinator/app.py Coordinator._loop_ended: a cancellation that
    close() did not ask for fails every request; ModelServer._step turns a CancelledError its
    caller did not ask for into StreamBroken). Before: a target step that raises asyncio.CancelledError
    (ModelServer.step does when info() resets the call in flight) is caught nowhere: the loop task
    ends cancelled, _loop_ended takes that for close() (no failure, no fail_all), and the running
    request gets neither its tokens nor an error."""
    class CancellingTarget(FakeTarget):
        calls = 0

        async def step(self, request, timeout=None, on_sent=None):
            self.calls += 1
            if self.calls == 3:
                raise asyncio.CancelledError()
            return await super().step(request, timeout)

    async def main():
        coord = Coordinator(config(), tok, CancellingTarget(), FakeDraft(), target_info(), target_info(),
                            CoordinatorMetrics(CollectorRegistry()))
        coord.start()
        seq = coord.new_sequence(GenParams(request_id="r", prompt_ids=PROMPT, max_new_tokens=24,
                                           sampling=Sampling()))
        coord.scheduler.submit(seq)
        last = None
        try:
            while not (isinstance(last, Abort) or getattr(last, "finish", None) is not None):
                last = await asyncio.wait_for(seq.queue.get(), 2)
        except asyncio.TimeoutError:
            last = "no answer within 2 s"
        state = (coord._task.done(), coord.failure)
        await coord.close()
        return last, state
    last, (loop_done, failure) = asyncio.run(main())
    assert last != "no answer within 2 s", f"the client hangs: loop task done={loop_done}, failure={failure}"


def test_stream_broken_is_a_connection_error():
    """What the loop's target-lost path catches: the fallback's failures stay ConnectionErrors."""
    assert issubclass(StreamBroken, ConnectionError)
    assert issubclass(servers_mod.ChannelUnreachable, ConnectionError)
