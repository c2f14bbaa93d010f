"""A sparse draft row that names one column twice is refused, by the coordinator
(proposals.checked_proposal) and by the target's decode (transport.decode_probs), whatever the
order of the columns; distinct columns in any order are accepted. Both use
protos.wire.repeats_a_column, whose one-pass answer for increasing positions (what the encoders
write) must agree with sorting, through protos.wire.sparse_positions, which checks the rest of a
sparse block's layout for both and whose every refusal names the field."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.proposals import BadProposal, checked_proposal
from protos import specdec_pb2 as pb
from protos.wire import WireError, pack_ids, repeats_a_column, sparse_positions
from specdec.sampling.transport import ProbsDecodeError, decode_probs

V = 16


def test_one_pass_and_sorting_agree():
    rng = np.random.default_rng(0)
    cases = [np.array([], dtype=np.int64), np.array([5]), np.array([1, 2, 3]), np.array([3, 3]),
             np.array([1, 4, 4, 9]), np.array([9, 1, 4]), np.array([9, 1, 9]), np.array([2, 1])]
    cases += [rng.integers(0, 40, size=rng.integers(2, 12)) for _ in range(200)]
    cases += [np.sort(c) for c in cases[8:]]
    for flat in cases:
        assert repeats_a_column(flat) == (np.unique(flat).size != flat.size), flat


def _sparse(rows_cols: list[list[int]]):
    lengths = [len(c) for c in rows_cols]
    cols = [c for row in rows_cols for c in row]
    values = np.full(len(cols), 0.25, dtype="<f2").tobytes()
    return pb.Probs(encoding=pb.PROBS_ENCODING_SPARSE_FP16, rows=len(rows_cols), vocab_size=V, values=values,
                    indices=pack_ids(cols), row_lengths=np.asarray(lengths, dtype="<i4").tobytes())


@pytest.mark.parametrize("rows_cols,ok", [
    ([[1, 2, 3], [0, 15]], True),
    ([[3, 1, 2], [15, 0]], True),          # unsorted but distinct
    ([[1, 2, 2], [0, 15]], False),         # a repeat next to itself
    ([[2, 1, 2], [0, 15]], False),         # a repeat out of order
    ([[1, 2, 3], [3, 3]], False),          # in the second row
    ([[7], [7]], True),                    # the same column in two rows is no repeat
])
def test_coordinator_and_target_refuse_a_repeated_column(rows_cols, ok):
    probs = _sparse(rows_cols)
    result = pb.DraftResult(seq_id=1, tokens=pack_ids([1] * len(rows_cols)), probs=probs)
    decode = lambda: decode_probs(probs.values, probs.rows, V, "SPARSE_FP16", probs.indices,  # noqa: E731
                                  probs.row_lengths)
    if ok:
        checked_proposal(result, 1, len(rows_cols), V, sampled=True)
        assert decode().shape == (len(rows_cols), V)
    else:
        with pytest.raises(BadProposal, match="twice"):
            checked_proposal(result, 1, len(rows_cols), V, sampled=True)
        with pytest.raises(ProbsDecodeError, match="twice"):
            decode()


def _layout(lengths, cols, n_values=None):
    lengths_b = np.asarray(lengths, dtype="<i4").tobytes()
    return lengths_b, pack_ids(cols), 2 * len(cols) if n_values is None else n_values


def test_sparse_positions_of_a_good_block():
    lengths_b, cols_b, nv = _layout([2, 0, 3], [4, 9, 0, 1, 15])
    assert sparse_positions(3, V, lengths_b, cols_b, nv).tolist() == [4, 9, 2 * V, 2 * V + 1, 2 * V + 15]
    assert sparse_positions(0, V, b"", b"", 0).tolist() == []


BAD_LAYOUTS = {  # name: (rows, (row_lengths, indices, value bytes), field in the message)
    "short row_lengths": (3, (np.asarray([1, 1], dtype="<i4").tobytes(), pack_ids([1, 2]), 4), "row_lengths"),
    "negative length": (2, _layout([-1, 2], [1, 2]), "row_lengths"),
    "length over vocab": (1, _layout([V + 1], list(range(V)) + [0]), "row_lengths"),
    "missing index bytes": (2, _layout([1, 2], [1, 2]), "indices"),
    "missing value bytes": (2, _layout([1, 1], [1, 2], n_values=2), "indices"),
    "column below 0": (1, _layout([2], [-1, 3]), "indices"),
    "column at vocab": (1, _layout([2], [3, V]), "indices"),
    "repeated column": (1, _layout([3], [3, 1, 3]), "indices"),
}


@pytest.mark.parametrize("name", BAD_LAYOUTS)
def test_each_bad_layout_is_refused_naming_its_field_by_both_readers(name):
    rows, (lengths_b, cols_b, nv), field = BAD_LAYOUTS[name]
    with pytest.raises(WireError, match=f"^{field}: "):
        sparse_positions(rows, V, lengths_b, cols_b, nv)
    probs = pb.Probs(encoding=pb.PROBS_ENCODING_SPARSE_FP16, rows=rows, vocab_size=V, values=b"\0" * nv,
                     indices=cols_b, row_lengths=lengths_b)
    result = pb.DraftResult(seq_id=1, tokens=pack_ids([1] * rows), probs=probs)
    with pytest.raises(BadProposal, match=f"^probs.{field}: "):
        checked_proposal(result, 1, rows, V, sampled=True)
    with pytest.raises(ProbsDecodeError, match=f"^draft_probs.{field}: "):
        decode_probs(probs.values, rows, V, "SPARSE_FP16", cols_b, lengths_b)
