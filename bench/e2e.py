"""End-to-end tokens/s through the gRPC services (client -> coordinator -> draft and target servers):
speculative decoding against plain decoding on the same services, and transformers' generate with
and without assisted generation (assistant_model=draft) on the same pair.

    python3 bench/e2e.py            # GPU sweep, bounded by --deadline (default 420 s)
    python3 bench/e2e.py --quick    # demo pair on one GPU, HF on it, 7B with the 68m draft
    python3 bench/e2e.py --smoke    # CPU plumbing check: demo pair + a tiny random pair

Sections, in this order (one not started when the deadline would pass is recorded as skipped):
  demo-1gpu  demo pair (models/target, models/draft; real acceptance), both on cuda:0
  hf-demo    transformers generate on the demo pair, plain and assisted, batch 1
  7b         Llama-7B shape with the llama-68m, llama-160m and tinyllama-1.1b shapes as drafts,
             batch 1 and 8 (--batches-7b), one GPU; random weights (servers' --random-weights: no checkpoint on disk)
             built to agree (--random-agreement: the target 1, each draft --agreement, default
             0.8; specdec/models/synthetic.py), so speculation has a real acceptance to work
             with; --agreement -1 gives plain random weights (acceptance ~0); the target server
             stays up while the drafts change
  demo-2gpu  demo pair with the target on cuda:0 and the draft on cuda:1 (two GPUs only)
  7b-2gpu    the 7B pairs with the target on cuda:0 and the drafts on cuda:1 (two GPUs only)
  7b-tp2     the 7B pairs with the target tensor-parallel over cuda:0 and cuda:1
             (--tensor-parallel-size 2) and the drafts on cuda:1 (two GPUs only; not in the
             default sections); rows carry target_tp 2
  hf-7b      transformers generate on the 7B shapes (its own random init, which does not agree:
             only its plain tokens/s goes beside our 7B rows; assisted stays in result["hf"])

Per row: tokens/s with speculation (fixed γ) and without (speculation off: plain decoding through
the same Verify path), acceptance = accepted/drafted, τ = 1 + accepted/steps, α solved from τ and γ
(Leviathan's per-token acceptance), c from the servers' start-up decode profiles (graph replays on
cuda), c_system from the coordinator's metrics when it exposes them, expected speedup τ/(γc + 1)
against the measured one, whether greedy speculative output equals greedy plain output, and the
RPC + coordinator overhead per step (step wall time minus the servers' handling, from the
coordinator's specdec_step_overhead_seconds) beside the step time and the coordinator's propose and
verify stage times. SPECDEC_PROFILE_DIR=DIR in the environment makes every server (engine thread) and
the coordinator (event loop) write a cProfile there at shutdown (specdec/profiling.py; it slows them
down: profile runs are for finding host time, not for the table).
Writes bench/results/e2e.json (and $OUT/e2e.json).
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import time
from pathlib import Path

from common import environment, table, write_result

import torch  # noqa: E402

from coordinator.launch import spawn_server, stop_all, wait_healthy  # noqa: E402
from services import (REPLAY_PROFILE, DEMO_DRAFT, DEMO_TARGET, code_prompts, coordinator,  # noqa: E402
                      decode_profile, graphs_captured, has_weights, leviathan_alpha, profile_at,
                      run_concurrent, steady_occupancy, steady_tok_s, summarize, write_shape_folder)
from specdec.metrics import SERVER_STEP_PARTS, STAGES, histogram_mean, sample_total, scrape  # noqa: E402

SEVEN_B_DRAFTS = ("llama-68m", "llama-160m", "tinyllama-1.1b")
# Smoke stand-ins for the 7B pair: random weights through the same code path, CPU-sized.
TINY = {"target": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192,
                       hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
        "draft": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192,
                      hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)}
# Rough seconds a section needs once started (start-up included); a section starts only if the
# deadline leaves it this much.
ESTIMATE = {"demo-1gpu": 40, "hf-demo": 15, "7b": 90, "7b-draft": 30, "demo-2gpu": 30, "7b-2gpu": 90, "7b-tp2": 110,
            "hf-7b": 45}


class Clock:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, section: str) -> bool:
        return self.left() >= ESTIMATE[section]


def server_args(a) -> list[str]:
    args = ["--max-model-len", str(a.max_model_len), "--max-num-draft", "8",
            "--warmup-batch-sizes", ",".join(map(str, sorted({1, *a.batches})))]
    if a.device == "cuda":
        # Two servers share a GPU: a fixed KV size each (the default takes 85% of what is free).
        args += ["--kv-memory", a.kv_memory,
                 "--graph-batch-sizes", ",".join(str(b) for b in (1, 2, 4, 8, 16, 32) if b <= max(a.batches)),
                 "--busy-poll-ms", str(a.busy_poll_ms)]
    return args


def measure(a, label: str, gpus: int, target, draft, batches, prompts, log_dir: Path) -> list[dict]:
    """One coordinator over running servers: per batch size a plain and a speculative pass."""
    rows = []
    poll = ["--busy-poll-ms", str(a.busy_poll_ms)] if gpus and a.busy_poll_ms else []
    args = ["--max-batch-size", str(max(batches)), "--num-draft", str(a.gamma), *poll]
    with contextlib.ExitStack() as stack:
        coord = stack.enter_context(coordinator(target, draft, log_dir, [*args, "--pipeline", "off"]))
        pipe = None
        if a.pipeline and draft is not None:
            # A second coordinator with --pipeline over the same servers, idle while the first
            # runs (and the other way round): the third pass of each batch size.
            (log_dir / "pipeline").mkdir(parents=True, exist_ok=True)
            pipe = stack.enter_context(coordinator(target, draft, log_dir / "pipeline", [*args, "--pipeline", "on"]))
        used = prompts[:max(b * a.waves for b in batches)]
        # Warm-up over every prompt: eager prefill shapes compile their Triton kernels here. Then
        # both modes at the largest batch for two waves, so that steps mixing a joining request's
        # prompt with other sequences' decode or verify tokens (eager, with shapes of their own)
        # compile before the timed passes: in one run the first batch-8 pass through a fresh 7B
        # target lost ~1.6 s to such a stall (bench/README.md).
        run_concurrent(coord.address, used, max(batches), max_new_tokens=4, ignore_eos=True)
        for speculate in (False, True):
            run_concurrent(coord.address, used[:2 * max(batches)], max(batches), max_new_tokens=16,
                           ignore_eos=True, speculate=speculate,
                           **({"num_draft": a.gamma} if speculate else {}))
        if pipe is not None:
            run_concurrent(pipe.address, used[:2 * max(batches)], max(batches), max_new_tokens=16,
                           ignore_eos=True, num_draft=a.gamma)
        tprof, dprof = decode_profile(target), decode_profile(draft)
        treplay, dreplay = decode_profile(target, REPLAY_PROFILE), decode_profile(draft, REPLAY_PROFILE)
        for b in batches:
            ps = used[:b * a.waves]
            common = dict(max_new_tokens=a.new_tokens, ignore_eos=True, timeout=a.request_timeout,
                          **sampling_params(a))
            m0, t0 = coord.metrics(), scrape(target.metrics_address)
            plain_recs, plain_wall = run_concurrent(coord.address, ps, b, speculate=False, **common)
            m1, t1 = coord.metrics(), scrape(target.metrics_address)
            spec_recs, spec_wall = run_concurrent(coord.address, ps, b, speculate=True,
                                                  num_draft=a.gamma, **common)
            m2, t2 = coord.metrics(), scrape(target.metrics_address)
            plain, spec = summarize(plain_recs, plain_wall), summarize(spec_recs, spec_wall)
            t_c, d_c = profile_at(tprof, b), profile_at(dprof, b)
            c = d_c / t_c if t_c and d_c else None
            t_r, d_r = profile_at(treplay, b), profile_at(dreplay, b)
            tau = spec["tau"]
            after = coord.metrics()
            c_sys = _metric(after, "specdec_system_cost_coefficient", b)
            # c as the coordinator holds it after the passes: the servers' decode profiles moved by
            # live forwards (EMA), beside the start-up c above (one warm-up median per server)
            c_live = _metric(after, "specdec_cost_coefficient", b)
            # Sampled outputs of two exact methods differ token by token; only greedy ones compare.
            same = [p.tokens == s.tokens for p, s in zip(plain_recs, spec_recs)
                    if p.error is None and s.error is None and not a.temperature]
            row = {"pair": label, "gpus": gpus, "batch": b, "gamma": a.gamma,
                   "plain_tok_s": plain["tok_s"], "spec_tok_s": spec["tok_s"],
                   "speedup": spec["tok_s"] / plain["tok_s"] if plain["tok_s"] and spec["tok_s"] else None,
                   "acceptance": spec["acceptance"], "tau": tau,
                   "alpha": leviathan_alpha(tau, a.gamma) if tau else None,
                   "c": c, "c_live": c_live, "c_system": c_sys,
                   # from the graph replays alone (no host work): the models' own cost ratio
                   "c_replay": d_r / t_r if t_r and d_r else None,
                   "expected": tau / (a.gamma * c + 1) if tau and c is not None else None,
                   "expected_system": tau / (a.gamma * c_sys + 1) if tau and c_sys is not None else None,
                   "greedy_equal": sum(same) / len(same) if same else None,
                   # RPC + coordinator time per step (step wall minus the servers' handling), mean
                   "overhead_ms_plain": _ms(histogram_mean(m1, "specdec_step_overhead_seconds", m0, mode="plain")),
                   "overhead_ms_spec": _ms(histogram_mean(m2, "specdec_step_overhead_seconds", m1, mode="spec")),
                   "step_ms_plain": _ms(histogram_mean(m1, "specdec_step_seconds", m0, mode="plain")),
                   "step_ms_spec": _ms(histogram_mean(m2, "specdec_step_seconds", m1, mode="spec")),
                   # where a speculative step's wall time goes (coordinator stages, means per step)
                   **{f"{stage}_ms_spec": _ms(histogram_mean(m2, "specdec_stage_seconds", m1, stage=stage))
                      for stage in STAGES},
                   # the servers' handling per step, split into device forward time and the rest
                   **{f"{role}_{part}_ms_{mode}": _ms(histogram_mean(after, "specdec_server_step_seconds",
                                                                     before, role=role, part=part))
                      for mode, before, after in (("plain", m0, m1), ("spec", m1, m2))
                      for role in ("draft", "target") for part in SERVER_STEP_PARTS},
                   "target_decode_ms": 1e3 * t_c if t_c else None,
                   "draft_decode_ms": 1e3 * d_c if d_c else None,
                   "graphs": {"target": graphs_captured(target), "draft": graphs_captured(draft)},
                   # how the step messages went (gRPC stream, step-channel socket, shared memory)
                   "step_paths": step_paths(after),
                   # the target's steps staged ahead (--verify-ahead) and how often a pass's guess held
                   **ahead_counts(t0, t1, "plain"), **ahead_counts(t1, t2, "spec"),
                   "plain": plain, "spec": spec}
            row.update(steady_rows(b, plain_recs, spec_recs, plain, spec, (m0, m1, m2), row["expected"]))
            row.update(per_step(row))
            if row["overhead_ms_spec"] is not None and row["step_ms_spec"]:
                row["overhead_frac_spec"] = row["overhead_ms_spec"] / row["step_ms_spec"]
            if row["target_forward_ms_spec"] and row["target_forward_ms_plain"]:
                # Leviathan's expected speedup assumes a verify forward costs a decode forward;
                # with the measured ratio r in its place: τ / (γc + r)
                r = row["verify_ratio"] = row["target_forward_ms_spec"] / row["target_forward_ms_plain"]
                if tau and c is not None:
                    row["expected_verify"] = tau / (a.gamma * c + r)
            if pipe is not None:
                row.update(pipelined_pass(a, pipe, ps, b, common, plain_recs, plain))
            rows.append(row)
            print(f"{label} gpus={gpus} batch={b}: plain {_f(plain['tok_s'])} tok/s, spec "
                  f"{_f(spec['tok_s'])} tok/s, acceptance {_f(spec['acceptance'], '.3f')}, "
                  f"c {_f(c, '.3f')}, overhead/step {_f(row['overhead_ms_spec'], '.3f')} ms "
                  f"(step {_f(row['step_ms_spec'], '.2f')} ms), steady speedup {_f(row['speedup_steady'], '.2f')} "
                  f"(occupancy plain {_f(row['occupancy_plain'], '.2f')}, spec {_f(row['occupancy_spec'], '.2f')}), "
                  f"steps over {', '.join(f'{k} {v}' for k, v in sorted(row['step_paths'].items())) or '-'}, "
                  f"staged ahead taken {_f(row['ahead_taken_frac_spec'], '.2f')} of {_f(row['ahead_taken_spec'] + row['ahead_dropped_spec'])} (spec), "
                  f"{_f(row['ahead_taken_frac_plain'], '.2f')} (plain), "
                  f"errors {plain['errors'] + spec['errors']}"
                  + (f" ({plain['first_error'] or spec['first_error']})"
                     if plain['errors'] + spec['errors'] else ""), flush=True)
    return rows


def steady_rows(b: int, plain_recs, spec_recs, plain: dict, spec: dict, scrapes, expected) -> dict:
    """Beside the whole run's tokens/s: tokens/s while all b slots decode (services.steady_window:
    the drain at the end of a finite closed-loop run left out), and each mode's occupancy, the
    mean sequences per batch step over b (sequence steps from the requests' usage, batch steps
    from the coordinator's step histogram)."""
    m0, m1, m2 = scrapes
    out = {"plain_steady_tok_s": steady_tok_s(plain_recs, b), "spec_steady_tok_s": steady_tok_s(spec_recs, b)}
    p, s = out["plain_steady_tok_s"], out["spec_steady_tok_s"]
    out["speedup_steady"] = s / p if s and p else None
    out["steady_over_expected"] = out["speedup_steady"] / expected if out["speedup_steady"] and expected else None
    out["occupancy_steady_plain"] = steady_occupancy(plain_recs, b)
    out["occupancy_steady_spec"] = steady_occupancy(spec_recs, b)
    for mode, before, after, summary in (("plain", m0, m1, plain), ("spec", m1, m2, spec)):
        # every batch step between the scrapes, whatever its mode label (a speculative pass's
        # steps that only prefill are labelled plain)
        steps = (sample_total(after, "specdec_step_seconds_count")
                 - sample_total(before, "specdec_step_seconds_count"))
        out[f"occupancy_{mode}"] = summary["steps"] / (steps * b) if steps and summary["steps"] else None
    return out


def per_step(row: dict) -> dict:
    """The speedup of one batch step: τ (tokens per sequence and target step) times the plain
    step's mean time over the speculative step's. Leviathan's expected speedup models this, a
    step of a full batch; the steady tokens/s also carry how full the batch was (occupancy)."""
    tau, plain, spec = row.get("tau"), row.get("step_ms_plain"), row.get("step_ms_spec")
    if not (tau and plain and spec):
        return {}
    out = {"step_speedup": tau * plain / spec}
    if row.get("expected"):
        out["step_over_expected"] = out["step_speedup"] / row["expected"]
    return out


def sampling_params(a) -> dict:
    """The requests' sampling: greedy, or --temperature with a fixed seed (reproducible runs)."""
    return dict(temperature=a.temperature, top_k=a.top_k, seed=1234) if a.temperature else {}


def pipelined_pass(a, pipe, prompts, b: int, common: dict, plain_recs, plain: dict) -> dict:
    """The speculative pass again through the --pipeline coordinator: its speed against plain
    decoding, and how often a step's drafts came from the draft's pipelined extension."""
    m0 = pipe.metrics()
    recs, wall = run_concurrent(pipe.address, prompts, b, speculate=True, num_draft=a.gamma, **common)
    m1 = pipe.metrics()
    s = summarize(recs, wall)
    same = [p.tokens == q.tokens for p, q in zip(plain_recs, recs)
            if p.error is None and q.error is None and not a.temperature]
    hits, spec_steps = (sample_total(m1, name) - sample_total(m0, name)
                        for name in ("specdec_pipelined_steps_total", "specdec_spec_steps_total"))
    return {"pipe_tok_s": s["tok_s"],
            "pipe_speedup": s["tok_s"] / plain["tok_s"] if s["tok_s"] and plain["tok_s"] else None,
            "pipe_acceptance": s["acceptance"], "pipe_tau": s["tau"],
            "pipe_greedy_equal": sum(same) / len(same) if same else None,
            "pipelined_frac": hits / spec_steps if spec_steps else None,
            "pipe_step_ms": _ms(histogram_mean(m1, "specdec_step_seconds", m0, mode="spec")),
            **{f"pipe_{stage}_ms": _ms(histogram_mean(m1, "specdec_stage_seconds", m0, stage=stage))
               for stage in ("propose", "verify", "ahead")},
            "pipe": s}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _metric(samples: dict, name: str, batch: int) -> float | None:
    values = samples.get(name) or []
    exact = [v for labels, v in values if labels.get("batch") == str(batch)]
    value = exact[0] if exact else (values[0][1] if values else None)
    return None if value is None or value != value else value  # NaN: not measured yet


def step_paths(samples: dict) -> dict:
    """{role: how its steps traveled (grpc | socket | shared)} from the coordinator's
    specdec_step_transport_state gauge; {} from a coordinator that does not export it."""
    return {labels["role"]: labels["transport"] for labels, v in samples.get("specdec_step_transport_state") or []
            if v == 1}


AHEAD = "specdec_verify_ahead_steps_total"


def ahead_counts(before: dict, after: dict, mode: str) -> dict:
    """The target's steps staged ahead between two scrapes of its /metrics: taken (the next Verify
    was the step expected) and dropped, and the share taken (None when it staged nothing: off,
    or a server without the counter)."""
    taken, dropped = (sample_total(after, AHEAD, outcome=o) - sample_total(before, AHEAD, outcome=o)
                      for o in ("taken", "dropped"))
    return {f"ahead_taken_{mode}": taken, f"ahead_dropped_{mode}": dropped,
            f"ahead_taken_frac_{mode}": taken / (taken + dropped) if taken + dropped else None}


def _f(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def serve_pairs(a, label: str, target_path: Path, drafts: list[tuple[str, Path]], target_dev: str,
                draft_dev: str, gpus: int, batches, prompts, log_root: Path, clock: Clock,
                target_args: list[str] = (), draft_args: list[str] = ()) -> list[dict]:
    """Starts the target once (and each draft once it is up); each draft gets its own server
    and coordinator in turn."""
    rows, procs = [], []
    args = server_args(a)
    log_root.mkdir(parents=True, exist_ok=True)
    try:
        target = spawn_server("target", target_path, log_root, device=target_dev,
                              args=args + list(target_args) + shlex.split(a.target_args))
        procs.append(target)
        # Up before any draft starts: a server times its decode profile (c's inputs) at start-up,
        # and one started beside the other's warm-up can time it on a busy GPU (session 18: the 68m
        # draft's b 1 forward logged 0.405 ms in a run that started both together, 0.17 before).
        wait_healthy(target, a.startup_timeout)
        draft = None
        for i, (dlabel, dpath) in enumerate(drafts):
            name = f"{label}/{dlabel}" if dlabel else label
            if i and not clock.allows("7b-draft"):
                rows.append({"pair": name, "gpus": gpus, "skipped": "deadline"})
                continue
            if draft is not None:
                stop_all([draft])
            log_dir = log_root / f"draft{i}"
            log_dir.mkdir(parents=True, exist_ok=True)
            draft = spawn_server("draft", dpath, log_dir, device=draft_dev,
                                 args=args + list(draft_args) + shlex.split(a.draft_args))
            procs.append(draft)
            wait_healthy(draft, a.startup_timeout)
            rows += measure(a, name, gpus, target, draft, batches, prompts, log_dir)
    finally:
        stop_all(procs)
    return rows


def hf_generate(target_path: Path, draft_paths: list[tuple[str, Path]], label: str, device: str,
                dtype: torch.dtype, prompts: list[str], a) -> list[dict]:
    """transformers' own generate, batch 1, greedy: plain, then assisted by each draft (γ fixed)."""
    import transformers
    from coordinator.tokenizer import TextTokenizer
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tok = TextTokenizer(target_path)
    ids = [torch.tensor([tok.encode(p)], device=device) for p in prompts]
    n = a.hf_new_tokens
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    def load(path):
        auto = transformers.AutoModelForCausalLM
        if has_weights(path):
            return auto.from_pretrained(path, dtype=dtype).to(device).eval()
        # A shape folder (random weights): transformers' own random init, on the device.
        with torch.device(device):
            return auto.from_config(transformers.AutoConfig.from_pretrained(path), dtype=dtype).eval()

    def tok_s(model, **extra) -> tuple[float, list[list[int]]]:
        model.generate(ids[0], **{**kw, **extra, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        outs, t = [], 0.0
        for x in ids:
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(x, **kw, **extra)
            _sync(device)
            t += time.perf_counter() - t0
            outs.append(out[0, x.shape[1]:].tolist())
        return len(ids) * n / t, outs

    rows = []
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # like the servers: tiny matmuls on a small busy host run faster
    with torch.no_grad():
        target = load(target_path)
        plain, plain_out = tok_s(target)
        for dlabel, dpath in draft_paths:
            draft = load(dpath)
            draft.generation_config.num_assistant_tokens = a.gamma
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            try:
                assisted, out = tok_s(target, assistant_model=draft)
                err = None
            except Exception as e:  # reported in the row: the comparison column says why
                assisted, out, err = None, None, f"{type(e).__name__}: {e}"[:300]
            rows.append({"pair": f"{label}/{dlabel}" if dlabel else label, "hf_plain_tok_s": plain,
                         "hf_assisted_tok_s": assisted, "hf_speedup": assisted / plain if assisted else None,
                         "hf_greedy_equal": (sum(o == p for o, p in zip(out, plain_out)) / len(out)
                                             if out else None), "hf_error": err})
            print(f"HF {rows[-1]['pair']}: plain {plain:.0f} tok/s, assisted {_f(assisted)} tok/s"
                  + (f" ({err})" if err else ""), flush=True)
            del draft
        del target
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check with small settings")
    p.add_argument("--quick", action="store_true", help="demo pair on one GPU, HF, 7B with the 68m draft")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds for the whole run")
    p.add_argument("--batches", type=int, nargs="+", help="concurrent clients (default 1 8; smoke 1 2)")
    p.add_argument("--batches-7b", type=int, nargs="+", default=[1, 8])
    p.add_argument("--agreement", type=float, default=0.8,
                   help="the 7B pairs' random drafts agree with the target's greedy choice on this "
                        "fraction of the vocabulary (-1: plain random weights)")
    p.add_argument("--new-tokens", type=int,
                   help="tokens per request (default 256; smoke 16). Each request's join (the step that "
                        "waits for its admission and the step that takes its prompt) is a fixed cost the "
                        "expected speedup does not model: at 64 tokens the b 8 speculative passes' slots "
                        "were empty 9%% of the steady window, at 256 2%% (bench/README, session 34)")
    p.add_argument("--hf-new-tokens", type=int, default=64,
                   help="tokens per transformers generate call, for its tokens/s (default 64, at most "
                        "--new-tokens; its eager 7B ran 14-16 tok/s on an H200)")
    p.add_argument("--waves", type=int, default=3, help="requests per client and measurement")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per step")
    p.add_argument("--busy-poll-ms", type=float, default=20.0,
                   help="--busy-poll-ms of the servers and the coordinator on cuda (0: all off); CPU "
                        "runs never poll")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the 7B and demo passes at this temperature (seeded; 0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k truncation")
    p.add_argument("--pipeline", action="store_true",
                   help="also time each speculative pass through a second coordinator with --pipeline")
    p.add_argument("--draft-args", default="",
                   help="more arguments for every draft server, one string (--draft-args=--no-sampler-graphs)")
    p.add_argument("--target-args", default="", help="more arguments for every target server, one string")
    p.add_argument("--drafts", nargs="+", choices=SEVEN_B_DRAFTS,
                   help="draft shapes of the 7B sections (default: all three; --quick: the 68m)")
    p.add_argument("--sections", nargs="+", help="subset of demo-1gpu hf-demo 7b demo-2gpu 7b-2gpu hf-7b, "
                                                   "or 7b-tp2")
    p.add_argument("--kv-memory", default="4GiB", help="KV cache of each server on cuda")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--work-dir", type=Path, help="where random checkpoints and logs go (default: a temp dir)")
    a = p.parse_args(argv)
    a.device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    a.batches = a.batches or ([1, 2] if a.smoke else [1, 8])
    a.new_tokens = a.new_tokens or (16 if a.smoke else 256)
    if a.hf_new_tokens < 1 or a.new_tokens < 1:
        p.error("--new-tokens and --hf-new-tokens must be at least 1")
    a.hf_new_tokens = min(a.hf_new_tokens, a.new_tokens)
    if a.smoke:
        a.waves = min(a.waves, 2)
    default = ["demo-1gpu", "hf-demo", "7b"] + ([] if a.quick else ["demo-2gpu", "7b-2gpu", "hf-7b"])
    a.sections = a.sections or default
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    clock = Clock(a.deadline)
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    dev0 = "cuda:0" if a.device == "cuda" else "cpu"
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="specdec-e2e-"))
    prompts = code_prompts(max(a.batches + a.batches_7b) * a.waves, 200, 400, seed=1)
    rows, hf_rows, skipped = [], [], []

    def section(name: str) -> bool:
        if name not in a.sections:
            return False
        if not clock.allows(name):
            skipped.append(name)
            print(f"skipping {name}: {clock.left():.0f}s left", flush=True)
            return False
        print(f"== {name} ({clock.left():.0f}s left)", flush=True)
        return True

    def seven_b() -> tuple[Path, list[tuple[str, Path]]]:
        """Model folders of the 7B pair (smoke: the tiny stand-ins): shapes, no weights."""
        if a.smoke:
            target_shape, draft_shapes = TINY["target"], [("tiny-draft", TINY["draft"])]
        else:
            target_shape = "llama-7b"
            names = a.drafts or (SEVEN_B_DRAFTS[:1] if a.quick else SEVEN_B_DRAFTS)
            draft_shapes = [(s, s) for s in names]
        dt = str(dtype).removeprefix("torch.")
        return (write_shape_folder(work / "shapes" / "target", target_shape, dtype=dt),
                [(label, write_shape_folder(work / "shapes" / label, shape, dtype=dt))
                 for label, shape in draft_shapes])

    seven_label = "tiny-random" if a.smoke else "llama-7b"
    if section("demo-1gpu"):
        rows += serve_pairs(a, "demo", DEMO_TARGET, [("", DEMO_DRAFT)], dev0, dev0, min(gpus, 1),
                            a.batches, prompts, work / "logs" / "demo-1gpu", clock)
    if section("hf-demo"):
        hf_rows += hf_generate(DEMO_TARGET, [("", DEMO_DRAFT)], "demo", dev0, dtype, prompts[:a.waves], a)
    def seven_b_rows(name: str, target_dev: str, draft_dev: str, used_gpus: int, tp: int = 1) -> list[dict]:
        tdir, drafts = seven_b()
        random = ["--random-weights"]
        agree = (lambda x: ["--random-agreement", str(x)]) if a.agreement >= 0 else (lambda x: [])
        tp_args = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        got = serve_pairs(a, seven_label, tdir, drafts, target_dev, draft_dev, used_gpus, a.batches_7b,
                          prompts, work / "logs" / name, clock, random + agree(1) + tp_args,
                          random + agree(a.agreement))
        return [{**r, "target_tp": tp} if tp > 1 else r for r in got]

    if section("7b"):
        rows += seven_b_rows("7b", dev0, dev0, min(gpus, 1))
    if "demo-2gpu" in a.sections and gpus < 2:
        skipped.append("demo-2gpu (one GPU)")
    elif section("demo-2gpu"):
        rows += serve_pairs(a, "demo", DEMO_TARGET, [("", DEMO_DRAFT)], "cuda:0", "cuda:1", 2,
                            a.batches, prompts, work / "logs" / "demo-2gpu", clock)
    if "7b-2gpu" in a.sections and gpus < 2:
        skipped.append("7b-2gpu (one GPU)")
    elif section("7b-2gpu"):
        rows += seven_b_rows("7b-2gpu", "cuda:0", "cuda:1", 2)
    if "7b-tp2" in a.sections and gpus < 2:
        skipped.append("7b-tp2 (one GPU)")
    elif section("7b-tp2"):
        rows += seven_b_rows("7b-tp2", "cuda:0", "cuda:1", 2, tp=2)
    if section("hf-7b"):
        tdir, drafts = seven_b()
        hf_rows += hf_generate(tdir, drafts, seven_label, dev0, dtype, prompts[:1], a)

    for r in rows:  # HF numbers next to our batch-1, one-GPU row of the same pair
        hf = next((h for h in hf_rows if h["pair"] == r["pair"]), None)
        if hf and r.get("batch") == 1 and r.get("gpus", 0) <= 1:
            if r["pair"].startswith(seven_label) and a.agreement >= 0:
                # transformers loads its own random init, whose models agree on nothing: its plain
                # speed compares, its assisted speed (acceptance ~0) does not sit beside ours.
                r.update(hf_plain_tok_s=hf.get("hf_plain_tok_s"),
                         hf_note="assisted generation not comparable: transformers' random init "
                                 "does not agree; see result['hf']")
            else:
                r.update({k: v for k, v in hf.items() if k != "pair"})
    result = {"benchmark": "e2e", "environment": environment(), "device": a.device, "gpus": gpus,
              "settings": {"new_tokens": a.new_tokens, "hf_new_tokens": a.hf_new_tokens, "gamma": a.gamma,
                           "waves": a.waves,
                           "batches": a.batches, "batches_7b": a.batches_7b, "smoke": a.smoke,
                           "quick": a.quick, "deadline_s": a.deadline,
                           "sampling": sampling_params(a) or "greedy",
                           "random_agreement_7b": a.agreement if a.agreement >= 0 else None,
                           "dtype": str(dtype).removeprefix("torch."),
                           "busy_poll_ms": a.busy_poll_ms if a.device == "cuda" else 0,
                           "pipeline": a.pipeline, "draft_args": a.draft_args,
                           "target_args": a.target_args},
              "rows": rows, "hf": hf_rows, "skipped": skipped,
              "elapsed_s": a.deadline - clock.left(), "work_dir": str(work)}
    path = write_result("e2e_smoke" if a.smoke else "e2e", result)
    print()
    print(table([r for r in rows if "skipped" not in r], [
        ("pair", "pair", "s"), ("gpus", "gpus", "d"), ("batch", "b", "d"),
        ("plain_tok_s", "plain tok/s", ".0f"), ("spec_tok_s", "spec tok/s", ".0f"),
        ("speedup", "speedup", ".2f"), ("expected", "expected (c)", ".2f"),
        ("expected_system", "expected (c_sys)", ".2f"), ("acceptance", "acc/drafted", ".3f"),
        ("alpha", "alpha", ".3f"), ("tau", "tau", ".2f"), ("c", "c", ".3f"), ("c_live", "c live", ".3f"),
        ("c_replay", "c replay", ".3f"),
        ("c_system", "c_sys", ".3f"), ("greedy_equal", "greedy ==", ".2f"),
        ("step_ms_spec", "step ms", ".2f"), ("propose_ms_spec", "propose ms", ".2f"),
        ("verify_ms_spec", "verify ms", ".2f"),
        ("overhead_ms_spec", "overhead ms/step", ".3f"), ("overhead_frac_spec", "of step", ".1%"),
        ("hf_plain_tok_s", "HF tok/s", ".0f"), ("hf_assisted_tok_s", "HF assisted tok/s", ".0f")]))
    if a.pipeline:
        print("\nthe speculative pass again through a coordinator with --pipeline (same servers, same run)")
        print(table([r for r in rows if "pipe_tok_s" in r], [
            ("pair", "pair", "s"), ("gpus", "gpus", "d"), ("batch", "b", "d"),
            ("plain_tok_s", "plain tok/s", ".0f"), ("spec_tok_s", "spec tok/s", ".0f"),
            ("pipe_tok_s", "pipelined tok/s", ".0f"), ("speedup", "speedup", ".2f"),
            ("pipe_speedup", "pipelined speedup", ".2f"), ("pipelined_frac", "steps w/o Propose", ".1%"),
            ("step_ms_spec", "spec step ms", ".2f"), ("pipe_step_ms", "pipelined step ms", ".2f"),
            ("pipe_propose_ms", "propose ms", ".2f"), ("pipe_ahead_ms", "ahead wait ms", ".2f"),
            ("pipe_greedy_equal", "greedy ==", ".2f")]))
    print("\nwhere a step's time goes (ms per step: server forward = device time of its forwards, "
          "host = the rest of its handling; transport = RPC + coordinator)")
    print(table([r for r in rows if "skipped" not in r], [
        ("pair", "pair", "s"), ("gpus", "gpus", "d"), ("batch", "b", "d"),
        ("step_ms_plain", "plain step", ".2f"), ("target_forward_ms_plain", "target fwd", ".2f"),
        ("target_host_ms_plain", "target host", ".2f"), ("overhead_ms_plain", "transport", ".2f"),
        ("step_ms_spec", "spec step", ".2f"), ("draft_forward_ms_spec", "draft fwd", ".2f"),
        ("draft_host_ms_spec", "draft host", ".2f"), ("target_forward_ms_spec", "target fwd", ".2f"),
        ("target_host_ms_spec", "target host", ".2f"), ("overhead_ms_spec", "transport", ".2f"),
        ("verify_ratio", "verify / decode fwd", ".2f"), ("speedup", "speedup", ".2f"),
        ("expected_verify", "expected (c, verify)", ".2f")]))
    print("\nthe servers' host time split (ms per step): the engine's call outside its forwards, and the "
          "server's handling around the engine (conversion, response)")
    print(table([r for r in rows if "skipped" not in r], [
        ("pair", "pair", "s"), ("gpus", "gpus", "d"), ("batch", "b", "d")]
        + [(f"{role}_{part}_ms_{mode}", f"{mode} {role} {label}", ".2f") for mode in ("plain", "spec")
           for role in ("draft", "target") if not (mode == "plain" and role == "draft")
           for part, label in (("engine_host", "engine host"), ("serving", "serving"))]))
    print("\nwhile every slot decodes (the run's final drain left out; occupancy: sequences per batch "
          "step / b over the whole run, and in that window the share of slots between a request's first "
          "and last token; per step: τ x plain step / spec step)")
    print(table([r for r in rows if "skipped" not in r], [
        ("pair", "pair", "s"), ("gpus", "gpus", "d"), ("batch", "b", "d"),
        ("plain_steady_tok_s", "plain tok/s", ".0f"), ("spec_steady_tok_s", "spec tok/s", ".0f"),
        ("speedup_steady", "speedup", ".2f"), ("expected", "expected (c)", ".2f"),
        ("steady_over_expected", "measured / expected", ".2f"), ("speedup", "whole-run speedup", ".2f"),
        ("occupancy_plain", "occupancy plain", ".2f"), ("occupancy_spec", "occupancy spec", ".2f"),
        ("occupancy_steady_plain", "in window plain", ".2f"), ("occupancy_steady_spec", "in window spec", ".2f"),
        ("step_speedup", "per-step speedup", ".2f"), ("step_over_expected", "per step / expected", ".2f")]))
    if skipped:
        print(f"skipped: {', '.join(skipped)}")
    print(f"wrote {path} ({result['elapsed_s']:.0f}s)")
    errors = sum(r["plain"]["errors"] + r["spec"]["errors"] for r in rows if "plain" in r)
    return 1 if errors or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
