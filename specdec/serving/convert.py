"""Protobuf <-> engine objects for the model servers. Whole-request problems (malformed packed
bytes) raise RequestError; a sequence's own bad values become that sequence's SeqError."""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import torch

from protos import specdec_pb2 as pb
from specdec.engine.types import (Code, DraftOutput, DraftSeqInput, ModelInfo, SeqError, StepTiming,
                                  VerifyOutput, VerifySeqInput)
from specdec.sampling.params import SamplingParams, SamplingParamsError
from specdec.sampling.transport import ProbsDecodeError, decode_probs, encode_probs

_ENCODING_PREFIX = "PROBS_ENCODING_"


class RequestError(ValueError):
    """The request as a whole is malformed (INVALID_ARGUMENT); the message names the field."""


def unpack_ids(data: bytes, field: str) -> list[int]:
    if len(data) % 4:
        raise RequestError(f"{field}: {len(data)} bytes is not a whole number of int32 token ids")
    return np.frombuffer(data, dtype="<i4").tolist()


def pack_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p,
                          min_p=msg.min_p, seed=msg.seed if msg.HasField("seed") else None)


def probs_from_pb(msg: pb.Probs, field: str) -> torch.Tensor | None:
    if msg.encoding == pb.PROBS_ENCODING_UNSPECIFIED:
        return None
    try:
        encoding = pb.ProbsEncoding.Name(msg.encoding).removeprefix(_ENCODING_PREFIX)
    except ValueError:
        raise RequestError(f"{field}.encoding: unknown value {msg.encoding}") from None
    try:
        return decode_probs(msg.values, msg.rows, msg.vocab_size, encoding, msg.indices, msg.row_lengths)
    except ProbsDecodeError as e:
        raise RequestError(f"{field}{str(e).removeprefix('draft_probs')}") from None


def probs_to_pb(weights: torch.Tensor, dtype: torch.dtype) -> pb.Probs:
    enc = encode_probs(weights, dtype)
    return pb.Probs(encoding=pb.ProbsEncoding.Value(_ENCODING_PREFIX + enc.encoding), rows=enc.rows,
                    vocab_size=enc.vocab_size, values=enc.values, indices=enc.indices,
                    row_lengths=enc.row_lengths)


def _sampling_or_error(msg: pb.SamplingParams, field: str) -> SamplingParams | SeqError:
    try:
        return sampling_from_pb(msg)
    except SamplingParamsError as e:
        return SeqError(Code.INVALID_ARGUMENT, f"{field}.{e}")


def draft_seqs_from_pb(req: pb.ProposeRequest) -> list[DraftSeqInput | SeqError]:
    out: list[DraftSeqInput | SeqError] = []
    for i, s in enumerate(req.seqs):
        new_tokens = unpack_ids(s.new_tokens, f"seqs[{i}].new_tokens")
        sampling = _sampling_or_error(s.sampling, "sampling")
        out.append(sampling if isinstance(sampling, SeqError) else
                   DraftSeqInput(s.seq_id, s.keep, new_tokens, s.num_draft, sampling, s.first))
    return out


def verify_seqs_from_pb(req: pb.VerifyRequest) -> list[VerifySeqInput | SeqError]:
    out: list[VerifySeqInput | SeqError] = []
    for i, s in enumerate(req.seqs):
        new_tokens = unpack_ids(s.new_tokens, f"seqs[{i}].new_tokens")
        drafts = unpack_ids(s.draft_tokens, f"seqs[{i}].draft_tokens")
        probs = probs_from_pb(s.draft_probs, f"seqs[{i}].draft_probs")
        sampling = _sampling_or_error(s.sampling, "sampling")
        out.append(sampling if isinstance(sampling, SeqError) else
                   VerifySeqInput(s.seq_id, new_tokens, drafts, probs, sampling, s.partial_prefill,
                                  s.first))
    return out


def error_to_pb(error: SeqError | None) -> pb.SeqError | None:
    return None if error is None else pb.SeqError(code=int(error.code), message=error.message)


def timing_to_pb(t: StepTiming) -> pb.StepTiming:
    return pb.StepTiming(**asdict(t))


def info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**asdict(info))


def draft_result_to_pb(seq_id: int, out: DraftOutput | SeqError, probs_dtype: torch.dtype) -> pb.DraftResult:
    if isinstance(out, SeqError):
        return pb.DraftResult(seq_id=seq_id, error=error_to_pb(out))
    if out.error is not None:
        return pb.DraftResult(seq_id=seq_id, error=error_to_pb(out.error))
    probs = probs_to_pb(out.probs, probs_dtype) if out.probs is not None else None
    return pb.DraftResult(seq_id=seq_id, tokens=pack_ids(out.tokens), probs=probs)


def verify_result_to_pb(seq_id: int, out: VerifyOutput | SeqError) -> pb.VerifyResult:
    if isinstance(out, SeqError):
        return pb.VerifyResult(seq_id=seq_id, next_token=-1, error=error_to_pb(out))
    return pb.VerifyResult(seq_id=seq_id, accepted=out.accepted, next_token=out.next_token,
                           error=error_to_pb(out.error))


def merge(prepared: list, outputs: list) -> list:
    """Request-order results: the conversion's SeqErrors where conversion failed, else the engine's
    outputs (which come in the order of the inputs it was given)."""
    it = iter(outputs)
    return [p if isinstance(p, SeqError) else next(it) for p in prepared]
