"""DraftEngine + TargetEngine on tiny CPU models: greedy speculation is exact, KV is accounted for,
per-sequence errors stay per sequence."""
from __future__ import annotations

import logging

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import (Code, DraftEngine, DraftSeqInput, TargetEngine, VerifySeqInput)
from specdec.sampling.params import SamplingParams
from specdec.sampling.transport import dense_weights
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: this module runs single-threaded)
from tests.helpers.tiny_models import make_pair

PROMPTS = [[5, 17, 42, 99, 7], [300, 2, 2, 2, 8, 64, 10, 11, 12], [1], [250, 251, 252]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


def engine_config(path, **kw) -> EngineConfig:
    kw.setdefault("num_blocks", 96)
    return EngineConfig(model=path, block_size=4, warmup_batch_sizes=(1, 2), **kw)


@pytest.fixture(scope="module")
def engines(pair):
    target_path, draft_path = pair
    return DraftEngine(engine_config(draft_path)), TargetEngine(engine_config(target_path))


def plain_greedy(target: TargetEngine, prompts, n_new: int, first_id: int = 1000) -> list[list[int]]:
    ids = [first_id + i for i in range(len(prompts))]
    pending = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    for step in range(n_new):
        res = target.verify([VerifySeqInput(sid, pend, first=step == 0)
                             for sid, pend in zip(ids, pending)]).outputs
        for i, r in enumerate(res):
            assert r.error is None and r.accepted == 0
            out[i].append(r.next_token)
            pending[i] = [r.next_token]
    target.release(ids)
    return out


def speculative(draft: DraftEngine, target: TargetEngine, prompts, ks, n_new: int,
                sampling=SamplingParams(), first_id: int = 2000) -> tuple[list[list[int]], int, int]:
    """A minimal coordinator: per step one batched propose and one batched verify."""
    ids = [first_id + i for i in range(len(prompts))]
    d_new = [list(p) for p in prompts]
    t_new = [list(p) for p in prompts]
    keep = [0] * len(prompts)
    out = [[] for _ in prompts]
    drafted_total = accepted_total = 0
    while any(len(o) < n_new for o in out):
        live = [i for i in range(len(prompts)) if len(out[i]) < n_new]
        prop = draft.propose([DraftSeqInput(ids[i], keep[i], d_new[i], ks[i], sampling, first=not out[i])
                              for i in live])
        assert prop.timing.num_forwards == max(1, *(ks[i] for i in live))  # k=0 still appends
        seqs = []
        for i, d in zip(live, prop.outputs):
            assert d.error is None and len(d.tokens) == ks[i]
            seqs.append(VerifySeqInput(ids[i], t_new[i], d.tokens, d.probs, sampling, first=not out[i]))
        ver = target.verify(seqs)
        assert ver.timing.num_forwards == 1
        for i, s, v in zip(live, seqs, ver.outputs):
            assert v.error is None and 0 <= v.accepted <= len(s.draft_tokens)
            out[i] += list(s.draft_tokens[:v.accepted]) + [v.next_token]
            keep[i], d_new[i], t_new[i] = v.accepted, [v.next_token], [v.next_token]
            drafted_total += len(s.draft_tokens)
            accepted_total += v.accepted
        done = [ids[i] for i in live if len(out[i]) >= n_new]
        draft.release(done)
        target.release(done)
    return [o[:n_new] for o in out], drafted_total, accepted_total


@pytest.mark.parametrize("ks", [[1, 1, 1, 1], [3, 3, 3, 3], [4, 2, 0, 5]])
def test_greedy_speculation_equals_target_greedy(engines, ks):
    draft, target = engines
    reference = plain_greedy(target, PROMPTS, 12)
    got, drafted, accepted = speculative(draft, target, PROMPTS, ks, 12)
    assert got == reference
    assert 0 < accepted < drafted  # the noisy draft agrees often, not always: both paths exercised
    for engine in engines:
        assert engine.num_free_blocks == engine.runner.blocks.num_blocks
        assert engine.num_sequences() == 0


def test_draft_catches_up_after_all_accepted(engines):
    # keep == k: the last drafted token was never fed; the next step must feed it before new_tokens.
    draft, _ = engines
    first = draft.propose([DraftSeqInput(1, 0, [3, 4, 5], 3, first=True)]).outputs[0]
    assert draft.runner.num_tokens(1) == 3 + 2
    nxt = draft.propose([DraftSeqInput(1, 3, [9], 2)]).outputs[0]
    assert draft.runner.num_tokens(1) == 3 + 3 + 1 + 1
    assert draft.states[1].tokens == [3, 4, 5] + first.tokens + [9] + nxt.tokens
    # A fresh sequence with the same history drafts the same tokens.
    fresh = draft.propose([DraftSeqInput(2, 0, [3, 4, 5] + first.tokens + [9], 2, first=True)]).outputs[0]
    assert fresh.tokens == nxt.tokens
    draft.release([1, 2])
    assert draft.num_free_blocks == draft.runner.blocks.num_blocks


def test_extend_drafts_after_the_unconfirmed_proposal(engines, monkeypatch):
    # Pipelined speculation: while the target verifies d, the draft drafts after it (extend); the
    # next keep counts from d's first token, so a rejection inside d drops the extension as well.
    draft, _ = engines
    prompt = [3, 4, 5, 6]
    d = draft.propose([DraftSeqInput(1, 0, prompt, 3, first=True)]).outputs[0].tokens
    truncated = []
    real_truncate = draft.runner.truncate
    monkeypatch.setattr(draft.runner, "truncate", lambda sid, n: (truncated.append(n), real_truncate(sid, n)))
    e = draft.propose([DraftSeqInput(1, 0, [], 3, extend=True)]).outputs[0].tokens
    assert truncated == [len(prompt) + 2]  # the KV keeps d's fed drafts: only d[-1] is fed
    assert draft.states[1].tokens == prompt + d + e and draft.states[1].base == len(prompt)
    fresh = draft.propose([DraftSeqInput(2, 0, prompt + d, 3, first=True)]).outputs[0].tokens
    assert e == fresh
    # Two of d accepted, then the target's 9: back inside the first proposal.
    miss = draft.propose([DraftSeqInput(1, 2, [9], 2)]).outputs[0].tokens
    assert draft.runner.num_tokens(1) == len(prompt) + 2 + 1 + 1
    fresh = draft.propose([DraftSeqInput(3, 0, prompt + d[:2] + [9], 2, first=True)]).outputs[0].tokens
    assert miss == fresh
    # An extension that confirms part of the proposal moves the base past it.
    f = draft.propose([DraftSeqInput(1, 1, [], 2, extend=True)]).outputs[0].tokens
    assert draft.states[1].tokens == prompt + d[:2] + [9] + miss + f
    assert draft.states[1].base == len(prompt) + 3 + 1
    bad = draft.propose([DraftSeqInput(1, 0, [7], 2, extend=True)]).outputs[0]
    assert bad.error is not None and bad.error.code == Code.INVALID_ARGUMENT and "extend" in bad.error.message
    assert draft.states[1].tokens == prompt + d[:2] + [9] + miss + f  # a refused step changes nothing
    draft.release([1, 2, 3])
    assert draft.num_free_blocks == draft.runner.blocks.num_blocks


@pytest.mark.parametrize("k", [1, 3])
def test_pipelined_speculation_equals_target_greedy(engines, k):
    """The coordinator's --pipeline bookkeeping on the engines: each step's verify runs beside an
    extend of the draft's proposal (a guess of the target's next token + k drafts); a step whose
    drafts were all accepted and whose guess was right verifies the extension, with no propose."""
    draft, target = engines
    n_new = 14
    reference = plain_greedy(target, PROMPTS, n_new)
    ids = [3000 + i for i in range(len(PROMPTS))]
    out = [[] for _ in PROMPTS]
    t_new = [list(p) for p in PROMPTS]
    prop = [[] for _ in PROMPTS]       # the draft's proposal: drafted, not yet confirmed
    keep = [0] * len(PROMPTS)          # of it, confirmed since
    pending = [list(p) for p in PROMPTS]  # confirmed tokens the draft has not seen
    hits = steps = 0
    while any(len(o) < n_new for o in out):
        live = [i for i in range(len(PROMPTS)) if len(out[i]) < n_new]
        drafts = {}
        normal = []
        for i in live:
            ahead = [] if pending[i] else prop[i][keep[i]:]
            if ahead:
                drafts[i] = ahead[:k]
                hits += 1
            else:
                normal.append(i)
        if normal:
            res = draft.propose([DraftSeqInput(ids[i], keep[i], pending[i], k, first=not out[i])
                                 for i in normal]).outputs
            for i, r in zip(normal, res):
                assert r.error is None
                drafts[i], prop[i], keep[i], pending[i] = r.tokens, list(r.tokens), 0, []
        ver = target.verify([VerifySeqInput(ids[i], t_new[i], drafts[i], first=not out[i]) for i in live])
        ext = draft.propose([DraftSeqInput(ids[i], keep[i], [], k + 1, extend=True) for i in live])
        for i, r in zip(live, ext.outputs):
            assert r.error is None
            prop[i], keep[i] = prop[i][keep[i]:] + r.tokens, 0
        for i, v in zip(live, ver.outputs):
            assert v.error is None
            emitted = drafts[i][:v.accepted] + [v.next_token]
            out[i] += emitted
            t_new[i] = [v.next_token]
            for tok in emitted:  # Sequence.draft_confirm
                if not pending[i] and keep[i] < len(prop[i]) and prop[i][keep[i]] == tok:
                    keep[i] += 1
                else:
                    pending[i].append(tok)
        steps += len(live)
        done = [ids[i] for i in live if len(out[i]) >= n_new]
        draft.release(done)
        target.release(done)
    assert [o[:n_new] for o in out] == reference
    assert 0 < hits < steps  # both kinds of step ran
    for engine in engines:
        assert engine.num_free_blocks == engine.runner.blocks.num_blocks
        assert engine.num_sequences() == 0


def test_sampled_draft_returns_the_distributions_it_sampled(engines):
    draft, target = engines
    params = SamplingParams(temperature=0.8, top_k=50, seed=123)
    res = draft.propose([DraftSeqInput(7, 0, [5, 6, 7], 3, params, first=True),
                         DraftSeqInput(8, 0, [5], 2, first=True)])
    sampled, greedy = res.outputs
    assert sampled.probs.shape == (3, draft.vocab_size) and greedy.probs is None
    for tok, row in zip(sampled.tokens, dense_weights(sampled.probs)):
        assert row[tok] > 0 and (row > 0).sum() <= 50
    # Seeded: the same request drafts the same tokens whatever shares its batch.
    again = draft.propose([DraftSeqInput(9, 0, [5, 6, 7], 3, params, first=True)]).outputs[0]
    assert again.tokens == sampled.tokens and torch.equal(dense_weights(again.probs), dense_weights(sampled.probs))
    ver = target.verify([VerifySeqInput(7, [5, 6, 7], sampled.tokens, sampled.probs, params,
                                        first=True)]).outputs[0]
    assert ver.error is None and 0 <= ver.accepted <= 3 and 0 <= ver.next_token < target.vocab_size
    assert target.runner.num_tokens(7) == 3 + ver.accepted
    draft.release([7, 8, 9])
    target.release([7])


def test_sparse_draft_probs_verify_as_dense_ones(engines):
    """The target's sparse path (SparseWeights as the wire carried them, scattered on the device)
    against the dense rows: the same verdicts, in a batch mixing sparse, dense and greedy drafts."""
    from specdec.sampling.transport import SparseWeights, decode_probs, encode_probs
    draft, target = engines
    outs = draft.propose([DraftSeqInput(20 + i, 0, [5 + i, 6, 7], 3, SamplingParams(temperature=0.9, top_k=20, seed=i),
                                        first=True) for i in range(3)]).outputs
    greedy = draft.propose([DraftSeqInput(23, 0, [4, 4], 2, first=True)]).outputs[0]

    def sparse(q):
        e = encode_probs(q, sparse=True)
        return decode_probs(e.values, e.rows, e.vocab_size, e.encoding, e.indices, e.row_lengths,
                            dtype=None, keep_sparse=True)

    results = []
    for make in (lambda i, q: dense_weights(q), lambda i, q: sparse(q) if i != 1 else dense_weights(q)):
        seqs = [VerifySeqInput(30 + i, [5 + i, 6, 7], o.tokens, make(i, o.probs),
                               SamplingParams(temperature=0.9, top_k=20, seed=40 + i), first=True)
                for i, o in enumerate(outs)]
        seqs.append(VerifySeqInput(33, [4, 4], greedy.tokens, None, SamplingParams(), first=True))
        assert sum(isinstance(s.draft_probs, SparseWeights) for s in seqs) in (0, 2)
        results.append([(o.error, o.accepted, o.next_token) for o in target.verify(seqs).outputs])
        target.release([30, 31, 32, 33])
    assert results[0] == results[1] and all(e is None for e, _, _ in results[0])
    draft.release([20, 21, 22, 23])


def test_bad_sequences_fail_alone(engines):
    draft, target = engines
    v = target.vocab_size
    res = target.verify([
        VerifySeqInput(11, [1, 2, 3], [4, 5], first=True),
        VerifySeqInput(12, [1, v], first=True),                         # token outside the vocabulary
        VerifySeqInput(13, [], [4], first=True),                        # nothing to score the draft with
        VerifySeqInput(14, [1] * target.max_model_len, first=True),     # no room for the emitted token
        VerifySeqInput(15, [1, 2], [3], None, SamplingParams(temperature=1.0, seed=1),
                       first=True),                                     # no draft_probs
        VerifySeqInput(11, [6], first=True),                            # seq_id twice
        VerifySeqInput(16, [1, 2], [3], partial_prefill=True, first=True),
    ]).outputs
    assert res[0].error is None and res[0].next_token >= 0
    assert [r.error.code for r in res[1:]] == [Code.INVALID_ARGUMENT] * 6
    assert "new_tokens" in res[1].error.message and "draft_probs" in res[4].error.message
    assert set(target.runner.blocks.seq_ids()) == {11}  # failed new sequences hold nothing
    res = draft.propose([
        DraftSeqInput(21, 0, [1, 2], 2, first=True),
        DraftSeqInput(22, 0, [1], draft.config.max_num_draft + 1, first=True),
        DraftSeqInput(23, 0, [], 1, first=True),
    ]).outputs
    assert res[0].error is None and len(res[0].tokens) == 2
    assert "num_draft" in res[1].error.message and "new_tokens" in res[2].error.message
    bad_keep = draft.propose([DraftSeqInput(21, 3, [1], 1)]).outputs[0]
    assert bad_keep.error.code == Code.INVALID_ARGUMENT and "keep" in bad_keep.error.message
    ok = draft.propose([DraftSeqInput(21, 2, [1], 1)]).outputs[0]   # state survived the bad step
    assert ok.error is None and draft.states[21].tokens[:5] == [1, 2, *res[0].tokens, 1]
    assert target.release([11]) == 1 and draft.release([21, 22, 23]) == 1
    for engine in engines:
        assert engine.num_free_blocks == engine.runner.blocks.num_blocks


def test_out_of_blocks_is_resource_exhausted_and_leaks_nothing(pair):
    target_path, draft_path = pair
    target = TargetEngine(engine_config(target_path, num_blocks=4))   # 16 token slots
    draft = DraftEngine(engine_config(draft_path, num_blocks=4))
    res = target.verify([VerifySeqInput(1, [1] * 7, first=True), VerifySeqInput(2, [2] * 10, first=True),
                         VerifySeqInput(3, [3] * 4, first=True)]).outputs
    assert res[0].error is None and res[2].error is None
    assert res[1].error.code == Code.RESOURCE_EXHAUSTED and "kv cache" in res[1].error.message
    assert set(target.runner.blocks.seq_ids()) == {1, 3}
    res = draft.propose([DraftSeqInput(1, 0, [1] * 6, 3, first=True),
                         DraftSeqInput(2, 0, [2] * 8, 2, first=True)]).outputs
    assert res[0].error is None and res[1].error.code == Code.RESOURCE_EXHAUSTED
    target.release([1, 2, 3])
    draft.release([1, 2])
    assert target.num_free_blocks == 4 and draft.num_free_blocks == 4


def test_info_and_profile(engines, pair):
    draft, target = engines
    table = target.warm_up()
    assert {1, 2} <= set(table) and all(t > 0 for t in table.values())
    info = target.info()
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size == 320
    assert info.kv_blocks_total == info.kv_blocks_free == 96 and info.block_size == 4
    assert len(info.tokenizer_fingerprint) == 64
    assert info.tokenizer_fingerprint == draft.info().tokenizer_fingerprint
    assert info.dtype == "float32" and info.device == "cpu" and info.eos_token_ids == (0,)
    timing = target.verify([VerifySeqInput(5, [1, 2, 3], first=True)]).timing
    assert timing.forward_seconds > 0 and timing.decode_forward_seconds == target.profile(1)
    target.release([5])


def test_warm_up_prefills_fit_the_limits_and_free_their_kv(pair, caplog):
    target = TargetEngine(engine_config(pair[0], max_model_len=64, num_blocks=24))  # 4-token blocks
    with caplog.at_level(logging.INFO, logger="specdec.engine"):
        table = target.warm_up(repeats=1)
        assert "0 prefill forwards (batch x prompt length: none)" in caplog.text  # CPU default
        target.warm_up(repeats=1, prompt_lens=(3, 40, 10_000))
    # 10_000 is capped to max_model_len 64 (16 blocks): batch 2 would need 32 of the 24 blocks.
    assert "5 prefill forwards (batch x prompt length: 1x3, 2x3, 1x40, 2x40, 1x64)" in caplog.text
    assert set(table) == {1, 2} and target.num_sequences() == 0
    assert target.num_free_blocks == target.runner.blocks.num_blocks == 24


def test_chunked_prefill_matches_whole_prompt(engines):
    _, target = engines
    prompt = PROMPTS[1]
    whole = target.verify([VerifySeqInput(31, prompt, first=True)]).outputs[0]
    first = target.verify([VerifySeqInput(32, prompt[:4], partial_prefill=True, first=True)]).outputs[0]
    assert first.error is None and first.next_token == -1 and target.runner.num_tokens(32) == 4
    last = target.verify([VerifySeqInput(32, prompt[4:])]).outputs[0]
    assert last.next_token == whole.next_token and target.runner.num_tokens(32) == len(prompt)
    target.release([31, 32])


def test_sampled_speculation_keeps_the_target_distribution(tmp_path):
    # The first emitted token (accepted draft or correction) must follow the target's p exactly,
    # with a draft far enough from the target that both acceptances and corrections are common.
    from scipy.stats import chisquare
    from specdec.runner import SeqInput
    from specdec.sampling.probs import SamplingTensors, logits_to_probs

    target_path, draft_path = make_pair(tmp_path, noise=0.02)  # ~30% accepted
    draft, target = DraftEngine(engine_config(draft_path)), TargetEngine(engine_config(target_path))
    prompt = [7, 8, 9]
    params = SamplingParams(temperature=1.5, top_k=6, seed=0)
    target.runner.add_sequence("p")
    logits = target.runner.step([SeqInput("p", prompt)])[0]
    target.runner.free("p")
    p = logits_to_probs(logits, SamplingTensors.from_params([params]))[0].double()
    counts = torch.zeros_like(p)
    n, batch, accepted = 600, 40, 0
    for start in range(0, n, batch):
        seqs = [SamplingParams(temperature=1.5, top_k=6, seed=start + i) for i in range(batch)]
        sids = [5000 + start + i for i in range(batch)]
        prop = draft.propose([DraftSeqInput(s, 0, prompt, 2, sp, first=True)
                              for s, sp in zip(sids, seqs)]).outputs
        ver = target.verify([VerifySeqInput(s, prompt, d.tokens, d.probs, sp, first=True)
                             for s, d, sp in zip(sids, prop, seqs)]).outputs
        for d, v in zip(prop, ver):
            counts[d.tokens[0] if v.accepted else v.next_token] += 1
            accepted += v.accepted > 0
        draft.release(sids)
        target.release(sids)
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (p[support] * n).numpy()).pvalue > 1e-3
    assert 0.1 * n < accepted < 0.9 * n  # the correction path carried a good part of the samples


