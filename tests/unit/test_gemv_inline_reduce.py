"""The GEMV's inline split-K reduce (SPECDEC_GEMV_SPLIT_REDUCE=inline, gemv.split_reduce_forced):
each N tile's last program to arrive sums the tile's fp32 partials in split order and runs the
epilogue, instead of a second kernel. On the CPU under TRITON_INTERPRET=1 (programs run one after
another there: which program comes last does not vary, the GPU tests cover that).

- plain, bias and SiLU * up: the bits of the separate reduce (the same sums in the same order);
- the residual producer: the same new residual stream, one sum of squares per N tile (the separate
  reduce gives one per reduce program), and a norm consumer reading them gives RMSNorm's value;
- every arrival count is back to 0 after each launch (the next launch, or graph replay, starts
  from 0 without a memset);
- a model whose projections split (K = 600): logits of the separate reduce, fused norm and SiLU."""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import gemv as gemv_module
from specdec.kernels.gemv import GemvConfig, NormInput, gemv, split_layout
from specdec.models.llama import RMSNorm
from specdec.models.loader import build_model, init_random
from tests.helpers.op_sets import new_runner, run_steps, tiny_config
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
def inline():
    return gemv_module.split_reduce_forced("inline")


def separate():
    return gemv_module.split_reduce_forced("separate")


