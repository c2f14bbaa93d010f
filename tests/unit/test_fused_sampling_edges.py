"""Edge cases of the fused sampling kernel (specdec/kernels/sampling.py) under TRITON_INTERPRET=1:
top-k at and around V, ties, flat and masked rows, extreme temperatures, logits and thresholds,
ragged and tiny vocabularies, low-precision logits, extreme uniforms, a mixed greedy/sampled
batch, and non-finite values. Every case is checked against a float64 reference of the documented
rules (kept set, weights, exact integer inverse-CDF draw).

The tests marked FIXED failed on the first version of the kernel (a review, session 9): a search
that never ended on a non-finite row, NaN weights, the greedy tie rule on a fully masked row. The
kernel now reads NaN as -inf and +inf as the largest float32, and a row with no finite logit takes
id 0. A would-be infinite loop is cut by a SIGALRM timer and reported as a failure instead of
hanging the suite."""
from __future__ import annotations

import contextlib
import signal

import numpy as np
import pytest
import torch

from specdec.kernels import sampling
from specdec.kernels.sampling import fused_probs, fused_sample
from tests.helpers.fused_sampling import params
from specdec.sampling.params import SamplingParams

CHUNK = 256
V = 2 * CHUNK + 77     # three chunks, the last one ragged


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(sampling, "CHUNK", CHUNK)


def reference(logits: torch.Tensor, row):
    """(kept mask, probabilities, near_tie) of one row by the module docstring's rules, float64."""
    temp, k, top_p, min_p, greedy = row
    top_p, min_p = float(np.float32(top_p)), float(np.float32(min_p))   # the kernel's float32 params
    if greedy:
        keep = np.zeros(logits.shape, bool)
        keep[int(np.argmax(logits.float().numpy()))] = True
        return keep, keep.astype(float), False
    x = (logits.float() * torch.tensor(1.0 / temp, dtype=torch.float32)).double().numpy()
    keep = np.ones(x.shape, bool)
    if 0 < k < x.size:
        keep &= x >= np.sort(x)[::-1][k - 1]
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max())
    near = False
    if top_p < 1:
        ek = np.where(keep, e, 0.0)
        above = np.array([ek[x > xi].sum() for xi in x])     # the strictly larger mass
        c = top_p * ek.sum()
        keep &= above < c
        near = bool(np.any(np.abs(above - c) <= 1e-5 * c))
    keep &= e >= min_p
    p = np.where(keep, e, 0.0)
    return keep, p / p.sum(), near


def int_units(q: torch.Tensor) -> list[int]:
    scale = 2 ** 24 if q.dtype == torch.float16 else 2 ** 47
    return [int(v * scale) for v in q.double().tolist()]


def draw(q_row: torch.Tensor, u: float) -> int:
    """Exact inverse CDF over the integer weights."""
    n = int_units(q_row)
    total = sum(n)
    target = min(int(u * float(total)), total - 1)
    c = 0
    for i, w in enumerate(n):
        c += w
        if c > target:
            return i
    raise AssertionError("no token")


def run(logits, rows, dtype=torch.float16, u=None, chunk=CHUNK):
    r, v = logits.shape
    u = torch.rand(r, dtype=torch.float64) if u is None else u
    q = torch.full((r, v), float("nan"), dtype=dtype)
    tok = torch.full((r,), -1, dtype=torch.int64)
    fused_sample(logits, *params(rows), u, q, tok, config={"CHUNK": chunk})
    return q, tok, u


