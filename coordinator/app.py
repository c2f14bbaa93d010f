"""The coordinator assembled: server connections, the start-up compatibility check, the scheduler and
the step loop. The gRPC servicer (service.py) only converts requests and chunks."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable

import grpc

from coordinator.config import CoordinatorConfig
from coordinator.scheduler import KVCapacity, Scheduler
from coordinator.sequence import GenParams, Sequence
from coordinator.servers import ModelServer
from coordinator.spec_loop import SpecLoop
from coordinator.tokenizer import TextTokenizer
from coordinator.validation import Limits
from protos import specdec_pb2 as pb
from specdec.metrics import CoordinatorMetrics

log = logging.getLogger("specdec.coordinator")


class IncompatibleModels(RuntimeError):
    """Draft, target and the coordinator's tokenizer do not share one vocabulary."""


def pipeline_enabled(mode: str, target: pb.ModelInfo, draft: pb.ModelInfo | None) -> bool:
    """--pipeline: on, off, or auto: on when both servers report their GPUs and none is shared
    (a draft on the target's GPU would take device time from the verify it overlaps)."""
    if mode != "auto":
        return mode == "on"
    return (draft is not None and bool(target.device_uuids) and bool(draft.device_uuids)
            and not set(target.device_uuids) & set(draft.device_uuids))


def check_draft_compatible(target: pb.ModelInfo, draft: pb.ModelInfo) -> None:
    problems = []
    if target.vocab_size != draft.vocab_size:
        problems.append(f"vocab_size: target {target.vocab_size} != draft {draft.vocab_size}")
    if target.tokenizer_fingerprint != draft.tokenizer_fingerprint:
        problems.append(f"tokenizer_fingerprint: target {target.tokenizer_fingerprint[:12] or '(none)'} "
                        f"!= draft {draft.tokenizer_fingerprint[:12] or '(none)'}")
    if problems:
        raise IncompatibleModels(
            f"draft model {draft.model_name} cannot speculate for target model {target.model_name}: "
            + "; ".join(problems) + ". Draft and target must share the tokenizer and vocabulary.")


def check_tokenizer_compatible(target: pb.ModelInfo, tokenizer: TextTokenizer) -> None:
    if target.tokenizer_fingerprint and tokenizer.fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleModels(
            f"tokenizer {tokenizer.path} (fingerprint {tokenizer.fingerprint[:12]}) is not the target "
            f"model's (fingerprint {target.tokenizer_fingerprint[:12]}); pass the target's --tokenizer")
    if tokenizer.vocab_size > target.vocab_size:
        raise IncompatibleModels(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more "
                                 f"than the target's vocab_size {target.vocab_size}")


def _capacity(name: str, info: pb.ModelInfo) -> KVCapacity:
    return KVCapacity(name, info.kv_blocks_total, info.block_size)


LIMITS = ("kv_blocks_total", "block_size", "max_model_len", "max_num_draft")


def _log_limit_changes(role: str, old: pb.ModelInfo, new: pb.ModelInfo) -> None:
    """A server back after a restart may run under other flags: say which limits changed."""
    changed = [f"{f} {getattr(old, f)} -> {getattr(new, f)}"
               for f in LIMITS if getattr(old, f) != getattr(new, f)]
    if changed:
        log.warning("%s server's limits changed: %s", role, ", ".join(changed))


