"""python -m coordinator --target HOST:PORT [--draft HOST:PORT] ..."""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import sys

from coordinator.config import ConfigError, CoordinatorConfig


def parse_args(argv: list[str] | None = None) -> CoordinatorConfig:
    d = CoordinatorConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__)
    p.add_argument("--target", required=True, help="target server address host:port")
    p.add_argument("--draft", default=None, help="draft server address host:port (omit: no speculation)")
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default)
    p.add_argument("--metrics-port", type=int, default=d["metrics_port"].default,
                   help="Prometheus /metrics port (compose: 9400); 0 picks a free port (logged); "
                        "-1 (default): no endpoint")
    p.add_argument("--tokenizer", default=None,
                   help="folder with tokenizer.json (default: the target's model folder)")
    p.add_argument("--max-batch-size", type=int, default=d["max_batch_size"].default)
    p.add_argument("--max-waiting", type=int, default=d["max_waiting"].default,
                   help="requests that may wait for a batch slot or KV; more are refused (RESOURCE_EXHAUSTED)")
    p.add_argument("--num-draft", type=int, default=d["num_draft"].default,
                   help="draft tokens per step when a request does not say")
    p.add_argument("--max-num-draft", type=int, default=d["max_num_draft"].default)
    p.add_argument("--gamma", dest="gamma_policy", choices=("fixed", "auto"),
                   default=d["gamma_policy"].default,
                   help="auto: pick num_draft per request from its acceptance and the cost ratio c")
    p.add_argument("--spec-max-batch", type=int, default=d["spec_max_batch"].default,
                   help="steps with more running sequences than this decode without drafts (at large "
                        "batches a verify forward costs more than a decode forward and speculation "
                        "can lose: bench/README.md); 0 (default): no limit")
    p.add_argument("--prefill-chunk", type=int, default=d["prefill_chunk"].default)
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float,
                   default=d["connect_timeout_s"].default,
                   help="seconds to wait for a server at start-up, and for a lost target to come back "
                        "before its running requests end with UNAVAILABLE")
    p.add_argument("--target-timeout", dest="target_timeout_s", type=float,
                   default=d["target_timeout_s"].default,
                   help="seconds one target step (write and answer) may take; a target slower than "
                        "this counts as lost: the coordinator waits for it (--connect-timeout) and "
                        "resends its sequences, which end with UNAVAILABLE if it keeps failing")
    p.add_argument("--draft-timeout", dest="draft_timeout_s", type=float,
                   default=d["draft_timeout_s"].default,
                   help="seconds one draft step may take; a slower draft is dropped (plain decoding) "
                        "and probed again every --draft-retry seconds")
    p.add_argument("--draft-retry", dest="draft_retry_s", type=float, default=d["draft_retry_s"].default)
    p.add_argument("--grace", dest="grace_s", type=float, default=d["grace_s"].default)
    p.add_argument("--busy-poll-ms", type=float, default=d["busy_poll_ms"].default,
                   help="after each step the event loop polls instead of sleeping for this long, so "
                        "server answers are read without a thread wake-up (one busy core while "
                        "serving; 20 suits GPU servers; default 0 = off)")
    p.add_argument("--pipeline", nargs="?", const="on", default=d["pipeline"].default,
                   choices=("auto", "on", "off"),
                   help="pipelined speculation: while the target verifies a step, the draft drafts the "
                        "next one, as if all drafts and its guess of the "
                        "target's bonus token were accepted; steps where they were need no Propose. "
                        "It pays with the draft on a GPU of its own (on the target's GPU the two "
                        "share it and it is slower): auto (default) turns it on when the servers "
                        "report different GPUs; `--pipeline` alone is on")
    p.add_argument("--step-channel", default=d["step_channel"].default, choices=("auto", "grpc"),
                   help="how steps reach the model servers: auto (default) over a server's step "
                        "channel, a plain socket it names in Info (its --step-port), where it has one, "
                        "else its gRPC stream; grpc: always the gRPC stream")
    p.add_argument("--seq-id-base", type=int, default=d["seq_id_base"].default,
                   help="the first sequence id this coordinator gives the servers (tests, debugging); 0 "
                        "(default): a random one, so that coordinators sharing servers never share ids")
    p.add_argument("--log-level", default="INFO")
    args = vars(p.parse_args(argv))
    logging.basicConfig(level=args.pop("log_level").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return CoordinatorConfig(**args)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return 2
    from prometheus_client import CollectorRegistry, disable_created_metrics

    from coordinator.app import IncompatibleModels
    from coordinator.service import serve
    from coordinator.tokenizer import TokenizerError
    from specdec.metrics import CoordinatorMetrics
    disable_created_metrics()  # no *_created series: half the exposition, nothing a panel reads
    metrics = CoordinatorMetrics(CollectorRegistry(), max_positions=config.max_num_draft)
    from specdec import trace
    from specdec.profiling import profile_dir, write_profile
    trace.start("coordinator")
    profiler = cProfile.Profile() if profile_dir() is not None else None  # the event loop's thread
    try:
        if profiler is not None:
            profiler.enable()
        asyncio.run(serve(config, metrics))
    except (IncompatibleModels, TokenizerError, OSError) as e:   # (ConnectionError; a port not to be had)
        logging.getLogger("specdec.coordinator").error("%s", e)
        print(f"coordinator: {e}", file=sys.stderr)
        return 1
    finally:
        if profiler is not None:
            profiler.disable()
            write_profile(profiler, "coordinator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
