"""The skinny-GEMM kernel (kernels/gemv.py) against float64 torch: on the CPU under TRITON_INTERPRET=1
(conftest sets it), both code paths (M = 1 elementwise, M > 1 tl.dot), split-K on and off, shapes
that are not multiples of the blocks; on the GPU the same plus Llama-7B shapes, and a tiny model's
logits with the GEMV on against the same weights on cuBLAS, eager and inside a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from specdec.kernels import gemv as gemv_module
from specdec.kernels.gemv import MAX_M, GemvConfig, GemvOps, default_config, gemv, linear, split_layout
from specdec.models.llama import TorchLayerOps
from specdec.models.loader import build_model, init_random
from tests.helpers.op_sets import assert_switch_keeps_logits, new_runner, run_steps, tiny_config

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Relative (Frobenius) error against float64: fp32 is reduction order only; bf16 adds the one
# rounding of the output (2^-9 relative; the interpreter truncates rather than rounds: up to 2^-8).
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


def _operands(m, n, k, dtype, device, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    return x, w, b


def _err(y, x, w, b):
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    return ((y.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 40, 64])
@pytest.mark.parametrize("split", [1, 3], ids=["one-split", "split-k3"])
def test_gemv_matches_float64(device, dtype, m, split):
    n, k = 37, 200  # neither a multiple of any block: masked rows and a ragged last K step
    x, w, b = _operands(m, n, k, dtype, device, bias=m % 2 == 1)
    base = default_config(m, n, k, 132)
    cfg = GemvConfig(base.block_m, base.block_n, 32, split_k=split)  # 7 K steps: splits of 3, 3, 1
    y = gemv(x, w, b, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _err(y, x, w, b) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_default_config_and_even_k(device):
    for m, n, k in [(1, 64, 128), (5, 48, 256), (16, 20, 64)]:
        x, w, b = _operands(m, n, k, torch.float32, device, bias=True, seed=m)
        assert _err(gemv(x, w, b), x, w, b) < TOL[torch.float32]


def test_gemv_strided_input_and_empty_shapes():
    x, w, _ = _operands(4, 24, 80, torch.float32, "cpu", bias=False)
    wide = torch.randn(4, 160)
    wide[:, ::2] = x  # a non-contiguous view
    assert _err(gemv(wide[:, ::2], w), x, w, None) < TOL[torch.float32]
    assert gemv(x[:0], w).shape == (0, 24)
    b = torch.randn(24)
    torch.testing.assert_close(gemv(torch.ones(3, 0), torch.ones(24, 0), b), b.expand(3, 24))


def test_gemv_rejects_what_it_does_not_serve():
    x, w, _ = _operands(MAX_M + 1, 8, 16, torch.float32, "cpu", bias=False)
    with pytest.raises(ValueError, match="M <= 64"):
        gemv(x, w)
    with pytest.raises(ValueError, match="dtype|must be one of"):
        gemv(x[:2], w.double())
    with pytest.raises(ValueError, match="block_m"):
        gemv(x[:1], w, config=GemvConfig(16, 16, 16))
    with pytest.raises(ValueError, match="block_m 48"):
        GemvConfig(48, 16, 16)


def test_default_config_splits_k_only_where_n_cannot_fill_the_sms():
    for m in (1, 4, 8, 20, 40, 64):
        for n, k in [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]:
            cfg = default_config(m, n, k, 132)
            tiles = -(-n // cfg.block_n)
            assert cfg.block_m == (1 if m == 1 else 16 if m <= 16 else 64)    # one M tile up to MAX_M
            tiles *= -(-m // cfg.block_m)
            if tiles >= 132:
                assert cfg.split_k == 1, (m, n, k, cfg)
            else:  # 4096 / 32 = 128 tiles at M > 1: split in two
                assert tiles * split_layout(k, cfg)[1] >= 132, (m, n, k, cfg)
        assert default_config(m, 32000, 4096, 132).split_k == 1
    # Small N (e.g. a tensor-parallel shard of a small model): the splits that launch fill the SMs
    # and are the ones the config names (uneven K blocks once launched fewer: 5 asked, 4 ran).
    for n, k in [(256, 4096), (192, 11008), (320, 192), (768, 768), (64, 4096)]:
        cfg = default_config(1, n, k, 132)
        launched = split_layout(k, cfg)[1]
        assert launched == cfg.split_k, (n, k, cfg)
        blocks = -(-k // cfg.block_k)
        assert -(-n // cfg.block_n) * launched >= 132 or launched == min(blocks, 16), (n, k, cfg)
    assert default_config(1, 256, 512, 132).split_k == 1  # K holds one block: nothing to split


def test_linear_dispatch():
    x, w, b = _operands(3, 24, 40, torch.float32, "cpu", bias=True)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # CPU without on_cpu: F.linear itself
    x3 = x.view(3, 1, 40)
    got = linear(x3, w, b, on_cpu=True)
    assert got.shape == (3, 1, 24) and _err(got.view(3, 24), x, w, b) < TOL[torch.float32]
    big, _, _ = _operands(MAX_M + 1, 24, 40, torch.float32, "cpu", bias=False)
    assert torch.equal(linear(big, w, on_cpu=True), F.linear(big, w))


def test_linear_dispatch_bound_and_its_override(monkeypatch):
    """By default steps of up to SERVE_MAX_M (64) rows go to the kernel (40 rows: verification at
    b 8, γ 4), except that above 16 rows a projection wider than WIDE_MAX_N goes to F.linear;
    serve_max_m_forced(16) (the kernel set gemv_m16) sends the 40 rows to F.linear and
    wide_max_n.forced(None) the wide projection to the kernel; the bounds come back after the block."""
    calls = []
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append((a[0].shape[0], a[1].shape[0]))
                        or F.linear(*a[:2]))
    x, w, _ = _operands(40, 24, 40, torch.float32, "cpu", bias=False)
    wide = torch.zeros(gemv_module.WIDE_MAX_N + 8, 40)
    assert gemv_module.SERVE_MAX_M == 64 and gemv_module.SMALL_TILE_MAX_M == 16
    linear(x, w, on_cpu=True)
    linear(x, wide, on_cpu=True)          # 40 rows, too wide: F.linear
    linear(x[:16], wide, on_cpu=True)     # 16 rows: the kernel at any width
    linear(x[:17], wide, on_cpu=True)     # 17: F.linear
    assert calls == [(40, 24), (16, wide.shape[0])]
    with gemv_module.serve_max_m_forced(16):
        linear(x, w, on_cpu=True)
    with gemv_module.wide_max_n.forced(None):
        linear(x, wide, on_cpu=True)
    assert calls == [(40, 24), (16, wide.shape[0]), (40, wide.shape[0])]
    linear(x, w, on_cpu=True)
    linear(x, wide, on_cpu=True)
    assert calls[3:] == [(40, 24)]
    with pytest.raises(ValueError, match="outside"):
        with gemv_module.serve_max_m_forced(MAX_M + 1):
            pass
    with pytest.raises(ValueError, match="wide_max_n"):
        with gemv_module.wide_max_n.forced(0):
            pass


def test_gemv_is_off_on_the_cpu_by_default_and_composes_with_the_layer_ops():
    model = build_model(tiny_config(), torch.float32, "cpu")
    assert not model.gemv_kernels and type(model.ops) is TorchLayerOps
    model.set_gemv_kernels(True)
    assert isinstance(model.ops, GemvOps) and model.ops.name == "torch+gemv+norm"   # norm fusion: on
    model.set_fused_kernels(True)
    assert model.ops.name == "fused+gemv+norm"
    model.set_gemv_kernels(False)
    assert model.ops.name == "fused"


def test_model_with_gemv_matches_cublas_path_on_cpu():
    """The wiring (qkv, o, gate_up, down, LM head through ops.linear) with the kernel itself run by the
    interpreter: the prefill step has 16 tokens, decode 2, verify 5; fp32."""
    model = init_random(build_model(tiny_config(qkv_bias=True), torch.float32, "cpu"), std=0.1)
    want = run_steps(new_runner(model, torch.float32))
    model.set_gemv_kernels(True)
    model.ops.on_cpu = True
    got = run_steps(new_runner(model, torch.float32))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8, 16])
@pytest.mark.parametrize("shape", [(12288, 4096), (4096, 4096), (4096, 11008), (32000, 4096)],
                         ids=["qkv", "o", "down", "lm_head"])
@pytest.mark.parametrize("split", [None, 4], ids=["default", "split-k4"])
def test_gemv_llama7b_shapes_on_cuda(m, shape, split):
    n, k = shape
    x, w, _ = _operands(m, n, k, torch.bfloat16, "cuda", bias=False)
    cfg = default_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    if split:
        cfg = GemvConfig(cfg.block_m, cfg.block_n, cfg.block_k, split_k=split)
    # Against float64 the bf16 output rounding dominates; F.linear's own error is the yardstick.
    assert _err(gemv(x, w, config=cfg), x, w, None) <= 1.5 * _err(F.linear(x, w), x, w, None) + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["torch-ops", "fused-ops"])
def test_gemv_logits_match_cublas_on_cuda(dtype, fused):
    cfg = tiny_config(hidden_size=256, intermediate_size=688, num_heads=8, num_kv_heads=8, head_dim=32)
    model = init_random(build_model(cfg, dtype, "cuda", fused_kernels=fused, gemv_kernels=True), std=0.05)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_switch_keeps_logits(model, dtype, lambda m: m.set_gemv_kernels(False), tol)


@pytest.mark.gpu
def test_fused_silu_gate_up_keeps_graphed_logits_on_cuda():
    """The SiLU * up epilogue in real graphs, bf16, fused layer kernels, against eager steps with the
    separate silu_mul kernel (the tolerance covers graph vs eager split-KV sums; the kernel-level
    test above checks the epilogue's bits)."""
    model = init_random(build_model(tiny_config(), torch.bfloat16, "cuda"), std=0.05)
    model.set_gemv_silu(True)
    runner = new_runner(model, torch.bfloat16)
    runner.enable_cuda_graphs(max_model_len=64, query_lens=(1,), batch_sizes=(4,))
    assert_switch_keeps_logits(model, torch.bfloat16, lambda m: m.set_gemv_silu(False), 2e-2, runner)


@pytest.mark.gpu
def test_gemv_graphed_decode_matches_eager_cublas():
    model = init_random(build_model(tiny_config(), torch.bfloat16, "cuda"), std=0.05)
    assert model.gemv_kernels and isinstance(model.ops, GemvOps)  # the CUDA default
    runner = new_runner(model, torch.bfloat16)
    runner.enable_cuda_graphs(max_model_len=64, query_lens=(1,), batch_sizes=(4,))
    assert_switch_keeps_logits(model, torch.bfloat16, lambda m: m.set_gemv_kernels(False), 2e-2, runner)
    assert runner.graphs.replays > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, k, split, block_n", [(1, 256, 1, 8), (1, 200, 3, 4), (5, 256, 1, 32),
                                                  (16, 200, 2, 16)])
