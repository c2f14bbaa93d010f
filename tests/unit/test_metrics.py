"""specdec/metrics.py and specdec/cost_model.py: names, gauge values for known inputs, exposition."""
from __future__ import annotations

import math
import random
import re
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specdec.cost_model import (CostProfile, ServerTiming, SpecStats, alpha_estimate, bucket_for,
                                expected_speedup)
from specdec.engine.timing import DecodeProfile
from specdec.metrics import (COORDINATOR_METRICS, SERVER_METRICS, CoordinatorMetrics, ServerMetrics,
                             all_metric_specs, exposed_series_names, histogram_mean, sample_value,
                             start_metrics_server)
from specdec.metrics import scrape as scrape_address


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


# --- naming -----------------------------------------------------------------------------------

def test_names_follow_prometheus_conventions():
    units = ("_seconds", "_total", "_ratio", "_coefficient", "_speedup", "_sequences", "_used",
             "_free", "_alpha", "_length", "_state")
    for spec in all_metric_specs().values():
        assert re.fullmatch(r"specdec_[a-z_]+", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert spec.name.endswith(units), f"{spec.name}: name should end in its unit"
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds") and list(spec.buckets) == sorted(spec.buckets)
        assert "le" not in spec.labels and spec.help


def test_design_names_exist():
    names = set(all_metric_specs())
    for n in ("specdec_draft_tokens_total", "specdec_accepted_tokens_total",
              "specdec_emitted_tokens_total", "specdec_spec_steps_total"):
        assert n in names


def test_exposed_names_match_a_real_scrape():
    reg = CollectorRegistry()
    CoordinatorMetrics(reg)
    sm_reg = CollectorRegistry()
    ServerMetrics(sm_reg, "draft")
    families = {f.name for r in (reg, sm_reg)
                for f in text_string_to_metric_families(generate_latest(r).decode())}
    for spec in COORDINATOR_METRICS + SERVER_METRICS:
        assert spec.name.removesuffix("_total") in families
    assert "specdec_draft_tokens_total" in exposed_series_names()
    assert "specdec_forward_seconds_bucket" in exposed_series_names()


def test_roles_are_checked():
    with pytest.raises(ValueError):
        ServerMetrics(CollectorRegistry(), "coordinator")
    with pytest.raises(ValueError):
        ServerMetrics(CollectorRegistry(), "drafter")


# --- cost model -------------------------------------------------------------------------------

def test_bucket_for():
    assert [bucket_for(b) for b in (1, 2, 3, 5, 8, 9, 256, 1000)] == [1, 2, 4, 8, 8, 16, 256, 256]
    with pytest.raises(ValueError):
        bucket_for(0)


def test_expected_speedup_formula():
    # Leviathan et al. Table/Fig. values: α = 0.8, γ = 4, c = 0 gives (1 - 0.8^5)/0.2 = 3.3616.
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert expected_speedup(1.0, 3, 0.1) == pytest.approx(4 / 1.3)  # α → 1 limit
    assert expected_speedup(0.0, 5, 0.1) == pytest.approx(1 / 1.5)  # nothing accepted
    assert expected_speedup(0.6, 0, 0.3) == pytest.approx(1.0)  # γ = 0 is plain decoding
    with pytest.raises(ValueError):
        expected_speedup(1.2, 4, 0.1)


def test_alpha_estimate_is_unbiased_where_accepted_over_drafted_is_not():
    rng, alpha, gamma = random.Random(0), 0.8, 4
    accepted = drafted = rejections = 0
    for _ in range(20000):
        a = 0
        while a < gamma and rng.random() < alpha:
            a += 1
        accepted, drafted, rejections = accepted + a, drafted + gamma, rejections + (a < gamma)
    assert alpha_estimate(accepted, rejections) == pytest.approx(alpha, abs=0.01)
    assert accepted / drafted == pytest.approx(0.59, abs=0.01)  # biased low: why we export both
    assert alpha_estimate(0, 0) is None


def test_cost_profile_warmup_median_then_ema():
    seen = []
    p = CostProfile(buckets=(1, 2, 4), ema_weight=0.5, on_update=lambda b, q, s: seen.append((b, q, s)))
    assert p.get(3) is None
    p.set_profiled(3, 1, [0.010, 0.5, 0.012])  # one slow launch does not move the median
    assert p.get(4) == pytest.approx(0.012) and p.get(3) == p.get(4)
    p.update(4, 1, 0.020)
    assert p.get(4) == pytest.approx(0.016)
    p.update(1, 5, 0.030)  # first live sample of a new entry initialises it
    p.update(1, 5, 0.300)  # a preempted forward (10x) counts as 2x the entry
    assert p.get(1, 5) == pytest.approx(0.045)
    p.update(1, 5, 0.030)
    assert p.table() == {(4, 1): pytest.approx(0.016), (1, 5): pytest.approx(0.0375)}
    assert seen[-1] == (1, 5, pytest.approx(0.0375))


def test_cost_profile_update_refuses_bad_samples_and_keeps_the_table():
    p = CostProfile(buckets=(1, 2, 4))
    p.update(2, 1, 0.010)
    for bad in ((2, 1, -0.001), (2, 0, 0.010)):
        with pytest.raises(ValueError):
            p.update(*bad)
    assert p.table() == {(2, 1): pytest.approx(0.010)}


def test_decode_profile_update_stores_before_it_tells_the_listeners():
    costs = CostProfile(buckets=(1, 2, 4), ema_weight=0.5)
    profile = DecodeProfile(costs)
    calls = []
    costs.subscribe(lambda b, q, sec: calls.append(("entry", b, q, sec)))
    profile.on_sample.append(lambda b, sec: calls.append(("sample", b, sec, profile(b))))
    profile.update(3, 0.010)
    profile.update(3, 0.020)
    assert calls == [("entry", 4, 1, pytest.approx(0.010)), ("sample", 3, 0.010, pytest.approx(0.010)),
                     ("entry", 4, 1, pytest.approx(0.015)), ("sample", 3, 0.020, pytest.approx(0.015))]


def test_cost_profile_profile_times_each_bucket():
    calls = []

    def fake_forward(b, q):
        calls.append((b, q))
        return 0.001 * b + 0.0001 * q

    p = CostProfile(buckets=(1, 2, 4, 8))
    table = p.profile(fake_forward, query_lens=(1, 5), repeats=3, warmup=1, max_batch=4)
    assert set(table) == {(b, q) for b in (1, 2, 4) for q in (1, 5)}
    assert table[(2, 5)] == pytest.approx(0.0025)
    assert len(calls) == 3 * 2 * 4


def test_spec_stats_known_step():
    st = SpecStats(buckets=(1, 2, 4))
    # Three sequences (bucket 4): γ = 4, 4, 0; accepted 4, 1, 0; emitted a + 1.
    st.add_step([4, 4, 0], [4, 1, 0], [5, 2, 1], step_seconds=0.020, propose_seconds=0.008,
                draft_timing=ServerTiming(0.004, 0.001, batch_size=3),
                target_timing=ServerTiming(0.006, 0.005, batch_size=3))
    w = st.window()
    assert st.c == {4: pytest.approx(0.2)}
    assert st.verify_ratio[4] == pytest.approx(1.2)
    plain = 0.020 - 0.008 - (0.006 - 0.005)  # estimate: no plain step seen yet
    assert st.plain_step_seconds(4) == pytest.approx(plain)
    assert w.c_system == pytest.approx((0.008 / 4) / plain)
    assert w.acceptance_ratio == pytest.approx(5 / 8)
    assert w.alpha == pytest.approx(5 / 6)
    assert w.mean_accepted_length == pytest.approx(3.5)
    assert w.mean_draft_length == pytest.approx(4.0)
    assert w.expected_speedup == pytest.approx(expected_speedup(5 / 6, 4, 0.2))
    assert w.measured_speedup == pytest.approx((8 / 3) * plain / 0.020)
    # An observed plain step replaces the estimate for its bucket.
    st.add_step([0, 0, 0], [0, 0, 0], [1, 1, 1], step_seconds=0.009)
    assert st.plain_step_seconds(4) == pytest.approx(0.009)
    assert st.c_system(4) == pytest.approx(0.002 / 0.009)


def test_spec_stats_prefill_steps_count_acceptance_not_time():
    st = SpecStats()
    st.add_step([3], [3], [4], step_seconds=1.0, propose_seconds=0.5, has_prefill=True,
                target_timing=ServerTiming(0.9, 0.01, batch_size=1))
    w = st.window()
    assert w.alpha == 1.0 and w.mean_accepted_length == 4.0
    assert st.plain_step_seconds(1) is None and st.c_system(1) is None and w.measured_speedup is None


def test_spec_stats_window_forgets_old_steps():
    st = SpecStats(window_steps=2)
    st.add_step([2], [0], [1], step_seconds=0.01)
    for _ in range(2):
        st.add_step([2], [2], [3], step_seconds=0.01)
    assert st.window().alpha == 1.0


def test_spec_stats_iid_acceptance_predicts_tau():
    # Under Leviathan's i.i.d. model Ŝ·(γc+1) is the expected tokens per step, i.e. τ.
    rng, st, alpha, gamma = random.Random(1), SpecStats(window_steps=100000), 0.7, 5
    for _ in range(4000):
        a = 0
        while a < gamma and rng.random() < alpha:
            a += 1
        st.add_step([gamma], [a], [a + 1], step_seconds=0.01)
    w = st.window()
    assert w.expected_speedup is None  # no c yet
    assert expected_speedup(w.alpha, w.mean_draft_length, 0.0) == pytest.approx(w.mean_accepted_length,
                                                                                  rel=0.02)


def test_spec_stats_rejects_bad_input():
    st = SpecStats()
    with pytest.raises(ValueError):
        st.add_step([2], [3], [4], step_seconds=0.01)
    with pytest.raises(ValueError):
        st.add_step([2, 2], [1], [2], step_seconds=0.01)


# --- prometheus recorders ---------------------------------------------------------------------

def test_spec_stats_plain_time_only_from_steps_that_decoded_plainly():
    """A step whose Propose failed (planned to draft, drafted all 0: its time holds the draft's
    timeout) and one whose sequences did not decode (a prompt chunk, a failed sequence: emitted 0)
    are no plain steps: neither sets the plain time, which the next real plain step does."""
    st = SpecStats(buckets=(1, 2))
    st.add_step([0], [0], [1], step_seconds=0.300, planned_spec=True)    # the Propose failed
    st.add_step([0, 0], [0, 0], [1, 0], step_seconds=0.050)              # one sequence did not decode
    assert st.plain_step_seconds(1) is None and st.plain_step_seconds(2) is None
    st.add_step([0], [0], [1], step_seconds=0.005)
    assert st.plain_step_seconds(1) == pytest.approx(0.005)


def test_spec_stats_draft_time_per_token_of_the_propose_that_ran():
    """A pipelined step: one sequence verifies drafts from the last step's extension (γ 6, not in
    this Propose), one was proposed 1 draft: the Propose's time is one draft forward's."""
    st = SpecStats(buckets=(2,))
    timing = dict(target_timing=ServerTiming(0.006, 0.005, batch_size=2))
    st.add_step([6, 1], [6, 0], [7, 1], step_seconds=0.02, propose_seconds=0.002, propose_gamma=1, **timing)
    assert st._draft_token[2] == pytest.approx(0.002)
    st2 = SpecStats(buckets=(2,))
    st2.add_step([6, 1], [6, 0], [7, 1], step_seconds=0.02, propose_seconds=0.002, **timing)
    assert st2._draft_token[2] == pytest.approx(0.002 / 6)   # (unsaid: γ is the step's most drafts)


def test_spec_stats_window_c_is_that_of_its_speculative_sequence_steps():
    """Ŝ(α, γ̄, c) takes c as α and γ̄ are counted: over speculative sequence-steps, so plain steps
    at a bucket whose c is known do not move it, and a bucket's c weighs by its drafting sequences."""
    st = SpecStats(buckets=(1, 8))

    def step(n, c, drafting):
        st.add_step([4] * drafting + [0] * (n - drafting), [2] * drafting + [0] * (n - drafting),
                    [3] * drafting + [1] * (n - drafting), step_seconds=0.01,
                    draft_timing=ServerTiming(0.001, c * 0.01, batch_size=n),
                    target_timing=ServerTiming(0.01, 0.01, batch_size=n))
    step(8, 0.5, 8)          # 8 speculative sequence-steps at c 0.5
    step(1, 0.1, 1)          # 1 at c 0.1
    for _ in range(20):
        step(8, 0.5, 0)      # plain steps at bucket 8: no sequence drafted
    assert st.window().c == pytest.approx((8 * 0.5 + 1 * 0.1) / 9)


def test_coordinator_metrics_step_modes_and_plain_sequence_steps():
    """step_seconds' mode: prefill for a step with prompt tokens, spec for one that was to draft
    (even if its Propose failed), plain otherwise; plain_steps_total counts sequences that decoded
    without drafts, not prompt chunks or failed sequences (emitted 0)."""
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2))
    cm.observe_step([0, 0], [0, 0], [0, 1], step_seconds=0.02, has_prefill=True)
    cm.observe_step([0], [0], [1], step_seconds=0.3, planned_spec=True)
    cm.observe_step([0, 0], [0, 0], [1, 0], step_seconds=0.01)
    s = scrape(reg)
    assert value(s, "specdec_step_seconds_count", mode="prefill") == 1
    assert value(s, "specdec_step_seconds_count", mode="spec") == 1
    assert value(s, "specdec_step_seconds_count", mode="plain") == 1
    assert value(s, "specdec_plain_steps_total") == 3


