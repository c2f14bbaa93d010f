"""Adversarial review of a60fa44 / 542f878: the draft's sampled rows leave the device as their
nonzeros (transport.draft_rows_to_host, DraftEngine._to_host) where the sparse encoding is smaller.

The contract checked here: per sequence, encode_probs of what the draft now returns gives exactly
the bytes encode_probs gave for the sequence's dense rows before the change (same encoding,
indices, values, row lengths); tokens are unchanged; sequences without sampled rows get None;
nothing is lost or moved between sequences. Inputs tried: many sequences of 0 / 1 / many rows,
all-sparse / all-dense / mixed steps, nonzero counts at, just under and just over the size rule
(6 * nnz + 4 * rows vs 2 * rows * vocab), -0.0 entries, vocabularies of 1, 2, 3, rows with one
nonzero and rows of zeros, non-contiguous q (column slices, strided rows, transposed storage,
expanded rows), counts as Python ints / numpy ints / a tensor, the DEVICE_SPARSE_MIN_ROWS boundary,
the bf16 transport, and an engine fuzz (random top-k / top-p / min-p / temperature-only / greedy
batches, num_draft 0..5, invalid sequences among valid ones, extend and plain follow-up steps)
comparing the wire bytes with the switch on and off.
"""
from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

import specdec.engine.draft as draft_module
from specdec.config import EngineConfig
from specdec.engine import DraftEngine, DraftSeqInput
from specdec.sampling import transport
from specdec.sampling.params import SamplingParams
from specdec.sampling.transport import (SparseWeights, dense_weights, draft_rows_to_host, encode_probs,
                                        nonzero_counts)
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import make_pair

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# --------------------------------------------------------------------------- helpers

def rule_sparse(nnz: int, rows: int, vocab: int) -> bool:
    """The wire-size rule written out independently of transport._sparse_is_smaller."""
    return 6 * nnz + 4 * rows < 2 * rows * vocab


def true_nnz(rows: torch.Tensor) -> int:
    """Nonzero weights as the wire counts them (bits other than the sign), computed on the host."""
    return int(((rows.detach().cpu().contiguous().view(torch.int16) & 0x7FFF) != 0).sum())


def random_weight_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n positive finite fp16 bit patterns (subnormals included)."""
    return rng.integers(1, 0x7C00, size=n).astype(np.int16)


def make_rows(rng: np.random.Generator, rows: int, vocab: int, nnz: int, neg_zero: bool = True) -> torch.Tensor:
    """[rows, vocab] fp16 with exactly nnz nonzeros placed at random (rows of zeros allowed), and
    -0.0 in some of the zero slots."""
    bits = np.zeros(rows * vocab, dtype=np.int16)
    where = rng.choice(rows * vocab, size=nnz, replace=False)
    bits[where] = random_weight_bits(rng, nnz)
    if neg_zero:
        zeros = np.flatnonzero(bits == 0)
        if zeros.size:
            bits[rng.choice(zeros, size=int(rng.integers(0, zeros.size + 1)), replace=False)] = -0x8000
    return torch.from_numpy(bits).view(torch.float16).reshape(rows, vocab)


def row_of_kind(rng: np.random.Generator, kind: str, vocab: int) -> torch.Tensor:
    if kind == "dense":
        nnz = vocab
    elif kind == "zeros":
        nnz = 0
    elif kind == "one":
        nnz = min(1, vocab)
    elif kind == "few":
        nnz = int(rng.integers(1, max(2, vocab // 4 + 1)))
    else:  # "any"
        nnz = int(rng.integers(0, vocab + 1))
    return make_rows(rng, 1, vocab, min(nnz, vocab))[0]


def as_layout(q: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as q [R, V], stored in another layout (all but 'plain' non-contiguous)."""
    r, v = q.shape
    if layout == "plain":
        return q.clone()
    if layout == "col_slice":   # rows of a wider buffer, as draft_sample's padded outputs
        big = torch.full((r, v + 5), 1.0, dtype=q.dtype, device=q.device)
        big[:, 2:2 + v] = q
        return big[:, 2:2 + v]
    if layout == "row_stride":  # every other row of a taller buffer
        big = torch.full((2 * r, v), 0.5, dtype=q.dtype, device=q.device)
        big[::2] = q
        return big[::2]
    if layout == "transposed":  # column-major storage
        return q.t().contiguous().t()
    raise AssertionError(layout)


