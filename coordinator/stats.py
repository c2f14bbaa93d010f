"""Speculation statistics of the coordinator: plain counters and moving averages (the Prometheus
export is built on top of this object later)."""
from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.gamma import expected_speedup

EMA = 0.1  # weight of the newest sample in the moving averages


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)


@dataclass
class SpecStats:
    steps: int = 0                 # coordinator steps (one Verify each)
    seq_steps: int = 0             # sequences verified, summed over steps (partial prefills excluded)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    drafted_at: list[int] = field(default_factory=list)    # [i]: drafts proposed at position i
    accepted_at: list[int] = field(default_factory=list)   # [i]: ... of which accepted
    draft_decode_s: float | None = None     # servers' single-token forward time at the live batch
    target_decode_s: float | None = None
    draft_wall_per_token_s: float | None = None  # coordinator-observed Propose time / drafted position
    target_plain_wall_s: float | None = None     # coordinator-observed Verify time of a γ=0 step
    mean_gamma: float | None = None

    def record_sequence(self, num_draft: int, accepted: int, emitted: int) -> None:
        self.seq_steps += 1
        self.drafted += num_draft
        self.accepted += accepted
        self.emitted += emitted
        if num_draft > len(self.drafted_at):
            grow = num_draft - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(num_draft):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted
        if num_draft:
            self.mean_gamma = _ema(self.mean_gamma, num_draft)

    def record_step(self, *, max_draft: int, draft_wall_s: float | None, target_wall_s: float,
                    draft_decode_s: float, target_decode_s: float) -> None:
        self.steps += 1
        if draft_decode_s > 0:
            self.draft_decode_s = _ema(self.draft_decode_s, draft_decode_s)
        if target_decode_s > 0:
            self.target_decode_s = _ema(self.target_decode_s, target_decode_s)
        if max_draft and draft_wall_s is not None:
            self.draft_wall_per_token_s = _ema(self.draft_wall_per_token_s, draft_wall_s / max_draft)
        if not max_draft:
            self.target_plain_wall_s = _ema(self.target_plain_wall_s, target_wall_s)

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tau(self) -> float | None:
        """Mean tokens emitted per sequence-step: 1 + accepted per step."""
        return 1 + self.accepted / self.seq_steps if self.seq_steps else None

    @property
    def c(self) -> float | None:
        if self.draft_decode_s and self.target_decode_s:
            return self.draft_decode_s / self.target_decode_s
        return None

    @property
    def c_system(self) -> float | None:
        if self.draft_wall_per_token_s and self.target_plain_wall_s:
            return self.draft_wall_per_token_s / self.target_plain_wall_s
        return None

    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def expected_speedup(self, gamma: float | None = None) -> float | None:
        gamma = self.mean_gamma if gamma is None else gamma
        if self.alpha is None or self.c is None or not gamma:
            return None
        return expected_speedup(self.alpha, round(gamma), self.c)

    def snapshot(self) -> dict:
        return {"steps": self.steps, "seq_steps": self.seq_steps, "drafted": self.drafted,
                "accepted": self.accepted, "emitted": self.emitted, "alpha": self.alpha,
                "tau": self.tau, "c": self.c, "c_system": self.c_system,
                "per_position_acceptance": self.per_position_acceptance(),
                "expected_speedup": self.expected_speedup(), "mean_gamma": self.mean_gamma,
                "requests_finished": self.requests_finished, "requests_failed": self.requests_failed}

    def summary(self) -> str:
        def f(x):
            return "-" if x is None else f"{x:.3f}"
        return (f"steps={self.steps} emitted={self.emitted} alpha={f(self.alpha)} tau={f(self.tau)} "
                f"c={f(self.c)} c_system={f(self.c_system)} expected_speedup={f(self.expected_speedup())}")
