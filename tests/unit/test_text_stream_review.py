"""Review of the coordinator's text stream (a helper's review; CPU, tokenizers only, no models).

Seeded random generations are pushed through the coordinator's own path — a pb.GenerateRequest
through validation.validate into GenParams, Sequence.emit per speculative step (1..9 tokens, as a
verify step emits them), service._usage for the usage, and for part of the cases the gRPC servicer
GenerationService.Generate itself over a fake scheduler — and compared against a reference written
here from the tokenizer's one-shot decode of the emitted ids:

- the chunks' text concatenates to decode(emitted ids) (cut at the stop string), no chunk ever
  holds text past the stop (not even transiently), no chunk shows a U+FFFD the full decode lacks;
- each chunk releases exactly what can be released: the text through the last token that ends on
  a complete character, less its longest suffix that may still begin a stop string (so a chunk is
  neither ahead of the reference nor needlessly behind it);
- the finish reason (stop string, stop token id, EOS with and without ignore_eos, max_new_tokens or
  the model length reached mid-step, and their interactions), the token ids of each chunk (a step's
  tokens after the finishing one are dropped) and usage.completion_tokens (= every emitted token:
  the stop string's tokens and the stop token are counted and returned in token_ids, their text is
  not / is).

Token ids are drawn as a model could emit them: a random valid UTF-8 text segmented into random
vocabulary tokens (not only the canonical encoding), with a byte-level BPE trained here on text with
accented, CJK, Hangul and emoji characters, so that tokens split characters and also straddle
character boundaries (' 😀🚀👍' + the first bytes of the next emoji); plus the repository's tiny
tokenizer (tests/helpers/tiny_models.save_tokenizer), where every non-ASCII character is bytes.

Reference semantics of a stop string (the coordinator's): it is looked for in the text decoded so
far up to its last complete character (an incomplete tail waits for the tokens that finish it). A
token that holds complete characters and the first bytes of the next one (' cr' + b'\\xc3') shows
its complete part at once, so a stop string in it ends the request at that token. (Until this
review's fix the text only advanced at tokens that ended on a complete character; see
test_stop_in_a_token_that_ends_mid_character and the fixed findings at the end.)
"""
from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from coordinator.client import FINISH_REASONS
from coordinator.sequence import Abort, Finish, Sequence
from coordinator.service import GenerationService, _usage
from coordinator.tokenizer import MAX_HELD_TOKENS, REPLACEMENT, TextTokenizer
from coordinator.validation import Limits, validate
from protos import specdec_pb2 as pb
from tests.helpers.tiny_models import TRAINING_TEXT, save_tokenizer

EOS = 0  # <|endoftext|> in both tokenizers
EXTRA_TEXT = [
    "café naïve résumé über Ölçü señor façade crème brûlée déjà vu",
    "漢字 日本語 中文字符 東京 北京 漢字漢字 日本語日本語",
    "emoji 😀🚀👍🎉 😀😀 🚀🚀 👩‍👩‍👧 ❤️ ✨ 😀🚀👍🎉😀🚀",
    "Ωμέγα Привет мир こんにちは 안녕하세요 안녕하세요",
    "!😀 (漢) «é» “quote” — – … «é»",
]
WORDS = ["def", "return", "a + b", "print(i)", "x = 1", "ab", "aab", "the", "STOP", "</s>", "END",
         "café", "naïve", "crème", "brûlée", "über", "漢字", "日本語", "東京", "こんにちは", "안녕하세요",
         "Привет", "Ωμέγα", "😀", "🚀", "👍🎉", "😀🚀👍🎉", "👩‍👩‍👧", "❤️", "«é»", "—", "…", "!😀", "\n",
         "    "]
DECOYS = ["zz", "STOP", "END.", "漢字", "😀🚀", "é»", "\n\n", "ab", "</s>", "ü"]
PROMPTS = ["def f(x):\n", "Say: ", "漢字 → ", "naïve café ", "😀 "]


# --- tokenizers ----------------------------------------------------------------------------------

