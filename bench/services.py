"""What the service benchmarks (e2e.py, serving.py) share: random-weight models of public shapes,
model servers and coordinators as local processes, code prompts, streaming clients, and the numbers
the services report about themselves (start-up decode profile, coordinator metrics when exposed)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common import ROOT, hf_config

from coordinator.client import AsyncClient  # noqa: E402
from coordinator.launch import Proc, free_port, spawn_server, start_healthy, start_process, stop_all  # noqa: E402
from specdec.config import ModelConfig  # noqa: E402
from specdec.metrics import Samples, scrape  # noqa: E402

DEMO_TARGET, DEMO_DRAFT = ROOT / "models" / "target", ROOT / "models" / "draft"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# --- random-weight models -----------------------------------------------------------------------
def write_shape_folder(path: Path, shape: str | dict, *, dtype: str = "bfloat16",
                       max_position: int = 4096, tokenizer_from: Path = DEMO_TARGET) -> Path:
    """A model folder without weights: config.json of a shape (a SHAPES name or an hf_config-style
    dict) and a tokenizer. Servers started with --random-weights initialise that shape on their
    device (a 7B model in a second; nothing written, read or loaded), transformers with from_config.
    It borrows the demo tokenizer: its 8192 ids are a subset of any larger vocabulary (ids past
    them decode to ""), so every such folder shares one tokenizer fingerprint."""
    hf = hf_config(shape, max_position) if isinstance(shape, str) else dict(shape)
    hf.update(bos_token_id=0, eos_token_id=0, pad_token_id=0, dtype=dtype)
    ModelConfig.from_hf(hf)  # the shape is one we serve
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, path / name)
    return path


def has_weights(path: Path) -> bool:
    return any(Path(path).glob("*.safetensors"))


# --- processes -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def coordinator_has_metrics() -> bool:
    """Whether this checkout's coordinator can expose Prometheus metrics (--metrics-port)."""
    out = subprocess.run([sys.executable, "-m", "coordinator", "--help"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    return "--metrics-port" in out.stdout


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@contextlib.contextmanager
def model_servers(specs: Sequence[tuple[str, Path, str, Sequence[str]]], log_dir: Path,
                  timeout: float = 300.0) -> Iterator[list[Proc]]:
    """Starts (role, model, device, args) servers at once (they load in parallel) and yields them
    once every one reports SERVING (weights loaded, CUDA graphs captured, profile measured)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        for role, model, device, args in specs:
            procs.append(spawn_server(role, model, log_dir, device=device, args=args, cpu_threads=1))
        for proc in procs:
            start_healthy(proc, timeout)
        yield procs
    finally:
        stop_all(procs)


@dataclass
class Coordinator:
    proc: Proc
    metrics_port: int | None

    @property
    def address(self) -> str:
        return self.proc.address

    def metrics(self) -> Samples:
        return scrape(f"127.0.0.1:{self.metrics_port}") if self.metrics_port else {}


@contextlib.contextmanager
def coordinator(target: Proc, draft: Proc | None, log_dir: Path, args: Sequence[str] = (),
                timeout: float = 120.0) -> Iterator[Coordinator]:
    port = free_port()
    metrics_port = free_port() if coordinator_has_metrics() else None
    argv = [sys.executable, "-m", "coordinator", "--target", target.address, "--host", "127.0.0.1",
            "--port", str(port), *args]
    if draft is not None:
        argv += ["--draft", draft.address]
    if metrics_port:
        argv += ["--metrics-port", str(metrics_port)]
    proc = start_process(Proc("coordinator", f"127.0.0.1:{port}", None, log_dir / "coordinator.log", argv, _env(),
                              metrics_address=f"127.0.0.1:{metrics_port}" if metrics_port else None))
    try:
        start_healthy(proc, timeout)
        metrics_port = int(proc.metrics_address.rsplit(":", 1)[1]) if metrics_port else None
        yield Coordinator(proc, metrics_port)
    finally:
        stop_all([proc])


# --- what the services say about themselves -----------------------------------------------------
_PROFILE = re.compile(r"decode forward profile \(batch: ms\): (.*)")
REPLAY_PROFILE = re.compile(r"decode replay profile \(batch: ms\): (.*)")
_GRAPHS = re.compile(r"captured (\d+) CUDA graphs")


def decode_profile(proc: Proc, pattern: re.Pattern = None) -> dict[int, float]:
    """Seconds of one single-token forward by batch size, from the server's start-up log (a whole
    step's wall time; pattern=REPLAY_PROFILE: the graph replay alone, CUDA graphs only)."""
    text = proc.log_path.read_text(errors="replace")
    found = (pattern or _PROFILE).findall(text)
    if not found:
        return {}
    pairs = (item.split(":") for item in found[-1].split(","))
    return {int(b): float(ms) / 1e3 for b, ms in pairs}


def graphs_captured(proc: Proc) -> int:
    found = _GRAPHS.findall(proc.log_path.read_text(errors="replace"))
    return int(found[-1]) if found else 0


def profile_at(profile: dict[int, float], batch: int) -> float | None:
    """The profile's value at the nearest measured batch size at or above `batch` (else the largest)."""
    if not profile:
        return None
    sizes = sorted(profile)
    return profile[next((b for b in sizes if b >= batch), sizes[-1])]


# --- prompts -------------------------------------------------------------------------------------
def code_prompts(n: int, min_chars: int, max_chars: int, seed: int = 0) -> list[str]:
    """Windows of this repository's Python source, starting at line starts, drawn from the frozen
    snapshot bench/data/code_windows.json (so that editing the repository does not change the
    prompts, and with them the acceptance, between runs): the demo pair is a Python-code model,
    and these files were not in its training corpus."""
    windows = json.loads((ROOT / "bench" / "data" / "code_windows.json").read_text())["windows"]
    texts = [w["text"] for w in windows if len(w["text"]) >= max_chars]
    starts = [[0] + [i + 1 for i, ch in enumerate(t) if ch == "\n" and i + max_chars < len(t)]
              for t in texts]
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        i = rng.randrange(len(texts))
        start = rng.choice(starts[i])
        prompts.append(texts[i][start:start + rng.randint(min_chars, max_chars)])
    return prompts


# --- clients -------------------------------------------------------------------------------------
@dataclass
class Record:
    sent: float
    first: float | None = None       # first chunk that carried tokens
    done: float | None = None
    tokens: list[int] = field(default_factory=list)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per chunk with tokens
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.done is None or self.first is None or len(self.tokens) < 2:
            return None
        return (self.done - self.first) / (len(self.tokens) - 1)


async def _generate(client: AsyncClient, prompt: str, timeout: float, params: dict) -> Record:
    rec = Record(time.perf_counter())
    try:
        async for chunk in client.generate(prompt, timeout=timeout, **params):
            if chunk.token_ids:
                now = time.perf_counter()
                if rec.first is None:
                    rec.first = now
                rec.chunks.append((now, len(chunk.token_ids)))
            rec.tokens += chunk.token_ids
            if chunk.usage is not None:
                u = chunk.usage
                rec.drafted, rec.accepted, rec.steps = u.draft_tokens, u.accepted_tokens, u.steps
        rec.done = time.perf_counter()
    except Exception as e:  # recorded, the benchmark goes on (a RESOURCE_EXHAUSTED is a result too)
        detail = e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else e
        rec.error = f"{type(e).__name__}: {detail}"[:300]
    return rec


def run_concurrent(address: str, prompts: Sequence[str], concurrency: int, *, timeout: float = 120.0,
                   **params) -> tuple[list[Record], float]:
    """Every prompt once, at most `concurrency` in flight (closed loop); (records, wall seconds)."""
    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with AsyncClient(address) as client:
            async def one(p):
                async with sem:
                    return await _generate(client, p, timeout, params)
            t0 = time.perf_counter()
            recs = await asyncio.gather(*(one(p) for p in prompts))
            return list(recs), time.perf_counter() - t0
    return asyncio.run(main())


def run_poisson(address: str, requests: Sequence[tuple[str, int]], rate: float, *, seed: int = 0,
                timeout: float = 120.0, progress=None, **params) -> tuple[list[Record], float]:
    """Open loop: (prompt, max_new_tokens) requests arriving as a Poisson process of `rate`/s;
    (records, seconds from the first arrival to the last finish)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in requests:
        arrivals.append(t)
        t += rng.expovariate(rate)

    async def main():
        done = 0
        async with AsyncClient(address) as client:
            t0 = time.perf_counter()

            async def one(at, prompt, n):
                nonlocal done
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                rec = await _generate(client, prompt, timeout, {**params, "max_new_tokens": n})
                done += 1
                if progress:
                    progress(done, len(requests))
                return rec
            recs = await asyncio.gather(*(one(at, p, n) for at, (p, n) in zip(arrivals, requests)))
            return list(recs), time.perf_counter() - t0
    return asyncio.run(main())


def summarize(records: Sequence[Record], wall: float) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(len(r.tokens) for r in ok)
    drafted, accepted, steps = (sum(getattr(r, k) for r in ok) for k in ("drafted", "accepted", "steps"))
    return {"requests": len(records), "errors": len(records) - len(ok),
            "first_error": next((r.error for r in records if r.error), None),
            "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall > 0 else None,
            "drafted": drafted, "accepted": accepted, "steps": steps,
            "acceptance": accepted / drafted if drafted else None,
            "tau": 1 + accepted / steps if steps and drafted else None}


def steady_window(records: Sequence[Record], concurrency: int) -> tuple[float, float] | None:
    """The span of a closed-loop run (run_concurrent) in which all `concurrency` slots decode:
    from the moment the first `concurrency` requests (by send time) all have their first token,
    to the first finish after the last request was sent (from there the batch only drains).
    Leviathan's expected speedup is a per-step model of a full batch; speculative sequences of one
    length finish at different steps, so a finite run ends with a drain of a few steps at smaller
    batches that plain decoding (every sequence done at the same step) does not have. None when
    the span is empty, a request failed or streamed no token, or fewer requests than slots ran."""
    if concurrency < 1:
        raise ValueError(f"steady_window: concurrency {concurrency} < 1")
    if len(records) < concurrency or any(r.error is not None or r.first is None or r.done is None
                                         for r in records):
        return None
    by_send = sorted(records, key=lambda r: r.sent)
    start = max(r.first for r in by_send[:concurrency])
    last_sent = by_send[-1].sent
    end = min((r.done for r in records if r.done > last_sent), default=None)
    return (start, end) if end is not None and end > start else None


def steady_occupancy(records: Sequence[Record], concurrency: int) -> float | None:
    """Of steady_window, the mean fraction of the `concurrency` slots whose request was between
    its first token and its last: a slot between a finish and the next request's first token
    (the client's round trip, the admission, the new request's first step) is not counted. In a
    closed loop speculative requests finish at different steps and are refilled one by one, so
    this can fall below 1 inside the window; beside the per-step speedup it tells how much of a
    measured / expected gap is that and not the step's time. None where steady_window is."""
    window = steady_window(records, concurrency)
    if window is None:
        return None
    start, end = window
    busy = sum(max(0.0, min(r.done, end) - max(r.first, start)) for r in records)
    return busy / (concurrency * (end - start))


def steady_tok_s(records: Sequence[Record], concurrency: int) -> float | None:
    """Tokens/s over steady_window: the chunks that arrived inside it (a chunk at the window's
    start closes the interval before it and is not counted)."""
    window = steady_window(records, concurrency)
    if window is None:
        return None
    start, end = window
    tokens = sum(n for r in records for t, n in r.chunks if start < t <= end)
    return tokens / (end - start)


def leviathan_alpha(tau: float, gamma: int) -> float | None:
    """α with (1 - α^(γ+1)) / (1 - α) = τ (tokens per target step), by bisection."""
    if tau is None or gamma < 1 or not 1 <= tau <= gamma + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(gamma + 1)) < tau else (lo, mid)
    return (lo + hi) / 2
