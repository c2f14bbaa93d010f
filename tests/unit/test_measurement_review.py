"""Review of "measurement as a feature": α, c, τ, Ŝ and their Prometheus export against DESIGN.md
section 3 and Leviathan et al. 2023 (Def. 3.7, Thm. 3.8). Every expected value is computed by hand
here from the definitions, never read back from the code. Complements test_metrics.py (single
known steps), test_dashboard.py (metric names only) and test_spec_loop_pipeline.py (exactness)."""
from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.sequence import Finish, GenParams, Sampling, Sequence
from protos.wire import unpack_ids
from specdec.cost_model import ServerTiming, expected_speedup
from specdec.metrics import CoordinatorMetrics, ServerMetrics, all_metric_specs
from tests.unit.test_spec_loop_faults import (MAX_LEN, PROMPT, FakeDraft, collect, make_loop, model,
                                              plain_greedy, tokenizer)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "specdec.json"


def get(reg: CollectorRegistry, name: str, **labels) -> float | None:
    return reg.get_sample_value(name, labels)


# --- α, τ, γ̄ over sequences with different γ, plain sequences, prefill, the window -------------

def test_alpha_tau_gamma_over_mixed_gamma_and_plain_sequences():
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2, 4), max_positions=3)
    # Step 1, four sequences: γ 4, 2, 0 (plain), 1; accepted 2, 2, 0, 0. Step 2: γ 3, all accepted.
    cm.observe_step([4, 2, 0, 1], [2, 2, 0, 0], step_seconds=0.01)
    cm.observe_step([3], [3], [2], step_seconds=0.01)  # a stop token cut the emitted tokens to 2
    # Tested tokens: seq 1 tests 3 (2 accepted + the rejected one), seq 2 tests 2 (no rejection),
    # seq 4 tests 1 (rejected), step 2 tests 3. α = 7 accepted / 9 tested.
    assert get(reg, "specdec_alpha") == pytest.approx(7 / 9)
    assert get(reg, "specdec_acceptance_ratio") == pytest.approx(7 / 10)   # DESIGN's accepted / drafted
    assert get(reg, "specdec_mean_accepted_length") == pytest.approx(1 + 7 / 4)  # 4 speculative seq-steps
    assert get(reg, "specdec_mean_draft_length") == pytest.approx(10 / 4)
    counts = {"draft_tokens": 10, "accepted_tokens": 7, "emitted_tokens": 3 + 3 + 1 + 1 + 2,
              "spec_steps": 4, "plain_steps": 1, "rejections": 2}
    for name, want in counts.items():
        assert get(reg, f"specdec_{name}_total") == want, name
    # Position p: drafted by sequences with γ >= p, accepted by those with accepted >= p.
    for pos, (d, a) in {"1": (4, 3), "2": (3, 3), "3": (2, 1), ">3": (1, 0)}.items():
        assert get(reg, "specdec_draft_tokens_by_position_total", position=pos) == d, pos
        assert get(reg, "specdec_accepted_tokens_by_position_total", position=pos) == a, pos
    assert math.isnan(get(reg, "specdec_expected_speedup", basis="model"))  # no c reported yet


def test_prefill_and_plain_steps_move_acceptance_only_as_defined():
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2))
    cm.observe_step([0, 0], [0, 0], [0, 1], step_seconds=0.5, has_prefill=True)  # prompt chunks only
    assert math.isnan(get(reg, "specdec_alpha")) and math.isnan(get(reg, "specdec_mean_accepted_length"))
    cm.observe_step([0], [0], step_seconds=0.004)  # plain decoding: a plain step time, no α
    assert math.isnan(get(reg, "specdec_alpha"))
    assert get(reg, "specdec_plain_step_seconds", batch="1") == pytest.approx(0.004)
    # A speculative step with a prompt in it: its acceptance counts, its time does not.
    cm.observe_step([3], [1], step_seconds=0.9, stage_seconds={"propose": 0.8}, has_prefill=True)
    assert get(reg, "specdec_alpha") == pytest.approx(1 / 2)
    assert get(reg, "specdec_plain_step_seconds", batch="1") == pytest.approx(0.004)
    assert get(reg, "specdec_system_cost_coefficient", batch="1") is None
    assert math.isnan(get(reg, "specdec_measured_speedup"))


