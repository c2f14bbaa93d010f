"""Review of session 18: the GEMV's row tiles at M 17..64 (32 / 64-row tiles, M tiles of narrower ones)
against float64 with split-K, the residual producer, the norm consumer and SiLU on ragged N / K; the
dispatch bound (serve_max_m_forced); warm_up's default repeats; anatomy.prepare_ms; the e2e steady window
(services.steady_window / steady_tok_s, e2e.steady_rows). CPU, TRITON_INTERPRET=1."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specdec.kernels import gemv as gemv_module
from specdec.kernels.gemv import (BLOCK_MS, MAX_M, PARTS_AHEAD, GemvConfig, GemvOps, NormInput, PendingNorm,
                                  default_config, gemv, linear)
from specdec.models.llama import TorchLayerOps
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

F32, BF16 = torch.float32, torch.bfloat16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]   # the GPU runs the inline reduce for real


def _ops(m, n, k, dtype=F32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(device, dtype)
    return x, w, gen


def _rows_rel(got, want):
    """The worst row's relative error (a row no tile wrote fails even where the whole's is small)."""
    got, want = got.double(), want.double()
    return max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))


# ------------------------------------------------------------------------------ GEMV row tiles

# (m, block_m): a 32 / 64-row tile over fewer rows (masked), exactly full, and M tiles of a
# narrower tile with a ragged last tile (17 = 16 + 1, 33 = 32 + 1, 63 = 4 x 16 - 1)
TILES = [(17, 32), (33, 64), (64, 64), (17, 16), (33, 32), (63, 16), (64, 32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, block_m", TILES)
@pytest.mark.parametrize("split", [1, 3])
def test_row_tiles_fp32_match_float64_with_bias_on_ragged_shapes(device, m, block_m, split):
    n, k = 37, 200   # 37 = 2 x 16 + 5 columns; 200 = 6 x 32 + 8: a ragged last K step
    x, w, gen = _ops(m, n, k, seed=m * 7 + block_m, device=device)
    b = torch.randn(n, generator=gen).to(device)
    y = gemv(x, w, b, GemvConfig(block_m, 16, 32, split_k=split))
    want = x.double() @ w.double().T + b.double()
    assert y.shape == (m, n) and _rows_rel(y, want) < 2e-6


@pytest.mark.parametrize("m", [17, 40, 64])
def test_default_config_above_16_rows_matches_float64(m):
    """gemv's own config (default_config) at verify-sized M, bf16 (the interpreter truncates)."""
    x, w, _ = _ops(m, 48, 96, BF16, seed=m)
    cfg = default_config(m, 48, 96, 132)
    assert cfg.block_m in BLOCK_MS and cfg.block_m > 1
    assert _rows_rel(gemv(x, w), x.double() @ w.double().T) < 8e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, block_m", [(40, 16), (40, 64), (64, 32)])
def test_inline_and_separate_split_reduce_give_the_same_bits_and_leave_counters_zero(device, m, block_m):
    """Both reduces sum the partials in split order: the same bits. The inline reduce's arrival
    counts (one per tile) are back at zero after the launch, or the next launch's last-arrival
    test would fire early."""
    x, w, gen = _ops(m, 50, 160, seed=3, device=device)
    b = torch.randn(50, generator=gen).to(device)
    cfg = GemvConfig(block_m, 16, 32, split_k=4)
    with gemv_module.split_reduce_forced("inline"):
        inline = gemv(x, w, b, cfg)
        inline2 = gemv(x, w, b, cfg)   # a second launch over the same counters
    with gemv_module.split_reduce_forced("separate"):
        separate = gemv(x, w, b, cfg)
    assert torch.equal(inline, separate) and torch.equal(inline, inline2)
    assert int(gemv_module._counters(torch.device(device)).abs().sum()) == 0
    assert _rows_rel(inline, x.double() @ w.double().T + b.double()) < 2e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, block_m", [(17, 32), (40, 16), (64, 64)])
