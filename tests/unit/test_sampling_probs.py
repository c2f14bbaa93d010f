"""Logits -> probabilities (against transformers' warpers), transport encoding, counter-based RNG."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.sampling.draft import draft_sample
from specdec.sampling.params import SamplingParams
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import (ACCEPT, DRAFT, RESAMPLE, seed_to_int64, uniform, uniform_host,
                                  uniform_reference)
from specdec.sampling.transport import SparseWeights, scatter_rows
from specdec.sampling.transport import (ProbsDecodeError, decode_probs, encode_probs, normalize,
                                        round_probs, sample_from)

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=2.0, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=1000),
]


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = TemperatureLogitsWarper(p.temperature)(None, logits[None].clone())
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(None, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(None, x)
    if p.min_p:
        x = MinPLogitsWarper(p.min_p)(None, x)
    return x.softmax(-1)[0]


def test_mixed_batch_matches_transformers_row_by_row():
    logits = torch.randn(len(PARAMS), 64, generator=torch.Generator().manual_seed(0)) * 3
    probs = logits_to_probs(logits, SamplingTensors.from_params(PARAMS))
    for row, p in enumerate(PARAMS):
        ref = hf_probs(logits[row], p)
        assert torch.equal(probs[row] > 0, ref > 0), p
        torch.testing.assert_close(probs[row], ref, rtol=1e-5, atol=1e-7)
        alone = logits_to_probs(logits[row:row + 1], SamplingTensors.from_params([p]))[0]
        torch.testing.assert_close(alone, probs[row], rtol=1e-6, atol=0)


def test_top_k_and_greedy_details():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]])
    greedy = logits_to_probs(logits, SamplingTensors.from_params([SamplingParams()]))
    assert greedy.tolist() == [[0, 1, 0, 0, 0]]                          # first argmax on ties
    top2 = logits_to_probs(logits, SamplingTensors.from_params([SamplingParams(temperature=1, top_k=2)]))
    assert (top2[0] > 0).tolist() == [False, True, False, True, False]
    top1_tie = logits_to_probs(logits, SamplingTensors.from_params([SamplingParams(temperature=1, top_k=1)]))
    assert (top1_tie[0] > 0).sum() == 2                                  # ties at the k-th are kept
    top_p1 = logits_to_probs(logits * 30, SamplingTensors.from_params([SamplingParams(temperature=1)]))
    assert (top_p1[0] > 0).sum() == 5                                    # top_p = 1 drops nothing


def test_repeat_expands_rows_for_verify():
    t = SamplingTensors.from_params([SamplingParams(seed=1), SamplingParams(temperature=1, seed=2)])
    r = t.repeat([2, 0])
    assert r.seeds.tolist() == [1, 1] and r.greedy.tolist() == [True, True]
    assert t.repeat([1, 3]).temperature.tolist() == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounding_is_idempotent_and_normalisation_is_order_independent(dtype):
    probs = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)) * 6, -1)
    w = round_probs(probs, dtype)
    assert torch.equal(round_probs(w, dtype), w)
    assert torch.equal(w.to(dtype).float(), w)
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(2))
    # The float64 row sum of rounded weights is exact, so any summation order gives the same q.
    assert torch.equal(normalize(w[:, perm]), normalize(w)[:, perm])
    halves = w.double()[:, :500].sum(-1) + w.double()[:, 500:].flip(-1).sum(-1)
    assert torch.equal(halves, w.double().sum(-1))


@pytest.mark.parametrize("dtype, sparse, encoding", [
    (torch.float16, False, "DENSE_FP16"), (torch.bfloat16, False, "DENSE_BF16"),
    (torch.float16, True, "SPARSE_FP16")])
def test_encode_decode_is_exact(dtype, sparse, encoding):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3)) * 4
    t = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_k=7, seed=4)] * 3)
    _, q = draft_sample(logits, t, torch.arange(3), dtype)
    enc = encode_probs(q, dtype, sparse=sparse)
    assert enc.encoding == encoding and enc.rows == 3 and enc.vocab_size == 50
    back = decode_probs(enc.values, 3, 50, enc.encoding, enc.indices, enc.row_lengths)
    assert torch.equal(back, q)
    if sparse:
        assert len(enc.values) == 2 * 21 and len(enc.row_lengths) == 12   # 7 nonzeros per row


def test_encoding_choice_and_empty_block():
    dense = torch.softmax(torch.randn(2, 40), -1)
    assert encode_probs(round_probs(dense)).encoding == "DENSE_FP16"
    sparse = torch.zeros(2, 40)
    sparse[:, :3] = 1 / 3
    assert encode_probs(round_probs(sparse)).encoding == "SPARSE_FP16"
    assert encode_probs(round_probs(sparse, torch.bfloat16), torch.bfloat16).encoding == "DENSE_BF16"
    empty = encode_probs(torch.zeros(0, 40))
    assert decode_probs(empty.values, 0, 40, empty.encoding).shape == (0, 40)


def test_decode_rejects_bad_input_naming_the_field():
    good = encode_probs(round_probs(torch.tensor([[0.5, 0.5, 0.0, 0.0]])), sparse=True)
    cases = [
        (dict(values=b"\x00" * 6, encoding="DENSE_FP16"), "draft_probs.values"),
        (dict(values=good.values, encoding="SPARSE_FP32"), "draft_probs.encoding"),
        (dict(values=good.values, encoding="SPARSE_FP16", indices=good.indices), "draft_probs.row_lengths"),
        (dict(values=good.values, encoding="SPARSE_FP16", row_lengths=good.row_lengths,
              indices=(torch.tensor([0, 9], dtype=torch.int32).numpy().tobytes())), "draft_probs.indices"),
        (dict(values=good.values, encoding="SPARSE_FP16", row_lengths=good.row_lengths,
              indices=(torch.tensor([1, 1], dtype=torch.int32).numpy().tobytes())), "draft_probs.indices"),
        (dict(values=torch.tensor([-1.0, 2, 0, 0]).half().numpy().tobytes(), encoding="DENSE_FP16"),
         "draft_probs.values"),
        (dict(values=torch.zeros(4).half().numpy().tobytes(), encoding="DENSE_FP16"), "draft_probs.values"),
        (dict(values=torch.tensor([float("nan"), 1, 0, 0]).half().numpy().tobytes(), encoding="DENSE_FP16"),
         "draft_probs.values"),
        # several faults: the layout (indices) is reported before the weights
        (dict(values=torch.tensor([1.0, float("inf")]).half().numpy().tobytes(), encoding="SPARSE_FP16",
              row_lengths=good.row_lengths, indices=(torch.tensor([0, 0], dtype=torch.int32).numpy().tobytes())),
         "draft_probs.indices"),
    ]
    for kwargs, field in cases:
        for keep_sparse in (False, True):   # the target's sparse path checks exactly the same
            with pytest.raises(ProbsDecodeError, match=f"^{field}: "):
                decode_probs(rows=1, vocab_size=4, keep_sparse=keep_sparse, **kwargs)


def test_sparse_rows_scatter_to_the_dense_decode():
    """keep_sparse keeps a sparse block sparse (dense encodings still decode densely); scatter_rows
    writes blocks at row offsets of a wider tensor, bit for bit the dense decode, zeros elsewhere."""
    gen = torch.Generator().manual_seed(8)
    blocks = []
    for rows, vocab in [(3, 50), (2, 40), (1, 50)]:     # the middle one: a narrower draft vocabulary
        logits = torch.randn(rows, vocab, generator=gen) * 4
        t = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_k=5, seed=4)] * rows)
        _, q = draft_sample(logits, t, torch.arange(rows))
        blocks.append(encode_probs(q, sparse=True))
    dense = [decode_probs(e.values, e.rows, e.vocab_size, e.encoding, e.indices, e.row_lengths, dtype=None)
             for e in blocks]
    kept = [decode_probs(e.values, e.rows, e.vocab_size, e.encoding, e.indices, e.row_lengths, dtype=None,
                         keep_sparse=True) for e in blocks]
    assert all(isinstance(k, SparseWeights) and k.shape == d.shape and torch.equal(k.dense(), d)
               for k, d in zip(kept, dense))
    out = torch.zeros(6, 50)
    scatter_rows(out, [(0, kept[0]), (3, kept[1]), (5, kept[2])])
    want = torch.cat([dense[0].float(), torch.nn.functional.pad(dense[1].float(), (0, 10)), dense[2].float()])
    assert torch.equal(out, want)
    d = encode_probs(round_probs(torch.softmax(torch.randn(2, 40), -1)))
    assert isinstance(decode_probs(d.values, 2, 40, d.encoding, keep_sparse=True), torch.Tensor)


def test_sample_from_never_draws_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.4999, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    assert sample_from(probs, u).tolist() == [1, 1, 3, 3]


def test_uniforms_match_reference_and_are_keyed():
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 123456789]
    positions = [0, 1, 7, 100, 10**6, 2**40]
    s = torch.tensor([seed_to_int64(x) for x in seeds])
    pos = torch.tensor(positions)
    for purpose in (DRAFT, ACCEPT, RESAMPLE):
        got = uniform(s, pos, purpose).tolist()
        assert got == [uniform_reference(a, b, purpose) for a, b in zip(seeds, positions)]
        # the host version the graphed sampler stages: the same bits, one purpose per row
        assert uniform_host(s.tolist(), positions, [purpose] * len(seeds)).tolist() == got
    mixed = [DRAFT, RESAMPLE, ACCEPT, RESAMPLE, DRAFT, DRAFT]
    assert uniform_host(s.tolist(), positions, mixed).tolist() == [
        uniform_reference(a, b, p) for a, b, p in zip(seeds, positions, mixed)]
    u = uniform(torch.arange(100_000), torch.zeros(100_000, dtype=torch.int64), DRAFT)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    a, b = uniform(s, pos, DRAFT), uniform(s, pos, ACCEPT)
    assert not torch.equal(a, b)
    assert torch.equal(uniform(s[2:4], pos[2:4], DRAFT), a[2:4])          # batch composition


@pytest.mark.gpu
def test_uniforms_and_probs_same_on_cuda():
    s = torch.tensor([seed_to_int64(x) for x in (0, 2**64 - 1, 99)])
    pos = torch.tensor([0, 5, 2**40])
    assert torch.equal(uniform(s.cuda(), pos.cuda(), ACCEPT).cpu(), uniform(s, pos, ACCEPT))
    w = round_probs(torch.softmax(torch.randn(8, 32000) * 5, -1))
    assert torch.equal(normalize(w.cuda()).cpu(), normalize(w))


@pytest.mark.parametrize("dtype, encoding", [(torch.float16, "DENSE_FP16"), (torch.bfloat16, "DENSE_BF16"),
                                             (torch.float16, "SPARSE_FP16")])
def test_decode_validates_on_the_bits_as_the_float_rule_would(dtype, encoding):
    """decode_probs checks "finite and >= 0, some mass per row" on the int16 bits: the same verdict
    as the float comparisons, at the edges (-0.0, the smallest subnormal, the largest finite value,
    inf, NaN, negatives), in both dtypes; dtype=None returns the transport dtype, bit for bit."""
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # smallest subnormal
    big = torch.finfo(dtype).max
    for row, ok in [([0.5, -0.0, 0.0, tiny], True), ([big, 0.0, 0.0, 0.0], True), ([tiny, 0.0, 0.0, 0.0], True),
                    ([-0.0, 0.0, -0.0, 0.0], False), ([float("inf"), 1, 0, 0], False),
                    ([float("nan"), 1, 0, 0], False), ([-tiny, 1, 0, 0], False), ([-2.0, 4, 0, 0], False)]:
        w = torch.tensor([row], dtype=dtype)
        if encoding == "SPARSE_FP16":  # every column listed, zeros included: the decoder must cope
            args = dict(values=w.view(torch.int16).numpy().tobytes(),
                        indices=np.arange(4, dtype="<i4").tobytes(), row_lengths=np.array([4], "<i4").tobytes())
        else:
            args = dict(values=w.view(torch.int16).numpy().tobytes())
        if ok:
            back = decode_probs(rows=1, vocab_size=4, encoding=encoding, dtype=None, **args)
            assert back.dtype == dtype and torch.equal(back.view(torch.int16), w.view(torch.int16))
            assert torch.equal(decode_probs(rows=1, vocab_size=4, encoding=encoding, **args), w.float())
        else:
            with pytest.raises(ProbsDecodeError, match="^draft_probs.values: "):
                decode_probs(rows=1, vocab_size=4, encoding=encoding, **args)
