"""Review of session 17's two changes (CPU; Triton kernels under TRITON_INTERPRET=1).

1. The GEMV's inline split-K reduce (specdec/kernels/gemv.py, INLINE_REDUCE, now the default):
   - random shapes: inline output equal bit for bit to the separate reduce's output for plain, bias, SiLU * up,
     the norm consumer (NORM_IN) split over K, and the residual producer (RES_OUT) with a strided
     residual and a bias; M 1..16, ragged K and N, fewer launched splits than cfg.split_k; every
     arrival count back to 0;
   - the early returns (m == 0, n == 0, k == 0) leave the counts alone and answer right;
   - the residual producer's per-tile sums feed a consumer as well as the separate layout does;
   - found and fixed: a split launch with more N tiles than MAX_SPLIT_TILES raised instead of
     falling back to the separate reduce (bench/gemv.py's sweep has such configs);
   - found and fixed: the counters were keyed by the torch.device as given, so "cuda" and
     "cuda:0" were two buffers.
2. The prebuilt Verify (coordinator/spec_loop.py _verify_request, ModelServer.step's on_sent):
   - under random faults (pipeline on and off, cancellations, draft and target failures and
     losses, chunked prompts, spec_max_batch), the Verify built in on_sent is byte for byte what
     a build after the draft's answer gives (what the old code sent);
   - ModelServer: on the channel -> gRPC fallback, on_sent runs once, after the gRPC write and
     before the read; a write that fails calls no on_sent;
   - found and fixed: an exception raised while building the Verify in on_sent counted as the
     draft failing."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from coordinator import servers as servers_mod
from coordinator.sequence import Abort, Finish
from coordinator.servers import ChannelUnreachable, ModelServer
from coordinator.spec_loop import SpecLoop
from protos import specdec_pb2 as pb
from specdec.kernels import counters as counters_module
from specdec.kernels import gemv as gemv_module
from specdec.kernels.gemv import GemvConfig, NormInput, gemv, split_layout
from specdec.models.llama import RMSNorm
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.unit.test_spec_loop_faults import (PROMPT, FakeDraft, collect, make_loop, new_seq, plain_greedy,
                                              tokenizer, until)
from tests.unit.test_spec_loop_pipeline import Chaos, ChaosTarget

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")


def _counts_zero() -> bool:
    return not gemv_module._counters(CPU).any()


@pytest.fixture
def poisoned(monkeypatch):
    """gemv's fresh buffers (output, partials, sums) come filled with NaN: an element or a partial
    nobody wrote shows."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(gemv_module.torch, "empty", empty)


# ------------------------------------------------------------------------------ GEMV inline reduce
def _random_case(seed: int):
    rng = random.Random(seed)
    m = rng.choice([1, 2, 3, 7, 15, 16])
    bm = 1 if m == 1 else 16
    bn = rng.choice([2, 4, 8, 16, 32]) if bm == 1 else rng.choice([16, 32])
    bk = rng.choice([16, 32, 64])
    k = rng.choice([k for k in (40, 96, 100, 130, 200) if k > bk])   # at least two K blocks
    n = rng.choice([3, 17, 40, 72])
    kind = ["plain", "glu", "residual", "norm", "norm_glu"][seed % 5]
    return m, bm, bn, bk, k, n, rng.choice([2, 3, 5, 16]), kind, rng.random() < 0.5, rng.choice([F32, BF16])