def test_host_time_histograms_resolve_tens_of_microseconds():
    """Stage, overhead and server-part histograms have buckets below 100 us, where a GPU host's
    coordinator stages (~20 us) fall."""
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1,))
    cm.observe_step([4], [4], step_seconds=0.005, stage_seconds={"schedule": 2e-5})
    s = scrape(reg)
    assert value(s, "specdec_stage_seconds_bucket", stage="schedule", le="1e-05") == 0
    assert value(s, "specdec_stage_seconds_bucket", stage="schedule", le="2.5e-05") == 1


def test_coordinator_metrics_gauges_and_counters():
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2, 4), max_positions=3)
    before = scrape(reg)
    assert math.isnan(value(before, "specdec_alpha"))
    assert value(before, "specdec_requests_total", code="INTERNAL") == 0.0
    cm.observe_step([4, 4, 0], [4, 1, 0], step_seconds=0.020,
                    stage_seconds={"propose": 0.008, "verify": 0.010},
                    draft_timing=ServerTiming(0.004, 0.001, batch_size=3),
                    target_timing=ServerTiming(0.006, 0.005, batch_size=3))
    s = scrape(reg)
    assert value(s, "specdec_draft_tokens_total") == 8
    assert value(s, "specdec_accepted_tokens_total") == 5
    assert value(s, "specdec_emitted_tokens_total") == 8
    assert value(s, "specdec_spec_steps_total") == 2 and value(s, "specdec_plain_steps_total") == 1
    assert value(s, "specdec_rejections_total") == 1
    assert value(s, "specdec_draft_tokens_by_position_total", position="1") == 2
    assert value(s, "specdec_accepted_tokens_by_position_total", position="2") == 1
    assert value(s, "specdec_accepted_tokens_by_position_total", position=">3") == 1
    assert value(s, "specdec_draft_tokens_by_position_total", position=">3") == 2
    assert value(s, "specdec_cost_coefficient", batch="4") == pytest.approx(0.2)
    assert value(s, "specdec_verify_cost_ratio", batch="4") == pytest.approx(1.2)
    assert value(s, "specdec_system_cost_coefficient", batch="4") == pytest.approx(0.002 / 0.011)
    assert value(s, "specdec_alpha") == pytest.approx(5 / 6)
    assert value(s, "specdec_acceptance_ratio") == pytest.approx(5 / 8)
    assert value(s, "specdec_mean_accepted_length") == pytest.approx(3.5)
    assert value(s, "specdec_expected_speedup", basis="model") == pytest.approx(
        expected_speedup(5 / 6, 4, 0.2))
    assert value(s, "specdec_measured_speedup") == pytest.approx(8 / 3 * 0.011 / 0.020)
    assert value(s, "specdec_stage_seconds_count", stage="propose") == 1
    assert value(s, "specdec_step_seconds_count", mode="spec") == 1
    with pytest.raises(ValueError):
        cm.observe_step([1], [1], step_seconds=0.1, stage_seconds={"draft": 0.1})


