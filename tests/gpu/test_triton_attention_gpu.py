"""Triton paged attention and KV store on the GPU: fp16/bf16 against a float64 oracle on fresh random
inputs, the output poisoned with NaN before each run (an unwritten element fails, NaN never
passes), and the runner's logits with the Triton backend against the torch backend."""
import dataclasses
import zlib

import pytest
import torch
from triton.runtime.errors import OutOfResources

from specdec.config import CacheConfig, ModelConfig
from specdec.kernels.paged_inputs import random_paged_batch, reference_f64, rel_error
from specdec.kernels.reference import TorchAttention, store_kv_ref
from specdec.kernels.triton_attention import (TritonAttention, _tile_counters, merge_warps,
                                               paged_attention, store_kv)
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
DTYPES = [torch.float16, torch.bfloat16]

# (query_lens, context_lens): decode, verification (k+1), prefill chunks, all mixed in one batch
BATCHES = {
    "decode": ([1] * 6, [1, 15, 16, 17, 300, 1000]),
    "verify": ([5, 8, 1, 16, 9], [5, 40, 2049, 700, 129]),
    "mixed_prefill": ([200, 1, 64, 33], [250, 4000, 64, 1500]),
    "long_decode": ([1, 4], [8192, 6000]),                    # few programs: split-KV path
}
HEADS = [(32, 32, 128), (32, 8, 128), (8, 1, 64), (14, 2, 64)]  # MHA, GQA 4, MQA 8, group 7


