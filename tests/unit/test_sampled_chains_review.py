"""Adversarial review of sampled chains (config.sampled_chains; commit 742a71f) on the CPU stand-ins.

The contract: with sampled chains on, a draft engine returns exactly the tokens and distributions
(bit for bit, through transport.dense_weights) of the same engine, on the same stand-in graphs and
sampler, without them; its KV use and free blocks match after every step; greedy chains are
unchanged. Most cases run on DeviceTorchAttention below: the same attention as the reference, but
reading only the batch's device tensors (context lengths, query starts, tables, slots), so a CPU
stand-in replay of a chain step, whose host lists are the static bucket's, computes what a graph
would; it is ~50x faster than the interpreted Triton kernels, which one fuzz still uses."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import specdec.engine.draft as draft_mod
from specdec.config import EngineConfig
from specdec.cuda_graphs import GraphedForward
from specdec.engine import DraftEngine, DraftSeqInput
from specdec.kernels.triton_attention import TritonAttention
from specdec.sampling.params import SamplingParams
from specdec.sampling.probs import host_rows
from specdec.sampling.rng import DRAFT, RESAMPLE, uniform_host
from specdec.sampling.transport import dense_weights
from tests.helpers.cpu_graphs import CpuGraphs, CpuSampler, warm_record
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import make_pair

V = 320   # make_pair's vocabulary


# --- a fast graph-safe attention for the CPU ----------------------------------------------------
class DeviceTorchAttention:
    """Paged attention from the batch's device tensors only (what a CUDA graph replays): query
    token t of sequence b sits at context_lens[b] - (query_start_loc[b + 1] - t) and sees keys
    0..that position; tokens outside every query span (bucket padding) get key 0 (finite garbage).
    Slots < 0 are not written."""
    name = "device-torch"

    def store(self, k, v, k_cache, v_cache, batch) -> None:
        slots = batch.slot_mapping
        keep = (slots >= 0).nonzero().flatten()
        if keep.numel() == 0:
            return
        nb, bs = k_cache.shape[:2]
        idx = slots.index_select(0, keep)
        k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, idx, k.index_select(0, keep).to(k_cache.dtype))
        v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, idx, v.index_select(0, keep).to(v_cache.dtype))

    def attend(self, q, k_cache, v_cache, batch, scale: float) -> torch.Tensor:
        t, h, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        qsl = batch.query_start_loc.long()
        n = qsl.numel() - 1
        tok = torch.arange(t, device=q.device)
        seq = torch.searchsorted(qsl[1:].contiguous(), tok, right=True)
        valid = seq < n
        seq = seq.clamp(max=n - 1)
        pos = batch.context_lens.long()[seq] - (qsl[seq + 1] - tok)
        tables = batch.block_tables.long()[seq]                                   # [T, W]
        w = tables.shape[1]
        k = k_cache[tables].reshape(t, w * bs, hkv, d).float().repeat_interleave(h // hkv, dim=2)
        v = v_cache[tables].reshape(t, w * bs, hkv, d).float().repeat_interleave(h // hkv, dim=2)
        kpos = torch.arange(w * bs, device=q.device)
        visible = (kpos[None, :] <= pos[:, None]) & valid[:, None]
        visible[:, 0] |= ~valid
        scores = torch.einsum("thd,tkhd->thk", q.float(), k) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        return torch.einsum("thk,tkhd->thd", scores.softmax(-1), v).to(q.dtype)


class WarmGraphs(GraphedForward):
    """GraphedForward's own captures (_capture, _capture_chain: not the stand-in's), with a
    _record that executes on the CPU what the CUDA one executes: fn() twice (the warm-up on the
    side stream; the capture itself runs nothing), then a "graph" whose replay re-runs fn on the
    same buffers."""
    _check_device = staticmethod(lambda device: None)
    _new_pool = staticmethod(lambda: None)

    _record = staticmethod(warm_record)


# --- engines ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))[1]


def _engine(path, *, sampled: bool, dtype=torch.float16, sizes=(1, 2, 4), max_num_draft=6,
            graph_len=128, max_model_len=None, chains=True, backend=None, num_blocks=256,
            block_size=4, graphs_cls=CpuGraphs, check=True) -> DraftEngine:
    config = EngineConfig(model=path, num_blocks=num_blocks, block_size=block_size, warmup_batch_sizes=(1,),
                          max_num_draft=max_num_draft, probs_dtype=dtype, sampled_chains=sampled,
                          max_model_len=max_model_len)
    e = DraftEngine(config)
    e.runner.backend = backend if backend is not None else DeviceTorchAttention()
    e.runner.graphs = graphs_cls(e.runner, max_model_len=graph_len, query_lens=(1, 2), batch_sizes=sizes,
                                chains=chains)
    e.sampler = CpuSampler(e.vocab_size, sizes, max_num_draft, dtype, e.device)
    e._capture_sampled_chains()
    assert not check or bool(e.runner.graphs.sampled_chains) == (sampled and chains)
    return e


def _count_chains(engine) -> list:
    """Wraps engine._chain to record (rows, start, steps) of every sampled chain that ran."""
    ran = []
    inner = engine._chain

    def spy(plans, first_ids, rows, done, clock, steps, sampled=None):
        before = len(steps)
        ok = inner(plans, first_ids, rows, done, clock, steps, sampled)
        if ok and sampled is not None:
            ran.append((len(rows), done, len(steps) - before))
        return ok
    engine._chain = spy
    return ran


class _Seeds:
    """resolve_seeds replaced by a reproducible one: pinned seeds as given, None rows from an RNG
    that is reset to the same state before each engine's propose (what one fresh seed per row per
    step gives, reproducibly)."""

    def __init__(self, monkeypatch):
        self.rng = random.Random(0)
        monkeypatch.setattr(draft_mod, "resolve_seeds", self)

    def reset(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, params):
        return [p.seed if p.seed is not None else self.rng.getrandbits(64) for p in params]


def _same_outputs(a, b, *, probs=True) -> None:
    assert [o.seq_id for o in a.outputs] == [o.seq_id for o in b.outputs]
    assert [None if o.error is None else o.error.code for o in a.outputs] == \
           [None if o.error is None else o.error.code for o in b.outputs]
    for x, y in zip(a.outputs, b.outputs):
        assert x.tokens == y.tokens, (x.seq_id, x.tokens, y.tokens)
        if probs:
            assert (x.probs is None) == (y.probs is None), x.seq_id
            if x.probs is not None:
                dx, dy = dense_weights(x.probs), dense_weights(y.probs)
                assert dx.dtype == dy.dtype and dx.shape == dy.shape and torch.equal(dx, dy), x.seq_id
                assert dx.shape[0] == len(x.tokens)


def _same_timing(a, b) -> None:
    assert a.timing.num_forwards == b.timing.num_forwards


def _same_state(a: DraftEngine, b: DraftEngine) -> None:
    assert a.num_free_blocks == b.num_free_blocks
    assert set(a.states) == set(b.states)
    for sid in a.states:
        assert a.states[sid] == b.states[sid], sid
        assert a.runner.num_tokens(sid) == b.runner.num_tokens(sid), sid


# --- random steps -------------------------------------------------------------------------------
def _params(rng: random.Random, pinned: float = 0.7) -> SamplingParams:
    seed = rng.getrandbits(64) if rng.random() < pinned else None
    kind = rng.choice(["greedy", "temp", "top_k", "top_p", "min_p", "all", "top_k1"])
    t = rng.choice([0.3, 0.7, 1.0, 1.5, 3.0])
    if kind == "greedy":
        return SamplingParams(seed=seed)
    if kind == "temp":
        return SamplingParams(temperature=t, seed=seed)
    if kind == "top_k":
        return SamplingParams(temperature=t, top_k=rng.choice([2, 5, 40, 319, 320, 1000]), seed=seed)
    if kind == "top_k1":
        return SamplingParams(temperature=t, top_k=1, seed=seed)
    if kind == "top_p":
        return SamplingParams(temperature=t, top_p=rng.choice([0.05, 0.5, 0.9, 0.999]), seed=seed)
    if kind == "min_p":
        return SamplingParams(temperature=t, min_p=rng.choice([0.01, 0.2, 0.9, 1.0]), seed=seed)
    return SamplingParams(temperature=t, top_k=rng.choice([3, 50]), top_p=rng.choice([0.6, 0.95]),
                          min_p=rng.choice([0.0, 0.05]), seed=seed)


def _random_step(rng: random.Random, ref: DraftEngine, live: set, next_id: list, *, kmax: int, bmax: int,
                 max_len: int, greedy_only: bool = False, sampled_only: bool = False):
    """One random propose(seqs, release) that ref (the plain engine) would accept, mostly."""
    release = []
    for sid in sorted(live):
        if rng.random() < 0.08:
            release.append(sid)
    live -= set(release)
    if release and rng.random() < 0.2:   # released, then named in the step: unknown
        live.add(release[0])
    n = rng.randint(1, bmax)
    ids = rng.sample(sorted(live), min(len(live), n))
    while len(ids) < n and rng.random() < 0.8:
        ids.append(next_id[0])
        next_id[0] += 1
    rng.shuffle(ids)
    uniform = rng.random() < 0.6
    k_all = rng.choice([1, 2, kmax - 1, kmax, kmax, rng.randint(0, kmax)])
    mode_params = None
    if rng.random() < 0.3:   # one parameter set for the whole step
        mode_params = _params(rng)
    seqs = []
    for sid in ids:
        k = k_all if uniform else rng.randint(0, kmax)
        p = mode_params or _params(rng)
        if greedy_only:
            p = SamplingParams()
        elif sampled_only and p.greedy:
            p = SamplingParams(temperature=1.0, seed=p.seed)
        state = ref.states.get(sid)
        if state is not None and rng.random() < 0.05:   # a resend from the start (idempotent restart)
            state = None
        if rng.random() < 0.03:   # invalid: too many drafts, a bad token, or an unknown sequence
            bad = rng.choice([DraftSeqInput(sid, 0, [1], kmax + 1, p, first=state is None),
                              DraftSeqInput(sid, 0, [V], k, p, first=state is None),
                              DraftSeqInput(next_id[0] + 1000, 0, [1], k, p)])
            seqs.append(bad)
            continue
        if state is None:   # new
            prompt = [rng.randrange(V) for _ in range(rng.randint(1, 9))]
            if rng.random() < 0.1:   # long prompt: near max_model_len
                prompt = [rng.randrange(V) for _ in range(max(1, max_len - k - rng.randint(0, 3)))]
            seqs.append(DraftSeqInput(sid, 0, prompt, k, p, first=True))
            continue
        drafted = len(state.tokens) - state.base
        keep = rng.randint(0, drafted)
        if rng.random() < 0.2:
            seqs.append(DraftSeqInput(sid, keep, [], k, p, extend=True))
        else:
            new = [rng.randrange(V) for _ in range(rng.choice([1, 1, 1, 2, 0]))]
            seqs.append(DraftSeqInput(sid, keep, new, k, p))
    return seqs, release


def _step_all(engines, seeds, seed: int, seqs, release=(), timing: bool = True) -> list:
    """One propose on every engine, the seeds of unseeded rows reset alike before each; the
    outputs (and timing) and states of engines[1:] must be engines[0]'s. Returns the results."""
    outs = []
    for e in engines:
        seeds.reset(seed)
        outs.append(e.propose(seqs, release))
    for o in outs[1:]:
        _same_outputs(outs[0], o)
        if timing:
            _same_timing(outs[0], o)
    for e in engines[1:]:
        _same_state(engines[0], e)
    return outs


