"""bench/common.baseline_tree: another commit's packages with this checkout's bench scripts, for
the A/Bs across commits (hostpath.py --baseline, e2e_ab.py --a-code)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` is top-level

from common import baseline_tree  # noqa: E402


def test_a_folder_gets_this_checkouts_bench_and_a_models_link_and_is_kept(tmp_path):
    base = tmp_path / "base"
    (base / "specdec").mkdir(parents=True)
    (base / "specdec" / "marker.py").write_text("OLD = True\n")
    (base / "COMMIT").write_text("abc1234\n")
    (base / "bench").mkdir()
    (base / "bench" / "e2e.py").write_text("stale copy\n")
    (base / "models").symlink_to(tmp_path / "elsewhere")   # made on another machine: dangling
    with baseline_tree(str(base)) as (tree, commit):
        assert tree == base.resolve() and commit == "abc1234"
        for name in ("e2e.py", "hostpath.py", "common.py", "services.py"):
            assert (tree / "bench" / name).read_bytes() == (BENCH / name).read_bytes()
        assert (tree / "bench" / "data" / "code_windows.json").exists()
        assert (tree / "models").resolve() == (ROOT / "models").resolve()
        assert (tree / "specdec" / "marker.py").read_text() == "OLD = True\n"   # the packages stay
    assert base.exists()   # a given folder is the caller's


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
def test_a_commit_is_checked_out_as_a_worktree_and_removed():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD~1"], capture_output=True,
                          text=True)
    if head.returncode:
        pytest.skip("a checkout without history (shallow clone)")
    with baseline_tree("HEAD~1") as (tree, commit):
        assert commit == head.stdout.strip()
        listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
        assert str(tree) in listed
        assert (tree / "specdec" / "__init__.py").exists()
        assert (tree / "bench" / "e2e_ab.py").read_bytes() == (BENCH / "e2e_ab.py").read_bytes()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(tree) not in listed and not tree.exists()