def _wide_tokenizer_json() -> str:
    """The tiny tokenizer's recipe (byte-level BPE) on more text and a larger vocabulary, so merges
    split and straddle multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=640, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT + EXTRA_TEXT * 20, trainer)
    return tok.to_str()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the ByteLevel alphabet's characters -> bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass
class Tok:
    tok: TextTokenizer
    by_bytes: dict[bytes, int]    # every non-special token's bytes -> id
    max_len: int

    def segment(self, rng: random.Random, text: str) -> list[int]:
        """A random tokenization of text into vocabulary tokens: at each byte the longest token
        half the time, another matching one otherwise (single bytes are always in the vocabulary)."""
        data, ids, p = text.encode(), [], 0
        while p < len(data):
            cands = [k for k in range(1, min(self.max_len, len(data) - p) + 1) if data[p:p + k] in self.by_bytes]
            k = cands[-1] if rng.random() < 0.5 else rng.choice(cands)
            ids.append(self.by_bytes[data[p:p + k]])
            p += k
        return ids


def _tok(path) -> Tok:
    text_tok = TextTokenizer(path)
    raw = Tokenizer.from_file(str(text_tok.path))
    dec = _byte_decoder()
    special = {t.content for t in raw.get_added_tokens_decoder().values()}
    by_bytes = {bytes(dec[c] for c in s): i for s, i in raw.get_vocab().items() if s not in special}
    assert len([b for b in by_bytes if len(b) == 1]) == 256
    return Tok(text_tok, by_bytes, max(map(len, by_bytes)))


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, Tok]:
    tiny = tmp_path_factory.mktemp("tiny_tok")
    save_tokenizer(tiny, 320)  # a folder with tokenizer.json, as the coordinator is given it
    wide = tmp_path_factory.mktemp("wide_tok") / "tokenizer.json"
    wide.write_text(_wide_tokenizer_json())
    out = {"tiny": _tok(tiny), "wide": _tok(wide)}
    assert out["tiny"].tok.decode([EOS]) == out["wide"].tok.decode([EOS]) == ""
    return out


# --- the reference -------------------------------------------------------------------------------

def first_stop(text: str, stops) -> int | None:
    """Where text is cut for the stop string that occurs first in it (earliest start)."""
    found = [text.find(s) for s in stops]
    found = [i for i in found if i >= 0]
    return min(found) if found else None


def partial_hold(text: str, stops) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    return max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)


@dataclass
class Expected:
    n: int                 # tokens emitted: usage.completion_tokens
    text: str | None       # the whole streamed text, when finished
    finish: Finish | None
    released: list[str] = field(default_factory=list)  # released[i]: text out after i tokens (unfinished)
    strict_n: int | None = None  # the first token after which decode(ids[:n]) contains a stop string


def reference(tok: TextTokenizer, ids: list[int], stops: tuple[str, ...], stop_ids, eos_ids,
              budget: int) -> Expected:
    """Decode the ids one more at a time; stop at the first stop condition."""
    texts = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    complete, released = "", [""]
    strict = next((i for i in range(1, len(ids) + 1) if stops and first_stop(texts[i], stops) is not None), None)
    for i in range(1, len(ids) + 1):
        t = texts[i]
        complete = t.rstrip(REPLACEMENT)  # through the last complete character: the incomplete tail waits
        cut = first_stop(complete, stops) if stops else None
        if cut is not None:
            return Expected(i, complete[:cut], Finish.STOP, released, strict)
        tid = ids[i - 1]
        finish = (Finish.STOP if tid in stop_ids else Finish.EOS if tid in eos_ids
                  else Finish.LENGTH if i >= budget else None)
        if finish is not None:
            cut = first_stop(t, stops) if stops else None  # the rest of the text, at the end
            if cut is not None:
                return Expected(i, t[:cut], Finish.STOP, released, strict)
            return Expected(i, t, finish, released, strict)
        released.append(complete[:len(complete) - partial_hold(complete, stops)] if stops else complete)
    return Expected(len(ids), None, None, released, strict)


# --- random cases --------------------------------------------------------------------------------

@dataclass
class Case:
    seed: int
    prompt: list[int]
    ids: list[int]
    steps: list[int]
    stops: tuple[str, ...]
    stop_ids: tuple[int, ...]
    ignore_eos: bool
    max_new_tokens: int
    max_model_len: int

    def request(self) -> pb.GenerateRequest:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.prompt), max_new_tokens=self.max_new_tokens,
                                  stop=list(self.stops), stop_token_ids=list(self.stop_ids),
                                  ignore_eos=self.ignore_eos, request_id=f"case-{self.seed}")

    def limits(self, tok: TextTokenizer) -> Limits:
        return Limits(vocab_size=tok.vocab_size, max_model_len=self.max_model_len, max_num_draft=8,
                      eos_token_ids=frozenset({EOS}))


def longest_held_run(tok: TextTokenizer, ids: list[int]) -> int:
    """Most consecutive tokens after none of which the decode ends on a complete, longer text: how
    many tokens the detokenizer must hold at once to never show a broken character."""
    run = best = 0
    prev = ""
    for i in range(1, len(ids) + 1):
        t = tok.decode(ids[:i])
        run = run + 1 if (t.endswith(REPLACEMENT) or len(t) <= len(prev)) else 0
        best = max(best, run)
        if not t.endswith(REPLACEMENT):
            prev = t
    return best


def make_case(t: Tok, seed: int) -> Case:
    rng = random.Random(seed)
    tok = t.tok
    while True:
        text = "".join(rng.choice(WORDS) + rng.choice(["", " ", " ", "\n"]) for _ in range(rng.randint(3, 12)))
        ids = t.segment(rng, text) if rng.random() < 0.8 else tok.encode(text)
        assert tok.decode(ids) == text
        if rng.random() < 0.4:  # one or two EOS tokens (decode to ""), anywhere, mid-character too
            for pos in sorted(rng.sample(range(0, len(ids), 4), min(2, len(range(0, len(ids), 4)))), reverse=True):
                ids.insert(pos + rng.randrange(4), EOS)
        # Runs of MAX_HELD_TOKENS tokens without a complete character would be forced out as U+FFFD.
        if longest_held_run(tok, ids) < MAX_HELD_TOKENS:
            break
    stops, start = [], rng.randrange(len(text))
    for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 3, 4])):
        # Near the previous one half the time: overlapping stops, several ending in one step.
        start = min(max(0, start + rng.randint(-4, 4)), len(text) - 1) if rng.random() < 0.5 \
            else rng.randrange(len(text))
        n = rng.randint(1, 6)
        kind = rng.random()
        piece = text[start:start + n]
        stop = piece if kind < 0.65 else piece + "Q" if kind < 0.8 else rng.choice(DECOYS)
        stops.append(stop)
    stop_ids = ()
    if rng.random() < 0.3:
        stop_ids = tuple(rng.choice(ids) for _ in range(rng.randint(1, 2)))
        if rng.random() < 0.3:
            stop_ids += (EOS,)
    steps, left = [], len(ids)
    while left > 0:
        steps.append(min(left, rng.randint(1, 9)))
        left -= steps[-1]
    prompt = tok.encode(rng.choice(PROMPTS))
    max_model_len = 4096 if rng.random() < 0.8 else len(prompt) + rng.randint(1, len(ids) + 3)
    return Case(seed, prompt, ids, steps, tuple(stops), stop_ids, rng.random() < 0.5,
                rng.randint(1, len(ids) + 3), max_model_len)


def expected_for(case: Case, tok: TextTokenizer) -> Expected:
    eos = frozenset() if case.ignore_eos else frozenset({EOS})
    budget = min(case.max_new_tokens, case.max_model_len - len(case.prompt))
    return reference(tok, case.ids, case.stops, set(case.stop_ids), eos, budget)


def run_emit(case: Case, tok: TextTokenizer):
    """The coordinator's path: validate the request, then Sequence.emit each step until a finish."""
    params = validate(case.request(), case.limits(tok), tok)
    seq = Sequence(seq_id=1, params=params, max_len=case.max_model_len, tokenizer=tok)
    chunks, outs, i = [], [], 0
    for size in case.steps:
        step = case.ids[i:i + size]
        chunk = seq.emit(step)
        chunks.append((step, chunk))
        i += size
        outs.append(i)
        if chunk.finish is not None:
            break
    return seq, chunks, outs


