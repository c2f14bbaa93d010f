"""Prometheus metrics of the three processes: names, and the recorders each process calls.

Every metric lives on a CollectorRegistry that the process creates in its __main__ and passes in,
so tests can run several "processes" in one interpreter. Names follow Prometheus conventions:
prefix `specdec_`, base units in the name (`_seconds`), `_total` on counters. `role` is
draft | target | coordinator on metrics that more than one process exports; Prometheus' own
job/instance labels say which replica. Definitions of c, c_system, α, τ and Ŝ: DESIGN.md section 3,
specdec/cost_model.py, and CoordinatorMetrics below. Only prometheus_client and the standard
library are imported here: the coordinator imports no torch.
"""
from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from specdec.cost_model import (DEFAULT_BATCH_BUCKETS, DEFAULT_EMA_WEIGHT, CostProfile, ServerTiming,
                                SpecStats, WindowStats, bucket_for)

ROLES = ("draft", "target", "coordinator")
# prefill: forwards that carry a prompt (or a prompt chunk, or a draft catching up on several
# tokens); decode: one new token per sequence (draft steps, plain target steps; what c is defined
# on); verify: the target's forward over its new token + γ drafts per sequence.
PHASES = ("prefill", "decode", "verify")
# ahead: with --pipeline, the wait for the draft's next-step proposal after the target answered.
STAGES = ("schedule", "propose", "verify", "emit", "ahead")
RPCS = ("Propose", "Verify", "Release", "Info", "Generate")
# The RPCs each process times (coordinator: its round trips to the servers; servers: handling).
ROLE_RPCS = {"coordinator": ("Propose", "Verify", "Release"), "draft": ("Propose", "Info", "Release"),
             "target": ("Verify", "Info", "Release")}
