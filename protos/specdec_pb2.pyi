from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProbsEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBS_ENCODING_UNSPECIFIED: _ClassVar[ProbsEncoding]
    PROBS_ENCODING_DENSE_FP16: _ClassVar[ProbsEncoding]
    PROBS_ENCODING_DENSE_BF16: _ClassVar[ProbsEncoding]
    PROBS_ENCODING_SPARSE_FP16: _ClassVar[ProbsEncoding]

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_ON: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
PROBS_ENCODING_UNSPECIFIED: ProbsEncoding
PROBS_ENCODING_DENSE_FP16: ProbsEncoding
PROBS_ENCODING_DENSE_BF16: ProbsEncoding
PROBS_ENCODING_SPARSE_FP16: ProbsEncoding
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_ON: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Probs(_message.Message):
    __slots__ = ("encoding", "rows", "vocab_size", "values", "indices", "row_lengths")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    ROW_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    encoding: ProbsEncoding
    rows: int
    vocab_size: int
    values: bytes
    indices: bytes
    row_lengths: bytes
    def __init__(self, encoding: _Optional[_Union[ProbsEncoding, str]] = ..., rows: _Optional[int] = ..., vocab_size: _Optional[int] = ..., values: _Optional[bytes] = ..., indices: _Optional[bytes] = ..., row_lengths: _Optional[bytes] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("forward_seconds", "step_seconds", "batch_size", "num_forwards", "decode_forward_seconds", "engine_seconds")
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    forward_seconds: float
    step_seconds: float
    batch_size: int
    num_forwards: int
    decode_forward_seconds: float
    engine_seconds: float
    def __init__(self, forward_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., num_forwards: _Optional[int] = ..., decode_forward_seconds: _Optional[float] = ..., engine_seconds: _Optional[float] = ...) -> None: ...

class SeqError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "tokenizer_fingerprint", "max_model_len", "kv_blocks_total", "kv_blocks_free", "block_size", "device", "dtype", "eos_token_ids", "num_sequences", "tensor_parallel_size", "device_uuids", "max_num_draft", "step_port")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUIDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    STEP_PORT_FIELD_NUMBER: _ClassVar[int]
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
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_sequences: int
    tensor_parallel_size: int
    device_uuids: _containers.RepeatedScalarFieldContainer[str]
    max_num_draft: int
    step_port: int
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., block_size: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_sequences: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., device_uuids: _Optional[_Iterable[str]] = ..., max_num_draft: _Optional[int] = ..., step_port: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "kv_blocks_free")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    released: int
    kv_blocks_free: int
    def __init__(self, released: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ...) -> None: ...

class DraftSeq(_message.Message):
    __slots__ = ("seq_id", "keep", "new_tokens", "num_draft", "sampling", "first", "extend")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    keep: int
    new_tokens: bytes
    num_draft: int
    sampling: SamplingParams
    first: bool
    extend: bool
    def __init__(self, seq_id: _Optional[int] = ..., keep: _Optional[int] = ..., new_tokens: _Optional[bytes] = ..., num_draft: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., first: _Optional[bool] = ..., extend: _Optional[bool] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("step", "seqs", "release", "owner")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    step: int
    seqs: _containers.RepeatedCompositeFieldContainer[DraftSeq]
    release: _containers.RepeatedScalarFieldContainer[int]
    owner: int
    def __init__(self, step: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[DraftSeq, _Mapping]]] = ..., release: _Optional[_Iterable[int]] = ..., owner: _Optional[int] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("seq_id", "tokens", "probs", "error")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: bytes
    probs: Probs
    error: SeqError
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[bytes] = ..., probs: _Optional[_Union[Probs, _Mapping]] = ..., error: _Optional[_Union[SeqError, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("step", "results", "timing")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    step: int
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    timing: StepTiming
    def __init__(self, step: _Optional[int] = ..., results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ..., timing: _Optional[_Union[StepTiming, _Mapping]] = ...) -> None: ...

class VerifySeq(_message.Message):
    __slots__ = ("seq_id", "new_tokens", "draft_tokens", "draft_probs", "sampling", "partial_prefill", "first")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_tokens: bytes
    draft_tokens: bytes
    draft_probs: Probs
    sampling: SamplingParams
    partial_prefill: bool
    first: bool
    def __init__(self, seq_id: _Optional[int] = ..., new_tokens: _Optional[bytes] = ..., draft_tokens: _Optional[bytes] = ..., draft_probs: _Optional[_Union[Probs, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., partial_prefill: _Optional[bool] = ..., first: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("step", "seqs", "release", "owner")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    step: int
    seqs: _containers.RepeatedCompositeFieldContainer[VerifySeq]
    release: _containers.RepeatedScalarFieldContainer[int]
    owner: int
    def __init__(self, step: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[VerifySeq, _Mapping]]] = ..., release: _Optional[_Iterable[int]] = ..., owner: _Optional[int] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("seq_id", "accepted", "next_token", "error")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    accepted: int
    next_token: int
    error: SeqError
    def __init__(self, seq_id: _Optional[int] = ..., accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., error: _Optional[_Union[SeqError, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("step", "results", "timing")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    step: int
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    timing: StepTiming
    def __init__(self, step: _Optional[int] = ..., results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., timing: _Optional[_Union[StepTiming, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "max_new_tokens", "sampling", "stop", "stop_token_ids", "ignore_eos", "speculation", "num_draft", "request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    max_new_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    speculation: SpeculationMode
    num_draft: int
    request_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., speculation: _Optional[_Union[SpeculationMode, str]] = ..., num_draft: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens", "steps")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    steps: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    request_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerationInfo(_message.Message):
    __slots__ = ("target", "draft", "default_num_draft", "max_batch_size")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    target: ModelInfo
    draft: ModelInfo
    default_num_draft: int
    max_batch_size: int
    def __init__(self, target: _Optional[_Union[ModelInfo, _Mapping]] = ..., draft: _Optional[_Union[ModelInfo, _Mapping]] = ..., default_num_draft: _Optional[int] = ..., max_batch_size: _Optional[int] = ...) -> None: ...
