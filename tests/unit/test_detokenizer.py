"""Incremental detokenization and stop strings of the coordinator (tokenizers only, no models)."""
from __future__ import annotations

import random

import pytest

from coordinator.sequence import Finish, GenParams, Sampling, Sequence
from coordinator.stops import StopStrings
from coordinator.tokenizer import IncrementalDetokenizer, TextTokenizer
from tests.helpers.tiny_models import _tokenizer_json

TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld — naïve café", "emoji 😀🚀 and 漢字 mixed in",
         "    indented\n\n\ttabs", "ünïcödé 👩‍👩‍👧 family"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(_tokenizer_json(320))
    return TextTokenizer(path)


def stream(tok, prompt_ids, ids):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok, text):
    ids = tok.encode(text)
    prompt = tok.encode("prompt: ")
    deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas), deltas


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits the emoji into byte tokens
    deltas = stream(tok, [], ids)
    assert deltas[:len(ids) - 1] == [""] * (len(ids) - 1)
    assert deltas[len(ids) - 1] == "😀"


def test_invalid_bytes_do_not_stall_the_stream(tok):
    lone = tok.encode("😀")[:1]  # a lead byte that never completes
    ids = lone + tok.encode("abcdefghij")
    assert "".join(stream(tok, [], ids)) == tok.decode(ids)


def test_unknown_and_special_ids_decode_to_nothing(tok):
    ids = tok.encode("ab") + [0] + tok.encode("cd")  # 0 is <|endoftext|>, a special token
    assert "".join(stream(tok, [], ids)) == "abcd"


@pytest.mark.parametrize("seed", range(5))
def test_stop_strings_across_random_splits(seed):
    rng = random.Random(seed)
    text = "alpha beta STOP gamma"
    cuts = sorted(rng.sample(range(1, len(text)), 6))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    stops = StopStrings(["STOP", "zzz"])
    out, matched = [], False
    for piece in pieces:
        emitted, matched = stops.feed(piece)
        out.append(emitted)
        assert "S" not in emitted or "STOP"[:len(emitted)] not in emitted
        if matched:
            break
    assert matched and "".join(out) == "alpha beta "


def test_stop_string_holdback_released_when_not_matching():
    stops = StopStrings(["</end>"])
    assert stops.feed("a </e") == ("a ", False)
    assert stops.feed("x") == ("</ex", False)
    assert stops.feed("</") == ("", False)
    assert stops.flush() == "</"


def test_earliest_stop_string_wins():
    stops = StopStrings(["world", "lo w"])
    assert stops.feed("hello world") == ("hel", True)


def make_seq(tok, text="x = ", **kw) -> Sequence:
    params = dict(request_id="r", prompt_ids=tuple(tok.encode(text)), max_new_tokens=50, sampling=Sampling())
    params.update(kw)
    return Sequence(seq_id=1, params=GenParams(**params), max_len=512, tokenizer=tok)


def test_emit_trims_after_stop_token_and_keeps_it(tok):
    seq = make_seq(tok, stop_token_ids=frozenset({tok.encode("b")[0]}))
    ids = tok.encode("aab") + tok.encode("cc")
    chunk = seq.emit(ids)
    assert chunk.finish == Finish.STOP
    assert chunk.token_ids == tok.encode("aab") and chunk.text == "aab"
    assert seq.output == tok.encode("aab")


def test_emit_eos_length_and_stop_string(tok):
    seq = make_seq(tok, eos_token_ids=frozenset({0}))
    chunk = seq.emit(tok.encode("hi") + [0] + tok.encode("more"))
    assert (chunk.finish, chunk.text, chunk.token_ids[-1]) == (Finish.EOS, "hi", 0)

    seq = make_seq(tok, max_new_tokens=3)
    ids = tok.encode("abcdefgh")
    assert seq.emit(ids[:2]).finish is None
    chunk = seq.emit(ids[2:])
    assert chunk.finish == Finish.LENGTH and len(seq.output) == 3

    seq = make_seq(tok, stop=("END",))
    first = seq.emit(tok.encode("one EN"))
    assert first.finish is None and first.text == "one "
    second = seq.emit(tok.encode("D two"))
    assert second.finish == Finish.STOP and second.text == ""


def test_emit_model_length_limit(tok):
    seq = make_seq(tok, text="ab", max_new_tokens=100)
    seq.max_len = len(seq.params.prompt_ids) + 2
    assert seq.emit(tok.encode("abcdef")).finish == Finish.LENGTH
    assert len(seq.output) == 2


