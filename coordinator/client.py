"""Python client of the Generation service: sync and async generate() that stream chunks.

    with Client("localhost:50050") as client:
        for chunk in client.generate("def add(a, b):", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

A stream that is closed before its end cancels the call, which frees the request's KV on the
servers: generate() returns a generator, which CPython closes as soon as nothing refers to it (a
`for` over the call itself, left by break or an exception); a stream held in a variable is closed
by its close() (aclose()), or by `with contextlib.closing(client.generate(...)) as stream:`.
Errors arrive as grpc.RpcError with the server's status code and message.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc

FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
                  pb.FINISH_REASON_EOS: "eos"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    steps: int

    @property
    def acceptance_ratio(self) -> float | None:
        """accepted / drafted tokens (DESIGN's α; the gauge specdec_acceptance_ratio). Leviathan's
        per-token α, accepted / (accepted + rejections), is the gauge specdec_alpha: the usage has
        no rejection count, and accepted / drafted reads lower (tokens after a rejection are
        never tested)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]
    request_id: str
    finish_reason: str | None = None   # "length", "stop" or "eos" on the last chunk
    usage: Usage | None = None         # on the last chunk

    @classmethod
    def from_pb(cls, r: pb.GenerateResponse) -> "Chunk":
        # (an id this client does not know, from a newer server, still ends the stream)
        finish = FINISH_REASONS.get(r.finish_reason, f"unknown({r.finish_reason})") if r.finish_reason else None
        usage = None
        if r.HasField("usage"):
            u = r.usage
            usage = Usage(u.prompt_tokens, u.completion_tokens, u.draft_tokens, u.accepted_tokens, u.steps)
        return cls(r.text, tuple(r.token_ids), r.request_id, finish, usage)


def build_request(prompt: str | Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 0.0, min_p: float = 0.0, seed: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  speculate: bool | None = None, num_draft: int = 0, request_id: str = "") -> pb.GenerateRequest:
    """prompt: text, or a sequence of token ids (ints, numpy or torch integers). speculate None:
    the server's default. Values a field cannot hold raise ValueError / TypeError."""
    req = pb.GenerateRequest(max_new_tokens=max_new_tokens, stop=list(stop),
                             stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                             num_draft=num_draft, request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError("prompt: text (str) or token ids, not bytes")
    else:
        ids = [int(t) for t in prompt]
        req.token_ids.ids.extend(ids)
        if not ids:
            req.token_ids.SetInParent()  # an explicit empty prompt, for the server to refuse
    req.sampling.temperature, req.sampling.top_k = temperature, top_k
    req.sampling.top_p, req.sampling.min_p = top_p, min_p
    if seed is not None:
        req.sampling.seed = seed
    if speculate is not None:
        req.speculation = pb.SPECULATION_MODE_ON if speculate else pb.SPECULATION_MODE_OFF
    return req


def deadline(timeout: float | None) -> float | None:
    """A call's timeout in seconds as gRPC takes it: None or inf for none; ValueError unless positive
    (gRPC turned inf, NaN and very large values into a deadline already past)."""
    if timeout is None:
        return None
    if not timeout > 0:   # (NaN too)
        raise ValueError(f"timeout: must be a positive number of seconds, got {timeout}")
    return timeout if timeout < 1e9 else None   # ~30 years, or inf: none


class Client:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **params) -> Iterator[Chunk]:
        call = self.stub.Generate(build_request(prompt, **params), timeout=deadline(timeout))
        try:
            for response in call:
                yield Chunk.from_pb(response)
        finally:
            call.cancel()  # no-op when finished; frees the servers' KV when the caller stops early

    def info(self, timeout: float = 5.0) -> pb.GenerationInfo:
        return self.stub.Info(pb.InfoRequest(), timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The channel is opened on first use, in the event loop that uses it (a grpc.aio channel
    belongs to the loop it was made in: one made before asyncio.run, or in a finished run, fails
    inside gRPC); a client used from another loop later opens a new one."""

    def __init__(self, address: str):
        self.address = address
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stub = None
        self._closed = False

    @property
    def stub(self) -> pb_grpc.GenerationStub:
        if self._closed:
            raise ValueError("AsyncClient is closed")
        loop = asyncio.get_running_loop()
        if self._channel is None or self._loop is not loop:
            self._channel, self._loop = grpc.aio.insecure_channel(self.address), loop
            self._stub = pb_grpc.GenerationStub(self._channel)
        return self._stub

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                       **params) -> AsyncIterator[Chunk]:
        call = self.stub.Generate(build_request(prompt, **params), timeout=deadline(timeout))
        try:
            async for response in call:
                yield Chunk.from_pb(response)
        finally:
            call.cancel()

    async def info(self, timeout: float = 5.0) -> pb.GenerationInfo:
        return await self.stub.Info(pb.InfoRequest(), timeout=timeout)

    async def close(self) -> None:
        self._closed = True
        if self._channel is not None and self._loop is asyncio.get_running_loop():
            await self._channel.close()
        self._channel = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
