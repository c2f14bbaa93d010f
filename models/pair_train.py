"""Training loops of the demo pair: the target by cross-entropy (with the draft learning KL to its
logits on the same batches), the target's own continuations as extra data, the draft's distillation.

Every loop stops on wall time and keeps the checkpoint with the best validation loss.
"""
from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from make_pair import Settings

Log = Callable[[str], None]


class Stream:
    """Random seq_len+1 windows of a token stream on the device (and of generated rows, if any)."""

    def __init__(self, ids: torch.Tensor, s: Settings, gen: torch.Generator):
        self.ids, self.s, self.gen = ids, s, gen
        self.coin = random.Random(s.seed)  # which batches are generated rows; host-side, so no device sync
        self.offs = torch.arange(s.seq_len + 1, device=ids.device)
        self.generated: torch.Tensor | None = None  # [G, seq_len+1]

    def batch(self, allow_generated: bool = False) -> torch.Tensor:
        s, dev = self.s, self.ids.device
        if allow_generated and self.generated is not None and self.coin.random() < s.gen_mix:
            rows = torch.randint(0, self.generated.shape[0], (s.batch,), generator=self.gen, device=dev)
            return self.generated[rows]
        starts = torch.randint(0, self.ids.numel() - s.seq_len - 1, (s.batch,), generator=self.gen, device=dev)
        return self.ids[starts[:, None] + self.offs]


def optimizer(model, lr: float, s: Settings):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=s.device == "cuda")


def set_lr(opt, peak: float, step: int, progress: float, s: Settings) -> None:
    """Linear warmup over steps, cosine to a tenth over the phase's time budget."""
    warm = min(1.0, (step + 1) / s.warmup_steps)
    lr = peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
    for g in opt.param_groups:
        g["lr"] = lr


def autocast(s: Settings):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=s.device == "cuda")


