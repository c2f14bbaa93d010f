"""Rejection sampler: the output has the target's distribution (chi-square), edge cases, batching."""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling import rejection
from specdec.sampling.draft import draft_sample
from specdec.sampling.params import SamplingParams
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rejection import one_hot_probs, rejection_sample, rejection_sample_probs
from specdec.sampling.transport import decode_probs, encode_probs, normalize, round_probs
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: this module runs single-threaded)

N = 20_000
PASS, FAIL = 1e-3, 1e-6  # the seeds are fixed, so these are deterministic outcomes, not flaky ones


def pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square p-value of samples against p; cells with expected count < 5 are pooled, and any
    sample outside p's support is an outright failure."""
    p = p.double().numpy()
    counts = np.bincount(samples.numpy(), minlength=len(p))
    if counts[p == 0].sum():
        return 0.0
    expected = p * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (p > 0)].sum())
    exp = np.append(expected[big], expected[~big & (p > 0)].sum())
    keep = exp > 0
    if keep.sum() < 2:
        return 1.0  # a single possible outcome, and every sample is it
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def tensors_for(params: SamplingParams, n: int, seed0: int = 0) -> SamplingTensors:
    return SamplingTensors.from_params([params] * n, seeds=[seed0 + i for i in range(n)])


def make_case(vocab: int, rows: int, seed: int):
    """Target/draft logits per position (context-independent) and their sampling params."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(rows, vocab, generator=g) * 1.5
    draft = target + torch.randn(rows, vocab, generator=g)  # correlated: partial acceptance
    return target, draft


def speculate(p_rows, draft_logits, draft_params, k_of, n=N, transport=torch.float16, seed0=0):
    """One verify step for n sequences from position 0: sequence b drafts k_of(b) tokens, draft
    index j from draft_logits[j]; the target's distribution at index j is p_rows[j]."""
    counts = [k_of(b) for b in range(n)]
    kmax = max(counts)
    t = tensors_for(draft_params, n, seed0)
    positions = torch.zeros(n, dtype=torch.int64)
    toks, qs = [], []
    for j in range(kmax):
        tok, q = draft_sample(draft_logits[j].expand(n, -1), t, positions + j, transport)
        toks.append(tok)
        qs.append(q)
    k = torch.tensor(counts)
    sel = torch.arange(kmax)[None, :] < k[:, None]                     # [n, kmax]
    draft_tokens = torch.stack(toks, 1)[sel] if kmax else torch.zeros(0, dtype=torch.int64)
    draft_probs = torch.stack(qs, 1)[sel] if kmax else torch.zeros(0, p_rows.shape[1])
    rows = torch.cat([torch.arange(c + 1) for c in counts])
    out = rejection_sample_probs(p_rows[rows], draft_tokens, draft_probs, counts, t.seeds, positions)
    return out, counts


TARGET = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
DRAFT = SamplingParams(temperature=1.3, top_p=0.95)


@pytest.mark.parametrize("vocab", [8, 32])
def test_output_has_target_distribution_per_position(vocab):
    target_logits, draft_logits = make_case(vocab, 4, seed=vocab)
    p = logits_to_probs(target_logits, tensors_for(TARGET, 4))
    out, counts = speculate(p, draft_logits, DRAFT, lambda b: b % 4)   # k = 0..3 in one batch
    tokens = out.tokens
    assert pvalue(tokens[:, 0], p[0]) > PASS
    for j in (1, 2):
        reached = out.num_emitted > j
        assert reached.sum() > 2000
        assert pvalue(tokens[reached, j], p[j]) > PASS
    alpha = out.accepted.sum() / sum(counts)
    assert 0.2 < alpha < 0.95  # the test exercises both branches


@pytest.mark.parametrize("broken", ["skip_residual", "accept_all"])
def test_chi_square_catches_a_wrong_sampler(monkeypatch, broken):
    target_logits, draft_logits = make_case(16, 2, seed=3)
    p = logits_to_probs(target_logits, tensors_for(TARGET, 2))
    if broken == "skip_residual":
        monkeypatch.setattr(rejection, "residual_probs", lambda p, q: p)
    else:
        monkeypatch.setattr(rejection, "uniform", lambda seeds, pos, purpose: torch.zeros(pos.shape,
                                                                                          dtype=torch.float64))
    out, _ = speculate(p, draft_logits, DRAFT, lambda b: 1)
    assert pvalue(out.tokens[:, 0], p[0]) < FAIL