def test_bucket_gauges_follow_every_step_of_every_bucket():
    """The per-bucket gauges are written only when their value moves; after each of many steps in
    two buckets, with timings that change and repeat, each gauge reads what SpecStats holds."""
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2, 4, 8))
    rng = random.Random(3)
    for step in range(40):
        b = rng.choice([1, 8])
        fwd = rng.choice([0.001, 0.002, 0.002, 0.004])
        cm.observe_step([4] * b, [rng.randint(0, 4) for _ in range(b)], step_seconds=0.02,
                        stage_seconds={"propose": 0.008},
                        draft_timing=ServerTiming(fwd, fwd, batch_size=b),
                        target_timing=ServerTiming(0.006, 0.005, batch_size=b))
        s = scrape(reg)
        for bucket in cm.stats.buckets_seen():
            for name, want in (("specdec_cost_coefficient", cm.stats.c.get(bucket)),
                               ("specdec_system_cost_coefficient", cm.stats.c_system(bucket)),
                               ("specdec_plain_step_seconds", cm.stats.plain_step_seconds(bucket))):
                if want is not None:
                    assert value(s, name, batch=str(bucket)) == pytest.approx(want), (step, name, bucket)


def test_step_overhead_is_step_time_outside_the_servers():
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2, 4))
    assert value(scrape(reg), "specdec_step_overhead_seconds_count", mode="spec") == 0  # exported up front
    draft = ServerTiming(0.004, 0.001, batch_size=2, step_seconds=0.0050)
    target = ServerTiming(0.006, 0.005, batch_size=2, step_seconds=0.0070)
    cm.observe_step([3, 3], [1, 2], step_seconds=0.0131, draft_timing=draft, target_timing=target)
    cm.observe_step([0, 0], [0, 0], step_seconds=0.0075, target_timing=target)            # plain: no Propose
    cm.observe_step([0], [0], step_seconds=0.0075, target_timing=ServerTiming(0.006, 0.005))  # no step time
    s = scrape(reg)
    assert value(s, "specdec_step_overhead_seconds_sum", mode="spec") == pytest.approx(0.0011)
    assert value(s, "specdec_step_overhead_seconds_sum", mode="plain") == pytest.approx(0.0005)
    assert value(s, "specdec_step_overhead_seconds_count", mode="plain") == 1
    # The servers' own step time, split into forward (device) and host time.
    assert value(s, "specdec_server_step_seconds_sum", role="draft", part="forward") == pytest.approx(0.004)
    assert value(s, "specdec_server_step_seconds_sum", role="draft", part="host") == pytest.approx(0.001)
    assert value(s, "specdec_server_step_seconds_count", role="draft", part="host") == 1
    assert value(s, "specdec_server_step_seconds_sum", role="target", part="host") == pytest.approx(0.002)
    assert value(s, "specdec_server_step_seconds_count", role="target", part="forward") == 2


