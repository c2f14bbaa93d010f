"""Add + RMSNorm folded into the GEMVs around it (kernels/gemv.py: gemv(residual=...) and
gemv(norm=NormInput(...)), GemvOps(fuse_norm=True)), on the CPU under TRITON_INTERPRET=1 and on the
GPU: the producer's residual stream has torch's bits, its partial sums of squares add up to the
row's, the consumer equals RMSNorm followed by the plain GEMV (its value: the consumer scales by
1 / RMS after the sum), and a model with the fusion gives the logits of the separate kernels,
falling back where the GEMV does not serve."""
import pytest
import torch

from specdec.kernels import gemv as gemv_module
from specdec.kernels.gemv import GemvConfig, NormInput, PendingNorm, RowLinear, gemv
from specdec.kernels.paged_inputs import rel_error
from specdec.models.llama import RMSNorm
from specdec.models.loader import build_model, init_random
from specdec.runner import SeqInput
from tests.helpers.op_sets import new_runner, run_steps, tiny_config

# The interpreter truncates fp32 -> bf16 instead of rounding, so bit checks there use fp16.
CPU_DTYPES = [torch.float32, torch.float16]


def _norm_ref(r, weight, eps):
    return RMSNorm.forward(NormInput(None, weight, eps), r)


def default_n(m):       # default_config's rows per program (one part each without split-K)
    return 8 if m == 1 else 32


def _parts(n, m, cfg):
    """The producer's partial sums: one per N tile; split over K with the separate reduce, one per
    reduce program (1024 columns)."""
    if cfg is not None and cfg.split_k > 1 and gemv_module.split_reduce() == "separate":
        return -(-n // 1024)
    return -(-n // (cfg.block_n if cfg else default_n(m)))


def _configs(m):
    block_m = 1 if m == 1 else 16
    return [None, GemvConfig(block_m, 16, 32, split_k=3)]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("cfg_i", [0, 1], ids=["default", "split-k3"])
def test_producer_and_consumer_match_the_separate_ops(dtype, m, cfg_i):
    gen = torch.Generator().manual_seed(m + cfg_i)
    k, n, n2 = 96, 72, 40            # 72: the last 16-row tile of W is ragged
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    res = torch.randn(m, n, generator=gen).to(dtype)
    cfg = _configs(m)[cfg_i]
    r, sums = gemv(x, w, config=cfg, residual=res)
    assert torch.equal(r, (res.float() + gemv(x, w, config=cfg).float()).to(dtype))
    assert sums.dtype == torch.float32 and sums.shape[1] == m and sums.shape[0] == _parts(n, m, cfg)
    torch.testing.assert_close(sums.sum(0), r.float().pow(2).sum(-1), rtol=1e-5, atol=1e-5)
    nw = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    w2 = (torch.randn(n2, n, generator=gen) * 0.1).to(dtype)
    if dtype not in gemv_module.NORM_DTYPES:   # fp16: x * weight could overflow; refused
        with pytest.raises(ValueError, match="overflows fp16"):
            gemv(r, w2, norm=NormInput(sums, nw, 1e-5))
        return
    for cfg2 in _configs(m):
        out = gemv(r, w2, config=cfg2, norm=NormInput(sums, nw, 1e-5))
        want = gemv(_norm_ref(r, nw, 1e-5), w2, config=cfg2)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # the SiLU * up epilogue reads a normalised input the same way
    w3 = (torch.randn(2 * n2, n, generator=gen) * 0.1).to(dtype)
    out = gemv(r, w3, epilogue="silu_mul", norm=NormInput(sums, nw, 1e-5))
    torch.testing.assert_close(out, gemv(_norm_ref(r, nw, 1e-5), w3, epilogue="silu_mul"), rtol=1e-5, atol=1e-5)


def test_inputs_that_do_not_fit_are_refused():
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="residual"):
        gemv(x, w, residual=torch.randn(2, 15))
    with pytest.raises(ValueError, match="residual"):
        gemv(x, torch.randn(32, 32), residual=torch.randn(2, 16), epilogue="silu_mul")
    with pytest.raises(ValueError, match="norm"):
        gemv(x, w, norm=NormInput(torch.zeros(4, 2), torch.ones(31), 1e-5))
    with pytest.raises(ValueError, match="norm"):
        gemv(x, w, norm=NormInput(torch.zeros(4, 3), torch.ones(32), 1e-5))


def _model(device, dtype, **kw):
    model = init_random(build_model(tiny_config(**kw), dtype, device), std=0.1)
    model.set_gemv_kernels(True)
    return model


def _set_norm(model, on: bool, device: str, max_m: int = 16):
    model.set_gemv_norm(on)
    model.ops.on_cpu = device == "cpu"
    model.ops.norm_max_m = max_m     # 16: every step the GEMV serves (the default: GemvOps.norm_bound)


@pytest.mark.parametrize("device,dtype,tol", [("cpu", torch.float32, 1e-5),
                                              pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.gpu)])
def test_the_model_with_the_fusion_gives_the_separate_kernels_logits(device, dtype, tol):
    model = _model(device, dtype)
    if device == "cuda":
        model.set_fused_kernels(True)
    _set_norm(model, False, device)
    want = run_steps(new_runner(model, dtype))
    _set_norm(model, True, device)
    assert model.ops.fuse_norm and model.ops.name.endswith("+gemv+norm")
    calls = []
    original = gemv_module.gemv

    def spy(*a, **kw):
        calls.append(("residual" if kw.get("residual") is not None else "") + ("norm" if kw.get("norm") else ""))
        return original(*a, **kw)

    gemv_module.gemv = spy
    try:
        got = run_steps(new_runner(model, dtype))
    finally:
        gemv_module.gemv = original
    # per step (3 steps): producers o0, down0, o1 (the last down_proj runs plain before the final
    # norm); consumers gate_up0, qkv1, gate_up1 (layer 0's qkv reads the embedding's separate norm)
    assert calls.count("residual") == 3 * 3 and calls.count("norm") == 3 * 3
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        err = rel_error(g, w)
        assert err < tol, err


