"""Triton paged attention and KV store under TRITON_INTERPRET=1 (tests/conftest.py sets it without a
GPU), against the torch reference. Shapes stay tiny: the interpreter runs numpy per program."""
import random

import pytest
import torch

from specdec.config import CacheConfig, ModelConfig
from specdec.kernels.paged_inputs import random_paged_batch, reference_f64, rel_error
from specdec.kernels import triton_attention
from specdec.kernels.reference import TorchAttention, paged_attention_ref, store_kv_ref
from specdec.kernels.triton_attention import (SMEM_BUDGET, TritonAttention, _tile_counters,
                                               choose_splits, launch_plan, paged_attention, store_kv,
                                               tile_config)
from specdec.models.loader import build_model, init_random
from specdec.runner import ModelRunner, SeqInput

SCALE = 0.3


def run_both(batch, num_splits=None, config=None, **kw):
    out = torch.full_like(batch.q, float("nan"))        # an element the kernel skips stays NaN
    paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                    batch.query_start_loc, batch.max_query_len, SCALE,
                    max_context_len=batch.max_context_len, num_splits=num_splits, out=out,
                    config=config, **kw)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                              batch.context_lens_host, batch.query_lens, SCALE)
    return out, ref


# (query_lens, context_lens, H, Hkv, D, block_size, tile override, num_splits)
CASES = {
    "context_1": ([1], [1], 2, 1, 16, 4, None, None),
    "ragged_gqa_unaligned": ([1, 3, 7], [1, 9, 30], 4, 2, 32, 4, None, None),
    "group3_dpad_splits": ([5, 2, 1, 8], [37, 16, 17, 8], 6, 2, 24, 8, {"BLOCK_N": 16}, 3),
    "mha_prefill_tiles": ([2, 40], [50, 40], 4, 4, 16, 16, {"BLOCK_N": 16}, 2),
    "mqa_page_gt_tile": ([16, 3], [70, 3], 8, 1, 16, 32, {"BLOCK_N": 16, "BLOCK_M": 16}, 4),
    "more_splits_than_tiles": ([4, 1], [20, 5], 4, 2, 16, 16, {"BLOCK_N": 16}, 5),
    "wide_key_tiles": ([1, 4], [150, 260], 4, 1, 16, 16, {"BLOCK_N": 128}, 2),
    "more_kv_heads_than_seqs": ([3, 1], [40, 19], 8, 4, 16, 8, {"BLOCK_N": 16}, 3),
}


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("page_ahead", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_named_cases_match_reference(name, page_ahead, heads_first, monkeypatch):
    # Both ways of reading the page table: each tile's pages one tile ahead (the default), or in
    # the tile's own iteration; and both grid orders (KV heads or sequences on the grid's x).
    monkeypatch.setattr(triton_attention, "PAGE_AHEAD", page_ahead)
    monkeypatch.setattr(triton_attention, "HEADS_FIRST", heads_first)
    qls, ctxs, h, hkv, d, bs, cfg, splits = CASES[name]
    batch = random_paged_batch(qls, ctxs, h, hkv, d, bs, torch.float32, "cpu", seed=1)
    out, ref = run_both(batch, splits, cfg)
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("page_ahead", [True, False])
@pytest.mark.parametrize("name", ["ragged_gqa_unaligned", "group3_dpad_splits", "mha_prefill_tiles",
                                  "wide_key_tiles"])
def test_two_key_loops_match_reference(name, page_ahead, monkeypatch):
    """single_key_loop (default on) runs every key tile through the masked path in one loop; the
    A/B alternative, an unmasked loop then a masked one, must give the same reference results on
    cases whose programs have unmasked tiles and masked ones (prefill chunks, splits, wide tiles)."""
    monkeypatch.setattr(triton_attention, "PAGE_AHEAD", page_ahead)
    qls, ctxs, h, hkv, d, bs, cfg, splits = CASES[name]
    batch = random_paged_batch(qls, ctxs, h, hkv, d, bs, torch.float32, "cpu", seed=2)
    assert triton_attention.single_key_loop.value is True
    with triton_attention.single_key_loop.forced(False):
        two, ref = run_both(batch, splits, cfg)
    one, _ = run_both(batch, splits, cfg)
    assert rel_error(two, ref) < 1e-5 and rel_error(one, ref) < 1e-5


@pytest.mark.parametrize("seed", range(5))
def test_random_ragged_shapes(seed):
    rng = random.Random(seed)
    b = rng.randint(1, 4)
    qls = [rng.choice([1, 1, 2, 5, 9]) for _ in range(b)]
    ctxs = [q + rng.randint(0, 45) for q in qls]
    hkv, group = rng.choice([1, 2]), rng.choice([1, 2, 3, 4])
    d, bs = rng.choice([16, 32, 64]), rng.choice([4, 8, 16])
    cfg = {"BLOCK_N": rng.choice([16, 32])}
    splits = rng.choice([None, 1, 2, 3])
    batch = random_paged_batch(qls, ctxs, hkv * group, hkv, d, bs, torch.float32, "cpu", seed=seed)
    out, ref = run_both(batch, splits, cfg)
    assert rel_error(out, ref) < 1e-5, (qls, ctxs, hkv, group, d, bs, cfg, splits)


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("name", ["ragged_gqa_unaligned", "group3_dpad_splits", "mqa_page_gt_tile",
                                  "more_splits_than_tiles", "more_kv_heads_than_seqs"])
def test_inline_merge_matches_reference_and_resets_counters(name, splits, heads_first, monkeypatch):
    # mqa_page_gt_tile has 8 query tiles per sequence (some dead: 3 tokens), more_splits_than_tiles
    # has splits without keys; two calls in a row check that the counters come back to zero. Both
    # grid orders. The interpreter runs programs one after another, so two tiles sharing a counter
    # would go unseen here (the GPU tests run the default order with more KV heads than sequences).
    monkeypatch.setattr(triton_attention, "HEADS_FIRST", heads_first)
    qls, ctxs, h, hkv, d, bs, cfg, _ = CASES[name]
    batch = random_paged_batch(qls, ctxs, h, hkv, d, bs, torch.float32, "cpu", seed=2)
    separate, ref = run_both(batch, splits, cfg)
    for _ in range(2):
        out, _ = run_both(batch, splits, cfg, merge="inline")
        assert rel_error(out, ref) < 1e-5
        torch.testing.assert_close(out, separate, rtol=1e-6, atol=1e-6)
        assert not _tile_counters(torch.device("cpu"), 4096).any()


@pytest.mark.parametrize("merge", ["separate", "inline"])
@pytest.mark.parametrize("block_m", [1, 4, 8])
def test_small_row_tiles_without_dot(block_m, merge):
    # BLOCK_M < 16: CUDA-core products, for a q=1 GQA group that would fill 4 of 16 MMA rows.
    group = min(block_m, 4)
    batch = random_paged_batch([1, 1, 2, 1], [1, 30, 70, 17], 2 * group, 2, 32, 8, torch.float32,
                               "cpu", seed=block_m)
    for splits in (1, 3):
        out, ref = run_both(batch, splits, {"BLOCK_N": 16, "BLOCK_M": block_m}, merge=merge)
        assert rel_error(out, ref) < 1e-5, splits


def test_unknown_merge_mode_is_rejected():
    batch = random_paged_batch([1], [5], 2, 1, 16, 4, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="merge"):
        run_both(batch, 2, merge="fused")


@pytest.mark.parametrize("dtype,upcast,tol", [(torch.float16, False, 2e-3), (torch.bfloat16, True, 1e-2)])
def test_half_precision_against_float64(dtype, upcast, tol):
    # fp16 without upcast runs the GPU code path (fp16 dot operands, P cast to fp16).
    batch = random_paged_batch([3, 1, 6], [21, 1, 40], 4, 2, 32, 8, dtype, "cpu", seed=3)
    for merge in ("separate", "inline"):
        out, _ = run_both(batch, 2, {"BLOCK_N": 16}, merge=merge, _upcast=upcast)
        assert out.dtype == dtype
        assert rel_error(out, reference_f64(batch, SCALE)) < tol


def test_store_kv_matches_reference_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(0)
    t, hkv, d, nb, bs = 7, 3, 16, 5, 4
    fused = torch.randn(t, 2 * hkv * d + 5, generator=gen)               # k, v as strided views
    k = fused[:, :hkv * d].view(t, hkv, d)
    v = fused[:, hkv * d: 2 * hkv * d].view(t, hkv, d)
    slots = torch.tensor([3, 0, 17, -1, 9, 19, 4], dtype=torch.int64)
    caches = [torch.zeros(nb, bs, hkv, d, dtype=torch.float16) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    keep = slots >= 0
    store_kv_ref(k[keep], v[keep], caches[2], caches[3], slots[keep])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def tiny_model():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=61, hidden_size=64,
                      intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-6, max_position=256)
    return init_random(build_model(cfg, torch.float32, "cpu"), seed=0, std=0.1)


def test_backend_merge_from_the_environment(monkeypatch):
    assert TritonAttention().merge == "separate"
    monkeypatch.setenv("SPECDEC_ATTN_MERGE", "inline")
    assert TritonAttention().merge == "inline"
    assert TritonAttention("separate").merge == "separate"      # an explicit choice wins
    monkeypatch.setenv("SPECDEC_ATTN_MERGE", "inlined")
    with pytest.raises(ValueError, match="SPECDEC_ATTN_MERGE"):
        TritonAttention()


def test_runner_with_triton_backend_matches_torch_backend():
    model = tiny_model()
    cache = CacheConfig(num_blocks=16, block_size=4)
    runners = [ModelRunner(model, cache, backend=TritonAttention()),
               ModelRunner(model, cache, backend=TorchAttention())]
    steps = [
        [SeqInput("a", [1, 2, 3, 4, 5]), SeqInput("b", list(range(7, 18)), num_logits=3)],  # prefill
        [SeqInput("a", [9]), SeqInput("b", [4])],                                          # decode
        [SeqInput("a", [11, 12, 13, 14], num_logits=4), SeqInput("b", [6])],                # verify
    ]
    for r in runners:
        r.add_sequence("a")
        r.add_sequence("b")
    for items in steps:
        got, want = (r.step(items) for r in runners)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_split_heuristic_fills_the_gpu_only_when_needed():
    assert choose_splits(64 * 32, 8192, 132) == 1            # big batch: one pass, no merge
    assert choose_splits(8 * 32, 2048, 132) == 1             # ~2 programs per SM already (H200: S=1 won)
    assert choose_splits(32, 8192, 132) == 8                 # 256 programs: 1.94 waves, not 4.1 (S=17)
    assert choose_splits(128, 8192, 132) == 2
    assert choose_splits(32, 1024, 132) == 8                 # H200: 18.4 us at S=8 vs 22.5 at S=4
    assert choose_splits(32, 512, 132) == 4                  # but no split under 128 keys
    assert choose_splits(8, 100, 132) == 1
    plan = launch_plan(2, 8, 2, 64, 16, 100, torch.device("cpu"))
    assert (plan["BLOCK_M"], plan["QT"], plan["n_qtiles"]) == (64, 16, 1)  # 16 tokens x 4 heads


def test_tile_heuristic_minds_occupancy_of_short_streams():
    # GQA (4 heads a group) q=1, 512 keys a program: 512 programs are two waves of 64-key tiles
    # (2 per SM on 132 SMs) but one of 32-key tiles (4 per SM).
    assert tile_config(4, 1, 128, 512, programs=512, num_sms=132)["BLOCK_N"] == 32
    assert tile_config(4, 1, 128, 512, programs=256, num_sms=132)["BLOCK_N"] == 64   # one wave already
    assert tile_config(4, 1, 128, 512, programs=600, num_sms=132)["BLOCK_N"] == 64   # > 4 per SM
    assert tile_config(4, 1, 128, 4096, programs=512, num_sms=132)["BLOCK_N"] == 128  # long streams
    # Unsplit 32-row tiles (GQA, 8 tokens) with a program per SM or more: 128-key tiles.
    cfg = tile_config(4, 8, 128, 512, programs=512, num_sms=132)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]) == (32, 128, 3)
    assert (2 * 3 * 128 + 32) * 128 * 2 <= SMEM_BUDGET
    assert tile_config(4, 8, 128, 512, programs=100, num_sms=132)["BLOCK_N"] == 64  # SMs to spare
    assert tile_config(4, 8, 128, 273, programs=240, num_sms=132)["BLOCK_N"] == 64  # short keys
    assert tile_config(4, 8, 128, 512, programs=256, num_sms=132, num_splits=4)["BLOCK_N"] == 64
    # Through the plan (an H200's 132 SMs): GQA ctx 512 q=8 at B=32 is unsplit, at B=8 ctx 2048 not.
    assert triton_attention._plan(32, 32, 8, 128, 8, 512, 132, 2, None, ())[:2] == (32, 128)
    plan = triton_attention._plan(8, 32, 8, 128, 8, 2048, 132, 2, None, ())
    assert (plan[0], plan[1], plan[-1]) == (32, 64, 4)          # 4 splits: 64-key tiles
    assert tile_config(4, 8, 128, 512, programs=512, num_sms=132, elem_size=4)["BLOCK_N"] <= 64
    # A split of <= 128 keys with an SM per program: one 128-key tile.
    cfg = tile_config(4, 8, 128, 128, programs=64, num_sms=132)
    assert (cfg["BLOCK_N"], cfg["num_stages"]) == (128, 2)
    assert tile_config(1, 8, 128, 128, programs=256, num_sms=132)["BLOCK_N"] == 64  # 2 programs per SM
    assert tile_config(4, 1, 128, 512)["BLOCK_N"] == 64   # without the grid: as before
    for cfg in (tile_config(4, 1, 128, 512, programs=512, num_sms=132),
                tile_config(4, 8, 128, 128, programs=64, num_sms=132)):
        assert (2 * cfg["num_stages"] * cfg["BLOCK_N"] + cfg["BLOCK_M"]) * 128 * 2 <= SMEM_BUDGET


