"""Model-server bootstrap shared by draft_server and target_server: command line -> ServerConfig,
grpc.aio server with health checking, reflection and the error interceptor, and the engine's
runtime: one engine call at a time, either on the executor thread (loading, prompts, Info,
Release: the asyncio loop stays free for health checks meanwhile) or inline on the loop's thread
(decode and verify steps, a few milliseconds each: two thread hand-offs saved per step)."""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, disable_created_metrics

from protos.wire import MAX_MESSAGE_BYTES
from specdec.busy_poll import BusyPoll
from specdec.config import ORPHAN_TIMEOUT_S, TP_ALL_REDUCE_MODES, ConfigError, EngineConfig, ServerConfig, parse_dtype, parse_size
from specdec.engine.base import ModelEngine
from specdec.kernels.blas import LIBRARIES as BLAS_LIBRARIES
from specdec.metrics import ServerMetrics, start_metrics_server
from specdec.models.loader import CheckpointError
from specdec import trace
from specdec.profiling import profile_dir, write_profile
from specdec.serving import owners, step_channel, tensor_parallel
from specdec.serving.errors import ErrorInterceptor, NotReady
from specdec.serving.tensor_parallel import TensorParallelEngine

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"draft": 50051, "target": 50052}
SERVER_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  # The coordinator pings idle streams (keepalive) to notice a lost server; without
                  # these the server answers its pings with GOAWAY "too_many_pings".
                  ("grpc.keepalive_permit_without_calls", 1),
                  ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                  ("grpc.http2.max_pings_without_data", 0),
                  # And pings its coordinators: a coordinator whose host vanished (no FIN) ends its
                  # streams within ~15 s, so its sequences are freed (serving/owners.py).
                  ("grpc.keepalive_time_ms", 10000),
                  ("grpc.keepalive_timeout_ms", 5000),
                  # gRPC sets SO_REUSEPORT by default: a second server on a port in use started
                  # beside the first and took half its connections. Off, binding it fails.
                  ("grpc.so_reuseport", 0)]


