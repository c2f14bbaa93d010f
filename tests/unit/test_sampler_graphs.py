"""The graphed draft sampler (sampling/graphs.py) against eager draft_sample, on the CPU with a
stand-in graph that re-runs the captured function on its static buffers (the real capture is
tested on the GPU: tests/gpu/test_engines_gpu.py). What these hold: one staged copy carries a
position's parameters (padding, filter sets, guesses and the output row included), every filter
switched on gives the bits of the filters the rows use, and the draft engine drafts the same
tokens and distributions with the sampler as without it."""
from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import DraftEngine, DraftSeqInput
from specdec.sampling.draft import draft_sample
from specdec.sampling.graphs import GraphedVerifier
from specdec.sampling.params import SamplingParams
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.transport import dense_weights
from specdec.sampling.rejection import rejection_sample
from tests.helpers.cpu_graphs import CpuCaptures, CpuSampler
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: this module runs single-threaded)
from tests.helpers.tiny_models import make_checkpoint

V = 96


ROWS = [SamplingParams(temperature=0.8, top_k=5, seed=1), SamplingParams(),  # a greedy row
        SamplingParams(temperature=1.3, top_p=0.7, seed=2), SamplingParams(temperature=0.6, min_p=0.2, seed=3),
        SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0.9, top_k=3, top_p=0.9, seed=5)]


def _eager(logits, params, seeds, positions, guess, dtype=torch.float16):
    tensors = SamplingTensors.from_params(params, "cpu", seeds)
    tokens, q = draft_sample(logits, tensors, torch.tensor(positions), dtype,
                             None if guess is None else torch.tensor(guess))
    return tokens, q.to(dtype)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [1, 3, 4], [4], [2, 0], [2, 4]], ids=str)
