"""Continuous batching: which sequences take part in the next step.

New requests wait in a bounded queue and join the batch at a step boundary when a batch slot and
their KV reservation are free; finished ones leave at once. A request reserves, on each server, the
KV blocks its longest possible sequence needs (prompt + max_new_tokens, capped by the model length),
so a running batch never runs a server out of blocks mid-generation. Requests that can never fit,
or that would leave more than max_waiting requests queued after the next admission (a batch slot
the KV cannot fill is no place), are refused with RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from coordinator.sequence import Sequence


class Rejected(Exception):
    """The request is over capacity (RESOURCE_EXHAUSTED); the message says which."""


@dataclass(frozen=True)
class KVCapacity:
    name: str          # "target" or "draft", for messages
    blocks_total: int
    block_size: int

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


class Scheduler:
    def __init__(self, max_batch_size: int, max_waiting: int, target: KVCapacity,
                 draft: KVCapacity | None):
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.target, self.draft = target, draft
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.release_target: set[int] = set()  # sequences to free at the next step or idle moment
        self.release_draft: set[int] = set()
        self.reserved_target = 0
        self.reserved_draft = 0
        self._wake = asyncio.Event()

    @staticmethod
    def longest(seq: Sequence) -> int:
        return min(len(seq.params.prompt_ids) + seq.params.max_new_tokens, seq.max_len)

    def submit(self, seq: Sequence) -> None:
        need = self.target.blocks_for(self.longest(seq))
        if need > self.target.blocks_total:
            raise Rejected(f"kv cache: the request needs {need} KV blocks on the target (prompt and "
                           f"max_new_tokens: {self.longest(seq)} tokens), the target has "
                           f"{self.target.blocks_total} in all; lower max_new_tokens")
        if self._left_waiting(seq) > self.max_waiting:
            raise Rejected(f"capacity: {len(self.running)} requests running (max_batch_size "
                           f"{self.max_batch_size}, {self.reserved_target} of {self.target.blocks_total} "
                           f"target KV blocks reserved) and {len(self.waiting)} waiting (max_waiting "
                           f"{self.max_waiting}); retry later")
        self.waiting.append(seq)
        self._wake.set()

    def _left_waiting(self, seq: Sequence) -> int:
        """How many requests would still wait, with `seq` queued, after the next admission. A free
        slot that the KV cannot fill is no place in the batch, so --max-waiting bounds the queue
        under KV pressure too."""
        queue = [s for s in (*self.waiting, seq) if not s.done]
        return len(queue) - len(self._admissible(queue))

    def _admissible(self, queue) -> list[Sequence]:
        """The requests of `queue` (oldest first) the next admission takes: each while a batch slot
        and its target KV reservation are free, stopping at the first that does not fit (finished
        ones are skipped)."""
        slots = self.max_batch_size - len(self.running)
        free = self.target.blocks_total - self.reserved_target
        taken = []
        for seq in queue:
            if seq.done:
                continue
            need = self.target.blocks_for(self.longest(seq))
            if len(taken) == slots or need > free:
                break
            taken.append(seq)
            free -= need
        return taken

    def drop_draft(self, seq: Sequence) -> None:
        """The sequence goes on without the draft for good: its draft KV reservation comes back."""
        self.reserved_draft -= seq.reserved_draft
        seq.reserved_draft = 0

    def admit(self) -> list[Sequence]:
        """Moves waiting requests into the batch, oldest first, while slots and KV allow."""
        admitted = self._admissible(self.waiting)
        for seq in admitted:
            while self.waiting.popleft() is not seq:  # finished ones queued before it go too
                pass
            need = self.target.blocks_for(self.longest(seq))
            seq.reserved_target = need
            self.reserved_target += need
            if seq.params.speculate and self.draft is not None:
                # Without room on the draft the request still runs, by plain decoding.
                dneed = self.draft.blocks_for(self.longest(seq))
                if self.reserved_draft + dneed <= self.draft.blocks_total:
                    seq.use_draft = True
                    seq.reserved_draft = dneed
                    self.reserved_draft += dneed
            self.running.append(seq)
        return admitted

    def retire(self, seq: Sequence) -> None:
        """The sequence is finished, failed or cancelled: it leaves the batch and its KV is freed
        on both servers (in the next step's `release` field, or by a Release call when idle)."""
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
            self.release_target.add(seq.seq_id)
            self.reserved_target -= seq.reserved_target
            self.reserved_draft -= seq.reserved_draft
            seq.reserved_target = seq.reserved_draft = 0
            if seq.draft_holds:
                self.release_draft.add(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def cancel(self, seq: Sequence) -> None:
        """Called by the client's stream when it goes away; the loop retires the sequence at the
        next step boundary (it may be inside a step right now)."""
        seq.cancelled = True
        if seq in self.waiting:
            self.retire(seq)
        self._wake.set()

    def drop_cancelled(self) -> list[Sequence]:
        gone = [s for s in self.running if s.cancelled]
        for seq in gone:
            self.retire(seq)
        return gone

    @property
    def has_releases(self) -> bool:
        return bool(self.release_target or self.release_draft)

    def wake(self) -> None:
        """Something outside the scheduler (a draft back with releases) needs the loop."""
        self._wake.set()

    async def wait_for_work(self) -> None:
        while not (self.running or self.waiting or self.has_releases):
            self._wake.clear()
            await self._wake.wait()

    async def wait_for_requests(self, timeout: float) -> None:
        """Sleeps up to `timeout` seconds, less when a request arrives or is cancelled
        (a backoff that pending releases alone do not cut short)."""
        if self.running or self.waiting:
            return
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