def test_silu_mul_epilogue_gives_the_bits_of_gate_up_then_silu_mul(device, dtype, m, k, split, block_n):
    """epilogue="silu_mul" returns SiLU(gate) * up of a [2I, K] projection with exactly the bits of
    the projection followed by the silu_mul kernel, on both code paths (M = 1 and tl.dot), with
    split-K (the reduce kernel applies it), a ragged last K step, I not a multiple of the tile,
    and bias."""
    from specdec.kernels.fused import silu_mul
    inter = 21
    x, w, b = _operands(m, 2 * inter, k, dtype, device, bias=m == 5)
    base = default_config(m, 2 * inter, k, 132)
    cfg = GemvConfig(base.block_m, block_n, 32, split_k=split)
    fused = gemv(x, w, b, cfg, epilogue="silu_mul")
    assert fused.shape == (m, inter)
    if device == "cpu" and m > 1 and dtype == torch.float32:
        # The interpreter's fp32 tl.dot is numpy's matmul, whose bits on some CPUs depend on where a
        # column sits in the product (OpenBLAS's AVX-512 sgemm: permuting W's rows changed 150 of
        # 512 products of a [16, 32] x [32, 32] tile), and the SiLU tile holds the gate and up rows
        # where the plain tile holds neighbouring rows. So there: the same values (the GPU, and
        # every bf16 or one-row case, still checks bits).
        torch.testing.assert_close(fused, silu_mul(gemv(x, w, b, cfg)), rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(fused, silu_mul(gemv(x, w, b, cfg)))
    with pytest.raises(ValueError, match="odd"):
        gemv(x, w[:-1], epilogue="silu_mul")


def test_fused_silu_gate_up_in_the_model_on_cpu():
    """GemvOps(fuse_silu=True) through the model: the gate_up projection returns SiLU * up where
    the GEMV serves (decode and verify steps, the 16-token prefill of run_steps), and logits are
    those of the separate silu_mul."""
    model = init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1)
    model.set_gemv_kernels(True)
    model.ops.on_cpu = True
    want = run_steps(new_runner(model, torch.float32))
    model.set_gemv_silu(True)
    model.ops.on_cpu = True
    assert model.ops.name == "torch+gemv+silu+norm" and model.ops.fuse_silu
    fused = []
    original = gemv_module.gemv
    gemv_module.gemv = lambda *a, **kw: fused.append(kw.get("epilogue")) or original(*a, **kw)
    try:
        got = run_steps(new_runner(model, torch.float32))
    finally:
        gemv_module.gemv = original
    assert "silu_mul" in fused
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    model.set_gemv_silu(False)
    assert model.ops.name == "torch+gemv+norm"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, block_m", [(17, 16), (40, 16), (40, 32), (40, 64), (64, 32)])
