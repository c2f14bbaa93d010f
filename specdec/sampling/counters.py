"""Acceptance counters of the verifier (raw counts; rates are derived, see DESIGN.md section 3)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.sampling.rejection import HostSpecOutput, SpecOutput


@dataclass
class SpecCounters:
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    steps: int = 0  # sequence-steps: each sequence in each verify counts once (k = 0 included)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts at index j accepted
    drafted_per_position: list[int] = field(default_factory=list)   # [j]: drafts made at index j

    def update(self, out: SpecOutput | HostSpecOutput, num_draft: Sequence[int]) -> HostSpecOutput:
        """Adds one verify step; copies `out` to the host once (unless it is already there) and
        returns the host copy so the caller does not copy again."""
        host = out.to_host() if isinstance(out, SpecOutput) else out
        if len(num_draft) != len(host.accepted):
            raise ValueError(f"num_draft: {len(num_draft)} counts for {len(host.accepted)} sequences")
        width = max(num_draft, default=0)
        for per in (self.accepted_per_position, self.drafted_per_position):
            per.extend([0] * (width - len(per)))
        for k, a in zip(num_draft, host.accepted):
            for j in range(k):
                self.drafted_per_position[j] += 1
            for j in range(a):
                self.accepted_per_position[j] += 1
        self.drafted += sum(num_draft)
        self.accepted += sum(host.accepted)
        self.emitted += sum(host.num_emitted)
        self.steps += len(num_draft)
        return host

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / drafted (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_emitted(self) -> float:
        """tau: tokens emitted per sequence-step = 1 + accepted / steps."""
        return self.emitted / self.steps if self.steps else 0.0

    def position_rates(self) -> list[float]:
        """Acceptance rate at each draft index j: accepted / drafted there."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
