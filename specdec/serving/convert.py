"""Protobuf <-> engine objects for the model servers. Everything wrong with one sequence's fields
(malformed packed bytes, probabilities of the wrong shape, bad sampling values) becomes that
sequence's SeqError naming the field (`seqs[i].draft_probs.vocab_size`); the rest of the batch is
served."""
from __future__ import annotations

from dataclasses import asdict

import torch

from protos import specdec_pb2 as pb
from protos.wire import WireError, pack_ids, unpack_ids
from specdec.engine.types import (Code, DraftOutput, DraftSeqInput, ModelInfo, SeqError, StepTiming,
                                  VerifyOutput, VerifySeqInput)
from specdec.sampling.params import SamplingParams, SamplingParamsError
from specdec.sampling import transport
from specdec.sampling.transport import ProbsDecodeError, SparseWeights, decode_probs, encode_probs

_ENCODING_PREFIX = "PROBS_ENCODING_"


class FieldError(ValueError):
    """One sequence's field is malformed; the message starts with the field's name below the
    sequence (`draft_probs.values: ...`)."""


# Validated SamplingParams by their wire values: a sequence sends the same ones with every step,
# and building one (its checks) cost more than the rest of its conversion. Frozen, so shared;
# cleared when full; values that fail the checks are never stored.
_SAMPLING: dict[tuple, SamplingParams] = {}
_SAMPLING_MAX = 4096


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    key = (msg.temperature, msg.top_k, msg.top_p, msg.min_p, msg.seed if msg.HasField("seed") else None)
    params = _SAMPLING.get(key)
    if params is None:
        params = SamplingParams(*key)
        if len(_SAMPLING) >= _SAMPLING_MAX:
            _SAMPLING.clear()
        _SAMPLING[key] = params
    return params


def probs_from_pb(msg: pb.Probs, max_vocab: int, expected_rows: int) -> torch.Tensor | SparseWeights | None:
    """The draft weights [expected_rows, vocab_size <= max_vocab], or None when none were sent;
    a sparse encoding stays sparse (the target scatters it on its device). The shape is checked
    before anything is decoded or allocated."""
    if msg.encoding == pb.PROBS_ENCODING_UNSPECIFIED:
        return None
    try:
        encoding = pb.ProbsEncoding.Name(msg.encoding).removeprefix(_ENCODING_PREFIX)
    except ValueError:
        raise FieldError(f"draft_probs.encoding: unknown value {msg.encoding}") from None
    try:
        # In the transport dtype (exact): the target moves half the bytes and widens on the device.
        return decode_probs(msg.values, msg.rows, msg.vocab_size, encoding, msg.indices,
                            msg.row_lengths, max_vocab=max_vocab, expected_rows=expected_rows, dtype=None,
                            keep_sparse=transport.KEEP_SPARSE)
    except ProbsDecodeError as e:
        raise FieldError(str(e)) from None


def probs_to_pb(weights: torch.Tensor | SparseWeights, dtype: torch.dtype) -> pb.Probs:
    enc = encode_probs(weights, dtype)
    return pb.Probs(encoding=pb.ProbsEncoding.Value(_ENCODING_PREFIX + enc.encoding), rows=enc.rows,
                    vocab_size=enc.vocab_size, values=enc.values, indices=enc.indices,
                    row_lengths=enc.row_lengths)


def _seq_error(index: int, e: Exception) -> SeqError:
    return SeqError(Code.INVALID_ARGUMENT, f"seqs[{index}].{e}")


def _sampling(msg: pb.SamplingParams) -> SamplingParams:
    try:
        return sampling_from_pb(msg)
    except SamplingParamsError as e:
        raise FieldError(f"sampling.{e}") from None


def _ids(data: bytes, field: str) -> list[int]:
    try:
        return unpack_ids(data, field)
    except WireError as e:
        raise FieldError(str(e)) from None


def draft_seqs_from_pb(req: pb.ProposeRequest) -> list[DraftSeqInput | SeqError]:
    out: list[DraftSeqInput | SeqError] = []
    for i, s in enumerate(req.seqs):
        try:
            out.append(DraftSeqInput(s.seq_id, s.keep, _ids(s.new_tokens, "new_tokens"), s.num_draft,
                                     _sampling(s.sampling), s.first, s.extend))
        except FieldError as e:
            out.append(_seq_error(i, e))
    return out


def verify_seqs_from_pb(req: pb.VerifyRequest, vocab_size: int,
                        max_num_draft: int) -> list[VerifySeqInput | SeqError]:
    """vocab_size and max_num_draft (the engine's) bound the draft probabilities before they are
    decoded: a sparse block of any claimed shape would otherwise be allocated in full."""
    out: list[VerifySeqInput | SeqError] = []
    for i, s in enumerate(req.seqs):
        try:
            new_tokens = _ids(s.new_tokens, "new_tokens")
            drafts = _ids(s.draft_tokens, "draft_tokens")
            if len(drafts) > max_num_draft:
                raise FieldError(f"draft_tokens: {len(drafts)} outside 0..{max_num_draft}")
            probs = probs_from_pb(s.draft_probs, vocab_size, len(drafts))
            out.append(VerifySeqInput(s.seq_id, new_tokens, drafts, probs, _sampling(s.sampling),
                                      s.partial_prefill, s.first))
        except FieldError as e:
            out.append(_seq_error(i, e))
    return out


def error_to_pb(error: SeqError | None) -> pb.SeqError | None:
    return None if error is None else pb.SeqError(code=int(error.code), message=error.message)


def timing_to_pb(t: StepTiming) -> pb.StepTiming:
    # Field by field: dataclasses.asdict deep-copies recursively (~20 us a step on the servers).
    return pb.StepTiming(forward_seconds=t.forward_seconds, step_seconds=t.step_seconds,
                         batch_size=t.batch_size, num_forwards=t.num_forwards,
                         decode_forward_seconds=t.decode_forward_seconds, engine_seconds=t.engine_seconds)


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
