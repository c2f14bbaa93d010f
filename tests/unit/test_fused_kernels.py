"""Fused layer kernels (kernels/fused.py) against the torch path (models/llama.TorchLayerOps): on the
CPU under TRITON_INTERPRET=1 (conftest sets it), fp32 and bf16, small shapes; on the GPU the kernels
and a tiny model's logits with fused kernels against the same model on the torch ops."""
import pytest
import torch

from specdec.config import RopeConfig
from specdec.kernels.fused import FusedLayerOps, add_rmsnorm, rope_store, silu_mul
from specdec.models.llama import RMSNorm, TorchLayerOps
from specdec.models.loader import build_model, init_random
from specdec.models.rope import Rotary, apply_rotary
from tests.helpers.op_sets import assert_switch_keeps_logits, new_runner, run_steps, tiny_config

DTYPES = [torch.float32, torch.bfloat16]
# bf16: the kernels round where torch does, so only reduction order and exp/rsqrt differ (1 ulp).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def same_roundings(dtype, device):
    """Tolerance where the kernel rounds exactly where torch does. fp32: fma contraction may move the
    last bit. bf16: exact on the GPU (round-to-nearest), but the interpreter truncates fp32 -> bf16,
    so on the CPU allow a few ulps."""
    if dtype == torch.float32:
        return dict(rtol=2e-6, atol=2e-6)
    return dict(rtol=0, atol=0) if device == "cuda" else dict(rtol=2e-2, atol=2e-2)


def _norm(n, dtype, device, gen):
    norm = RMSNorm(n, 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(n, generator=gen))
    return norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_torch(device, dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    t, n = 5, 48  # n not a power of two: masked columns
    norm = _norm(n, dtype, device, gen)
    x = torch.randn(t, n, generator=gen).to(device, dtype)
    res = torch.randn(t, n, generator=gen).to(device, dtype) if with_residual else None
    got, got_res = add_rmsnorm(x, res, norm.weight, norm.eps)
    want, want_res = TorchLayerOps.add_rmsnorm(x, res, norm)
    assert got.dtype == want.dtype and got_res.dtype == want_res.dtype
    torch.testing.assert_close(got_res, want_res, **same_roundings(dtype, device))
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_torch(device, dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(4, 2 * 40, generator=gen)).to(device, dtype)
    torch.testing.assert_close(silu_mul(gate_up), TorchLayerOps.silu_mul(gate_up), **TOL[dtype])


def _qkv(t, h, hkv, d, dtype, device, gen):
    """q, k, v as the model makes them: strided views of one qkv projection output."""
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(device, dtype)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)


def _rope64(x, cos, sin):
    """float64 rotation of the given operands, and the size of its terms, |x| |cos| + |rot(x)| |sin|:
    the scale that rounding errors of a rotation are measured against (where the two products
    cancel, the result itself can be much smaller)."""
    x, cos, sin = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin, x.abs() * cos.abs() + rot.abs() * sin.abs()


def _ulps(got, ref64, scale64):
    """|got - ref| in units of the last place of got's dtype at the terms' magnitude."""
    finfo = torch.finfo(got.dtype)
    unit = finfo.eps * torch.exp2(torch.floor(torch.log2(scale64.clamp_min(finfo.tiny))))
    return (got.double() - ref64).abs() / unit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 2, 16), (3, 3, 12)], ids=["gqa-d16", "mha-d12-pad"])