def test_pipelined_sampled_speculation_keeps_the_target_distribution(tmp_path):
    """Sampled pipelining on the engines: beside the verify of d1, an extension drafts a guess g of
    the target's next token (drawn with the target's own uniform for that position) and e after
    it. When d1 is accepted and the target's token is g, the next step verifies e with its row.
    The token that step emits must follow the target's p given its prefix; a prefix is counted
    only where it is the commonest one, so every count has one distribution to match."""
    from collections import Counter, defaultdict

    from scipy.stats import chisquare
    from specdec.runner import SeqInput
    from specdec.sampling.probs import SamplingTensors, logits_to_probs

    target_path, draft_path = make_pair(tmp_path, noise=0.01)
    draft = DraftEngine(engine_config(draft_path, num_blocks=256))
    target = TargetEngine(engine_config(target_path, num_blocks=256))
    prompt = [7, 8, 9]

    def params(seed):
        return SamplingParams(temperature=1.5, top_k=3, seed=seed)
    emitted = defaultdict(list)   # prefix (d1, g) -> tokens emitted after it on the pipelined path
    guesses = hits = 0
    n, batch = 1800, 60
    for start in range(0, n, batch):
        sids = [9000 + start + i for i in range(batch)]
        sps = [params(start + i) for i in range(batch)]
        prop = draft.propose([DraftSeqInput(s, 0, prompt, 1, sp, first=True) for s, sp in zip(sids, sps)]).outputs
        ver = target.verify([VerifySeqInput(s, prompt, d.tokens, d.probs, sp, first=True)
                             for s, d, sp in zip(sids, prop, sps)]).outputs
        ext = draft.propose([DraftSeqInput(s, 0, [], 2, sp, extend=True) for s, sp in zip(sids, sps)]).outputs
        nxt = []
        for s, sp, d, v, x in zip(sids, sps, prop, ver, ext):
            assert v.error is None and x.error is None and x.probs.shape[0] == 2
            if v.accepted == 1:
                guesses += 1
                if v.next_token == x.tokens[0]:  # the guess was right: verify e without a propose
                    nxt.append((s, sp, d.tokens[0], x))
        if nxt:
            out = target.verify([VerifySeqInput(s, [x.tokens[0]], x.tokens[1:], dense_weights(x.probs)[1:], sp)
                                 for s, sp, _, x in nxt]).outputs
            for (s, sp, d1, x), v in zip(nxt, out):
                assert v.error is None
                emitted[(d1, x.tokens[0])].append(x.tokens[1] if v.accepted else v.next_token)
            hits += len(nxt)
        draft.release(sids)
        target.release(sids)
    prefix, tokens = max(emitted.items(), key=lambda kv: len(kv[1]))
    assert len(tokens) > 150
    target.runner.add_sequence("ref")
    logits = target.runner.step([SeqInput("ref", prompt + list(prefix))])[0]
    target.runner.free("ref")
    p = logits_to_probs(logits, SamplingTensors.from_params([params(0)]))[0].double()
    counts = torch.zeros_like(p)
    for tok, c in Counter(tokens).items():
        counts[tok] = c
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support] / p[support].sum() * len(tokens)
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


