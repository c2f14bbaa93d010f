"""The norm weighed ahead (kernels/gemv.py: gemv(residual=..., norm_weight=...) and a consumer's
NormInput(sums, None, eps); GemvOps.norm_ahead, on by default): the producer of the residual
stream also writes the stream times the next norm's weight, rounded as the consumer would round
it, so the consumer reads it as its x and its K steps carry no multiply. On the CPU under
TRITON_INTERPRET=1 and on the GPU: the producer's extra output has those bits on every path
(one row, tl.dot rows, split-K summed inline or by the reduce kernel, ragged N); the consumer of
it gives the bits of the consumer that multiplies; a model gives the same logits with it on and
off; what does not fit is refused."""
import pytest
import torch

from specdec.kernels import gemv as gemv_module
from specdec.kernels.gemv import GemvConfig, NormInput, PendingNorm, gemv
from specdec.models.loader import build_model, init_random
from tests.helpers.op_sets import new_runner, run_steps, tiny_config

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# fp32 on the CPU (the interpreter truncates fp32 -> bf16 where torch rounds); bf16 on the GPU
DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}

CASES = [  # (m, producer config, reduce): one row, tl.dot rows, split-K both ways, N not a tile multiple
    (1, None, "inline"),
    (1, GemvConfig(1, 8, 32, split_k=3), "inline"),
    (1, GemvConfig(1, 8, 32, split_k=3), "separate"),
    (5, None, "inline"),
    (5, GemvConfig(16, 16, 32, split_k=3), "inline"),
    (5, GemvConfig(16, 16, 32, split_k=3), "separate"),
    (3, GemvConfig(16, 32, 16), "inline"),
]


def _operands(m, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k, n, n2 = 96, 72, 40            # 72: ragged against 16- and 32-row W tiles
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(device, dtype)
    res = torch.randn(m, n, generator=gen).to(device, dtype)
    nw = (1 + 0.3 * torch.randn(n, generator=gen)).to(device, dtype)
    w2 = (torch.randn(n2, n, generator=gen) * 0.1).to(device, dtype)
    w3 = (torch.randn(2 * n2, n, generator=gen) * 0.1).to(device, dtype)
    return x, w, res, nw, w2, w3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, cfg, reduce", CASES, ids=lambda c: str(c))
def test_producer_writes_the_weighted_stream_and_consumers_keep_their_bits(device, m, cfg, reduce):
    dtype = DTYPE[device]
    x, w, res, nw, w2, w3 = _operands(m, device, dtype, seed=m)
    with gemv_module.split_reduce_forced(reduce):
        r0, sums0 = gemv(x, w, config=cfg, residual=res)
        torch.full_like(r0, float("nan"))   # a freed block of NaN: an unwritten rw element shows
        r, sums, rw = gemv(x, w, config=cfg, residual=res, norm_weight=nw)
    # the stream and its sums as without the weight; rw as torch rounds r * weight
    assert torch.equal(r, r0) and torch.equal(sums, sums0)
    assert rw.shape == r.shape and rw.dtype == dtype
    assert torch.equal(rw, (r.float() * nw.float()).to(dtype))
    # consumers (one row, tl.dot rows, SiLU * up): the weighted stream and the scale alone give the
    # bits of the consumer that multiplies the stream by the weight on its K steps
    for cfg2 in (None, GemvConfig(16 if m > 1 else 1, 16, 16, split_k=2)):
        plain = gemv(r, w2, config=cfg2, norm=NormInput(sums, nw, 1e-5))
        ahead = gemv(rw, w2, config=cfg2, norm=NormInput(sums, None, 1e-5))
        assert torch.isfinite(ahead).all() and torch.equal(ahead, plain)
    plain = gemv(r, w3, epilogue="silu_mul", norm=NormInput(sums, nw, 1e-5))
    assert torch.equal(gemv(rw, w3, epilogue="silu_mul", norm=NormInput(sums, None, 1e-5)), plain)


def test_empty_rows_and_what_does_not_fit():
    x, w, res, nw, _, _ = _operands(2, "cpu", torch.float32, seed=7)
    r, sums, rw = gemv(x[:0], w, residual=res[:0], norm_weight=nw)
    assert r.shape == rw.shape == (0, 72) and sums.shape == (1, 0)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, norm_weight=nw)                                   # no residual
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x, w, residual=res, norm_weight=nw[:-1])                # not [N]
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x.half(), w.half(), residual=res.half(), norm_weight=nw.half())   # fp16: refused
    with pytest.raises(ValueError, match="norm"):
        gemv(x, w.T.contiguous()[:, :72], norm=NormInput(torch.zeros(3, 1), None, 1e-5))   # sums for 1 row


