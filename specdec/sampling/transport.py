"""Draft distributions on the wire: rounding to the transport precision, packing, unpacking.

Exactness. The draft rounds its distribution q to the transport dtype FIRST and samples from the
rounded weights w; the target decodes the very same w. Both sides turn w into probabilities by
dividing by the row sum computed in float64, and that sum is exact whatever the reduction order:
fp16 weights <= 1 are multiples of 2**-24 and bf16 weights (flushed below 2**-40) multiples of
2**-47, so every partial sum (< 2) fits float64's 53-bit significand. Hence draft and target agree
bit for bit on q = w / sum(w), on any device and batch shape, and the draft samples from exactly
the distribution the target tests against.

Rows are weights, not renormalised in the transport dtype (that would not survive a second
rounding); they sum to 1 up to the rounding (|1 - sum| < 2**-11) and every consumer normalises with
`normalize`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.staging import to_device

TRANSPORT_DTYPES = {"DENSE_FP16": torch.float16, "DENSE_BF16": torch.bfloat16}
ENCODINGS = ("DENSE_FP16", "DENSE_BF16", "SPARSE_FP16")  # ProbsEncoding without its prefix
_BF16_FLUSH = 2.0 ** -40


class ProbsDecodeError(ValueError):
    """Malformed draft probabilities; the message starts with the field (draft_probs...)."""


def round_probs(probs: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[.., V] probabilities -> float32 weights exactly representable in dtype (idempotent)."""
    if dtype == torch.float16:
        return probs.to(torch.float16).float()
    if dtype == torch.bfloat16:
        w = probs.to(torch.bfloat16).float()
        return w.masked_fill(w < _BF16_FLUSH, 0.0)  # keeps the float64 row sum exact (see above)
    raise ValueError(f"transport dtype: expected float16 or bfloat16, got {dtype}")