@pytest.mark.parametrize("split", [1, 3], ids=["one-split", "split-k3"])
@pytest.mark.parametrize("reduce", ["inline", "separate"])
def test_row_tiles_cover_every_row(device, m, block_m, split, reduce):
    """M above the row tile runs in ceil(M / BLOCK_M) tiles of their own (each program over the same
    W tile): every row right, with either split-K reduce, in bf16, each row checked on its own (a row
    no tile wrote holds whatever torch.empty gave, not its product)."""
    n, k = 37, 200
    x, w, b = _operands(m, n, k, torch.bfloat16, device, bias=True, seed=m + block_m)
    cfg = GemvConfig(block_m, 16, 32, split_k=split)
    with gemv_module.split_reduce_forced(reduce):
        y = gemv(x, w, b, cfg)
    assert torch.isfinite(y).all() and _err(y, x, w, b) < TOL[torch.bfloat16]
    for row in range(m):   # no row left to another row's values (a tile offset error would repeat rows)
        want = x[row].double() @ w.double().T + b.double()
        assert ((y[row].double() - want).norm() / want.norm()).item() < 2e-2, row


@pytest.mark.parametrize("split", [1, 3], ids=["one-split", "split-k3"])
def test_residual_producer_over_row_tiles(split):
    """The residual epilogue with 40 rows in 16-row tiles: r = residual + x @ W^T as torch rounds it,
    and the per-program sums of squares add up to each row's sum of r^2."""
    m, n, k = 40, 48, 96
    x, w, _ = _operands(m, n, k, torch.float32, "cpu", bias=False, seed=5)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(6))
    cfg = GemvConfig(16, 16, 32, split_k=split)
    r, sums = gemv(x, w, config=cfg, residual=res)
    want = res.double() + x.double() @ w.double().T
    assert ((r.double() - want).norm() / want.norm()).item() < TOL[torch.float32]
    torch.testing.assert_close(sums.sum(0).double(), r.double().pow(2).sum(1), rtol=1e-5, atol=1e-5)