@pytest.mark.parametrize("seed", range(20))
def test_inline_equals_separate_bit_for_bit(seed, poisoned):
    """Every epilogue, including the split norm consumer (its per-row 1 / RMS scales each split's
    partial before the sum, in both modes) and the residual producer with a strided residual and a
    bias: the inline reduce gives the separate reduce's bits; all counts back to 0."""
    m, bm, bn, bk, k, n, split_k, kind, bias, dtype = _random_case(seed)
    cfg = GemvConfig(bm, bn, bk, split_k=split_k)
    launched = split_layout(k, cfg)[1]
    assert launched > 1
    gen = torch.Generator().manual_seed(seed)
    glu = kind.endswith("glu")
    rows = 2 * n if glu else n
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(rows, k, generator=gen) * 0.1).to(dtype)
    b = torch.randn(rows, generator=gen).to(dtype) if bias else None
    kw = {"epilogue": "silu_mul"} if glu else {}
    if kind == "residual":
        wide = torch.randn(m, n + 7, generator=gen).to(dtype)
        kw["residual"] = wide[:, 3:3 + n]      # row stride n + 7: a view
    if kind.startswith("norm"):
        parts = [1, 5, 200][seed % 3]          # 200 > BLOCK_P: the consumer's loop over further parts
        kw["norm"] = NormInput(torch.rand(parts, m, generator=gen) * k / parts,
                               (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype), 1e-5)
    with gemv_module.split_reduce_forced("separate"):
        want = gemv(x, w, b, config=cfg, **kw)
    with gemv_module.split_reduce_forced("inline"):
        got = gemv(x, w, b, config=cfg, **kw)
        assert _counts_zero()
    if kind == "residual":
        (r, sums), (r_want, sums_want) = got, want
        assert torch.equal(r, r_want)
        assert sums.shape == (-(-n // bn), m) and torch.isfinite(sums).all()
        for t in range(sums.shape[0]):   # each N tile's sum of its squares
            torch.testing.assert_close(sums[t], r[:, bn * t:bn * (t + 1)].float().pow(2).sum(-1),
                                       rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(sums.sum(0), sums_want.sum(0), rtol=1e-5, atol=1e-6)
    else:
        assert got.shape == want.shape and torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("mode", ["inline", "separate"])
def test_early_returns_leave_the_counts_and_answer_right(mode):
    """m == 0, n == 0 and k == 0 launch nothing: the counts stay 0, the results are the defined
    ones (the bias; zeros; SiLU * up of the bias; the residual as it is)."""
    cfg = GemvConfig(1, 8, 16, split_k=4)
    with gemv_module.split_reduce_forced(mode):
        b = torch.randn(6)
        assert torch.equal(gemv(torch.randn(1, 0), torch.randn(6, 0), b, config=cfg), b[None])
        y = gemv(torch.randn(3, 0), torch.randn(6, 0), config=GemvConfig(16, 16, 16, split_k=4))
        assert torch.equal(y, torch.zeros(3, 6))
        b2 = torch.randn(8)
        y = gemv(torch.randn(1, 0), torch.randn(8, 0), b2, epilogue="silu_mul", config=cfg)
        torch.testing.assert_close(y[0], torch.nn.functional.silu(b2[:4]) * b2[4:])
        assert gemv(torch.randn(0, 64), torch.randn(6, 64), config=cfg).shape == (0, 6)
        res = torch.randn(0, 6)
        r, sums = gemv(torch.randn(0, 64), torch.randn(6, 64), config=cfg, residual=res)
        assert r.shape == (0, 6) and sums.shape == (1, 0)
        assert gemv(torch.randn(1, 64), torch.randn(0, 64), config=cfg).shape == (1, 0)
        assert _counts_zero()
        # and the next split launch is right (nothing was left counted)
        x, w = torch.randn(1, 64), torch.randn(40, 64)
        torch.testing.assert_close(gemv(x, w, config=cfg), x @ w.t(), rtol=1e-5, atol=1e-5)
        assert _counts_zero()


@pytest.mark.parametrize("m", [1, 6])
def test_per_tile_sums_feed_a_split_consumer(m, poisoned):
    """The producer's sums layout changed (per N tile, inline): a consumer that is itself split
    over K reads them into RMSNorm's value, and a consumer of the inline layout gives the same
    bits in both reduce modes (its own split is reduced the same way)."""
    gen = torch.Generator().manual_seed(11 + m)
    k, n = 72, 130                                 # n: 9 tiles of 16 (the last ragged)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.2
    res = torch.randn(m, n, generator=gen)
    pcfg = GemvConfig(1 if m == 1 else 16, 16, 16, split_k=3)
    with gemv_module.split_reduce_forced("inline"):
        r, sums = gemv(x, w, config=pcfg, residual=res)
    assert sums.shape == (9, m)
    nw = 1 + 0.1 * torch.randn(n, generator=gen)
    w2 = torch.randn(2 * 24, n, generator=gen) * 0.1
    ccfg = GemvConfig(1 if m == 1 else 16, 16, 32, split_k=4)
    assert split_layout(n, ccfg)[1] == 3           # fewer launched than asked
    outs = {}
    for mode in ("separate", "inline"):
        with gemv_module.split_reduce_forced(mode):
            outs[mode] = gemv(r, w2, norm=NormInput(sums, nw, 1e-5), config=ccfg, epilogue="silu_mul")
    assert torch.equal(outs["separate"], outs["inline"]) and _counts_zero()
    normed = RMSNorm.forward(NormInput(None, nw, 1e-5), r.double()).double()
    gu = normed @ w2.double().t()
    ref = torch.nn.functional.silu(gu[:, :24]) * gu[:, 24:]
    torch.testing.assert_close(outs["inline"].double(), ref, rtol=1e-4, atol=1e-5)


def test_more_tiles_than_the_counters_fall_back_instead_of_raising(monkeypatch):
    """(Found in review: such a launch raised in inline mode; bench/gemv.py's sweep reaches it.)"""
    # The cap made small so that the interpreter launch stays quick (4097 real tiles take ~30 s).
    monkeypatch.setattr(gemv_module, "MAX_SPLIT_TILES", 4)
    x, w = torch.randn(1, 64), torch.randn(40, 64)        # 5 tiles of 8, split in 4
    cfg = GemvConfig(1, 8, 16, split_k=4)
    with gemv_module.split_reduce_forced("separate"):
        want = gemv(x, w, config=cfg)
    with gemv_module.split_reduce_forced("inline"):
        got = gemv(x, w, config=cfg)
    assert torch.equal(got, want) and _counts_zero()


def test_the_real_cap_is_reached_by_the_gemv_sweep():
    """What makes the test above matter: bench/gemv.py sweeps split_k=2 over (4, 1024) tiles at
    M = 1, and the 7B's lm_head and gate_up then have more N tiles than MAX_SPLIT_TILES."""
    cfg = GemvConfig(1, 4, 1024, split_k=2)
    for n in (32000, 2 * 11008):
        assert split_layout(4096, cfg)[1] == 2 and -(-n // cfg.block_n) > gemv_module.MAX_SPLIT_TILES


def test_counters_are_one_buffer_per_physical_device(monkeypatch):
    """(Found in review: "cuda" and "cuda:0" were two buffers, and the GPU tests checked the one
    no launch used.)"""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **kw: real_zeros(*a, **kw))
    try:
        assert gemv_module._counters(torch.device("cuda")) is gemv_module._counters(torch.device("cuda", 0))
    finally:
        counters_module._buffer.cache_clear()   # (the CPU buffer comes back zeroed on next use)


# -------------------------------------------------------------------------------- prebuilt Verify
class EarlyChaos(Chaos):
    """Chaos (random failures, losses, delays) that calls on_sent as ModelServer does: once the
    request is written (most calls; a call that fails before the write does not), sometimes again
    (a resend over gRPC), then works for a while."""

    async def step(self, request, timeout=None, on_sent=None):
        if on_sent is not None and self.rng.random() < 0.85:
            on_sent()
            if self.rng.random() < 0.3:
                on_sent()
            await asyncio.sleep(self.rng.choice([0.0, 0.001]))
        return await super().step(request, timeout, on_sent)


@pytest.fixture
def verify_checker(monkeypatch):
    """Every later call of SpecLoop._verify_request (the one after the draft's answer, and a second
    on_sent) compares what is built with what a build at that moment gives: the old code's
    request, without drafts and releases."""
    real = SpecLoop._verify_request
    seen = {"first_builds": 0, "checked": 0, "mismatches": []}

    def checking(self, plans, built):
        if not built:
            real(self, plans, built)
            seen["first_builds"] += 1
            return
        fresh: list = []
        real(self, plans, fresh)
        seen["checked"] += 1
        if fresh[0].SerializeToString() != built[0].SerializeToString():
            seen["mismatches"].append((self._step_no, str(built[0]), str(fresh[0])))
    monkeypatch.setattr(SpecLoop, "_verify_request", checking)
    return seen


@pytest.mark.parametrize("pipeline", ["on", "off"])
@pytest.mark.parametrize("seed", range(12))
def test_prebuilt_verify_is_what_a_late_build_gives_under_faults(tmp_path, seed, pipeline, verify_checker):
    rng = random.Random(1000 + seed)

    async def main():
        seqs = {}
        draft = EarlyChaos(rng, seqs, max_num_draft=rng.choice([0, 5]))
        draft.fail_p, draft.lose_p = rng.choice([0.0, 0.05]), rng.choice([0.0, 0.05])
        target = ChaosTarget(rng)
        target.fail_p, target.lose_p = rng.choice([0.0, 0.03]), rng.choice([0.0, 0.05])
        loop, sched, _ = make_loop(draft, target, pipeline=pipeline, spec_max_batch=rng.choice([0, 2]),
                                   prefill_chunk=rng.choice([2, 4, 512]))
        loop.draft_max_num_draft = draft.max_num_draft
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        batch = [new_seq(tok, i + 1, rng.choice([0.0, 0.7]), speculate=rng.random() < 0.85,
                         max_new_tokens=rng.choice([3, 8, 24])) for i in range(rng.randint(2, 5))]
        for seq in batch:
            seqs[seq.seq_id] = seq
            sched.submit(seq)
        cancelled = batch.pop() if rng.random() < 0.5 else None
        if cancelled is not None:   # goes away at a random moment (often while the draft works)
            asyncio.get_running_loop().call_later(rng.random() * 0.01, sched.cancel, cancelled)
        try:
            results = await asyncio.gather(*(collect(s, timeout=5) for s in batch))
            await until(lambda: not draft.held and not target.held)
        finally:
            task.cancel()
        return batch, results, draft, target
    batch, results, draft, target = asyncio.run(main())
    for seq, (tokens, end) in zip(batch, results):
        if isinstance(end, Finish):
            assert tokens == plain_greedy(PROMPT, seq.params.max_new_tokens)
    assert not draft.violations and not target.violations
    proposes = [r for r in draft.requests if any(not s.extend for s in r.seqs)]
    assert verify_checker["first_builds"] > 0 and (verify_checker["checked"] > 0 or not proposes)
    assert not verify_checker["mismatches"], verify_checker["mismatches"][0]


class _Log:
    def __init__(self):
        self.events: list[str] = []


class _FakeGrpcCall:
    def __init__(self, log: _Log, fail_write: bool = False):
        self.log, self.fail_write = log, fail_write

    async def write(self, request):
        self.log.events.append("grpc-write")
        if self.fail_write:
            raise ConnectionError("stream broken")

    async def read(self):
        self.log.events.append("grpc-read")
        return pb.ProposeResponse(step=7)

    def cancel(self):
        self.log.events.append("cancel")

    def done(self):
        return False


class _FakeStub:
    def __init__(self, log: _Log, fail_write: bool = False):
        self.log, self.fail_write = log, fail_write

    def Propose(self):
        return _FakeGrpcCall(self.log, self.fail_write)


@pytest.mark.parametrize("grpc_write_fails", [False, True])
def test_on_sent_on_the_grpc_fallback_runs_once_after_that_write(monkeypatch, grpc_write_fails):
    """The step channel takes no connection (the request never left): the same request goes over
    gRPC, and on_sent runs once, after the gRPC write and before the read; a write that fails
    calls no on_sent (the loop then builds the Verify itself)."""
    log = _Log()

    async def unreachable(self, request):
        log.events.append("channel-write")
        raise ChannelUnreachable("refused")
    monkeypatch.setattr(servers_mod.ChannelCall, "write", unreachable)

    async def main():
        server = ModelServer("draft", "127.0.0.1:1")
        server.step_port = 9   # the server's Info named a step channel
        server.stub = _FakeStub(log, grpc_write_fails)
        assert server.transport == "channel"
        try:
            return await server.step(pb.ProposeRequest(step=7), timeout=5,
                                     on_sent=lambda: log.events.append("on_sent"))
        finally:
            await server.close()
    if grpc_write_fails:
        with pytest.raises(ConnectionError):
            asyncio.run(main())
        assert "on_sent" not in log.events
    else:
        response = asyncio.run(main())
        assert response.step == 7
        assert log.events[:4] == ["channel-write", "grpc-write", "on_sent", "grpc-read"]


def test_no_drafting_sequence_still_gets_a_full_verify(tmp_path, verify_checker):
    """Sequences that do not speculate (no Propose goes out, so no on_sent): the Verify is built
    after _propose, prompts in chunks included, and the output is plain greedy."""
    class MustNotBeCalled(FakeDraft):
        async def step(self, request, timeout=None, on_sent=None):
            raise AssertionError("a Propose without a drafting sequence")

    async def main():
        loop, sched, target = make_loop(MustNotBeCalled(), prefill_chunk=2)
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        seqs = [new_seq(tok, i + 1, speculate=False, max_new_tokens=6) for i in range(3)]
        for s in seqs:
            sched.submit(s)
        try:
            return await asyncio.gather(*(collect(s) for s in seqs)), loop
        finally:
            task.cancel()
    results, loop = asyncio.run(main())
    assert all(end == Finish.LENGTH and tokens == plain_greedy(PROMPT, 6) for tokens, end in results)
    assert loop.draft_up and verify_checker["first_builds"] > 0 and verify_checker["checked"] == 0


def test_a_failure_building_the_verify_is_not_the_drafts(tmp_path, monkeypatch):
    """(Found in review: an exception building the Verify inside the draft's on_sent counted as the
    draft failing and took it down; the step fails, the draft stays up.)"""
    class CallingDraft(FakeDraft):
        written = 0

        async def step(self, request, timeout=None, on_sent=None):
            self.written += 1   # (the request is written, then on_sent runs)
            if on_sent is not None:
                on_sent()
            return await super().step(request, timeout)

    def broken(self, plans, built):
        raise RuntimeError("a bug while building the Verify")
    monkeypatch.setattr(SpecLoop, "_verify_request", broken)

    async def main():
        draft = CallingDraft()
        loop, sched, _ = make_loop(draft)
        task = asyncio.create_task(loop.run())
        seq = new_seq(tokenizer(tmp_path), 1)
        sched.submit(seq)
        try:
            out = await collect(seq)
        finally:
            task.cancel()
        return out, loop, draft
    (tokens, end), loop, draft = asyncio.run(main())
    assert isinstance(end, Abort) and "building the Verify" in end.message   # the step failed either way
    assert draft.written == 1                                                # and a Propose went out
    assert loop.draft_up   # ... but the draft did nothing wrong


# ----------------------------------------------------------------- on the GPU (skipped on the CPU)
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_inline_every_epilogue_on_cuda_and_the_counters_launches_use(m):
    """The drafts' split shapes with each epilogue (plain + bias, SiLU * up, the residual producer,
    the split norm consumer): the inline reduce's bits are the separate reduce's over 40 launches
    each (programs arrive in any order), and the counters the launches use (x.device's, cuda:N;
    not _counters(torch.device('cuda'))) are all 0 afterwards, also after graph replays."""
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator().manual_seed(m)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, BF16)
    k, n, inter = 768, 768, 2048
    x, w, b = rnd(m, k), rnd(n, k, scale=0.05), rnd(n)
    res = rnd(m, n + 8)[:, 4:4 + n]
    wgu = rnd(2 * inter, k, scale=0.05)
    wqkv = rnd(3 * n, k, scale=0.05)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(dev, BF16)
    calls = {
        "plain": lambda: gemv(x, w, b),
        "glu": lambda: gemv(x, wgu, epilogue="silu_mul"),
        "residual": lambda: gemv(x, w, residual=res)[0],
    }
    with gemv_module.split_reduce_forced("inline"):
        _, sums = gemv(x, w, residual=res)
    calls["norm"] = lambda: gemv(x, wqkv, norm=NormInput(sums, nw, 1e-5))
    splits = {"plain": (n, k), "glu": (2 * inter, k), "residual": (n, k), "norm": (3 * n, k)}
    assert any(split_layout(kk, gemv_module.default_config(m, nn, kk, sms))[1] > 1 for nn, kk in splits.values())
    for name, call in calls.items():
        with gemv_module.split_reduce_forced("separate"):
            want = call()
        with gemv_module.split_reduce_forced("inline"):
            outs = [call() for _ in range(40)]
            torch.cuda.synchronize()
            assert not gemv_module._counters(dev).any(), name
            assert all(torch.equal(o, want) for o in outs), name
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = call()
            for _ in range(10):
                static.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static, want), name
            assert not gemv_module._counters(dev).any(), name
