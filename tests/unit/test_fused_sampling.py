"""The fused sampling kernel (specdec/kernels/sampling.py) under TRITON_INTERPRET=1 (tests/conftest.py
sets it without a GPU): its kept sets against a float64 reference of the documented semantics, its
weights against the reference probabilities, its draws against an exact integer inverse CDF of the
weights it returned, and a row's independence from the rest of its batch. Small vocabularies: the
interpreter runs numpy per program."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.kernels import sampling
from specdec.kernels.sampling import fused_probs, fused_sample
from tests.helpers.fused_sampling import params

CHUNK = 1024          # smaller than the GPU's chunk: the interpreter's time grows with it
V = 2 * CHUNK + 404   # three chunks, the last one ragged


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(sampling, "CHUNK", CHUNK)


def reference(logits: torch.Tensor, row) -> tuple[np.ndarray, np.ndarray, bool]:
    """(kept mask, probabilities, near_tie) of one row by the documented rules in float64; near_tie:
    a top-p boundary within float32 rounding, where either choice is right."""
    temp, k, top_p, min_p, greedy = row
    l = logits.double().numpy()
    if greedy:
        keep = np.zeros(l.shape, bool)
        keep[int(np.argmax(l))] = True
        return keep, keep.astype(float), False
    x = (logits.float() * torch.tensor(1.0 / temp, dtype=torch.float32)).double().numpy()
    keep = np.ones(x.shape, bool)
    if 0 < k < x.size:
        kth = np.sort(x)[::-1][k - 1]
        keep &= x >= kth
    e = np.exp(x - x.max())
    near = False
    if top_p < 1:
        ek = np.where(keep, e, 0.0)
        above = np.array([ek[x > xi].sum() for xi in x])   # mass strictly larger
        c = top_p * ek.sum()
        keep &= above < c
        near = bool(np.any(np.abs(above - c) < 1e-5 * c))
    keep &= e >= min_p
    p = np.where(keep, e, 0.0)
    return keep, p / p.sum(), near


def int_units(q: torch.Tensor) -> np.ndarray:
    scale = 2 ** 24 if q.dtype == torch.float16 else 2 ** 47
    return np.array([int(v * scale) for v in q.double().tolist()], dtype=object)


def draw(q_row: torch.Tensor, u: float) -> int:
    """Exact inverse CDF over the integer weights."""
    n = int_units(q_row)
    total = int(sum(n))
    target = min(int(u * float(total)), total - 1)
    c = 0
    for i, w in enumerate(n):
        c += int(w)
        if c > target:
            return i
    raise AssertionError("no token")


ROWS = [
    (1.0, 0, 1.0, 0.0, True),        # greedy
    (0.8, 0, 1.0, 0.0, False),       # temperature only
    (0.8, 50, 1.0, 0.0, False),      # the e2e setting
    (1.3, 0, 0.9, 0.0, False),       # top-p alone
    (0.7, 200, 0.8, 0.0, False),     # top-k then top-p
    (1.0, 0, 1.0, 0.05, False),      # min-p
    (2.0, 30, 0.95, 0.01, False),    # everything
    (0.05, 1, 1.0, 0.0, False),      # top-k 1: a one-hot draw
]


def run(logits, rows, dtype=torch.float16, u=None):
    r = logits.shape[0]
    u = torch.rand(r, dtype=torch.float64) if u is None else u
    q = torch.full((r, logits.shape[1]), float("nan"), dtype=dtype)
    tok = torch.full((r,), -1, dtype=torch.int64)
    fused_sample(logits, *params(rows), u, q, tok)
    return q, tok, u


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kept_sets_weights_and_draws(dtype):
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), V) * 3
    q, tok, u = run(logits, ROWS, dtype)
    for i, row in enumerate(ROWS):
        keep, p, near = reference(logits[i], row)
        got = q[i].float().numpy()
        assert np.isfinite(got).all()
        if not near:   # the kept set, up to weights that round to 0 in the transport dtype
            tiny = 2.0 ** -23 if dtype == torch.float16 else 2.0 ** -39
            assert not (got > 0)[~keep].any() and (got > 0)[keep & (p > tiny)].all(), row
        tol = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
        np.testing.assert_allclose(got, p, rtol=tol, atol=2.0 ** -24)
        assert tok[i] == draw(q[i], float(u[i])), row
        assert got[int(tok[i])] > 0
    assert tok[0] == logits[0].argmax() and q[0].float().sum() == 1


def test_ties_at_the_kth_logit_are_all_kept():
    torch.manual_seed(1)
    logits = (torch.randn(3, V) * 2).round()          # integers: many ties everywhere
    rows = [(1.0, 10, 1.0, 0.0, False), (1.0, 300, 1.0, 0.0, False), (1.0, 0, 0.5, 0.0, False)]
    q, _, _ = run(logits, rows)
    for i, (_, k, top_p, _, _) in enumerate(rows):
        x = logits[i]
        if k:
            kth = x.sort(descending=True).values[k - 1]
            assert torch.equal(q[i] > 0, x >= kth)
        else:   # every token of the boundary value kept, none below it
            kept = x[q[i] > 0]
            assert torch.equal(q[i] > 0, x >= kept.min())


def test_greedy_ties_pick_the_first_index():
    logits = torch.zeros(2, V)
    logits[0, [7, 1500, 2400]] = 5.0
    logits[1, [2100, 2200]] = 3.0
    q, tok, _ = run(logits, [(1.0, 0, 1.0, 0.0, True)] * 2)
    assert tok.tolist() == [7, 2100]
    assert q[0, 7] == 1 and q[0].float().sum() == 1


def test_draws_follow_the_weights_exactly():
    """A stratified grid of uniforms: each token is drawn as often as its integer weight's share,
    to within one draw (the inverse CDF is exact, not approximate)."""
    torch.manual_seed(2)
    logits = torch.randn(1, V) * 2
    row = [(1.0, 20, 1.0, 0.0, False)]
    n = 256
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    toks = []
    for j in range(0, n, 32):
        q, tok, _ = run(logits.expand(32, V).contiguous(), row * 32, u=u[j:j + 32])
        toks += tok.tolist()
    w = int_units(q[0])
    total = int(sum(w))
    counts = np.bincount(toks, minlength=V)
    for i in np.flatnonzero(np.array([int(x) for x in w])):
        assert abs(counts[i] - n * int(w[i]) / total) <= 1
    assert counts[np.array([int(x) == 0 for x in w])].sum() == 0


def test_a_row_does_not_depend_on_its_batch():
    torch.manual_seed(3)
    logits = torch.randn(5, V) * 3
    u = torch.rand(5, dtype=torch.float64)
    rows = ROWS[1:6]
    q_all, tok_all, _ = run(logits, rows, u=u)
    for i in (0, 3):
        q_one, tok_one, _ = run(logits[i:i + 1].clone(), rows[i:i + 1], u=u[i:i + 1])
        assert torch.equal(q_one[0], q_all[i]) and tok_one[0] == tok_all[i]


def test_step_rows_and_probs_mode():
    torch.manual_seed(4)
    logits = torch.randn(2, V).to(torch.bfloat16)     # low-precision logits are read as float32
    rows = ROWS[2:4]
    q = torch.full((3, 2, V), float("nan"), dtype=torch.float16)
    tok = torch.full((3, 2), -1, dtype=torch.int64)
    u = torch.rand(2, dtype=torch.float64)
    fused_sample(logits, *params(rows), u, q, tok, step=torch.tensor(1))
    assert torch.isnan(q[0]).all() and torch.isnan(q[2]).all() and (tok[[0, 2]] == -1).all()
    p = fused_probs(logits, *params(rows))
    assert torch.equal(q[1], p.half())               # the same weights before the rounding
    assert torch.allclose(p.double().sum(-1), torch.ones(2, dtype=torch.float64), atol=1e-5)
    for i, row in enumerate(rows):
        keep, ref, near = reference(logits[i].float(), row)
        assert near or np.array_equal(p[i].numpy() > 0, keep)
        assert tok[1, i] == draw(q[1, i], float(u[i]))


def test_the_gpu_chunk_gives_the_same_bits():
    """The chunk size changes the order of the float sums, not the rules: compare kept sets and
    draws at the GPU's chunk (one chunk here) with the small one."""
    torch.manual_seed(6)
    logits = torch.randn(3, V) * 3
    u = torch.rand(3, dtype=torch.float64)
    rows = [ROWS[2], ROWS[4], ROWS[6]]
    q_small, tok_small, _ = run(logits, rows, u=u)
    q = torch.empty_like(q_small)
    tok = torch.empty_like(tok_small)
    fused_sample(logits, *params(rows), u, q, tok, config={"CHUNK": 4096})
    assert torch.equal(q > 0, q_small > 0)
    torch.testing.assert_close(q, q_small, rtol=2.0 ** -10, atol=2.0 ** -24)
    for i in range(3):
        assert tok[i] == draw(q[i], float(u[i]))