class EngineRuntime:
    """The engine (None while loading), the calls into it (one at a time), and the server's metrics."""

    def __init__(self, metrics: ServerMetrics, profile: bool = False, busy_poll_s: float = 0.0,
                 orphan_timeout_s: float = ORPHAN_TIMEOUT_S) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._lock = asyncio.Lock()  # engine calls never overlap, on whichever thread they run
        self.engine: ModelEngine | None = None
        self.metrics = metrics
        self.decode_seconds = 0.0  # single-token forward seconds of the step in progress
        self.step_port = 0  # the step channel's port, which Info reports (0: none)
        # SPECDEC_PROFILE_DIR: a cProfile of every call on the engine thread after start-up (request
        # conversion, engine step, response, metrics), written there at shutdown (specdec/profiling.py).
        self.profiler = cProfile.Profile() if profile else None
        # The loop polls for a while after each answered step, so the next request is read
        # without a thread wake-up (paused while the engine thread works).
        self.busy_poll = BusyPoll(busy_poll_s)
        # Which coordinator holds each sequence: those of a coordinator gone without releasing
        # them are freed (specdec/serving/owners.py).
        self.owners = owners.Owners(self._free_orphans, orphan_timeout_s)

    def attach(self, engine: ModelEngine) -> None:
        """Serves `engine` from now on; its profile becomes the exported one (warm-up included)
        and its live single-token forwards go into the decode histogram."""
        self.metrics.watch_profile(engine.profile.costs)
        engine.profile.on_sample.append(self._on_decode_forward)
        if engine.device.type == "cuda" and engine.device.index is not None:
            # Inline calls run on this (the loop's) thread: Triton launches and graph replays use
            # the thread's current device (see ModelEngine.__init__; bare "cuda" is the default).
            torch.cuda.set_device(engine.device)
        self.engine = engine

    def _on_decode_forward(self, batch_size: int, seconds: float) -> None:
        self.metrics.observe_forward("decode", batch_size, seconds)
        self.decode_seconds += seconds

    def publish_state(self) -> None:
        """KV and sequence gauges; on the engine thread, after anything that changes them."""
        blocks = self.engine.runner.blocks
        self.metrics.set_kv(used=blocks.num_blocks - blocks.num_free, free=blocks.num_free)
        self.metrics.set_running(self.engine.num_sequences())
        self.metrics.set_forwards(graph=self.engine.graph_replays, eager=self.engine.eager_forwards)
        if self.metrics.role == "target":
            self.metrics.set_ahead(taken=self.engine.ahead_taken, dropped=self.engine.ahead_dropped)

    async def call(self, fn: Callable, *args, inline: bool = False):
        """fn(*args) once no other engine call runs: on the executor thread, or with `inline` on
        the loop's own thread (blocking the loop meanwhile: only for calls of milliseconds)."""
        if self.engine is None:
            raise NotReady("the model is still loading")
        if self.profiler is not None:
            fn, args = self.profiler.runcall, (fn, *args)  # calls never overlap: one thread at a time
        await self._lock.acquire()
        if inline:
            try:
                return fn(*args)
            finally:
                self._lock.release()
        # The lock goes with the call itself, not with this coroutine: a caller cancelled (its
        # client went away) while the engine thread still runs fn must not let the next call in.
        done = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        done.add_done_callback(self._release_after)
        with self.busy_poll.paused():
            return await asyncio.shield(done)

    async def release(self, seq_ids: list[int]) -> tuple[int, int]:
        """Frees these sequences' KV (unknown ids are ignored): (how many were held, free blocks).
        Their owner is dropped once they are freed: a call cancelled before the engine ran it
        leaves them to the owner's orphan timeout."""
        def release():
            released = self.engine.release(seq_ids)
            self.publish_state()
            return released, self.engine.num_free_blocks
        out = await self.call(release)
        self.owners.released(seq_ids)
        return out

    async def _free_orphans(self, seq_ids: list[int]) -> None:
        released, _ = await self.release(seq_ids)
        self.metrics.count_orphaned(released)

    def _release_after(self, call: asyncio.Future) -> None:
        """Done callback of an executor call: the engine is free for the next call. Reading the
        exception marks it retrieved (a caller cancelled meanwhile never awaits it; one that
        waits still gets it raised)."""
        self._lock.release()
        if not call.cancelled():
            call.exception()


