"""Review of the reworked norm fusion (07abe22: residual tile loaded before the K loop, the
consumer's 1 / RMS applied after it, PARTS_AHEAD partial sums loaded ahead, norm_max_m, on by
default). Adversarial checks on the CPU under TRITON_INTERPRET=1; each fails if the bug exists.

Exact-bit checks in fp32 (the interpreter truncates fp32 -> bf16); bf16 within a tolerance."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.kernels import gemv as gemv_module
from specdec.kernels.gemv import (PARTS_AHEAD, GemvConfig, GemvOps, NormInput, PendingNorm, RowLinear,
                                  default_config, gemv, split_layout)
from specdec.models.llama import RMSNorm, TorchLayerOps
from specdec.models.loader import build_model, init_random
from specdec.runner import SeqInput
from tests.helpers.op_sets import new_runner, tiny_config
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)

F32, BF16 = torch.float32, torch.bfloat16


def _norm_ref(r, weight, eps):
    return RMSNorm.forward(NormInput(None, weight, eps), r)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _f64_ref(r, nw, eps, w2, b=None, glu=False):
    """RMSNorm(r) @ W2^T (+ b) (then SiLU(gate) * up) in float64 throughout."""
    rd = r.double()
    xn = rd * torch.rsqrt(rd.pow(2).mean(-1, keepdim=True) + eps) * nw.double()
    y = xn @ w2.double().T + (0 if b is None else b.double())
    if glu:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y


def _trunc(t):
    """fp32 -> bf16 as the interpreter casts: truncation."""
    return (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(BF16)


def _partition_sums(r, parts, seed):
    """[parts, M] sums of squares over a random partition of r's columns (fp32)."""
    k = r.shape[1]
    cuts = sorted(random.Random(seed).sample(range(1, k), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, k]
    sq = r.float().pow(2)
    return torch.stack([sq[:, a:b].sum(-1) for a, b in zip(bounds, bounds[1:])]).contiguous()


def _cfg(m, block_n, block_k, split):
    return GemvConfig(1 if m == 1 else 16, block_n, block_k, split_k=split)


# ------------------------------------------------------------- consumer: parts around PARTS_AHEAD

# (m, parts): at and just past one load of partial sums (1024 at M = 1, 128 at 16-row tiles),
# with M = 16 (the full tile) too. K = 1100: ragged (not a multiple of 32 / 64), and a split-K
# consumer whose last split is shorter.
@pytest.mark.parametrize("m,parts", [(1, 1024), (1, 1025), (3, 128), (3, 129), (16, 129), (16, 257)])
@pytest.mark.parametrize("variant", ["plain-bias", "splitk-bias", "glu-splitk-bias"])
def test_consumer_parts_boundaries_split_ragged_glu_bias_vs_float64(m, parts, variant):
    gen = torch.Generator().manual_seed(parts * 31 + m)
    k = 1100
    r = torch.randn(m, k, generator=gen) * 3
    sums = _partition_sums(r, parts, seed=parts + m)
    nw = 1 + 0.1 * torch.randn(k, generator=gen)
    glu = variant.startswith("glu")
    rows = 2 * 12 if glu else 20
    w2 = torch.randn(rows, k, generator=gen) * 0.1
    b = torch.randn(rows, generator=gen)
    cfg = None
    if "splitk" in variant:
        cfg = _cfg(m, 16, 64, 3)             # 18 K blocks of 64 (last one ragged): splits 6, 6, 6
        per, n_split = split_layout(k, cfg)
        assert n_split == 3 and k % 64 != 0
    ep = "silu_mul" if glu else None
    out = gemv(r, w2, b, config=cfg, epilogue=ep, norm=NormInput(sums, nw, 1e-6))
    want = _f64_ref(r, nw, 1e-6, w2, b, glu)
    assert out.shape == want.shape
    assert _rel(out, want) < 5e-6
    # every partial counts: changing the last one changes the scale
    bumped = sums.clone()
    bumped[-1] += 50.0
    assert not torch.equal(out, gemv(r, w2, b, config=cfg, epilogue=ep, norm=NormInput(bumped, nw, 1e-6)))
    # ... and the first one
    bumped = sums.clone()
    bumped[0] += 50.0
    assert not torch.equal(out, gemv(r, w2, b, config=cfg, epilogue=ep, norm=NormInput(bumped, nw, 1e-6)))


@pytest.mark.parametrize("m,parts,block_n", [(1, 1025, 1), (3, 129, 16)])
def test_real_producer_with_parts_past_one_load_feeds_the_consumer(m, parts, block_n):
    """The producer itself makes 1025 (M = 1, 1-row tiles) / 129 (M = 3, 16-row tiles) partial
    sums; the consumer (default config, and split-K) reads them all."""
    gen = torch.Generator().manual_seed(parts)
    n = parts * block_n
    x = torch.randn(m, 16, generator=gen)
    w = torch.randn(n, 16, generator=gen) * 0.3
    res = torch.randn(m, n, generator=gen)
    cfg = _cfg(m, block_n, 16, 1)
    r, sums = gemv(x, w, config=cfg, residual=res)
    assert sums.shape == (parts, m)
    assert torch.equal(r, res + gemv(x, w, config=cfg))
    nw = 1 + 0.1 * torch.randn(n, generator=gen)
    w2 = torch.randn(8, n, generator=gen) * 0.1
    b2 = torch.randn(8, generator=gen)
    for ccfg in (None, _cfg(m, 16, 256, 3)):
        out = gemv(r, w2, b2, config=ccfg, norm=NormInput(sums, nw, 1e-5))
        assert _rel(out, _f64_ref(r, nw, 1e-5, w2, b2)) < 5e-6


# ------------------------------------------------------------- consumer: exact formula with bias

@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("split", [1, 3])
def test_bias_is_added_after_the_rms_scale_exact_bits(m, split):
    """out = rstd * ((x * w) @ W^T) + b, with exact sums (small integers) and an identity W:
    fp32 bits of the formula, plain and with the SiLU epilogue; a bias added before the scale
    (rstd * (xw W^T + b)) would differ by far more than an ulp."""
    gen = torch.Generator().manual_seed(m * 10 + split)
    k = 80                                         # ragged for block_k 32: 3 blocks, the last half
    r = torch.randint(-8, 9, (m, k), generator=gen).to(F32)
    r[:, 0] = 5                                    # no zero rows here
    _, sums = gemv(torch.zeros(m, 16), torch.zeros(k, 16), residual=r)
    nw = 1 + 0.1 * torch.randn(k, generator=gen)
    b = torch.randn(k, generator=gen) * 10
    rstd = torch.rsqrt(r.pow(2).sum(-1, keepdim=True) / k + 1e-5)
    xn = r * nw
    eye = torch.eye(k)
    cfg = _cfg(m, 16, 32, split)
    out = gemv(r, eye, b, config=cfg, norm=NormInput(sums, nw, 1e-5))
    assert torch.equal(out, xn * rstd + b)
    both = torch.cat([eye, eye])
    b2 = torch.cat([b, -b * 0.5])
    got = gemv(r, both, b2, config=cfg, epilogue="silu_mul", norm=NormInput(sums, nw, 1e-5))
    assert torch.equal(got, gemv(xn * rstd, both, b2, config=cfg, epilogue="silu_mul"))


# ------------------------------------------------------------- producer through the reduce kernel

@pytest.mark.parametrize("m", [1, 3])
def test_producer_split_k_two_reduce_programs_strided_residual(m):
    """Split-K producer (reduce kernel) over 1100 columns (two reduce programs: two partial sums)
    with a residual whose row stride is not N (a view) and a transposed one; bias too. The separate
    reduce's layout (tests/unit/test_gemv_inline_reduce.py: the inline one's)."""
    with gemv_module.split_reduce_forced("separate"):
        gen = torch.Generator().manual_seed(40 + m)
        n, k = 1100, 64
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen) * 0.2
        bias = torch.randn(n, generator=gen)
        cfg = _cfg(m, 64, 16, 4)
        assert split_layout(k, cfg)[1] == 4
        y = gemv(x, w, bias, config=cfg)
        # one split (the residual tile loaded before the K loop) with the same strided residuals
        one = _cfg(m, 64, 16, 1)
        wide = torch.randn(m, n + 37, generator=gen)
        for res in (wide[:, 20:20 + n], torch.randn(n, m, generator=gen).t()):
            r1, sums1 = gemv(x, w, bias, config=one, residual=res)
            assert torch.equal(r1, res + gemv(x, w, bias, config=one))
            assert sums1.shape == (-(-n // 64), m)
            torch.testing.assert_close(sums1.sum(0), r1.pow(2).sum(-1), rtol=2e-6, atol=0)
        wide = torch.randn(m, n + 37, generator=gen)
        for res in (wide[:, 20:20 + n], torch.randn(n, m, generator=gen).t()):
            r, sums = gemv(x, w, bias, config=cfg, residual=res)
            assert torch.equal(r, res + y)
            assert sums.shape == (2, m)
            assert torch.equal(sums[0], r[:, :1024].pow(2).sum(-1)) or torch.allclose(
                sums[0], r[:, :1024].pow(2).sum(-1), rtol=2e-6, atol=0)
            torch.testing.assert_close(sums[1], r[:, 1024:].pow(2).sum(-1), rtol=2e-6, atol=0)
            nw = 1 + 0.1 * torch.randn(n, generator=gen)
            w2 = torch.randn(10, n, generator=gen) * 0.1
            out = gemv(r, w2, norm=NormInput(sums, nw, 1e-5))
            assert _rel(out, _f64_ref(r, nw, 1e-5, w2)) < 5e-6


# ------------------------------------------------------------- bf16 vs float64

@pytest.mark.parametrize("m", [1, 5])
def test_bf16_consumer_with_large_activations_vs_float64(m):
    """bf16 stream with outlier channels (Llama's massive activations, ~1e3), bias, SiLU, split-K."""
    gen = torch.Generator().manual_seed(70 + m)
    k = 96
    x = torch.randn(m, 48, generator=gen).to(BF16)
    w = (torch.randn(k, 48, generator=gen) * 0.1).to(BF16)
    res = torch.randn(m, k, generator=gen)
    res[:, 3] = 2000.0
    res[:, 50] = -900.0
    res = res.to(BF16)
    r, sums = gemv(x, w, residual=res)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(BF16)
    for glu, cfg in ((False, None), (True, _cfg(m, 16, 32, 2))):
        rows = 32 if glu else 24
        w2 = (torch.randn(rows, k, generator=gen) * 0.1).to(BF16)
        b2 = torch.randn(rows, generator=gen).to(BF16)
        out = gemv(r, w2, b2, config=cfg, epilogue="silu_mul" if glu else None, norm=NormInput(sums, nw, 1e-5))
        assert out.dtype == BF16
        # the interpreter truncates each of up to five bf16 roundings (x * w, gate, up, SiLU, out):
        # a loose bound against float64, a tight one against the formula truncated the same way
        assert _rel(out, _f64_ref(r, nw, 1e-5, w2, b2, glu)) < 4e-2
        rstd = torch.rsqrt(sums.sum(0)[:, None] / k + 1e-5)
        acc = (_trunc(r.float() * nw.float()).float() @ w2.float().T) * rstd + b2.float()
        if glu:
            g, u = (_trunc(t).float() for t in acc.chunk(2, -1))
            acc = _trunc(g / (1 + torch.exp(-g))).float() * u
        assert _rel(out, _trunc(acc)) < 5e-3


# ------------------------------------------------------------- zero rows, eps, NaN / inf

@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy's, inside the interpreter
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split", [1, 2])
def test_nan_inf_zero_rows_and_eps_zero_match_the_separate_ops(m, split):
    """Where the separate RMSNorm + linear gives NaN (a NaN / inf in the row, a zero row with
    eps = 0), the fused consumer does too, and only there; finite rows agree."""
    gen = torch.Generator().manual_seed(m + 5 * split)
    k = 48
    cfg = _cfg(m, 16, 16, split)
    nw = 1 + 0.1 * torch.randn(k, generator=gen)
    w2 = torch.randn(20, k, generator=gen) * 0.1
    b2 = torch.randn(20, generator=gen)
    cases = []
    r = torch.randn(m, k, generator=gen)
    r[0, 7] = float("inf")
    cases.append((r, 1e-5))
    r = torch.randn(m, k, generator=gen)
    r[m - 1, 1] = float("nan")
    cases.append((r, 1e-5))
    r = torch.randn(m, k, generator=gen)
    r[0] = 0
    cases.append((r, 0.0))
    cases.append((r, 1e30))
    for r, eps in cases:
        _, sums = gemv(torch.zeros(m, 16), torch.zeros(k, 16), residual=r)
        out = gemv(r, w2, b2, config=cfg, norm=NormInput(sums, nw, eps))
        want = gemv(_norm_ref(r, nw, eps), w2, b2, config=cfg)
        assert torch.equal(out.isnan(), want.isnan()), (eps, out, want)
        fin = want.isfinite()
        assert torch.equal(out.isfinite(), fin)
        torch.testing.assert_close(out[fin], want[fin], rtol=1e-5, atol=1e-5)


def test_producer_inf_residual_sums_inf_like_torch():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 32, generator=gen)
    w = torch.randn(40, 32, generator=gen)
    res = torch.randn(3, 40, generator=gen)
    res[1, 5] = float("inf")
    res[2, 39] = float("nan")
    for cfg in (None, _cfg(3, 16, 16, 2)):
        r, sums = gemv(x, w, config=cfg, residual=res)
        assert torch.equal(r.isnan(), (res + gemv(x, w, config=cfg)).isnan())
        assert torch.isinf(sums[:, 1]).any() and torch.isnan(sums[:, 2]).any()
        assert torch.isfinite(sums[:, 0]).all()


# ------------------------------------------------------------- GemvOps: norm_max_m boundaries

class StrictOps(TorchLayerOps):
    """The base op set, refusing anything but tensors (a RowLinear / PendingNorm leaking into a
    non-GEMV op fails the test)."""

    name = "strict"

    @staticmethod
    def _t(*xs):
        for x in xs:
            assert x is None or isinstance(x, torch.Tensor), type(x)

    @classmethod
    def add_rmsnorm(cls, x, residual, norm):
        cls._t(x, residual)
        return TorchLayerOps.add_rmsnorm(x, residual, norm)

    @classmethod
    def rope_store(cls, q, k, v, cos, sin, kv_layer, batch, backend):
        cls._t(q, k, v)
        return TorchLayerOps.rope_store(q, k, v, cos, sin, kv_layer, batch, backend)

    @classmethod
    def silu_mul(cls, gate_up):
        cls._t(gate_up)
        return TorchLayerOps.silu_mul(gate_up)

    @classmethod
    def linear(cls, x, weight, bias=None):
        cls._t(x)
        return TorchLayerOps.linear(x, weight, bias)


@pytest.mark.parametrize("max_m", [1, 3])
def test_norm_max_m_boundary_in_ops(max_m):
    ops = GemvOps(StrictOps(), on_cpu=True, fuse_norm=True)
    ops.norm_max_m = max_m
    gen = torch.Generator().manual_seed(max_m)
    w = torch.randn(24, 32, generator=gen) * 0.1
    norm = RMSNorm(24, 1e-6)
    w2 = torch.randn(16, 24, generator=gen) * 0.1
    for m in (max_m, max_m + 1):
        x = torch.randn(m, 32, generator=gen)
        res = torch.randn(m, 24, generator=gen)
        lazy = ops.row_linear(x, w)
        assert isinstance(lazy, RowLinear) == (m <= max_m)
        h, r = ops.add_rmsnorm(lazy, res, norm)
        assert isinstance(h, PendingNorm) == (m <= max_m)
        want_h, want_r = TorchLayerOps.add_rmsnorm(gemv(x, w), res, norm)
        assert torch.equal(r, want_r)
        assert _rel(ops.linear(h, w2), want_h @ w2.T) < 2e-6


def _model(**kw):
    return init_random(build_model(tiny_config(**kw), F32, "cpu"), std=0.1)


def _strict(model, norm, max_m=1, silu=False):
    model.set_gemv_kernels(True)
    model.set_gemv_silu(silu)
    model.set_gemv_norm(norm)
    model.ops = GemvOps(StrictOps(), on_cpu=True, fuse_silu=silu, fuse_norm=model.ops.fuse_norm)
    model.ops.norm_max_m = max_m


# steps: token counts per sequence; 1 token total (fused at max_m 1), several sequences, verify
STEPS = [
    {"a": [1, 2, 3]},
    {"a": [4]},
    {"a": [5], "b": [7, 8]},
    {"a": [6]},
    {"b": [9]},
    {"a": [10], "b": [11]},
    {"a": [12, 13]},
    {"b": [14]},
    {"a": [15, 16, 17], "b": [18]},
    {"a": [19]},
]


def _run(model):
    runner = new_runner(model, F32)
    calls, original = [], gemv_module.gemv

    def spy(*a, **kw):
        calls.append((a[0].shape[0], kw.get("residual") is not None, kw.get("norm") is not None))
        return original(*a, **kw)
    gemv_module.gemv = spy
    try:
        runner.add_sequence("a")
        out = [torch.cat(runner.step([SeqInput("a", STEPS[0]["a"])]))]
        runner.add_sequence("b")
        for st in STEPS[1:]:
            items = [SeqInput(s, t, num_logits=len(t)) for s, t in st.items()]
            out.append(torch.cat(runner.step(items)))
    finally:
        gemv_module.gemv = original
    return out, calls


@pytest.mark.parametrize("max_m,silu", [(1, False), (2, True)])
def test_model_alternating_step_sizes_no_leaks_and_logits(max_m, silu):
    model = _model(qkv_bias=True)
    _strict(model, False, max_m, silu)
    want, _ = _run(model)
    _strict(model, True, max_m, silu)
    assert model.ops.fuse_norm
    got, calls = _run(model)
    layers = model.config.num_layers
    sizes = [sum(len(t) for t in st.values()) for st in STEPS]
    fused_steps = sum(1 for s in sizes if s <= max_m)
    assert sum(1 for c in calls if c[1]) == fused_steps * (2 * layers - 1)
    assert sum(1 for c in calls if c[2]) == fused_steps * (2 * layers - 1)
    assert all(c[0] <= max_m for c in calls if c[1] or c[2])
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 4])
def test_consumer_with_strided_stream_and_transposed_sums(m):
    """The stream a row-strided view (row stride > K), the partial sums a strided view: the
    consumer reads both as the contiguous ones."""
    gen = torch.Generator().manual_seed(90 + m)
    k = 72
    wide = torch.randn(m, k + 24, generator=gen)
    r = wide[:, 8:8 + k]
    assert r.stride(0) == k + 24
    sums = _partition_sums(r, 5, seed=m)
    pad = torch.full((5, m + 3), float("nan"))
    pad[:, 1:1 + m] = sums
    sums_t = pad[:, 1:1 + m]                       # a view: row stride m + 3, NaN either side
    assert not sums_t.is_contiguous()
    nw = 1 + 0.1 * torch.randn(k, generator=gen)
    w2 = torch.randn(2 * 10, k, generator=gen) * 0.1
    b2 = torch.randn(2 * 10, generator=gen)
    for ep, cfg in ((None, None), ("silu_mul", _cfg(m, 16, 16, 2))):
        want = gemv(r.contiguous(), w2, b2, config=cfg, epilogue=ep, norm=NormInput(sums, nw, 1e-5))
        got = gemv(r, w2, b2, config=cfg, epilogue=ep, norm=NormInput(sums_t, nw, 1e-5))
        assert torch.equal(got, want)
        assert _rel(got, _f64_ref(r, nw, 1e-5, w2, b2, ep is not None)) < 5e-6