def check_case(case: Case, tok: TextTokenizer, stats: dict | None = None) -> None:
    exp = expected_for(case, tok)
    seq, chunks, outs = run_emit(case, tok)
    where = f"seed={case.seed} stops={case.stops!r} stop_ids={case.stop_ids} ignore_eos={case.ignore_eos} " \
            f"max_new={case.max_new_tokens} max_len={case.max_model_len} steps={case.steps} ids={case.ids} " \
            f"text={tok.decode(case.ids)!r} expected={exp.finish!r} {exp.n} {exp.text!r}"
    streamed, n_ids = "", 0
    for k, ((step, chunk), end) in enumerate(zip(chunks, outs)):
        streamed += chunk.text
        last = k == len(chunks) - 1
        if chunk.finish is None:
            assert chunk.token_ids == step, where
            # Never past the stop, never ahead of what is decided, never needlessly behind.
            assert streamed == exp.released[end], (k, streamed, exp.released[end], where)
        else:
            assert last, where
            assert chunk.token_ids == step[:len(step) - (end - exp.n)], (k, chunk.token_ids, where)
        if exp.text is not None:
            assert exp.text.startswith(streamed), (k, streamed, where)
            if REPLACEMENT in chunk.text:
                assert REPLACEMENT in exp.text, (k, chunk.text, where)
        n_ids += len(chunk.token_ids)
    final = chunks[-1][1]
    assert final.finish == exp.finish, (final.finish, where)
    assert n_ids == len(seq.output) == exp.n, (n_ids, len(seq.output), where)
    assert seq.output == case.ids[:exp.n], where
    if exp.finish is not None:
        assert streamed == exp.text, (streamed, where)
        usage = _usage(seq)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(case.prompt), exp.n), where
    if stats is not None:
        text = tok.decode(case.ids[:exp.n])
        stats["finished"] += exp.finish is not None
        stats[f"finish={exp.finish.name if exp.finish else None}"] += 1
        stats["stop text cut"] += exp.finish == Finish.STOP and exp.text != text
        stats["stop after streamed text"] += exp.finish == Finish.STOP and any(c.text for _, c in chunks[:-1])
        before_last = tok.decode(case.ids[:outs[-2]]).rstrip(REPLACEMENT) if len(outs) > 1 else ""
        stopped = exp.finish == Finish.STOP
        stats["stop across steps"] += stopped and len(exp.text) < len(before_last)
        before_token = tok.decode(case.ids[:exp.n - 1]).rstrip(REPLACEMENT)
        stats["stop across tokens"] += stopped and len(exp.text) < len(before_token)
        reach = tok.decode(case.ids[:outs[-1]])  # through the last step's dropped tokens
        stats["several stops in the last step"] += stopped and sum(s in reach and s not in before_last
                                                                   for s in case.stops) >= 2
        stats["tokens dropped mid-step"] += exp.finish is not None and outs[-1] > exp.n
        stats["split characters"] += any(REPLACEMENT in tok.decode(case.ids[:j]) for j in range(1, exp.n))
        stats["held back then released"] += any(exp.released[j] != tok.decode(case.ids[:j]).rstrip(REPLACEMENT)
                                                 for j in range(1, min(exp.n, len(exp.released))))
        stats["no stop strings (id path)"] += not case.stops
        stats["stop seen one token late (mid-character token)"] += exp.strict_n is not None and exp.strict_n < exp.n
        stats["ignore_eos with EOS emitted"] += case.ignore_eos and EOS in case.ids[:exp.n]
        stats["stop token id"] += stopped and exp.text == text and case.ids[exp.n - 1] in case.stop_ids
        stats["model length limit"] += (exp.finish == Finish.LENGTH
                                        and case.max_model_len - len(case.prompt) < case.max_new_tokens)