@pytest.fixture
def poisoned(monkeypatch):
    """gemv's buffers (the output, the partials' workspace) come filled with NaN: an element or a
    partial nobody wrote shows (fresh CPU memory often holds the previous call's values)."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(gemv_module.torch, "empty", empty)


def _counts_zero() -> bool:
    return not gemv_module._counters(torch.device("cpu")).any()


def _cfg(m, block_n, block_k, split):
    return GemvConfig(1 if m == 1 else 16, block_n, block_k, split_k=split)


# (m, k, n, block_n, block_k, split): M = 1 elementwise and tl.dot rows, ragged K and N, uneven splits
CASES = [(1, 96, 72, 16, 16, 4), (1, 600, 64, 8, 64, 5), (3, 96, 200, 16, 32, 3), (16, 40, 72, 16, 16, 3),
         (5, 600, 64, 32, 128, 4)]


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "m{}-k{}-n{}-bn{}-bk{}-s{}".format(*c))
def test_bits_of_the_separate_reduce(dtype, case, poisoned):
    m, k, n, bn, bk, split = case
    cfg = _cfg(m, bn, bk, split)
    assert split_layout(k, cfg)[1] > 1
    gen = torch.Generator().manual_seed(m * 100 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    w2 = (torch.randn(2 * n, k, generator=gen) * 0.1).to(dtype)
    b2 = torch.randn(2 * n, generator=gen).to(dtype)
    calls = [lambda: gemv(x, w, config=cfg), lambda: gemv(x, w, b, config=cfg),
             lambda: gemv(x, w2, b2, config=cfg, epilogue="silu_mul")]
    for call in calls:
        with separate():
            want = call()
        with inline():
            got = call()
            assert _counts_zero()
        assert got.shape == want.shape and torch.equal(got, want)
    # and against float64: the sums are right, not only the same
    ref = (x.double() @ w.double().t() + b.double()).to(dtype)
    with inline():
        torch.testing.assert_close(gemv(x, w, b, config=cfg), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("m", [1, 4])
def test_residual_producer_sums_per_tile_and_a_consumer(m, poisoned):
    k, n, bn = 600, 200, 16
    cfg = _cfg(m, bn, 64 if m == 1 else 128, 4)
    gen = torch.Generator().manual_seed(7 + m)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.1
    wide = torch.randn(m, n + 9, generator=gen)
    res = wide[:, 5:5 + n]   # a strided residual (a view)
    with separate():
        want, want_sums = gemv(x, w, config=cfg, residual=res)
    with inline():
        r, sums = gemv(x, w, config=cfg, residual=res)
        assert _counts_zero()
    assert torch.equal(r, want)
    tiles = -(-n // bn)
    assert sums.shape == (tiles, m) and want_sums.shape[0] != tiles
    for t in range(tiles):
        torch.testing.assert_close(sums[t], r[:, bn * t:bn * (t + 1)].pow(2).sum(-1), rtol=2e-6, atol=0)
    nw = 1 + 0.1 * torch.randn(n, generator=gen)
    w3 = torch.randn(24, n, generator=gen) * 0.1
    with inline():
        out = gemv(r, w3, norm=NormInput(sums, nw, 1e-5), config=_cfg(m, 16, 64, 3))
    want_out = RMSNorm.forward(NormInput(None, nw, 1e-5), r) @ w3.t()
    torch.testing.assert_close(out, want_out, rtol=2e-5, atol=2e-5)


def test_counts_left_by_a_broken_launch_would_show(poisoned):
    """The arrival count decides who reduces: a count left non-zero (what a missing reset would
    leave) makes the next launch reduce too early. The reset is what these tests check."""
    m, k, n = 1, 96, 72
    cfg = _cfg(m, 16, 16, 4)
    x, w = torch.randn(m, k), torch.randn(n, k)
    with inline():
        good = gemv(x, w, config=cfg)
        counters = gemv_module._counters(torch.device("cpu"))
        counters[0] = 1   # tile 0 starts one arrival ahead
        bad = gemv(x, w, config=cfg)
        counters.zero_()
    assert torch.equal(bad[:, 16:], good[:, 16:]) and not torch.equal(bad[:, :16], good[:, :16])


@pytest.mark.parametrize("silu", [False, True])
def test_model_whose_projections_split(silu):
    model = init_random(build_model(tiny_config(intermediate_size=600), F32, "cpu"), std=0.1)
    model.set_fused_kernels(False)
    model.set_gemv_kernels(True)
    model.set_gemv_silu(silu)
    model.set_gemv_norm(True)
    model.ops.on_cpu = True
    model.ops.norm_max_m = 16
    with separate():
        want = run_steps(new_runner(model, F32))
    with inline():
        got = run_steps(new_runner(model, F32))
        assert _counts_zero()
    for g, wt in zip(got, want):
        assert torch.isfinite(g).all()
        # the norm's sums of squares are grouped per N tile, not per reduce program: fp32 rounding
        assert ((g.double() - wt.double()).norm() / wt.double().norm()).item() < 1e-6


def test_mode_is_checked():
    with pytest.raises(ValueError, match="split reduce mode"):
        gemv_module.set_split_reduce("atomic")
    assert gemv_module.split_reduce() in gemv_module.SPLIT_REDUCE_MODES


# --- on the GPU: programs arrive in any order, many at once -------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("shape", [(768, 768), (768, 3072), (2048, 5632), (4096, 11008)],
                         ids=["160m-o", "160m-down", "1.1b-down", "7b-down"])
def test_inline_reduce_bits_on_cuda_again_and_again(m, shape):
    """The default configs of the drafts' split projections (and the 7B's down projection at 8
    rows): inline against separate bits, 50 launches in a row (a partial read before it was
    written, or a count not reset, would show as a different or NaN output), the counts all back
    to 0, and a CUDA graph of it replayed."""
    n, k = shape
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = gemv_module.default_config(m, n, k, sms)
    if split_layout(k, cfg)[1] == 1:
        cfg = GemvConfig(cfg.block_m, cfg.block_n, cfg.block_k, split_k=4)
    gen = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=gen).to(dev, BF16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dev, BF16)
    res = torch.randn(m, n, generator=gen).to(dev, BF16)
    with separate():
        want = gemv(x, w, config=cfg)
        want_r, _ = gemv(x, w, config=cfg, residual=res)
    with inline():
        gemv_module._counters(dev)
        outs = [gemv(x, w, config=cfg) for _ in range(50)]
        rs = [gemv(x, w, config=cfg, residual=res)[0] for _ in range(10)]
        torch.cuda.synchronize()
        assert not gemv_module._counters(dev).any()
        assert all(torch.equal(o, want) for o in outs) and all(torch.equal(r, want_r) for r in rs)
        graph = torch.cuda.CUDAGraph()
        static = torch.empty_like(want)
        with torch.cuda.graph(graph):
            static.copy_(gemv(x, w, config=cfg))
        for _ in range(20):
            static.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static, want)
        assert not gemv_module._counters(dev).any()


@pytest.mark.gpu
def test_inline_reduce_graphed_logits_on_cuda():
    """A model whose down projection splits (K = 600), graphed decode with the inline reduce,
    against eager steps with the separate one."""
    model = init_random(build_model(tiny_config(intermediate_size=600), BF16, "cuda"), std=0.05)
    gemv_module._counters(torch.device("cuda"))
    with inline():
        runner = new_runner(model, BF16)
        runner.enable_cuda_graphs(max_model_len=64, query_lens=(1,), batch_sizes=(4,))
        got = run_steps(runner)
        assert runner.graphs.replays > 0
    with separate():
        want = run_steps(new_runner(model, BF16))
    for g, wt in zip(got, want):
        assert torch.isfinite(g).all()
        assert ((g.double() - wt.double()).norm() / wt.double().norm()).item() < 2e-2
