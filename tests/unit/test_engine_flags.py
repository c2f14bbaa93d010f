"""Engine settings of the model servers added for the GPU path and the benchmarks (CUDA graphs,
random weights): command line -> EngineConfig, validation, and that CPU engines never capture (the
graph path itself is tested on the GPU: tests/gpu/test_services_gpu.py)."""
from __future__ import annotations

import pytest

from specdec.config import ConfigError, EngineConfig
from specdec.serving.server import config_from_args


def test_defaults_graph_on_cuda_with_engine_query_lengths():
    config = config_from_args("target", ["--model", "m", "--device", "cuda:1"])[0]
    e = config.engine
    assert e.cuda_graphs and e.graph_query_lens is None and e.graph_batch_sizes == (1, 2, 4, 8, 16, 32)


def test_flags_reach_the_engine_config():
    argv = ["--model", "m", "--no-cuda-graphs", "--graph-query-lens", "1,3", "--graph-batch-sizes", "1,8"]
    config = config_from_args("draft", argv)[0]
    e = config.engine
    assert not e.cuda_graphs and e.graph_query_lens == (1, 3) and e.graph_batch_sizes == (1, 8)
    assert not e.random_weights and e.gemv_kernels is None
    assert config_from_args("draft", ["--model", "m", "--no-gemv-kernels"])[0].engine.gemv_kernels is False
    assert e.pdl is None and config_from_args("target", ["--model", "m", "--no-pdl"])[0].engine.pdl is False
    assert config_from_args("target", ["--model", "m", "--random-weights"])[0].engine.random_weights
    assert e.graph_prefill_lens is None  # the engine's default
    assert e.sampler_graphs and e.sampled_chains
    assert not config_from_args("draft", ["--model", "m", "--no-sampled-chains"])[0].engine.sampled_chains
    prefill = ["--model", "m", "--graph-prefill-lens"]
    assert config_from_args("target", prefill + ["32,128"])[0].engine.graph_prefill_lens == (32, 128)
    assert config_from_args("target", prefill + ["none"])[0].engine.graph_prefill_lens == ()


@pytest.mark.parametrize("argv, on", [(["--device", "cuda"], True), (["--device", "cuda:1"], True),
                                      ([], False), (["--device", "cuda", "--no-verify-ahead"], False),
                                      (["--verify-ahead"], True)])
def test_targets_stage_steps_ahead_on_cuda_unless_told(argv, on):
    assert config_from_args("target", ["--model", "m", *argv])[0].engine.verify_ahead is on


def test_drafts_have_no_verify_ahead_flag(capsys):
    with pytest.raises(SystemExit):
        config_from_args("draft", ["--model", "m", "--verify-ahead"])
    assert "--verify-ahead" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--graph-query-lens", "1,x"), ("--graph-batch-sizes", "0,2"),
                                         ("--graph-prefill-lens", "16,0")])
def test_bad_values_exit_with_usage(flag, value, capsys):
    with pytest.raises(SystemExit):
        config_from_args("target", ["--model", "m", flag, value])
    assert flag.strip("-").replace("-", "_") in capsys.readouterr().err.replace("-", "_")


def test_config_validation():
    with pytest.raises(ConfigError, match="graph_query_lens"):
        EngineConfig(model="m", graph_query_lens=())
    with pytest.raises(ConfigError, match="graph_batch_sizes"):
        EngineConfig(model="m", graph_batch_sizes=(0,))


def test_cpu_engines_run_eagerly(tmp_path):
    from specdec.engine import DraftEngine, TargetEngine
    from tests.helpers.tiny_models import make_pair
    target, draft = make_pair(tmp_path)
    for cls, path in ((DraftEngine, draft), (TargetEngine, target)):
        engine = cls(EngineConfig(model=path, num_blocks=8))
        assert engine.runner.graphs is None and engine.graph_replays == 0


def test_rank_devices_are_consecutive_gpus_from_rank_zeros(monkeypatch):
    from specdec.config import rank_devices
    assert rank_devices("cpu", 2) == ["cpu", "cpu"] and rank_devices("cuda:3", 1) == ["cuda:3"]
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    assert rank_devices("cuda:1", 2) == ["cuda:1", "cuda:2"]
    assert rank_devices("cuda:2", 2, rank=1) == ["cuda:1", "cuda:2"]    # seen from rank 1 (the engine's Info)
    with pytest.raises(ConfigError, match="needs GPUs 3..4; 4 visible"):
        rank_devices("cuda:3", 2)
    with pytest.raises(ConfigError, match=">= 1"):
        rank_devices("cpu", 0)


def test_blas_flag_reaches_the_config_and_is_checked(capsys):
    assert config_from_args("target", ["--model", "m"])[0].engine.blas is None          # blas.DEFAULT on cuda
    assert config_from_args("target", ["--model", "m", "--blas", "cublas"])[0].engine.blas == "cublas"
    with pytest.raises(SystemExit):
        config_from_args("target", ["--model", "m", "--blas", "mkl"])
    assert "--blas" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="blas: expected one of cublas, cublaslt"):
        EngineConfig(model="m", blas="cuBLAS")


class _Preference:
    """torch.backends.cuda.preferred_blas_library as a recorder (a CPU build of torch refuses
    cuBLASLt, so the setting itself is only made on the GPU: tests/gpu)."""

    def __init__(self):
        self.value, self.calls = "Cublas", []

    def __call__(self, backend=None):
        if backend is not None:
            self.calls.append(backend)
            self.value = {"cublas": "Cublas", "cublaslt": "Cublaslt"}[backend.lower()]
        return type("Backend", (), {"name": self.value})()


def test_blas_forced_restores_the_library_whatever_the_block_raises(monkeypatch):
    from specdec.kernels import blas
    pref = _Preference()
    monkeypatch.setattr("torch.backends.cuda.preferred_blas_library", pref)
    assert blas.current() == "cublas"
    with blas.forced("cublaslt"):
        assert blas.current() == "cublaslt"
    assert blas.current() == "cublas"
    with pytest.raises(KeyError):
        with blas.forced("cublaslt"):
            raise KeyError("inside")
    assert blas.current() == "cublas"
    with pytest.raises(ValueError, match="blas"):
        with blas.forced("rocblas"):      # checked before anything changes
            pass
    assert pref.calls == ["cublaslt", "cublas", "cublaslt", "cublas"]


def test_cpu_engines_leave_the_blas_library_alone(tmp_path, monkeypatch):
    from specdec.engine import TargetEngine
    from tests.helpers.tiny_models import make_pair
    pref = _Preference()
    monkeypatch.setattr("torch.backends.cuda.preferred_blas_library", pref)
    TargetEngine(EngineConfig(model=make_pair(tmp_path)[0], num_blocks=8, blas="cublaslt"))
    assert pref.calls == []
