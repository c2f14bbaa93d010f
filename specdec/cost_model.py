"""The speculative-decoding cost model: batch buckets, per-bucket forward-time profiles, Ŝ.

Pure Python (no torch, no prometheus_client): the servers feed it device times they measured, the
coordinator feeds it wall times it observed, and specdec/metrics.py exports what it computes.
Definitions follow DESIGN.md section 3 and Leviathan et al. 2023 (Def. 3.7, Thm. 3.8).
"""
from __future__ import annotations

import bisect
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

# Batch sizes are padded up to one of these (the CUDA-graph buckets), so forward time is a
# function of the bucket, not of the exact batch size.
DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Weight of a new live sample in the exponential moving averages below: ~10 steps of memory, so a
# profile follows a change of load within a second of decoding.
DEFAULT_EMA_WEIGHT = 0.1
# A live forward counts at most this factor away from its profile entry. One forward preempted by
# the OS or stalled by a GC pause can take 10x its time; unclamped it would nearly double the entry
# (and c with it). Clamped, one outlier moves the entry by at most 10% while a real change of load
# still gets through in a few steps.
LIVE_SAMPLE_CLAMP = 2.0


def bucket_for(batch_size: int, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> int:
    """The smallest bucket >= batch_size; the largest bucket for anything bigger."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[min(i, len(buckets) - 1)]


def ema(previous: float | None, sample: float, weight: float) -> float:
    """Exponential moving average; the first sample is taken as is."""
    return sample if previous is None else (1.0 - weight) * previous + weight * sample


def expected_speedup(alpha: float, gamma: float, c: float) -> float:
    """Leviathan et al. Thm. 3.8: Ŝ = (1 - α^(γ+1)) / ((1 - α)(γc + 1)).

    Expected tokens per step (1 - α^(γ+1)) / (1 - α) over the cost of a step in target-forward
    units (γ draft forwards at c each, one verify forward assumed to cost one decode forward).
    At α = 1 the first factor is its limit γ + 1. γ may be a mean over steps (fractional).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0 or c < 0:
        raise ValueError(f"gamma and c must be non-negative, got {gamma}, {c}")
    tokens = gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)
    return tokens / (gamma * c + 1.0)


def alpha_estimate(accepted: float, rejections: float) -> float | None:
    """Per-token acceptance probability α from accepted tokens and rejection events.

    Each tested draft token is either accepted or is the one rejection that ends its step; tokens
    after a rejection are never tested. So α = accepted / (accepted + rejections) is the maximum
    likelihood estimate under Leviathan's i.i.d. model. The plain ratio accepted / drafted counts
    the untested tokens as failures and is biased low: at α = 0.8, γ = 4 it reads 0.59, and
    Ŝ computed from it would be 2.26 instead of 3.36.
    """
    tested = accepted + rejections
    return accepted / tested if tested > 0 else None


