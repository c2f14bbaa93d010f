"""Writes deploy/grafana/dashboards/specdec.json, the Grafana dashboard, from the panel list below.

    python deploy/grafana/make_dashboard.py           # regenerate
    python deploy/grafana/make_dashboard.py --check   # exit 1 if the committed JSON differs

The panels are data here so tests can read the same list: every expression must parse and return
data on a real Prometheus, and deploy/README.md must describe every panel and show its query.
`$__rate_interval` is Grafana's; tests substitute a fixed window for it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "specdec.json"
DATASOURCE = {"type": "prometheus", "uid": "specdec-prometheus"}  # provisioning sets this uid
R = "$__rate_interval"
FAILED = '{code!~"OK|CANCELLED"}'  # client cancellations are not server errors


def rate(metric: str, by: str = "", sel: str = "") -> str:
    group = f" by ({by}) " if by else ""
    return f"sum{group}(rate({metric}{sel}[{R}]))"


def quantile(q: float, hist: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(hist + '_bucket', ', '.join(x for x in ('le', by) if x))})"


def percentiles(hist: str) -> list[tuple[str, str]]:
    return [(quantile(q, hist), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


# (title, unit, kind, [(expr, legend)], description)
PANELS = [
    ("Acceptance rate α", "percentunit", "timeseries", [
        (f"{rate('specdec_accepted_tokens_total')} / ({rate('specdec_accepted_tokens_total')} + "
         f"{rate('specdec_rejections_total')})", "α = accepted / (accepted + rejections)"),
        (f"{rate('specdec_accepted_tokens_total')} / {rate('specdec_draft_tokens_total')}",
         "accepted / drafted"),
        ("specdec_alpha", "α gauge (coordinator window)")],
     "Per-token acceptance probability α from the raw counters, and the coordinator's window gauge."),
    ("Acceptance by draft position", "percentunit", "timeseries", [
        (f"{rate('specdec_accepted_tokens_by_position_total', 'position')} / "
         f"{rate('specdec_draft_tokens_by_position_total', 'position')}", "position {{position}}")],
     "Fraction of draft tokens accepted at each position (about α^i under i.i.d. acceptance)."),
    ("Mean accepted length τ and draft length γ", "none", "timeseries", [
        (f"1 + {rate('specdec_accepted_tokens_total')} / {rate('specdec_spec_steps_total')}", "τ"),
        ("specdec_mean_draft_length", "mean γ")],
     "Tokens emitted per speculative step, and the mean number drafted."),
    ("c by batch size over time", "none", "timeseries", [
        ("specdec_cost_coefficient", "c batch={{batch}}"),
        ('max by (batch) (specdec_forward_profile_seconds{role="draft", query_len="1"}) / '
         'max by (batch) (specdec_forward_profile_seconds{role="target", query_len="1"})',
         "c from server profiles batch={{batch}}")],
     "Cost coefficient c = draft / target single-token forward device time, per batch bucket."),
    ("c_system by batch size over time", "none", "timeseries", [
        ("specdec_system_cost_coefficient", "c_system batch={{batch}}")],
     "Coordinator wall time per drafted token (RPC included) over the wall time of a plain step."),
    ("c and c_system by batch size", "none", "bargauge", [
        ("specdec_cost_coefficient", "c {{batch}}"),
        ("specdec_system_cost_coefficient", "c_system {{batch}}")],
     "Latest c and c_system per batch bucket, side by side."),
    ("Verify cost ratio", "none", "timeseries", [
        ("specdec_verify_cost_ratio", "t(γ+1) / t(1) batch={{batch}}")],
     "Target forward time over γ+1 tokens divided by one token (Leviathan's analysis assumes 1)."),
    ("Expected vs measured speedup", "none", "timeseries", [
        ("specdec_expected_speedup", "expected Ŝ ({{basis}} c)"),
        ("specdec_measured_speedup", "measured")],
     "Ŝ = (1-α^(γ+1)) / ((1-α)(γc+1)) with model c and with c_system, against emitted tokens/s "
     "over plain-decoding tokens/s."),
    ("Tokens per second", "short", "timeseries", [
        (rate("specdec_emitted_tokens_total"), "emitted"),
        (rate("specdec_draft_tokens_total"), "drafted"),
        (rate("specdec_accepted_tokens_total"), "accepted")],
     "Throughput of the whole system."),
    ("Time to first token", "s", "timeseries", percentiles("specdec_time_to_first_token_seconds"),
     "TTFT percentiles over finished first tokens."),
    ("Time per output token", "s", "timeseries", percentiles("specdec_time_per_output_token_seconds"),
     "TPOT percentiles: (latency - TTFT) / (output tokens - 1) per request."),
    ("Request latency", "s", "timeseries", percentiles("specdec_request_duration_seconds"),
     "Generate latency percentiles, arrival to last token."),
    ("Forward time by role and phase", "s", "timeseries", [
        (quantile(0.5, "specdec_forward_seconds", "role, phase"), "p50 {{role}} {{phase}}"),
        (quantile(0.9, "specdec_forward_seconds", "role, phase"), "p90 {{role}} {{phase}}")],
     "Device time of model forwards: draft decode, target prefill / decode / verify."),
    ("Single-token forward profile", "s", "timeseries", [
        ('specdec_forward_profile_seconds{query_len="1"}', "{{role}} batch={{batch}}")],
     "Each server's warm-up profile, then EMA of live steps: the inputs of c."),
    ("Coordinator stage time p90", "s", "timeseries", [
        (quantile(0.9, "specdec_stage_seconds", "stage"), "{{stage}}"),
        (quantile(0.9, "specdec_step_seconds", "mode"), "whole step ({{mode}})")],
     "Where a step's wall time goes: schedule, propose, verify, emit."),
    ("Step overhead: RPC and coordinator", "s", "timeseries", [
        (quantile(0.5, "specdec_step_overhead_seconds", "mode"), "p50 {{mode}}"),
        (quantile(0.9, "specdec_step_overhead_seconds", "mode"), "p90 {{mode}}")],
     "Step wall time minus the servers' handling of its Propose and Verify: what transport and the "
     "coordinator add to every step (the performance goal: <= 5% of a Llama-7B target step)."),
    ("Server step time: forward and host", "s", "timeseries", [
        ('sum by (role, part) (rate(specdec_server_step_seconds_sum[$__rate_interval])) / '
         'sum by (role, part) (rate(specdec_server_step_seconds_count[$__rate_interval]))',
         "{{role}} {{part}}")],
     "Mean per step of each server's own handling, as the coordinator receives it: device time of "
     "its forwards (forward) and the rest (host: request conversion, scheduling, launches, sampling, "
     "response), which splits into the engine's call outside its forwards (engine_host) and the "
     "server's handling around the engine (serving)."),
    ("Forwards: CUDA graph or eager", "ops", "timeseries", [
        ("sum by (role, path) (rate(specdec_server_forwards_total[$__rate_interval]))",
         "{{role}} {{path}}")],
     "Model forwards per second by how they ran. On a GPU every decode, verify and prompt-chunk step "
     "within the graph buckets replays a CUDA graph; an eager forward (a chunk over the largest "
     "prefill length, a batch over the largest bucket) costs milliseconds of launches for the "
     "whole step. On the CPU every forward is eager."),
    ("RPC time p90", "s", "timeseries", [
        (quantile(0.9, "specdec_rpc_seconds", "role, rpc"), "{{role}} {{rpc}}")],
     "Coordinator round trips against the servers' own handling time of the same RPCs."),
    ("KV cache usage", "percentunit", "timeseries", [
        ("sum by (role) (specdec_kv_blocks_used) / (sum by (role) (specdec_kv_blocks_used) + "
         "sum by (role) (specdec_kv_blocks_free))", "{{role}}")],
     "Fraction of paged KV blocks in use on each model server."),
    ("Running sequences", "short", "timeseries", [
        ("sum by (role) (specdec_running_sequences)", "{{role}}")],
     "Sequences in flight on the coordinator and holding KV on each server."),
    ("Error rate", "percentunit", "timeseries", [
        (f"{rate('specdec_requests_total', sel=FAILED)} / {rate('specdec_requests_total')}",
         "failed requests / requests"),
        (rate("specdec_errors_total", "role"), "{{role}} errors/s")],
     "Share of requests ending in an error status (client cancellations excluded), and per-process "
     "errors per second (failed RPCs and per-sequence errors)."),
    ("Step transport", "short", "timeseries", [
        ("max by (role, transport) (specdec_step_transport_state) > 0", "{{role}} {{transport}}")],
     "How the coordinator's step messages reach each model server: grpc (the gRPC stream), socket "
     "(the server's step channel) or shared (its frames through shared memory: coordinator and "
     "server on one host, the coordinator busy-polling). A line per transport in use."),
    ("Target steps staged ahead", "ops", "timeseries", [
        ("sum by (outcome) (rate(specdec_verify_ahead_steps_total[$__rate_interval]))", "{{outcome}}")],
     "The target's steps staged ahead (--verify-ahead, on by default on a GPU) per second: taken "
     "(the next Verify was the step it expected, and it skipped that host work) or dropped (another "
     "request came: a sequence joined, more drafts, sampling). A high dropped rate means work for "
     "nothing; the target's debug log says why each was dropped."),
    ("Sequences freed for a lost coordinator", "ops", "timeseries", [
        ("sum by (role) (rate(specdec_orphaned_sequences_total[$__rate_interval]))", "{{role}}")],
     "Sequences a model server freed because their coordinator had no step connection open for the "
     "server's --orphan-timeout (it was killed or lost its host before releasing them). Non-zero "
     "only around a coordinator's crash; anything else means connections that keep dropping."),
]


def panel(i: int, title: str, unit: str, kind: str, targets: list[tuple[str, str]], desc: str) -> dict:
    width = 8
    p = {
        "id": i + 1, "type": kind, "title": title, "description": desc, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": width, "x": (i % 3) * width, "y": (i // 3) * 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr,
                     "legendFormat": legend, "range": kind != "bargauge", "instant": kind == "bargauge"}
                    for j, (expr, legend) in enumerate(targets)],
    }
    if kind == "bargauge":
        p["options"] = {"orientation": "horizontal", "displayMode": "basic",
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return p


def dashboard() -> dict:
    return {
        "uid": "specdec", "title": "specdec: speculative decoding", "tags": ["specdec"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": True,
        "refresh": "5s", "time": {"from": "now-15m", "to": "now"},
        "annotations": {"list": []}, "templating": {"list": []},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
