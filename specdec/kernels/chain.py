"""A chain graph's bookkeeping between two of its steps, in one kernel.

A draft's chain graph (cuda_graphs.GraphedForward._chain_step) runs one single-token forward, picks
each row's token, and moves the bucket's static inputs on to the next position, so that the same
graph replayed again drafts the next token. In torch that move is ~15 small kernels (the token into
its row, the ids, positions and context lengths, and each row's next KV slot from its block table:
a divide, a clamp, a gather, a cast, a multiply, a remainder, an add, a compare, a select and the
copies), each a launch the GPU waits on between two forwards of a ~100 us draft step.
`advance` does all of it in one program: rows are the bucket's b sequences (at most a few hundred).

The same results as cuda_graphs.advance_reference (the torch version, which the CPU path runs),
element for element: everything here is integer arithmetic. Triton is imported only with this
module (the GPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_kernel(Ids, Tokens, At, InputIds, Positions, ContextLens, Slots, Tables, n_rows,
                    max_blocks, block_size, BLOCK: tl.constexpr, WRITE_TOKENS: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    mask = rows < n_rows
    ids = tl.load(Ids + rows, mask=mask, other=0)
    at = tl.load(At)
    if WRITE_TOKENS:
        tl.store(Tokens + at * n_rows + rows, ids, mask=mask)
    tl.store(InputIds + rows, ids, mask=mask)
    pos = tl.load(Positions + rows, mask=mask, other=0) + 1
    tl.store(Positions + rows, pos, mask=mask)
    ctx = tl.load(ContextLens + rows, mask=mask, other=0) + 1
    tl.store(ContextLens + rows, ctx, mask=mask)
    # The next position's slot from the row's block table; the block index is clamped so that a
    # position past the context stays in the table (cuda_graphs.table_slots). Padding rows keep slot -1.
    slot = tl.load(Slots + rows, mask=mask, other=-1)
    block = tl.minimum(pos // block_size, max_blocks - 1)
    entry = tl.load(Tables + rows.to(tl.int64) * max_blocks + block, mask=mask & (slot >= 0), other=0)
    tl.store(Slots + rows, tl.where(slot >= 0, entry.to(tl.int64) * block_size + pos % block_size, slot),
             mask=mask)
    # Every thread has read `at` (above) before any writes it back.
    tl.debug_barrier()
    tl.store(At, at + 1)


def advance(ids: torch.Tensor, tokens: torch.Tensor | None, at: torch.Tensor, input_ids: torch.Tensor,
            positions: torch.Tensor, context_lens: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, block_size: int) -> None:
    """After a chain step's forward over b rows: ids [b] (int64, the rows' picked tokens) into row
    `at` of tokens [rows, b] (None: the picker wrote them already), the ids into input_ids [b],
    positions [b] and context_lens [b] one on, each row's slot_mapping to its next position's slot
    in block_tables [b, max_blocks] (padding rows, slot -1, stay -1), and at [1] one on. In place."""
    b = ids.shape[0]
    max_blocks = block_tables.shape[1]
    for name, t in (("input_ids", input_ids), ("positions", positions), ("context_lens", context_lens),
                    ("slot_mapping", slot_mapping), ("block_tables", block_tables)):
        if t.shape[0] != b or not t.is_contiguous():
            raise ValueError(f"advance: {name} {tuple(t.shape)} is not {b} contiguous rows")
    if tokens is not None and (tokens.dim() != 2 or tokens.shape[1] != b or not tokens.is_contiguous()):
        raise ValueError(f"advance: tokens {tuple(tokens.shape)} are not contiguous rows of {b}")
    _advance_kernel[(1,)](ids, tokens if tokens is not None else ids, at, input_ids, positions, context_lens,
                          slot_mapping, block_tables, b, max_blocks, block_size,
                          BLOCK=triton.next_power_of_2(b), WRITE_TOKENS=tokens is not None,
                          num_warps=1 if b <= 32 else 4)