class CostProfile:
    """Seconds of one model forward per (batch bucket, query length), on one server.

    Query length 1 is a decode step (what c is defined on); γ+1 is a verify step. Warm-up sets a
    bucket from the median of timed forwards; live steps then move it by an EMA so the table
    follows the real load (clock boosts, contention with the other model on a shared GPU).
    Thread-safe: the GPU thread writes, the metrics and RPC threads read.
    """

    def __init__(self, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 ema_weight: float = DEFAULT_EMA_WEIGHT,
                 on_update: Callable[[int, int, float], None] | None = None) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive ints, got {buckets}")
        if not 0.0 < ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {ema_weight}")
        self.buckets = tuple(buckets)
        self.ema_weight = ema_weight
        self._listeners: list[Callable[[int, int, float], None]] = [on_update] if on_update else []
        self._table: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()

    def set_profiled(self, batch_size: int, query_len: int, samples: Iterable[float]) -> float:
        """Warm-up: the median of timed forwards replaces the entry (robust to one slow launch)."""
        values = [float(s) for s in samples]
        if not values or min(values) < 0:
            raise ValueError("samples must be a non-empty list of non-negative seconds")
        return self._store(batch_size, query_len, statistics.median(values), replace=True)

    def update(self, batch_size: int, query_len: int, seconds: float) -> float:
        """A live forward: EMA into the entry (the first sample initialises it), the sample clamped
        to within LIVE_SAMPLE_CLAMP of the entry."""
        return self.update_many(batch_size, query_len, (seconds,))

    def update_many(self, batch_size: int, query_len: int, samples: Sequence[float],
                    each: Callable[[float], None] | None = None) -> float | None:
        """update() of each sample in turn, at one batch size: the same entries and listener calls
        (each(sample) after each sample's), the bucket looked up once. The last value (None: no
        samples)."""
        key = self._key(batch_size, query_len)
        value = None
        for seconds in samples:
            if seconds < 0:
                raise ValueError(f"seconds must be non-negative, got {seconds}")
            value = self._store_at(key, float(seconds), replace=False)
            if each is not None:
                each(seconds)
        return value

    def _key(self, batch_size: int, query_len: int) -> tuple[int, int]:
        if query_len < 1:
            raise ValueError(f"query_len must be positive, got {query_len}")
        return bucket_for(batch_size, self.buckets), query_len

    def _store(self, batch_size: int, query_len: int, seconds: float, replace: bool) -> float:
        return self._store_at(self._key(batch_size, query_len), seconds, replace)

    def _store_at(self, key: tuple[int, int], seconds: float, replace: bool) -> float:
        with self._lock:
            old = self._table.get(key)
            if replace or old is None:
                value = seconds
            else:
                sample = min(max(seconds, old / LIVE_SAMPLE_CLAMP), old * LIVE_SAMPLE_CLAMP)
                value = ema(old, sample, self.ema_weight)
            self._table[key] = value
        for listener in self._listeners:
            listener(key[0], key[1], value)
        return value

    def subscribe(self, listener: Callable[[int, int, float], None]) -> None:
        """Calls listener(bucket, query_len, seconds) on every change, starting with the entries
        already there (so a gauge attached after warm-up still shows the warm-up profile)."""
        self._listeners.append(listener)
        for (bucket, query_len), seconds in self.table().items():
            listener(bucket, query_len, seconds)

    def get(self, batch_size: int, query_len: int = 1) -> float | None:
        """Seconds at batch_size's bucket, or None when that bucket was never timed."""
        with self._lock:
            return self._table.get((bucket_for(batch_size, self.buckets), query_len))

    def table(self) -> dict[tuple[int, int], float]:
        """A copy of all entries, keyed by (bucket, query_len)."""
        with self._lock:
            return dict(self._table)

    def profile(self, forward_seconds: Callable[[int, int], float],
                query_lens: Sequence[int] = (1,), repeats: int = 5, warmup: int = 2,
                max_batch: int | None = None) -> dict[tuple[int, int], float]:
        """Warm-up profile: times forward_seconds(bucket, query_len) for every bucket up to max_batch.

        forward_seconds runs one forward at that shape and returns its device time (the server
        synchronises or uses CUDA events); the first `warmup` calls per shape are discarded
        (compilation, graph capture, allocator growth).
        """
        for bucket in self.buckets:
            if max_batch is not None and bucket > max_batch:
                break
            for q in query_lens:
                for _ in range(warmup):
                    forward_seconds(bucket, q)
                self.set_profiled(bucket, q, [forward_seconds(bucket, q) for _ in range(repeats)])
        return self.table()


@dataclass(frozen=True)
class ServerTiming:
    """A server's timing of one step, as StepTiming in the proto (a pb StepTiming works in its place).

    forward_seconds: device time of the step's forwards; decode_forward_seconds: the server's
    profile entry for a single-token forward at its batch bucket (0 when unknown).
    """
    forward_seconds: float
    decode_forward_seconds: float
    batch_size: int = 0
    step_seconds: float = 0.0
    num_forwards: int = 1
    engine_seconds: float = 0.0  # of step_seconds, the engine's call (0: not reported)


@dataclass(frozen=True)
class WindowStats:
    """Acceptance and speedup over the last `window_steps` batched steps; None where undefined."""
    acceptance_ratio: float | None  # Σaccepted / Σdrafted
    alpha: float | None  # Σaccepted / (Σaccepted + Σrejections), see alpha_estimate
    mean_accepted_length: float | None  # τ = 1 + Σaccepted / Σspeculative sequence-steps
    mean_draft_length: float | None  # γ̄ = Σdrafted / Σspeculative sequence-steps
    c: float | None  # mean over window steps of c at each step's bucket
    c_system: float | None  # the same for c_system
    expected_speedup: float | None  # Ŝ(α, γ̄, c)
    expected_speedup_system: float | None  # Ŝ(α, γ̄, c_system)
    measured_speedup: float | None  # Σ plain-equivalent seconds / Σ step seconds


