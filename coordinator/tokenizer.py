"""Text <-> token ids for the coordinator (tokenizers only, no torch) and incremental detokenization.

Streaming text one token at a time is not `decode([token])`: a byte-level BPE token can hold part of
a UTF-8 character (an emoji is often four tokens), and SentencePiece-style decoders change a token's
text depending on its neighbours (leading spaces). The detokenizer therefore decodes a short window
of tokens twice — up to the last emitted point and up to now — and emits the difference up to its
last complete character; an incomplete tail (U+FFFD at the end) waits for the tokens that finish it.
Tokens may straddle characters (byte-level BPE merges across them inside a word), so a run of
tokens can end mid-character again and again: what is complete goes out at every step.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from specdec.tokenizer_info import TOKENIZER_FILE, tokenizer_fingerprint

REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the first generated one, so its leading space (SentencePiece) or
# its continuation of a split character is decoded in context.
PROMPT_CONTEXT = 6
# Tokens held in the window while its text keeps ending mid-character: a bound on the window's
# decode, not on a character (runs of tokens that straddle characters are valid, and tokens that
# decode to nothing, an EOS with ignore_eos, may sit inside one). Past it the held text goes out as
# it is, U+FFFD included. (At 6, a run of emoji split across tokens lost a character, found by the
# review in tests/unit/test_text_stream_review.py.)
MAX_HELD_TOKENS = 64


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded; the message names the path."""


class TextTokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"tokenizer: no {TOKENIZER_FILE} at {path} (pass --tokenizer)")
        self._tok = Tokenizer.from_file(str(file))
        self.path = file
        self.fingerprint = tokenizer_fingerprint(file)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_unlocked(self, text: str) -> list[int]:
        """encode(), releasing the GIL while it runs (tokenizers' encode holds it, encode_batch
        does not): for a worker thread, so a long prompt does not stall the event loop."""
        return self._tok.encode_batch([text], add_special_tokens=True)[0].ids

    def decode(self, ids: list[int]) -> str:
        # Ids the tokenizer does not know (a model vocabulary padded past the tokenizer's) decode to "".
        return self._tok.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas that concatenate to the full text."""

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int]):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix = 0                  # window start: decoded for context, already emitted
        self._read = len(self._ids)       # tokens up to here are emitted
        self._sent = 0                    # characters of the text after _read already emitted

    def push(self, token_id: int) -> str:
        """Adds one token; returns the new complete text (often "", e.g. mid-character)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def push_many(self, token_ids: list[int]) -> str:
        """push() of each token, joined: one advance (two decodes) for the whole step."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        now = self._tok.decode(self._ids[self._prefix:])
        start = len(before) + self._sent
        complete = len(now) > len(before) and not now.endswith(REPLACEMENT)
        if complete or final or len(self._ids) - self._read >= MAX_HELD_TOKENS:
            # The window slides: the tokens just emitted become the context of the next decode, so
            # the cost per token stays constant however long the output grows.
            self._prefix, self._read, self._sent = self._read, len(self._ids), 0
            return now[start:]
        # Mid-character (or no text yet): what precedes the incomplete tail goes out now.
        stable = len(now.rstrip(REPLACEMENT))
        if stable <= start:
            return ""
        self._sent = stable - len(before)
        return now[start:stable]
