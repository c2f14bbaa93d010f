"""Held-out measurements of the pair: perplexity, teacher-forced agreement, and acceptance α measured
by running speculative decoding itself (greedy and temperature 1) on held-out prompts.

The speculative loop recomputes every forward from scratch (no KV cache): the models are tiny, and
right-padded rows need no attention mask because causal attention never looks at later positions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def logits_at(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Logits of an HF causal LM at chosen positions: ids [B, T], pos [B, k] -> [B, k, V] fp32."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state                      # [B, T, H]
    picked = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, k, H]
    return model.lm_head(picked).float()


def windows(ids: torch.Tensor, length: int, limit: int) -> torch.Tensor:
    """Non-overlapping windows [n, length] from a 1-D token stream, at most limit of them."""
    n = min(limit, (ids.numel() - 1) // length)
    return ids[: n * length].view(n, length)


@torch.no_grad()
def mean_nll(model, wins: torch.Tensor, batch: int) -> float:
    total, count = 0.0, 0
    for i in range(0, wins.shape[0], batch):
        x = wins[i:i + batch]
        logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / max(count, 1)


@torch.no_grad()
def agreement(target, draft, wins: torch.Tensor, batch: int) -> dict[str, float]:
    """On real held-out text: how often the argmaxes agree (greedy acceptance of a first draft token),
    the mean of sum_x min(p, q) (its temperature-1 acceptance probability), and KL(p || q)."""
    top1 = overlap = kl = 0.0
    count = 0
    for i in range(0, wins.shape[0], batch):
        x = wins[i:i + batch, :-1]
        lp = F.log_softmax(target(input_ids=x, use_cache=False).logits.float(), -1)
        lq = F.log_softmax(draft(input_ids=x, use_cache=False).logits.float(), -1)
        top1 += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        overlap += torch.minimum(lp.exp(), lq.exp()).sum(-1).sum().item()
        kl += (lp.exp() * (lp - lq)).sum(-1).sum().item()
        count += x.numel()
    return {"top1_agreement": top1 / count, "overlap_min_pq": overlap / count, "kl_target_draft": kl / count}


def _pick(probs: torch.Tensor, greedy: bool, gen: torch.Generator) -> torch.Tensor:
    if greedy:
        return probs.argmax(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def speculative_decode(target, draft, prompts: torch.Tensor, n_new: int, gamma: int, greedy: bool,
                       gen: torch.Generator) -> dict[str, object]:
    """Leviathan et al. speculative decoding for a batch of equal-length prompts [B, P]; each row
    accepts independently. Returns α = accepted / drafted over all rows and steps, τ, and the rows."""
    B, P = prompts.shape
    dev = prompts.device
    rows = torch.arange(B, device=dev)
    buf = torch.zeros(B, P + n_new + 2 * gamma + 2, dtype=prompts.dtype, device=dev)
    buf[:, :P] = prompts
    length = torch.full((B,), P, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    accepted = drafted = steps = 0
    accepted_at = [0] * gamma
    while bool(active.any()):
        qs, xs = [], []
        for g in range(gamma):
            t = int(length.max()) + g
            q = F.softmax(logits_at(draft, buf[:, :t], (length - 1 + g)[:, None])[:, 0], -1)  # [B, V]
            x = _pick(q, greedy, gen)
            buf[rows, length + g] = x
            qs.append(q)
            xs.append(x)
        t = int(length.max()) + gamma
        offs = torch.arange(gamma + 1, device=dev)
        p = F.softmax(logits_at(target, buf[:, :t], length[:, None] - 1 + offs), -1)  # [B, gamma+1, V]
        q = torch.stack(qs, 1)                                                      # [B, gamma, V]
        x = torch.stack(xs, 1)                                                      # [B, gamma]
        if greedy:
            ok = x == p[:, :gamma].argmax(-1)
        else:
            px = p[:, :gamma].gather(-1, x[..., None]).squeeze(-1)
            qx = q.gather(-1, x[..., None]).squeeze(-1)
            u = torch.rand(px.shape, generator=gen, device=dev)
            ok = u * qx < px  # accept with probability min(1, p/q)
        n = ok.long().cumprod(1).sum(1)                                             # accepted prefix [B]
        if greedy:
            nxt = p[rows, n].argmax(-1)
        else:
            # Rejected at n: resample from norm(max(p - q, 0)); all accepted: the bonus token from p.
            resid = p[rows, n].clone()
            rejected = n < gamma
            qn = q[rows, n.clamp(max=gamma - 1)]
            resid[rejected] = (resid[rejected] - qn[rejected]).clamp(min=0)
            mass = resid.sum(-1, keepdim=True)
            resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), p[rows, n])
            nxt = _pick(resid, False, gen)
        buf[rows, length + n] = nxt
        act = active.long()
        accepted += int((n * act).sum())
        drafted += gamma * int(act.sum())
        for g in range(gamma):
            accepted_at[g] += int(((n > g).long() * act).sum())
        steps += int(act.sum())
        length = torch.where(active, length + n + 1, length)
        active = length - P < n_new
    alpha = accepted / max(drafted, 1)
    return {"alpha": alpha, "accepted": accepted, "drafted": drafted, "steps": steps,
            "tau": (accepted + steps) / max(steps, 1),
            "accepted_at_position": [a / max(steps, 1) for a in accepted_at],
            "tokens": buf[:, P:P + n_new]}


@torch.no_grad()
def greedy_decode(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    buf = prompts
    for _ in range(n_new):
        last = torch.full((buf.shape[0], 1), buf.shape[1] - 1, device=buf.device)
        nxt = logits_at(model, buf, last)[:, 0].argmax(-1)
        buf = torch.cat([buf, nxt[:, None]], 1)
    return buf[:, prompts.shape[1]:]


def evaluate_pair(target, draft, heldout: torch.Tensor, *, seq_len: int, max_windows: int, batch: int,
                  n_prompts: int, prompt_len: int, n_new: int, gamma: int, seed: int) -> dict[str, object]:
    """All the numbers of the model card; models in eval mode, in the dtype the caller chose."""
    wins = windows(heldout, seq_len + 1, max_windows)
    nll_t, nll_d = mean_nll(target, wins, batch), mean_nll(draft, wins, batch)
    out: dict[str, object] = {
        "heldout_tokens_scored": int(wins[:, 1:].numel()),
        "target_nll": nll_t, "target_ppl": math.exp(nll_t),
        "draft_nll": nll_d, "draft_ppl": math.exp(nll_d),
        **agreement(target, draft, wins, batch),
    }
    # Prompts spread evenly over the held-out stream (its files are in hash order, so this mixes packages).
    stride = max(prompt_len, (heldout.numel() - prompt_len) // max(n_prompts, 1))
    starts = torch.arange(n_prompts, device=heldout.device) * stride
    starts = starts[starts + prompt_len <= heldout.numel()]
    prompts = heldout[starts[:, None] + torch.arange(prompt_len, device=heldout.device)]
    gen = torch.Generator(device=heldout.device).manual_seed(seed)
    greedy = speculative_decode(target, draft, prompts, n_new, gamma, True, gen)
    plain = greedy_decode(target, prompts, n_new)
    sampled = speculative_decode(target, draft, prompts, n_new, gamma, False, gen)
    same = (greedy["tokens"] == plain)
    out.update({
        "spec_prompts": int(prompts.shape[0]), "spec_prompt_len": prompt_len, "spec_new_tokens": n_new,
        "gamma": gamma,
        "alpha_greedy": greedy["alpha"], "tau_greedy": greedy["tau"],
        "accepted_at_position_greedy": greedy["accepted_at_position"],
        "alpha_t1": sampled["alpha"], "tau_t1": sampled["tau"],
        "accepted_at_position_t1": sampled["accepted_at_position"],
        # Lossless check of the loop itself: greedy speculative output vs the target's own greedy output.
        "greedy_spec_equals_target_tokens": same.float().mean().item(),
        "greedy_spec_equals_target_rows": same.all(1).float().mean().item(),
    })
    return out
