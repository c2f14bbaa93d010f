"""Hand-written helpers of the specdec.v1 wire format shared by the servers and the coordinator
(torch-free): token ids travel as packed little-endian int32 bytes, never as repeated scalars."""
from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence

import numpy as np

# Draft probabilities of a large batch make big messages (k x V fp16 per sequence).
MAX_MESSAGE_BYTES = 1 << 30


# Sampling temperatures below this are greedy (argmax), on every side of the wire: logits / T
# overflows float32 for T below ~1e-38 (NaN probabilities), and long before that the distribution is
# one-hot up to ties. vLLM draws the same line (its _SAMPLING_EPS, 1e-5).
GREEDY_BELOW_TEMPERATURE = 1e-5


class InvalidInput(ValueError):
    """Input a client sent that cannot be served as it is (INVALID_ARGUMENT at the gRPC boundary,
    specdec/serving/errors.py); the message names the field. Torch-free, so the coordinator and
    the servers share it."""


class WireError(InvalidInput):
    """Malformed packed bytes; the message names the field."""


def pack_ids(ids: Sequence[int]) -> bytes:
    # struct, not numpy: the coordinator packs a few ids per sequence and step, where numpy's
    # array construction costs twice as much (0.42 vs 0.66 us for 5 ids on the 2-core CPU).
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as e:  # an id outside int32: what numpy raised
        raise OverflowError(f"token ids: {e}") from None


def outside_vocab(ids: Sequence[int], vocab_size: int) -> int | None:
    """The first id not in 0..vocab_size-1, or None. min / max first (in C): a prompt of thousands
    of ids checks in microseconds, where a Python loop over them took a millisecond."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    return next(t for t in ids if not 0 <= t < vocab_size)


def unpack_ids(data: bytes, field: str = "token ids") -> list[int]:
    if len(data) % 4:
        raise WireError(f"{field}: {len(data)} bytes is not a whole number of int32 token ids")
    if len(data) <= 4096:  # a step's few ids: struct (0.37 vs 0.81 us for 5); a prompt's: numpy
        return list(struct.unpack(f"<{len(data) // 4}i", data))
    return np.frombuffer(data, dtype="<i4").tolist()


def repeats_a_column(flat: np.ndarray) -> bool:
    """Whether flat positions (row * vocab_size + column) hold one twice. Encoders write each row's
    columns in increasing order (encode_probs, draft_rows_to_host), so a strictly increasing array
    is answered in one pass; any other order is sorted (np.unique)."""
    if flat.size < 2 or bool((flat[1:] > flat[:-1]).all()):
        return False
    return np.unique(flat).size != flat.size


def sparse_positions(rows: int, vocab_size: int, row_lengths: bytes, indices: bytes,
                     value_bytes: int) -> np.ndarray:
    """The flat positions (row * vocab_size + column, int64) of a sparse fp16 block's nonzeros, after
    checking its layout: one int32 length per row in 0..vocab_size, an int32 column and a 16-bit
    value per nonzero, columns inside the vocabulary and none twice in a row. WireError names the
    field. The values themselves are the caller's to check."""
    if len(row_lengths) != 4 * rows:
        raise WireError(f"row_lengths: {len(row_lengths)} bytes for {rows} rows")
    lengths = np.frombuffer(row_lengths, dtype="<i4").astype(np.int64)
    if ((lengths < 0) | (lengths > vocab_size)).any():
        raise WireError(f"row_lengths: each must be in 0..{vocab_size}")
    nnz = int(lengths.sum())
    if len(indices) != 4 * nnz or value_bytes != 2 * nnz:
        raise WireError(f"indices: {nnz} nonzeros need {4 * nnz} index and {2 * nnz} value bytes, "
                        f"got {len(indices)} and {value_bytes}")
    cols = np.frombuffer(indices, dtype="<i4").astype(np.int64)
    if nnz and (int(cols.min()) < 0 or int(cols.max()) >= vocab_size):
        raise WireError(f"indices: a column outside 0..{vocab_size - 1}")
    flat = np.repeat(np.arange(rows, dtype=np.int64) * vocab_size, lengths) + cols
    if repeats_a_column(flat):
        raise WireError("indices: a column appears twice in one row")
    return flat


# --- the step channel's frames (specdec/serving/step_channel.py, coordinator/servers.py) -----------
# A frame: little-endian uint32 length of what follows, one kind byte, the payload. A step request
# and its answer are each one frame holding the serialized ProposeRequest / VerifyRequest and
# ProposeResponse / VerifyResponse; an answer that failed as a whole is a FRAME_ERROR frame whose
# payload is "<gRPC status name>: <message>" in UTF-8.
FRAME_MESSAGE = 0
FRAME_ERROR = 1
# Shared-memory frames (protos/shared_slots.py): a doorbell (payload: the uint64 sequence number of
# the frame written into the shared slot), and the offer of a mapping before the first step (the
# coordinator's, naming it; the server's answer: empty where taken, else why not, in UTF-8).
FRAME_SHARED = 2
FRAME_OFFER = 3
_KINDS = (FRAME_MESSAGE, FRAME_ERROR, FRAME_SHARED, FRAME_OFFER)
_FRAME_HEADER = struct.Struct("<IB")


class FrameError(ConnectionError):
    """A frame this side will not read: longer than MAX_MESSAGE_BYTES, or of an unknown kind."""


def frame(payload: bytes, kind: int = FRAME_MESSAGE) -> bytes:
    if len(payload) >= MAX_MESSAGE_BYTES:
        raise FrameError(f"a {len(payload)}-byte frame is over the {MAX_MESSAGE_BYTES}-byte limit")
    return _FRAME_HEADER.pack(len(payload) + 1, kind) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(kind, payload) of the next frame; asyncio.IncompleteReadError where the stream ends
    (at a frame's start: a clean close), FrameError for a frame not to read."""
    length, kind = _FRAME_HEADER.unpack(await reader.readexactly(_FRAME_HEADER.size))
    if not 1 <= length <= MAX_MESSAGE_BYTES or kind not in _KINDS:
        raise FrameError(f"frame of length {length} and kind {kind}: not a step channel frame")
    return kind, await reader.readexactly(length - 1)
