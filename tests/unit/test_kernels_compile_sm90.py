"""The compiled path of the Triton kernels, on a machine without a GPU: the interpreter runs the
kernels' semantics, but not Triton's frontend, layouts and ptxas, where a kernel that is right in
numpy can still fail (a loop-carried value whose type changes, an unsupported reshape, too much
shared memory). tests/helpers/compile_sm90.py compiles the variants that change most often for
the H200's architecture in a process of its own (kernels defined under TRITON_INTERPRET cannot be
compiled)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "compile_sm90.py"


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=600)
    if run.returncode == 2:
        pytest.skip(run.stdout.strip().splitlines()[-1])
    lines = run.stdout.splitlines()
    assert run.returncode == 0, "\n".join(lines + [run.stderr[-2000:]])
    assert len([line for line in lines if line.startswith("ok ")]) == 84
