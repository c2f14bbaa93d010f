"""RoPE + KV store in the qkv GEMV's epilogue (kernels/gemv.py: gemv(rope=RopeStore(...)),
GemvOps(fuse_rope=True)), on the CPU under TRITON_INTERPRET=1 and on the GPU: RoPE(q) and the
cache slots hold the bits of the projection followed by fused.rope_store (MHA / GQA / MQA heads,
head_dim 16-64, M 1-16, bias, padding slots, half and full cos tables, with the RMSNorm of the
norm fusion on its input), and a model with it gives the same logits as without."""
import pytest
import torch

from specdec.kernels import gemv as gemv_module
from specdec.kernels.fused import rope_store
from specdec.kernels.gemv import GemvConfig, NormInput, RopeStore, gemv
from specdec.models.loader import build_model, init_random
from specdec.runner import SeqInput
from tests.helpers.op_sets import new_runner, run_steps, tiny_config

# The interpreter truncates fp32 -> bf16 instead of rounding: bit checks on the CPU use fp16.
CASES = [(4, 2, 16), (2, 2, 32), (4, 1, 64)]


def _both(m, heads, dtype, device="cpu", bias=True, full_cos=False, norm=False, config=None, seed=0):
    """(fused q, fused caches), (reference q, reference caches) for one random case."""
    h, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    k = 48
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn((h + 2 * hkv) * d, k, generator=gen) * 0.2).to(device, dtype)
    b = torch.randn((h + 2 * hkv) * d, generator=gen).to(device, dtype) if bias else None
    cos = torch.rand(m, d if full_cos else d // 2, generator=gen).to(device)
    sin = torch.rand(m, d if full_cos else d // 2, generator=gen).to(device)
    slots = torch.randperm(24, generator=gen)[:m].to(device)
    if m > 1:
        slots[1] = -1                                   # a padding token: no KV slot
    caches = [torch.full((6, 4, hkv, d), float("nan"), dtype=dtype, device=device) for _ in range(4)]
    nin = None
    if norm:
        nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, dtype)
        sums = torch.stack([x[:, :20].float().pow(2).sum(-1), x[:, 20:].float().pow(2).sum(-1)])
        nin = NormInput(sums, nw, 1e-5)
    q = gemv(x, w, b, config=config, norm=nin, rope=RopeStore(cos, sin, caches[0], caches[1], slots, h, hkv, d))
    plain = gemv(x, w, b, config=config, norm=nin)
    qq, kk, vv = plain.split([h * d, hkv * d, hkv * d], -1)
    ref = rope_store(qq.view(m, h, d), kk.view(m, hkv, d), vv.view(m, hkv, d), cos, sin, caches[2], caches[3],
                     slots)
    return (q, caches[0], caches[1]), (ref, caches[2], caches[3])


def _same(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0))   # unwritten slots stay NaN on both


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("heads", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("m", [1, 3, 16])
def test_epilogue_has_the_bits_of_projection_then_rope_store(dtype, heads, m):
    _same(*_both(m, heads, dtype))


@pytest.mark.parametrize("variant", ["no_bias", "full_cos", "norm", "narrow_tiles"])
def test_variants(variant):
    kw = {"no_bias": dict(bias=False), "full_cos": dict(full_cos=True), "norm": dict(norm=True),
          "narrow_tiles": dict(config=GemvConfig(16, 16, 16, split_k=4))}[variant]   # split-K is dropped
    for m in (1, 5) if variant != "narrow_tiles" else (5,):
        _same(*_both(m, (4, 2, 32), torch.float16, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_on_the_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `make test-gpu` on the device machine)")
    for heads in [(32, 32, 128), (32, 8, 128), (12, 12, 64)]:
        for m in (1, 5, 16):
            _same(*_both(m, heads, dtype, device="cuda", norm=m == 5))


def test_refused_where_it_does_not_fit():
    x, w = torch.randn(2, 32), torch.randn(3 * 2 * 16, 32)
    caches = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    ok = RopeStore(torch.rand(2, 8), torch.rand(2, 8), *caches, torch.tensor([0, 1]), 2, 2, 16)
    assert gemv(x, w, rope=ok).shape == (2, 2, 16)
    for bad in (ok._replace(num_heads=3), ok._replace(head_dim=12), ok._replace(slots=torch.tensor([0])),
                ok._replace(cos=torch.rand(2, 5))):
        with pytest.raises(ValueError, match="rope"):
            gemv(x, w, rope=bad)
    with pytest.raises(ValueError, match="rope"):
        gemv(x, w, epilogue="silu_mul", rope=ok)


def _model(**sets):
    model = init_random(build_model(tiny_config(), torch.float16, "cpu"), std=0.1)
    model.set_fused_kernels(True)
    model.set_gemv_kernels(True)
    for name, on in sets.items():
        getattr(model, f"set_gemv_{name}")(on)
    model.ops.on_cpu = True
    return model


@pytest.mark.parametrize("norm", [False, True])
def test_the_model_gives_the_same_logits(norm):
    """fp16 on the fused op set: with the epilogue the logits are those without it, bit for bit (with
    the norm fusion on both sides when `norm`); the fused qkv GEMV ran in every layer of every step."""
    model = _model(norm=norm)
    want = run_steps(new_runner(model, torch.float16))
    model.set_gemv_rope(True)
    model.ops.on_cpu = True
    assert model.ops.fuse_rope and model.ops.name.endswith("+rope")
    calls = []
    original = gemv_module.gemv
    gemv_module.gemv = lambda *a, **kw: calls.append(kw.get("rope") is not None) or original(*a, **kw)
    try:
        got = run_steps(new_runner(model, torch.float16))
    finally:
        gemv_module.gemv = original
    assert calls.count(True) == 3 * model.config.num_layers
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_steps_above_sixteen_tokens_and_torch_ops_keep_the_separate_kernels():
    model = _model(rope=True)
    model.ops.on_cpu = True
    runner = new_runner(model, torch.float16)
    runner.add_sequence("a")
    got = torch.cat(runner.step([SeqInput("a", list(range(1, 18)), num_logits=2)]))
    model.set_gemv_rope(False)
    model.ops.on_cpu = True
    runner = new_runner(model, torch.float16)
    runner.add_sequence("a")
    want = torch.cat(runner.step([SeqInput("a", list(range(1, 18)), num_logits=2)]))
    assert torch.equal(got, want)
    torch_ops = init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1)
    torch_ops.set_gemv_kernels(True)
    torch_ops.set_gemv_rope(True)              # needs the fused op set's rope_store: not taken
    assert not torch_ops.ops.fuse_rope