@pytest.mark.parametrize("max_m", [2, 16])
def test_a_model_gives_the_same_logits_with_the_weight_ahead(max_m):
    """run_steps (a 16-token prefill, a 2-row decode and a 5-row verify step) through the fused norm
    (2: the decode step only, 16: every step) with the producer weighing ahead and without: the
    same logits (float32 on the CPU: the same arithmetic); with it on, producers get the norm
    weight and consumers none."""
    model = init_random(build_model(tiny_config(), torch.float32, "cpu"), std=0.1)
    model.set_gemv_kernels(True)
    model.ops.on_cpu = True
    model.ops.norm_max_m = max_m
    assert model.ops.norm_ahead          # on by default (SPECDEC_GEMV_NORM_AHEAD=0 turns it off)

    def steps(ahead):
        model.ops.norm_ahead = ahead
        seen, original = [], gemv_module.gemv

        def spy(*a, **kw):
            if kw.get("residual") is not None:
                seen.append(("producer", kw.get("norm_weight") is not None))
            if kw.get("norm") is not None:
                seen.append(("consumer", kw["norm"].weight is None))
            return original(*a, **kw)
        gemv_module.gemv = spy
        try:
            return run_steps(new_runner(model, torch.float32)), seen
        finally:
            gemv_module.gemv = original

    want, off = steps(False)
    got, on = steps(True)
    assert off and not any(flag for _, flag in off)
    assert on and all(flag for _, flag in on) and len(on) == len(off)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_pending_norm_hands_its_consumer_the_weighted_stream():
    r, w = torch.ones(2, 4), torch.full((2, 4), 3.0)
    norm = NormInput(torch.zeros(1, 2), torch.full((4,), 3.0), 1e-5)
    x, n = PendingNorm(r, norm, w).consumed()
    assert x is w and n.weight is None and n.sums is norm.sums and n.eps == norm.eps
    x, n = PendingNorm(r, norm).consumed()
    assert x is r and n is norm
    with pytest.raises(ValueError, match="without its weight"):   # not a norm to run on its own
        PendingNorm(r, norm, w).consumed()[1](r)


def test_by_default_steps_of_up_to_16_tokens_fuse_at_any_width():
    """norm_max_m None (the default): steps of 1..16 tokens take the fusion, narrow or wide; more
    than 16 never. An explicit norm_max_m decides alone."""
    from specdec.kernels.gemv import NARROW_NORM_N, NORM_MAX_M, GemvOps, RowLinear, SERVE_MAX_M
    from specdec.models.llama import TorchLayerOps
    ops = GemvOps(TorchLayerOps(), on_cpu=True, fuse_norm=True)
    assert ops.norm_max_m is None and ops.norm_bound() == NORM_MAX_M == 16 < SERVE_MAX_M
    narrow, wide = torch.zeros(NARROW_NORM_N, 8), torch.zeros(NARROW_NORM_N + 8, 8)
    for m, want in ((1, True), (2, True), (NORM_MAX_M, True), (NORM_MAX_M + 1, False)):
        x = torch.zeros(m, 8)
        assert isinstance(ops.row_linear(x, narrow), RowLinear) == want, m
        assert isinstance(ops.row_linear(x, wide), RowLinear) == want, m
    # the GEMV serving more rows (64 by default) does not widen the fusion
    assert not isinstance(ops.row_linear(torch.zeros(SERVE_MAX_M, 8), narrow), RowLinear)
    ops.norm_max_m = 1
    assert not isinstance(ops.row_linear(torch.zeros(2, 8), wide), RowLinear)
    assert ops.norm_bound() == 1


def test_wide_consumers_of_several_rows_skip_pdl():
    """gemv.consumer_launch_pdl: by default every norm consumer takes PDL but those of 2.. rows over
    a stream wider than NARROW_NORM_N; forced True / False decides alone; anything else is refused.
    And gemv() launches such a consumer without PDL where PDL is on (the launch's options seen by a
    stand-in kernel), and every other GEMV with it."""
    from specdec.kernels.gemv import NARROW_NORM_N, consumer_launch_pdl, consumer_pdl
    assert consumer_pdl.value is None
    assert consumer_launch_pdl(1, NARROW_NORM_N + 16) and consumer_launch_pdl(16, NARROW_NORM_N)
    assert not consumer_launch_pdl(2, NARROW_NORM_N + 16) and not consumer_launch_pdl(16, 4096)
    with consumer_pdl.forced(True):
        assert consumer_launch_pdl(5, 4096)
    with consumer_pdl.forced(False):
        assert not consumer_launch_pdl(1, 768)
    for bad in (1, 0, "yes"):
        with pytest.raises(ValueError, match="consumer PDL"):
            with consumer_pdl.forced(bad):   # checked before anything changes
                pass
    assert consumer_pdl.value is None

    launches = []

    class Kernel:   # records each launch's PDL options instead of running
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((kw["USE_PDL"], kw["launch_pdl"], kw["LATE_TRIGGER"]))

    def run(m, k, norm):
        x, w = torch.zeros(m, k), torch.zeros(32, k)
        sums = NormInput(torch.ones(4, m), None, 1e-5) if norm else None
        launches.clear()
        gemv(x, w, config=GemvConfig(1 if m == 1 else 16, 16, 16), norm=sums)
        return launches[0]

    wide = NARROW_NORM_N + 16
    orig_kernel, orig_options = gemv_module._gemv_kernel, gemv_module.pdl.options
    gemv_module._gemv_kernel = Kernel()
    # PDL on, as on an H200 (the interpreter never has it); a launch gemv() does not allow stays off
    gemv_module.pdl.options = lambda device, allowed=True: {"USE_PDL": allowed, "launch_pdl": allowed}
    try:
        # an off-PDL consumer triggers its successor after its K loop (consumer_trigger)
        assert run(5, wide, norm=True) == (False, False, True)
        assert run(5, NARROW_NORM_N, norm=True) == (True, True, False)
        assert run(1, wide, norm=True) == (True, True, False)
        assert run(5, wide, norm=False) == (True, True, False)
        with consumer_pdl.forced(True):
            assert run(5, wide, norm=True) == (True, True, False)
        with gemv_module.consumer_trigger.forced(False):
            assert run(5, wide, norm=True) == (False, False, False)
        # PDL off for the whole process: nothing to trigger
        gemv_module.pdl.options = lambda device, allowed=True: {"USE_PDL": False, "launch_pdl": False}
        assert run(5, wide, norm=True) == (False, False, False)
    finally:
        gemv_module._gemv_kernel, gemv_module.pdl.options = orig_kernel, orig_options


