"""Stands in for the three processes: synthetic speculative steps recorded through specdec.metrics.

    python -m tests.helpers.synthetic_exporter [--duration 120] [--alpha 0.8]

Serves one /metrics endpoint per role on free loopback ports, prints them as one JSON line
({"coordinator": port, "draft": port, "target": port}), then records ~50 batched steps a second
with i.i.d. acceptance until killed or `duration` seconds pass (it always stops by itself). The
model servers' forward times are fixed per bucket (draft 1 ms, target 10 ms at batch 1, growing
slowly with batch), so c is known exactly: the Prometheus harness test checks it end to end.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from prometheus_client import CollectorRegistry

from specdec.cost_model import bucket_for
from specdec.metrics import CoordinatorMetrics, ServerMetrics, ServerTiming, start_metrics_server

BUCKETS = (1, 2, 4, 8)
GAMMA = 4


# Forward time depends on the padded batch (the CUDA-graph bucket), as on the real servers.
def draft_seconds(batch: int) -> float:
    return 0.001 * (1 + 0.05 * bucket_for(batch, BUCKETS))


def target_seconds(batch: int, query_len: int) -> float:
    return 0.010 * (1 + 0.02 * bucket_for(batch, BUCKETS)) * (1 + 0.1 * (query_len - 1))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    regs = {role: CollectorRegistry() for role in ("coordinator", "draft", "target")}
    coord = CoordinatorMetrics(regs["coordinator"], buckets=BUCKETS)
    draft = ServerMetrics(regs["draft"], "draft", buckets=BUCKETS)
    target = ServerMetrics(regs["target"], "target", buckets=BUCKETS)
    for b in BUCKETS:  # the warm-up profile, as the servers do it before serving
        draft.profile.set_profiled(b, 1, [draft_seconds(b)] * 3)
        target.profile.set_profiled(b, 1, [target_seconds(b, 1)] * 3)
        target.profile.set_profiled(b, GAMMA + 1, [target_seconds(b, GAMMA + 1)] * 3)
    servers = {role: start_metrics_server(0, reg, addr="127.0.0.1") for role, reg in regs.items()}
    print(json.dumps({role: s.port for role, s in servers.items()}), flush=True)

    start, step = time.monotonic(), 0
    try:
        while time.monotonic() - start < args.duration:
            step += 1
            n = rng.choice((1, 2, 3, 4))
            plain = step % 10 == 0  # every tenth step plain: c_system gets an observed denominator
            gamma = 0 if plain else GAMMA
            accepted = []
            for _ in range(n):
                a = 0
                while a < gamma and rng.random() < args.alpha:
                    a += 1
                accepted.append(a)
            for _ in range(gamma):
                draft.observe_forward("decode", n, 1, draft_seconds(n))
            verify = target_seconds(n, gamma + 1)
            target.observe_forward("decode" if plain else "verify", n, gamma + 1, verify)
            if step % 25 == 1:
                target.observe_forward("prefill", 1, None, 0.05)
                draft.observe_forward("prefill", 1, None, 0.005)
            propose = gamma * (draft_seconds(n) + 0.0002) + (0.0005 if gamma else 0.0)
            verify_wall = verify + 0.0005
            stages = {"schedule": 0.0001, "verify": verify_wall, "emit": 0.0001}
            if gamma:
                stages["propose"] = propose
            coord.observe_step(
                [gamma] * n, accepted, step_seconds=sum(stages.values()), stage_seconds=stages,
                draft_timing=ServerTiming(gamma * draft_seconds(n), draft.decode_forward_seconds(n), n)
                if gamma else None,
                target_timing=ServerTiming(verify, target.decode_forward_seconds(n), n))
            if gamma:
                coord.observe_rpc("Propose", propose)
                draft.observe_rpc("Propose", propose - 0.0003)
            coord.observe_rpc("Verify", verify_wall)
            target.observe_rpc("Verify", verify_wall - 0.0003)
            for server in (draft, target):
                server.set_kv(used=10 * n, free=1000 - 10 * n)
                server.set_running(n)
            coord.set_running(n)
            if step % 5 == 0:  # a request finishes: 0.05 s TTFT, 20 tokens
                coord.observe_first_token(0.05)
                code = "INVALID_ARGUMENT" if step % 50 == 0 else "OK"
                coord.observe_request(code, 0.05 + 19 * 0.01, 20, ttft_seconds=0.05)
            if step % 40 == 0:
                target.count_error("RESOURCE_EXHAUSTED")
            time.sleep(0.02)
    finally:
        for s in servers.values():
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
