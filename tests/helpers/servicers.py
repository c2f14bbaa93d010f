"""The target and draft servicers over tiny CPU engines, driven without a gRPC stream: what tests of
a server's step (conversion, engine, response, timing) build on."""
from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from draft_server.servicer import DraftServicer
from specdec.config import EngineConfig
from specdec.engine import DraftEngine, TargetEngine
from specdec.metrics import ServerMetrics
from specdec.serving.server import EngineRuntime
from target_server.servicer import TargetServicer
from tests.helpers.tiny_models import make_pair


def runtime_for(engine, role: str) -> EngineRuntime:
    runtime = EngineRuntime(ServerMetrics(CollectorRegistry(), role))
    runtime.attach(engine)
    return runtime


def servicer_pair(folder: Path) -> tuple[TargetServicer, DraftServicer]:
    """make_pair's models in `folder`, each served by its servicer (32 blocks of 4 tokens, up to 4
    drafts a sequence)."""
    target_path, draft_path = make_pair(folder)
    config = dict(num_blocks=32, block_size=4, warmup_batch_sizes=(1,), max_num_draft=4)
    return (TargetServicer(runtime_for(TargetEngine(EngineConfig(model=target_path, **config)), "target")),
            DraftServicer(runtime_for(DraftEngine(EngineConfig(model=draft_path, **config)), "draft")))
