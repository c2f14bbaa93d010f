"""Shared by the fused sampling kernel's interpreter tests (tests/unit/test_fused_sampling*.py)."""
from __future__ import annotations

import torch


def params(rows):
    """rows: list of (temperature, top_k, top_p, min_p, greedy) -> the kernel's parameter tensors."""
    t, k, p, mp, g = zip(*rows)
    return (torch.tensor(t, dtype=torch.float32), torch.tensor(k, dtype=torch.int64),
            torch.tensor(p, dtype=torch.float32), torch.tensor(mp, dtype=torch.float32),
            torch.tensor(g, dtype=torch.bool))