def check(logits, rows, dtype=torch.float16, u=None, chunk=CHUNK):
    """Every row against the reference: finite weights, the kept set (away from a top-p boundary
    within float32 rounding), the weights, and the token = the exact draw, of positive weight."""
    q, tok, u = run(logits, rows, dtype, u, chunk)
    tiny = 2.0 ** -23 if dtype == torch.float16 else 2.0 ** -39
    tol = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    for i, row in enumerate(rows):
        keep, p, near = reference(logits[i], row)
        got = q[i].float().numpy()
        assert np.isfinite(got).all(), row
        if not near:
            assert not (got > 0)[~keep].any(), row
            assert (got > 0)[keep & (p > tiny)].all(), row
        # near a top-p tie the float32 sums (their order set by the chunk) may cut one more or
        # one fewer boundary id: compare the weights on the ids both sides keep there
        both = slice(None) if not near else (got > 0) & keep
        np.testing.assert_allclose(got[both], p[both], rtol=tol, atol=2.0 ** -24, err_msg=str(row))
        t = int(tok[i])
        assert 0 <= t < logits.shape[1] and got[t] > 0, (row, t)
        assert t == draw(q[i], float(u[i])), row
    return q, tok


class _Hang(Exception):
    pass


@contextlib.contextmanager
def must_finish(seconds: float):
    """Fails (instead of hanging forever) when the kernel runs longer than `seconds`; a normal run
    here takes well under a second. The interpreter wraps the alarm's exception."""
    def alarm(*_):
        raise _Hang()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except Exception as e:          # InterpreterError(... _Hang() ...) or _Hang itself
        if isinstance(e, _Hang) or "_Hang" in repr(e):
            pytest.fail(f"the kernel did not finish within {seconds} s (infinite loop in _search)")
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------- cases the kernel gets right

def test_top_k_at_and_around_the_vocabulary_size():
    torch.manual_seed(10)
    logits = torch.randn(1, V) * 3
    logits[0, [5, 300, 580]] = 12.0                   # a three-way tie at the max, across chunks
    rows = [(1.0, V, 1.0, 0.0, False), (1.0, V + 7, 1.0, 0.0, False), (1.0, V - 1, 1.0, 0.0, False),
            (1.0, 1, 1.0, 0.0, False), (1.0, 2, 1.0, 0.0, False), (0.8, 4, 1.0, 0.0, False)]
    x = logits.expand(len(rows), V).contiguous()
    q, _ = check(x, rows)
    p = fused_probs(x, *params(rows))                # float32: no weight rounds to 0
    assert (p[0] > 0).sum() == V and (p[1] > 0).sum() == V
    assert (p[2] > 0).sum() == V - 1 and p[2, logits[0].argmin()] == 0
    for i in (3, 4):                                  # k = 1 and 2 keep the whole tie at the max
        assert torch.equal((q[i] > 0).nonzero().flatten(), torch.tensor([5, 300, 580]))


def test_flat_rows_keep_everything_uniformly():
    logits = torch.zeros(4, V)
    rows = [(1.0, 0, 1.0, 0.0, False), (1.0, 5, 1.0, 0.0, False), (1.0, 0, 0.5, 0.0, False),
            (1.0, 0, 1.0, 0.9, False)]
    q, _ = check(logits, rows)
    assert (q == q[0, 0]).all() and q[0, 0] == torch.tensor(1.0 / V).half()


def test_masked_vocabularies():
    torch.manual_seed(11)
    base = torch.randn(V) * 3
    masked = base.clone()
    masked[100:500] = float("-inf")                  # 189 finite ids left
    floor = base.clone()
    floor[100:500] = torch.finfo(torch.float32).min  # overflows to -inf at temperature 0.5
    logits = torch.stack([masked, masked, masked, masked, floor, floor, masked])
    rows = [(1.0, 0, 1.0, 0.0, False), (1.0, 50, 1.0, 0.0, False),
            (1.0, 300, 1.0, 0.0, False),              # k above the finite count: every finite id
            (0.7, 30, 0.9, 0.05, False), (1.0, 20, 0.9, 0.0, False), (0.5, 0, 0.8, 0.0, False),
            (1.0, 0, 1.0, 0.0, True)]
    q, _ = check(logits, rows)
    assert (q[:, 100:500] == 0).all()
    assert (fused_probs(logits, *params(rows))[2] > 0).sum() == V - 400