@pytest.mark.parametrize("seed", range(6))
def test_push_many_gives_the_deltas_of_pushing_token_by_token(tok, seed):
    """Steps hand the detokenizer several tokens at once (push_many: two decodes a step). Split
    into random steps, the text must be the token-by-token stream's: the same total, and at the
    end of each step the same text out so far (a step ending mid-character holds only that tail;
    a step of invalid bytes or special ids still lets the complete text before them out)."""
    rng = random.Random(seed)
    text = rng.choice(TEXTS) + rng.choice(TEXTS)
    ids = tok.encode(text)
    ids[rng.randrange(len(ids)):] = ids[rng.randrange(len(ids)):]  # some odd joins
    ids.insert(rng.randrange(len(ids)), tok.encode("😀")[0])      # a lead byte that never completes
    ids.insert(rng.randrange(len(ids)), 0)                         # a special token
    prompt = tok.encode("prompt: ")
    one, many = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
    out_one, out_many, i = "", "", 0
    while i < len(ids):
        step = ids[i:i + rng.randint(1, 9)]
        i += len(step)
        out_one += "".join(one.push(t) for t in step)
        out_many += many.push_many(step)
        assert out_many == out_one, (step, out_one, out_many)
    # (Not always tok.decode(ids): the lone lead byte's replacement characters group differently.)
    assert out_many + many.flush() == out_one + one.flush()


@pytest.mark.parametrize("case", ["stop_id", "eos", "length", "model_length", "none"])
def test_emit_without_stop_strings_matches_the_token_by_token_path(tok, case):
    """emit() cuts by ids and detokenizes a step at once when there are no stop strings; an
    inactive stop string (one the text never contains) forces the token-by-token path, which
    must end the same way with the same text."""
    ids = tok.encode("héllo wörld 😀 ab") + tok.encode(" more text")
    kw = {"stop_id": dict(stop_token_ids=frozenset({ids[5]})), "eos": dict(eos_token_ids=frozenset({ids[7]})),
          "length": dict(max_new_tokens=9), "model_length": {}, "none": {}}[case]
    fast, slow = make_seq(tok, **kw), make_seq(tok, stop=("\x00never",), **kw)
    if case == "model_length":
        fast.max_len = slow.max_len = len(fast.params.prompt_ids) + 6
    assert not fast._stops.active and slow._stops.active
    steps, i = [], 0
    while i < len(ids):
        steps.append(ids[i:i + 4])
        i += 4
    for step in steps:
        a, b = fast.emit(step), slow.emit(step)
        assert (a.text, a.token_ids, a.finish) == (b.text, b.token_ids, b.finish)
        if a.finish is not None:
            break
    assert fast.output == slow.output
    assert (a.finish is None) == (case == "none")


@pytest.mark.parametrize("seed", range(4))
def test_chunk_text_is_rendered_when_read_in_any_order(tok, seed):
    """A sequence without stop strings detokenizes a chunk when its text is first read (the
    client's stream task, off the step loop's critical path): emitting decodes nothing, and
    reading the chunks' texts in any order gives the texts of reading each as it is emitted."""
    rng = random.Random(seed)
    ids = tok.encode(rng.choice(TEXTS) + rng.choice(TEXTS)) + [0]
    kw = dict(eos_token_ids=frozenset({0}), max_new_tokens=len(ids))
    eager, lazy = make_seq(tok, **kw), make_seq(tok, **kw)
    decodes = []
    real = lazy.tokenizer.decode
    lazy.tokenizer = type("Counting", (), {"decode": lambda self, x: decodes.append(1) or real(x)})()
    lazy._detok._tok = lazy.tokenizer
    want, chunks, i = [], [], 0
    while i < len(ids):
        step = ids[i:i + rng.randint(1, 6)]
        i += len(step)
        a = eager.emit(step)
        want.append((a.text, a.token_ids, a.finish))
        chunks.append(lazy.emit(step))
    assert not decodes                     # nothing rendered at emission
    order = list(range(len(chunks)))
    rng.shuffle(order)
    texts = {k: chunks[k].text for k in order}
    assert decodes
    assert [(texts[k], c.token_ids, c.finish) for k, c in enumerate(chunks)] == want
    assert "".join(texts[k] for k in range(len(chunks))) == tok.decode(ids[:-1])


def _partial_suffix_reference(stops: list[str], text: str) -> int:
    """The longest end of `text` that begins a stop string and is not all of it, by every length."""
    return max([n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1)
                if text.endswith(stop[:n])], default=0)


@pytest.mark.parametrize("seed", range(3))
def test_the_held_back_end_is_the_longest_that_begins_a_stop(seed):
    """StopStrings' partial-match scan (candidate lengths found by the text's last character)
    agrees with trying every length, over random texts and stops of a two-letter alphabet (where
    partial matches abound)."""
    rng = random.Random(seed)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        assert StopStrings(stops)._partial_suffix(text) == _partial_suffix_reference(stops, text), (stops, text)