class Coordinator:
    def __init__(self, config: CoordinatorConfig, tokenizer: TextTokenizer, target: ModelServer,
                 draft: ModelServer | None, target_info: pb.ModelInfo, draft_info: pb.ModelInfo | None,
                 metrics: CoordinatorMetrics):
        self.config, self.tokenizer = config, tokenizer
        self.target, self.draft = target, draft
        self.target_info, self.draft_info = target_info, draft_info
        self.metrics = metrics
        self.limits = Limits(vocab_size=target_info.vocab_size, max_model_len=target_info.max_model_len,
                             max_num_draft=config.max_num_draft,
                             eos_token_ids=frozenset(target_info.eos_token_ids))
        self.scheduler = Scheduler(config.max_batch_size, config.max_waiting,
                                   _capacity("target", target_info),
                                   _capacity("draft", draft_info) if draft_info else None)
        self.loop = SpecLoop(config, self.scheduler, target, draft, metrics,
                             vocab_size=target_info.vocab_size,
                             draft_max_len=draft_info.max_model_len if draft_info else 0,
                             check_draft=self._check_draft if draft else None,
                             target_back=self._target_back)
        self.loop.target_max_num_draft = target_info.max_num_draft
        self._apply_draft_info(draft_info)
        # Sequence ids from a random base: the servers key their sequences by id alone, so two
        # coordinators on the same servers (a rolling restart's old and new one) that both counted
        # from 1 continued each other's sequences, with wrong tokens and no error. 2^62 ids a base;
        # two bases collide within n requests with probability ~n / 2^62.
        self._ids = itertools.count(config.seq_id_base or secrets.randbits(62) + 1)
        self._task: asyncio.Task | None = None
        self._closing = False  # close() was called: the loop task's cancellation is expected
        self.failure: str | None = None  # set when the step loop died: no request can be served
        self._on_failure: Callable[[str], Awaitable[None]] | None = None
        self._failure_task: asyncio.Task | None = None
        self._target_check: asyncio.Future | None = None  # check_target's Info in flight

    @classmethod
    async def connect(cls, config: CoordinatorConfig, metrics: CoordinatorMetrics) -> "Coordinator":
        """Waits for the servers and checks that draft, target and tokenizer agree. The target is
        required; a draft that does not answer is tried again in the background (the draft is
        optional), but a draft that answers with another vocabulary is a start-up error."""
        channel = config.step_channel == "auto"
        poll_s = config.busy_poll_ms / 1e3
        target = ModelServer("target", config.target, metrics, step_channel=channel, poll_s=poll_s)
        draft = ModelServer("draft", config.draft, metrics, step_channel=channel, poll_s=poll_s) if config.draft else None
        waits = [target.wait_ready(config.connect_timeout_s)]
        if draft is not None:
            waits.append(draft.wait_ready(config.connect_timeout_s))
        infos = await asyncio.gather(*waits, return_exceptions=True)
        if isinstance(infos[0], BaseException):
            raise infos[0]
        target_info = infos[0]
        draft_info = None
        if draft is not None:
            if isinstance(infos[1], BaseException):
                log.warning("draft server unavailable at start-up (%s); plain decoding until it answers",
                            infos[1])
            else:
                draft_info = infos[1]
                check_draft_compatible(target_info, draft_info)
        tokenizer = TextTokenizer(config.tokenizer or target_info.model_name)
        check_tokenizer_compatible(target_info, tokenizer)
        for server, info in ((target, target_info), (draft, draft_info)):
            if info is not None:
                log.info("%s steps over %s", server.role,
                         f"its step channel (port {server.step_port})" if server.transport == "channel"
                         else "the gRPC stream")
        coord = cls(config, tokenizer, target, draft, target_info, draft_info, metrics)
        if draft is not None and draft_info is None:
            coord.loop.draft_up = True  # so that set_draft_down starts the probe
            coord.loop.set_draft_down("not reachable at start-up")
        return coord

    def _apply_draft_info(self, draft_info: pb.ModelInfo | None) -> None:
        """The loop's draft limit (--max-num-draft) and whether it pipelines (--pipeline)."""
        if draft_info is not None:
            self.loop.draft_max_num_draft = draft_info.max_num_draft
        on = pipeline_enabled(self.config.pipeline, self.target_info, draft_info)
        if on != self.loop.pipeline or self.config.pipeline == "auto":
            log.info("pipelined speculation %s (--pipeline %s; target GPUs %s, draft GPUs %s)",
                     "on" if on else "off", self.config.pipeline, list(self.target_info.device_uuids) or "-",
                     list(draft_info.device_uuids) or "-" if draft_info else "-")
        self.loop.pipeline = on

    async def _check_draft(self) -> None:
        """A draft server answering again (first contact, or back after a restart): its limits
        are taken afresh, since a restarted server may run with another KV size or length.
        Running sequences keep their reservations: one the new draft cannot hold is refused by it
        and goes on by plain decoding (SpecLoop's draft-failure path)."""
        info = await self.draft.info(timeout=2.0)
        check_draft_compatible(self.target_info, info)
        self._apply_draft_info(info)  # a draft back after a restart may be on another GPU
        if self.draft_info is not None:
            _log_limit_changes("draft", self.draft_info, info)
        self.draft_info = info
        self.scheduler.draft = _capacity("draft", info)
        self.loop.draft_max_len = info.max_model_len

    async def check_target(self) -> None:
        """Before a request's admission: a target that may have restarted since its last Info (it
        closed the step connection while the coordinator was idle, or a step failed and the loop
        gave up waiting for it) is asked for its Info, and its limits are taken, as after a failed
        step; a request it cannot hold is then refused at admission rather than failed mid-stream.
        Until an Info is answered, concurrent requests awaiting the same one; a target still down
        is left to the step's own failure path (and asked again at the next request)."""
        if self._target_check is None:
            if not self.target.needs_info():
                return
            self._target_check = asyncio.ensure_future(self._reread_target())
        await asyncio.shield(self._target_check)

    async def _reread_target(self) -> None:
        try:
            info = await self.target.info(timeout=2.0)
        except grpc.aio.AioRpcError as e:
            log.info("the target may have restarted and does not answer Info yet (%s)", e.code().name)
        else:
            self._target_back(info)
        finally:
            self._target_check = None

    def _target_back(self, info: pb.ModelInfo) -> str | None:
        """The target answers again after a failed step: a restarted server may run with another KV
        size, length or draft limit, which are taken afresh (running sequences keep their
        reservations; the server refuses what it cannot hold). Another model (vocabulary,
        tokenizer) is a deployment error: every request fails, the coordinator stops serving (as
        the step loop's death does), and the problem is returned."""
        old = self.target_info
        if (info.vocab_size, info.tokenizer_fingerprint) != (old.vocab_size, old.tokenizer_fingerprint):
            problem = (f"the target server came back with another model ({info.model_name}: vocab_size "
                       f"{info.vocab_size}, tokenizer {info.tokenizer_fingerprint[:12] or '(none)'}; was "
                       f"{old.model_name}: {old.vocab_size}, {old.tokenizer_fingerprint[:12] or '(none)'})")
            # Every request would run against a tokenizer and limits that are not the target's: the
            # coordinator stops serving (NOT_SERVING, new requests UNAVAILABLE) until it is
            # restarted against that target, as a start-up mismatch stops it from starting.
            log.error("%s; not serving until restarted", problem)
            self.failure = problem
            self.loop.fail_all(grpc.StatusCode.FAILED_PRECONDITION, problem)
            if self._on_failure is not None:
                self._failure_task = asyncio.ensure_future(self._on_failure(problem))
            return problem
        _log_limit_changes("target", old, info)
        self.target_info = info
        self.scheduler.target = _capacity("target", info)
        self.loop.target_max_num_draft = info.max_num_draft
        self.limits = dataclasses.replace(self.limits, max_model_len=info.max_model_len)
        return None

    def start(self, on_failure: Callable[[str], Awaitable[None]] | None = None) -> None:
        """Starts the step loop; `on_failure(message)` is awaited if it ever dies."""
        self._on_failure = on_failure
        self._task = asyncio.create_task(self.loop.run(), name="spec-loop")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The loop catches its own errors, so this is a last resort: without it every client
        would wait forever on a queue nobody fills."""
        if task.cancelled() and self._closing:  # close()
            return
        # Cancelled by anything but close() (a CancelledError raised inside the loop ends its task
        # as cancelled too): a failure like any other, or the clients would wait forever.
        exc = None if task.cancelled() else task.exception()
        what = "cancelled" if task.cancelled() else type(exc).__name__ if exc else "returned"
        self.failure = f"coordinator step loop stopped: {what}: {exc}"
        log.error("%s; failing every request", self.failure, exc_info=exc)
        self.loop.fail_all(grpc.StatusCode.INTERNAL, self.failure)
        if self._on_failure is not None:
            self._failure_task = asyncio.ensure_future(self._on_failure(self.failure))

    async def close(self) -> None:
        """Stops the loop and frees, best effort, whatever the servers still hold for us."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        sched = self.scheduler
        for seq in list(sched.running) + list(sched.waiting):
            sched.retire(seq)
        orphans = sched.release_draft | self.loop.draft_orphans
        for server, ids in ((self.target, sched.release_target), (self.draft, orphans)):
            if server is not None and ids:
                try:
                    await server.release(ids, timeout=2.0)
                except Exception as e:  # shutting down: the server may be gone already
                    log.info("release on the %s server at shutdown failed: %s", server.role, e)
        await self.target.close()
        if self.draft is not None:
            await self.draft.close()

    def new_sequence(self, params: GenParams) -> Sequence:
        return Sequence(seq_id=next(self._ids), params=params, max_len=self.limits.max_model_len,
                        tokenizer=self.tokenizer)

    @property
    def draft_up(self) -> bool:
        return self.loop.draft_up