def test_sampler_gives_the_bits_of_eager_draft_sample(rows):
    """Bucket padding (3 rows in a bucket of 4), both filter sets (rows [1, 3, 4] use no sort,
    [2, 4] top-p alone; the second position drops the sorting filters), guesses on some rows,
    successive output rows: tokens and q equal eager draft_sample's."""
    sampler = CpuSampler(V, (1, 4, 8), 4, torch.float16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(len(rows))
    params = [ROWS[r] for r in rows]
    seeds = [11 * r + 7 for r in rows]
    outs = []
    for step in range(3):
        if step == 1:  # the other filter set in between: the bucket's two graphs share its buffers
            params = [ROWS[4] if p.top_k or p.top_p < 1 else p for p in params]
        logits = torch.randn(len(rows), V, generator=gen) * 3
        positions = [40 + 3 * j + step for j in range(len(rows))]
        guess = [j % 2 == 0 for j in range(len(rows))] if step == 0 else None
        tokens, q = sampler.sample(logits, params, seeds, positions, guess, step)
        want_tokens, want_q = _eager(logits, params, seeds, positions, guess)
        assert torch.equal(tokens, want_tokens) and torch.equal(q, want_q)
        outs.append((tokens.clone(), q.clone()))
    # Earlier positions' outputs stay in their rows until the step ends (the engine reads them then).
    assert all(torch.equal(sampler.tokens[s, :len(rows)], t) for s, (t, _) in enumerate(outs))
    assert sampler.replays == 3


def test_every_filter_on_gives_the_bits_of_the_filters_rows_use():
    """The graph runs top-k, top-p and min-p on every row; a row that does not use a filter must
    come out as if the filter had not run (min-p renormalises only its own rows)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROWS), V, generator=gen) * 4
    for keep in ([1, 4], [0, 4], [2, 4], [3, 4], [0, 1, 2, 3, 4, 5]):
        params = [ROWS[r] for r in keep]
        t = SamplingTensors.from_params(params, "cpu", [0] * len(keep))
        every = SamplingTensors(**{**t.__dict__, "any_top_k": True, "any_top_p": True, "any_min_p": True})
        assert torch.equal(logits_to_probs(logits[keep], t), logits_to_probs(logits[keep], every)), keep


def test_a_rows_distribution_does_not_depend_on_a_min_p_neighbour():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, V, generator=gen)
    alone = logits_to_probs(logits[:1], SamplingTensors.from_params([ROWS[4]], "cpu", [0]))
    beside = logits_to_probs(logits, SamplingTensors.from_params([ROWS[4], ROWS[3]], "cpu", [0, 0]))
    assert torch.equal(alone[0], beside[0])


def test_sampler_refuses_what_it_does_not_fit():
    sampler = CpuSampler(V, (1, 2), 2, torch.bfloat16, torch.device("cpu"))
    assert sampler.fits(2, 1, V) and not sampler.fits(3, 0, V) and not sampler.fits(1, 2, V)
    assert not sampler.fits(1, 0, V + 1) and not sampler.fits(0, 0, V)
    with pytest.raises(ValueError, match="rows"):
        sampler.sample(torch.zeros(3, V), ROWS[:3], [0] * 3, [0] * 3, None, 0)
    tokens, q = sampler.sample(torch.randn(2, V), ROWS[:2], [5, 6], [9, 9], None, 1)
    assert q.dtype == torch.bfloat16 and tokens.shape == (2,)


def _with_and_without(tmp_path, engine_cls, install) -> list:
    """Two engines of one tiny checkpoint on the CPU; install(engine) gives the second its graphs."""
    path = make_checkpoint(tmp_path, with_tokenizer=False)
    engines = [engine_cls(EngineConfig(model=path, block_size=4, num_blocks=128, warmup_batch_sizes=(1,),
                                       max_num_draft=6)) for _ in range(2)]
    install(engines[1])
    return engines


def test_draft_engine_drafts_the_same_with_the_sampler(tmp_path):
    """Mixed sampled and greedy sequences, different num_draft (rows drop out of later positions),
    an extension whose first token is a guess, and a batch larger than the sampler's buckets (the
    eager fallback): drafts and distributions equal those of the engine without the sampler."""
    engines = _with_and_without(tmp_path, DraftEngine, lambda e: setattr(
        e, "sampler", CpuSampler(e.vocab_size, (1, 2, 4), 6, e.config.probs_dtype, e.device)))
    sampled = [SamplingParams(temperature=0.9, top_k=20, seed=7), SamplingParams(temperature=1.1, seed=8),
               SamplingParams(), SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=9)]
    prompts = [[5, 6, 7], [9, 8], [1, 2, 3, 4], [30]]

    def run(engine):
        first = engine.propose([DraftSeqInput(i, 0, prompts[i], k, sampled[i], first=True)
                                for i, k in enumerate([4, 2, 3, 4])]).outputs
        ext = engine.propose([DraftSeqInput(0, 2, [], 3, sampled[0], extend=True),
                              DraftSeqInput(1, 1, [44], 2, sampled[1]),
                              DraftSeqInput(3, 4, [], 5, sampled[3], extend=True)]).outputs
        wide = engine.propose([DraftSeqInput(10 + i, 0, [i + 1, 2], 2, sampled[i % 4], first=True)
                               for i in range(6)]).outputs   # 6 rows: above the largest bucket (4)
        return first + ext + wide

    without, with_ = run(engines[0]), run(engines[1])
    assert engines[1].sampler.replays > 0
    for a, b in zip(without, with_):
        assert a.error is None and b.error is None
        assert a.tokens == b.tokens
        assert (a.probs is None) == (b.probs is None)
        if a.probs is not None:
            a_q, b_q = dense_weights(a.probs), dense_weights(b.probs)
            assert a_q.dtype == b_q.dtype == torch.float16 and torch.equal(a_q, b_q)


class CpuVerifier(CpuCaptures, GraphedVerifier):
    pass


def _softish(gen, rows, sharp=2.0):
    return torch.randn(rows, V, generator=gen) * sharp


@pytest.mark.parametrize("case", range(5))
def test_verifier_gives_the_bits_of_eager_rejection_sample(case):
    """Ragged draft counts (0 included) padded to the bucket's kmax, sequences padded to the
    bucket, sampled and greedy sequences (one-hot rows for the greedy ones' drafts), all drafts
    deterministic (no rows sent), both filter sets: the verdicts of rejection_sample."""
    gen = torch.Generator().manual_seed(case)
    verifier = CpuVerifier(V, (1, 4, 8), 5, torch.device("cpu"))
    picks = [[0, 2, 3], [4], [1, 4, 0, 5, 3], [4, 2, 4], [2, 3, 4, 0, 1, 5]][case]
    params = [ROWS[i] for i in picks]
    if case == 3:  # deterministic drafts at the argmax of rows whose top token has ~half the mass
        params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8, top_k=40, seed=12),
                  SamplingParams(temperature=0.9, seed=13)]
    counts = [[3, 0, 5], [2], [4, 1, 0, 5, 3], [2, 4, 3], [5, 5, 2, 0, 3, 1]][case]
    seeds = [1000 + 17 * i for i in range(len(picks))]
    positions = [30 + 5 * i for i in range(len(picks))]
    m = sum(counts)
    z = _softish(gen, m)
    q = torch.softmax(z, -1).half().float() if m else None   # transport-rounded draft weights
    drafts = torch.tensor([int(torch.multinomial(r, 1, generator=gen)) for r in q], dtype=torch.int64) \
        if m else torch.zeros(0, dtype=torch.int64)
    # Target rows near the draft's (p close to q: most drafts accepted, some rejected), bonus rows apart.
    logits, row = [], 0
    for k in counts:
        logits += [z[row + j] + 0.5 * torch.randn(V, generator=gen) for j in range(k)] + [_softish(gen, 1)[0]]
        row += k
    logits = torch.stack(logits)
    row = 0
    for p, k in zip(params, counts):  # greedy sequences' drafts are deterministic: one-hot rows
        if p.greedy and k:
            q[row:row + k] = 0.0
            q[range(row, row + k), drafts[row:row + k]] = 1.0
        row += k
    if case == 3:
        # Every draft deterministic, no rows sent (q one-hot at the draft): the drafts are the target
        # rows' argmaxes, made to hold about half of their row's mass, so that some are accepted
        # and the rejections' residuals (p without the draft) depend on the one-hot rows.
        rows_of_drafts = [sum(counts[:i]) + i + j for i, k in enumerate(counts) for j in range(k)]
        drafts = logits[rows_of_drafts].argmax(-1)
        logits[rows_of_drafts, drafts] += 1.5
    dq = None if case == 3 else q
    got = verifier.verify(logits, drafts.tolist(), dq, counts, params, seeds, positions)
    want = rejection_sample(logits, drafts, dq, counts, SamplingTensors.from_params(params, "cpu", seeds),
                            positions).to_host()
    assert got == want
    assert verifier.replays == 1


def test_verifier_refuses_what_it_does_not_fit():
    with pytest.raises(ValueError, match="kmax 0"):
        CpuVerifier(V, (1,), 0, torch.device("cpu"))
    verifier = CpuVerifier(V, (1, 2), 3, torch.device("cpu"))
    assert verifier.fits(2, 3, V) and not verifier.fits(3, 1, V) and not verifier.fits(1, 4, V)
    assert not verifier.fits(1, 1, V + 1)
    with pytest.raises(ValueError, match="target rows"):
        verifier.verify(torch.zeros(3, V), [1], None, [1], ROWS[:1], [0], [0])   # 3 rows for k = 1
    with pytest.raises(ValueError, match="verifier"):
        verifier.verify(torch.zeros(5, V), [1] * 4, None, [4], ROWS[:1], [0], [0])  # k 4 > kmax 3


def test_target_engine_verifies_the_same_with_the_verifier(tmp_path):
    """Sampled speculation through the target with and without the graphed verifier (a CPU
    stand-in), the same drafts and probabilities each step: the same verdicts, so the same text."""
    from specdec.engine import TargetEngine
    targets = _with_and_without(tmp_path, TargetEngine, lambda e: setattr(
        e, "verifier", CpuVerifier(e.vocab_size, (1, 2, 4), 6, e.device)))
    verify_alike(targets, [SamplingParams(temperature=0.9, top_k=30, seed=7), SamplingParams(),
                           SamplingParams(temperature=1.2, seed=8)], [[5, 6, 7], [9, 8], [1, 2, 3, 4]])
    assert targets[1].verifier.replays == 4


def verify_alike(targets, params, prompts, steps: int = 4) -> None:
    """`steps` verifies of the same random drafts (and, for sampled sequences, probabilities that
    favour them) on each target engine, draft counts cycling through 0..3: the same verdicts."""
    from specdec.engine import VerifySeqInput
    gen = torch.Generator().manual_seed(3)
    v = targets[0].vocab_size
    new = [list(p) for p in prompts]
    for step in range(steps):
        seqs = []
        for i, p in enumerate(params):
            k = (step + i) % 4
            drafts = torch.randint(0, v, (k,), generator=gen).tolist()
            probs = None
            if k and not p.greedy:
                probs = torch.softmax(torch.randn(k, v, generator=gen), -1).half()
                probs[range(k), drafts] += 0.25
            seqs.append(VerifySeqInput(i, new[i], drafts, probs, p, first=step == 0))
        outs = [t.verify(seqs).outputs for t in targets]
        for a, b in zip(*outs):
            assert a.error is None and (a.accepted, a.next_token) == (b.accepted, b.next_token)
        new = [[o.next_token] for o in outs[0]]