# gRPC status names created at zero up front, so rate() and error-ratio queries have series to
# work on before the first failure (Prometheus advice: avoid missing metrics).
STATUS_CODES = ("OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                "RESOURCE_EXHAUSTED", "UNAVAILABLE", "INTERNAL")

# Seconds, log-spaced: a small draft's graphed forward on a GPU is ~50-100 µs, a 70B prefill chunk ~1 s.
FORWARD_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)
# Host times of a step's parts (the coordinator's stages, transport, a server's handling): 10-50 µs
# on a GPU host, which buckets from 100 µs up could only place below 100 µs.
HOST_BUCKETS = (5e-6, 1e-5) + FORWARD_BUCKETS
REQUEST_BUCKETS = (5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _c(name, help, *labels):
    return MetricSpec(name, "counter", help, labels)


def _g(name, help, *labels):
    return MetricSpec(name, "gauge", help, labels)


# specdec_step_seconds' modes (observe_step)
STEP_MODES = ("spec", "plain", "prefill")
# specdec_server_step_seconds' parts: forward + host = the server's step; host = engine_host + serving
SERVER_STEP_PARTS = ("forward", "host", "engine_host", "serving")


def step_overhead(step_seconds: float, draft_timing: ServerTiming | None,
                  target_timing: ServerTiming | None) -> float | None:
    """A step's wall time minus the servers' handling time of its RPCs (Propose and Verify run one
    after the other): what RPC transport and the coordinator add. None while the target's timing
    is unknown (step_seconds 0: a server that does not report it)."""
    if target_timing is None or not target_timing.step_seconds:
        return None
    served = target_timing.step_seconds + (draft_timing.step_seconds if draft_timing is not None else 0.0)
    return max(step_seconds - served, 0.0)


def _h(name, help, buckets, *labels):
    return MetricSpec(name, "histogram", help, labels, buckets)


PROCESS_METRICS = (  # every process
    _h("specdec_rpc_seconds", "RPC time: round trip on the coordinator, handling time on servers",
       FORWARD_BUCKETS, "role", "rpc"),
    _g("specdec_running_sequences", "Sequences in flight (coordinator) or holding KV (servers)", "role"),
    _c("specdec_errors_total", "Failed RPCs and per-sequence errors, by gRPC status", "role", "code"),
)
SERVER_METRICS = PROCESS_METRICS + (
    _h("specdec_forward_seconds", "Device time of one model forward", FORWARD_BUCKETS, "role", "phase"),
    _g("specdec_forward_profile_seconds",
       "Forward time per batch bucket and query length: warm-up median, then EMA of live steps",
       "role", "batch", "query_len"),
    _g("specdec_kv_blocks_used", "Paged KV cache blocks in use", "role"),
    _g("specdec_kv_blocks_free", "Paged KV cache blocks free", "role"),
    _c("specdec_server_forwards_total",
       "Model forwards by how they ran: path=graph (a CUDA-graph replay) or eager (op by op: on a GPU "
       "a step no graph bucket fits, e.g. a prompt chunk over the largest prefill length, costs "
       "milliseconds of launches)", "role", "path"),
    _c("specdec_orphaned_sequences_total",
       "Sequences freed because their coordinator had no step connection for --orphan-timeout "
       "seconds (it died without releasing them; specdec/serving/owners.py)", "role"),
    _c("specdec_verify_ahead_steps_total",
       "Target steps staged ahead of their request (--verify-ahead) by what became of them: "
       "outcome=taken (the next Verify was that step) or dropped (another request came; undone)",
       "role", "outcome"),
)
# specdec_verify_ahead_steps_total's outcomes (TargetEngine.ahead_taken / ahead_dropped)
AHEAD_OUTCOMES = ("taken", "dropped")
COORDINATOR_METRICS = PROCESS_METRICS + (
    _c("specdec_draft_tokens_total", "Draft tokens proposed and sent for verification"),
    _c("specdec_accepted_tokens_total", "Draft tokens the target accepted"),
    _c("specdec_emitted_tokens_total", "Tokens emitted to clients (accepted drafts + target tokens)"),
    _c("specdec_spec_steps_total", "Sequence-steps that verified at least one draft token"),
    _c("specdec_plain_steps_total", "Sequence-steps of plain decoding (no draft tokens)"),
    _c("specdec_rejections_total", "Sequence-steps that ended with a rejected draft token"),
    _c("specdec_pipelined_steps_total",
       "Sequence-steps whose drafts were proposed during the previous step's verification (--pipeline)"),
    _c("specdec_draft_tokens_by_position_total", "Draft tokens proposed at each position (1-based)",
       "position"),
    _c("specdec_accepted_tokens_by_position_total", "Draft tokens accepted at each position (1-based)",
       "position"),
    _c("specdec_requests_total", "Finished Generate requests by gRPC status", "code"),
    _h("specdec_stage_seconds", "Wall time of one coordinator stage per step", HOST_BUCKETS, "stage"),
    _h("specdec_step_seconds", "Wall time of one batched step (mode spec: some sequence was to draft; "
       "plain: none was, every sequence decoded; prefill: the step carried prompt tokens)",
       FORWARD_BUCKETS, "mode"),
    _h("specdec_step_overhead_seconds",
       "Step wall time outside the servers' own handling of its RPCs: transport, serialisation and "
       "the coordinator's scheduling and emit", HOST_BUCKETS, "mode"),
    _h("specdec_server_step_seconds",
       "A server's handling of one step, as it reports it: device time of its forwards (part=forward) "
       "and the rest (part=host: request conversion, scheduling, launches, sampling, response); the "
       "host part split into the engine's call outside its forwards (part=engine_host) and the "
       "server's handling around the engine (part=serving)",
       HOST_BUCKETS, "role", "part"),
    _h("specdec_request_duration_seconds", "Generate request latency, arrival to last token",
       REQUEST_BUCKETS),
    _h("specdec_time_to_first_token_seconds", "Arrival to first emitted token", REQUEST_BUCKETS),
    _h("specdec_time_per_output_token_seconds", "(latency - TTFT) / (output tokens - 1)",
       FORWARD_BUCKETS),
    _g("specdec_cost_coefficient", "c: draft / target single-token forward device time", "batch"),
    _g("specdec_system_cost_coefficient",
       "c_system: coordinator wall time per drafted token / wall time of a plain step", "batch"),
    _g("specdec_verify_cost_ratio", "Target forward time at γ+1 tokens / at 1 token", "batch"),
    _g("specdec_plain_step_seconds", "Wall time of a plain (γ=0) step: observed, else estimated",
       "batch"),
    _g("specdec_acceptance_ratio", "Accepted / drafted tokens over the window"),
    _g("specdec_alpha", "Per-token acceptance probability α = accepted / (accepted + rejections)"),
    _g("specdec_mean_accepted_length", "τ = 1 + accepted / speculative steps over the window"),
    _g("specdec_mean_draft_length", "Mean γ of speculative sequence-steps over the window"),
    _g("specdec_expected_speedup", "Ŝ = (1-α^(γ+1)) / ((1-α)(γc+1)) with c of the basis", "basis"),
    _g("specdec_measured_speedup", "Emitted tokens/s over plain-decoding tokens/s, same batches"),
    _g("specdec_step_transport_state",
       "How step messages reach each model server (role: draft or target): 1 on the transport in "
       "use, 0 on the others and on all before the first step. grpc: the gRPC stream; socket: the "
       "server's step channel; shared: the step channel with its frames through shared memory (a "
       "server on this host)", "role", "transport"),
)
# specdec_step_transport_state's transports (coordinator/servers.py chooses one per server)
STEP_TRANSPORTS = ("grpc", "socket", "shared")


def all_metric_specs() -> dict[str, MetricSpec]:
    return {s.name: s for s in SERVER_METRICS + COORDINATOR_METRICS}


def exposed_series_names() -> set[str]:
    """Every sample name a scrape can show (histograms add _bucket, _sum, _count)."""
    names = set()
    for spec in all_metric_specs().values():
        if spec.kind == "histogram":
            names |= {spec.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(spec.name)
    return names


def _build(specs: Iterable[MetricSpec], registry: CollectorRegistry) -> dict:
    out = {}
    for s in specs:
        # prometheus_client appends _total itself; give it the bare name so the family is right.
        name = s.name[: -len("_total")] if s.kind == "counter" else s.name
        if s.kind == "counter":
            out[s.name] = Counter(name, s.help, s.labels, registry=registry)
        elif s.kind == "gauge":
            out[s.name] = Gauge(name, s.help, s.labels, registry=registry)
        else:
            out[s.name] = Histogram(name, s.help, s.labels, registry=registry, buckets=s.buckets)
    return out


class _ProcessMetrics:
    def __init__(self, registry: CollectorRegistry, role: str, specs: Sequence[MetricSpec]) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.registry = registry
        self._m = _build(specs, registry)
        self._children: dict[tuple, object] = {}
        # Labelled series exist at zero from the start (Prometheus advice: avoid missing metrics):
        # rate() then has a sample from before the first event, and error ratios read 0, not empty.
        for code in STATUS_CODES[1:]:
            self._m["specdec_errors_total"].labels(role=role, code=code)
        for rpc in ROLE_RPCS[role]:
            self._m["specdec_rpc_seconds"].labels(role=role, rpc=rpc)
        self._m["specdec_running_sequences"].labels(role=role).set(0)

    def _child(self, name: str, **labels: str):
        """The labelled series of metric `name`, looked up once (labels() takes a lock and
        validates the labels on every call: several per step on the model servers)."""
        key = (name, *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._m[name].labels(**labels)
        return child

    def observe_rpc(self, rpc: str, seconds: float) -> None:
        self._child("specdec_rpc_seconds", role=self.role, rpc=rpc).observe(seconds)

    def set_running(self, n: int) -> None:
        self._child("specdec_running_sequences", role=self.role).set(n)

    def count_error(self, code: str, n: int = 1) -> None:
        self._m["specdec_errors_total"].labels(role=self.role, code=code).inc(n)


class ServerMetrics(_ProcessMetrics):
    """What a model server (draft or target) exports.

    The engine owns its CostProfile (warm-up medians, then EMAs of live forwards, which it also
    reports as StepTiming.decode_forward_seconds); `watch_profile` mirrors that profile into the
    specdec_forward_profile_seconds gauge, so what the server reports and what Prometheus shows
    are the same numbers. `observe_forward` feeds the forward-time histogram only.
    """

    def __init__(self, registry: CollectorRegistry, role: str,
                 buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 ema_weight: float = DEFAULT_EMA_WEIGHT) -> None:
        if role not in ("draft", "target"):
            raise ValueError(f"a model server's role is draft or target, got {role!r}")
        super().__init__(registry, role, SERVER_METRICS)
        for phase in PHASES if role == "target" else ("prefill", "decode"):
            self._m["specdec_forward_seconds"].labels(role=role, phase=phase)
        self.profile = CostProfile(buckets, ema_weight)
        self.watch_profile(self.profile)
        self._totals_seen: dict[tuple, int] = {}   # the engine's totals already counted, per series
        for path in ("graph", "eager"):
            self._m["specdec_server_forwards_total"].labels(role=role, path=path)
        self._m["specdec_orphaned_sequences_total"].labels(role=role)
        if role == "target":
            for outcome in AHEAD_OUTCOMES:
                self._m["specdec_verify_ahead_steps_total"].labels(role=role, outcome=outcome)

    def watch_profile(self, profile: CostProfile) -> None:
        """Exports `profile` (its current entries and every later change) as the profile gauge."""
        self.profile = profile
        profile.subscribe(lambda b, q, s: self._child("specdec_forward_profile_seconds", role=self.role,
                                                      batch=str(b), query_len=str(q)).set(s))

    def observe_forward(self, phase: str, batch_size: int, seconds: float) -> None:
        """One forward of `batch_size` sequences in `phase` (PHASES), device seconds."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._child("specdec_forward_seconds", role=self.role, phase=phase).observe(seconds)

    def set_kv(self, used: int, free: int) -> None:
        self._child("specdec_kv_blocks_used", role=self.role).set(used)
        self._child("specdec_kv_blocks_free", role=self.role).set(free)

    def set_forwards(self, graph: int, eager: int) -> None:
        """The engine's running totals of graph replays and eager forwards (counters move by the
        difference, so a total that only grows is all they need)."""
        for path, total in (("graph", graph), ("eager", eager)):
            self._advance("specdec_server_forwards_total", total, path=path)

    def count_orphaned(self, n: int) -> None:
        self._child("specdec_orphaned_sequences_total", role=self.role).inc(n)

    def set_ahead(self, taken: int, dropped: int) -> None:
        """The target engine's running totals of steps staged ahead and taken or dropped."""
        for outcome, total in (("taken", taken), ("dropped", dropped)):
            self._advance("specdec_verify_ahead_steps_total", total, outcome=outcome)

    def _advance(self, name: str, total: int, **labels: str) -> None:
        """Counter `name` moved up to an engine's running total (by the difference from the last)."""
        key = (name, *labels.values())
        seen = self._totals_seen.get(key, 0)
        if total > seen:
            self._child(name, role=self.role, **labels).inc(total - seen)
            self._totals_seen[key] = total


class CoordinatorMetrics(_ProcessMetrics):
    """What the coordinator exports: raw counters, stage and request histograms, cost gauges.

    Counters are the ground truth (dashboards take rate() of them); the gauges are SpecStats'
    per-bucket EMAs and window values (see specdec/cost_model.py for exact definitions), refreshed
    after every step. Gauges read NaN until their inputs exist. Not thread-safe: call it from the
    coordinator's event loop only (scrapes read the prometheus_client values, which are).
    """

    def __init__(self, registry: CollectorRegistry, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 window_steps: int = 256, ema_weight: float = DEFAULT_EMA_WEIGHT,
                 max_positions: int = 16) -> None:
        super().__init__(registry, "coordinator", COORDINATOR_METRICS)
        self.stats = SpecStats(buckets, window_steps, ema_weight)
        self.max_positions = max_positions
        self._positions: dict[str, tuple] = {}
        self._gauge_values: dict[tuple, float] = {}   # per-bucket gauges as last written
        for p in range(1, max_positions + 1):
            self._position_series(p)
        for stage in STAGES:
            self._m["specdec_stage_seconds"].labels(stage=stage)
        for mode in STEP_MODES:
            self._m["specdec_step_seconds"].labels(mode=mode)
            self._m["specdec_step_overhead_seconds"].labels(mode=mode)
        for role in ("draft", "target"):
            for part in SERVER_STEP_PARTS:
                self._m["specdec_server_step_seconds"].labels(role=role, part=part)
        for code in STATUS_CODES:
            self._m["specdec_requests_total"].labels(code=code)
        self._m["specdec_expected_speedup"].labels(basis="model")
        self._m["specdec_expected_speedup"].labels(basis="system")
        self._set_window(self.stats.window())
        self._transports: dict[str, str] = {}   # role -> its step transport as last set
        for role in ("draft", "target"):   # every transport at 0 until a step call opens
            for t in STEP_TRANSPORTS:
                self._child("specdec_step_transport_state", role=role, transport=t).set(0)

    def set_step_transport(self, role: str, transport: str) -> None:
        """The transport `role`'s (draft | target) steps take now: its series reads 1, the others
        0. Set when a step call opens (not on every step)."""
        if transport not in STEP_TRANSPORTS:
            raise ValueError(f"transport must be one of {STEP_TRANSPORTS}, got {transport!r}")
        if self._transports.get(role) == transport:
            return
        self._transports[role] = transport
        for t in STEP_TRANSPORTS:
            self._child("specdec_step_transport_state", role=role, transport=t).set(1 if t == transport else 0)

    def _position_series(self, p: int) -> tuple:
        # Positions past max_positions share one series, bounding the label's cardinality.
        label = str(p) if p <= self.max_positions else f">{self.max_positions}"
        series = self._positions.get(label)
        if series is None:  # both series exist from the first draft at p on (accepted at 0)
            series = self._positions[label] = (
                self._m["specdec_draft_tokens_by_position_total"].labels(position=label),
                self._m["specdec_accepted_tokens_by_position_total"].labels(position=label))
        return series

    def _count_positions(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        # One inc per position and step, not per token: at position p, the sequences with
        # γ >= p drafted a token and those with accepted >= p had it accepted.
        top = max(drafted)
        if not top:
            return
        d_len, a_len = [0] * (top + 1), [0] * (top + 1)
        for d, a in zip(drafted, accepted):
            d_len[d] += 1
            a_len[a] += 1
        d_at = a_at = 0
        for p in range(top, 0, -1):
            d_at, a_at = d_at + d_len[p], a_at + a_len[p]
            series_d, series_a = self._position_series(p)
            series_d.inc(d_at)
            if a_at:
                series_a.inc(a_at)

    def count_pipelined(self, n: int) -> None:
        """Sequence-steps whose drafts came from a pipelined proposal (no Propose on the path)."""
        if n:
            self._m["specdec_pipelined_steps_total"].inc(n)

    def observe_step(self, drafted: Sequence[int], accepted: Sequence[int],
                     emitted: Sequence[int] | None = None, *, step_seconds: float,
                     stage_seconds: Mapping[str, float] | None = None, has_prefill: bool = False,
                     draft_timing: ServerTiming | None = None,
                     target_timing: ServerTiming | None = None, planned_spec: bool = False,
                     propose_gamma: int | None = None) -> WindowStats:
        """One batched step: per-sequence γ (0 = plain), accepted drafts and emitted tokens.

        emitted defaults to accepted + 1 (the correction or bonus token); pass it when a stop
        condition cut the output, or 0 for a sequence that did not decode (a prompt chunk, an
        error, cancelled). stage_seconds holds wall times of STAGES ("propose" feeds c_system).
        has_prefill marks steps that carried prompt tokens: they count for acceptance but not for
        step-time EMAs. draft_timing / target_timing are the servers' StepTiming messages (or
        ServerTiming). planned_spec: some sequence was to draft (a step whose Propose failed is
        no plain step); propose_gamma: the most drafts its Propose asked of a sequence
        (SpecStats.add_step). Returns the window after this step.
        """
        stage_seconds = dict(stage_seconds or {})
        unknown = set(stage_seconds) - set(STAGES)
        if unknown:
            raise ValueError(f"stage_seconds: unknown stages {sorted(unknown)}, expected {STAGES}")
        emitted = [a + 1 for a in accepted] if emitted is None else list(emitted)
        self.stats.add_step(drafted, accepted, emitted, step_seconds, stage_seconds.get("propose", 0.0),
                            has_prefill, draft_timing, target_timing, stage_seconds.get("ahead", 0.0),
                            planned_spec=planned_spec, propose_gamma=propose_gamma)
        m = self._m
        m["specdec_draft_tokens_total"].inc(sum(drafted))
        m["specdec_accepted_tokens_total"].inc(sum(accepted))
        m["specdec_emitted_tokens_total"].inc(sum(emitted))
        m["specdec_spec_steps_total"].inc(sum(1 for d in drafted if d > 0))
        m["specdec_plain_steps_total"].inc(sum(1 for d, e in zip(drafted, emitted) if d == 0 and e > 0))
        m["specdec_rejections_total"].inc(sum(1 for a, d in zip(accepted, drafted) if a < d))
        self._count_positions(drafted, accepted)
        for stage, seconds in stage_seconds.items():
            self._child("specdec_stage_seconds", stage=stage).observe(seconds)
        mode = "prefill" if has_prefill else "spec" if planned_spec or max(drafted) > 0 else "plain"
        self._child("specdec_step_seconds", mode=mode).observe(step_seconds)
        # (less a pipelined step's wait for the draft's extension: draft time, as the Propose's is)
        overhead = step_overhead(step_seconds - stage_seconds.get("ahead", 0.0), draft_timing, target_timing)
        if overhead is not None:
            self._child("specdec_step_overhead_seconds", mode=mode).observe(overhead)
        for role, timing in (("draft", draft_timing), ("target", target_timing)):
            if timing is not None and timing.step_seconds:
                name = "specdec_server_step_seconds"
                self._child(name, role=role, part="forward").observe(timing.forward_seconds)
                self._child(name, role=role, part="host").observe(
                    max(timing.step_seconds - timing.forward_seconds, 0.0))
                engine = timing.engine_seconds   # 0: a server that does not report it
                if engine:
                    self._child(name, role=role, part="engine_host").observe(
                        max(engine - timing.forward_seconds, 0.0))
                    self._child(name, role=role, part="serving").observe(max(timing.step_seconds - engine, 0.0))
        self._set_buckets()
        window = self.stats.window()
        self._set_window(window)
        return window

    def _set_buckets(self) -> None:
        # Every bucket seen, every step (an estimate may follow another bucket's data), but a
        # gauge is only written when its value moved: most buckets' do not in a given step.
        st = self.stats
        for b in st.buckets_seen():
            for name, value in (("specdec_cost_coefficient", st.c.get(b)),
                                ("specdec_system_cost_coefficient", st.c_system(b)),
                                ("specdec_verify_cost_ratio", st.verify_ratio.get(b)),
                                ("specdec_plain_step_seconds", st.plain_step_seconds(b))):
                if value is not None and self._gauge_values.get((name, b)) != value:
                    self._gauge_values[(name, b)] = value
                    self._child(name, batch=str(b)).set(value)

    def _set_window(self, w: WindowStats) -> None:
        m = self._m
        for name, value in (("specdec_acceptance_ratio", w.acceptance_ratio), ("specdec_alpha", w.alpha),
                            ("specdec_mean_accepted_length", w.mean_accepted_length),
                            ("specdec_mean_draft_length", w.mean_draft_length),
                            ("specdec_measured_speedup", w.measured_speedup)):
            m[name].set(_nan(value))
        self._child("specdec_expected_speedup", basis="model").set(_nan(w.expected_speedup))
        self._child("specdec_expected_speedup", basis="system").set(_nan(w.expected_speedup_system))

    def observe_first_token(self, seconds: float) -> None:
        """Time to first token of one request, observed when that token is emitted."""
        self._m["specdec_time_to_first_token_seconds"].observe(seconds)

    def observe_request(self, code: str, duration_seconds: float, output_tokens: int,
                        ttft_seconds: float | None = None) -> None:
        """A finished request: its status name (STATUS_CODES), latency, and TPOT when defined.

        TPOT = (duration - TTFT) / (output_tokens - 1), the mean gap between later tokens; a
        request with fewer than two tokens or without a first token has none.
        """
        self._child("specdec_requests_total", code=code).inc()
        self._m["specdec_request_duration_seconds"].observe(duration_seconds)
        if ttft_seconds is not None and output_tokens >= 2:
            tpot = max(duration_seconds - ttft_seconds, 0.0) / (output_tokens - 1)
            self._m["specdec_time_per_output_token_seconds"].observe(tpot)


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


class MetricsServer:
    """The /metrics HTTP endpoint of one process (prometheus_client's WSGI server on a thread)."""

    def __init__(self, port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> None:
        self._httpd, self._thread = start_http_server(port, addr=addr, registry=registry)
        self.port: int = self._httpd.server_port  # the real one when port=0

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> MetricsServer:
    """Serves `registry` at http://addr:port/metrics until .close(); port 0 picks a free port.
    OSError naming the --metrics-port flag where it cannot listen (a port in use)."""
    try:
        return MetricsServer(port, registry, addr)
    except OSError as e:
        raise OSError(f"--metrics-port {port}: cannot listen on {addr}:{port}: {e.strerror or e}") from None


__all__ = ["ROLES", "PHASES", "STAGES", "RPCS", "STATUS_CODES", "STEP_TRANSPORTS", "MetricSpec", "SERVER_METRICS",
           "COORDINATOR_METRICS", "all_metric_specs", "exposed_series_names", "ServerMetrics",
           "CoordinatorMetrics", "ServerTiming", "WindowStats", "MetricsServer",
           "start_metrics_server", "bucket_for"]


# --- reading a process's /metrics (the demo and the benchmarks) --------------------------------
Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(address: str | None, timeout: float = 5.0) -> Samples:
    """The samples of a /metrics endpoint at host:port: {sample name: [(labels, value)]} (a
    histogram's _bucket, _sum and _count are separate names); {} when unreachable or None."""
    if not address:
        return {}
    try:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout).read().decode()
    except OSError:
        return {}
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def sample_value(samples: Samples, name: str, **labels: str) -> float | None:
    """The first finite-or-infinite (not NaN) value of `name` whose labels include `labels`."""
    for got, value in samples.get(name, ()):
        if value == value and all(got.get(k) == v for k, v in labels.items()):
            return value
    return None


def sample_total(samples: Samples | None, name: str, **labels: str) -> float:
    """Sum of the samples `name` whose labels match `labels` (0 when there are none)."""
    return sum(v for got, v in (samples or {}).get(name, ())
               if all(got.get(k) == x for k, x in labels.items()))


def histogram_mean(after: Samples, name: str, before: Samples | None = None, **labels: str) -> float | None:
    """Mean observation of histogram `name` (series matching `labels`, summed), over the whole
    scrape `after` or between the scrapes `before` and `after`; None without observations."""
    count = sample_total(after, name + "_count", **labels) - sample_total(before, name + "_count", **labels)
    total = sample_total(after, name + "_sum", **labels) - sample_total(before, name + "_sum", **labels)
    return total / count if count else None