def check_sequences(out, q: torch.Tensor, lengths, dtype=torch.float16, counted: bool = True) -> list[bool]:
    """Each sequence's output against its dense rows (the pre-change DraftOutput.probs); returns
    per sequence with rows whether it came sparse. counted: the rows had counts (fp16, switch on),
    so a sequence comes sparse exactly where the size rule says so."""
    assert len(out) == len(lengths)
    vocab = q.shape[1]
    kinds, start = [], 0
    for n, o in zip(lengths, out):
        if n == 0:
            assert o is None
            continue
        want = q[start:start + n].detach().cpu().clone()
        start += n
        got_wire, want_wire = encode_probs(o, dtype), encode_probs(want, dtype)
        assert got_wire == want_wire, (n, vocab, got_wire.encoding, want_wire.encoding)
        assert tuple(o.shape) == (n, vocab)
        if isinstance(o, SparseWeights):
            assert dtype == torch.float16 and o.dtype == torch.float16 and rule_sparse(true_nnz(want), n, vocab)
            assert o.flat.dtype == np.int64 and o.bits.dtype == np.int16 and o.flat.size == o.bits.size
            assert (np.diff(o.flat) > 0).all() and (o.flat.size == 0 or (o.flat[0] >= 0 and o.flat[-1] < n * vocab))
            # the weights, up to the sign of zeros (-0.0 carries no mass and is not a nonzero)
            assert torch.equal(dense_weights(o).view(torch.int16) & 0x7FFF, want.view(torch.int16) & 0x7FFF)
            kinds.append(True)
        else:
            # dense: bit for bit the old host rows, -0.0 included
            assert isinstance(o, torch.Tensor) and o.device.type == "cpu" and o.dtype == want.dtype
            assert torch.equal(o.contiguous().view(torch.int16), want.view(torch.int16))
            if counted and dtype == torch.float16:
                assert not rule_sparse(true_nnz(want), n, vocab)
            kinds.append(False)
    assert start == q.shape[0]
    return kinds


# --------------------------------------------------------------------------- draft_rows_to_host

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 2, 3, 4, 5, 8, 11])
def test_size_rule_boundary_per_sequence(vocab, device):
    """Sequences whose nonzero count is exactly at the rule's boundary, one under and one over
    (where those counts exist), all in one step with -0.0 among the zeros: each comes back in
    encode_probs' form with its bytes."""
    rng = np.random.default_rng(vocab)
    seqs = []
    for rows in (1, 2, 3, 5):
        exact = rows * (vocab - 2) / 3     # 6 * nnz + 4 * rows == 2 * rows * vocab
        for nnz in {int(np.floor(exact)) - 1, int(np.floor(exact)), int(np.ceil(exact)), int(np.ceil(exact)) + 1}:
            if 0 <= nnz <= rows * vocab:
                seqs.append(make_rows(rng, rows, vocab, nnz))
    seqs.append(torch.zeros(0, vocab, dtype=torch.float16))   # a sequence without rows, in the middle
    rng.shuffle(seqs)
    q = torch.cat(seqs).to(device)
    lengths = [s.shape[0] for s in seqs]
    counts = nonzero_counts(q).tolist()
    assert counts == [true_nnz(r) for r in q]
    kinds = check_sequences(draft_rows_to_host(q, lengths, counts), q, lengths)
    want = [rule_sparse(true_nnz(s), s.shape[0], vocab) for s in seqs if s.shape[0]]
    assert kinds == want
    if vocab <= 2:
        assert not any(kinds)       # 6 * nnz + 4 * rows < 2 * rows * vocab never holds
    if vocab >= 5:
        assert any(kinds) and not all(kinds)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_to_host_fuzz_mixed_sequences_layouts_and_vocabularies(device):
    """Random steps: up to 24 sequences of 0..6 rows, each sequence all-sparse / all-dense / mixed
    row kinds (zeros, one nonzero, few, dense, any), vocabularies 1..300, q in four layouts."""
    rng = np.random.default_rng(7)
    seen = {True: 0, False: 0}
    for trial in range(150):
        vocab = int(rng.choice([1, 2, 3, 4, 6, 16, 33, 300]))
        n_seqs = int(rng.integers(1, 25))
        lengths = [int(rng.choice([0, 1, 1, 2, 3, 6])) for _ in range(n_seqs)]
        if sum(lengths) == 0:
            lengths[int(rng.integers(n_seqs))] = 1
        style = rng.choice(["sparse", "dense", "mixed"])
        rows = []
        for n in lengths:
            seq_kind = style if style != "mixed" else rng.choice(["sparse", "dense", "rows"])
            for _ in range(n):
                kind = {"sparse": rng.choice(["one", "few", "zeros"]), "dense": "dense",
                        "rows": rng.choice(["dense", "zeros", "one", "few", "any"])}[seq_kind]
                rows.append(row_of_kind(rng, kind, vocab))
        q = as_layout(torch.stack(rows).to(device), str(rng.choice(["plain", "col_slice", "row_stride", "transposed"])))
        counts = nonzero_counts(q)
        counts = counts.tolist() if trial % 3 else [np.int64(c) for c in counts.tolist()]
        kinds = check_sequences(draft_rows_to_host(q, lengths, counts), q, lengths)
        for k in kinds:
            seen[k] += 1
        # the switch off / no counts: every row dense, the old bytes again
        dense = draft_rows_to_host(q, lengths, None)
        assert not any(isinstance(o, SparseWeights) for o in dense)
        check_sequences(dense, q, lengths, counted=False)
    assert seen[True] > 100 and seen[False] > 100


