"""How many tokens to draft for a sequence this step (γ)."""
from __future__ import annotations

PRIOR_WEIGHT = 8.0      # drafted tokens' worth of trust in the global α before a request has its own
DEFAULT_ALPHA = 0.6     # before anything was measured
DEFAULT_C = 0.1         # draft/target cost ratio before the servers reported one


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. (2023) eq. 1: expected tokens per step over the relative cost of the step,
    (1 - α^(γ+1)) / ((1 - α)(γc + 1))."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def request_alpha(accepted: int, drafted: int, prior: float | None) -> float:
    """The request's acceptance rate, shrunk towards the global one while it has few samples."""
    prior = DEFAULT_ALPHA if prior is None else prior
    return (accepted + PRIOR_WEIGHT * prior) / (drafted + PRIOR_WEIGHT)


def best_gamma(alpha: float, c: float, max_gamma: int) -> int:
    """The γ in 1..max_gamma with the highest expected speedup. Never 0: a request that stopped
    drafting would stop measuring its acceptance; use speculation off for that."""
    return max(range(1, max_gamma + 1), key=lambda g: (expected_speedup(alpha, g, c), -g))


def choose_num_draft(*, requested: int, policy: str, default: int, max_gamma: int,
                     accepted: int, drafted: int, global_alpha: float | None,
                     c: float | None) -> int:
    """requested > 0 wins; otherwise the fixed default or, with policy 'auto', the γ that maximises
    the expected speedup for this request's acceptance so far."""
    if requested > 0:
        return min(requested, max_gamma)
    if policy == "fixed":
        return default
    alpha = min(request_alpha(accepted, drafted, global_alpha), 0.999)
    return best_gamma(alpha, DEFAULT_C if not c else c, max_gamma)