def test_tile_heuristic_widens_long_streams_and_fits_shared_memory():
    cfg = tile_config(1, 1, 128, keys_per_program=8192)
    assert (cfg["BLOCK_N"], cfg["num_stages"]) == (128, 3)   # long decode stream
    assert tile_config(1, 1, 128, keys_per_program=512)["BLOCK_N"] == 64   # a short split
    fp32 = tile_config(1, 1, 128, keys_per_program=8192, elem_size=4)
    assert (2 * fp32["num_stages"] * fp32["BLOCK_N"] + fp32["BLOCK_M"]) * 128 * 4 <= SMEM_BUDGET
    plan = launch_plan(64, 32, 8, 128, 1, 8192, torch.device("cpu"), num_splits=1)
    assert (plan["BLOCK_N"], plan["num_splits"]) == (128, 1)
    # Overrides win over the heuristic and are part of the cached plan's key.
    plan = launch_plan(64, 32, 8, 128, 1, 8192, torch.device("cpu"), num_splits=1,
                       config={"BLOCK_N": 32, "num_stages": 2})
    assert (plan["BLOCK_N"], plan["num_stages"]) == (32, 2)


@pytest.mark.parametrize("page_ahead", [True, False])
@pytest.mark.parametrize("cfg, splits, merge", [
    ({"BLOCK_M": 4, "BLOCK_N": 16}, 3, "inline"),
    ({"BLOCK_M": 8, "BLOCK_N": 32}, 2, "separate"),
    ({"BLOCK_M": 2, "BLOCK_N": 16}, None, "separate"),
    ({"BLOCK_N": 64}, 4, "inline"),
])
def test_page_ahead_on_core_products_inline_merge_and_head_dim_64(page_ahead, cfg, splits, merge,
                                                                  monkeypatch):
    """Both page-table reads where the named cases do not go: tiles under 16 rows (CUDA-core
    products), the inline merge, head_dim 64, splits whose next tile lies in the following split."""
    monkeypatch.setattr(triton_attention, "PAGE_AHEAD", page_ahead)
    batch = random_paged_batch([1, 3, 1], [70, 41, 129], 4, 2, 64, 8, torch.float32, "cpu", seed=3)
    out, ref = run_both(batch, splits, cfg, merge=merge)
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
def test_padding_sequences_and_dead_tiles_with_early_loads(early, heads_first, splits, monkeypatch):
    # CUDA-graph padding: sequences with no query tokens (context 0, or a context whose pages are
    # all page 0) after real ones, 4-row tiles so that shorter queries leave dead tiles. With early
    # loads (pdl.EARLY_LOADS) every program computes its key range and loads its first page indices
    # before the wait and returns afterwards; the real rows must still match the reference.
    from specdec.kernels import pdl
    monkeypatch.setattr(pdl, "EARLY_LOADS", early)
    monkeypatch.setattr(triton_attention, "HEADS_FIRST", heads_first)
    qls, ctxs = [5, 1, 3], [20, 9, 40]
    batch = random_paged_batch(qls, ctxs, 4, 2, 16, 8, torch.float32, "cpu", seed=1)
    t = sum(qls)
    starts = torch.cat([batch.query_start_loc, torch.tensor([t, t], dtype=torch.int32)])
    ctx = torch.cat([batch.context_lens, torch.tensor([17, 0], dtype=torch.int32)])
    tables = torch.zeros(5, max(batch.block_tables.shape[1], 3), dtype=torch.int32)
    tables[:3, :batch.block_tables.shape[1]] = batch.block_tables
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(batch.q, batch.k_cache, batch.v_cache, tables, ctx, starts, 5, SCALE,
                    max_context_len=40, num_splits=splits, out=out, config={"BLOCK_N": 16, "BLOCK_M": 4})
    assert rel_error(out, reference_f64(batch, SCALE)) < 1e-5