@dataclass(frozen=True)
class _StepRecord:
    drafted: int
    accepted: int
    rejections: int
    spec_steps: int
    c: float | None
    c_system: float | None
    seconds: float | None
    plain_equivalent: float | None


class SpecStats:
    """The coordinator's view of cost and acceptance, per batch bucket and over a window of steps.

    Per bucket b:
      c[b]          = draft.decode_forward_seconds / target.decode_forward_seconds of the latest step
                      where both servers reported one at bucket b: the servers' own profile values
                      (each an EMA of its single-token forwards), so no smoothing here, prefill
                      steps included.
    and EMAs with weight ema_weight, over steps without prefill:
      draft_tok[b]  = propose stage wall time / the most drafts its Propose asked of a sequence (the
                      draft runs that many forwards; sequences drafted ahead by a pipelined
                      extension are not in it).
      plain[b]      = wall time of plain steps (no sequence planned to draft, every sequence
                      decoded: not a step whose Propose failed, nor one of prompt chunks or failed
                      sequences) when any were seen; otherwise estimated
                      from speculative steps as step - propose - (target forward - target decode
                      forward): the same RPC and coordinator overhead without the draft and without
                      the extra verify positions.
      c_system[b]   = draft_tok[b] / plain[b].
      verify_ratio[b] = target.forward_seconds / target.decode_forward_seconds of speculative steps.
    The window (last window_steps batched steps, prefill included for acceptance counts) gives
    WindowStats; its c and c_system are those of its speculative sequence-steps (each step's
    bucket value weighted by its speculative sequences, as α and γ̄ are counted), since Ŝ(α, γ, c)
    is the speedup of those. Measured speedup counts only speculative steps without prefill whose bucket had
    a plain time: each step's plain equivalent is (emitted / sequences) × plain[b], the time plain
    decoding needs to emit as many tokens per sequence in a batch of the same bucket.
    """

    def __init__(self, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS, window_steps: int = 256,
                 ema_weight: float = DEFAULT_EMA_WEIGHT) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be positive, got {window_steps}")
        self.buckets = tuple(buckets)
        self.ema_weight = ema_weight
        self._window: deque[_StepRecord] = deque(maxlen=window_steps)
        self._totals: dict[str, float] = dict.fromkeys(
            ("drafted", "accepted", "rejections", "spec_steps", "c", "c_n", "c_system", "c_system_n",
             "seconds", "seconds_n", "plain_equivalent", "plain_equivalent_n"), 0)
        self.c: dict[int, float] = {}
        self.verify_ratio: dict[int, float] = {}
        self._draft_token: dict[int, float] = {}
        self._plain_observed: dict[int, float] = {}
        self._plain_estimated: dict[int, float] = {}

    def plain_step_seconds(self, bucket: int) -> float | None:
        return self._plain_observed.get(bucket, self._plain_estimated.get(bucket))

    def c_system(self, bucket: int) -> float | None:
        plain, per_token = self.plain_step_seconds(bucket), self._draft_token.get(bucket)
        return per_token / plain if plain and per_token is not None else None

    def buckets_seen(self) -> list[int]:
        return sorted(set(self.c) | set(self._draft_token) | set(self._plain_observed)
                      | set(self._plain_estimated) | set(self.verify_ratio))

    def add_step(self, drafted: Sequence[int], accepted: Sequence[int], emitted: Sequence[int],
                 step_seconds: float, propose_seconds: float = 0.0, has_prefill: bool = False,
                 draft_timing: ServerTiming | None = None,
                 target_timing: ServerTiming | None = None, ahead_seconds: float = 0.0,
                 planned_spec: bool = False, propose_gamma: int | None = None) -> int:
        """Records one batched step (per-sequence lists, same order); returns its bucket.
        emitted 0: a sequence that did not decode (a prompt chunk, an error, cancelled).
        ahead_seconds: a pipelined step's wait for the draft's extension after the target answered
        (draft time a plain step does not have either; not part of the per-drafted-token time).
        planned_spec: some sequence was to draft this step (its Propose may have failed, leaving
        drafted all 0: not a plain step). propose_gamma: the most drafts the step's Propose asked
        of a sequence (None: max(drafted))."""
        n = len(drafted)
        if n == 0 or len(accepted) != n or len(emitted) != n:
            raise ValueError("drafted, accepted and emitted need one entry per sequence (>= 1)")
        if any(a < 0 or a > d for a, d in zip(accepted, drafted)):
            raise ValueError("need 0 <= accepted <= drafted for every sequence")
        b, w = bucket_for(n, self.buckets), self.ema_weight
        any_spec = max(drafted) > 0
        tgt_dec = target_timing.decode_forward_seconds if target_timing is not None else 0.0
        if draft_timing is not None and tgt_dec > 0 and draft_timing.decode_forward_seconds > 0:
            tb = bucket_for(target_timing.batch_size or n, self.buckets)
            if bucket_for(draft_timing.batch_size or n, self.buckets) == tb:
                self.c[tb] = draft_timing.decode_forward_seconds / tgt_dec
        if not has_prefill:
            if not any_spec:
                if not planned_spec and min(emitted) > 0:
                    self._plain_observed[b] = ema(self._plain_observed.get(b), step_seconds, w)
            else:
                gamma = max(drafted) if propose_gamma is None else propose_gamma
                if propose_seconds > 0 and gamma > 0:
                    per_token = propose_seconds / gamma
                    self._draft_token[b] = ema(self._draft_token.get(b), per_token, w)
                if tgt_dec > 0 and target_timing.forward_seconds > 0:
                    extra = target_timing.forward_seconds - tgt_dec
                    ratio = target_timing.forward_seconds / tgt_dec
                    self.verify_ratio[b] = ema(self.verify_ratio.get(b), ratio, w)
                    estimate = step_seconds - propose_seconds - ahead_seconds - extra
                    if estimate > 0:
                        self._plain_estimated[b] = ema(self._plain_estimated.get(b), estimate, w)
        plain = self.plain_step_seconds(b)
        timed = any_spec and not has_prefill and plain is not None and step_seconds > 0
        self._push(_StepRecord(
            drafted=sum(drafted), accepted=sum(accepted),
            rejections=sum(1 for a, d in zip(accepted, drafted) if a < d),
            spec_steps=sum(1 for d in drafted if d > 0),
            c=self.c.get(b), c_system=self.c_system(b),   # (weighted by spec_steps: 0 for plain steps)
            seconds=step_seconds if timed else None,
            plain_equivalent=sum(emitted) / n * plain if timed else None))
        return b

    def _push(self, record: _StepRecord) -> None:
        # Running sums over the window: window() is called after every step, and summing 256
        # records each time would cost the coordinator's step loop ~0.1 ms.
        if len(self._window) == self._window.maxlen:
            self._add(self._window[0], -1)
        self._window.append(record)
        self._add(record, 1)

    def _add(self, r: _StepRecord, sign: int) -> None:
        t = self._totals
        for name in ("drafted", "accepted", "rejections", "spec_steps"):
            t[name] += sign * getattr(r, name)
        for name, value, weight in (("c", r.c, r.spec_steps), ("c_system", r.c_system, r.spec_steps),
                                    ("seconds", r.seconds, 1), ("plain_equivalent", r.plain_equivalent, 1)):
            if value is not None:
                t[name] += sign * weight * value
                t[name + "_n"] += sign * weight

    def window(self) -> WindowStats:
        t = self._totals
        drafted, accepted, spec_steps = t["drafted"], t["accepted"], t["spec_steps"]
        alpha = alpha_estimate(accepted, t["rejections"])
        gamma = drafted / spec_steps if spec_steps else None
        c = t["c"] / t["c_n"] if t["c_n"] else None
        c_sys = t["c_system"] / t["c_system_n"] if t["c_system_n"] else None
        seconds = t["seconds"] if t["seconds_n"] else 0.0

        def s_hat(cost: float | None) -> float | None:
            if alpha is None or gamma is None or cost is None:
                return None
            return expected_speedup(alpha, gamma, cost)

        return WindowStats(
            acceptance_ratio=accepted / drafted if drafted else None, alpha=alpha,
            mean_accepted_length=1.0 + accepted / spec_steps if spec_steps else None,
            mean_draft_length=gamma, c=c, c_system=c_sys,
            expected_speedup=s_hat(c), expected_speedup_system=s_hat(c_sys),
            measured_speedup=t["plain_equivalent"] / seconds if seconds > 0 else None)

