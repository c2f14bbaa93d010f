"""Review of 9af7806 (sparse draft rows scattered on the target's device): the sparse path must give
bit for bit the draft-probability tensor the dense path gives, and fail on bad input the same way.

The first two cover row offsets, narrower vocabularies, -0.0, greedy rows with or without probs,
sequences with 0 drafts, bf16 dense rows beside fp16 sparse ones and decode validation. The last
three failed on 9af7806 (a helper's review; fixed in scatter_rows): a SparseWeights block wider
than the target's vocabulary, holding explicit zero / -0.0 entries at ids >= V (no mass there, so
`_plan` admits it, as it admits the same dense tensor), was scattered at flat index row * V + col
with col >= V: into the next row, or past the end of the tensor (IndexError on CPU; a device-side
assert on CUDA). Not reachable from the wire (the servicer bounds vocab_size by the target's)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import TargetEngine, VerifySeqInput
from specdec.engine.target import Plan, _mass_beyond
from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection import one_hot_probs
from specdec.sampling.transport import ProbsDecodeError, SparseWeights, decode_probs
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import make_checkpoint

V = 12
SAMPLED = SamplingParams(temperature=1.0, seed=3)


def dense_reference(plans, v: int) -> torch.Tensor | None:
    """TargetEngine._draft_probs before 9af7806, with SparseWeights densified on the host (what
    SPECDEC_SPARSE_DRAFT_PROBS=0 decodes)."""
    if all(p.seq.sampling.greedy or not p.seq.draft_tokens for p in plans):
        return None
    rows = []
    for p in plans:
        if not p.seq.draft_tokens:
            continue
        if p.seq.sampling.greedy:
            rows.append(one_hot_probs(torch.tensor(p.seq.draft_tokens), v))
            continue
        q = p.seq.draft_probs
        q = q.dense() if isinstance(q, SparseWeights) else q.cpu()
        q = q[:, :v] if q.shape[1] >= v else torch.nn.functional.pad(q, (0, v - q.shape[1]))
        rows.append(q)
    return torch.cat(rows).float()


def sparse_kwargs(bits: np.ndarray, keep: np.ndarray, rows: int, vocab: int) -> dict:
    """SPARSE_FP16 fields holding bits.flat[keep] (keep: flat row-major positions, may name zeros)."""
    return dict(values=bits.reshape(-1)[keep].astype("<i2").tobytes(), rows=rows, vocab_size=vocab,
                encoding="SPARSE_FP16", indices=(keep % vocab).astype("<i4").tobytes(),
                row_lengths=np.bincount(keep // vocab, minlength=rows).astype("<i4").tobytes(), dtype=None)


def stub_engine(v: int = V):
    return types.SimpleNamespace(vocab_size=v, device=torch.device("cpu"))


def draft_probs(plans, v: int = V):
    return TargetEngine._draft_probs(stub_engine(v), plans)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_sparse_rows_match_the_dense_decode_bit_for_bit_in_mixed_batches():
    """Random batches: sparse / dense fp16 / dense bf16 / greedy (with or without probs) / 0-draft
    sequences, narrower draft vocabularies, -0.0 weights, explicit zero entries inside the target
    vocabulary, wider blocks with nothing stored past the target's ids."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        plans = []
        for i in range(int(rng.integers(1, 6))):
            k, greedy = int(rng.integers(0, 4)), bool(rng.random() < .3)
            vocab = int(rng.integers(1, V + 1)) if rng.random() < .8 else V + int(rng.integers(1, 6))
            w = torch.from_numpy(rng.random((k, vocab)) * (rng.random((k, vocab)) < .4)).float()
            w[torch.from_numpy(rng.random((k, vocab)) < .1)] = -0.0
            w[:, 0] = 0.01 + w[:, 0].abs()
            w[:, V:] = 0.0
            bits = w.half().view(torch.int16).numpy().reshape(-1)
            explicit = (rng.random(bits.size) < .1) & (np.arange(bits.size) % vocab < V)  # zeros inside V only
            keep = np.flatnonzero((bits != 0) | explicit)
            kind = rng.choice(["sparse", "fp16", "bf16", "none"])
            if kind == "sparse":
                q = decode_probs(keep_sparse=True, **sparse_kwargs(bits, keep, k, vocab))
                assert isinstance(q, SparseWeights)
            elif kind == "fp16":
                q = decode_probs(**sparse_kwargs(bits, keep, k, vocab))
            elif kind == "bf16" and not greedy:
                q = w.to(torch.bfloat16)
            else:
                q = None if greedy else w.half()
            toks = [int(t) for t in rng.integers(0, V, k)]
            plans.append(Plan(i, VerifySeqInput(i, [1], toks, q, SamplingParams() if greedy else SAMPLED,
                                                first=True), 0))
        want, got = dense_reference(plans, V), draft_probs(plans)
        assert (want is None) == (got is None)
        if want is not None:
            assert same_bits(got, want)


