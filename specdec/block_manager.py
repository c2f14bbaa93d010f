"""Paged KV bookkeeping: which cache blocks each sequence owns. Pure Python, no tensors."""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks; raised before any state changes."""


@dataclass
class SeqBlocks:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low block ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[Hashable, SeqBlocks] = {}

    # --- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).blocks)

    def held(self, seq_id: Hashable) -> SeqBlocks:
        """The sequence's live record (its block list and token count), for reading on a step's
        hot path without a copy per call: read it before the sequence changes again, never
        change it (append / truncate / free do)."""
        return self._get(seq_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_append(self, seq_id: Hashable | None, n: int) -> bool:
        return self._extra_blocks(seq_id, n) <= self.num_free

    # --- mutations ---------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable) -> None:
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already exists")
        self._seqs[seq_id] = SeqBlocks()

    def append(self, seq_id: Hashable, n: int) -> list[int]:
        """Reserve n more token slots for seq_id; returns their flat slot indices."""
        if n < 0:
            raise ValueError(f"cannot append {n} tokens")
        seq = self._get(seq_id)
        start = seq.num_tokens
        bs, blocks = self.block_size, seq.blocks
        extra = self.blocks_needed(start + n) - len(blocks)
        if extra > 0:
            if extra > len(self._free):
                raise OutOfBlocks(f"sequence {seq_id!r} needs {extra} more KV blocks, {self.num_free} free "
                                  f"of {self.num_blocks}")
            for _ in range(extra):
                blocks.append(self._free.pop())
        seq.num_tokens = start + n
        return [blocks[t // bs] * bs + t % bs for t in range(start, start + n)]

    def truncate(self, seq_id: Hashable, n: int) -> None:
        """Keep the first n tokens (rollback of rejected drafts); freed blocks return to the pool."""
        seq = self._get(seq_id)
        if not 0 <= n <= seq.num_tokens:
            raise ValueError(f"cannot truncate sequence {seq_id!r} of {seq.num_tokens} tokens to {n}")
        keep = self.blocks_needed(n)
        while len(seq.blocks) > keep:
            self._free.append(seq.blocks.pop())
        seq.num_tokens = n

    def free(self, seq_id: Hashable) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    # --- internals ---------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _extra_blocks(self, seq_id: Hashable | None, n: int) -> int:
        seq = self._seqs.get(seq_id) if seq_id is not None else None
        have_tokens, have_blocks = (seq.num_tokens, len(seq.blocks)) if seq else (0, 0)
        return max(0, self.blocks_needed(have_tokens + n) - have_blocks)