def test_merge_warps_by_size_and_forced():
    # One warp while a (token, head)'s partials fit MERGE_ELEMS_PER_WARP (the sum over splits then
    # stays in registers), more for bigger merges, never over 4; forced(n) wins; bad counts refused.
    assert triton_attention.merge_num_warps(8, 128) == 1        # the 7B at b 1 in the 4096 graphs
    assert triton_attention.merge_num_warps(30, 64) == 1        # TinyLlama's 30 splits pad to 32
    assert triton_attention.merge_num_warps(33, 64) == 2
    assert triton_attention.merge_num_warps(64, 128) == 4
    assert triton_attention.merge_num_warps(64, 256) == 4
    with triton_attention.merge_warps.forced(4):
        assert triton_attention.merge_num_warps(2, 64) == 4
    assert triton_attention.merge_num_warps(2, 64) == 1
    with pytest.raises(ValueError, match="merge warps"):
        triton_attention.merge_warps.set(3)
    with pytest.raises(ValueError, match="merge warps"):
        triton_attention.merge_warps.set(True)


def test_small_split_tile_rule(monkeypatch):
    # Split plans whose programs have < SMALL_SPLIT_KEYS keys, more programs than SMs: 32-key tiles
    # at 2 warps, at the same split count; the latency case of bench/attention.py is one.
    plan = triton_attention._plan(1, 32, 32, 128, 8, 1024, 132, 2, None, ())
    assert plan == (16, 32, 2, 3, 16, 1, 8)
    # llama-160m at b 1 in a 4096 graph: 20 splits of 205 keys, 240 programs.
    assert triton_attention._plan(1, 12, 12, 64, 1, 4096, 132, 2, None, ())[1:3] == (32, 2)
    # Not taken: splits of >= 256 keys (the 7B at b 1 in a 4096 graph), a program per SM or fewer
    # (B=1 ctx 512: 4 splits, 128 programs), unsplit plans, fp32 caches, or with the switch off.
    assert triton_attention._plan(1, 32, 32, 128, 1, 4096, 132, 2, None, ())[1:3] == (64, 4)
    assert triton_attention._plan(1, 32, 32, 128, 1, 512, 132, 2, None, ())[2] == 4
    assert triton_attention._plan(8, 32, 32, 128, 1, 4096, 132, 2, None, ())[2] == 4
    assert triton_attention._plan(1, 32, 32, 128, 8, 1024, 132, 4, None, ())[2] == 4
    assert triton_attention._plan(1, 32, 32, 128, 8, 1024, 132, 2, None, (), False)[1:3] == (64, 4)
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 132)   # launch_plan's switch
    assert launch_plan(1, 32, 32, 128, 8, 1024, "cpu")["BLOCK_N"] == 32
    with triton_attention.small_split_tiles.forced(False):
        assert launch_plan(1, 32, 32, 128, 8, 1024, "cpu")["BLOCK_N"] == 64
    assert launch_plan(1, 32, 32, 128, 8, 1024, "cpu")["num_warps"] == 2


def test_one_key_loop_for_tiles_up_to_32_rows(monkeypatch):
    """The launch takes the single key loop (single_key_loop, default on) for tiles of up to
    ONE_LOOP_MAX_M rows (decode and verify steps) and the two loops above (prefill chunks), and
    never when the switch is off: the ONE_LOOP a stand-in kernel is launched with."""
    seen = []

    class Kernel:   # records each launch's ONE_LOOP instead of running
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["BLOCK_M"], kw["ONE_LOOP"]))
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Kernel())

    def launch(q_len, group=1):
        batch = random_paged_batch([q_len], [q_len + 20], 2 * group, 2, 16, 4, torch.float32, "cpu", seed=3)
        seen.clear()
        run_both(batch, 1)
        return seen[0]
    assert triton_attention.ONE_LOOP_MAX_M == 32
    assert launch(1) == (16, True) and launch(5) == (16, True) and launch(8, group=4) == (32, True)
    assert launch(40) == (64, False) and launch(16, group=4) == (64, False)
    with triton_attention.single_key_loop.forced(False):
        assert launch(5) == (16, False)