def test_step_overhead_leaves_out_a_pipelined_steps_wait_for_the_extension():
    """The extension Propose is one of the step's RPCs: its wait (stage "ahead") is draft time."""
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1,))
    cm.observe_step([4], [4], step_seconds=0.015, stage_seconds={"ahead": 0.006},
                    target_timing=ServerTiming(0.006, 0.005, batch_size=1, step_seconds=0.007))
    assert value(scrape(reg), "specdec_step_overhead_seconds_sum", mode="spec") == pytest.approx(0.002)


def test_coordinator_request_metrics():
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg)
    cm.observe_first_token(0.2)
    cm.observe_request("OK", duration_seconds=1.2, output_tokens=11, ttft_seconds=0.2)
    cm.observe_request("INVALID_ARGUMENT", duration_seconds=0.001, output_tokens=0)
    s = scrape(reg)
    assert value(s, "specdec_requests_total", code="OK") == 1
    assert value(s, "specdec_requests_total", code="INVALID_ARGUMENT") == 1
    assert value(s, "specdec_request_duration_seconds_count") == 2
    assert value(s, "specdec_time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert value(s, "specdec_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    assert value(s, "specdec_time_per_output_token_seconds_count") == 1


def test_server_metrics_forward_profile_and_kv():
    reg = CollectorRegistry()
    sm = ServerMetrics(reg, "target", buckets=(1, 2, 4), ema_weight=0.5)
    # The engine's own profile: warm-up entries already there show up when it is watched.
    engine_profile = CostProfile(buckets=(1, 2, 4), ema_weight=0.5)
    engine_profile.set_profiled(4, 1, [0.004, 0.004, 0.006])
    sm.watch_profile(engine_profile)
    engine_profile.update(3, 1, 0.006)
    engine_profile.update(3, 5, 0.007)
    sm.observe_forward("decode", 3, 0.006)
    sm.observe_forward("verify", 3, 0.007)
    sm.observe_forward("verify", 2, 0.5)
    sm.observe_forward("prefill", 1, 0.5)
    sm.set_kv(used=10, free=90)
    sm.set_forwards(graph=5, eager=2)
    sm.set_forwards(graph=7, eager=2)   # running totals: the counters move by the difference
    sm.set_ahead(taken=0, dropped=1)
    sm.set_ahead(taken=4, dropped=1)
    sm.set_running(3)
    sm.observe_rpc("Verify", 0.01)
    sm.count_error("INVALID_ARGUMENT")
    s = scrape(reg)
    assert value(s, "specdec_forward_profile_seconds", role="target", batch="4", query_len="1") == \
        pytest.approx(0.005)
    assert value(s, "specdec_forward_profile_seconds", role="target", batch="4", query_len="5") == \
        pytest.approx(0.007)
    assert value(s, "specdec_forward_seconds_count", role="target", phase="verify") == 2
    assert value(s, "specdec_forward_seconds_count", role="target", phase="prefill") == 1
    assert value(s, "specdec_kv_blocks_used", role="target") == 10
    assert value(s, "specdec_kv_blocks_free", role="target") == 90
    assert value(s, "specdec_server_forwards_total", role="target", path="graph") == 7
    assert value(s, "specdec_server_forwards_total", role="target", path="eager") == 2
    assert value(s, "specdec_verify_ahead_steps_total", role="target", outcome="taken") == 4
    assert value(s, "specdec_verify_ahead_steps_total", role="target", outcome="dropped") == 1
    assert value(s, "specdec_running_sequences", role="target") == 3
    assert value(s, "specdec_rpc_seconds_count", role="target", rpc="Verify") == 1
    assert value(s, "specdec_errors_total", role="target", code="INVALID_ARGUMENT") == 1
    with pytest.raises(ValueError):
        sm.observe_forward("draft", 1, 0.1)


def test_start_metrics_server_serves_the_registry():
    reg = CollectorRegistry()
    ServerMetrics(reg, "draft").set_kv(1, 2)
    server = start_metrics_server(0, reg, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.close()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "specdec_kv_blocks_free" in names and "specdec_draft_tokens_total" not in names


def test_scrape_reads_values_and_histogram_means_back():
    """What the demo and the benchmarks read from a process: gauges by label (NaN skipped) and the
    mean of a labelled histogram over a whole scrape or between two."""
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2, 4))
    timing = ServerTiming(0.006, 0.005, batch_size=1, step_seconds=0.007)
    cm.observe_step([2], [1], step_seconds=0.010, draft_timing=ServerTiming(0.001, 0.001, step_seconds=0.002),
                    target_timing=timing)
    server = start_metrics_server(0, reg, addr="127.0.0.1")
    try:
        before = scrape_address(f"127.0.0.1:{server.port}")
        cm.observe_step([2], [2], step_seconds=0.012, draft_timing=ServerTiming(0.001, 0.001, step_seconds=0.002),
                        target_timing=timing)
        cm.observe_step([0], [0], step_seconds=0.008, target_timing=timing)
        after = scrape_address(f"127.0.0.1:{server.port}")
    finally:
        server.close()
    assert sample_value(after, "specdec_cost_coefficient", batch="1") == pytest.approx(0.2)
    assert sample_value(after, "specdec_cost_coefficient", batch="4") is None   # NaN: not measured
    assert sample_value(after, "specdec_draft_tokens_total") == 4
    assert histogram_mean(after, "specdec_step_seconds", mode="spec") == pytest.approx(0.011)
    assert histogram_mean(after, "specdec_step_seconds", before, mode="spec") == pytest.approx(0.012)
    assert histogram_mean(after, "specdec_step_overhead_seconds", before, mode="plain") == pytest.approx(0.001)
    assert histogram_mean(before, "specdec_step_seconds", mode="plain") is None


def test_metrics_import_no_torch():
    # The coordinator imports specdec.metrics and must stay torch-free (DESIGN.md section 1).
    import subprocess
    import sys
    code = ("import sys, specdec.metrics, specdec.cost_model, coordinator.service, coordinator.__main__; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=__file__.rsplit("/tests/", 1)[0]).returncode == 0


def test_engine_decode_profile_is_a_view_of_one_cost_profile():
    from specdec.engine.timing import DecodeProfile

    costs = CostProfile(buckets=(1, 2, 4), ema_weight=0.5)
    profile, samples = DecodeProfile(costs), []
    profile.on_sample.append(lambda b, s: samples.append((b, s)))
    profile.set(2, 0.004)  # warm-up: no live sample
    profile.update(3, 0.010)  # bucket 4, first live sample
    profile.update(2, 0.006)
    assert costs.table() == {(2, 1): pytest.approx(0.005), (4, 1): pytest.approx(0.010)}
    assert profile.table() == {2: pytest.approx(0.005), 4: pytest.approx(0.010)}
    assert profile(4) == profile(3) == pytest.approx(0.010)
    assert profile(1) == 0.0 and profile(0) == 0.0  # never timed; no forward at all
    assert samples == [(3, 0.010), (2, 0.006)]