def test_multi_step_sequences_are_iid_per_position():
    """A full loop over several steps (k varies per sequence and step): each position's token is
    distributed as p at that position and positions are independent (the joint of the first two
    tokens is the product), which checks the reuse of position-keyed uniforms after rejections."""
    vocab, length, n = 8, 4, N
    target_logits, draft_logits = make_case(vocab, length + 4, seed=12)
    target = SamplingParams(temperature=1.0, top_p=0.95)               # 4..7 tokens kept per position
    p_table = logits_to_probs(target_logits, tensors_for(target, length + 4))
    t = tensors_for(DRAFT, n, seed0=1000)
    out_tokens = torch.full((n, length + 4), -1)
    done = torch.zeros(n, dtype=torch.int64)                          # committed length
    step = 0
    while int(done.min()) < length:
        counts = [0 if int(done[b]) >= length else (b + step) % 4 for b in range(n)]
        kmax = max(counts)
        toks, qs = [], []
        for j in range(kmax):
            tok, q = draft_sample(draft_logits[(done + j).clamp(max=length + 3)], t, done + j)
            toks.append(tok)
            qs.append(q)
        sel = torch.arange(kmax)[None, :] < torch.tensor(counts)[:, None]
        dt = torch.stack(toks, 1)[sel] if kmax else torch.zeros(0, dtype=torch.int64)
        dp = torch.stack(qs, 1)[sel] if kmax else torch.zeros(0, vocab)
        rows = torch.cat([int(done[b]) + torch.arange(c + 1) for b, c in enumerate(counts)])
        out = rejection_sample_probs(p_table[rows], dt, dp, counts, t.seeds, done)
        for b, toks_b in enumerate(out.to_host().tokens):
            d = int(done[b])
            if d < length:
                out_tokens[b, d:d + len(toks_b)] = torch.tensor(toks_b)
                done[b] = d + len(toks_b)
        step += 1
    for pos in range(length):
        assert pvalue(out_tokens[:, pos], p_table[pos]) > PASS, pos
    joint = out_tokens[:, 0] * vocab + out_tokens[:, 1]
    assert pvalue(joint, torch.outer(p_table[0], p_table[1]).flatten()) > PASS


def test_token_with_zero_draft_probability_is_never_accepted():
    n, vocab = 4000, 8
    p = torch.full((2, vocab), 1.0 / vocab)
    q = torch.tensor([[0.0] + [1.0 / 7] * 7])                          # q(0) = 0, p(0) = 1/8
    out = rejection_sample_probs(p.repeat(n, 1), torch.zeros(n, dtype=torch.int64), q.expand(n, -1),
                                 [1] * n, torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert int(out.accepted.sum()) == 0
    assert pvalue(out.tokens[:, 0], rejection.residual_probs(p[:1], q)[0]) > PASS


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=5), SamplingParams()])
def test_p_equal_q_accepts_everything(params):
    n, k, vocab = 3000, 4, 16
    logits = torch.randn(k, vocab, generator=torch.Generator().manual_seed(5)) * 2
    t = tensors_for(params, n)
    positions = torch.zeros(n, dtype=torch.int64)
    toks, qs = zip(*[draft_sample(logits[j].expand(n, -1), t, positions + j) for j in range(k)])
    # an all-greedy draft returns no q: its distribution is one-hot at the token
    qs = [q if q is not None else one_hot_probs(x, vocab) for x, q in zip(toks, qs)]
    dt, dp = torch.stack(toks, 1).flatten(), torch.stack(qs, 1).reshape(n * k, vocab)
    p = normalize(dp).reshape(n, k, vocab)                              # the very same q, as the target
    p = torch.cat([p, p[:, :1]], 1).reshape(n * (k + 1), vocab)
    out = rejection_sample_probs(p, dt, dp, [k] * n, t.seeds, positions)
    assert bool((out.accepted == k).all())
    assert torch.equal(out.tokens[:, :k], torch.stack(toks, 1))


