"""Malformed draft probabilities and packed ids, through the target servicer's step (convert + engine):
each bad sequence gets its own INVALID_ARGUMENT naming the field, the rest of the batch is served,
nothing is allocated from a claimed shape, and the KV is all free after release."""
from __future__ import annotations

import resource
import time

import numpy as np
import pytest
import torch

from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from specdec.sampling.transport import ProbsDecodeError, decode_probs
from target_server.servicer import TargetServicer
from tests.helpers.servicers import servicer_pair
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: this module runs single-threaded)

V = 320  # make_pair's vocabulary
INVALID = 3
SAMPLED = pb.SamplingParams(temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def servicers(tmp_path_factory):
    return servicer_pair(tmp_path_factory.mktemp("pair"))


def uniform_dense(rows: int, vocab: int = V) -> pb.Probs:
    values = np.full(rows * vocab, 1.0 / vocab, dtype="<f2").tobytes()
    return pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=rows, vocab_size=vocab, values=values)


def one_nonzero_sparse(vocab: int) -> pb.Probs:
    """One row with one nonzero: a few bytes that claim a [1, vocab] block."""
    return pb.Probs(encoding=pb.PROBS_ENCODING_SPARSE_FP16, rows=1, vocab_size=vocab,
                    values=np.array([1.0], dtype="<f2").tobytes(), indices=pack_ids([3]),
                    row_lengths=pack_ids([1]))


def good(seq_id: int) -> pb.VerifySeq:
    return pb.VerifySeq(seq_id=seq_id, new_tokens=pack_ids([5, 17, 42]), draft_tokens=pack_ids([9]),
                        draft_probs=uniform_dense(1), sampling=SAMPLED, first=True)


def step(servicer, request):
    """One step as the servicer's stream runs it (step, then its metrics), without a stream."""
    response, decode_seconds = servicer._timed_step(request, time.perf_counter())
    servicer._count(response)
    servicer._account(request, response, decode_seconds)
    return response


def verify(servicer: TargetServicer, seqs, release=()) -> pb.VerifyResponse:
    return step(servicer, pb.VerifyRequest(step=1, seqs=seqs, release=release))


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


BAD = [
    ("huge sparse vocab_size", dict(draft_tokens=pack_ids([9]), draft_probs=one_nonzero_sparse(2**31 - 1)),
     "draft_probs.vocab_size"),
    ("vocab_size over the target's", dict(draft_tokens=pack_ids([9]), draft_probs=uniform_dense(1, V + 8)),
     "draft_probs.vocab_size"),
    ("rows for other draft count", dict(draft_tokens=pack_ids([9]), draft_probs=uniform_dense(2)),
     "draft_probs.rows"),
    ("truncated dense values", dict(draft_tokens=pack_ids([9]), draft_probs=pb.Probs(
        encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=1, vocab_size=V, values=uniform_dense(1).values[:-2])),
     "draft_probs.values"),
    ("truncated sparse row_lengths", dict(draft_tokens=pack_ids([9]), draft_probs=pb.Probs(
        encoding=pb.PROBS_ENCODING_SPARSE_FP16, rows=1, vocab_size=V, row_lengths=b"\x01\0")),
     "draft_probs.row_lengths"),
    ("unknown encoding", dict(draft_tokens=pack_ids([9]), draft_probs=pb.Probs(encoding=7, rows=1, vocab_size=V)),
     "draft_probs.encoding"),
    ("more drafts than max_num_draft", dict(draft_tokens=pack_ids([9] * 5), draft_probs=uniform_dense(5)),
     "draft_tokens"),
    ("truncated draft_tokens", dict(draft_tokens=b"\x09\0"), "draft_tokens"),
    ("truncated new_tokens", dict(new_tokens=b"\x05\0\0"), "new_tokens"),
    ("bad sampling", dict(sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
]


@pytest.mark.parametrize("name, fields, field", BAD, ids=[b[0] for b in BAD])
def test_bad_sequence_fails_alone(servicers, name, fields, field):
    target, _ = servicers
    engine = target.runtime.engine
    bad = pb.VerifySeq(seq_id=1, new_tokens=pack_ids([5, 6]), sampling=SAMPLED, first=True)
    for key, value in fields.items():
        if isinstance(value, pb.Probs) or isinstance(value, pb.SamplingParams):
            getattr(bad, key).CopyFrom(value)
        else:
            setattr(bad, key, value)
    rss, t0 = max_rss_bytes(), time.perf_counter()
    reply = verify(target, [good(2), bad])
    assert time.perf_counter() - t0 < 5
    assert max_rss_bytes() - rss < 256 << 20  # nothing sized by the claimed shape was allocated
    ok, err = reply.results
    assert err.seq_id == 1 and err.error.code == INVALID
    assert err.error.message.startswith(f"seqs[1].{field}"), err.error.message
    assert not ok.HasField("error") and 0 <= ok.accepted <= 1 and 0 <= ok.next_token < V
    assert engine.num_sequences() == 1  # the bad one holds nothing
    verify(target, [], release=[1, 2])
    assert engine.num_free_blocks == engine.runner.blocks.num_blocks


def test_draft_bad_ids_fail_alone(servicers):
    _, draft = servicers
    engine = draft.runtime.engine
    reply = step(draft, pb.ProposeRequest(step=1, seqs=[
        pb.DraftSeq(seq_id=1, new_tokens=b"\x01", num_draft=2, first=True),
        pb.DraftSeq(seq_id=2, new_tokens=pack_ids([5, 17]), num_draft=2, sampling=SAMPLED, first=True),
        pb.DraftSeq(seq_id=3, new_tokens=pack_ids([5]), num_draft=2, first=True,
                    sampling=pb.SamplingParams(top_p=2.0))]))
    bad_ids, ok, bad_sampling = reply.results
    assert bad_ids.error.code == INVALID and bad_ids.error.message.startswith("seqs[0].new_tokens")
    assert bad_sampling.error.code == INVALID and bad_sampling.error.message.startswith("seqs[2].sampling.top_p")
    assert not ok.HasField("error") and len(ok.tokens) == 8 and ok.probs.rows == 2
    assert engine.release([1, 2, 3]) == 1 and engine.num_free_blocks == engine.runner.blocks.num_blocks


def test_decode_checks_the_shape_before_allocating():
    claim = one_nonzero_sparse(2**31 - 1)
    args = (claim.values, claim.rows, claim.vocab_size, "SPARSE_FP16", claim.indices, claim.row_lengths)
    with pytest.raises(ProbsDecodeError, match=r"^draft_probs\.vocab_size: 2147483647 is over"):
        decode_probs(*args, max_vocab=V, expected_rows=1)
    with pytest.raises(ProbsDecodeError, match=r"^draft_probs\.rows: 1 rows for 2 draft tokens"):
        decode_probs(*args, max_vocab=V, expected_rows=2)
    small = one_nonzero_sparse(V)
    w = decode_probs(small.values, 1, V, "SPARSE_FP16", small.indices, small.row_lengths,
                     max_vocab=V, expected_rows=1)
    assert w.shape == (1, V) and w[0, 3] == 1.0 and w.sum() == 1.0
    assert torch.equal(decode_probs(uniform_dense(1).values, 1, V, max_vocab=V, expected_rows=1),
                       torch.full((1, V), np.float16(1.0 / V).item()))