# --- command line ------------------------------------------------------------------------------
def build_parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {role}_server",
                                description=f"specdec {role} model server (gRPC specdec.v1.{role.title()})")
    p.add_argument("--model", required=True, type=Path, help="Hugging Face checkpoint folder")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    p.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto "
                                                   "(bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--host", default="[::]")
    p.add_argument("--port", type=int, default=DEFAULT_PORTS[role], help="0 picks a free port (logged)")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="Prometheus /metrics port (compose: draft 9401, target 9402); 0 picks a free "
                        "port (logged); -1 (default): no endpoint")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int, help="KV cache blocks")
    kv.add_argument("--kv-memory", help="KV cache size, e.g. 8GiB (default: 85%% of free GPU memory "
                                        "after the weights on cuda, 64MiB on cpu)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, help="longest sequence (default: the model's)")
    p.add_argument("--max-num-draft", type=int, default=16, help="most draft tokens per sequence and step")
    if role == "draft":
        p.add_argument("--probs-dtype", default="float16", choices=["float16", "bfloat16"],
                       help="precision of draft probabilities on the wire")
    p.add_argument("--warmup-batch-sizes", help="comma-separated batch sizes of the startup profile "
                                                "(default 1,2,4,8,16,32 on cuda, 1,2 on cpu)")
    if role == "target":
        p.add_argument("--verify-ahead", action=argparse.BooleanOptionalAction, default=None,
                       help="after answering a step, admit and stage the step that usually follows "
                            "(the same greedy sequences, each with its next token and the step's most drafts) "
                            "while the coordinator and the draft work; the next Verify skips that host "
                            "work when it is that step (TargetEngine.prepare_ahead; default: on for "
                            "cuda, off for cpu)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights of the shape in the model folder's config.json (benchmarks: "
                        "no checkpoint needed)")
    p.add_argument("--random-agreement", type=float, metavar="A",
                   help="with --random-weights: weights whose greedy next token agrees with a shared "
                        "reference on a fraction A of the vocabulary (give the target 1 and the draft "
                        "the acceptance to benchmark at; specdec/models/synthetic.py)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every forward eagerly on cuda (default: graphs for decode/verify steps)")
    p.add_argument("--no-sampler-graphs", dest="sampler_graphs", action="store_false",
                   help="sample op by op on cuda (default: on CUDA graphs: the draft's sampling one "
                        "replay per drafted position, the target's rejection step one per verify; "
                        "sampling/graphs.py)")
    p.add_argument("--no-sampled-chains", dest="sampled_chains", action="store_false",
                   help="draft: sample position by position, one sampler replay each (default: a "
                        "sampled step's positions run as one chain of graph replays, as greedy steps "
                        "do; cuda_graphs.py)")
    p.add_argument("--no-gemv-kernels", dest="gemv_kernels", action="store_const", const=False,
                   default=None, help="cuBLAS for every linear layer on cuda (default: the Triton GEMV "
                                      "for steps of <= 64 tokens, above 16 only projections up to 16384 "
                                      "wide; the BLAS for the rest)")
    p.add_argument("--no-pdl", dest="pdl", action="store_const", const=False, default=None,
                   help="launch the Triton kernels without programmatic dependent launch (default: "
                        "with it on Hopper and newer GPUs; kernels/pdl.py)")
    p.add_argument("--blas", choices=BLAS_LIBRARIES,
                   help="on cuda, the library of the matrix products the Triton GEMV does not take (steps "
                        "of > 64 tokens, prompts, and above 16 tokens the widest projections; default "
                        "cublaslt, whose kernels at 32-40 rows skip cuBLAS's split-K reduce; kernels/blas.py)")
    p.add_argument("--graph-query-lens", help="comma-separated query lengths to graph (default: "
                                              "draft 1,2; target 1..min(max-num-draft, 8)+1)")
    p.add_argument("--graph-prefill-lens",
                   help="comma-separated prompt-chunk lengths to graph, each with every batch size, "
                        "for steps mixing a prompt with decode/verify tokens; 'none' for none "
                        "(default: 16,32,...,512 up to max-model-len)")
    p.add_argument("--graph-context-lens",
                   help="comma-separated context bounds below max-model-len, each with a decode/verify "
                        "graph set planned for it (fewer attention KV splits while every sequence of a "
                        "step is that short; cuda_graphs.GraphSets); 'none' for none (default: 256)")
    p.add_argument("--graph-batch-sizes", default="1,2,4,8,16,32",
                   help="comma-separated batch buckets to graph (larger batches run eagerly)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N GPUs from --device on, one process each (this one "
                        "serves gRPC; serving/tensor_parallel.py); the KV heads and the "
                        "intermediate size must divide by N")
    p.add_argument("--tp-all-reduce", choices=TP_ALL_REDUCE_MODES, default="auto",
                   help="with --tensor-parallel-size > 1: the row-parallel projections' all-reduce; "
                        "auto: a one-shot all-reduce over symmetric memory (NVLink peers) for "
                        "activations up to 512 KiB where every rank can, NCCL otherwise; nccl: NCCL "
                        "only; one-shot: refuse to start without it (specdec/collectives.py)")
    p.add_argument("--step-port", type=int, default=0,
                   help="TCP port of the step channel (Propose / Verify steps as plain frames beside "
                        "the gRPC stream, without gRPC's thread hand-offs; the coordinator finds it in "
                        "Info; specdec/serving/step_channel.py): 0 (default) any free port, -1 none")
    p.add_argument("--torch-threads", type=int, help="intra-op CPU threads (default: torch's choice)")
    p.add_argument("--busy-poll-ms", type=float,
                   help="after each step the event loop polls instead of sleeping for this long: "
                        "the next request is read without a thread wake-up, for one busy core "
                        "while serving (default 20 on cuda, 0 = off on cpu)")
    p.add_argument("--orphan-timeout", type=float, default=ORPHAN_TIMEOUT_S, metavar="SECONDS",
                   help="free a coordinator's sequences once none of its step connections has been "
                        "open for this long (it died without releasing them; default 5)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds in-flight steps get at shutdown")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(role: str, argv: Sequence[str] | None = None) -> tuple[ServerConfig, int, str]:
    """(config, metrics port, log level) from the command line; errors exit with the argparse
    usage message."""
    parser = build_parser(role)
    a = parser.parse_args(argv)
    if not -1 <= a.metrics_port < 65536:
        parser.error(f"--metrics-port must be in -1..65535, got {a.metrics_port}")
    cuda = a.device.startswith("cuda")
    dtype = ("bfloat16" if cuda else "float32") if a.dtype == "auto" else a.dtype
    sizes = a.warmup_batch_sizes or ("1,2,4,8,16,32" if cuda else "1,2")
    try:
        engine = EngineConfig(
            model=a.model, device=a.device, dtype=parse_dtype(dtype), block_size=a.block_size,
            num_blocks=a.num_blocks, kv_memory=parse_size(a.kv_memory) if a.kv_memory else None,
            max_model_len=a.max_model_len, max_num_draft=a.max_num_draft,
            probs_dtype=parse_dtype(getattr(a, "probs_dtype", "float16")),
            warmup_batch_sizes=_ints(sizes, "--warmup-batch-sizes"), cuda_graphs=a.cuda_graphs,
            sampler_graphs=a.sampler_graphs, sampled_chains=a.sampled_chains,
            graph_query_lens=(_ints(a.graph_query_lens, "--graph-query-lens")
                              if a.graph_query_lens else None),
            graph_batch_sizes=_ints(a.graph_batch_sizes, "--graph-batch-sizes"),
            graph_context_lens=(None if a.graph_context_lens is None else ()
                                if a.graph_context_lens == "none"
                                else _ints(a.graph_context_lens, "--graph-context-lens")),
            graph_prefill_lens=(None if a.graph_prefill_lens is None else ()
                                if a.graph_prefill_lens == "none"
                                else _ints(a.graph_prefill_lens, "--graph-prefill-lens")),
            random_weights=a.random_weights, random_agreement=a.random_agreement,
            gemv_kernels=a.gemv_kernels, pdl=a.pdl, blas=a.blas, tensor_parallel_size=a.tensor_parallel_size,
            verify_ahead=(cuda if getattr(a, "verify_ahead", None) is None else a.verify_ahead),
            tp_all_reduce=a.tp_all_reduce)
        config = ServerConfig(role=role, engine=engine, host=a.host, port=a.port, grace_seconds=a.grace,
                              torch_threads=a.torch_threads, busy_poll_ms=a.busy_poll_ms,
                              step_port=a.step_port, orphan_timeout_s=a.orphan_timeout)
    except ValueError as e:
        parser.error(str(e))
    return config, a.metrics_port, a.log_level


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None


# --- serving -----------------------------------------------------------------------------------
async def serve(config: ServerConfig, make_engine: Callable[[EngineConfig], ModelEngine],
                add_servicer: Callable[[grpc.aio.Server, EngineRuntime], object], service_name: str,
                metrics: ServerMetrics, metrics_port: int = -1) -> None:
    """Listens at once (health NOT_SERVING; the step channel unless step_port is -1; /metrics too
    when metrics_port >= 0), loads and warms the engine on its thread, then reports SERVING until
    SIGINT/SIGTERM. add_servicer returns the servicer it added (its steps serve the channel)."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    runtime = EngineRuntime(metrics, profile=profile_dir() is not None, busy_poll_s=config.busy_poll_s,
                            orphan_timeout_s=config.orphan_timeout_s)
    server = grpc.aio.server(interceptors=[ErrorInterceptor(on_error=metrics.count_error)],
                             options=SERVER_OPTIONS)
    servicer = add_servicer(server, runtime)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    for name in ("", service_name):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        port = server.add_insecure_port(config.address)
    except RuntimeError as e:   # (in use, or not an address of this host)
        raise ConfigError(f"--port {config.port}: cannot listen on {config.address}: {e}") from None
    await server.start()
    log.info("%s server listening on %s:%d", config.role, config.host, port)
    channel = None
    if config.step_port >= 0:
        channel = step_channel.StepChannel(servicer)
        try:
            runtime.step_port = await channel.start(config.host, config.step_port)
        except OSError as e:
            await server.stop(None)
            raise ConfigError(f"--step-port {config.step_port}: cannot listen on it: {e}") from None
        log.info("%s step channel on port %d", config.role, runtime.step_port)
    try:
        metrics_server = start_metrics_server(metrics_port, metrics.registry) if metrics_port >= 0 else None
    except OSError as e:
        await asyncio.gather(server.stop(None), *([channel.close(0)] if channel is not None else []))
        raise ConfigError(str(e)) from None
    if metrics_server is not None:
        log.info("%s metrics on port %d", config.role, metrics_server.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        engine = await loop.run_in_executor(runtime.executor, _load, make_engine, config.engine)
        runtime.attach(engine)
        await runtime.call(runtime.publish_state)
        for name in ("", service_name):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("SERVING %s (%d KV blocks of %d tokens)", config.engine.model,
                 engine.runner.blocks.num_blocks, engine.runner.blocks.block_size)
        await stop.wait()
        log.info("shutting down")
    finally:
        await health.enter_graceful_shutdown()
        await asyncio.gather(server.stop(config.grace_seconds),
                             *([channel.close(config.grace_seconds)] if channel is not None else []))
        runtime.busy_poll.close()
        runtime.owners.close()
        runtime.executor.shutdown(wait=True, cancel_futures=True)
        if isinstance(runtime.engine, TensorParallelEngine):
            runtime.engine.close()
        if metrics_server is not None:
            metrics_server.close()
        if runtime.profiler is not None:
            log.info("engine-thread profile written to %s", write_profile(runtime.profiler, config.role))


def _load(make_engine: Callable[[EngineConfig], ModelEngine], config: EngineConfig) -> ModelEngine:
    if config.tensor_parallel_size == 1:
        engine = make_engine(config)
    else:  # a warm-up that fails on rank 0 ends the process (TensorParallelEngine: on_call_failed)
        engine = tensor_parallel.start(make_engine, config, torch_threads=torch.get_num_threads())
    profile = engine.warm_up()
    log.info("decode forward profile (batch: ms): %s",
             ", ".join(f"{b}: {s * 1e3:.3f}" for b, s in profile.items()))
    return engine


def main(role: str, make_engine: Callable[[EngineConfig], ModelEngine],
         add_servicer: Callable[[grpc.aio.Server, EngineRuntime], None], service_name: str,
         argv: Sequence[str] | None = None) -> None:
    config, metrics_port, level = config_from_args(role, argv)
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    disable_created_metrics()  # no *_created series: half the exposition, nothing a panel reads
    metrics = ServerMetrics(CollectorRegistry(), role)
    trace.start(role)
    try:
        asyncio.run(serve(config, make_engine, add_servicer, service_name, metrics, metrics_port))
    except (ConfigError, CheckpointError) as e:
        log.error("cannot start the %s server: %s", role, e)
        raise SystemExit(2) from None