def test_disjoint_supports_never_accept_and_sample_p():
    n, vocab = N, 16
    p = torch.zeros(vocab)
    p[:8] = torch.softmax(torch.randn(8, generator=torch.Generator().manual_seed(1)), 0)
    q = torch.zeros(vocab)
    q[8:] = 1.0 / 8
    t = tensors_for(SamplingParams(temperature=1.0), n)
    x, _ = draft_sample(torch.log(q).expand(n, -1), t, torch.zeros(n, dtype=torch.int64))
    out = rejection_sample_probs(p.repeat(2 * n, 1), x, q.expand(n, -1), [1] * n, t.seeds,
                                 torch.zeros(n, dtype=torch.int64))
    assert int(out.accepted.sum()) == 0
    assert pvalue(out.tokens[:, 0], p) > PASS


@pytest.mark.parametrize("transport", [torch.float16, torch.bfloat16])
def test_transport_rounding_of_q_changes_nothing(transport):
    """A draft with many tiny probabilities (some flushed to 0, some subnormal after rounding),
    sampled from the rounded q and sent through encode/decode: the output is still p."""
    vocab = 32
    target_logits, _ = make_case(vocab, 2, seed=21)
    p = logits_to_probs(target_logits, tensors_for(SamplingParams(temperature=1.0), 2))
    draft_logits = torch.linspace(0, -40, vocab).expand(2, -1).contiguous()  # q spans 1 .. 1e-18
    out_direct, _ = speculate(p, draft_logits, SamplingParams(temperature=1.0), lambda b: 1,
                              transport=transport)
    assert pvalue(out_direct.tokens[:, 0], p[0]) > PASS
    q = round_probs(torch.softmax(draft_logits[:1], -1), transport)
    assert (q == 0).any() and (q > 0).sum() > 10
    enc = encode_probs(q, transport)
    assert torch.equal(decode_probs(enc.values, 1, vocab, enc.encoding, enc.indices, enc.row_lengths), q)


def test_greedy_target_accepts_while_argmax_matches_then_emits_argmax():
    vocab, k = 16, 5
    target = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(2))
    argmax = target.argmax(-1)
    drafts = argmax[:k].clone()
    drafts[3] = (drafts[3] + 1) % vocab                                # first mismatch at index 3
    t = tensors_for(SamplingParams(), 1)
    for probs in (None, torch.nn.functional.one_hot(drafts, vocab).float()):
        out = rejection_sample(target, drafts, probs, [k], t, [7]).to_host()
        assert out.accepted == [3]
        assert out.tokens == [argmax[:4].tolist()]
    out = rejection_sample(target, argmax[:k], None, [k], t, [7]).to_host()
    assert out.tokens == [argmax.tolist()]                               # all accepted + bonus argmax


@pytest.mark.parametrize("ties", [False, True], ids=["randn", "ties"])
def test_all_greedy_shortcut_equals_the_general_path(ties):
    """rejection_sample and draft_sample take an argmax shortcut when every row is greedy; the
    general arithmetic (one-hot p and q, hashed uniforms, inverse-CDF draws) must give the same
    tokens, ties at the maximum included (few distinct logit values). Drafts copy the target's
    argmax for a random prefix, so every accepted count occurs."""
    gen = torch.Generator().manual_seed(21)
    vocab, counts = 40, [4, 0, 1, 4, 2, 3, 0, 4]
    rows = sum(counts) + len(counts)
    logits = (torch.randint(0, 3, (rows, vocab), generator=gen).float() if ties
              else torch.randn(rows, vocab, generator=gen))
    best = logits.argmax(-1)
    drafts, row = [], 0
    for k in counts:
        keep = int(torch.randint(0, k + 1, (1,), generator=gen))
        for j in range(k):
            drafts.append(int(best[row + j]) if j < keep else (int(best[row + j]) + 1) % vocab)
        row += k + 1
    drafts = torch.tensor(drafts)
    t = tensors_for(SamplingParams(), len(counts))
    assert t.all_greedy
    positions = list(range(3, 3 + len(counts)))
    fast = rejection_sample(logits, drafts, None, counts, t, positions).to_host()
    general = rejection_sample_probs(logits_to_probs(logits, t.repeat([k + 1 for k in counts])), drafts, None,
                                     counts, t.seeds, positions).to_host()
    assert fast == general
    # The target engine's host form of the same rule (argmax rows, then a compare per sequence).
    per_seq, q0 = [], 0
    for k in counts:
        per_seq.append(drafts[q0:q0 + k].tolist())
        q0 += k
    host = rejection.greedy_accept_rows(best.tolist(), per_seq)
    assert host == [(a, toks[-1]) for a, toks in zip(fast.accepted, fast.tokens)]
    with pytest.raises(ValueError, match="target rows"):
        rejection.greedy_accept_rows(best.tolist()[:-1], per_seq)
    assert sorted(set(fast.accepted)) == sorted(set(fast.accepted) | {0, 4}) and len(set(fast.accepted)) >= 3
    t = tensors_for(SamplingParams(), len(logits))
    tok, q = draft_sample(logits, t, torch.arange(len(logits)))
    general_tok, general_q = draft_sample(logits, dataclasses.replace(t, all_greedy=False), torch.arange(len(logits)))
    assert q is None and torch.equal(tok, best) and torch.equal(general_tok, best)
    assert torch.equal(general_q, one_hot_probs(best, vocab))


