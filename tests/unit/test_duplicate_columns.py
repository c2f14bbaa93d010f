"""A sparse draft row that names one column twice is refused, by the coordinator
(proposals.checked_proposal) and by the target's decode (transport.decode_probs), whatever the
order of the columns; distinct columns in any order are accepted. Both use
protos.wire.repeats_a_column, whose one-pass answer for increasing positions (what the encoders
write) must agree with sorting."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.proposals import BadProposal, checked_proposal
from protos import specdec_pb2 as pb
from protos.wire import pack_ids, repeats_a_column
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
