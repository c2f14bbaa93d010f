"""Helpers of the service benchmarks (bench/services.py): weightless shape folders serve through
--random-weights engines and load in transformers, and α solved from tokens per step."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` and `services` are top-level

from prometheus_client import CollectorRegistry  # noqa: E402
from services import has_weights, leviathan_alpha, write_shape_folder  # noqa: E402

from specdec.metrics import CoordinatorMetrics, scrape, start_metrics_server  # noqa: E402

SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=9000, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def test_shape_folder_serves_random_weights(tmp_path):
    import transformers
    from specdec.config import EngineConfig
    from specdec.engine import TargetEngine, VerifySeqInput
    from specdec.tokenizer_info import tokenizer_fingerprint

    path = write_shape_folder(tmp_path / "t", SHAPE, dtype="float32")
    other = write_shape_folder(tmp_path / "d", {**SHAPE, "num_hidden_layers": 1}, dtype="float32")
    assert not has_weights(path)
    assert tokenizer_fingerprint(path) == tokenizer_fingerprint(other) != ""  # one shared tokenizer
    engine = TargetEngine(EngineConfig(model=path, num_blocks=8, random_weights=True))
    assert engine.model_config.vocab_size == 9000 and engine.model_config.num_layers == 2
    # ids past the borrowed tokenizer's 8192 are fine for the model
    out = engine.verify([VerifySeqInput(1, [5, 17, 8191, 8999, 3], first=True)]).outputs[0]
    assert out.error is None and 0 <= out.next_token < 9000
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    assert hf.config.vocab_size == 9000 and hf.config.num_hidden_layers == 2


@pytest.mark.parametrize("alpha, gamma", [(0.0, 4), (0.3, 1), (0.835, 4), (0.99, 8)])
def test_alpha_from_tokens_per_step(alpha, gamma):
    tau = sum(alpha ** i for i in range(gamma + 1))
    assert leviathan_alpha(tau, gamma) == pytest.approx(alpha, abs=1e-9)
    assert leviathan_alpha(gamma + 2, gamma) is None


def test_scrape_of_nothing_is_empty():
    from coordinator.launch import free_port
    from specdec.metrics import scrape
    assert scrape(f"127.0.0.1:{free_port()}") == {} and scrape(None) == {}


def _rec(sent, chunks, error=None):
    """A request record: sent at `sent`, chunks (arrival, tokens), done at the last chunk."""
    from services import Record
    r = Record(sent, first=chunks[0][0], done=chunks[-1][0], chunks=list(chunks), error=error)
    r.tokens = [0] * sum(n for _, n in chunks)
    return r


def test_steady_window_spans_full_batch_until_the_drain():
    from services import steady_tok_s, steady_window
    # Two slots, three requests. A: 0 -> first token at 1, done at 5. B: first at 2, done at 9.
    # C is sent when A finishes (5) and finishes at 12; the drain starts at B's finish (9), the
    # first after the last send.
    a = _rec(0.0, [(1.0, 1), (3.0, 2), (5.0, 2)])
    b = _rec(0.1, [(2.0, 1), (4.0, 3), (9.0, 3)])
    c = _rec(5.0, [(6.0, 1), (8.0, 2), (10.0, 1), (12.0, 1)])
    recs = [c, a, b]                      # any order: the window goes by send time
    assert steady_window(recs, 2) == (2.0, 9.0)
    # Chunks in (2, 9]: a 3.0 (2), 5.0 (2); b 4.0 (3), 9.0 (3); c 6.0 (1), 8.0 (2) = 13 tokens.
    assert steady_tok_s(recs, 2) == 13 / 7.0
    # The whole run's rate counts the drain (10.0 and 12.0, one slot busy) too.
    whole = sum(len(r.tokens) for r in recs) / 12.0
    assert steady_tok_s(recs, 2) > whole


def test_steady_window_is_none_without_a_clean_full_span():
    from services import steady_tok_s, steady_window
    a = _rec(0.0, [(1.0, 1), (2.0, 1)])
    b = _rec(0.0, [(3.0, 1), (4.0, 1)])
    # b's first token comes after a finished: no moment with both slots decoding
    assert steady_window([a, b], 2) is None and steady_tok_s([a, b], 2) is None
    failed = _rec(0.0, [(1.0, 1), (5.0, 1)], error="UNAVAILABLE: gone")
    ok = _rec(0.0, [(1.5, 1), (6.0, 1)])
    assert steady_window([failed, ok], 2) is None
    assert steady_window([], 1) is None
    # one slot, one request: first token to finish
    assert steady_window([ok], 1) == (1.5, 6.0) and steady_tok_s([ok], 1) == 1 / 4.5


def test_profiles_from_a_server_log(tmp_path):
    """decode_profile reads the last logged profile line of either kind (a whole step, or the graph
    replay alone), in seconds by batch size."""
    from types import SimpleNamespace
    from services import REPLAY_PROFILE, decode_profile
    log = tmp_path / "server.log"
    log.write_text("x decode forward profile (batch: ms): 1: 4.000, 8: 5.000\n"
                   "y decode replay profile (batch: ms): 1: 3.500, 8: 4.250\n"
                   "z decode forward profile (batch: ms): 1: 4.100, 8: 5.100\n")
    proc = SimpleNamespace(log_path=log)
    assert decode_profile(proc) == pytest.approx({1: 0.0041, 8: 0.0051})
    assert decode_profile(proc, REPLAY_PROFILE) == pytest.approx({1: 0.0035, 8: 0.00425})
    log.write_text("nothing logged\n")
    assert decode_profile(proc) == {} and decode_profile(proc, REPLAY_PROFILE) == {}


def test_steady_occupancy_counts_slots_between_first_and_last_token():
    from services import steady_occupancy
    # The window of test_steady_window_spans_full_batch_until_the_drain, (2, 9) with two slots:
    # A decodes 2..5, B 2..9, C 6..9 (sent at 5, first token at 6): 3 + 7 + 3 of 2 x 7.
    a = _rec(0.0, [(1.0, 1), (3.0, 2), (5.0, 2)])
    b = _rec(0.1, [(2.0, 1), (4.0, 3), (9.0, 3)])
    c = _rec(5.0, [(6.0, 1), (8.0, 2), (10.0, 1), (12.0, 1)])
    assert steady_occupancy([c, a, b], 2) == pytest.approx(13 / 14)
    # A last request whose first token comes after the window's end adds nothing (not a negative
    # span): sent at 8, first token at 11, while B's finish at 9 ends the window.
    late = _rec(8.0, [(11.0, 1), (13.0, 1)])
    assert steady_occupancy([c, a, b, late], 2) == pytest.approx(13 / 14)
    # Both slots streaming the whole window: 1.
    assert steady_occupancy([_rec(0.0, [(1.0, 1), (6.0, 1)]), _rec(0.0, [(1.0, 1), (7.0, 1)])], 2) == 1.0
    assert steady_occupancy([a], 2) is None          # fewer requests than slots: no window


def test_per_step_speedup_is_tau_times_the_step_ratio():
    from e2e import per_step
    row = {"tau": 3.2, "step_ms_plain": 5.0, "step_ms_spec": 8.0, "expected": 2.5}
    out = per_step(row)
    assert out["step_speedup"] == pytest.approx(2.0) and out["step_over_expected"] == pytest.approx(0.8)
    assert per_step({**row, "expected": None}) == {"step_speedup": pytest.approx(2.0)}
    assert per_step({**row, "step_ms_spec": None}) == {} and per_step({"tau": None}) == {}


def test_step_transport_state_names_one_transport_per_server_and_e2e_reads_it_back():
    from e2e import step_paths
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg)
    server = start_metrics_server(0, reg, addr="127.0.0.1")
    try:
        before = scrape(f"127.0.0.1:{server.port}")
        cm.set_step_transport("target", "socket")
        cm.set_step_transport("draft", "grpc")
        cm.set_step_transport("target", "shared")    # a later connection took shared slots
        samples = scrape(f"127.0.0.1:{server.port}")
    finally:
        server.close()
    assert step_paths(before) == {}                   # every series at 0: no step call yet
    assert len(before["specdec_step_transport_state"]) == 6
    assert step_paths(samples) == {"target": "shared", "draft": "grpc"}
    target = [v for labels, v in samples["specdec_step_transport_state"] if labels["role"] == "target"]
    assert sorted(target) == [0, 0, 1]
    with pytest.raises(ValueError, match="transport must be one of"):
        cm.set_step_transport("target", "pipe")


def test_e2e_counts_the_targets_steps_staged_ahead_between_two_scrapes():
    from e2e import ahead_counts
    from specdec.metrics import ServerMetrics
    reg = CollectorRegistry()
    sm = ServerMetrics(reg, "target")
    server = start_metrics_server(0, reg, addr="127.0.0.1")
    try:
        zero = scrape(f"127.0.0.1:{server.port}")
        sm.set_ahead(taken=3, dropped=1)
        before = scrape(f"127.0.0.1:{server.port}")
        sm.set_ahead(taken=9, dropped=3)
        after = scrape(f"127.0.0.1:{server.port}")
    finally:
        server.close()
    assert ahead_counts(before, after, "spec") == {"ahead_taken_spec": 6, "ahead_dropped_spec": 2,
                                                   "ahead_taken_frac_spec": 0.75}
    assert ahead_counts(zero, before, "plain")["ahead_taken_frac_plain"] == 0.75
    # Nothing staged (off), or a target without the counter: no share.
    assert ahead_counts(after, after, "spec")["ahead_taken_frac_spec"] is None
    assert ahead_counts({}, {}, "plain") == {"ahead_taken_plain": 0, "ahead_dropped_plain": 0,
                                             "ahead_taken_frac_plain": None}