@pytest.mark.parametrize("name", ["tiny", "wide"])
def test_random_generations_match_the_reference(toks, name):
    t = toks[name]
    stats = Counter()
    for seed in range(300):
        check_case(make_case(t, seed), t.tok, stats)
    # The random cases do reach the situations under review (not only easy ones).
    need = ["finish=STOP", "finish=EOS", "finish=LENGTH", "stop text cut", "stop after streamed text",
            "stop across steps", "stop across tokens", "several stops in the last step", "tokens dropped mid-step",
            "split characters", "held back then released",
            "no stop strings (id path)", "ignore_eos with EOS emitted", "stop token id",
            "model length limit"]
    assert all(stats[k] >= 5 for k in need), stats
    assert stats["finished"] >= 250, stats


# --- the gRPC servicer, over a fake scheduler -----------------------------------------------------

class _Metrics:
    def observe_first_token(self, ttft):
        pass

    def observe_request(self, code, seconds, tokens, ttft):
        self.code = code


class _Scheduler:
    """Plays a case's steps as the spec loop's _apply does: emit, queue the chunk, stop at a finish."""

    def __init__(self, steps: list[list[int]]):
        self.steps = steps
        self.cancelled = False

    def submit(self, seq: Sequence) -> None:
        async def play():
            for step in self.steps:
                await asyncio.sleep(0)
                chunk = seq.emit(step)
                seq.queue.put_nowait(chunk)
                if chunk.finish is not None:
                    return
            seq.queue.put_nowait(Abort(13, "the case's steps ran out without a finish"))  # INTERNAL
        self.task = asyncio.get_running_loop().create_task(play())

    def cancel(self, seq: Sequence) -> None:
        self.cancelled = True


