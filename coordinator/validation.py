"""GenerateRequest -> GenParams, or InvalidRequest naming the field (INVALID_ARGUMENT)."""
from __future__ import annotations

import asyncio
import math
import secrets
import uuid
from dataclasses import dataclass

from coordinator.sequence import GenParams, Sampling
from coordinator.tokenizer import TextTokenizer
from protos import specdec_pb2 as pb
from protos.wire import GREEDY_BELOW_TEMPERATURE, outside_vocab

MAX_REQUEST_ID = 256
MAX_STOP_STRINGS = 16
# A stop string's characters: every emitted token looks for a partial match at the text's end,
# which costs up to a stop's length squared per token on the step loop (a 131k-character stop
# took 3 s for one token), stalling every request.
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
# Text prompts longer than this are tokenized on a worker thread (a 1 MB prompt takes ~1 s).
THREAD_ENCODE_CHARS = 10_000


class InvalidRequest(ValueError):
    """A request field is invalid; the message starts with the field's name."""


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_num_draft: int
    eos_token_ids: frozenset[int]


def _check_ids(ids, vocab_size: int, field: str) -> None:
    bad = outside_vocab(ids, vocab_size)
    if bad is not None:
        raise InvalidRequest(f"{field}: token id {bad} is outside the vocabulary 0..{vocab_size - 1}")


def _sampling(req: pb.GenerateRequest) -> Sampling:
    s = req.sampling
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidRequest(f"sampling.temperature: must be a finite number >= 0, got {s.temperature}")
    if s.top_k < 0:
        raise InvalidRequest(f"sampling.top_k: must be >= 0 (0 = off), got {s.top_k}")
    if not 0 <= s.top_p <= 1:  # NaN fails too
        raise InvalidRequest(f"sampling.top_p: must be in [0, 1] (0 or 1 = off), got {s.top_p}")
    if not 0 <= s.min_p <= 1:
        raise InvalidRequest(f"sampling.min_p: must be in [0, 1], got {s.min_p}")
    # Draft and target derive all randomness from this seed (counter-based, per position), so a
    # request without one gets one here, once.
    seed = s.seed if s.HasField("seed") else secrets.randbits(64)
    # Below GREEDY_BELOW_TEMPERATURE the request is greedy (its logits / T would overflow near 1e-38).
    temperature = s.temperature if s.temperature >= GREEDY_BELOW_TEMPERATURE else 0.0
    return Sampling(temperature=temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                    min_p=s.min_p, seed=seed)


async def validate_async(req: pb.GenerateRequest, limits: Limits, tokenizer: TextTokenizer) -> GenParams:
    """validate() for the event loop: a long text prompt is tokenized off it."""
    text_ids = None
    if req.WhichOneof("prompt") == "text" and len(req.text) > THREAD_ENCODE_CHARS:
        text_ids = await asyncio.to_thread(tokenizer.encode_unlocked, req.text)
    return validate(req, limits, tokenizer, text_ids=text_ids)


def validate(req: pb.GenerateRequest, limits: Limits, tokenizer: TextTokenizer,
             text_ids: list[int] | None = None) -> GenParams:
    """`text_ids`: the text prompt already tokenized (validate_async)."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt: empty; set text or token_ids")
    if which == "text":
        if not req.text:
            raise InvalidRequest("prompt.text: empty")
        ids = text_ids if text_ids is not None else tokenizer.encode(req.text)
        if not ids:
            raise InvalidRequest("prompt.text: tokenizes to no tokens")
    else:
        ids = list(req.token_ids.ids)
        if not ids:
            raise InvalidRequest("prompt.token_ids: empty")
        _check_ids(ids, limits.vocab_size, "prompt.token_ids")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequest(f"prompt: {len(ids)} tokens, but the model allows at most "
                             f"{limits.max_model_len - 1} (max_model_len {limits.max_model_len} "
                             f"counts the prompt and at least one generated token)")
    if req.max_new_tokens <= 0:
        raise InvalidRequest(f"max_new_tokens: must be positive, got {req.max_new_tokens}")
    sampling = _sampling(req)
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    for i, stop in enumerate(req.stop):
        if not stop:
            raise InvalidRequest(f"stop[{i}]: empty string")
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop[{i}]: longer than {MAX_STOP_CHARS} characters ({len(stop)})")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(req.stop_token_ids)}")
    _check_ids(req.stop_token_ids, limits.vocab_size, "stop_token_ids")
    if not 0 <= req.num_draft <= limits.max_num_draft:
        raise InvalidRequest(f"num_draft: must be in 0..{limits.max_num_draft} (0 = the server's "
                             f"choice), got {req.num_draft}")
    if req.speculation not in pb.SpeculationMode.values():
        raise InvalidRequest(f"speculation: unknown mode {req.speculation}")
    if len(req.request_id) > MAX_REQUEST_ID:
        raise InvalidRequest(f"request_id: longer than {MAX_REQUEST_ID} characters")
    if not req.request_id.isprintable():   # (control and format characters: no forged log lines)
        raise InvalidRequest("request_id: printable characters only")
    return GenParams(
        request_id=req.request_id or uuid.uuid4().hex, prompt_ids=tuple(ids),
        max_new_tokens=req.max_new_tokens, sampling=sampling, stop=tuple(req.stop),
        stop_token_ids=frozenset(req.stop_token_ids),
        eos_token_ids=frozenset() if req.ignore_eos else limits.eos_token_ids,
        speculate=req.speculation != pb.SPECULATION_MODE_OFF, num_draft=req.num_draft)