def normalize(weights: torch.Tensor) -> torch.Tensor:
    """Rounded weights [.., V] -> float32 probabilities, identical on every device and batch shape."""
    w = weights.double()
    return (w / w.sum(-1, keepdim=True)).float()


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [R, V] (non-negative, any scale), u [R] float64 in [0, 1) -> [R] int64.

    Uses one uniform per row (cheap to derive by hashing). A token of probability 0 is never drawn.
    """
    v = probs.shape[-1]
    cdf = probs.double().cumsum(-1)                                     # [R, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # u * total may round up to total: clamp to the last token that has mass.
    cols = torch.arange(v, device=probs.device)
    last = torch.where(probs > 0, cols, 0).amax(-1)
    return torch.minimum(idx, last)


@dataclass(frozen=True)
class EncodedProbs:
    """Fields of the `Probs` proto message (encoding without the PROBS_ENCODING_ prefix)."""
    encoding: str
    rows: int
    vocab_size: int
    values: bytes
    indices: bytes = b""
    row_lengths: bytes = b""


def encode_probs(weights: torch.Tensor, dtype: torch.dtype = torch.float16,
                 sparse: bool | None = None) -> EncodedProbs:
    """weights [k, V], already rounded by `round_probs(.., dtype)` (draft_sample's q) -> packed bytes.

    sparse=None picks the smaller form; sparse rows need fp16 weights (the only sparse encoding).
    One device-to-host copy.
    """
    rows, vocab = weights.shape
    host = weights.detach().to(dtype).cpu()
    if sparse is None:
        nnz = int((host != 0).sum()) if dtype == torch.float16 else rows * vocab
        sparse = 6 * nnz + 4 * rows < 2 * rows * vocab
    if not sparse:
        name = "DENSE_FP16" if dtype == torch.float16 else "DENSE_BF16"
        raw = host.contiguous().view(torch.int16).numpy()
        return EncodedProbs(name, rows, vocab, raw.astype("<i2", copy=False).tobytes())
    if dtype != torch.float16:
        raise ValueError(f"sparse draft probabilities are float16 only, got {dtype}")
    r, c = host.nonzero(as_tuple=True)
    lengths = torch.bincount(r, minlength=rows).to(torch.int32).numpy()
    values = host[r, c].contiguous().view(torch.int16).numpy()
    return EncodedProbs("SPARSE_FP16", rows, vocab, values.astype("<i2", copy=False).tobytes(),
                        c.to(torch.int32).numpy().astype("<i4", copy=False).tobytes(),
                        lengths.astype("<i4", copy=False).tobytes())


def decode_probs(values: bytes, rows: int, vocab_size: int, encoding: str = "DENSE_FP16",
                 indices: bytes = b"", row_lengths: bytes = b"",
                 device: torch.device | str = "cpu", *, max_vocab: int | None = None,
                 expected_rows: int | None = None) -> torch.Tensor:
    """Packed bytes -> float32 weights [rows, vocab_size] on device, exactly what was encoded.

    Validates on the host (the bytes come from the network) before one host-to-device copy. The
    shape is checked against expected_rows and max_vocab before anything is allocated: the sparse
    form allocates rows x vocab_size floats that no byte count bounds.
    """
    def fail(field: str, msg: str) -> None:
        raise ProbsDecodeError(f"draft_probs.{field}: {msg}")

    if encoding not in ENCODINGS:
        fail("encoding", f"unknown {encoding!r}, expected one of {ENCODINGS}")
    if rows < 0:
        fail("rows", f"must be >= 0, got {rows}")
    if expected_rows is not None and rows != expected_rows:
        fail("rows", f"{rows} rows for {expected_rows} draft tokens (one row per draft token)")
    if vocab_size <= 0:
        fail("vocab_size", f"must be > 0, got {vocab_size}")
    if max_vocab is not None and vocab_size > max_vocab:
        fail("vocab_size", f"{vocab_size} is over the model's vocabulary of {max_vocab}")
    if encoding in TRANSPORT_DTYPES:
        if len(values) != 2 * rows * vocab_size:
            fail("values", f"{encoding} needs {2 * rows * vocab_size} bytes for {rows} x {vocab_size}, "
                           f"got {len(values)}")
        raw = torch.from_numpy(np.frombuffer(values, dtype="<i2").astype(np.int16))
        w = raw.view(TRANSPORT_DTYPES[encoding]).float().reshape(rows, vocab_size)
    else:
        if len(row_lengths) != 4 * rows:
            fail("row_lengths", f"needs {4 * rows} bytes for {rows} rows, got {len(row_lengths)}")
        lengths = np.frombuffer(row_lengths, dtype="<i4").astype(np.int64)
        if (lengths < 0).any() or (lengths > vocab_size).any():
            fail("row_lengths", f"each must be in 0..{vocab_size}")
        nnz = int(lengths.sum())
        if len(indices) != 4 * nnz or len(values) != 2 * nnz:
            fail("indices", f"{nnz} nonzeros need {4 * nnz} index and {2 * nnz} value bytes, "
                            f"got {len(indices)} and {len(values)}")
        cols = torch.from_numpy(np.frombuffer(indices, dtype="<i4").astype(np.int64))
        if nnz and (int(cols.min()) < 0 or int(cols.max()) >= vocab_size):
            fail("indices", f"column outside 0..{vocab_size - 1}")
        r = torch.repeat_interleave(torch.arange(rows), torch.from_numpy(lengths))
        if nnz and torch.unique(r * vocab_size + cols).numel() != nnz:
            fail("indices", "a column appears twice in one row")
        vals = torch.from_numpy(np.frombuffer(values, dtype="<i2").astype(np.int16)).view(torch.float16)
        w = torch.zeros(rows, vocab_size)
        w[r, cols] = vals.float()
    if not torch.isfinite(w).all() or (w < 0).any():
        fail("values", "must be finite and >= 0")
    if rows and (w.sum(-1) <= 0).any():
        fail("values", "every row needs some probability mass")
    return to_device(w, device)