class _Coord:
    def __init__(self, case: Case, tok: TextTokenizer):
        self.limits, self.tokenizer, self.failure = case.limits(tok), tok, None
        self.metrics = _Metrics()
        i, steps = 0, []
        for size in case.steps:
            steps.append(case.ids[i:i + size])
            i += size
        self.scheduler = _Scheduler(steps)

    def new_sequence(self, params) -> Sequence:
        return Sequence(seq_id=1, params=params, max_len=self.limits.max_model_len, tokenizer=self.tokenizer)

    async def check_target(self) -> None:   # (its target never restarts)
        pass


class _Context:
    async def abort(self, code, message):
        raise AssertionError(f"aborted {code}: {message}")


def test_generate_rpc_responses_match_the_reference(toks):
    """GenerationService.Generate: the pb responses' text, token ids, finish_reason and usage."""
    async def collect(coord, case):
        return [r async for r in GenerationService(coord).Generate(case.request(), _Context())]

    done = 0
    for name, t in toks.items():
        for seed in range(1000, 1060):
            case = make_case(t, seed)
            exp = expected_for(case, t.tok)
            if exp.finish is None:
                continue
            coord = _Coord(case, t.tok)
            responses = asyncio.run(collect(coord, case))
            where = f"{name} seed={seed} {case.stops!r} {exp!r}"
            assert "".join(r.text for r in responses) == exp.text, where
            assert [i for r in responses for i in r.token_ids] == case.ids[:exp.n], where
            assert all(not r.finish_reason and not r.HasField("usage") for r in responses[:-1]), where
            last = responses[-1]
            assert FINISH_REASONS[last.finish_reason] == {Finish.STOP: "stop", Finish.EOS: "eos",
                                                          Finish.LENGTH: "length"}[exp.finish], where
            assert last.usage.completion_tokens == exp.n and last.usage.prompt_tokens == len(case.prompt), where
            assert all(r.request_id == f"case-{seed}" for r in responses), where
            assert coord.metrics.code == "OK" and not coord.scheduler.cancelled, where
            done += 1
    assert done >= 90


# --- explicit interactions -------------------------------------------------------------------------

def _seq(tok: TextTokenizer, *, prompt="Say: ", max_new_tokens=64, max_len=4096, **req) -> Sequence:
    request = pb.GenerateRequest(text=prompt, max_new_tokens=max_new_tokens, **req)
    limits = Limits(vocab_size=tok.vocab_size, max_model_len=max_len, max_num_draft=8, eos_token_ids=frozenset({EOS}))
    return Sequence(seq_id=1, params=validate(request, limits, tok), max_len=max_len, tokenizer=tok)


def _bytes_ids(t: Tok, text: str) -> list[int]:
    """One token per byte: every multi-byte character split across tokens."""
    return [t.by_bytes[bytes([b])] for b in text.encode()]


def _play(seq: Sequence, ids: list[int], sizes: list[int]):
    out, i = [], 0
    for size in sizes:
        chunk = seq.emit(ids[i:i + size])
        out.append(chunk)
        i += size
        if chunk.finish is not None:
            break
    return out