def _fuzz(path, seed: int, num_steps: int, monkeypatch, *, dtype=torch.float16, sizes=(1, 2, 4), kmax=6,
          bmax=6, graph_len=128, max_model_len=96, greedy_only=False, sampled_only=False, backend=None,
          extra_plain=None, num_blocks=256, block_size=4, graphs_cls=CpuGraphs):
    seeds = _Seeds(monkeypatch)
    kw = dict(dtype=dtype, sizes=sizes, max_num_draft=kmax, graph_len=graph_len, max_model_len=max_model_len,
              backend=backend, num_blocks=num_blocks, block_size=block_size, graphs_cls=graphs_cls)
    plain, chained = _engine(path, sampled=False, **kw), _engine(path, sampled=True, **kw)
    engines = [plain, chained] + ([extra_plain] if extra_plain is not None else [])
    free0 = [e.num_free_blocks for e in engines]
    ran = _count_chains(chained)
    rng = random.Random(seed)
    live: set = set()
    next_id = [1]
    for i in range(num_steps):
        seqs, release = _random_step(rng, plain, live, next_id, kmax=kmax, bmax=bmax,
                                     max_len=plain.max_model_len, greedy_only=greedy_only,
                                     sampled_only=sampled_only)
        outs = _step_all(engines, seeds, 1000 + i, seqs, release)
        for s, o in zip(seqs, outs[0].outputs):
            assert o.error is not None or len(o.tokens) == s.num_draft
        live = set(plain.states)
        assert live == set(plain.runner.blocks.seq_ids())
    for e, f in zip(engines, free0):
        e.release(sorted(live))
        assert e.num_free_blocks == f and not e.states
    return plain, chained, ran