def test_sampled_draft_against_greedy_target_is_greedy():
    vocab, n = 16, 500
    target = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    t_draft = tensors_for(SamplingParams(temperature=1.5), n)
    x, q = draft_sample(target[0].expand(n, -1), t_draft, torch.zeros(n, dtype=torch.int64))
    out = rejection_sample(target.repeat(n, 1), x, q, [1] * n, tensors_for(SamplingParams(), n), [0] * n)
    assert bool((out.tokens[:, 0] == target[0].argmax()).all())
    assert torch.equal(out.accepted == 1, x == target[0].argmax())


def test_deterministic_draft_without_probs_against_sampling_target():
    """draft_probs=None means q is one-hot at the drafted token: exact for a greedy draft even
    when the target samples (accept with probability p(x), else sample norm(p - onehot))."""
    target_logits, draft_logits = make_case(16, 2, seed=17)
    p = logits_to_probs(target_logits, tensors_for(SamplingParams(temperature=1.0), 2))
    x = draft_logits[0].argmax().expand(N)
    t = tensors_for(SamplingParams(temperature=1.0), N)
    out = rejection_sample_probs(p.repeat(N, 1), x, None, [1] * N, t.seeds, torch.zeros(N, dtype=torch.int64))
    assert abs(float(out.accepted.double().mean()) - float(p[0, x[0]])) < 0.01
    assert pvalue(out.tokens[:, 0], p[0]) > PASS


def test_seeded_row_is_independent_of_batch_composition():
    vocab = 32
    target_logits, draft_logits = make_case(vocab, 4, seed=8)
    params = [SamplingParams(temperature=0.7, seed=s) for s in (11, 12, 13)] + [SamplingParams()]
    counts = [3, 0, 2, 1]

    def run(idx):
        sub = [params[i] for i in idx]
        t = SamplingTensors.from_params(sub)
        pos = torch.tensor([5 + i for i in idx])
        ks = [counts[i] for i in idx]
        toks, qs = [], []
        for b, i in enumerate(idx):
            tb = SamplingTensors.from_params([sub[b]])
            for j in range(ks[b]):
                tok, q = draft_sample(draft_logits[j][None], tb, pos[b:b + 1] + j)
                toks.append(tok)
                qs.append(q if q is not None else one_hot_probs(tok, vocab))  # greedy: one-hot
        dt = torch.cat(toks) if toks else torch.zeros(0, dtype=torch.int64)
        dp = torch.cat(qs) if qs else torch.zeros(0, vocab)
        rows = torch.cat([torch.arange(k + 1) for k in ks])
        return rejection_sample(target_logits[rows], dt, dp, ks, t, pos).to_host().tokens

    together = run([0, 1, 2, 3])
    assert [run([i])[0] for i in range(4)] == together
    assert run([2, 0]) == [together[2], together[0]]