def test_stop_string_across_steps_and_inside_characters(toks):
    """'é»' split byte by byte over three steps: 'naïve «' goes out at once, the stop's first
    (incomplete) byte is neither shown nor mistaken for text, the step after it drops its tail."""
    t = toks["tiny"]
    ids = _bytes_ids(t, "naïve «é» after")
    seq = _seq(t.tok, stop=["é»"])
    k = len("naïve «".encode())
    chunks = _play(seq, ids, [k + 1, 2, 9])  # the step ends after é's first byte, then mid '»'
    assert [c.text for c in chunks] == ["naïve «", "", ""]
    assert [c.finish for c in chunks] == [None, None, Finish.STOP]
    assert seq.output == ids[:len("naïve «é»".encode())]  # ' after' dropped
    assert _usage(seq).completion_tokens == len(seq.output)


def test_several_stops_in_one_step_the_first_to_appear_wins(toks):
    t = toks["wide"]
    ids = t.tok.encode("alpha END beta STOP gamma </s> delta")
    for stops, text in [(["STOP", "END"], "alpha "), (["</s>", "STOP"], "alpha END beta "),
                        (["a STOP", "STOP g"], "alpha END bet"), (["ta S", "beta"], "alpha END ")]:
        seq = _seq(t.tok, stop=stops)
        (chunk,) = _play(seq, ids, [len(ids)])
        assert (chunk.text, chunk.finish) == (text, Finish.STOP), stops
        assert seq.output == ids[:len(seq.output)] and len(seq.output) < len(ids)  # the rest dropped


@pytest.mark.parametrize("extra", [-1, 0, 1, 5])
def test_stop_string_and_max_new_tokens_in_the_same_step(toks, extra):
    """max_new_tokens falls before, on, or after the token that completes the stop string, all in
    one 9-token step: before it the held-back prefix of the stop is ordinary text (LENGTH); on or
    after it the stop wins and later tokens are dropped."""
    t = toks["tiny"]
    ids = _bytes_ids(t, "ok STOP tail")
    done = len("ok STOP".encode())
    seq = _seq(t.tok, stop=["STOP"], max_new_tokens=done + extra)
    chunks = _play(seq, ids, [4, 9])
    assert chunks[0].text == "ok " and chunks[0].finish is None  # 'S' held back
    if extra < 0:
        assert (chunks[1].text, chunks[1].finish) == ("STO", Finish.LENGTH)
        assert len(seq.output) == done - 1
    else:
        assert (chunks[1].text, chunks[1].finish) == ("", Finish.STOP)
        assert len(seq.output) == done
    assert _usage(seq).completion_tokens == len(seq.output) == sum(len(c.token_ids) for c in chunks)


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("eos_is_stop_id", [False, True])
@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_eos_ignore_eos_and_stop_token_ids(toks, ignore_eos, eos_is_stop_id, stops):
    """EOS mid-step ends with 'eos' and is returned (no text) unless ignore_eos; listed in
    stop_token_ids it ends with 'stop' either way. Both the id path and the stop-string path."""
    t = toks["wide"]
    head, tail = t.tok.encode("déjà 漢"), t.tok.encode("字 vu")
    ids = head + [EOS] + tail
    seq = _seq(t.tok, ignore_eos=ignore_eos, stop_token_ids=[EOS] if eos_is_stop_id else [], stop=list(stops))
    (chunk,) = _play(seq, ids, [len(ids)])
    if eos_is_stop_id or not ignore_eos:
        assert chunk.finish == (Finish.STOP if eos_is_stop_id else Finish.EOS)
        assert (chunk.text, chunk.token_ids) == ("déjà 漢", head + [EOS])
    else:
        assert (chunk.text, chunk.token_ids, chunk.finish) == ("déjà 漢字 vu", ids, None)


def test_max_new_tokens_and_model_length_mid_step_cut_a_character(toks):
    """The budget ends inside a character: the tokens past it are dropped and the incomplete
    character is flushed as U+FFFD — exactly what decoding the emitted ids gives."""
    t = toks["tiny"]
    ids = _bytes_ids(t, "a😀b")
    for kw in (dict(max_new_tokens=3), dict(max_len=len(t.tok.encode("Say: ")) + 3)):
        for stops in ([], ["zz"]):
            seq = _seq(t.tok, stop=stops, **kw)
            (chunk,) = _play(seq, ids, [6])
            assert chunk.finish == Finish.LENGTH and chunk.token_ids == ids[:3], kw
            assert chunk.text == t.tok.decode(ids[:3]) == "a" + REPLACEMENT, kw