def test_extreme_temperatures_and_logits():
    torch.manual_seed(12)
    l = torch.randn(V) * 3
    logits = torch.stack([l, l, l, l, l, l * 1e30, l * 1e30])
    rows = [(0.01, 0, 1.0, 0.0, False), (0.01, 10, 0.9, 0.0, False), (100.0, 0, 1.0, 0.0, False),
            (100.0, 300, 0.5, 0.0, False), (100.0, 0, 1.0, 0.97, False),
            (1.0, 10, 0.9, 0.0, False), (0.01, 0, 1.0, 0.0, False)]
    check(logits, rows)


def test_threshold_extremes():
    torch.manual_seed(13)
    l = torch.randn(V) * 3
    rows = [(1.0, 0, 1.0, 0.999999, False), (1.0, 0, 1.0, 1.0, False), (1.0, 0, 1e-6, 0.0, False),
            (1.0, 0, 0.999999, 0.0, False), (0.3, 0, 0.999999, 0.0, False),
            (1.0, 0, 1 - 2 ** -24, 0.0, False), (1.0, 5, 1e-6, 0.5, False)]
    q, _ = check(l.expand(len(rows), V).contiguous(), rows)
    for i in (0, 1, 2):                               # only the max survives
        assert (q[i] > 0).nonzero().flatten().tolist() == [int(l.argmax())]


@pytest.mark.parametrize("v", [1, 2, CHUNK - 1, CHUNK, CHUNK + 1])
def test_small_and_ragged_vocabularies(v):
    torch.manual_seed(14 + v)
    rows = [(1.0, 0, 1.0, 0.0, False), (0.8, 1, 1.0, 0.0, False), (0.8, 2, 0.5, 0.0, False),
            (1.0, 0, 0.3, 0.1, False), (1.0, 0, 1.0, 0.0, True)]
    logits = torch.randn(len(rows), v) * 3
    check(logits, rows)
    check(logits, rows, dtype=torch.bfloat16, chunk=1024)   # v < CHUNK: one masked chunk


def test_low_precision_logits():
    torch.manual_seed(15)
    rows = [(0.7, 40, 0.9, 0.01, False), (1.0, 7, 1.0, 0.0, False), (1.0, 0, 1.0, 0.0, True)]
    for dt in (torch.float16, torch.bfloat16):
        check((torch.randn(3, V) * 3).to(dt), rows)


def test_bf16_transport_tiny_probabilities():
    """Probabilities down to ~1e-40: the bf16 flush at 2**-40 and zero weights never drawn."""
    torch.manual_seed(16)
    logits = torch.randn(4, V) * 12
    u = torch.tensor([0.0, 0.3, 1 - 2 ** -53, 1.0], dtype=torch.float64)
    q, _ = check(logits, [(1.0, 0, 1.0, 0.0, False)] * 4, dtype=torch.bfloat16, u=u)
    w = q.float()
    assert ((w == 0) | (w >= 2.0 ** -40)).all() and (w == 0).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_uniforms_at_the_ends_pick_the_first_and_last_weighted_ids(dtype):
    torch.manual_seed(17)
    logits = torch.randn(1, V).expand(4, V).contiguous() * 3
    u = torch.tensor([0.0, 2.0 ** -60, 1 - 2 ** -53, 1.0], dtype=torch.float64)
    q, tok = check(logits, [(1.0, 3, 1.0, 0.0, False)] * 4, dtype=dtype, u=u)
    ids = (q[0] > 0).nonzero().flatten()
    assert tok.tolist() == [ids[0], ids[0], ids[-1], ids[-1]]


def test_mixed_greedy_batch_rows_are_independent():
    torch.manual_seed(18)
    logits = (torch.randn(6, V) * 2).round()          # ties everywhere, greedy ties included
    rows = [(1.0, 0, 1.0, 0.0, True), (0.8, 50, 0.9, 0.0, False), (1.0, 0, 1.0, 0.0, True),
            (2.0, 0, 0.5, 0.02, False), (0.01, 1, 1.0, 0.0, False), (1.0, 0, 1.0, 0.0, True)]
    u = torch.rand(6, dtype=torch.float64)
    q_all, tok_all = check(logits, rows, u=u)
    for i in range(6):
        q1, tok1, _ = run(logits[i:i + 1].clone(), rows[i:i + 1], u=u[i:i + 1])
        assert torch.equal(q1[0], q_all[i]) and tok1[0] == tok_all[i]
    p = fused_probs(logits, *params(rows))
    assert torch.equal(p.half(), q_all)