def test_warm_up_replay_profile_path_with_a_stand_in_graph(pair, monkeypatch):
    """The replay profile's code path on the CPU (CUDA graphs and events stood in for): each warm-up
    batch size with a staged graph gets the median of its replays' event times, the staged
    sequences are freed, and a batch without a graph (graph_key None) gets none."""
    import dataclasses
    import types
    target_path, _ = pair
    engine = TargetEngine(engine_config(target_path))
    replays = []

    class Graph:
        def replay(self):
            replays.append(1)

    class Event:
        clock = [0.0]

        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            Event.clock[0] += 1.0 + len(replays)   # ms: later replays take longer
            self.t = Event.clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    prepare = engine.runner.prepare

    def staged(items, graphs=True):
        batch = prepare(items, graphs=False)
        return dataclasses.replace(batch, graph_key=None if len(items) == 2 else (len(items), 1, 0))
    monkeypatch.setattr(engine.runner, "prepare", staged)
    monkeypatch.setattr(engine.runner, "graphs", types.SimpleNamespace(
        staged_graph=lambda b: types.SimpleNamespace(graph=Graph()), replays=0))
    monkeypatch.setattr(engine.runner, "step", lambda items, graphs=True: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    free = engine.num_free_blocks
    engine.warm_up(repeats=3, prompt_lens=())
    # batch 1: replays 1..3 take 2, 3, 4 ms (the end event's step) -> median 3 ms; batch 2: no graph
    assert engine.replay_profile == {1: 0.003} and len(replays) == 3
    assert engine.num_free_blocks == free


def test_warm_up_without_a_block_for_the_replay_profile_skips_only_it(pair, monkeypatch):
    """Block size 4, 5 blocks: the timed steps of batch 1 fill them exactly (16 + 3 + 1 tokens), so
    the replay profile's staged token finds no block: it is left out, the decode profile is not,
    and nothing leaks."""
    import types
    target_path, _ = pair
    engine = TargetEngine(engine_config(target_path, num_blocks=5))
    monkeypatch.setattr(engine.runner, "graphs", types.SimpleNamespace(   # every step runs eagerly
        stage=lambda *a, **k: None, forward=lambda batch, argmax=False: None, replays=0,
        staged_graph=lambda b: pytest.fail("no batch should be staged")))
    table = engine.warm_up(repeats=3, prompt_lens=())
    assert set(table) == {1} and engine.replay_profile == {} and engine.num_free_blocks == 5


def test_draft_state_moves_in_place_and_a_failed_step_keeps_it(engines, monkeypatch):
    """A step rolls the held token list back and extends it in place (no copy of the context per
    step); a step whose drafting fails leaves the list as it was."""
    draft, _ = engines
    prompt = list(range(1, 40))
    d = draft.propose([DraftSeqInput(1, 0, prompt, 3, first=True)]).outputs[0].tokens
    held = draft.states[1].tokens
    e = draft.propose([DraftSeqInput(1, 1, [9], 3)]).outputs[0].tokens
    assert draft.states[1].tokens is held and held == prompt + d[:1] + [9] + e
    assert draft.states[1].base == len(prompt) + 2
    before = list(held)

    def boom(*a, **kw):
        raise RuntimeError("injected")
    monkeypatch.setattr(draft, "_draft", boom)
    with pytest.raises(RuntimeError, match="injected"):
        draft.propose([DraftSeqInput(1, 2, [5], 3)])
    assert draft.states[1].tokens is held and held == before and draft.states[1].base == len(prompt) + 2
    monkeypatch.undo()
    f = draft.propose([DraftSeqInput(1, 3, [8], 2)]).outputs[0].tokens
    fresh = draft.propose([DraftSeqInput(2, 0, prompt + d[:1] + [9] + e + [8], 2, first=True)]).outputs[0].tokens
    assert f == fresh
    draft.release([1, 2])
    assert draft.num_free_blocks == draft.runner.blocks.num_blocks
