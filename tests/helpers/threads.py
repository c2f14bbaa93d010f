"""The single-thread fixture of test modules that run many tiny tensor ops."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add contention on the shared 2-core machines (a 25x
    slowdown measured under load; no OpenMP spinning between small matmuls), so the importing
    module runs single-threaded. Import it into a test module to use it (autouse there)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