@pytest.mark.parametrize("device", DEVICES)
def test_rows_to_host_counts_as_a_tensor_or_numpy_array(device):
    """Counts as a host tensor, a numpy array or numpy ints work as the list of ints does."""
    rng = np.random.default_rng(3)
    q = torch.cat([make_rows(rng, 2, 40, 6), make_rows(rng, 3, 40, 120), make_rows(rng, 1, 40, 1)]).to(device)
    lengths = [2, 0, 3, 1]
    want = [type(o) for o in draft_rows_to_host(q, lengths, nonzero_counts(q).tolist())]
    assert want == [SparseWeights, type(None), torch.Tensor, SparseWeights]
    host_counts = nonzero_counts(q).cpu()
    for counts in (host_counts, host_counts.numpy(), [np.int32(c) for c in host_counts.tolist()]):
        out = draft_rows_to_host(q, lengths, counts)
        assert [type(o) for o in out] == want
        check_sequences(out, q, lengths)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_to_host_expanded_and_single_row_inputs(device):
    """q whose rows share storage (expand) and a step of one row of one nonzero."""
    rng = np.random.default_rng(5)
    row = make_rows(rng, 1, 64, 3).to(device)
    q = row.expand(7, 64)
    assert q.stride(0) == 0
    lengths = [3, 0, 4]
    assert nonzero_counts(q).tolist() == [3] * 7
    assert check_sequences(draft_rows_to_host(q, lengths, nonzero_counts(q).tolist()), q, lengths) == [True, True]
    one = torch.zeros(1, 9, dtype=torch.float16, device=device)
    one[0, 8] = 1.0
    out = draft_rows_to_host(one, [1], [1])
    assert isinstance(out[0], SparseWeights) and out[0].flat.tolist() == [8]
    assert out[0].bits.tolist() == [one.cpu().view(torch.int16)[0, 8].item()]
    check_sequences(out, one, [1])


@pytest.mark.parametrize("device", DEVICES)
def test_rows_to_host_bf16_rows_stay_dense(device):
    """bf16 transport: no counts (nonzero_counts gives None), every row dense and bit for bit
    the old rows, -0.0 included; encode_probs(.., bfloat16) bytes equal."""
    rng = np.random.default_rng(11)
    q = torch.rand(9, 20, generator=torch.Generator().manual_seed(0)).bfloat16()
    q[q < 0.8] = 0
    q[0, 0] = -0.0
    q = as_layout(q.to(device), "col_slice")
    assert nonzero_counts(q) is None
    lengths = [2, 0, 1, 6]
    out = draft_rows_to_host(q, lengths, nonzero_counts(q))
    assert not any(isinstance(o, SparseWeights) for o in out)
    check_sequences(out, q, lengths, dtype=torch.bfloat16, counted=False)
    assert out[0][0, 0].view(torch.int16).item() == -0x8000
    del rng


# --------------------------------------------------------------------------- DraftEngine._to_host

