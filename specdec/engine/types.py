"""Data contracts between the gRPC servicers and the engines: plain Python and tensors, no protobuf.

The per-sequence types (DraftSeqInput, DraftOutput, VerifySeqInput, VerifyOutput) are made for every
sequence of every step, so they are slotted, not frozen: a frozen dataclass's __init__ sets each
field through object.__setattr__ (1.6 us against 0.4 us for seven fields on the 2-core CPU VM,
session 32), and nothing changes them after they are made."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specdec.sampling.params import SamplingParams
from specdec.sampling.transport import SparseWeights


class Code(enum.IntEnum):
    """The google.rpc.Code numbers a per-sequence error can carry (SeqError.code on the wire)."""
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13


@dataclass(frozen=True)
class SeqError:
    code: Code
    message: str


class SeqFailure(Exception):
    """One sequence of a step cannot be served; the rest of the batch goes on."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.error = SeqError(code, message)


def unknown_seq(seq_id: int) -> SeqFailure:
    """A message without `first` for a sequence the server does not hold. Treating it as new would
    silently restart the sequence from one token of context (wrong output, no error); the
    coordinator answers NOT_FOUND by resending the whole sequence with first set."""
    return SeqFailure(Code.NOT_FOUND, f"seq_id {seq_id}: unknown to this server (restarted?); "
                                      f"resend from the start with first=true")


@dataclass(frozen=True)
class StepTiming:
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    batch_size: int = 0
    num_forwards: int = 0
    decode_forward_seconds: float = 0.0
    engine_seconds: float = 0.0  # the servicer sets it: the engine's own step_seconds


@dataclass(slots=True)
class DraftSeqInput:
    seq_id: int
    keep: int
    new_tokens: list[int]
    num_draft: int
    sampling: SamplingParams = SamplingParams()
    first: bool = False  # the sequence's first message: allocate it (see unknown_seq)
    extend: bool = False  # draft after the proposal's unconfirmed rest (DraftSeq.extend)


@dataclass(slots=True)
class DraftOutput:
    seq_id: int
    tokens: list[int] = field(default_factory=list)
    # [num_draft, V] on the host, already rounded to the transport dtype: a tensor, or SparseWeights
    # (its nonzeros; .dense() gives the tensor) where the sparse encoding is the smaller one
    probs: torch.Tensor | SparseWeights | None = None
    error: SeqError | None = None


@dataclass(slots=True)
class VerifySeqInput:
    seq_id: int
    new_tokens: list[int]
    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft_tokens), V_draft]; None for greedy
    sampling: SamplingParams = SamplingParams()
    partial_prefill: bool = False
    first: bool = False  # the sequence's first message: allocate it (see unknown_seq)


@dataclass(slots=True)
class VerifyOutput:
    seq_id: int
    accepted: int = 0
    next_token: int = -1  # -1: partial prefill (nothing emitted) or error
    error: SeqError | None = None


@dataclass(frozen=True)
class StepResult:
    outputs: list  # list[DraftOutput] or list[VerifyOutput], in request order
    timing: StepTiming


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    architecture: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_model_len: int
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    device: str
    dtype: str
    eos_token_ids: tuple[int, ...]
    num_sequences: int
    tensor_parallel_size: int = 1
    device_uuids: tuple[str, ...] = ()
    max_num_draft: int = 0