def test_window_gauges_forget_old_steps_while_counters_accumulate():
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1,), window_steps=2)
    for (d, a), c in zip([(2, 0), (2, 2), (2, 1)], [0.1, 0.2, 0.4]):
        cm.observe_step([d], [a], step_seconds=0.01, draft_timing=ServerTiming(0.02, c * 0.01, batch_size=1),
                        target_timing=ServerTiming(0.012, 0.01, batch_size=1))
    # Window = last two steps: accepted 3, tested 2 + 2 = 4 → α 3/4; mean c (0.2 + 0.4) / 2.
    assert get(reg, "specdec_alpha") == pytest.approx(3 / 4)
    assert get(reg, "specdec_acceptance_ratio") == pytest.approx(3 / 4)
    alpha, gamma, c = 3 / 4, 2.0, 0.3
    assert get(reg, "specdec_expected_speedup", basis="model") == pytest.approx(
        (1 - alpha ** 3) / ((1 - alpha) * (gamma * c + 1)))
    # Cumulative (what the dashboard's rate() queries see): 3 accepted, 2 rejections, 6 drafted.
    acc, rej = get(reg, "specdec_accepted_tokens_total"), get(reg, "specdec_rejections_total")
    assert (acc, rej, get(reg, "specdec_draft_tokens_total")) == (3, 2, 6)
    assert get(reg, "specdec_cost_coefficient", batch="1") == pytest.approx(0.4)  # latest, not a mean


# --- c: draft / target single-token forward device time at one batch bucket --------------------

def test_c_is_the_ratio_of_decode_forward_times_at_the_same_bucket():
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1, 2, 4, 8))

    def step(n, draft_batch, draft_dec, target_dec, draft_fwd=0.05, target_fwd=0.05):
        cm.observe_step([2] * n, [1] * n, step_seconds=0.1,
                        draft_timing=ServerTiming(draft_fwd, draft_dec, batch_size=draft_batch),
                        target_timing=ServerTiming(target_fwd, target_dec, batch_size=n))

    # 3 sequences → bucket 4. The draft ran 2 forwards (0.012 s), its one-token forward is 0.003;
    # the target's verify took 0.010, its one-token forward 0.008: c = 0.003 / 0.008, not 0.012 / 0.010.
    step(3, 3, 0.003, 0.008, draft_fwd=0.012, target_fwd=0.010)
    assert get(reg, "specdec_cost_coefficient", batch="4") == pytest.approx(0.375)
    step(3, 2, 0.001, 0.008)   # the draft's batch is in bucket 2, the target's in 4: no c sample
    step(4, 4, 0.002, 0.0)     # target's decode time unknown (0): no c sample
    assert get(reg, "specdec_cost_coefficient", batch="4") == pytest.approx(0.375)
    assert get(reg, "specdec_cost_coefficient", batch="2") is None
    step(1, 1, 0.001, 0.004)   # bucket 1 has its own c
    step(7, 5, 0.004, 0.005)   # 5 and 7 share bucket 8
    assert get(reg, "specdec_cost_coefficient", batch="1") == pytest.approx(0.25)
    assert get(reg, "specdec_cost_coefficient", batch="8") == pytest.approx(0.8)
    assert get(reg, "specdec_cost_coefficient", batch="4") == pytest.approx(0.375)


# --- Ŝ = (1 - α^(γ+1)) / ((1 - α)(γc + 1)) at its edges --------------------------------------

@pytest.mark.parametrize("alpha, gamma, c, want", [
    (0.5, 2, 0.25, 0.875 / 0.75),           # 1 + .5 + .25 tokens over 1.5 target-forward units
    (0.0, 4, 0.1, 1 / 1.4),                 # nothing accepted: one token per step of cost 1 + γc
    (0.7, 0, 0.3, 1.0),                     # γ = 0 is plain decoding
    (0.6, 3, 0.0, 1 + 0.6 + 0.36 + 0.216),  # free draft: expected tokens per step
    (1.0, 3, 0.2, 4 / 1.6),                 # α = 1: γ + 1 tokens
    (1 - 1e-9, 3, 0.2, 4 / 1.6),            # ... and the formula is continuous there
    (0.5, 1.5, 0.0, (1 - 0.5 ** 2.5) / 0.5),  # a mean γ over steps may be fractional
])
def test_expected_speedup_definition(alpha, gamma, c, want):
    assert expected_speedup(alpha, gamma, c) == pytest.approx(want, rel=1e-6)


# --- the step loop reports what the target verified -------------------------------------------

def noisy(ctx: list[int]) -> int:
    return model(ctx) if len(ctx) % 7 else 0   # a wrong draft at every seventh position


