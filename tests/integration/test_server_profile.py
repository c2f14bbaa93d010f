"""SPECDEC_PROFILE_DIR: each model server profiles its engine thread, the coordinator its event
loop, and each writes its profile at shutdown (specdec/profiling.py; how host time per step was
found)."""
from __future__ import annotations

import pstats

from coordinator.client import Client
from tests.helpers.cluster import tiny_cluster


def test_servers_write_engine_thread_profiles(tmp_path, monkeypatch):
    out = tmp_path / "profiles"
    monkeypatch.setenv("SPECDEC_PROFILE_DIR", str(out))  # the spawned servers inherit it
    with tiny_cluster(tmp_path, coordinator_args=["--num-draft", "3"]) as cluster:
        with Client(cluster.coordinator) as client:
            chunks = list(client.generate("def add(a, b):", max_new_tokens=12, ignore_eos=True))
        assert sum(len(c.token_ids) for c in chunks) == 12
    for role, step in (("draft", "propose"), ("target", "verify"), ("coordinator", "_step")):
        [prof] = out.glob(f"{role}-*.prof")
        stats = pstats.Stats(str(prof)).stats
        calls = {fn[2]: s[1] for fn, s in stats.items()}  # function name -> number of calls
        assert calls.get(step, 0) >= 2, (role, sorted(calls)[:20])  # several steps were profiled
        text = prof.with_suffix(".txt").read_text()
        assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
