"""Hand-written helpers of the specdec.v1 wire format shared by the servers and the coordinator
(torch-free): token ids travel as packed little-endian int32 bytes, never as repeated scalars."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Draft probabilities of a large batch make big messages (k x V fp16 per sequence).
MAX_MESSAGE_BYTES = 1 << 30


class WireError(ValueError):
    """Malformed packed bytes; the message names the field."""


def pack_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes, field: str = "token ids") -> list[int]:
    if len(data) % 4:
        raise WireError(f"{field}: {len(data)} bytes is not a whole number of int32 token ids")
    return np.frombuffer(data, dtype="<i4").tolist()


def repeats_a_column(flat: np.ndarray) -> bool:
    """Whether flat positions (row * vocab_size + column) hold one twice. Encoders write each row's
    columns in increasing order (encode_probs, draft_rows_to_host), so a strictly increasing array
    is answered in one pass; any other order is sorted (np.unique)."""
    if flat.size < 2 or bool((flat[1:] > flat[:-1]).all()):
        return False
    return np.unique(flat).size != flat.size