def old_to_host(plans, active, steps):
    """DraftEngine._draft's tail before a60fa44 (the reference)."""
    drafted = [[] for _ in plans]
    qs = [[] for _ in plans]
    host = iter(torch.cat([t for _, t, _ in steps]).tolist() if steps else ())
    for rows_at, _, q in steps:
        for j, r in enumerate(rows_at):
            i = active[r]
            drafted[i].append(next(host))
            if not plans[i].seq.sampling.greedy:
                qs[i].append(q[j])
    flat = [row for rows_i in qs for row in rows_i]
    parts = torch.stack(flat).cpu().split([len(q) for q in qs]) if flat else [None] * len(qs)
    return drafted, [part if q else None for q, part in zip(qs, parts)]


def synthetic_step(rng: np.random.Generator, vocab: int, dtype=torch.float16, device="cpu"):
    """Plans, active and steps as _draft builds them: sequences with num_draft 0..5 dropping out
    as they finish, a mix of greedy and sampled ones, each step's q a view of a wider buffer (as
    the graphed sampler's outputs are) with rows sparse, dense or at the size boundary."""
    n = int(rng.integers(1, 12))
    greedy = [bool(rng.random() < 0.3) for _ in range(n)]
    num_draft = [int(rng.integers(0, 6)) for _ in range(n)]
    plans = [types.SimpleNamespace(seq=types.SimpleNamespace(
        sampling=SamplingParams() if g else SamplingParams(temperature=1.0, seed=1), num_draft=k))
        for g, k in zip(greedy, num_draft)]
    active = [i for i in range(n) if num_draft[i]]
    seq_kind = {i: rng.choice(["few", "dense", "any", "boundary"]) for i in active}
    rows = list(range(len(active)))
    steps = []
    step = 0
    while rows:
        tokens = torch.from_numpy(rng.integers(0, 10**6, size=len(rows))).to(device, torch.int64)
        if all(greedy[active[r]] for r in rows):
            q = None
        else:
            buf = torch.full((len(rows) + 2, vocab + 3), 7.0, dtype=dtype)
            for j, r in enumerate(rows):
                kind = seq_kind[active[r]]
                if kind == "boundary":
                    nnz = int(np.clip(round((vocab - 2) / 3) + int(rng.integers(-1, 2)), 0, vocab))
                    buf[j, 1:1 + vocab] = make_rows(rng, 1, vocab, nnz)[0].to(dtype)
                else:
                    buf[j, 1:1 + vocab] = row_of_kind(rng, kind, vocab).to(dtype)
            q = buf.to(device)[:len(rows), 1:1 + vocab]
        steps.append((rows, tokens, q))
        step += 1
        rows = [r for r in rows if num_draft[active[r]] > step]
    return plans, active, steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_to_host_matches_the_old_tail_for_random_steps(dtype, device, monkeypatch):
    """_to_host (switch on, threshold 0 / at the step's row count / one over it / switch off)
    against the pre-change code: the same tokens per sequence, None for the same sequences, the
    same wire bytes; sparse exactly where the threshold is met and encode_probs' rule says so."""
    rng = np.random.default_rng(13 if dtype == torch.float16 else 17)
    sparse_seen = dense_seen = 0
    for trial in range(120):
        vocab = int(rng.choice([3, 5, 8, 40, 128]))
        plans, active, steps = synthetic_step(rng, vocab, dtype, device)
        ref_tokens, ref_probs = old_to_host(plans, active, steps)
        sampled_rows = sum(0 if p is None else p.shape[0] for p in ref_probs)
        on, min_rows = [(True, 0), (True, sampled_rows), (True, sampled_rows + 1), (False, 0)][trial % 4]
        monkeypatch.setattr(transport, "DRAFT_DEVICE_SPARSE", on)
        monkeypatch.setattr(transport, "DEVICE_SPARSE_MIN_ROWS", min_rows)
        tokens, probs = draft_module.DraftEngine._to_host(plans, active, steps)
        assert tokens == ref_tokens
        assert [p is None for p in probs] == [p is None for p in ref_probs]
        device_sparse = on and sampled_rows >= min_rows and dtype == torch.float16
        for p, ref in zip(probs, ref_probs):
            if ref is None:
                continue
            assert encode_probs(p, dtype) == encode_probs(ref, dtype)
            want_sparse = device_sparse and rule_sparse(true_nnz(ref), ref.shape[0], vocab)
            assert isinstance(p, SparseWeights) == want_sparse
            if want_sparse:
                sparse_seen += 1
            else:
                assert p.device.type == "cpu" and torch.equal(p.view(torch.int16), ref.cpu().view(torch.int16))
                dense_seen += 1
    assert dense_seen > 50 and (dtype == torch.bfloat16 or sparse_seen > 50)


