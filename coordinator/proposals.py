"""A draft server's answer for one sequence, checked before the target sees it.

The draft is optional and never trusted: a proposal with the wrong number of tokens, an id outside
the vocabulary or probabilities that do not describe the drafts would make the target fail the
sequence or reject the whole Verify request. A bad proposal is only that sequence's draft failing;
it goes on by plain decoding, which is exact.

Probabilities are required for a sampled sequence (without them the target would take the drafts
as chosen deterministically, which is not lossless for a sampling draft) and optional for a greedy
one. Their packing is checked by size, which costs nothing; dense values are not scanned (that
would cost a pass over k x V numbers per sequence per step), the target checks them.
"""
from __future__ import annotations

import numpy as np

from protos import specdec_pb2 as pb
from protos.wire import WireError, outside_vocab, sparse_positions, unpack_ids

_DENSE = (pb.PROBS_ENCODING_DENSE_FP16, pb.PROBS_ENCODING_DENSE_BF16)


class BadProposal(ValueError):
    """The draft's result for one sequence is unusable; the message says why."""


def checked_proposal(r: pb.DraftResult, seq_id: int, num_draft: int, vocab_size: int,
                     sampled: bool) -> tuple[list[int], pb.Probs | None]:
    """The drafted ids and the probabilities to forward to the target (None: deterministic drafts)."""
    if r.seq_id != seq_id:
        raise BadProposal(f"result for sequence {r.seq_id} in the place of {seq_id}")
    try:
        tokens = unpack_ids(r.tokens, "tokens")
    except WireError as e:
        raise BadProposal(str(e)) from None
    if len(tokens) != num_draft:
        raise BadProposal(f"{len(tokens)} tokens for num_draft {num_draft}")
    bad = outside_vocab(tokens, vocab_size)
    if bad is not None:
        raise BadProposal(f"token id {bad} outside the vocabulary 0..{vocab_size - 1}")
    has_probs = r.HasField("probs") and r.probs.encoding != pb.PROBS_ENCODING_UNSPECIFIED
    if not has_probs:
        if sampled:
            raise BadProposal("no probabilities for a sampled sequence")
        return tokens, None
    _check_probs(r.probs, num_draft, vocab_size)
    return tokens, r.probs


def _check_probs(probs: pb.Probs, rows: int, vocab_size: int) -> None:
    if probs.rows != rows or probs.vocab_size != vocab_size:
        raise BadProposal(f"probs: {probs.rows} x {probs.vocab_size} for {rows} drafts x "
                          f"vocab_size {vocab_size}")
    if probs.encoding in _DENSE:
        if len(probs.values) != 2 * rows * vocab_size:
            raise BadProposal(f"probs.values: {len(probs.values)} bytes for {rows} x {vocab_size} "
                              "16-bit values")
        return
    if probs.encoding != pb.PROBS_ENCODING_SPARSE_FP16:
        raise BadProposal(f"probs.encoding: unknown value {probs.encoding}")
    try:
        sparse_positions(rows, vocab_size, probs.row_lengths, probs.indices, len(probs.values))
    except WireError as e:
        raise BadProposal(f"probs.{e}") from None
    values = np.frombuffer(probs.values, dtype="<f2")
    if not (np.isfinite(values) & (values >= 0)).all():
        raise BadProposal("probs.values: must be finite and >= 0")


def probs_row(probs: pb.Probs, i: int) -> pb.Probs:
    """Row i of a checked Probs (see _check_probs) as a single-row Probs, bytes as received: a
    pipelined proposal's rows are verified over two steps (the first is the draft's guess of the
    target's token, the rest the next step's drafts). Only the rows a step sends are cut."""
    v = probs.vocab_size
    if probs.encoding in _DENSE:
        return pb.Probs(encoding=probs.encoding, rows=1, vocab_size=v, values=probs.values[2 * v * i:2 * v * (i + 1)])
    lengths = np.frombuffer(probs.row_lengths, dtype="<i4", count=i + 1).astype(np.int64)
    end = int(lengths.sum())
    a = end - int(lengths[i])
    return pb.Probs(encoding=probs.encoding, rows=1, vocab_size=v, indices=probs.indices[4 * a:4 * end],
                    values=probs.values[2 * a:2 * end], row_lengths=probs.row_lengths[4 * i:4 * i + 4])


def probs_join(rows: list[pb.Probs]) -> pb.Probs:
    """Rows of one encoding and vocabulary (probs_row's) as one Probs."""
    first = rows[0]
    if any((r.encoding, r.vocab_size) != (first.encoding, first.vocab_size) for r in rows):
        raise ValueError("probs_join: rows of different encodings or vocabularies")
    return pb.Probs(encoding=first.encoding, rows=sum(r.rows for r in rows), vocab_size=first.vocab_size,
                    values=b"".join(r.values for r in rows), indices=b"".join(r.indices for r in rows),
                    row_lengths=b"".join(r.row_lengths for r in rows))
