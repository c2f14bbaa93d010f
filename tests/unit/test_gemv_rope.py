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


def test_shapes_the_plain_gemv_splits_keep_the_separate_kernels():
    """A helper's review: where the plain projection splits K (few N tiles, e.g. a 160m draft's
    qkv at M > 1) its partial sums add in split order, which one pass cannot match, so GemvOps
    keeps projection + rope_store there; the direct call is still RoPE of the projection, to
    float rounding."""
    from specdec.kernels.gemv import GemvOps, rope_keeps_bits
    x, w = torch.randn(3, 768), torch.randn(12 * 3 * 64, 768) * 0.05
    assert not rope_keeps_bits(x, w) and rope_keeps_bits(x[:1], w)
    # a model whose qkv splits K at every step of run_steps (M > 1, K = 256): the same logits bit
    # for bit, and no fused call
    kw = dict(hidden_size=256, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=64)
    want = run_steps(new_runner(_model(config=kw), torch.float16))
    model = _model(config=kw, rope=True)
    assert isinstance(model.ops, GemvOps) and model.ops.fuse_rope
    got, calls = _steps_with_rope_calls(model)
    assert calls and not any(calls)
    for g, w_ in zip(got, want):
        assert torch.equal(g, w_)
    h, hkv, d = 12, 12, 64
    cos, sin = torch.rand(3, d // 2), torch.rand(3, d // 2)
    caches = [torch.zeros(4, 4, hkv, d) for _ in range(4)]
    slots = torch.tensor([0, 5, 9])
    got = gemv(x, w, rope=RopeStore(cos, sin, caches[0], caches[1], slots, h, hkv, d))
    q, k, v = gemv(x, w).split([h * d, hkv * d, hkv * d], -1)
    want = rope_store(q.view(3, h, d), k.view(3, hkv, d), v.view(3, hkv, d), cos, sin, caches[2], caches[3], slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], caches[2], rtol=1e-5, atol=1e-5)


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
    for cfg in (GemvConfig(1, 8, 32), GemvConfig(1, 1, 32)):
        with pytest.raises(ValueError, match="rope"):       # block_m 1 for 2 rows; block_n 1
            gemv(x, w, config=cfg, rope=ok)


def _steps_with_rope_calls(model):
    """run_steps' logits on a fresh fp16 runner, and for each gemv call whether it took rope=."""
    calls = []
    original = gemv_module.gemv
    gemv_module.gemv = lambda *a, **kw: calls.append(kw.get("rope") is not None) or original(*a, **kw)
    try:
        return run_steps(new_runner(model, torch.float16)), calls
    finally:
        gemv_module.gemv = original


def _model(config=None, **sets):
    model = init_random(build_model(tiny_config(**(config or {})), torch.float16, "cpu"), std=0.1, seed=3)
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
    got, calls = _steps_with_rope_calls(model)
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