# --- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,dtype", [(1, torch.float16), (2, torch.bfloat16), (3, torch.float16),
                                        (4, torch.bfloat16)], ids=str)
def test_fuzz_mixed_steps_match_the_plain_engine(draft_path, monkeypatch, seed, dtype):
    """Random steps: greedy / temperature / top-k / top-p / min-p rows, pinned and fresh seeds,
    uniform and ragged num_draft (0 .. max), extensions, keeps, new sequences, releases, batches
    1..6 on buckets (1, 2, 4) (3 between them, 5 and 6 above: eager)."""
    _, _, ran = _fuzz(draft_path, seed, 60, monkeypatch, dtype=dtype)
    assert len(ran) >= 5, ran                      # the sampled chain actually ran ...
    assert {r[0] for r in ran} >= {1, 2}, ran      # ... for several bucket sizes
    assert any(start + steps == 6 for _, start, steps in ran), ran   # ... up to the sampler's last row


def test_fuzz_sampled_only_uniform_bucket_three(draft_path, monkeypatch):
    """Buckets (1, 3): rows 2 and 3 chain on bucket 3, 4+ run eagerly; every row sampled."""
    _, _, ran = _fuzz(draft_path, 11, 30, monkeypatch, sizes=(1, 3), bmax=5, sampled_only=True, kmax=5)
    assert {r[0] for r in ran} & {2, 3}, ran