def test_keep_sparse_fails_and_decodes_exactly_as_the_dense_decode():
    rng = np.random.default_rng(0)
    special = np.array([0, -0x8000, 1, 0x3C00, 0x7BFF, 0x7C00, 0x7E00, -1, -0x7C00, 0x0400, -0x7FFF], np.int16)
    valid = 0
    for _ in range(3000):
        rows, vocab = int(rng.integers(0, 4)), int(rng.integers(1, 7))
        lengths = rng.integers(-1 if rng.random() < .02 else 0, vocab + (2 if rng.random() < .02 else 1), rows)
        nnz = int(max(lengths.sum(), 0))
        cols = rng.integers(-1 if rng.random() < .03 else 0, vocab + (1 if rng.random() < .03 else 0), nnz)
        vals = np.where(rng.random(nnz) < .4, rng.choice(special, nnz), rng.integers(0, 0x7C00, nnz)).astype(np.int16)
        kw = dict(values=vals.astype("<i2").tobytes(), rows=rows, vocab_size=vocab, encoding="SPARSE_FP16",
                  indices=cols.astype("<i4").tobytes(), row_lengths=lengths.astype("<i4").tobytes(), dtype=None)
        outcomes = []
        for keep_sparse in (False, True):
            try:
                outcomes.append(decode_probs(keep_sparse=keep_sparse, **kw))
            except ProbsDecodeError as e:
                outcomes.append(str(e))
        dense, sparse = outcomes
        if isinstance(dense, str):
            assert sparse == dense
            continue
        valid += 1
        assert isinstance(sparse, SparseWeights)
        assert torch.equal(sparse.dense().view(torch.int16), dense.view(torch.int16))
        for v in range(vocab + 1):
            assert _mass_beyond(sparse, v) == _mass_beyond(dense, v)
    assert valid > 500


def wide_block(zero_bits: int, row: int):
    """2 rows over V + 4 ids, mass inside V only; an explicit entry (bits zero_bits: 0.0 or -0.0) at
    id V + 1 of `row`. Returns the sparse and the dense decode of the same bytes."""
    w = torch.zeros(2, V + 4, dtype=torch.float16)
    w[0, 2], w[1, 3], w[1, 5] = 1.0, 0.25, 0.75
    bits = w.view(torch.int16).numpy().reshape(-1).copy()
    bits[row * (V + 4) + V + 1] = zero_bits
    keep = np.sort(np.concatenate([np.flatnonzero(bits & 0x7FFF), [row * (V + 4) + V + 1]]))
    kw = sparse_kwargs(bits, keep, 2, V + 4)
    return decode_probs(keep_sparse=True, **kw), decode_probs(**kw)


@pytest.mark.parametrize("zero_bits", [0, -0x8000], ids=["0.0", "-0.0"])
def test_wide_sparse_block_with_a_zero_past_the_target_vocab_in_its_last_row(zero_bits):
    """Failed on 9af7806: IndexError (index 17 out of bounds for 2 x 12) in scatter_rows; the dense
    tensor of the same bytes is admitted and truncated to V. On CUDA this is a device-side assert."""
    sparse, dense = wide_block(zero_bits, row=1)
    assert not _mass_beyond(sparse, V) and not _mass_beyond(dense, V)   # _plan admits both
    plans = lambda q: [Plan(0, VerifySeqInput(0, [1], [2, 3], q, SAMPLED, first=True), 0)]  # noqa: E731
    want = dense_reference(plans(dense), V)
    assert same_bits(draft_probs(plans(dense)), want)
    assert same_bits(draft_probs(plans(sparse)), want)


def test_wide_sparse_block_with_a_zero_past_the_target_vocab_spills_into_the_next_row():
    """Failed on 9af7806: the -0.0 at (row 0, id V + 1) was written at (row 1, id 1): -0.0 where the
    dense decode has +0.0. (Where the landing cell holds a real weight, CPU's last write happens to
    keep it; CUDA's index_put_ with duplicate indices keeps either, i.e. may zero a drafted token.)"""
    sparse, dense = wide_block(-0x8000, row=0)
    plans = [Plan(0, VerifySeqInput(0, [1], [2, 3], sparse, SAMPLED, first=True), 0)]
    want = dense_reference([Plan(0, VerifySeqInput(0, [1], [2, 3], dense, SAMPLED, first=True), 0)], V)
    got = draft_probs(plans)
    assert not torch.signbit(got[1, 1]), "-0.0 from row 0's id V + 1 landed in row 1"
    assert same_bits(got, want)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("review") / "target", vocab_size=64, layers=1, seed=1)
    return TargetEngine(EngineConfig(model=path, block_size=4, num_blocks=32, warmup_batch_sizes=(1,)))


def test_engine_verify_fails_the_whole_step_on_a_wide_sparse_block(target):
    """Failed on 9af7806: TargetEngine.verify raised IndexError for the whole batch (the good
    sequence beside it too) where the dense tensor of the same bytes verifies normally. (With the
    wide block first instead, its stray entry lands in the dense row and index_copy_ hides it.)"""
    v = target.vocab_size
    w = torch.zeros(2, v + 8, dtype=torch.float16)
    w[0, 7], w[1, 9] = 1.0, 1.0
    bits = w.view(torch.int16).numpy().reshape(-1).copy()
    at = 1 * (v + 8) + v + 3                                       # last row, id v + 3: -0.0
    bits[at] = -0x8000
    kw = sparse_kwargs(bits, np.sort(np.concatenate([np.flatnonzero(bits & 0x7FFF), [at]])), 2, v + 8)
    results = []
    for q in (decode_probs(**kw), decode_probs(keep_sparse=True, **kw)):
        good = torch.zeros(1, v, dtype=torch.float16)
        good[0, 4] = 1.0
        seqs = [VerifySeqInput(2, [3, 3], [4], good, SAMPLED, first=True),      # a good sequence first
                VerifySeqInput(1, [5, 6, 7], [7, 9], q, SAMPLED, first=True)]
        try:
            out = target.verify(seqs).outputs
            results.append([(o.error, o.accepted, o.next_token) for o in out])
        except IndexError as e:
            results.append(f"verify raised IndexError: {e}")
        target.release([1, 2])
    assert not isinstance(results[0], str) and all(e is None for e, _, _ in results[0])
    assert results[1] == results[0]