def test_stop_in_a_token_that_ends_mid_character(toks):
    """A token with complete text and the first byte of the next character (' cr' + b'\\xc3'):
    the stop string 'cr' is seen with that token (its complete part goes out at once), so the
    request ends there, without the token that completes 'è'."""
    t = toks["wide"]
    tok = t.tok
    straddle = t.by_bytes.get(" cr\xc3".encode("latin-1"))
    assert straddle is not None  # the wide vocabulary has it (from 'crème')
    rest = t.by_bytes[b"\xa8"]
    head = tok.encode("un")
    ids = head + [straddle, rest] + tok.encode("me brûlée")
    seq = _seq(tok, stop=["cr"])
    (chunk,) = _play(seq, ids, [len(ids)])
    assert (chunk.text, chunk.finish) == ("un ", Finish.STOP)
    # 'cr' is in decode(head + [straddle]) = 'un cr\ufffd' already: the stream sees it there.
    assert chunk.token_ids == head + [straddle]


# --- findings -------------------------------------------------------------------------------------

def _stream(seq: Sequence, ids: list[int], sizes: list[int]) -> list[str]:
    return [c.text for c in _play(seq, ids, sizes)]


def test_tokens_without_text_inside_a_character_keep_it(toks):
    # Found by this review (fixed): IncrementalDetokenizer forced out its held tokens after 6
    # tokens without a complete character, assuming invalid bytes. Tokens that decode to ""
    # (EOS emitted under ignore_eos, other special or unknown ids) counted too, so EOS tokens inside
    # a split character made the stream show U+FFFD and then lose the character: 'ab\ufffdcd'
    # streamed where decode(ids) is 'ab漢cd'. The limit is now a bound on the window (64).
    t = toks["tiny"]
    tok = t.tok
    ids = _bytes_ids(t, "ab漢cd")
    ids[3:3] = [EOS] * 4  # between 漢's first and second byte
    for stops, sizes in [(("zz",), [len(ids)]), ((), [1] * len(ids))]:
        seq = _seq(tok, ignore_eos=True, stop=list(stops))
        streamed = "".join(_stream(seq, ids, sizes)) + seq._detok.flush() + seq._stops.flush()
        assert streamed == tok.decode(ids) == "ab漢cd", (stops, sizes, streamed)


@pytest.mark.parametrize("stops,size", [(("zz",), 17), ((), 1), ((), 3), (("👍",), 17)])
def test_long_runs_of_tokens_straddling_characters_keep_them(toks, stops, size):
    # Found by this review (fixed): the detokenizer held every token since the last one that ended
    # on a complete character and forced them out after 6. With tokens that straddle characters
    # (here b'\x9a\x80\xf0\x9f' = the tail of 🚀 and the head of the next emoji; byte-level BPE
    # merges across characters inside a word), the tokenizer's own encoding of a run of emoji has 6
    # such tokens in a row: the stream showed '🚀😀🚀😀\ufffd東京✨❤️❤️' (the 👍 lost), on every path
    # that pushed token by token, and a stop string '👍' never matched. Now what precedes the
    # incomplete tail goes out at every step and the tail waits for the tokens that finish it.
    tok = toks["wide"].tok
    text = "🚀😀🚀😀👍東京✨❤️❤️"
    ids = tok.encode(text)  # the tokenizer's own encoding of the text
    assert tok.decode(ids) == text and longest_held_run(tok, ids) >= 6  # what the old limit broke
    seq = _seq(tok, stop=list(stops), max_new_tokens=len(ids))
    chunks = _play(seq, ids, [size] * len(ids))
    streamed = "".join(c.text for c in chunks)
    if "👍" in stops:
        assert (streamed, chunks[-1].finish) == ("🚀😀🚀😀", Finish.STOP)
    else:
        assert chunks[-1].finish == Finish.LENGTH and len(seq.output) == len(ids)
        assert streamed == text