@pytest.mark.parametrize("split, reduce", [(1, "inline"), (3, "inline"), (3, "separate")])
def test_residual_producer_over_wide_and_multiple_row_tiles(device, m, block_m, split, reduce):
    """r = residual + x @ W^T (torch's rounding of `residual + y`) and the per-program sums of
    squares add up to each row's sum of r^2, whichever program wrote which rows."""
    n, k = 37, 72
    x, w, gen = _ops(m, n, k, seed=m + split, device=device)
    res = torch.randn(m, n, generator=gen).to(device)
    with gemv_module.split_reduce_forced(reduce):
        r, sums = gemv(x, w, config=GemvConfig(block_m, 16, 32, split_k=split), residual=res)
    assert _rows_rel(r, res.double() + x.double() @ w.double().T) < 2e-6
    assert sums.shape[1] == m and sums.dtype == F32
    torch.testing.assert_close(sums.sum(0).double(), r.double().pow(2).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, block_m, parts", [(17, 32, 3), (40, 16, 130), (40, 64, 33), (64, 32, 65)])
@pytest.mark.parametrize("split", [1, 3])
def test_norm_consumer_at_17_to_64_rows_matches_float64_rmsnorm(device, m, block_m, parts, split):
    """gemv(r, W, norm=NormInput(sums, nw, eps)) = RMSNorm(r) @ W^T from `parts` partial sums of
    squares: more partials than PARTS_AHEAD loads ahead for the tile (64 rows: 32; 16 rows: 128),
    so the rest come after the K loop, read at each M tile's own rows."""
    k, n = 200, 37
    r, w, gen = _ops(m, n, k, seed=parts + block_m, device=device)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(device)
    cuts = torch.linspace(0, k, parts + 1).round().long().tolist()   # a partition of the columns
    sums = torch.stack([r[:, a:b].pow(2).sum(1) for a, b in zip(cuts, cuts[1:])])
    eps, cfg = 1e-6, GemvConfig(block_m, 16, 32, split_k=split)
    y = gemv(r, w, norm=NormInput(sums, nw, eps), config=cfg)
    rd = r.double()
    assert _rows_rel(y, rd * torch.rsqrt(rd.pow(2).mean(1, keepdim=True) + eps) * nw.double() @ w.double().T) < 5e-6
    # the sums are read at each tile's own rows: swapping two rows' sums moves both rows' results
    swapped = sums.clone()
    swapped[:, [0, m - 1]] = sums[:, [m - 1, 0]]
    y2 = gemv(r, w, norm=NormInput(swapped, nw, eps), config=cfg)
    assert torch.equal(y2[1:m - 1], y[1:m - 1]) and not torch.equal(y2[m - 1], y[m - 1])


def test_producer_then_consumer_chain_at_40_rows():
    """The fused layer boundary at verify size: o_proj with the residual epilogue, then qkv reading
    its stream and sums (GemvOps.add_rmsnorm -> linear(PendingNorm)) with the kernel serving 40 rows."""
    m, h, q = 40, 96, 40
    x, wo, gen = _ops(m, h, h, seed=9)
    wq = torch.randn(q, h, generator=gen) * 0.1
    res = torch.randn(m, h, generator=gen)
    nw = 1 + 0.1 * torch.randn(h, generator=gen)
    ops = GemvOps(TorchLayerOps(), on_cpu=True, fuse_norm=True)
    ops.norm_max_m = 64
    norm = SimpleNamespace(weight=nw, eps=1e-5)
    with gemv_module.serve_max_m_forced(64):
        pending, r = ops.add_rmsnorm(ops.row_linear(x, wo), res, norm)
        assert isinstance(pending, PendingNorm)
        y = ops.linear(pending, wq)
    rd = res.double() + x.double() @ wo.double().T
    assert _rows_rel(r, rd) < 2e-6
    normed = rd * torch.rsqrt(rd.pow(2).mean(1, keepdim=True) + 1e-5) * nw.double()
    assert _rows_rel(y, normed @ wq.double().T) < 5e-6


@pytest.mark.parametrize("m, block_m", [(40, 16), (24, 32)])
def test_silu_epilogue_over_row_tiles(m, block_m):
    inter, k = 21, 64   # odd I: the last program's gate / up halves are partly masked
    x, w, _ = _ops(m, 2 * inter, k, seed=m)
    for split in (1, 2):
        y = gemv(x, w, config=GemvConfig(block_m, 16, 32, split_k=split), epilogue="silu_mul")
        full = x.double() @ w.double().T
        want = F.silu(full[:, :inter]) * full[:, inter:]
        assert y.shape == (m, inter) and _rows_rel(y, want) < 5e-6


def test_configs_and_parts_ahead_cover_every_row_tile():
    assert set(PARTS_AHEAD) == set(BLOCK_MS) == {1, 16, 32, 64}
    x, w, _ = _ops(40, 16, 32)
    for bad in [lambda: GemvConfig(48, 16, 16), lambda: GemvConfig(32, 8, 64), lambda: GemvConfig(64, 16, 8),
                lambda: GemvConfig(32, 24, 32), lambda: GemvConfig(16, 16, 16, 0),
                lambda: gemv(x[:1], w, config=GemvConfig(32, 16, 32)),   # one row: the elementwise path only
                lambda: gemv(x, w, config=GemvConfig(1, 16, 32)),        # 40 rows on the one-row path
                lambda: gemv(torch.zeros(MAX_M + 1, 32), w)]:
        with pytest.raises(ValueError):
            bad()


# ---------------------------------------------------------------- dispatch bound (SERVE_MAX_M)

def _count_gemv(monkeypatch):
    calls, real = [], gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    return calls


def test_forced_bound_comes_back_after_an_exception_and_when_nested(monkeypatch):
    calls = _count_gemv(monkeypatch)
    x, w, _ = _ops(40, 24, 32)
    assert gemv_module._serve_max_m.value == gemv_module.SERVE_MAX_M == 64
    with pytest.raises(RuntimeError, match="boom"):
        with gemv_module.serve_max_m_forced(16):
            linear(x, w, on_cpu=True)                       # 40 > 16: F.linear
            raise RuntimeError("boom")
    assert gemv_module._serve_max_m.value == 64 and calls == []
    linear(x, w, on_cpu=True)                               # the kernel again
    assert calls == [40]
    with gemv_module.serve_max_m_forced(16):
        with gemv_module.serve_max_m_forced(8):
            linear(x[:16], w, on_cpu=True)                  # 16 > 8: F.linear
            assert gemv_module._serve_max_m.value == 8
        assert gemv_module._serve_max_m.value == 16
        linear(x[:16], w, on_cpu=True)
        linear(x[:33], w, on_cpu=True)                      # 33 > 16: F.linear
    assert gemv_module._serve_max_m.value == 64 and calls == [40, 16]
    for bad in (0, MAX_M + 1):
        with pytest.raises(ValueError, match="outside"):
            with gemv_module.serve_max_m_forced(bad):
                pass
        assert gemv_module._serve_max_m.value == 64


# -------------------------------------------------------------------------- warm_up repeats

def test_warm_up_default_repeats_by_device(tmp_path):
    """Per warm-up batch size: one context forward, one untimed and `repeats` timed single-token
    forwards; repeats defaults to WARMUP_REPEATS_CUDA (25) on CUDA and 3 elsewhere; an explicit
    value wins. (The CUDA default on a CPU engine whose device says cuda.)"""
    from services import write_shape_folder
    from specdec.config import EngineConfig
    from specdec.engine import TargetEngine, base
    shape = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300, hidden_size=32,
                 intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    path = write_shape_folder(tmp_path / "t", shape, dtype="float32")
    engine = TargetEngine(EngineConfig(model=path, num_blocks=64, random_weights=True, warmup_batch_sizes=(1, 2)))
    steps, real = [], engine.runner.step
    engine.runner.step = lambda items, **kw: steps.append(len(items)) or real(items, **kw)
    assert base.WARMUP_REPEATS_CUDA == 25
    for device, repeats, want in (("cpu", None, 3), ("cpu", 5, 5), ("cuda", None, 25), ("cuda", 2, 2)):
        steps.clear()
        engine.device, engine.synchronize = torch.device(device), lambda: None
        table = engine.warm_up(repeats, prompt_lens=())
        assert steps == [1] * (want + 2) + [2] * (want + 2), device
        assert set(table) == {1, 2} and engine.num_sequences() == 0


# ------------------------------------------------------------------ steady window (e2e bench)

def _rec(sent, chunks, error=None, done=None):
    """A request: sent at `sent`, chunks (arrival, tokens), done at the last chunk (or `done`)."""
    from services import Record
    r = Record(sent, first=chunks[0][0] if chunks else None, done=done if done is not None else chunks[-1][0],
               chunks=list(chunks), error=error)
    r.tokens = [0] * sum(n for _, n in chunks)
    return r


def test_steady_window_concurrency_one_is_first_token_to_last_finish():
    """One slot, three requests back to back: the window runs from the first request's first token
    to the last one's finish (every earlier finish precedes the last send)."""
    from services import steady_tok_s, steady_window
    recs = [_rec(4.0, [(4.5, 1), (6.0, 3)]), _rec(0.0, [(1.0, 1), (2.0, 2)]), _rec(2.0, [(2.5, 1), (4.0, 2)])]
    assert steady_window(recs, 1) == (1.0, 6.0)
    assert steady_tok_s(recs, 1) == (2 + 1 + 2 + 1 + 3) / 5.0


def test_steady_window_boundaries_with_equal_timestamps():
    """The finish that frees the last request's slot happens at its send time: not the window's
    end (strictly after the last send); a chunk at the start is left out, one at the end is in."""
    from services import steady_tok_s, steady_window
    a = _rec(0.0, [(1.0, 1), (3.0, 2)])                 # finishes at 3.0, when c is sent
    b = _rec(0.0, [(2.0, 1), (3.0, 1), (7.0, 4)])
    c = _rec(3.0, [(3.5, 1), (9.0, 2)])
    assert steady_window([a, b, c], 2) == (2.0, 7.0)
    # (2, 7]: a 3.0 (2); b 3.0 (1), 7.0 (4); c 3.5 (1) = 8; b's 2.0 chunk (the start) is not counted
    assert steady_tok_s([a, b, c], 2) == 8 / 5.0
    same = _rec(0.0, [(2.0, 1), (2.0, 1)])             # first token and finish at one instant
    assert steady_window([same], 1) is None and steady_tok_s([same], 1) is None


def test_steady_window_without_tokens_is_none_not_a_crash():
    """A request that streamed no tokens (first None) rules out the window rather than raising."""
    from services import steady_tok_s, steady_window
    empty = _rec(0.0, [], done=1.0)
    ok = _rec(0.0, [(0.5, 1), (3.0, 1)])
    assert steady_window([ok, empty], 2) is None and steady_tok_s([empty, ok], 1) is None
    unfinished = _rec(0.0, [(0.6, 1)])
    unfinished.done = None                             # a stream that never ended (no error either)
    assert steady_window([ok, unfinished], 2) is None


# (found by the review as a strict xfail; fixed: fewer requests than slots give no window)
def test_steady_window_is_none_when_fewer_requests_than_slots():
    from services import steady_window
    recs = [_rec(0.0, [(1.0, 1), (5.0, 4)]), _rec(0.0, [(1.5, 1), (6.0, 4)]), _rec(0.0, [(2.0, 1), (7.0, 4)])]
    assert steady_window(recs, 3) == (2.0, 5.0)        # exactly full: a real window
    assert steady_window(recs, 8) is None


# (found by the review as a strict xfail; fixed: a concurrency below 1 is a ValueError)
def test_steady_window_rejects_a_non_positive_concurrency():
    from services import steady_window
    recs = [_rec(0.0, [(1.0, 1), (5.0, 4)]), _rec(0.0, [(1.5, 1), (6.0, 4)])]
    for c in (0, -1):
        with pytest.raises(ValueError, match="concurrency"):
            steady_window(recs, c)


def test_steady_rows_speedup_and_occupancy_from_scrapes():
    from e2e import steady_rows
    recs = [_rec(0.0, [(1.0, 1), (3.0, 2), (5.0, 2)]), _rec(0.1, [(2.0, 1), (4.0, 3), (9.0, 3)]),
            _rec(5.0, [(6.0, 1), (8.0, 2), (10.0, 1), (12.0, 1)])]
    fast = [_rec(0.0, [(1.0, 1), (3.0, 4), (5.0, 4)]), _rec(0.1, [(2.0, 1), (4.0, 6), (9.0, 6)]),
            _rec(5.0, [(6.0, 2), (8.0, 4), (10.0, 1), (12.0, 1)])]   # twice the tokens in (2, 9]
    count = lambda n: {"specdec_step_seconds_count": [({"mode": "plain"}, n * 0.75), ({"mode": "spec"}, n * 0.25)]}
    out = steady_rows(2, recs, fast, {"steps": 30}, {"steps": 12}, (count(100), count(120), count(130)), 1.6)
    assert out["plain_steady_tok_s"] == 13 / 7 and out["spec_steady_tok_s"] == 26 / 7
    assert out["speedup_steady"] == pytest.approx(2.0) and out["steady_over_expected"] == pytest.approx(1.25)
    # sequence steps / (batch steps between the scrapes x b): 30 / (20 x 2), 12 / (10 x 2)
    assert out["occupancy_plain"] == pytest.approx(0.75) and out["occupancy_spec"] == pytest.approx(0.6)
    none = steady_rows(2, recs, fast, {"steps": 30}, {"steps": 12}, ({}, {}, {}), None)
    assert none["speedup_steady"] == pytest.approx(2.0) and none["steady_over_expected"] is None
    assert none["occupancy_plain"] is None and none["occupancy_spec"] is None


def test_anatomy_prepare_ms_leaves_the_sequences_as_it_found_them():
    """prepare_ms reserves q slots per sequence on every rep and truncates them back: token counts
    and free blocks unchanged after 4 reps of 5 tokens on 4-token blocks (each rep crosses a block)."""
    import anatomy
    from specdec.models.loader import build_model, init_random
    from specdec.runner import SeqInput
    from tests.helpers.op_sets import new_runner, tiny_config
    model = build_model(tiny_config(), F32, "cpu")
    init_random(model, seed=0)
    runner = new_runner(model, F32)
    for s in ("a", "b"):
        runner.add_sequence(s)
    runner.step([SeqInput("a", [1, 2, 3]), SeqInput("b", [4, 5, 6, 7, 8, 9])])
    free = runner.blocks.num_free
    engine = SimpleNamespace(runner=runner)
    assert anatomy.prepare_ms(engine, ["a", "b"], 5, reps=4) > 0
    assert [runner.num_tokens(s) for s in ("a", "b")] == [3, 6] and runner.blocks.num_free == free
    assert anatomy.launch_ms(engine, 2, 1) == (None, None)      # no CUDA graphs: nothing to launch
