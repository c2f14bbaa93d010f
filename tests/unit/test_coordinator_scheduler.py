"""Coordinator logic without servers: admission, γ policy, request validation, compatibility."""
from __future__ import annotations

import pytest

from coordinator.app import IncompatibleModels, check_draft_compatible
from coordinator.gamma import best_gamma, choose_num_draft, expected_speedup, request_alpha
from coordinator.scheduler import KVCapacity, Rejected, Scheduler
from coordinator.sequence import GenParams, Sampling, Sequence
from coordinator.tokenizer import TextTokenizer
from coordinator.validation import InvalidRequest, Limits, validate
from protos import specdec_pb2 as pb
from tests.helpers.tiny_models import _tokenizer_json


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(_tokenizer_json(320))
    return TextTokenizer(path)


def seq(tok, i, prompt_len=10, max_new=22, speculate=True) -> Sequence:
    params = GenParams(request_id=str(i), prompt_ids=tuple([5] * prompt_len), max_new_tokens=max_new,
                       sampling=Sampling(), speculate=speculate)
    return Sequence(seq_id=i, params=params, max_len=128, tokenizer=tok)


def test_admission_respects_batch_size_kv_and_queue(tok):
    # 32 tokens = 2 blocks per request; the target has 5 blocks, the draft 2.
    s = Scheduler(max_batch_size=3, max_waiting=1, target=KVCapacity("target", 5, 16),
                  draft=KVCapacity("draft", 2, 16))
    a, b, c, d = (seq(tok, i) for i in range(4))
    for x in (a, b, c):
        s.submit(x)
    # c will wait (KV for two), d would be a second waiting one: the free batch slot does not
    # count, the KV cannot fill it.
    with pytest.raises(Rejected, match="max_batch_size 3, 0 of 5 target KV blocks reserved"):
        s.submit(d)
    assert s.admit() == [a, b]  # c waits for KV although a batch slot is free
    assert a.use_draft and not b.use_draft  # no draft room for b: plain decoding
    s.retire(a)
    assert s.release_target == {a.seq_id} and s.release_draft == set()  # a never reached the draft
    assert s.admit() == [c] and c.use_draft


def test_request_larger_than_the_cache_is_refused(tok):
    s = Scheduler(4, 4, KVCapacity("target", 3, 16), None)
    with pytest.raises(Rejected, match="kv cache.*needs 4 KV blocks"):
        s.submit(seq(tok, 1, prompt_len=20, max_new=40))


def test_cancel_of_waiting_and_running(tok):
    s = Scheduler(1, 2, KVCapacity("target", 100, 16), None)
    a, b = seq(tok, 1), seq(tok, 2)
    s.submit(a)
    s.submit(b)
    s.admit()
    s.cancel(b)
    assert b.done and not s.waiting
    s.cancel(a)
    assert s.drop_cancelled() == [a] and not s.running and s.release_target == {1}


def test_expected_speedup_and_gamma_policy():
    assert expected_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    assert best_gamma(0.95, 0.01, 8) == 8
    assert best_gamma(0.3, 0.3, 8) == 1
    kw = dict(policy="fixed", default=4, max_gamma=8, accepted=0, rejections=0, global_alpha=None, c=None)
    assert choose_num_draft(requested=0, **kw) == 4
    assert choose_num_draft(requested=6, **kw) == 6
    kw.update(policy="auto", accepted=95, rejections=2, c=0.02)
    assert choose_num_draft(requested=0, **kw) >= 6


def test_request_alpha_counts_tested_tokens():
    # Leviathan's α: accepted / (accepted + rejections), shrunk towards the prior (weight 8).
    assert request_alpha(0, 0, 0.5) == pytest.approx(0.5)
    assert request_alpha(12, 4, None) == pytest.approx((12 + 8 * 0.6) / (16 + 8))
    assert request_alpha(1000, 0, 0.1) > 0.99  # γ drafted and all accepted: no tokens go untested


