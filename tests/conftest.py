import os

import pytest

# Triton kernels must be defined under the interpreter when there is no GPU; this has to happen
# before any kernel module is imported, so it lives here rather than in a fixture.
try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tiny models on a 2-core machine that also runs server subprocesses: one intra-op thread is
    # many times faster than torch's default (threads spin and contend between small forwards).
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