def run_loop(tmp_path, **config_kw):
    """Three greedy requests (one ends on an EOS token inside an accepted run of drafts, one has a
    small budget); the fake target's Verify traffic is recorded as the ground truth."""
    async def main():
        draft = FakeDraft(draft_model=noisy)
        loop, sched, target = make_loop(draft, **config_kw)
        verified, calls = [], []
        target_step, observe = target.step, loop.metrics.observe_step

        async def step(request, timeout=None, on_sent=None):
            response = await target_step(request, timeout)
            verified.append((request, response))
            return response

        def spy(drafted, accepted, emitted=None, **kw):
            calls.append((list(drafted), list(accepted), list(emitted), kw))
            return observe(drafted, accepted, emitted, **kw)
        target.step, loop.metrics.observe_step = step, spy
        task = asyncio.create_task(loop.run())
        tok = tokenizer(tmp_path)
        eos = plain_greedy(PROMPT, 24)[1]  # inside the first step's 4 accepted drafts
        seqs = [Sequence(i, GenParams(request_id=str(i), prompt_ids=PROMPT, max_new_tokens=n,
                                      sampling=Sampling(), eos_token_ids=frozenset(e)),
                         max_len=MAX_LEN, tokenizer=tok)
                for i, n, e in [(1, 24, ()), (2, 24, (eos,)), (3, 6, ())]]
        for s in seqs:
            sched.submit(s)
        try:
            results = await asyncio.gather(*(collect(s) for s in seqs))
            await asyncio.sleep(0.02)  # the last step's statistics are recorded by call_soon
        finally:
            task.cancel()
        return loop, draft, verified, calls, results
    return asyncio.run(main())


@pytest.mark.parametrize("pipeline", ["off", "on"])
def test_counters_equal_what_the_target_verified(tmp_path, pipeline):
    loop, draft, verified, calls, results = run_loop(tmp_path, pipeline=pipeline)
    assert results[1][1] == Finish.EOS and len(results[1][0]) == 2
    drafted = accepted = rejections = spec_steps = pipelined = verified_steps = 0
    for request, response in verified:
        proposed = {s.seq_id for r in draft.requests if r.step == request.step
                    for s in r.seqs if not s.extend}
        for s, r in zip(request.seqs, response.results):
            k = len(unpack_ids(s.draft_tokens))
            drafted, accepted, rejections = drafted + k, accepted + r.accepted, rejections + (r.accepted < k)
            spec_steps += k > 0
            verified_steps += not s.partial_prefill
            pipelined += k > 0 and s.seq_id not in proposed
    reg = loop.metrics.registry
    assert rejections and (pipelined > 0) == (pipeline == "on")
    # α's population is the target's verification outcome: drafts accepted after the EOS that
    # ended request 2 count (they were tested), though the client never sees them.
    assert get(reg, "specdec_draft_tokens_total") == drafted
    assert get(reg, "specdec_accepted_tokens_total") == accepted
    assert get(reg, "specdec_rejections_total") == rejections
    assert get(reg, "specdec_spec_steps_total") == spec_steps
    assert get(reg, "specdec_pipelined_steps_total") == pipelined
    emitted = sum(len(t) for t, _ in results)
    assert get(reg, "specdec_emitted_tokens_total") == emitted < accepted + verified_steps  # the EOS cut
    assert get(reg, "specdec_alpha") == pytest.approx(accepted / (accepted + rejections))
    assert get(reg, "specdec_mean_accepted_length") == pytest.approx(1 + accepted / spec_steps)


def prefill_marks(run) -> set:
    """Per step of run_loop's result: has_prefill must say whether either server got a prompt; the
    (draft got a prompt, target got a prompt, most tokens fed to the draft) of each step."""
    loop, draft, verified, calls, results = run
    seen = set()
    for (request, _), (_, _, _, kw) in zip(verified, calls):
        fed = [s for r in draft.requests if r.step == request.step and not r.seqs[0].extend for s in r.seqs]
        prompt_to_draft = any(s.first or len(unpack_ids(s.new_tokens)) > 2 for s in fed)
        prompt_to_target = any(s.partial_prefill or len(unpack_ids(s.new_tokens)) > 1 for s in request.seqs)
        assert kw["has_prefill"] == (prompt_to_draft or prompt_to_target), request.step
        seen.add((prompt_to_draft, prompt_to_target, max((len(unpack_ids(s.new_tokens)) for s in fed), default=0)))
    return seen


def test_a_step_that_prefills_the_draft_is_marked_as_prefill(tmp_path):
    # Found by this review (fixed): has_prefill came from the target's side only (p.partial or
    # len(p.target_new) > 1). When a prompt's last target chunk is a single token, or the draft
    # catches up after a restart (draft_resync) or after plain steps above --spec-max-batch, that
    # step's Propose carries a prompt to the draft, yet the step counted as a decode step: its
    # propose time (a draft prefill) entered c_system's per-drafted-token EMA and the step entered
    # measured speedup. Decode steps stay decode steps. (Since session 14 a prompt prefilled in
    # chunks beside decoding sequences reaches the draft chunk by chunk too, so the catch-up after
    # --spec-max-batch is where the draft alone gets a prompt here.)
    seen = prefill_marks(run_loop(tmp_path, prefill_chunk=2))
    assert (True, True, 2) in seen        # a chunk to both servers
    assert (False, False, 1) in seen, seen  # a decode step: one token to each side
    seen = prefill_marks(run_loop(tmp_path, spec_max_batch=1))
    assert any(draft and not target and n > 2 for draft, target, n in seen), seen  # the missed case