def test_to_host_threshold_boundary(monkeypatch):
    """Exactly DEVICE_SPARSE_MIN_ROWS sampled rows goes to the device-sparse path; one fewer
    does not (the counts are then not fetched at all: nonzero_counts is not called)."""
    rng = np.random.default_rng(2)
    vocab = 64
    plans = [types.SimpleNamespace(seq=types.SimpleNamespace(sampling=SamplingParams(temperature=1.0, seed=1)))
             for _ in range(4)]
    active = [0, 1, 2, 3]
    steps = []
    for s in range(4):   # 4 sequences x 4 positions = 16 sampled rows, top-k-like
        steps.append((active, torch.arange(4) + 10 * s, make_rows(rng, 4, vocab, 8)))
    calls = []
    real = transport.nonzero_counts
    monkeypatch.setattr(transport, "nonzero_counts", lambda q: (calls.append(q.shape[0]), real(q))[1])
    monkeypatch.setattr(transport, "DRAFT_DEVICE_SPARSE", True)
    ref_tokens, ref_probs = old_to_host(plans, active, steps)
    default = transport.DEVICE_SPARSE_MIN_ROWS    # 16 as of 542f878
    for min_rows, sparse in ((16, True), (17, False), (15, True), (default, default <= 16)):
        calls.clear()
        monkeypatch.setattr(transport, "DEVICE_SPARSE_MIN_ROWS", min_rows)
        tokens, probs = draft_module.DraftEngine._to_host(plans, active, steps)
        assert tokens == ref_tokens == [[10 * s + i for s in range(4)] for i in range(4)]
        assert [isinstance(p, SparseWeights) for p in probs] == [sparse] * 4
        assert calls == ([16] if sparse else [])
        for p, ref in zip(probs, ref_probs):
            assert encode_probs(p) == encode_probs(ref)


# --------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))[1]


def random_params(rng: random.Random, seed: int) -> SamplingParams:
    # top_k 105 / 106 / 107 of the tiny model's 320 ids: one under, at and over the size rule's
    # boundary (6 * 106 + 4 == 2 * 320); low temperatures leave temperature-only rows with fp16 zeros
    kind = rng.choice(["greedy", "top_k", "top_k", "top_p", "min_p", "temp", "temp", "mixed"])
    t = rng.choice([0.05, 0.15, 0.3, 0.6, 1.0, 1.5, 3.0])
    if kind == "greedy":
        return SamplingParams()
    if kind == "top_k":
        return SamplingParams(temperature=t, top_k=rng.choice([1, 2, 5, 40, 105, 106, 107, 200, 320]), seed=seed)
    if kind == "top_p":
        return SamplingParams(temperature=t, top_p=rng.choice([0.05, 0.5, 0.9, 0.99]), seed=seed)
    if kind == "min_p":
        return SamplingParams(temperature=t, min_p=rng.choice([0.001, 0.01, 0.2]), seed=seed)
    if kind == "temp":
        return SamplingParams(temperature=t, seed=seed)
    return SamplingParams(temperature=t, top_k=rng.choice([10, 150]), top_p=rng.choice([0.7, 0.95]),
                          min_p=rng.choice([0.0, 0.02]), seed=seed)


def run_world(engine, monkeypatch, on: bool, min_rows: int, seqs):
    monkeypatch.setattr(transport, "DRAFT_DEVICE_SPARSE", on)
    monkeypatch.setattr(transport, "DEVICE_SPARSE_MIN_ROWS", min_rows)
    return engine.propose(seqs).outputs


