"""Which coordinator each of a model server's sequences belongs to, so that the sequences of a
coordinator that died without releasing them (SIGKILL, OOM, a lost host) are freed.

A server frees a sequence's KV only when told to (a step's `release`, or Release). A coordinator
that dies before it can say so leaves its sequences' KV behind for good, and a coordinator started
in its place finds the cache full (RESOURCE_EXHAUSTED for requests that fit an idle cluster).

Every step request names its coordinator (`owner`: a random id the coordinator keeps for its life;
0 names none, and such sequences are never freed here). A sequence belongs to the owner of the step
that started it (`first`), until it is released. Each step connection (a gRPC stream or a step
channel socket) counts for the owner it carries; once an owner has no connection left for
`timeout_s` seconds, its sequences are freed. A coordinator that only reopened a connection (after
a step timeout, or a dropped stream) carries its id again at once and loses nothing; one that did
stay away that long finds its sequences gone, and the servers answer NOT_FOUND, after which it
resends them from their start (the same path as after a server restart).

Event-loop only (no locks): the servicers call it from their step loops.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from specdec.config import ORPHAN_TIMEOUT_S

log = logging.getLogger(__name__)


class Owners:
    def __init__(self, free: Callable[[list[int]], Awaitable[object]], timeout_s: float = ORPHAN_TIMEOUT_S):
        """free(seq_ids): frees those sequences on the engine (an engine call; unknown ids are
        ignored)."""
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self._free = free
        self.timeout_s = timeout_s
        self._seqs: dict[int, set[int]] = {}       # owner -> its sequences
        self._owner_of: dict[int, int] = {}        # sequence -> owner
        self._connections: dict[int, int] = {}     # owner -> step connections carrying it now
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._freeing: set[asyncio.Task] = set()

    def switch(self, old: int, new: int) -> None:
        """A connection that carried `old` (0: none yet) carries `new` (0: it closed)."""
        if old:
            left = self._connections[old] - 1
            if left:
                self._connections[old] = left
            else:
                del self._connections[old]
                if old in self._seqs:
                    self._timers[old] = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, old)
        if new:
            self._connections[new] = self._connections.get(new, 0) + 1
            timer = self._timers.pop(new, None)
            if timer is not None:
                timer.cancel()

    def step(self, owner: int, request) -> None:
        """A step request on a connection carrying `owner`: its new sequences become the owner's.
        (Its released ones become nobody's once the engine freed them: released(), after the
        step; a step cancelled before it ran leaves them to the owner's timeout.)"""
        if not owner:
            return
        for s in request.seqs:
            if s.first:
                self._claim(owner, s.seq_id)

    def _claim(self, owner: int, seq_id: int) -> None:
        previous = self._owner_of.get(seq_id)
        if previous == owner:
            return
        if previous is not None:
            self._seqs[previous].discard(seq_id)
        self._owner_of[seq_id] = owner
        self._seqs.setdefault(owner, set()).add(seq_id)

    def released(self, seq_ids: Iterable[int]) -> None:
        """These sequences were freed on the engine: nobody's from now on."""
        for seq_id in seq_ids:
            owner = self._owner_of.pop(seq_id, None)
            if owner is not None:
                seqs = self._seqs[owner]
                seqs.discard(seq_id)
                if not seqs and owner not in self._connections:
                    del self._seqs[owner]

    def held(self, owner: int) -> set[int]:
        """The sequences `owner` holds here (a copy)."""
        return set(self._seqs.get(owner, ()))

    def _expire(self, owner: int) -> None:
        del self._timers[owner]
        seqs = self._seqs.pop(owner, set())
        for seq_id in seqs:
            del self._owner_of[seq_id]
        if not seqs:
            return
        log.warning("coordinator %016x has had no connection for %.1fs: freeing its %d sequence(s)",
                    owner, self.timeout_s, len(seqs))
        task = asyncio.ensure_future(self._free_now(owner, sorted(seqs)))
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)

    async def _free_now(self, owner: int, seq_ids: list[int]) -> None:
        try:
            await self._free(seq_ids)
        except Exception:
            log.exception("freeing coordinator %016x's sequences failed", owner)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


class Connection:
    """One step connection (a gRPC stream or a step channel socket) as Owners counts it: for the
    owner its last request named. close() once it ends; closing again does nothing."""

    __slots__ = ("owners", "owner", "closed")

    def __init__(self, owners: Owners):
        self.owners = owners
        self.owner = 0
        self.closed = False

    def step(self, request) -> None:
        if request.owner != self.owner and not self.closed:
            self.owners.switch(self.owner, request.owner)
            self.owner = request.owner
        self.owners.step(self.owner, request)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owners.switch(self.owner, 0)
            self.owner = 0
