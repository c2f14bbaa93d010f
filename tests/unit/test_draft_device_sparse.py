"""The draft's sampled rows leave the device as their nonzeros where the sparse encoding is smaller
(transport.draft_rows_to_host): the wire bytes must be those the dense rows gave through
encode_probs, row for row and in the same encoding, whatever mix of sequences shares the step."""
from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import DraftEngine, DraftSeqInput
from specdec.sampling import transport
from specdec.sampling.params import SamplingParams
from specdec.sampling.transport import (SparseWeights, dense_weights, draft_rows_to_host, encode_probs,
                                        nonzero_counts, round_probs)
from tests.helpers.tiny_models import make_pair

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _rows(kinds: list[str], vocab: int, gen: torch.Generator) -> torch.Tensor:
    """fp16 weight rows: 'topk' keeps 5 ids (one an explicit -0.0 among the zeros), 'dense' all."""
    out = []
    for kind in kinds:
        p = torch.rand(vocab, generator=gen, dtype=torch.float64) + 1e-3
        if kind == "topk":
            keep = torch.randperm(vocab, generator=gen)[:5]
            p = torch.zeros(vocab, dtype=torch.float64).index_fill_(0, keep, 1.0) * p
        w = round_probs(p / p.sum(), torch.float16).half()
        if kind == "topk":
            w[(w == 0).nonzero()[0, 0]] = -0.0
        out.append(w)
    return torch.stack(out)


def _same_wire(got, want: torch.Tensor) -> None:
    a, b = encode_probs(got, torch.float16), encode_probs(want, torch.float16)
    assert a == b, (a.encoding, b.encoding)
    # the same weights, up to the sign of a zero (-0.0 is no mass, and no nonzero on the wire)
    assert torch.equal(dense_weights(got).view(torch.int16) & 0x7FFF, want.view(torch.int16) & 0x7FFF)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_to_host_gives_the_dense_rows_wire_bytes(device):
    vocab = 64
    gen = torch.Generator().manual_seed(0)
    # per sequence: row kinds (a sequence with no rows is a greedy one)
    seqs = [["topk", "topk"], [], ["dense", "topk", "dense"], ["topk"], ["dense"], ["topk", "dense"]]
    lengths = [len(s) for s in seqs]
    q = _rows([k for s in seqs for k in s], vocab, gen).to(device)
    counts = nonzero_counts(q).tolist()
    assert counts == [int(((r.view(torch.int16) & 0x7FFF) != 0).sum()) for r in q.cpu()]
    out = draft_rows_to_host(q, lengths, counts)
    assert out[1] is None
    # sparse where 6 bytes a nonzero + 4 a row beat 2 a weight: all-top-k sequences only here
    assert [isinstance(o, SparseWeights) for o in out] == [True, False, False, True, False, False]
    start = 0
    for n, o in zip(lengths, out):
        if n:
            assert o.shape == (n, vocab) and dense_weights(o).device.type == "cpu"
            _same_wire(o, q[start:start + n].cpu())
        start += n
    # no counts (bf16 transport, or the switch off): every row dense
    dense = draft_rows_to_host(q, lengths, None)
    assert not any(isinstance(o, SparseWeights) for o in dense)
    assert torch.equal(torch.cat([o for o in dense if o is not None]), q.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_rows_to_host_when_every_row_is_sparse_or_none_is(device):
    vocab = 48
    gen = torch.Generator().manual_seed(1)
    q = _rows(["topk"] * 5, vocab, gen).to(device)
    out = draft_rows_to_host(q, [2, 3], nonzero_counts(q).tolist())
    assert all(isinstance(o, SparseWeights) for o in out)
    _same_wire(out[0], q[:2].cpu())
    _same_wire(out[1], q[2:].cpu())
    q = _rows(["dense"] * 3, vocab, gen).to(device)
    out = draft_rows_to_host(q, [0, 3, 0], nonzero_counts(q).tolist())
    assert out[0] is None and out[2] is None and torch.equal(out[1], q.cpu())
    assert nonzero_counts(q.bfloat16()) is None   # no sparse form for bf16


def test_rows_to_host_refuses_counts_that_do_not_fit_the_rows():
    q = torch.zeros(2, 16, dtype=torch.float16)
    q[0, 3], q[1, 7] = 0.5, 0.25
    with pytest.raises(ValueError, match="above the rows' nonzeros"):
        draft_rows_to_host(q, [2], [2, 1])
    with pytest.raises(ValueError, match="counts"):
        draft_rows_to_host(q, [2], [1])
    with pytest.raises(ValueError, match="fp16 rows only"):
        draft_rows_to_host(q.bfloat16(), [2], [1, 1])
    with pytest.raises(ValueError, match="lengths summing to 3"):
        draft_rows_to_host(q, [1, 2], None)
    assert encode_probs(draft_rows_to_host(q, [2], [1, 1])[0]).encoding == "SPARSE_FP16"


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))[1]


def test_the_draft_engine_sends_the_same_bytes_with_the_switch_on_and_off(draft_path, monkeypatch):
    """One propose mixing top-k, top-p, temperature-only and greedy sequences of different
    lengths: the rows found on the device are the rows the dense copy gave, byte for byte on the
    wire, and the tokens are the same."""
    engine = DraftEngine(EngineConfig(model=draft_path, block_size=4, num_blocks=96, warmup_batch_sizes=(1, 2)))
    params = [SamplingParams(temperature=0.9, top_k=8, seed=1), SamplingParams(temperature=0.7, top_p=0.5, seed=2),
              SamplingParams(temperature=1.2, seed=3), SamplingParams(), SamplingParams(temperature=0.8, top_k=3, seed=4)]
    drafts = [3, 2, 3, 2, 1]

    def run(on: bool, first_id: int, min_rows: int = 0):
        monkeypatch.setattr(transport, "DRAFT_DEVICE_SPARSE", on)
        monkeypatch.setattr(transport, "DEVICE_SPARSE_MIN_ROWS", min_rows)
        seqs = [DraftSeqInput(first_id + i, 0, [5 + i, 6, 7], k, p, first=True)
                for i, (k, p) in enumerate(zip(drafts, params))]
        outs = engine.propose(seqs).outputs
        engine.release([s.seq_id for s in seqs])
        return outs

    on, off = run(True, 100), run(False, 200)
    assert [o.tokens for o in on] == [o.tokens for o in off]
    kinds = []
    for a, b, k in zip(on, off, drafts):
        assert (a.probs is None) == (b.probs is None)
        if a.probs is None:
            continue
        assert not isinstance(b.probs, SparseWeights) and a.probs.shape == (k, engine.vocab_size)
        assert encode_probs(a.probs, torch.float16) == encode_probs(b.probs, torch.float16)
        kinds.append(isinstance(a.probs, SparseWeights))
    assert kinds == [True, True, False, True]   # temperature only: dense rows stay dense
    # fewer sampled rows than the threshold (9 here): every row densely, the same bytes again
    few = run(True, 300, min_rows=10)
    assert not any(isinstance(o.probs, SparseWeights) for o in few)
    assert [encode_probs(o.probs) for o in few if o.probs is not None] == \
        [encode_probs(o.probs) for o in off if o.probs is not None]
