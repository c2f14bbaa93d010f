"""specdec/collectives.py on the CPU: the mode's validation (EngineConfig, the servers' flag), and
that a gloo group keeps torch.distributed's all-reduce (the one-shot path is GPU-only:
tests/gpu/test_collectives_gpu.py runs it on two GPUs)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from specdec import collectives
from specdec.config import ConfigError, EngineConfig
from specdec.serving.server import config_from_args


def test_mode_is_validated_and_reaches_the_engine_config(capsys):
    assert EngineConfig(model="m").tp_all_reduce == "auto"
    with pytest.raises(ConfigError, match="tp_all_reduce"):
        EngineConfig(model="m", tp_all_reduce="ring")
    assert config_from_args("target", ["--model", "m", "--tp-all-reduce", "nccl"])[0].engine.tp_all_reduce == "nccl"
    with pytest.raises(SystemExit):
        config_from_args("target", ["--model", "m", "--tp-all-reduce", "ring"])
    assert "tp-all-reduce" in capsys.readouterr().err


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        yield
    finally:
        collectives.reset()
        dist.destroy_process_group()


def test_a_cpu_group_keeps_gloo_and_refuses_a_forced_one_shot(gloo_group):
    assert collectives.setup(torch.device("cpu"), torch.float32, "auto") == "gloo"
    x = torch.arange(6, dtype=torch.float32)
    assert collectives.all_reduce(x) is x and torch.equal(x, torch.arange(6, dtype=torch.float32))
    with pytest.raises(ConfigError, match="one-shot needs GPUs"):
        collectives.setup(torch.device("cpu"), torch.float32, "one-shot")
    with pytest.raises(ConfigError, match="tp_all_reduce"):
        collectives.setup(torch.device("cpu"), torch.float32, "ring")
    assert collectives.path() == "gloo"