def test_fuzz_near_max_model_len_and_table_end(draft_path, monkeypatch):
    """max_model_len 40 on graphs of 24 tokens (6 blocks): chains that would cross the graphs'
    table run position by position (eagerly), sequences are refused at max_model_len."""
    plain, chained, ran = _fuzz(draft_path, 5, 40, monkeypatch, graph_len=24, max_model_len=40, bmax=4)
    assert ran


def test_fuzz_greedy_only_is_unchanged(draft_path, monkeypatch):
    """Greedy steps on the chained engine vs the plain one and one without any chain graph: the
    sampled chain never runs and the greedy chain gives the position-by-position argmaxes."""
    from specdec.runner import ModelRunner
    calls = []
    inner = ModelRunner.greedy_chain

    def greedy_chain(self, seq_ids, first_ids, steps, sampled=False, start=0):
        calls.append(sampled)
        return inner(self, seq_ids, first_ids, steps, sampled, start)
    monkeypatch.setattr(ModelRunner, "greedy_chain", greedy_chain)
    nochain = _engine(draft_path, sampled=False, chains=False, max_model_len=96)
    _, chained, ran = _fuzz(draft_path, 7, 20, monkeypatch, greedy_only=True, extra_plain=nochain)
    assert ran == [] and True not in calls
    assert calls.count(False) >= 10   # greedy chains ran (on both chain engines)