@pytest.mark.parametrize("half_fp32", [False, True], ids=["cos-full", "cos-half-fp32"])
def test_rope_store_matches_float64(device, dtype, heads, half_fp32):
    """RoPE(q) returned, RoPE(k) and v stored in their slots, against a float64 rotation of the same
    rounded operands, in units of the last place at the size of the rotation's terms: bf16 within 1
    on the GPU (2 in the interpreter) and no less accurate than the torch path; fp32 within 1.5."""
    h, hkv, d = heads
    gen = torch.Generator().manual_seed(3)
    t, nb, bs = 6, 5, 4
    q, k, v = _qkv(t, h, hkv, d, dtype, device, gen)
    positions = torch.tensor([0, 1, 2, 7, 300, 4095], device=device)
    rotary = Rotary(RopeConfig(), d).to(device)
    cos, sin = rotary.cos_sin(positions, dtype)          # what the kernel rounds its table to
    table = rotary.cos_sin_half(positions) if half_fp32 else (cos, sin)
    slots = torch.tensor([3, -1, 0, 17, 9, 12], device=device)  # -1: a padding token, no store
    k_cache, v_cache = (torch.zeros(nb, bs, hkv, d, dtype=dtype, device=device) for _ in range(2))
    got_q = rope_store(q, k, v, *table, k_cache, v_cache, slots)

    keep = slots >= 0
    got_k = k_cache.view(-1, hkv, d)[slots[keep]]
    # bf16: the products are exact in fp32 and the kernel rounds once (the GPU to nearest: <= 1/2
    # unit + fp32's error); the interpreter truncates, both the table and the result (< 2 units).
    # fp32: each product may round too, unless the compiler fuses a multiply-add (<= 1.5 units).
    bound = 1.5 if dtype == torch.float32 else 1.0 if device == "cuda" else 2.0
    for got, x, c, s in ((got_q, q, cos, sin), (got_k, k[keep], cos[keep], sin[keep])):
        ref, scale = _rope64(x, c, s)
        assert got.dtype == dtype
        err = _ulps(got, ref, scale)
        assert err.max().item() <= bound, f"{err.max().item():.2f} units from the float64 rotation"
        if device == "cuda" and dtype == torch.bfloat16:  # the torch path rounds each product too
            assert err.sum() <= _ulps(apply_rotary(x, c, s), ref, scale).sum()
    assert torch.equal(v_cache.view(-1, hkv, d)[slots[keep]], v[keep])
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert not k_cache.view(-1, hkv, d)[untouched].any() and not v_cache.view(-1, hkv, d)[untouched].any()


def test_rope_store_rejects_mismatched_cache():
    q, k, v = _qkv(2, 4, 2, 16, torch.float32, "cpu", torch.Generator().manual_seed(0))
    cos = sin = torch.ones(2, 16)
    cache = torch.zeros(3, 4, 4, 16)  # 4 KV heads, k has 2
    with pytest.raises(ValueError, match="caches"):
        rope_store(q, k, v, cos, sin, cache, cache, torch.tensor([0, 1]))


def test_cpu_models_keep_the_torch_path():
    assert type(build_model(tiny_config(), torch.float32, "cpu").ops) is TorchLayerOps


def test_model_with_fused_ops_matches_torch_ops_on_cpu():
    """The whole layer wiring (residual pattern, final norm, KV store inside rope_store) through the
    interpreter: fp32, one tiny model, both op sets."""
    model = init_random(build_model(tiny_config(), torch.float32, "cpu", fused_kernels=False), std=0.1)
    want = run_steps(new_runner(model, torch.float32))
    model.set_fused_kernels(True)
    assert isinstance(model.ops, FusedLayerOps)
    got = run_steps(new_runner(model, torch.float32))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", [tiny_config(), tiny_config(hidden_size=256, intermediate_size=688, num_heads=8,
                                                            num_kv_heads=8, head_dim=32, num_layers=3)],
                         ids=["gqa", "mha"])
def test_fused_logits_match_torch_ops_on_cuda(dtype, cfg):
    model = init_random(build_model(cfg, dtype, "cuda", gemv_kernels=False), std=0.05)
    assert isinstance(model.ops, FusedLayerOps)  # the CUDA default (under the GEMV, off here)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_switch_keeps_logits(model, dtype, lambda m: m.set_fused_kernels(False), tol)


@pytest.mark.gpu
def test_fused_graphed_decode_matches_eager_torch_ops():
    """Graph capture with the fused kernels (padding tokens with slot -1) gives the eager torch logits."""
    cfg = tiny_config()
    model = init_random(build_model(cfg, torch.bfloat16, "cuda"), std=0.05)
    runner = new_runner(model, torch.bfloat16)
    runner.enable_cuda_graphs(max_model_len=64, query_lens=(1,), batch_sizes=(4,))
    assert_switch_keeps_logits(model, torch.bfloat16, lambda m: m.set_fused_kernels(False), 2e-2, runner)
    assert runner.graphs.replays > 0
