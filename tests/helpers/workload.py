"""What the burst / soak tests of real clusters ask and what they get back: one kind of request
(Recipe), one planned client of it (Planned), what that client saw (Outcome)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from coordinator.client import Chunk, Client, build_request
from protos import specdec_pb2 as pb


# Prompts of a few tokens each (the tiny models' tokenizer).
SHORT_PROMPTS = ["def add(a, b):", "The quick brown fox", "class Point:", "import os\nimport sys",
                 "for i in range(10):", "Speculative decoding is"]


@dataclass(frozen=True)
class Reference:
    """A request's undisturbed output."""
    tokens: tuple[int, ...]
    text: str
    finish: str
    prompt_tokens: int


@dataclass(eq=False)
class Recipe:
    """One kind of request. greedy: checked against plain decoding (any speculation setting);
    sampled: against the same request alone (its params fix num_draft and speculation); invalid:
    must fail with `code` and a message containing `message`."""
    name: str
    prompt: object                     # text, token ids, or None (set by `mutate`)
    params: dict = field(default_factory=dict)
    kind: str = "greedy"
    code: grpc.StatusCode | None = None
    message: str = ""
    mutate: Callable[[pb.GenerateRequest], None] | None = None

    def request(self, **extra) -> pb.GenerateRequest:
        req = build_request(self.prompt if self.prompt is not None else "x", **{**self.params, **extra})
        if self.prompt is None:
            req.ClearField("prompt")
        if self.mutate is not None:
            self.mutate(req)
        return req


@dataclass(eq=False)
class Planned:
    """One client: which request, how it treats its stream (`behaviour`), when it starts."""
    index: int
    recipe: Recipe
    behaviour: str
    delay: float                       # seconds after the burst starts
    extra: dict = field(default_factory=dict)   # speculation settings, request_id
    timeout: float | None = None
    cut: int = 0                       # chunks read before cancelling or stalling
    pause: float = 0.0                 # before cancelling / while stalled

    def describe(self) -> str:
        return (f"#{self.index} {self.recipe.name} {self.behaviour} extra={self.extra} delay={self.delay:.3f} "
                f"timeout={self.timeout} cut={self.cut} pause={self.pause:.3f}")


@dataclass(eq=False)
class Outcome:
    plan: Planned
    chunks: list = field(default_factory=list)
    eof: bool = False
    code: grpc.StatusCode | None = None
    details: str = ""
    hung: bool = False
    seconds: float = 0.0               # how long the stream took


def collect(chunks: list[Chunk]) -> tuple[tuple[int, ...], str]:
    """A stream's tokens and text."""
    return tuple(t for c in chunks for t in c.token_ids), "".join(c.text for c in chunks)


def run_alone(client: Client, recipe: Recipe, **extra) -> Reference:
    """The recipe's request alone, read to its end (which must say why it ended and count its tokens)."""
    chunks = [Chunk.from_pb(r) for r in client.stub.Generate(recipe.request(**extra), timeout=60)]
    tokens, text = collect(chunks)
    assert chunks[-1].finish_reason is not None, recipe.name
    assert chunks[-1].usage.completion_tokens == len(tokens), recipe.name
    return Reference(tokens, text, chunks[-1].finish_reason, chunks[-1].usage.prompt_tokens)


def stream_problems(o: Outcome, hang_s: float) -> tuple[list[str], list[int] | None]:
    """What is wrong with any stream, whatever it asked: (problems, the chunks carrying a
    finish_reason), or ([why], None) for one that did not end within hang_s seconds."""
    if o.hung:
        return [f"stream did not end within {hang_s:g}s"], None
    finishes = [i for i, c in enumerate(o.chunks) if c.finish_reason is not None]
    if finishes and finishes != [len(o.chunks) - 1]:
        return [f"finish_reason on chunks {finishes} of {len(o.chunks)}"], finishes
    return [], finishes