def test_fuzz_on_triton_attention(draft_path, monkeypatch):
    """A short fuzz on the interpreted Triton attention (the GPU's kernels)."""
    _, _, ran = _fuzz(draft_path, 21, 6, monkeypatch, backend=TritonAttention(), bmax=3, kmax=4)
    assert ran


def test_unseeded_rows_are_consistent(draft_path):
    """Unpatched resolve_seeds (fresh seeds each step): greedy rows must match (their draws do not
    depend on the sampled rows' seeds), every row drafts num_draft tokens with num_draft q rows
    that put weight on the drafted token, and KV / blocks match."""
    plain = _engine(draft_path, sampled=False)
    chained = _engine(draft_path, sampled=True)
    ran = _count_chains(chained)
    free0 = plain.num_free_blocks
    rng = random.Random(4)
    g = SamplingParams()
    u = SamplingParams(temperature=1.0)
    seqs = [DraftSeqInput(i, 0, [rng.randrange(V) for _ in range(3)], 5, [g, u][i % 2], first=True)
            for i in range(4)]
    for step in range(6):
        a, b = plain.propose(seqs), chained.propose(seqs)
        for s, x, y in zip(seqs, a.outputs, b.outputs):
            assert x.error is None and y.error is None
            assert len(x.tokens) == len(y.tokens) == s.num_draft
            if s.sampling.greedy:
                assert x.tokens == y.tokens and x.probs is None and y.probs is None
            else:
                w = dense_weights(y.probs).float()
                assert w.shape == (s.num_draft, V)
                assert all(w[j, t] > 0 for j, t in enumerate(y.tokens))
            assert plain.runner.num_tokens(s.seq_id) == chained.runner.num_tokens(s.seq_id)
        # next: every draft kept and a correction; the engines' sampled drafts differ (fresh
        # seeds), each continues from its own, and the greedy rows stay identical.
        seqs = [DraftSeqInput(s.seq_id, s.num_draft, [7], s.num_draft, s.sampling) for s in seqs]
    assert plain.num_free_blocks == chained.num_free_blocks
    assert len(ran) == 6
    for e in (plain, chained):
        e.release(range(4))
        assert e.num_free_blocks == free0


def test_stage_chain_uniforms_are_those_sample_stages():
    """stage_chain's table row start + i, column j == the uniform sample() stages at step
    start + i for row j (position positions[j] + i, DRAFT); padding columns and other rows 0;
    parameters padded as greedy rows."""
    sampler = CpuSampler(V, (1, 2, 4), 6, torch.float16, torch.device("cpu"))
    for b in (1, 2, 4):
        sampler.chain_pick(b)
    rng = random.Random(3)
    for _ in range(40):
        n = rng.randint(1, 4)
        b = next(x for x in (1, 2, 4) if x >= n)
        params = [_params(rng, pinned=1.0) for _ in range(n)]
        seeds = [p.seed for p in params]
        positions = [rng.randint(0, 500) for _ in range(n)]
        start = rng.randint(1, 5)
        steps = rng.randint(1, 6 - start)
        sampler.stage_chain(params, seeds, positions, start, steps)
        table = sampler.chain_buffers[b].views[5].view(6, b)
        for i in range(6):
            if start <= i < start + steps:
                # what sample() stages at step i: DRAFT purposes (no guess after step 0)
                want = uniform_host(host_rows(params, seeds).seeds, [p + (i - start) for p in positions], [DRAFT] * n)
                got = table[i, :n].numpy()
                assert np.array_equal(got, want)
                # and sample()'s own staging, read back from its buffer
                logits = torch.randn(n, V)
                sampler.sample(logits, params, seeds, [p + (i - start) for p in positions], None, i)
                g, _ = sampler._graph_for(n, params)
                assert np.array_equal(g.packed.views[5][:n].numpy(), got)
                assert (table[i, n:] == 0).all()
            else:
                assert (table[i] == 0).all()
        v = sampler.chain_buffers[b].views
        assert v[4][n:].all() and v[3][n:].eq(0).all()
        assert v[4][:n].tolist() == [p.greedy for p in params]


