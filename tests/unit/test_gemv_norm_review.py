"""Review of the add + RMSNorm fusion into the GEMVs (commit 555535b): adversarial cases for the
producer (gemv(residual=...)), the consumer (gemv(norm=NormInput(...))) and GemvOps(fuse_norm=True)
in the model, on the CPU under TRITON_INTERPRET=1. The review found four bugs, all at the gemv()
call level (no rows, a strided norm weight, residual= with norm=, empty partial sums); their tests
below were strict xfails until the fixes.

Bit checks use fp32 / fp16 (the interpreter truncates fp32 -> bf16 rather than rounding)."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.config import CacheConfig
from specdec.kernels import gemv as gemv_module
from specdec.kernels.gemv import (NORM_DTYPES, PARTS_AHEAD, GemvConfig, GemvOps, NormInput, PendingNorm, RowLinear,
                                  default_config, gemv, split_layout)
from specdec.kernels.triton_attention import TritonAttention
from specdec.models.llama import RMSNorm, TorchLayerOps
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput
from tests.helpers.cpu_graphs import CpuGraphs
from tests.helpers.op_sets import new_runner, run_steps, tiny_config
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _norm_ref(r, weight, eps):
    return RMSNorm.forward(NormInput(None, weight, eps), r)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _operands(m, k, n, dtype, seed, scale=0.1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * scale).to(dtype)
    res = torch.randn(m, n, generator=gen).to(dtype)
    nw = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    return x, w, res, nw, gen


def _cfg(m, block_n, block_k, split):
    return GemvConfig(1 if m == 1 else 16, block_n, block_k, split_k=split)


# ---------------------------------------------------------------- kernel level: what holds

# (m, k, n, n2, producer config, consumer config, glu, bias): every M path (1 elementwise, 2..16
# tl.dot, 16 the maximum), ragged K and N, split-K on either side (the producer's through the
# reduce kernel; n = 1100 > 1024 gives that kernel two programs, so two partial sums), the SiLU
# epilogue with the norm at M > 1 and with split-K, bias on the consumer.
SWEEP = [
    (1, 96, 72, 40, None, None, False, True),
    (1, 40, 200, 24, (16, 16, 16), (16, 32, 4), True, True),
    (1, 96, 1100, 33, (16, 32, 3), None, True, False),
    (2, 96, 72, 40, (16, 32, 3), (16, 32, 4), True, True),
    (3, 40, 200, 24, None, (32, 16, 16), False, True),
    (7, 64, 1100, 17, (16, 16, 16), (16, 32, 4), True, True),
    (15, 64, 64, 64, None, None, True, False),
    (16, 96, 72, 40, (16, 32, 3), (16, 32, 4), False, True),
    (16, 40, 200, 24, None, (16, 32, 4), True, True),
]


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("case", SWEEP, ids=lambda c: f"m{c[0]}-k{c[1]}-n{c[2]}-{'glu' if c[6] else 'plain'}")
def test_producer_bits_sums_and_consumer_against_the_separate_ops(dtype, case):
    m, k, n, n2, pc, cc, glu, bias = case
    pcfg = None if pc is None else _cfg(m, *pc)
    ccfg = None if cc is None else _cfg(m, *cc)
    x, w, res, nw, gen = _operands(m, k, n, dtype, seed=m * 7 + n)
    r, sums = gemv(x, w, config=pcfg, residual=res)
    # producer: the bits of torch's `res + y` on the plain GEMV's y
    assert torch.equal(r, (res.float() + gemv(x, w, config=pcfg).float()).to(dtype))
    cfg = pcfg or default_config(m, n, k, 132)
    split = split_layout(k, cfg)[1]
    if split > 1 and gemv_module.split_reduce() == "separate":   # one per reduce program
        parts = -(-n // min(1024, 1 << (n - 1).bit_length()))
    else:   # one per N tile (split over K: the tile's last program's)
        parts = -(-n // cfg.block_n)
    assert sums.shape == (parts, m) and sums.dtype == F32
    torch.testing.assert_close(sums.sum(0), r.float().pow(2).sum(-1), rtol=2e-6, atol=0)
    rows = 2 * n2 if glu else n2
    w2 = (torch.randn(rows, n, generator=gen) * 0.1).to(dtype)
    b = torch.randn(rows, generator=gen).to(dtype) if bias else None
    ep = "silu_mul" if glu else None
    if dtype == F16:   # the consumer takes bf16 / fp32 only (fp16's x * weight may overflow)
        r, nw, w2, b = (t if t is None else t.to(BF16) for t in (r, nw, w2, b))
    out = gemv(r, w2, b, config=ccfg, epilogue=ep, norm=NormInput(sums, nw, 1e-5))
    want = gemv(_norm_ref(r, nw, 1e-5), w2, b, config=ccfg, epilogue=ep)
    assert out.shape == want.shape and out.dtype == r.dtype
    if dtype == F32:
        assert _rel(out, want) < 2e-6
    else:  # bf16 operands: x * weight and x / RMS * weight round differently (8-bit mantissa)
        assert _rel(out, want) < 1e-2
    # deterministic: the same bits again
    assert torch.equal(out, gemv(r, w2, b, config=ccfg, epilogue=ep, norm=NormInput(sums, nw, 1e-5)))


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [64, 96])
def test_consumer_gives_the_formulas_bits_where_its_sums_are_exact(m, k):
    """The consumer's product is ((x * weight) @ W^T) * 1 / RMS in fp32. Small integers make every
    order of the sum of squares the same fp32 (the same 1 / RMS), an identity W reads x * weight
    out exactly, sums of neighbours add two of them: each must be the formula's bits, plain and
    through the SiLU epilogue on [I; I], with and without split-K."""
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randint(-8, 9, (m, 48), generator=gen).to(F32)
    res = torch.randint(-8, 9, (m, k), generator=gen).to(F32)
    r, sums = gemv(x, torch.zeros(k, 48), residual=res)   # y = 0: r = res
    assert torch.equal(r, res)
    nw = 1 + 0.1 * torch.randn(k, generator=gen)
    rstd = torch.rsqrt(r.pow(2).sum(-1, keepdim=True) / k + 1e-5)
    xn = r * nw
    eye = torch.eye(k)
    pairs = eye + torch.roll(eye, 1, dims=1)
    for cfg in (None, _cfg(m, 16, 32, 2)):
        assert torch.equal(gemv(r, eye, config=cfg, norm=NormInput(sums, nw, 1e-5)), xn * rstd)
        # each K split's partial is scaled by 1 / RMS, then the partials add in split order
        per, _ = split_layout(k, cfg or default_config(m, k, k, 1))
        want = sum(((xn[:, a:a + per] @ pairs[:, a:a + per].T) * rstd for a in range(per, k, per)),
                   (xn[:, :per] @ pairs[:, :per].T) * rstd)
        assert torch.equal(gemv(r, pairs, config=cfg, norm=NormInput(sums, nw, 1e-5)), want)
        both = torch.cat([eye, eye])
        assert torch.equal(gemv(r, both, config=cfg, epilogue="silu_mul", norm=NormInput(sums, nw, 1e-5)),
                           gemv(xn * rstd, both, config=cfg, epilogue="silu_mul"))


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("parts", [1, 63, 64, 65, 128, 129, 1024, 1025])
def test_consumer_sums_any_number_of_partials(m, parts):
    """The consumer loads PARTS_AHEAD partial sums before its K loop (1024 at M = 1, 128 with
    16-row tiles, fewer with wider ones) and any further ones after it: 1 to 1025 partials, the
    squares split unevenly between them (a partition of the row's columns)."""
    assert PARTS_AHEAD == {1: 1024, 16: 128, 32: 64, 64: 32}
    gen = torch.Generator().manual_seed(parts)
    k = 1040
    r = torch.randn(m, k, generator=gen)
    cuts = sorted(random.Random(parts).sample(range(1, k), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, k]
    sq = r.pow(2)
    sums = torch.stack([sq[:, a:b].sum(-1) for a, b in zip(bounds, bounds[1:])])   # [parts, m]
    nw = 1 + 0.1 * torch.randn(k, generator=gen)
    w2 = torch.randn(24, k, generator=gen) * 0.1
    out = gemv(r, w2, norm=NormInput(sums, nw, 1e-6))
    assert _rel(out, gemv(_norm_ref(r, nw, 1e-6), w2)) < 2e-6
    # the partials really are read: dropping the last one changes the result
    assert parts == 1 or not torch.equal(out, gemv(r, w2, norm=NormInput(sums[:-1].contiguous(), nw, 1e-6)))


@pytest.mark.parametrize("m", [1, 4])
def test_producer_with_strided_transposed_or_broadcast_residuals(m):
    x, w, _, _, gen = _operands(m, 48, 40, F32, seed=11)
    y = gemv(x, w)
    wide = torch.randn(m, 100, generator=gen)
    for res in (wide[:, 10:50],                                   # a view: row stride 100
                torch.randn(40, m, generator=gen).t(),            # column-major
                torch.randn(1, 40, generator=gen).expand(m, 40),  # row stride 0
                wide[:, ::2][:, :40]):                            # element stride 2
        before = res.clone()
        r, sums = gemv(x, w, residual=res)
        assert torch.equal(r, res + y) and torch.equal(res, before)
        torch.testing.assert_close(sums.sum(0), r.pow(2).sum(-1), rtol=2e-6, atol=0)


def test_producer_with_bias_is_residual_plus_the_biased_projection():
    for m, cfg in ((1, None), (3, None), (3, GemvConfig(16, 16, 16, split_k=3))):
        x, w, res, _, gen = _operands(m, 48, 40, F16, seed=m)
        b = torch.randn(40, generator=gen).to(F16)
        r, _ = gemv(x, w, b, config=cfg, residual=res)
        assert torch.equal(r, (res.float() + gemv(x, w, b, config=cfg).float()).to(F16))


def test_refusals_of_mismatched_residuals():
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    for bad in (torch.randn(2, 16, dtype=F16), torch.randn(3, 16), torch.randn(2, 16, 1), torch.randn(16)):
        with pytest.raises(ValueError, match="residual"):
            gemv(x, w, residual=bad)
    with pytest.raises(ValueError, match="norm"):    # fp16 sums
        gemv(x, w, norm=NormInput(torch.zeros(1, 2, dtype=F16), torch.ones(32), 1e-5))
    with pytest.raises(ValueError, match="norm"):    # norm weight dtype
        gemv(x, w, norm=NormInput(torch.zeros(1, 2), torch.ones(32, dtype=F16), 1e-5))
    with pytest.raises(ValueError, match="norm"):    # 1-D sums
        gemv(x, w, norm=NormInput(torch.zeros(2), torch.ones(32), 1e-5))


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("eps", [1e-12, 1e-6, 1.0, 100.0])
def test_zero_rows_and_eps_extremes(m, eps):
    """A row of zeros (rstd = 1 / sqrt(eps), output 0), mixed with ordinary rows; tiny and large
    eps."""
    x, w, res, nw, gen = _operands(m, 48, 40, F32, seed=3)
    res[0] = 0
    w_zero_row = w.clone()
    x[0] = 0
    r, sums = gemv(x, w_zero_row, residual=res)
    assert (r[0] == 0).all() and sums[:, 0].eq(0).all()
    w2 = torch.randn(24, 40, generator=gen) * 0.1
    out = gemv(r, w2, norm=NormInput(sums, nw, eps))
    want = gemv(_norm_ref(r, nw, eps), w2)
    assert torch.isfinite(out).all() and (out[0] == 0).all()
    assert _rel(out, want) < 2e-6


@pytest.mark.parametrize("m", [1, 3])
def test_fp16_near_overflow(m):
    """A residual stream near fp16's maximum: the squares need fp32 (65504^2 * K), and a sum that
    overflows to inf in fp16 does so as torch's does."""
    x, w, res, nw, gen = _operands(m, 64, 48, F16, seed=9)
    res = (torch.rand(m, 48, generator=gen) * 2 - 1).mul(65000).to(F16)
    r, sums = gemv(x, w, residual=res)
    assert torch.equal(r, res + gemv(x, w))
    assert torch.isfinite(sums).all()
    torch.testing.assert_close(sums.sum(0), r.float().pow(2).sum(-1), rtol=2e-6, atol=0)
    w2 = (torch.randn(24, 48, generator=gen) * 0.1).to(F16)
    with pytest.raises(ValueError, match="overflows fp16"):   # x * weight > 65504: refused
        gemv(r, w2, norm=NormInput(sums, nw, 1e-5))
    assert F16 not in NORM_DTYPES
    # res + y past 65504: inf in the stream as in torch (NaN after the norm, as in torch)
    big = torch.full((m, 48), 65504.0).to(F16)
    xa, wa = (x.abs() * 20).to(F16), w.abs()          # y ~ 100: 65504 + y rounds to inf
    r2, _ = gemv(xa, wa, residual=big)
    assert torch.equal(r2, big + gemv(xa, wa)) and torch.isinf(r2).all()


# ---------------------------------------------------------------- kernel level: the review's bugs (fixed)

def test_producer_with_no_rows_still_returns_the_pair():
    out = gemv(torch.randn(0, 32), torch.randn(16, 32), residual=torch.randn(0, 16))
    assert isinstance(out, tuple) and out[0].shape == (0, 16) and out[1].shape[1] == 0


def test_fused_add_rmsnorm_on_zero_tokens():
    ops = GemvOps(TorchLayerOps(), on_cpu=True, fuse_norm=True)
    x, w = torch.randn(0, 32), torch.randn(16, 32)
    lazy = ops.row_linear(x, w)
    assert isinstance(lazy, RowLinear)
    h, r = ops.add_rmsnorm(lazy, torch.randn(0, 16), RMSNorm(16, 1e-5))
    assert ops.resolve(h).shape == (0, 16) and r.shape == (0, 16)


@pytest.mark.parametrize("m", [1, 3])
def test_consumer_with_a_strided_norm_weight(m):
    x, w, res, _, gen = _operands(m, 48, 64, F32, seed=4)
    r, sums = gemv(x, w, residual=res)
    nw = (1 + 0.1 * torch.randn(128, generator=gen))[::2]
    assert nw.stride(0) == 2
    w2 = torch.randn(24, 64, generator=gen) * 0.1
    out = gemv(r, w2, norm=NormInput(sums, nw, 1e-5))
    assert _rel(out, gemv(_norm_ref(r, nw, 1e-5), w2)) < 2e-6


def test_residual_and_norm_together_are_refused():
    x, w, res, nw, _ = _operands(3, 64, 64, F32, seed=2)
    r, sums = gemv(x, w, residual=res)
    with pytest.raises(ValueError):
        gemv(r, w, residual=res, norm=NormInput(sums, nw, 1e-5))


def test_empty_partial_sums_are_refused():
    x, w, res, nw, _ = _operands(2, 48, 64, F32, seed=6)
    r, _ = gemv(x, w, residual=res)
    with pytest.raises(ValueError, match="norm"):
        gemv(r, torch.randn(8, 64), norm=NormInput(torch.zeros(0, 2), nw, 1e-5))


# ---------------------------------------------------------------- GemvOps and the model

def test_ops_pieces_match_the_base_ops():
    """RowLinear -> add_rmsnorm -> PendingNorm -> linear / gate_up_silu / resolve, against the base
    op set on the same tensors; the fallbacks (no residual, a residual of another dtype)."""
    base = TorchLayerOps()
    x, w, res, _, gen = _operands(5, 48, 40, F32, seed=8)
    norm = RMSNorm(40, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(40, generator=gen))
    w2 = torch.randn(2 * 24, 40, generator=gen) * 0.1
    b2 = torch.randn(2 * 24, generator=gen)
    want_h, want_r = base.add_rmsnorm(gemv(x, w), res, norm)
    for silu in (False, True):
        ops = GemvOps(base, on_cpu=True, fuse_silu=silu, fuse_norm=True)
        ops.norm_max_m = 16
        pending, r = ops.add_rmsnorm(ops.row_linear(x, w), res, norm)
        assert isinstance(pending, PendingNorm) and torch.equal(r, want_r)
        assert _rel(ops.resolve(pending), want_h) < 1e-6
        assert _rel(ops.linear(pending, w2, b2), gemv(want_h, w2, b2)) < 2e-6
        assert _rel(ops.gate_up_silu(pending, w2, b2), base.silu_mul(gemv(want_h, w2, b2))) < 2e-6
        # fallbacks: no residual; a residual in another dtype
        h0, r0 = ops.add_rmsnorm(ops.row_linear(x, w), None, norm)
        assert torch.equal(r0, gemv(x, w)) and torch.equal(h0, norm(gemv(x, w)))
        h1, r1 = ops.add_rmsnorm(ops.row_linear(x, w), res.double(), norm)
        assert r1.dtype == torch.float64 and torch.equal(r1, res.double() + gemv(x, w))


def _model(dtype=F32, **kw):
    return init_random(build_model(tiny_config(**kw), dtype, "cpu"), std=0.1)


def _set(model, norm, silu=False, fused=False):
    model.set_fused_kernels(fused)
    model.set_gemv_kernels(True)
    model.set_gemv_silu(silu)
    model.set_gemv_norm(norm)
    model.ops.on_cpu = True
    model.ops.norm_max_m = 16     # every step the GEMV serves (the default: GemvOps.norm_bound)


def _spy():
    calls = []
    original = gemv_module.gemv

    def spy(*a, **kw):
        calls.append(("residual" if kw.get("residual") is not None else "")
                     + ("norm" if kw.get("norm") is not None else ""))
        return original(*a, **kw)
    return calls, original, spy


def _run_traced(model, dtype):
    """run_steps on a fresh runner, and which gemv calls were producers / consumers."""
    calls, original, spy = _spy()
    gemv_module.gemv = spy
    try:
        return run_steps(new_runner(model, dtype)), calls
    finally:
        gemv_module.gemv = original


MODELS = [
    ("num_layers1", dict(num_layers=1), F32, False, False),
    ("qkv_bias+silu", dict(qkv_bias=True), F32, True, False),
    ("tied+fused_ops", dict(tie_word_embeddings=True), F32, True, True),
    ("ragged_hidden80_inter72", dict(hidden_size=80, intermediate_size=72), F32, False, False),
    ("default_split_k_inter600", dict(intermediate_size=600), F32, True, False),
    ("fp16_qkv_bias", dict(qkv_bias=True), F16, True, False),    # fp16: no consumer, separate norms
]


@pytest.mark.parametrize("name,kw,dtype,silu,fused", MODELS, ids=[m[0] for m in MODELS])
def test_model_logits_with_the_fusion(name, kw, dtype, silu, fused):
    """Same weights, fusion off then on: fp32 logits within reduction-order error (~1e-7), fp16
    within an fp16 ulp or so; every producer / consumer pair of the layers fused."""
    model = _model(dtype, **kw)
    _set(model, False, silu, fused)
    want = run_steps(new_runner(model, dtype))
    _set(model, True, silu, fused)
    assert model.ops.fuse_norm
    got, calls = _run_traced(model, dtype)
    layers = model.config.num_layers
    # per step: producers o_i, down_i (i < L - 1), o_{L-1}; consumers gate_up_i, qkv_i (i > 0)
    fused = 3 * (2 * layers - 1) if dtype in NORM_DTYPES else 0
    assert calls.count("residual") == fused and calls.count("norm") == fused
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert _rel(g, w) < (1e-6 if dtype == F32 else 2e-3), name


def test_default_configs_of_the_split_k_model_really_split():
    """The inter600 model above reaches the producer's reduce kernel (down_proj, K = 600) at
    decode (M = 1) and verify (M > 1) sizes."""
    for m in (1, 5):
        cfg = default_config(m, 64, 600, 132)
        assert split_layout(600, cfg)[1] > 1


def test_norm_weight_in_another_dtype_falls_back():
    """A layer whose norm weight is not the stream's dtype: the add + RMSNorm runs as before (the
    producer is not used for it), logits as without the fusion."""
    model = _model(F32)
    with torch.no_grad():
        for layer in model.layers:
            w = layer.post_attention_layernorm.weight
            layer.post_attention_layernorm.weight = torch.nn.Parameter(w.to(F16))
    _set(model, False)
    want = run_steps(new_runner(model, F32))
    _set(model, True)
    got, calls = _run_traced(model, F32)
    assert calls.count("residual") == 3 * 1   # only layer 0's down_proj -> layer 1's input norm
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-6


def test_graphed_and_reused_runner_with_sequences_coming_and_going():
    """CpuGraphs (buckets of 1 / 4 sequences x 1 / 4 tokens: M up to 16, padding rows) with the
    fusion against an eager runner without it, on one model; sequences freed, truncated and
    added between ragged steps."""
    model = _model(F32)

    def runner():
        return ModelRunner(model, CacheConfig(num_blocks=64, block_size=4, dtype=F32), backend=TritonAttention())

    eager, graphed = runner(), runner()
    graphed.graphs = CpuGraphs(graphed, max_model_len=64, query_lens=(1, 4), batch_sizes=(1, 4))
    rng = random.Random(3)

    def step(r, items, norm):
        _set(model, norm)
        return r.step(items)

    live = {}
    for s in range(4):
        live[s] = [rng.randrange(61) for _ in range(2 + s)]
    for r, norm in ((eager, False), (graphed, True)):
        for s in live:
            r.add_sequence(s)
        step(r, [SeqInput(s, ids) for s, ids in live.items()], norm)
    next_id, replays = 4, graphed.graphs.replays
    for i in range(6):
        if i == 2:   # one sequence leaves, one arrives
            for r in (eager, graphed):
                r.free(0)
                r.add_sequence(next_id)
            del live[0]
            live[next_id] = [5, 6]
            for want, got in zip(step(eager, [SeqInput(next_id, [5, 6])], False),
                                 step(graphed, [SeqInput(next_id, [5, 6])], True)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if i == 4:   # a rejected draft: drop the last token of a sequence
            s = next(iter(live))
            for r in (eager, graphed):
                r.truncate(s, r.num_tokens(s) - 1)
        chosen = rng.sample(sorted(live), rng.randint(1, len(live)))
        items = []
        for s in chosen:
            n = rng.choice([1, 2, 4])
            items.append(SeqInput(s, [rng.randrange(61) for _ in range(n)], rng.randint(1, n)))
        for want, got in zip(step(eager, items, False), step(graphed, items, True)):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert graphed.graphs.replays > replays