@pytest.mark.parametrize("probs_dtype", [torch.float16, torch.bfloat16])
def test_engine_fuzz_switch_on_and_off_give_the_same_wire(draft_path, monkeypatch, probs_dtype):
    """Random batches over several steps (first, then plain or extend follow-ups), the same
    sequences drafted twice under different ids, once with the device-sparse path (at a random
    threshold around the step's sampled-row count) and once without: tokens, None-ness and
    encode_probs bytes agree sequence by sequence; an invalid sequence among them stays an error
    and moves nothing."""
    engine = DraftEngine(EngineConfig(model=draft_path, block_size=4, num_blocks=512,
                                      warmup_batch_sizes=(1, 2), probs_dtype=probs_dtype))
    vocab = engine.vocab_size
    rng = random.Random(0 if probs_dtype == torch.float16 else 1)
    stats = {"sparse": 0, "dense": 0, "none": 0, "under": 0, "boundary": 0}
    next_id = 1
    trials = 30 if probs_dtype == torch.float16 else 5
    for _ in range(trials):
        n = rng.randint(1, 9)
        params = [random_params(rng, rng.randrange(2**32)) for _ in range(n)]
        ids_on = list(range(next_id, next_id + n))
        ids_off = list(range(next_id + n, next_id + 2 * n))
        bogus = next_id + 2 * n        # never admitted: an unknown sequence, an error in both worlds
        next_id += 2 * n + 1
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for _ in range(n)]
        drafted = [0] * n              # drafts of the last proposal (keep's upper bound)
        for step in range(3):
            ks = [rng.choice([0, 1, 1, 2, 3, 4, 5]) for _ in range(n)]
            kinds = []
            for i in range(n):
                if step == 0:
                    kinds.append(("first", 0, prompts[i]))
                elif rng.random() < 0.5:
                    kinds.append(("extend", rng.randint(0, drafted[i]), []))
                else:
                    kinds.append(("plain", rng.randint(0, drafted[i]), [rng.randrange(vocab)]))

            def seqs(ids):
                out = [DraftSeqInput(ids[i], keep, new, ks[i], params[i], first=kind == "first",
                                     extend=kind == "extend") for i, (kind, keep, new) in enumerate(kinds)]
                out.insert(n // 2, DraftSeqInput(bogus, 0, [], 2, params[0]))
                return out

            sampled = sum(k for k, p in zip(ks, params) if not p.greedy)
            min_rows = rng.choice([0, max(sampled - 1, 0), sampled, sampled + 1, 16])
            on = run_world(engine, monkeypatch, True, min_rows, seqs(ids_on))
            off = run_world(engine, monkeypatch, False, 0, seqs(ids_off))
            assert len(on) == len(off) == n + 1
            for o in (on.pop(n // 2), off.pop(n // 2)):
                assert o.error is not None and o.tokens == [] and o.probs is None
            device_sparse = sampled >= min_rows and probs_dtype == torch.float16
            stats["under"] += sampled < min_rows
            for i, (a, b) in enumerate(zip(on, off)):
                assert a.error is None and b.error is None
                assert a.seq_id == ids_on[i] and b.seq_id == ids_off[i]
                assert a.tokens == b.tokens and len(a.tokens) == ks[i]
                assert all(0 <= t < vocab for t in a.tokens)
                has_rows = ks[i] > 0 and not params[i].greedy
                assert (a.probs is not None) == (b.probs is not None) == has_rows
                drafted[i] = ks[i]
                if not has_rows:
                    stats["none"] += 1
                    continue
                assert isinstance(b.probs, torch.Tensor) and b.probs.dtype == probs_dtype
                assert b.probs.shape == (ks[i], vocab) and tuple(a.probs.shape) == (ks[i], vocab)
                assert encode_probs(a.probs, probs_dtype) == encode_probs(b.probs, probs_dtype)
                nnz = true_nnz(b.probs)
                if abs(6 * nnz + 4 * ks[i] - 2 * ks[i] * vocab) <= 6 * ks[i]:
                    stats["boundary"] += 1
                want_sparse = device_sparse and rule_sparse(nnz, ks[i], vocab)
                assert isinstance(a.probs, SparseWeights) == want_sparse
                if not want_sparse:
                    assert torch.equal(a.probs.view(torch.int16), b.probs.view(torch.int16))
                # each drafted token has mass in its own row (rows not swapped between sequences)
                rows = dense_weights(a.probs).float()
                assert all(rows[j, t] > 0 for j, t in enumerate(a.tokens))
                stats["sparse" if want_sparse else "dense"] += 1
        engine.release(ids_on + ids_off)
    assert engine.states == {}   # every sequence released, the invalid one never admitted
    if probs_dtype == torch.float16:
        assert stats["sparse"] >= 20 and stats["dense"] >= 20 and stats["none"] >= 10 and stats["under"] >= 2
        assert stats["boundary"] >= 5
    else:
        assert stats["sparse"] == 0 and stats["dense"] >= 10