def test_engine_chain_uniforms_match_the_plain_engines(draft_path, monkeypatch):
    """Through the engines: the uniform each chained position draws with (the chain table's row)
    equals the one the plain engine stages for it in sample(), per row, for an extension step
    (RESAMPLE at step 0 only) and for new sequences at different positions."""
    seeds = _Seeds(monkeypatch)
    plain = _engine(draft_path, sampled=False)
    chained = _engine(draft_path, sampled=True)
    staged_plain, staged_chain = {}, {}
    inner_sample = plain.sampler.sample

    def sample(logits, params, sds, positions, guess, step):
        out = inner_sample(logits, params, sds, positions, guess, step)
        g, _ = plain.sampler._graph_for(len(params), params)
        staged_plain[step] = g.packed.views[5][:len(params)].clone()
        if step == 0 and guess:
            rows = host_rows(params, sds)
            want = uniform_host(rows.seeds, positions, [RESAMPLE if x else DRAFT for x in guess])
            assert np.array_equal(staged_plain[0].numpy(), want)
        return out
    plain.sampler.sample = sample
    inner_stage = chained.sampler.stage_chain

    def stage_chain(params, sds, positions, start, steps):
        inner_stage(params, sds, positions, start, steps)
        b = chained.sampler.chain_bucket(len(params))
        table = chained.sampler.chain_buffers[b].views[5].view(chained.sampler.max_steps, b)
        for i in range(start, start + steps):
            staged_chain[i] = table[i, :len(params)].clone()
    chained.sampler.stage_chain = stage_chain
    p1, p2 = SamplingParams(temperature=0.8, top_k=30, seed=5), SamplingParams(temperature=1.1)
    steps = [
        [DraftSeqInput(1, 0, [3, 4, 5, 6, 7], 5, p1, first=True), DraftSeqInput(2, 0, [9], 5, p2, first=True)],
        [DraftSeqInput(1, 2, [], 4, p1, extend=True), DraftSeqInput(2, 5, [], 4, p2, extend=True)],
        [DraftSeqInput(1, 1, [8], 6, p1), DraftSeqInput(2, 0, [1, 2], 6, p2)],
    ]
    for i, step in enumerate(steps):
        staged_plain.clear()
        staged_chain.clear()
        seeds.reset(i)
        a = plain.propose(step)
        seeds.reset(i)
        b = chained.propose(step)
        _same_outputs(a, b)
        k = step[0].num_draft
        assert sorted(staged_chain) == list(range(1, k))
        for j in range(1, k):
            assert torch.equal(staged_chain[j], staged_plain[j]), (i, j)


