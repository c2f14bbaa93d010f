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

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protos.wire import WireError, sparse_positions
from specdec.staging import to_device

TRANSPORT_DTYPES = {"DENSE_FP16": torch.float16, "DENSE_BF16": torch.bfloat16}
# Sparse draft rows stay sparse on the target's host and are scattered on its device (SparseWeights),
# instead of k x V dense host arrays, a host concatenation and a k x V host-to-device copy per step.
# SPECDEC_SPARSE_DRAFT_PROBS=0 decodes them densely on the host (the A/B switch of e2e.py runs).
KEEP_SPARSE = os.environ.get("SPECDEC_SPARSE_DRAFT_PROBS", "1") != "0"
# The draft finds its rows' nonzeros on the device and copies only those to the host where the
# sparse encoding is smaller (draft_rows_to_host); SPECDEC_DRAFT_DEVICE_SPARSE=0 copies every row
# densely and lets encode_probs scan it on the host (the A/B switch).
DRAFT_DEVICE_SPARSE = os.environ.get("SPECDEC_DRAFT_DEVICE_SPARSE", "1") != "0"
# ... from this many sampled rows a step on: below it the second copy and the extra kernels cost
# more than the dense copy saves (bench/draft_rows.py, one H200 host: 4 rows of 32k ids 267 vs
# 176 us, 32 rows 488 vs 1027 us, 64 rows 599 vs 2028 us).
DEVICE_SPARSE_MIN_ROWS = 16
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


# Bit patterns of the transport dtypes as int16: the exponent field (all ones = inf or NaN) and -0.0.
_EXP_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
_NEG_ZERO = -0x8000


