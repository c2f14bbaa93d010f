"""Opt-in timestamps of each step's way through the processes, for splitting the transport (a
speculative step's time outside both servers' step_seconds) into its parts: set
SPECDEC_TRACE_DIR=DIR and the coordinator and each model server record time.perf_counter() at the
points below, and write them to DIR/<role>-<pid>.json when they exit. On Linux perf_counter is
CLOCK_MONOTONIC, one clock for every process of a host, so the stamps of the coordinator and of a
server line up; bench/trace_steps.py joins them by (rpc, step) and prints the median of each part.

Coordinator (per rpc "Propose" / "Verify" and step):  c_write  request serialised and sent;
    c_read  the answer's frame read;  c_parsed  the answer parsed.
    c_built  the request built (stamped before serialising; from c_parsed of the other rpc on).
Server (step channel):  s_read  the request's frame read;  s_parsed  parsed (step_seconds starts);
    s_ready  the answer built (step_seconds ends);  s_write  serialised and sent.
How a polled step-channel frame arrived (protos/shared_slots.Inbox, where both sides share slots;
    after the reader's c_read / s_read):  c_missed / s_missed  the reader's last look at the empty
    slot before the frame (its poll interval when the frame came);  c_by_poll / s_by_poll,
    c_by_socket / s_by_socket (the doorbell woke it, or the frame came over the socket),
    c_by_waiting / s_by_waiting (the frame was there before the reader asked for it).
Inside a server's step (any transport; mark_step, to the step begin_step named):  s_engine  the
    request converted, the engine called;  e_launch  sequences admitted and planned, the forward's
    inputs about to be prepared;  e_launched  the step's forwards launched (graph replays return
    before the device is done);  e_synced  the results on the host;  s_engined  the engine returned.

Off (the default), a mark is one module attribute read at each call site."""
from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path

ENV = "SPECDEC_TRACE_DIR"
MAX_EVENTS = 1_000_000  # ~10 per step and rpc: a long run keeps its first 100k steps

enabled = bool(os.environ.get(ENV))
_events: list[tuple[str, str, int, int, float]] = []  # (point, rpc, step, batch, perf_counter)
_step: tuple[str, int] | None = None  # the (rpc, step) mark_step stamps (begin_step; None: none)


def mark(point: str, rpc: str, step: int, batch: int = 0, at: float | None = None) -> None:
    """Records `point` of step `step` of `rpc` now (or at perf_counter time `at`)."""
    if len(_events) < MAX_EVENTS:
        _events.append((point, rpc, step, batch, time.perf_counter() if at is None else at))


def begin_step(rpc: str | None, step: int = 0) -> None:
    """mark_step stamps go to step `step` of `rpc` from here on (rpc None: to no step). The server
    sets it around the engine's call, which holds the engine: one step at a time."""
    global _step
    _step = None if rpc is None else (rpc, step)


def mark_step(point: str) -> None:
    """Records `point` of the step begin_step named, if any (code that does not know the step:
    the engines)."""
    if _step is not None:
        mark(point, *_step)


def mark_arrival(prefix: str, rpc: str, step: int, inbox) -> None:
    """How the frame a timed Inbox (protos/shared_slots.py) just gave arrived: {prefix}_missed at
    its last empty look at the slot, if any, and {prefix}_by_{its arrival}."""
    if inbox.missed_at is not None:
        mark(f"{prefix}_missed", rpc, step, at=inbox.missed_at)
    if inbox.arrival is not None:
        mark(f"{prefix}_by_{inbox.arrival}", rpc, step)


def start(role: str) -> None:
    """Writes this process's stamps at exit (no-op unless SPECDEC_TRACE_DIR is set)."""
    if enabled:
        atexit.register(dump, role)


def dump(role: str) -> Path | None:
    folder = os.environ.get(ENV)
    if not folder or not _events:
        return None
    path = Path(folder) / f"{role}-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"role": role, "pid": os.getpid(),
                                "events": [list(e) for e in _events]}))
    return path
