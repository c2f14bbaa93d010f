"""The engines on CUDA (Triton attention, CUDA-event timing): greedy speculation stays exact."""
from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.sampling.transport import dense_weights
from specdec.engine import DraftEngine, TargetEngine
from specdec.engine.types import DraftSeqInput, VerifySeqInput
from tests.helpers.tiny_models import make_pair
from tests.unit.test_engines import PROMPTS, plain_greedy, speculative

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculation_on_cuda(tmp_path, dtype):
    target_path, draft_path = make_pair(tmp_path)

    def config(path):
        return EngineConfig(model=path, device="cuda", dtype=dtype, num_blocks=256, block_size=16,
                            warmup_batch_sizes=(1, 2, 4))

    draft, target = DraftEngine(config(draft_path)), TargetEngine(config(target_path))
    for engine in (draft, target):
        assert all(t > 0 for t in engine.warm_up().values())
    reference = plain_greedy(target, PROMPTS, 16)
    got, drafted, accepted = speculative(draft, target, PROMPTS, [4, 2, 0, 5], 16)
    if dtype == torch.float32:
        assert got == reference  # bf16 may flip near-ties between a k+1 verify and 1-token steps
    assert 0 < accepted <= drafted
    assert draft.num_free_blocks == target.num_free_blocks == 256