def _bits(weights: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """[k, V] weights -> their transport-dtype bits as a host int16 array (one device-to-host copy)."""
    return weights.detach().to(dtype).cpu().contiguous().view(torch.int16).numpy()


def _sparse_is_smaller(nonzeros: int, rows: int, vocab: int) -> bool:
    """6 bytes a nonzero (int32 column, fp16 value) and 4 a row, against 2 bytes a weight."""
    return 6 * nonzeros + 4 * rows < 2 * rows * vocab


def encode_probs(weights: torch.Tensor | SparseWeights, dtype: torch.dtype = torch.float16,
                 sparse: bool | None = None) -> EncodedProbs:
    """weights [k, V], already rounded by `round_probs(.., dtype)` (draft_sample's q) -> packed bytes.

    sparse=None picks the smaller form; sparse rows need fp16 weights (the only sparse encoding).
    One device-to-host copy; the packing is numpy on the bits (a weight is nonzero when its bits
    other than the sign are; the mask is a bool array: numpy's nonzero of int16 is ~15x slower).
    SparseWeights (draft_rows_to_host's sparse rows) are packed as they are: the same bytes as
    their dense form would give.
    """
    if isinstance(weights, SparseWeights):
        if weights.dtype != torch.float16 or dtype != torch.float16 or sparse is False:
            raise ValueError(f"SparseWeights are packed sparse and float16, not {dtype} (sparse={sparse})")
        return _sparse_encoded(weights.rows, weights.vocab_size, weights.flat, weights.bits)
    rows, vocab = weights.shape
    bits = _bits(weights, dtype)
    nonzero = None
    if sparse is None:
        if dtype == torch.float16:
            nonzero = np.flatnonzero((bits & 0x7FFF) != 0)
            sparse = _sparse_is_smaller(nonzero.size, rows, vocab)
        else:
            sparse = False
    if not sparse:
        name = "DENSE_FP16" if dtype == torch.float16 else "DENSE_BF16"
        return EncodedProbs(name, rows, vocab, bits.astype("<i2", copy=False).tobytes())
    if dtype != torch.float16:
        raise ValueError(f"sparse draft probabilities are float16 only, got {dtype}")
    if nonzero is None:
        nonzero = np.flatnonzero((bits & 0x7FFF) != 0)                     # row-major: columns ascend per row
    return _sparse_encoded(rows, vocab, nonzero, bits.reshape(-1)[nonzero])


def _sparse_encoded(rows: int, vocab: int, flat: np.ndarray, bits: np.ndarray) -> EncodedProbs:
    """SPARSE_FP16 of nonzeros at flat = row * vocab + column (row-major, columns ascending)."""
    lengths = np.bincount(flat // vocab, minlength=rows)
    return EncodedProbs("SPARSE_FP16", rows, vocab, bits.astype("<i2").tobytes(),
                        (flat % vocab).astype("<i4").tobytes(), lengths.astype("<i4").tobytes())


@dataclass(frozen=True)
class SparseWeights:
    """Checked sparse draft weights on the host, [rows, vocab_size] in the transport dtype, as the
    wire carried them (decode_probs(..., keep_sparse=True)): `scatter_rows` writes them into a
    device tensor with one small copy, where a dense decode moves rows x vocab_size values."""
    rows: int
    vocab_size: int
    dtype: torch.dtype
    flat: np.ndarray   # int64 row * vocab_size + column (row-major, columns ascending)
    bits: np.ndarray   # int16: the transport dtype's bits of each value

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.vocab_size)

    def dim(self) -> int:
        return 2

    def dense(self) -> torch.Tensor:
        """[rows, vocab_size] on the host in the transport dtype."""
        bits = np.zeros(self.rows * self.vocab_size, dtype=np.int16)
        bits[self.flat] = self.bits
        return torch.from_numpy(bits).view(self.dtype).reshape(self.rows, self.vocab_size)


def dense_weights(w: torch.Tensor | SparseWeights) -> torch.Tensor:
    """A draft's rows as a dense tensor, whichever form they came in."""
    return w.dense() if isinstance(w, SparseWeights) else w


def nonzero_counts(q: torch.Tensor) -> torch.Tensor | None:
    """Per row of q [R, V] (fp16 draft weights, on its device) how many weights are nonzero, as
    encode_probs counts them (bits other than the sign); None for other dtypes (no sparse form)."""
    if q.dtype != torch.float16:
        return None
    return ((q.view(torch.int16) & 0x7FFF) != 0).sum(1)


def draft_rows_to_host(q: torch.Tensor, lengths: Sequence[int], counts: Sequence[int] | None
                       ) -> list[torch.Tensor | SparseWeights | None]:
    """A step's drafted weights q [R, V] (transport dtype, on the draft's device; R = sum(lengths),
    sequence after sequence) -> per sequence its rows on the host (None where it has none):
    SparseWeights where the sparse encoding is the smaller one, by encode_probs' rule on the
    counts (nonzero_counts, already on the host), else a dense host tensor. The sparse rows'
    nonzeros are found on the device and only they travel: one copy of their flat indices and
    bits, where a dense copy moves R x V weights and encode_probs scans them with numpy.
    counts must be nonzero_counts(q)'s: fewer would drop nonzeros, more would leave the -1 padding
    of nonzero_static (refused below), each case moving entries between sequences."""
    vocab = q.shape[1]
    if sum(lengths) != q.shape[0] or (counts is not None and (len(counts) != q.shape[0] or q.dtype != torch.float16)):
        raise ValueError(f"draft_rows_to_host: {q.shape[0]} {q.dtype} rows, lengths summing to {sum(lengths)}, "
                         f"{'no' if counts is None else len(counts)} counts (fp16 rows only)")
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()
    nnz = [0 if counts is None else sum(counts[a:b]) for a, b in zip(starts, starts[1:])]   # per sequence
    sparse = [counts is not None and n > 0 and _sparse_is_smaller(z, n, vocab) for n, z in zip(lengths, nnz)]
    out: list = [None] * len(lengths)
    for want_sparse in (False, True):
        seqs = [i for i, n in enumerate(lengths) if n and sparse[i] == want_sparse]
        if not seqs:
            continue
        rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
        sub = q if len(rows) == q.shape[0] else q.index_select(0, to_device(torch.tensor(rows), q.device))
        if not want_sparse:
            for i, part in zip(seqs, sub.cpu().split([lengths[i] for i in seqs])):
                out[i] = part
            continue
        total = sum(nnz[i] for i in seqs)
        bits = sub.view(torch.int16).reshape(-1)
        # nonzero_static: the size is known from the counts, so no second sync to learn it.
        flat = torch.nonzero_static((bits & 0x7FFF) != 0, size=total).squeeze(1)   # row-major: ascending
        host = torch.cat([flat, bits[flat].to(torch.int64)]).cpu().numpy()
        flat_h, bits_h = host[:total], host[total:].astype(np.int16)
        if total and flat_h.min() < 0:
            raise ValueError("draft_rows_to_host: counts above the rows' nonzeros")
        at, row0 = 0, 0
        for i in seqs:
            n, z = lengths[i], nnz[i]
            out[i] = SparseWeights(n, vocab, torch.float16, flat_h[at:at + z] - row0 * vocab, bits_h[at:at + z])
            at, row0 = at + z, row0 + n
    return out


def scatter_rows(out: torch.Tensor, parts: list[tuple[int, SparseWeights]]) -> None:
    """Writes each part's weights into out [R, V] (zeros where they go) from row `offset` on,
    with one staged copy of the indices and one of the values. A part's vocabulary may be narrower
    than V (its ids keep their numbers) or wider: entries at ids >= V are dropped, as the dense path
    cuts its columns (the target checked before that they carry no mass; -0.0 or 0.0 entries may
    still be listed there)."""
    if not parts:
        return
    v = out.shape[1]
    idx, vals = [], []
    for off, w in parts:
        rows, cols = w.flat // w.vocab_size, w.flat % w.vocab_size
        keep = cols < v
        idx.append(((off + rows) * v + cols)[keep])
        vals.append(torch.from_numpy(w.bits[keep]).view(w.dtype).to(out.dtype))
    flat = np.concatenate(idx)
    if flat.size and (flat.min() < 0 or flat.max() >= out.numel()):
        raise ValueError(f"scatter_rows: rows past the {out.shape[0]} of out")
    out.view(-1)[to_device(torch.from_numpy(flat), out.device)] = to_device(torch.cat(vals), out.device)


def decode_probs(values: bytes, rows: int, vocab_size: int, encoding: str = "DENSE_FP16",
                 indices: bytes = b"", row_lengths: bytes = b"",
                 device: torch.device | str = "cpu", *, max_vocab: int | None = None,
                 expected_rows: int | None = None, dtype: torch.dtype | None = torch.float32,
                 keep_sparse: bool = False) -> torch.Tensor | SparseWeights:
    """Packed bytes -> weights [rows, vocab_size] on device, exactly what was encoded: float32, or
    with dtype=None the transport dtype itself (half the bytes to move; exact either way). With
    keep_sparse, a sparse encoding comes back checked but sparse (SparseWeights, on the host).

    Validates on the host (the bytes come from the network) before one host-to-device copy, on the
    int16 bits with numpy: finite and >= 0 (-0.0 allowed) is 0 <= bits < exponent mask, or -0.0.
    The shape is checked against expected_rows and max_vocab before anything is allocated: the
    sparse form allocates rows x vocab_size weights that no byte count bounds.
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
    wire_dtype = TRANSPORT_DTYPES.get(encoding, torch.float16)
    if encoding in TRANSPORT_DTYPES:
        if len(values) != 2 * rows * vocab_size:
            fail("values", f"{encoding} needs {2 * rows * vocab_size} bytes for {rows} x {vocab_size}, "
                           f"got {len(values)}")
        bits = np.frombuffer(values, dtype="<i2").astype(np.int16)  # a writable native copy
        _check_weights(bits, wire_dtype, fail)
        has_mass = bits.reshape(rows, vocab_size).max(axis=1) > 0 if rows else None
    else:
        try:
            flat = sparse_positions(rows, vocab_size, row_lengths, indices, len(values))
        except WireError as e:
            raise ProbsDecodeError(f"draft_probs.{e}") from None
        vals = np.frombuffer(values, dtype="<i2").astype(np.int16)
        _check_weights(vals, wire_dtype, fail)
        has_mass = np.zeros(rows, dtype=bool)
        has_mass[flat[vals > 0] // vocab_size] = True
    if rows and not has_mass.all():  # non-negative weights: mass iff some bits are positive
        fail("values", "every row needs some probability mass")
    if encoding not in TRANSPORT_DTYPES:
        if keep_sparse:
            return SparseWeights(rows, vocab_size, wire_dtype, flat, vals)
        bits = np.zeros(rows * vocab_size, dtype=np.int16)
        bits[flat] = vals
    w = torch.from_numpy(bits).view(wire_dtype).reshape(rows, vocab_size)
    w = to_device(w, device)
    return w if dtype is None else w.to(dtype)


def _check_weights(bits: np.ndarray, dtype: torch.dtype, fail) -> None:
    """Every weight finite and >= 0: as int16 bits, 0 <= b < the exponent mask, or exactly -0.0."""
    if not bits.size:
        return
    if int(bits.max()) >= _EXP_MASK[dtype] or (int(bits.min()) < 0 and (bits[bits < 0] != _NEG_ZERO).any()):
        fail("values", "must be finite and >= 0")
