"""kernels/chain.advance (a chain graph's bookkeeping in one Triton kernel; here under
TRITON_INTERPRET=1) against cuda_graphs.advance_reference, the torch ops it replaces."""
from __future__ import annotations

import pytest
import torch

from specdec.cuda_graphs import advance_reference
from specdec.kernels.chain import advance

BLOCK = 16
# The interpreter runs the kernel on CPU tensors (tests/conftest.py sets it only without a GPU);
# on the device the kernel itself, compiled, on CUDA tensors.
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                       reason="Triton on CPU tensors needs TRITON_INTERPRET (set only without a GPU)")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _state(b: int, max_blocks: int, chain_max: int, seed: int, device: str = "cpu"):
    """A bucket's static inputs as a chain finds them: real rows at random positions (some the
    last of a block, so the next crosses into the following one; some at the table's end, where
    the block index clamps), padding rows with slot -1, and a chain's token rows and counter."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(4 * b * max_blocks, generator=g)[:b * max_blocks].view(b, max_blocks).to(torch.int32)
    positions = torch.randint(0, BLOCK * max_blocks, (b,), generator=g)
    positions[0] = BLOCK - 1                      # next position opens block 1
    if b > 1:
        positions[1] = BLOCK * max_blocks - 1     # next position is past the table: clamped
    slots = (tables.gather(1, (positions // BLOCK)[:, None]).squeeze(1).to(torch.int64) * BLOCK
             + positions % BLOCK)
    padding = torch.rand(b, generator=g) < 0.3
    padding[0] = False
    slots[padding] = -1
    state = {"ids": torch.randint(0, 32000, (b,), generator=g),
             "tokens": torch.randint(0, 32000, (chain_max, b), generator=g),
             "at": torch.tensor([int(torch.randint(0, chain_max - 1, (1,), generator=g))]),
             "input_ids": torch.randint(0, 32000, (b,), generator=g),
             "positions": positions, "context_lens": (positions + 1).to(torch.int32),
             "slot_mapping": slots, "block_tables": tables}
    return {k: v.to(device) for k, v in state.items()}


def _run(fn, s: dict, write_tokens: bool) -> None:
    fn(s["ids"], s["tokens"] if write_tokens else None, s["at"], s["input_ids"], s["positions"],
       s["context_lens"], s["slot_mapping"], s["block_tables"], BLOCK)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", [1, 3, 8, 33])
@pytest.mark.parametrize("write_tokens", [True, False])
def test_advance_matches_the_torch_ops_step_after_step(b, write_tokens, device):
    ours, ref = _state(b, 4, 8, seed=b, device=device), _state(b, 4, 8, seed=b, device=device)
    for step in range(3):
        _run(advance, ours, write_tokens)
        _run(advance_reference, ref, write_tokens)
        for name in ref:
            assert torch.equal(ours[name], ref[name]), (name, step)
        ours["ids"] = ref["ids"] = torch.randint(0, 32000, (b,), device=device)
    assert (ours["slot_mapping"] >= -1).all()
    # What it should be, said directly for row 0: three positions on, its slot in block 1.
    assert int(ours["positions"][0]) == BLOCK + 2
    assert int(ours["slot_mapping"][0]) == int(ours["block_tables"][0, 1]) * BLOCK + 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors needs TRITON_INTERPRET (set only without a GPU)")
def test_advance_refuses_rows_that_do_not_line_up():
    s = _state(4, 4, 8, seed=0)
    with pytest.raises(ValueError, match="positions"):
        advance(s["ids"], s["tokens"], s["at"], s["input_ids"], s["positions"][:3], s["context_lens"],
                s["slot_mapping"], s["block_tables"], BLOCK)
    with pytest.raises(ValueError, match="tokens"):
        advance(s["ids"], s["tokens"].t(), s["at"], s["input_ids"], s["positions"], s["context_lens"],
                s["slot_mapping"], s["block_tables"], BLOCK)