# ---------------------------------------------------------------- FIXED: non-finite rows

def _row_with(value, at=(10,)):
    torch.manual_seed(19)
    l = torch.randn(1, 64) * 3
    l[0, list(at)] = value
    return l


def test_inf_logit_with_top_p_terminates():
    # FIXED (was a hang): a +inf logit made m = inf, e = exp(inf - inf) = NaN, so top_p * Z is NaN; in
    # _search/_narrow (sampling.py:92, 106) both `g >= c` and `g < c` are False for NaN, the
    # bracket never moves and the `while hi - lo > 1` loop never ends (a hung GPU kernel).
    logits = _row_with(float("inf"))
    with must_finish(5):
        q, tok, _ = run(logits, [(1.0, 0, 0.9, 0.0, False)], chunk=64)
    assert torch.isfinite(q.float()).all() and q[0, int(tok[0])] > 0


def test_valid_tiny_temperature_with_top_p_terminates():
    # FIXED (was a hang): SamplingParams accepts temperature=1e-38 (finite, > 0, so not greedy); 1/T = 1e38 in
    # float32 and logit * 1e38 overflows to +-inf for |logit| > 3.4 (sampling.py:70), which hangs
    # the top-p search as above.
    SamplingParams(temperature=1e-38, top_p=0.9)      # valid by the request validation
    logits = _row_with(5.0)
    with must_finish(5):
        q, tok, _ = run(logits, [(1e-38, 0, 0.9, 0.0, False)], chunk=64)
    assert torch.isfinite(q.float()).all() and q[0, int(tok[0])] > 0


def test_nan_logit_with_top_p_terminates():
    # FIXED (was a hang): a NaN logit had a key above every pivot and e = NaN, so every G(t) is NaN and the same
    # loop never ends. (Without top-p the kernel just gives the NaN id weight 0.)
    logits = _row_with(float("nan"))
    with must_finish(5):
        run(logits, [(1.0, 0, 0.9, 0.0, False)], chunk=64)


def test_inf_logit_gives_finite_weights_and_a_weighted_token():
    # FIXED: with a +inf logit and no top-p, m = inf and x - m is NaN at the inf id, -inf elsewhere
    # (sampling.py:223, 230): the inf id fails `e >= min_p` (NaN) and gets weight 0, every other id
    # has e = 0, so z = 0 and their weights are 0 / 0 = NaN; the draw converts the NaN weights to
    # int64 (sampling.py:234, _units) and returns an id whose weight is NaN (id V-1 here).
    logits = _row_with(float("inf"))
    q, tok, _ = run(logits, [(1.0, 0, 1.0, 0.0, False)], chunk=64)
    assert torch.isfinite(q.float()).all()
    assert q[0, int(tok[0])] > 0
    assert int(tok[0]) == 10 and q[0, 10] == 1     # +inf reads as the largest value: all the mass


def test_greedy_fully_masked_row_takes_the_first_index():
    # FIXED: "one-hot at the argmax of the logits (first index on ties)", and torch.argmax (the CPU
    # path, probs.py) gives 0 on an all -inf row; the kernel returns V - 1: ix starts at V
    # (sampling.py:183), `x > mx` is never true for -inf (188), so arg = min(V, V - 1) (193).
    logits = torch.full((1, V), float("-inf"))
    q, tok, _ = run(logits, [(1.0, 0, 1.0, 0.0, True)])
    assert int(logits[0].argmax()) == 0
    assert int(tok[0]) == 0 and q[0, 0] == 1
