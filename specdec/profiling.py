"""Opt-in cProfile of a process's hot thread, for finding host time per step: set
SPECDEC_PROFILE_DIR=DIR and each model server (its engine thread) and the coordinator (its event
loop) write <role>-<pid>.prof (pstats) and .txt (top functions by own and by cumulative time) there
when they shut down. Profiling slows them down: profile runs are for finding where time goes, not
for measuring it."""
from __future__ import annotations

import cProfile
import io
import os
import pstats
from pathlib import Path

ENV = "SPECDEC_PROFILE_DIR"


def profile_dir() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def write_profile(profiler: cProfile.Profile, role: str, top: int = 40) -> Path | None:
    """Writes the profile under $SPECDEC_PROFILE_DIR (no-op without it); returns the .prof path."""
    out = profile_dir()
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{role}-{os.getpid()}"
    profiler.dump_stats(str(stem) + ".prof")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(top)
    Path(str(stem) + ".txt").write_text(text.getvalue())
    return Path(str(stem) + ".prof")