def test_greedy_then_sampled_then_greedy_on_one_bucket(draft_path, monkeypatch):
    """The greedy and the sampled chain of bucket 2 share its static inputs and the sampler's
    rows: alternate them (and a ragged step between) and compare with the plain engine, step by
    step, including the one without any chain."""
    seeds = _Seeds(monkeypatch)
    engines = [_engine(draft_path, sampled=False), _engine(draft_path, sampled=True),
               _engine(draft_path, sampled=False, chains=False)]
    ran = _count_chains(engines[1])
    g, s = SamplingParams(), SamplingParams(temperature=1.3, top_p=0.9, seed=3)
    plan = [
        [DraftSeqInput(1, 0, [5, 6], 6, s, first=True), DraftSeqInput(2, 0, [7], 6, s, first=True)],
        [DraftSeqInput(1, 6, [1], 6, g), DraftSeqInput(2, 6, [2], 6, g)],          # greedy chain (whole)
        [DraftSeqInput(1, 3, [4], 4, s), DraftSeqInput(2, 2, [3], 4, g)],          # mixed: sampled chain (whole)
        [DraftSeqInput(1, 4, [2], 3, s), DraftSeqInput(2, 4, [1], 5, s)],          # ragged
        [DraftSeqInput(1, 3, [5], 6, g), DraftSeqInput(2, 5, [6], 6, g)],
        [DraftSeqInput(1, 1, [], 6, s, extend=True), DraftSeqInput(2, 0, [], 6, g, extend=True)],
    ]
    for i, step in enumerate(plan):
        _step_all(engines, seeds, i, step, timing=False)
    assert ran == [(2, 1, 5), (2, 0, 4), (1, 4, 1), (2, 1, 5)]


def test_q_rows_survive_until_to_host(draft_path):
    """The DraftOutput.probs of a chained step are copies: a later step that rewrites the
    sampler's rows (same bucket, same rows) does not change the earlier outputs."""
    chained = _engine(draft_path, sampled=True)
    s = SamplingParams(temperature=1.0, seed=1)
    a = chained.propose([DraftSeqInput(1, 0, [3], 6, s, first=True), DraftSeqInput(2, 0, [4], 6, s, first=True)])
    saved = [dense_weights(o.probs).clone() for o in a.outputs]
    chained.propose([DraftSeqInput(1, 0, [9], 6, SamplingParams(temperature=2.0, seed=2)),
                     DraftSeqInput(2, 0, [8], 6, SamplingParams(temperature=0.5, seed=3))])
    for o, w in zip(a.outputs, saved):
        assert torch.equal(dense_weights(o.probs), w)


def test_many_sampled_rows_device_sparse_path(draft_path, monkeypatch):
    """>= 16 sampled rows in one step (4 sequences x 6 drafts): the device-sparse copy of the
    chained rows; fp16 and bf16 (top-k rows are sparse, temperature rows dense)."""
    for dtype in (torch.float16, torch.bfloat16):
        seeds = _Seeds(monkeypatch)
        plain = _engine(draft_path, sampled=False, dtype=dtype)
        chained = _engine(draft_path, sampled=True, dtype=dtype)
        ran = _count_chains(chained)
        ps = [SamplingParams(temperature=0.9, top_k=5, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=0.7, top_k=3, seed=3), SamplingParams(temperature=1.0, min_p=0.3, seed=4)]
        step = [DraftSeqInput(i + 1, 0, [i + 3, 5], 6, ps[i], first=True) for i in range(4)]
        for i in range(3):
            seeds.reset(i)
            a = plain.propose(step)
            seeds.reset(i)
            b = chained.propose(step)
            _same_outputs(a, b)
            _same_state(plain, chained)
            step = [DraftSeqInput(s.seq_id, 2, [1], 6, s.sampling) for s in step]
        assert len(ran) == 3


