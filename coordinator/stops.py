"""Stop strings over a stream of text deltas.

Text is released only when no stop string can still begin inside it: the longest suffix that is a
prefix of some stop string is held back until the next delta decides it, so a stop string split
across tokens (or steps) is found and never shown to the client.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...] | list[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string matched). After a match the text is
        everything before the earliest match and the rest is dropped."""
        text = self._held + delta
        if not self._stops:
            self._held = ""
            return text, False
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return text[:min(hits)], True
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """End of stream without a match: the held text is ordinary output after all."""
        text, self._held = self._held, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string (and is not all of it)."""
        best, last = 0, text[-1:]
        for stop in self._stops:
            # Only lengths whose last character is the text's can match: found with rfind (in C)
            # rather than a slice compared at every length.
            n = min(len(stop) - 1, len(text))
            while n > best:
                n = stop.rfind(last, 0, n) + 1   # the longest candidate length <= n
                if n <= best:
                    break
                if text.endswith(stop[:n]):
                    best = n
                    break
                n -= 1
        return best
