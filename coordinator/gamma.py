"""How many tokens to draft for a sequence this step (γ).

α here is Leviathan's per-token acceptance probability, accepted / (accepted + rejections)
(specdec.cost_model.alpha_estimate; the gauge specdec_alpha), which is what the expected-speedup
formula takes; accepted / drafted (specdec_acceptance_ratio) would undercount it.
"""
from __future__ import annotations

from specdec.cost_model import expected_speedup

PRIOR_WEIGHT = 8.0      # tested draft tokens' worth of trust in the global α before a request has its own
DEFAULT_ALPHA = 0.6     # before anything was measured
DEFAULT_C = 0.1         # draft/target cost ratio before the servers reported one

__all__ = ["best_gamma", "choose_num_draft", "expected_speedup", "request_alpha"]


def request_alpha(accepted: int, rejections: int, prior: float | None) -> float:
    """The request's α (accepted / tested draft tokens), shrunk towards the global one while it has
    few samples. Each step tests its accepted tokens plus the one rejected, if any."""
    prior = DEFAULT_ALPHA if prior is None else prior
    return (accepted + PRIOR_WEIGHT * prior) / (accepted + rejections + PRIOR_WEIGHT)


def best_gamma(alpha: float, c: float, max_gamma: int) -> int:
    """The γ in 1..max_gamma with the highest expected speedup. Never 0: a request that stopped
    drafting would stop measuring its acceptance; use speculation off for that."""
    return max(range(1, max_gamma + 1), key=lambda g: (expected_speedup(alpha, g, c), -g))


def choose_num_draft(*, requested: int, policy: str, default: int, max_gamma: int,
                     accepted: int, rejections: int, global_alpha: float | None,
                     c: float | None) -> int:
    """requested > 0 wins; otherwise the fixed default or, with policy 'auto', the γ that maximises
    the expected speedup for this request's acceptance so far."""
    if requested > 0:
        return min(requested, max_gamma)
    if policy == "fixed":
        return default
    alpha = min(request_alpha(accepted, rejections, global_alpha), 0.999)
    return best_gamma(alpha, DEFAULT_C if not c else c, max_gamma)