def attention(batch, scale, **kw):
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                    batch.query_start_loc, batch.max_query_len, scale,
                    max_context_len=batch.max_context_len, out=out, **kw)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("merge", ["separate", "inline"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda x: "x".join(map(str, x)))
@pytest.mark.parametrize("name", list(BATCHES))
def test_matches_float64_reference(name, heads, dtype, merge):
    h, hkv, d = heads
    qls, ctxs = BATCHES[name]
    seed = zlib.crc32(f"{name}{heads}{dtype}".encode())
    for block_size in (16, 32) if name == "verify" else (16,):
        batch = random_paged_batch(qls, ctxs, h, hkv, d, block_size, dtype, "cuda", seed=seed)
        ref = reference_f64(batch, d ** -0.5)
        for splits in (None, 1, 7) if merge == "separate" else (None, 3, 7):
            out = attention(batch, d ** -0.5, num_splits=splits, merge=merge)
            err = rel_error(out, ref)
            assert err < TOL[dtype], (name, heads, dtype, block_size, splits, err)


@pytest.mark.parametrize("warps", [0, 1, 2, 4])
def test_separate_merge_at_every_warp_count(warps):
    # The split merge's result does not depend on its warps (triton_attention.merge_num_warps picks
    # them by size; 0 = that rule: 1, 1, 4, 1 and 2 warps here): ragged contexts, splits up to 64,
    # S_PAD x D_PAD from 1024 to 8192, head dim 256 too.
    for (h, hkv, d), splits in (((32, 32, 128), 8), ((14, 2, 64), 30), ((32, 8, 128), 64),
                                ((16, 16, 256), 8), ((16, 16, 256), 16)):
        batch = random_paged_batch([1, 5, 1], [4000, 517, 1], h, hkv, d, 16, torch.bfloat16, "cuda",
                                   seed=warps + splits)
        ref = reference_f64(batch, d ** -0.5)
        with merge_warps.forced(warps):
            out = attention(batch, d ** -0.5, num_splits=splits, merge="separate")
        assert rel_error(out, ref) < TOL[torch.bfloat16], (h, hkv, d, splits, warps)


@pytest.mark.parametrize("splits", [2, 5, 16])
def test_inline_merge_graph_replays_reset_counters(splits):
    # A graph captured around an inline-merge call replays correctly on new inputs, twice, and
    # leaves every arrival counter at zero (the last split of each tile resets its own).
    h, hkv, d = 32, 8, 128
    batch = random_paged_batch([1, 8, 3, 1], [4000, 517, 64, 1], h, hkv, d, 16, torch.bfloat16,
                               "cuda", seed=splits)
    out = torch.full_like(batch.q, float("nan"))

    def call():
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                        batch.query_start_loc, batch.max_query_len, d ** -0.5,
                        max_context_len=batch.max_context_len, num_splits=splits, out=out,
                        merge="inline")

    call()                                   # eager first: compiles, makes the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    gen = torch.Generator(device="cuda").manual_seed(splits)
    for _ in range(2):
        batch.q.copy_(torch.randn(batch.q.shape, device="cuda", generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(out, reference_f64(batch, d ** -0.5)) < TOL[torch.bfloat16]
        assert not _tile_counters(out.device, 4096).any()


@pytest.mark.parametrize("merge", ["separate", "inline"])
def test_graph_sized_for_long_sequences_serves_short_ones(merge):
    # A decode graph as a server captures it: the plan (and its split count) from a 4096-token
    # bound, replayed on contexts that fill one, some or all of its splits (the rest see no keys).
    h, hkv, d = 32, 8, 128
    batch = random_paged_batch([1] * 4, [4000, 40, 129, 700], h, hkv, d, 16, torch.bfloat16, "cuda", seed=4)
    out = torch.full_like(batch.q, float("nan"))

    def call():
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                        batch.query_start_loc, 1, d ** -0.5, max_context_len=4096, out=out, merge=merge)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for lens in ([4000, 40, 129, 700], [3000, 1, 100, 17]):    # each within its sequence's pages
        batch.context_lens.copy_(torch.tensor(lens, dtype=batch.context_lens.dtype))
        batch = dataclasses.replace(batch, context_lens_host=lens)
        batch.q.copy_(torch.randn(batch.q.shape, device="cuda", generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(out, reference_f64(batch, d ** -0.5)) < TOL[torch.bfloat16], lens
    assert not _tile_counters(out.device, 4096).any()


def test_float32_cache_is_exact_and_deterministic():
    batch = random_paged_batch([3, 1, 17], [100, 1, 2000], 8, 2, 128, 16, torch.float32, "cuda", seed=5)
    ref = reference_f64(batch, 0.1)
    first = attention(batch, 0.1)
    assert rel_error(first, ref) < TOL[torch.float32]
    assert torch.equal(first, attention(batch, 0.1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tile_configs_agree(dtype):
    # The bench's tuning sweep runs these configs; every one of them must be correct.
    batch = random_paged_batch([1, 8, 16], [3000, 517, 64], 32, 8, 128, 16, dtype, "cuda", seed=9)
    ref = reference_f64(batch, 0.08)
    ran = 0
    for block_n in (32, 64, 128):
        for warps, stages in ((4, 2), (4, 3), (8, 3), (2, 3), (2, 2)):
            cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            try:
                out = attention(batch, 0.08, config=cfg)
            except OutOfResources:  # a config too big for shared memory is not a wrong answer
                continue
            assert rel_error(out, ref) < TOL[dtype], cfg
            ran += 1
    assert ran >= 10
    # The 32-row, 128-key, 3-stage tile the plan takes for GQA verification (session 23).
    out = attention(batch, 0.08, config={"BLOCK_M": 32, "BLOCK_N": 128, "num_stages": 3})
    assert rel_error(out, ref) < TOL[dtype]
    for block_m in (4, 8):            # CUDA-core tiles (no tl.dot), the q=1 GQA tuning candidates
        for merge in ("separate", "inline"):
            cfg = {"BLOCK_M": block_m, "BLOCK_N": 32, "num_stages": 2}
            out = attention(batch, 0.08, config=cfg, num_splits=3, merge=merge)
            assert rel_error(out, ref) < TOL[dtype], (cfg, merge)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=str)
def test_store_kv_matches_reference(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, hkv, d, nb, bs = 300, 8, 128, 40, 16
    fused = torch.randn(t, 2 * hkv * d + 64, device="cuda", generator=gen)
    k, v = fused[:, :hkv * d].view(t, hkv, d), fused[:, hkv * d:2 * hkv * d].view(t, hkv, d)
    slots = torch.randperm(nb * bs, device="cuda", generator=gen)[:t]
    slots[::37] = -1                                                 # padded tokens: no slot
    caches = [torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype, device="cuda") for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    keep = slots >= 0
    store_kv_ref(k[keep], v[keep], caches[2], caches[3], slots[keep])
    torch.cuda.synchronize()
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        # Same slots written (the NaN pattern), values equal up to the cast's rounding.
        torch.testing.assert_close(got, want, equal_nan=True)


def tiny_model(dtype):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=257, hidden_size=256,
                      intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                      rms_norm_eps=1e-6, max_position=4096)
    return init_random(build_model(cfg, dtype, "cuda"), seed=0, std=0.05)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=str)
def test_runner_triton_backend_matches_torch_backend(dtype, tol):
    model = tiny_model(dtype)
    cache = CacheConfig(num_blocks=256, block_size=16, dtype=dtype)
    runners = [ModelRunner(model, cache, backend=TritonAttention()),
               ModelRunner(model, cache, backend=TorchAttention())]
    assert runners[0].backend.name == "triton"
    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, 257, (n,), generator=gen).tolist()

    steps = [
        [SeqInput("a", tokens(300)), SeqInput("b", tokens(17), num_logits=5), SeqInput("c", tokens(1))],
        [SeqInput("a", tokens(1)), SeqInput("b", tokens(1)), SeqInput("c", tokens(1))],
        [SeqInput("a", tokens(5), num_logits=5), SeqInput("b", tokens(1)), SeqInput("c", tokens(9), 9)],
    ]
    for r in runners:
        for s in "abc":
            r.add_sequence(s)
    for items in steps:
        got, want = (torch.cat(r.step(items)) for r in runners)
        assert not got.isnan().any()
        assert rel_error(got, want) < tol