# --- c_system and measured speedup on pipelined steps ------------------------------------------

def test_plain_step_estimate_excludes_the_pipelined_draft_wait():
    # Found by this review (fixed): specdec/cost_model.py SpecStats.add_step estimates a plain step (no plain step seen
    # in the bucket) as step - propose - (target forward - target decode forward): "the same RPC
    # and coordinator overhead without the draft". With --pipeline the step also waits for the
    # draft's extension after the target answered (stage "ahead"), but CoordinatorMetrics.
    # observe_step passes add_step only the "propose" stage, so that draft time stays in the
    # estimate: plain_step_seconds too high, c_system too low, measured speedup too high.
    reg = CollectorRegistry()
    cm = CoordinatorMetrics(reg, buckets=(1,))
    cm.observe_step([4], [4], step_seconds=0.015,
                    stage_seconds={"schedule": 0.001, "propose": 0.002, "verify": 0.008, "emit": 0.001,
                                   "ahead": 0.003},
                    target_timing=ServerTiming(0.006, 0.005, batch_size=1))
    plain = 0.015 - 0.002 - 0.003 - (0.006 - 0.005)   # = schedule + plain verify + emit
    assert get(reg, "specdec_plain_step_seconds", batch="1") == pytest.approx(plain)
    assert get(reg, "specdec_measured_speedup") == pytest.approx(5 * plain / 0.015)


# --- the demo prints the same definitions -----------------------------------------------------

def test_demo_report_uses_the_definitions(capsys):
    from specdec.demo import Run, report
    spec = Run("x", tokens=16, seconds=2.0, ttft=0.1, drafted=16, accepted=12, steps=4)  # 4 steps of γ 4
    plain = Run("x", tokens=16, seconds=4.0, ttft=0.1, drafted=0, accepted=0, steps=16)
    report(spec, plain, 4, {"specdec_cost_coefficient": [({"batch": "1"}, 0.2)],
                            "specdec_alpha": [({}, 5 / 6)]})
    out = capsys.readouterr().out
    assert "(accepted/drafted): 0.750  (12/16, γ = 4)" in out
    assert "τ (tokens per target step): 4.00" in out          # 1 + 12 / 4
    # Ŝ from the per-token α gauge: (1 - (5/6)^5) / ((1/6)(4 · 0.2 + 1)) = 1.9937
    assert "α=0.833, γ=4, c=0.200): 1.99x" in out
    assert "(speculative / plain tok/s): 2.00x" in out


# --- the dashboard queries series that exist, with the labels they have -----------------------

def populated_samples() -> list[tuple[str, dict]]:
    regs = [CollectorRegistry() for _ in range(3)]
    cm = CoordinatorMetrics(regs[0], max_positions=4)
    cm.observe_step([2, 0], [1, 0], step_seconds=0.01, stage_seconds={"propose": 0.003},
                    draft_timing=ServerTiming(0.002, 0.001, batch_size=2, step_seconds=0.003),
                    target_timing=ServerTiming(0.006, 0.005, batch_size=2, step_seconds=0.007))
    for reg, role in zip(regs[1:], ("draft", "target")):
        sm = ServerMetrics(reg, role)
        sm.profile.set_profiled(1, 1, [0.001])
        sm.set_kv(1, 9)
    return [(s.name, s.labels) for reg in regs
            for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples]


def test_dashboard_selectors_labels_and_legends_exist():
    specs, samples = all_metric_specs(), populated_samples()
    board = json.loads(DASHBOARD.read_text())
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            used: list[set] = []
            for name, body in re.findall(r"\b(specdec_[a-z_]+)(?:\{([^}]*)\})?", expr):
                base = re.sub(r"_(bucket|sum|count)$", "", name) if name not in specs else name
                labels = set(specs[base].labels) | ({"le"} if name.endswith("_bucket") else set())
                used.append(labels)
                matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body or "")
                assert {m[0] for m in matchers} <= labels, f"{expr}: labels {matchers} not on {base}"
                want = {k: v for k, op, v in matchers if op == "="}
                assert any(n == name and want.items() <= lab.items() for n, lab in samples), \
                    f"{panel['title']}: no series {name}{want}"
            grouped = [set(g.replace(" ", "").split(",")) for g in re.findall(r"\bby \(([^)]*)\)", expr)]
            for g in grouped:
                assert all(g - {"le"} <= labels for labels in used), f"{expr}: by {g}"
            out = set.intersection(*grouped) - {"le"} if grouped else set.union(*used)
            for legend in re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")):
                assert legend in out, f"{panel['title']}: legend {{{{{legend}}}}} is not a label of {expr}"
