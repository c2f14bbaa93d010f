"""`make demo` end to end: the bundled pair on all three services, a real request, α and c printed."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_streams_a_completion_and_reports_acceptance():
    result = subprocess.run([sys.executable, "-m", "specdec.demo", "--max-new-tokens", "48", "--device", "cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "def count_lines(path):" in out
    assert "identical output (lossless): yes" in out
    alpha = float(re.search(r"acceptance rate α \(accepted/drafted\): ([0-9.]+)", out).group(1))
    # The bundled draft accepts ~0.8 greedily on code (models/README.md); far below means a broken pair.
    assert 0.5 < alpha <= 1.0, out
    assert re.search(r"measured speedup \(speculative / plain tok/s\): [0-9.]+x", out)
    overhead = re.search(r"RPC \+ coordinator overhead per speculative step: ([0-9.]+) ms \((\d+)% of the step's "
                         r"([0-9.]+) ms\)", out)
    assert overhead, out
    ms, pct, step_ms = float(overhead.group(1)), int(overhead.group(2)), float(overhead.group(3))
    assert 0 < ms < step_ms and abs(pct - 100 * ms / step_ms) <= 1, out