def test_consumer_pdl_from_the_environment():
    """A server's processes take SPECDEC_GEMV_CONSUMER_PDL (1 / 0: every consumer on / off PDL,
    unset: the rule), so an e2e A/B can set it per side; anything else stops the import."""
    import os
    import subprocess
    import sys
    code = "from specdec.kernels import gemv; print(gemv.consumer_pdl.value)"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    seen = {}
    for value in ("1", "0", "", "yes"):
        env = {**os.environ, "SPECDEC_GEMV_CONSUMER_PDL": value}
        seen[value] = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                                     capture_output=True, text=True, timeout=120)
    assert [seen[v].stdout.strip() for v in ("1", "0", "")] == ["True", "False", "None"]
    assert seen["yes"].returncode != 0 and "SPECDEC_GEMV_CONSUMER_PDL" in seen["yes"].stderr


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16])
def test_wide_consumer_off_pdl_in_a_graph_keeps_its_bits(m):
    """On the H200 (PDL on): a producer and a norm consumer over a stream wider than NARROW_NORM_N,
    the consumer launched without PDL at 5 and 16 rows (with it at 1), as the servers' graphs run
    them: eager and graphed replays give the bits of every consumer forced onto PDL, new inputs
    each replay (a consumer reading the producer's stream before it was written would differ or
    show the NaN left in it)."""
    from specdec.kernels.gemv import NARROW_NORM_N, consumer_pdl
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(m)
    k, n, n2 = 512, NARROW_NORM_N + 64, 3 * 256
    x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dev, torch.bfloat16)
    res = torch.randn(m, n, generator=gen).to(dev, torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(n, generator=gen)).to(dev, torch.bfloat16)
    w2 = (torch.randn(n2, n, generator=gen) * 0.05).to(dev, torch.bfloat16)

    def pair():
        r, sums, rw = gemv(x, w, residual=res, norm_weight=nw)
        return gemv(rw, w2, norm=NormInput(sums, None, 1e-5))

    gemv_module._counters(dev)          # made before any capture
    with consumer_pdl.forced(True):
        want = pair()
    got = pair()
    assert gemv_module.consumer_launch_pdl(m, n) == (m == 1)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    graph, static = torch.cuda.CUDAGraph(), torch.empty_like(want)
    with torch.cuda.graph(graph):
        static.copy_(pair())
    for i in range(5):
        x.copy_(torch.randn(m, k, generator=gen).to(dev, torch.bfloat16))
        with consumer_pdl.forced(True):
            want = pair()
        static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want), i


@pytest.mark.gpu
def test_graphed_model_with_consumers_off_pdl_gives_the_same_logits():
    """The chain the rule makes in a forward: producer GEMV (PDL) -> norm consumer without PDL ->
    RoPE + KV store (PDL, loading cos / sin and slots before its wait) -> attention. A graphed
    model with every consumer off PDL against one with every consumer on it: the same logits bit
    for bit (the launches differ, the arithmetic does not), graphed decode steps replayed."""
    from specdec.kernels.gemv import consumer_pdl
    model = init_random(build_model(tiny_config(), torch.bfloat16, "cuda"), std=0.05)
    assert model.ops.fuse_norm
    gemv_module._counters(torch.device("cuda"))
    got = {}
    for flag in (False, True):
        with consumer_pdl.forced(flag):
            runner = new_runner(model, torch.bfloat16)
            runner.enable_cuda_graphs(max_model_len=64, query_lens=(1,), batch_sizes=(2,))
            got[flag] = run_steps(runner)
            assert runner.graphs.replays > 0
    for off, on in zip(got[False], got[True]):
        assert torch.isfinite(off).all() and torch.equal(off, on)