@pytest.mark.parametrize("prompt,chained_rows", [(19, [(1, 1, 5)]), (20, [])])
def test_chain_at_the_end_of_the_graph_tables(draft_path, monkeypatch, prompt, chained_rows):
    """Graphs of 24 tokens (6 blocks of 4), max_model_len 26: a prompt of 19 with 6 drafts ends its
    KV on the tables' last slot (the chain runs; its last advance clamps the block index), one of
    20 would cross it (no chain: positions run one by one, the last ones eagerly). The next step
    is refused at max_model_len by both engines."""
    seeds = _Seeds(monkeypatch)
    kw = dict(graph_len=24, max_model_len=26)
    plain, chained = _engine(draft_path, sampled=False, **kw), _engine(draft_path, sampled=True, **kw)
    ran = _count_chains(chained)
    free0 = plain.num_free_blocks
    s = SamplingParams(temperature=1.0, top_k=50, seed=9)
    steps = [[DraftSeqInput(1, 0, list(range(10, 10 + prompt)), 6, s, first=True)],
             [DraftSeqInput(1, 6, [5], 6, s)],     # 19 + 6 + 1 + 6 > 26: refused
             [DraftSeqInput(1, 0, [5], 6, s)]]     # prompt + 1 + 6 <= 26 only for 19
    for i, step in enumerate(steps):
        outs = _step_all((plain, chained), seeds, i, step)
    assert outs[0].outputs[0].error is None if prompt == 19 else outs[0].outputs[0].error is not None
    assert ran[:1] == chained_rows
    for e in (plain, chained):
        e.release([1])
        assert e.num_free_blocks == free0


@pytest.mark.parametrize("kmax", [17, 18])
def test_chain_max_boundary(draft_path, monkeypatch, kmax):
    """num_draft 17: a chain of CHAIN_MAX (16) steps, up to the sampler's last row; 18: 17 steps
    do not fit a chain: one more position alone, then a chain of 16 from row 2. Both as the plain
    engine drafts."""
    seeds = _Seeds(monkeypatch)
    kw = dict(max_num_draft=kmax)
    plain, chained = _engine(draft_path, sampled=False, **kw), _engine(draft_path, sampled=True, **kw)
    ran = _count_chains(chained)
    ps = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.6, top_p=0.9)]
    step = [DraftSeqInput(i + 1, 0, [4, i + 5], kmax, ps[i], first=True) for i in range(2)]
    for i in range(2):
        _step_all((plain, chained), seeds, i, step)
        step = [DraftSeqInput(x.seq_id, 3, [2], kmax, x.sampling) for x in step]
    assert ran == ([(2, 1, 16)] * 2 if kmax == 17 else [(2, 2, 16)] * 2)


@pytest.mark.parametrize("seed,dtype", [(31, torch.float16), (32, torch.bfloat16)], ids=str)
def test_fuzz_on_the_real_chain_captures(draft_path, monkeypatch, seed, dtype):
    """GraphedForward's own _capture / _capture_chain / capture_sampled_chains (WarmGraphs: the
    warm-up runs execute, as on CUDA, advancing the static inputs and the chains' `at` before any
    step) instead of the stand-in's: the same contract."""
    _, chained, ran = _fuzz(draft_path, seed, 40, monkeypatch, graphs_cls=WarmGraphs, kmax=4, bmax=5, dtype=dtype)
    assert ran and chained.runner.graphs.sampled_chains


def test_max_num_draft_1_with_sampled_chains_starts_and_drafts(draft_path, monkeypatch):
    """An engine with max_num_draft 1 and sampled chains captures (a chain can never run: a step
    has no position after its first) and drafts what the plain engine drafts. Found by this review:
    the capture's two warm-up runs advanced the chain's row counter past the sampler's single
    output row (an IndexError here, an out-of-range device index on CUDA); GraphCaptures._record
    now resets it after each warm-up run."""
    seeds = _Seeds(monkeypatch)
    plain = _engine(draft_path, sampled=False, max_num_draft=1, graphs_cls=WarmGraphs)
    chained = _engine(draft_path, sampled=True, max_num_draft=1, graphs_cls=WarmGraphs, check=False)
    step = [DraftSeqInput(1, 0, [3, 4], 1, SamplingParams(temperature=1.0, seed=1), first=True)]
    outs = []
    for e in (plain, chained):
        seeds.reset(0)
        outs.append(e.propose(step))
    _same_outputs(*outs)