def _syncs(fn):
    """(fn's result, the synchronising CUDA calls it made) under torch's sync debug mode."""
    import warnings
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return result, [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_steps_sync_only_for_their_results(tmp_path, temperature):
    """Issue #7: no host synchronisation inside a step. A draft proposal of 4 tokens (graph
    replays, device-fed tokens) and a verify of them each synchronise only where their results
    come to the host: the drafted tokens (and, sampled, their probabilities), the verify outcome."""
    from specdec.sampling.params import SamplingParams
    target_path, draft_path = make_pair(tmp_path)
    sampling = SamplingParams(temperature=temperature, seed=3) if temperature else SamplingParams()

    def config(path):
        return EngineConfig(model=path, device="cuda", dtype=torch.bfloat16, num_blocks=256,
                            block_size=16, warmup_batch_sizes=(1, 2, 4))

    draft, target = DraftEngine(config(draft_path)), TargetEngine(config(target_path))
    for engine in (draft, target):
        engine.warm_up()
    ids, prompts = [7, 8], [list(p) for p in PROMPTS[:2]]
    # Prefill and a first step outside the count: they may compile kernels and build caches.
    prop = draft.propose([DraftSeqInput(i, 0, p, 4, sampling, first=True) for i, p in zip(ids, prompts)])
    ver = target.verify([VerifySeqInput(i, p, o.tokens, o.probs, sampling, first=True)
                         for i, p, o in zip(ids, prompts, prop.outputs)])
    keep = [v.accepted for v in ver.outputs]
    nxt = [[v.next_token] for v in ver.outputs]
    prop, draft_syncs = _syncs(lambda: draft.propose(
        [DraftSeqInput(i, k, n, 4, sampling) for i, k, n in zip(ids, keep, nxt)]))
    ver, target_syncs = _syncs(lambda: target.verify(
        [VerifySeqInput(i, n, o.tokens, o.probs, sampling) for i, n, o in zip(ids, nxt, prop.outputs)]))
    assert all(len(o.tokens) == 4 for o in prop.outputs) and all(v.error is None for v in ver.outputs)
    # Allowed: the results' copies to the host (draft tokens, sampled probabilities; the verify
    # outcome) and the step clock's event wait right after them, which may count as a sync but
    # waits for nothing; a sync per drafted position (4 here) would exceed these.
    assert len(draft_syncs) <= (3 if temperature else 2), draft_syncs
    assert len(target_syncs) <= 2, target_syncs


def test_gemv_kernels_default_on_and_the_switch_off(tmp_path):
    target_path, _ = make_pair(tmp_path)
    for flag, want in ((None, True), (False, False)):
        engine = TargetEngine(EngineConfig(model=target_path, device="cuda", dtype=torch.bfloat16,
                                           num_blocks=64, cuda_graphs=False, gemv_kernels=flag))
        assert engine.runner.model.gemv_kernels is want


def test_cuda_engines_set_the_blas_library_before_their_graphs(tmp_path):
    """kernels/blas.py: the library of EngineConfig.blas (blas.DEFAULT when None) is torch's
    after the engine is made; a 40-row product (a batch-8 verify's, past the GEMV's rows) is
    right on both."""
    from specdec.kernels import blas
    target_path, _ = make_pair(tmp_path)
    before = blas.current()
    try:
        out = {}
        for flag, want in (("cublaslt", "cublaslt"), (None, blas.DEFAULT), ("cublas", "cublas")):
            engine = TargetEngine(EngineConfig(model=target_path, device="cuda", dtype=torch.bfloat16,
                                               num_blocks=64, warmup_batch_sizes=(1,), blas=flag))
            assert blas.current() == want
            x = torch.randn(40, engine.model_config.hidden_size, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(0))
            out[want] = torch.nn.functional.linear(x, x[:24])
        ref = torch.nn.functional.linear(*(t.double() for t in (x, x[:24])))
        for got in out.values():
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def test_info_names_the_gpu(tmp_path):
    """Info's device_uuids: what the coordinator's --pipeline auto compares (a GPU's UUID, the
    same for every process and container that uses it, and different for another GPU)."""
    from specdec.engine.base import device_uuids
    target_path, _ = make_pair(tmp_path)
    engine = TargetEngine(EngineConfig(model=target_path, device="cuda", num_blocks=16, block_size=16,
                                       warmup_batch_sizes=(1,)))
    uuids = engine.info().device_uuids
    assert len(uuids) == 1 and uuids[0] and uuids == device_uuids(torch.device("cuda", 0))
    if torch.cuda.device_count() > 1:
        assert device_uuids(torch.device("cuda", 1)) != uuids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_drafts_on_sampler_graphs_equal_eager_sampling(tmp_path, dtype):
    """The draft's sampler graphs (sampling/graphs.py) against the same engine sampling op by op:
    sampled and greedy rows mixed, top-k / top-p / min-p, ragged num_draft, an extension (its first
    token a guess) and a batch above the largest bucket (eager fallback): the same tokens and the
    same transport-dtype distributions, bit for bit; the graphs served the positions that fit.
    Sampled chains are off here, so every position is one sampler replay (chains against this
    position-by-position path: test_sampled_chains_draft_what_position_by_position_sampling_drafts)."""
    from specdec.sampling.params import SamplingParams
    _, draft_path = make_pair(tmp_path)
    engines = [DraftEngine(EngineConfig(model=draft_path, device="cuda", dtype=dtype, num_blocks=256,
                                        block_size=16, warmup_batch_sizes=(1,), graph_batch_sizes=(1, 2, 4),
                                        max_num_draft=8, sampler_graphs=on, sampled_chains=False))
               for on in (False, True)]
    assert engines[0].sampler is None and engines[1].sampler is not None
    rows = [SamplingParams(temperature=0.9, top_k=20, seed=7), SamplingParams(temperature=1.1, seed=8),
            SamplingParams(), SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=9)]

    def run(e):
        out = e.propose([DraftSeqInput(i, 0, list(PROMPTS[i]), k, rows[i], first=True)
                         for i, k in enumerate([4, 2, 3, 4])]).outputs
        out += e.propose([DraftSeqInput(0, 2, [], 3, rows[0], extend=True),
                          DraftSeqInput(1, 1, [44], 2, rows[1]),
                          DraftSeqInput(3, 4, [], 5, rows[3], extend=True)]).outputs
        out += e.propose([DraftSeqInput(10 + i, 0, [i + 1, 2, 3], 3, rows[i % 4], first=True)
                          for i in range(6)]).outputs
        return out

    eager, graphed = run(engines[0]), run(engines[1])
    assert engines[1].sampler.replays >= 4 + 5
    for a, b in zip(eager, graphed):
        assert a.error is None and b.error is None and a.tokens == b.tokens
        assert (a.probs is None) == (b.probs is None)
        if a.probs is not None:
            assert torch.equal(dense_weights(a.probs), dense_weights(b.probs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_chains_draft_what_position_by_position_sampling_drafts(tmp_path, dtype):
    """Sampled chains (config.sampled_chains: the positions after a sampled step's first as one
    chain of graph replays drawing with the sampler's fused kernel) against the same engine
    sampling each position on its sampler graph: uniform steps (chained), a ragged one (not), an
    extension (chained from its second token), a greedy row among sampled ones: the same tokens
    and distributions bit for bit; the chains ran."""
    from specdec.sampling.params import SamplingParams
    _, draft_path = make_pair(tmp_path)
    engines = [DraftEngine(EngineConfig(model=draft_path, device="cuda", dtype=dtype, num_blocks=256,
                                        block_size=16, warmup_batch_sizes=(1,), graph_batch_sizes=(1, 2, 4),
                                        max_num_draft=8, sampled_chains=on)) for on in (False, True)]
    assert not engines[0].runner.graphs.sampled_chains and set(engines[1].runner.graphs.sampled_chains) == {1, 2, 4}
    rows = [SamplingParams(temperature=0.9, top_k=20, seed=7), SamplingParams(temperature=1.1, seed=8),
            SamplingParams(), SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=9)]

    def run(e):
        out = e.propose([DraftSeqInput(i, 0, list(PROMPTS[i]), 4, rows[i], first=True) for i in range(4)]).outputs
        out += e.propose([DraftSeqInput(i, 2, [44 + i], 4, rows[i]) for i in range(4)]).outputs
        out += e.propose([DraftSeqInput(0, 1, [], 3, rows[0], extend=True), DraftSeqInput(1, 0, [7], 5, rows[1])]).outputs
        out += e.propose([DraftSeqInput(2, 1, [9], 6, rows[2]), DraftSeqInput(3, 0, [5], 6, rows[3])]).outputs
        return out

    before = engines[1].sampler.replays
    plain, chained = run(engines[0]), run(engines[1])
    # 4 steps: chained ones replay the sampler graph for their first position only
    assert engines[1].sampler.replays - before < engines[0].sampler.replays
    for a, b in zip(plain, chained):
        assert a.error is None and b.error is None and a.tokens == b.tokens
        assert (a.probs is None) == (b.probs is None)
        if a.probs is not None:
            assert torch.equal(dense_weights(a.probs), dense_weights(b.probs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_verifies_on_graphs_equal_eager_rejection(tmp_path, dtype):
    """The target's rejection graphs (sampling/graphs.GraphedVerifier) against the same engine
    sampling op by op: sampled and greedy sequences, ragged draft counts (0 included), four steps
    of the same drafts and probabilities: the same verdicts; the graphs served every step."""
    from specdec.sampling.params import SamplingParams
    from tests.unit.test_sampler_graphs import verify_alike
    target_path, _ = make_pair(tmp_path)
    targets = [TargetEngine(EngineConfig(model=target_path, device="cuda", dtype=dtype, num_blocks=256,
                                         block_size=16, warmup_batch_sizes=(1,), graph_batch_sizes=(1, 2, 4),
                                         max_num_draft=6, sampler_graphs=on)) for on in (False, True)]
    assert targets[0].verifier is None and targets[1].verifier is not None
    verify_alike(targets, [SamplingParams(temperature=0.9, top_k=30, seed=7), SamplingParams(),
                           SamplingParams(temperature=1.2, top_p=0.9, seed=8)], PROMPTS[:3])
    assert targets[1].verifier.replays == 4


def test_warm_up_times_graph_replays_alone_beside_whole_steps(tmp_path):
    """The replay profile (device time of the single-token graph, no host work) is logged beside the
    decode profile (a whole step's wall time) for every warm-up batch size with a graph, and is
    shorter than it."""
    target_path, _ = make_pair(tmp_path)
    engine = TargetEngine(EngineConfig(model=target_path, device="cuda", dtype=torch.bfloat16, num_blocks=128,
                                       block_size=16, warmup_batch_sizes=(1, 2, 4), graph_batch_sizes=(1, 2, 4)))
    profile = engine.warm_up()
    assert set(engine.replay_profile) == {1, 2, 4}
    for b, replay in engine.replay_profile.items():
        assert 0 < replay < profile[b], (b, replay, profile[b])
    assert engine.num_free_blocks == 128   # the staged sequences were freed with the rest


def test_graph_capture_writes_no_kv(tmp_path):
    """Capturing a draft's graphs (buckets, greedy chains, heads, then the sampled chains on the
    same static inputs) writes no KV: every capture's warm-up runs must see padding (slot -1). The
    session 21 review found the sampled chains' warm-ups writing block 0 after the heads' capture,
    on the CPU stand-in (fixed in d2f19aa); this is the same check on real captures."""
    _, draft_path = make_pair(tmp_path)
    engine = DraftEngine(EngineConfig(model=draft_path, device="cuda", num_blocks=64, block_size=16))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.heads and graphs.sampled_chains
    torch.cuda.synchronize()
    assert not engine.runner.kv.data.any()