def test_all_plain_decoding_matches_p():
    vocab = 16
    target_logits, _ = make_case(vocab, 1, seed=9)
    t = tensors_for(SamplingParams(temperature=1.0, min_p=0.05), N)
    out = rejection_sample(target_logits.expand(N, -1), torch.zeros(0, dtype=torch.int64), None,
                           [0] * N, t, torch.zeros(N, dtype=torch.int64))
    p = logits_to_probs(target_logits, tensors_for(SamplingParams(temperature=1.0, min_p=0.05), 1))[0]
    assert bool((out.num_emitted == 1).all()) and out.tokens.shape == (N, 1)
    assert pvalue(out.tokens[:, 0], p) > PASS


def test_shape_errors_are_clear():
    t = tensors_for(SamplingParams(), 2)
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample(torch.zeros(4, 8), torch.zeros(2, dtype=torch.int64), None, [1, 2], t, [0, 0])
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample(torch.zeros(2, 8), torch.zeros(0, dtype=torch.int64), None, [0, -1], t, [0, 0])


@contextmanager
def sync_is_an_error(dev: str):
    """On CUDA, any host-device synchronisation inside the block raises (torch's sync debug mode)."""
    if dev != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_same_output_on_cuda_without_host_sync():
    """The draft's and the target's sampling steps as the engines run them (parameters and
    positions from the host, counts on the host) give the CPU's tokens without one sync. The
    test's own copies and the boolean-mask selection (a nonzero: a sync) stay outside."""
    vocab, n = 32, 256
    target_logits, draft_logits = make_case(vocab, 4, seed=13)
    params = [SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=i) if i % 3 else SamplingParams()
              for i in range(n)]
    counts = [i % 4 for i in range(n)]
    results = []
    for dev in ("cpu", "cuda"):
        rows = torch.cat([torch.arange(k + 1) for k in counts]).to(dev)
        sel = (torch.arange(3)[None, :] < torch.tensor(counts)[:, None]).to(dev)
        logits, draft_logits_dev = target_logits.to(dev)[rows], draft_logits.to(dev)
        with sync_is_an_error(dev):
            t = SamplingTensors.from_params(params, dev)
            pos = torch.zeros(n, dtype=torch.int64, device=dev)
            toks, qs = zip(*[draft_sample(draft_logits_dev[j].expand(n, -1), t, pos + j) for j in range(3)])
        dt, dp = torch.stack(toks, 1)[sel], torch.stack(qs, 1)[sel]
        with sync_is_an_error(dev):
            out = rejection_sample(logits, dt, dp, counts, t, [0] * n)
            greedy = rejection_sample(logits, dt, None, counts,  # the all-greedy shortcut
                                      SamplingTensors.from_params([SamplingParams()] * n, dev), [0] * n)
        results.append((out.to_host(), greedy.to_host()))
    assert results[0] == results[1]


def test_a_guess_row_draws_with_the_targets_own_uniform():
    """draft_sample's guess rows (a pipelined extension's first token) draw with rng.RESAMPLE, the
    uniform of the target's bonus sample at that position; other rows with rng.DRAFT. With the
    draft's q the target's p (up to q's transport rounding), a guess matches the target's bonus
    token almost always, where an independent draw matches with probability sum p^2."""
    from specdec.sampling.rng import DRAFT, RESAMPLE, uniform
    from specdec.sampling.transport import sample_from

    n, v = 4000, 50
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(v, generator=gen) * 1.5).expand(n, -1)
    t = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=i) for i in range(n)])
    positions = torch.full((n,), 17, dtype=torch.int64)
    guess = torch.arange(n) % 2 == 0
    tok, q = draft_sample(logits, t, positions, guess=guess)
    for purpose, rows in ((RESAMPLE, guess), (DRAFT, ~guess)):
        want = sample_from(q, uniform(t.seeds, positions, purpose))
        assert torch.equal(tok[rows], want[rows])
    p = logits_to_probs(logits, t)
    bonus = sample_from(p, uniform(t.seeds, positions, RESAMPLE))   # what rejection_sample draws
    agree = (tok == bonus).double()
    assert agree[guess].mean() > 0.98
    assert agree[~guess].mean() < 0.3 and float((p[0].double() ** 2).sum()) < 0.3