@pytest.mark.parametrize("device,dtype,tol", [("cpu", torch.float32, 1e-5),
                                              pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.gpu)])
def test_the_fusion_at_40_rows_gives_the_separate_kernels_logits(device, dtype, tol):
    """norm_max_m = 64 (bench's norm_m64 set): a step of 40 rows (8 sequences verifying 5 tokens,
    the b 8 verify) runs the fused norm's producers and consumers on the 64-row tiles, with the
    logits of the separate kernels."""
    model = _model(device, dtype)
    if device == "cuda":
        model.set_fused_kernels(True)

    def logits(fused: bool):
        _set_norm(model, fused, device, max_m=64)
        runner = new_runner(model, dtype)
        for s in range(8):
            runner.add_sequence(s)
        runner.step([SeqInput(s, [1 + s, 2, 3]) for s in range(8)])   # 24 rows
        rows, original = [], gemv_module.gemv

        def spy(*a, **kw):
            if kw.get("norm") is not None or kw.get("residual") is not None:
                rows.append(a[0].shape[0])
            return original(*a, **kw)
        gemv_module.gemv = spy
        try:
            return torch.cat(runner.step([SeqInput(s, [4 + s, 5, 6, 7, 8], num_logits=5) for s in range(8)])), rows
        finally:
            gemv_module.gemv = original

    want, unfused = logits(False)
    got, fused = logits(True)
    assert not unfused and len(fused) == 6 and set(fused) == {40}   # 3 producers, 3 consumers
    assert torch.isfinite(got).all()
    err = rel_error(got, want)
    assert err < tol, err


def test_steps_the_gemv_does_not_serve_fall_back_to_the_separate_ops():
    """65 tokens (above MAX_M): cuBLAS-sized projections, no RowLinear or PendingNorm reaches a
    kernel; logits as without the fusion."""
    model = _model("cpu", torch.float32)
    _set_norm(model, False, "cpu")
    runner = new_runner(model, torch.float32)
    runner.add_sequence("a")
    want = torch.cat(runner.step([SeqInput("a", [1 + i % 60 for i in range(65)], num_logits=2)]))
    _set_norm(model, True, "cpu")
    runner = new_runner(model, torch.float32)
    runner.add_sequence("a")
    got = torch.cat(runner.step([SeqInput("a", [1 + i % 60 for i in range(65)], num_logits=2)]))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_fusion_is_off_where_it_cannot_hold():
    model = _model("cpu", torch.float32, o_bias=True)
    model.set_gemv_norm(True)
    assert not model.ops.fuse_norm                 # o_proj's bias is added after the projection
    ops = _model("cpu", torch.float32).ops
    assert ops.resolve(torch.ones(1)).shape == (1,)
    assert isinstance(RowLinear(torch.ones(2, 4), torch.ones(3, 4)).shape, torch.Size)
    assert PendingNorm(torch.ones(2, 4), NormInput(torch.zeros(1, 2), torch.ones(4), 1e-5)).shape == (2, 4)


def test_more_partial_sums_than_one_load_of_them():
    """70 producer programs (M = 1: 8 rows each): the consumer sums its partials in two loads of
    at most 64."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 48, generator=gen)
    w = torch.randn(560, 48, generator=gen) * 0.1
    r, sums = gemv(x, w, residual=torch.randn(1, 560, generator=gen))
    assert sums.shape == (70, 1)
    nw = 1 + 0.1 * torch.randn(560, generator=gen)
    w2 = torch.randn(24, 560, generator=gen) * 0.1
    out = gemv(r, w2, norm=NormInput(sums, nw, 1e-5))
    torch.testing.assert_close(out, gemv(_norm_ref(r, nw, 1e-5), w2), rtol=1e-5, atol=1e-5)


def test_at_a_bound_of_one_only_single_token_steps_are_fused():
    """norm_max_m = 1 (the bound wide models get by default: their tl.dot consumers measured slower
    on the H200): a one-sequence decode step runs the fused producers and consumers, a two-token
    step the separate kernels; logits as without the fusion either way."""
    model = _model("cpu", torch.float32)
    assert model.gemv_norm                    # on by default (SPECDEC_GEMV_NORM=0 turns it off)

    def steps(on):
        _set_norm(model, on, "cpu", max_m=1)
        runner = new_runner(model, torch.float32)
        runner.add_sequence("a")
        calls, original = [], gemv_module.gemv

        def spy(*a, **kw):
            calls.append(kw.get("residual") is not None or kw.get("norm") is not None)
            return original(*a, **kw)
        gemv_module.gemv = spy
        try:
            out = [torch.cat(runner.step([SeqInput("a", toks)])) for toks in ([1, 2, 3], [4], [5, 6], [7])]
        finally:
            gemv_module.gemv = original
        return out, calls

    want, _ = steps(False)
    got, calls = steps(True)
    layers = model.config.num_layers
    assert sum(calls) == 2 * 2 * (2 * layers - 1)   # two 1-token steps: producers + consumers
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