def kl_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-token KL(p_target || q_draft) at temperature 1; the target side carries no gradient."""
    lq = F.log_softmax(draft_logits.float().flatten(0, 1), -1)
    lp = F.log_softmax(target_logits.detach().float().flatten(0, 1), -1)
    return F.kl_div(lq, lp, log_target=True, reduction="batchmean")


@torch.no_grad()
def val_losses(target, draft, val: torch.Tensor, s: Settings) -> tuple[float, float]:
    """(target cross-entropy, KL(target || draft)) on the validation windows, bf16 autocast."""
    ce = kl = 0.0
    n = 0
    for i in range(0, val.shape[0], s.batch):
        x = val[i:i + s.batch]
        with autocast(s):
            tl = target(input_ids=x[:, :-1], use_cache=False).logits
            ce += F.cross_entropy(tl.float().flatten(0, 1), x[:, 1:].flatten()).item() * x.shape[0]
            if draft is not None:
                kl += kl_loss(draft(input_ids=x[:, :-1], use_cache=False).logits, tl).item() * x.shape[0]
        n += x.shape[0]
    return ce / n, kl / n


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_target(target, draft, stream: Stream, val: torch.Tensor, budget: float, s: Settings, log: Log):
    """Cross-entropy training of the target; with cotrain, the draft takes one KL step on the same
    batch against the target's logits of that step (free draft training while the target learns)."""
    opt_t = optimizer(target, s.target_lr, s)
    opt_d = optimizer(draft, s.draft_lr, s) if draft is not None else None
    target.train()
    best, best_step, step, tokens = (math.inf, math.inf), 0, 0, 0
    best_t = best_d = None
    t0 = time.perf_counter()
    next_eval = s.eval_every_seconds
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= next_eval or elapsed >= budget:
            target.eval()
            ce, kl = val_losses(target, draft, val, s)
            target.train()
            if ce < best[0]:
                best, best_step, best_t = (ce, kl), step, snapshot(target)
                best_d = snapshot(draft) if draft is not None else None
            log(f"target step {step} tokens {tokens:,} ({tokens / max(elapsed, 1e-9):,.0f}/s): "
                f"val ce {ce:.4f} ppl {math.exp(ce):.2f}" + (f", draft val kl {kl:.4f}" if draft else ""))
            next_eval += s.eval_every_seconds
            if elapsed >= budget:
                break
        x = stream.batch()
        set_lr(opt_t, s.target_lr, step, elapsed / budget, s)
        with autocast(s):
            logits = target(input_ids=x[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt_t.step()
        opt_t.zero_grad(set_to_none=True)
        if draft is not None:
            set_lr(opt_d, s.draft_lr, step, elapsed / budget, s)
            with autocast(s):
                dloss = kl_loss(draft(input_ids=x[:, :-1], use_cache=False).logits, logits)
            dloss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt_d.step()
            opt_d.zero_grad(set_to_none=True)
        step += 1
        tokens += x[:, 1:].numel()
    target.load_state_dict(best_t)
    if draft is not None:
        draft.load_state_dict(best_d)
    target.eval()
    return {"steps": step, "best_step": best_step, "train_tokens": tokens, "train_seconds": budget,
            "best_val_ce": best[0]}


@torch.no_grad()
def generate_rows(target, stream: Stream, budget: float, s: Settings, log: Log) -> torch.Tensor | None:
    """The target's own continuations of training prompts (half greedy, half sampled at temperature 1):
    speculative decoding runs the draft on the target's outputs, so the draft learns them too."""
    if budget <= 0 or s.gen_mix <= 0:
        return None
    dev, rows, chunks = stream.ids.device, s.gen_batch, []
    n_new = s.seq_len + 1 - s.gen_prompt_len
    greedy = torch.arange(rows, device=dev) % 2 == 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < budget:
        starts = torch.randint(0, stream.ids.numel() - s.gen_prompt_len, (rows,), generator=stream.gen, device=dev)
        seq = stream.ids[starts[:, None] + torch.arange(s.gen_prompt_len, device=dev)]
        with autocast(s):
            out = target(input_ids=seq, use_cache=True, logits_to_keep=1)
            toks = [seq]
            for i in range(n_new):
                probs = F.softmax(out.logits[:, -1].float(), -1)
                sampled = torch.multinomial(probs, 1, generator=stream.gen).squeeze(-1)
                nxt = torch.where(greedy, probs.argmax(-1), sampled)
                toks.append(nxt[:, None])
                if i + 1 < n_new:
                    out = target(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
        chunks.append(torch.cat(toks, 1))
    gen = torch.cat(chunks)
    log(f"generated {gen.shape[0]} rows of {gen.shape[1]} tokens from the target "
        f"({gen.shape[0] * n_new / (time.perf_counter() - t0):,.0f} tokens/s)")
    return gen


def distill_draft(target, draft, stream: Stream, val: torch.Tensor, budget: float, s: Settings, log: Log):
    opt = optimizer(draft, s.draft_lr, s)
    draft.train()
    best, best_step, best_d, step, tokens = math.inf, 0, None, 0, 0
    t0 = time.perf_counter()
    next_eval = s.eval_every_seconds
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= next_eval or elapsed >= budget:
            draft.eval()
            _, kl = val_losses(target, draft, val, s)
            draft.train()
            if kl < best:
                best, best_step, best_d = kl, step, snapshot(draft)
            log(f"draft step {step} tokens {tokens:,} ({tokens / max(elapsed, 1e-9):,.0f}/s): val kl {kl:.4f}")
            next_eval += s.eval_every_seconds
            if elapsed >= budget:
                break
        x = stream.batch(allow_generated=True)
        set_lr(opt, s.draft_lr, step, elapsed / budget, s)
        with autocast(s):
            with torch.no_grad():
                tl = target(input_ids=x[:, :-1], use_cache=False).logits
            loss = kl_loss(draft(input_ids=x[:, :-1], use_cache=False).logits, tl)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x[:, 1:].numel()
    draft.load_state_dict(best_d)
    draft.eval()
    return {"steps": step, "best_step": best_step, "distill_tokens": tokens, "distill_seconds": budget,
            "best_val_kl": best}