LIMITS = Limits(vocab_size=320, max_model_len=64, max_num_draft=8, eos_token_ids=frozenset({0}))


@pytest.mark.parametrize("build, field", [
    (lambda r: None, "prompt"),
    (lambda r: setattr(r, "text", ""), "prompt"),
    (lambda r: r.token_ids.ids.extend([1, 320]), "prompt.token_ids: token id 320"),
    (lambda r: r.token_ids.ids.extend([1] * 64), "prompt: 64 tokens"),
    (lambda r: (setattr(r, "text", "hi"), setattr(r, "max_new_tokens", -1)), "max_new_tokens"),
    (lambda r: (setattr(r, "text", "hi"), setattr(r.sampling, "temperature", -1)), "sampling.temperature"),
    (lambda r: (setattr(r, "text", "hi"), setattr(r.sampling, "temperature", float("nan"))),
     "sampling.temperature"),
    (lambda r: (setattr(r, "text", "hi"), setattr(r.sampling, "top_p", 1.5)), "sampling.top_p"),
    (lambda r: (setattr(r, "text", "hi"), setattr(r.sampling, "top_k", -2)), "sampling.top_k"),
    (lambda r: (setattr(r, "text", "hi"), setattr(r.sampling, "min_p", 2)), "sampling.min_p"),
    (lambda r: (setattr(r, "text", "hi"), r.stop.append("")), "stop[0]"),
    (lambda r: (setattr(r, "text", "hi"), r.stop_token_ids.append(999)), "stop_token_ids"),
    (lambda r: (setattr(r, "text", "hi"), setattr(r, "num_draft", 99)), "num_draft"),
])
def test_validation_names_the_field(tok, build, field):
    req = pb.GenerateRequest(max_new_tokens=4)
    build(req)
    with pytest.raises(InvalidRequest) as e:
        validate(req, LIMITS, tok)
    assert str(e.value).startswith(field), str(e.value)


def test_validation_fills_defaults(tok):
    p = validate(pb.GenerateRequest(text="def f", max_new_tokens=4, ignore_eos=True,
                                    speculation=pb.SPECULATION_MODE_OFF), LIMITS, tok)
    assert p.prompt_ids == tuple(tok.encode("def f")) and not p.speculate
    assert p.eos_token_ids == frozenset() and p.request_id and p.sampling.top_p == 1.0
    assert 0 <= p.sampling.seed < 2 ** 64


@pytest.mark.parametrize("t, want", [(1e-45, 0.0), (1e-38, 0.0), (9.9e-6, 0.0), (1.1e-5, 1.1e-5), (0.7, 0.7)])
def test_temperatures_below_the_greedy_bound_are_greedy(tok, t, want):
    """logits / T overflows float32 near T = 1e-38 (NaN probabilities: INVALID_ARGUMENT about
    draft_probs, or garbage tokens without speculation, found by the chaos review); below
    GREEDY_BELOW_TEMPERATURE a request is greedy, as the servers read it too."""
    req = pb.GenerateRequest(text="def f", max_new_tokens=4)
    req.sampling.temperature = t
    got = validate(req, LIMITS, tok).sampling.temperature
    assert got == pytest.approx(want, rel=1e-6)  # the wire's float32
    assert (got == 0.0) is (want == 0.0)


def test_incompatible_draft_is_named():
    t = pb.ModelInfo(model_name="T", vocab_size=320, tokenizer_fingerprint="a" * 64)
    check_draft_compatible(t, pb.ModelInfo(model_name="D", vocab_size=320, tokenizer_fingerprint="a" * 64))
    with pytest.raises(IncompatibleModels, match="vocab_size: target 320 != draft 512.*tokenizer_fingerprint"):
        check_draft_compatible(t, pb.ModelInfo(model_name="D", vocab_size=512, tokenizer_fingerprint="b" * 64))
