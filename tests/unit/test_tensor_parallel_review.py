"""Review of the tensor-parallel target path (models/llama.TensorParallel, the column/row-parallel
layers, loader slicing) on CPU gloo ranks, beyond test_tensor_parallel.py (two ranks, default
shapes, two plain steps):

* Llama/Mistral/Qwen2 configs with GQA (groups of 2 and 4, one KV head per rank), MHA, an explicit
  head_dim != hidden / heads, attention (qkv + o) and MLP biases, Qwen2's qkv-only bias, tied
  embeddings, default / linear / llama3 RoPE, intermediate sizes that are not powers of two, from
  checkpoint folders saved in several safetensors shards with an index;
* 2 and 4 ranks, each driven through ModelRunner with the paged KV cache: chunked prefill, decode,
  k+1-token verifies, rollback by truncation, free + reuse of blocks; logits against one rank, and
  each rank's KV cache against its heads of the one-rank cache;
* the CUDA-path op set under TP (FusedLayerOps + GemvOps with the SiLU epilogue + the Triton
  attention backend, all in the interpreter), where GemvOps' add + RMSNorm fusion must be off;
* the loader's per-rank slices of q/k/v/o and gate/up/down (and biases) against the checkpoint;
* invalid TP configurations refused with an error naming the field.

Two process groups are spawned per module (2 ranks, 4 ranks); every rank runs all its cases in one
go and writes its results to a file, so each case's test only reads them.
"""
from __future__ import annotations

import datetime
import json
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec.config import CacheConfig, ModelConfig
from specdec.models.llama import TensorParallel
from specdec.models.loader import CheckpointError, build_model, load_model
from specdec.runner import ModelRunner, SeqInput

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}

# name -> (arch, HF config kwargs). Every checkpoint is saved in several shards with an index.
CHECKPOINTS = {
    # GQA group 4 (one KV head per rank at TP 2), q/k/v/o + MLP biases, llama3 RoPE, I = 96
    "llama_gqa4_bias": ("llama", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                      intermediate_size=96, attention_bias=True, mlp_bias=True,
                                      tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    # Qwen2: q/k/v biases, no o bias; tied embeddings; linear RoPE; I = 80
    "qwen2_tied": ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=80, tie_word_embeddings=True,
                                 rope_parameters=LINEAR_ROPE)),
    # MHA with head_dim 16 != 48 / 4, so q_size (64) != hidden (48): o_proj is not square
    "mistral_mha_headdim": ("mistral", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                                            head_dim=16, intermediate_size=64, tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # GQA group 2, head_dim 16 with hidden 64, o bias, tied, llama3 RoPE, I = 96 (24 per rank at 4)
    "llama_tp4": ("llama", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                intermediate_size=96, attention_bias=True, mlp_bias=False,
                                tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
}
VOCAB = 192

# (world, checkpoint, mode). mode "torch": the CPU op set and torch attention; "cuda_ops": fused
# kernels + GEMV (SiLU epilogue) + Triton attention, in the interpreter; "size_mismatch": the model
# built for 4 ranks while the process group has 2.
CASES = {
    2: [("llama_gqa4_bias", "torch"), ("qwen2_tied", "torch"), ("mistral_mha_headdim", "torch"),
        ("llama_tp4", "torch"), ("qwen2_tied", "cuda_ops"), ("llama_tp4", "size_mismatch")],
    4: [("mistral_mha_headdim", "torch"), ("llama_tp4", "torch")],
}
ATOL, RTOL = 2e-5, 1e-5        # fp32, the same ops in a different summation order
OPS_ATOL, OPS_RTOL = 1e-4, 1e-4  # GEMV / fused kernels against the torch ops (as test_gemv.py)


def _make_checkpoint(path: Path, arch: str, seed: int, **kwargs) -> Path:
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
    config_cls, model_cls = classes[arch]
    config = config_cls(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256,
                        bos_token_id=0, eos_token_id=0, **kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # as tests/helpers/tiny_models: peaked distributions, random biases
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="40KB")
    return path


# --- the script every configuration runs: one rank or many, same calls -------------------------
def _drive(runner: ModelRunner) -> list[torch.Tensor]:
    """Chunked prefill, decode, k+1-token verifies with rollback, free + reuse; block size 4, so
    steps cross block boundaries. Returns each item's logits of every step."""
    out: list[torch.Tensor] = []

    def step(items):
        out.extend(t.clone() for t in runner.step(items))

    for s in "abc":
        runner.add_sequence(s)
    step([SeqInput("a", [5, 9, 2, 7, 1, 3, 8], 1),                 # whole prompt
          SeqInput("b", [11, 4, 6, 17, 30, 2], 0),                 # first chunk of a prompt
          SeqInput("c", [40, 41, 42], 3)])                         # prompt, logits of every token
    step([SeqInput("a", [12], 1), SeqInput("b", [3, 9, 101], 1), SeqInput("c", [77], 1)])
    # verify: 1 new token + 3 drafts / decode / 1 + 2 drafts
    na, nc = runner.num_tokens("a"), runner.num_tokens("c")
    step([SeqInput("a", [13, 14, 15, 16], 4), SeqInput("b", [150], 1), SeqInput("c", [7, 8, 9], 3)])
    runner.truncate("a", na + 2)       # one draft accepted
    runner.truncate("c", nc + 1)       # none accepted
    step([SeqInput("a", [99, 21, 22], 3), SeqInput("c", [5, 60, 61, 62, 63], 5)])
    runner.free("b")
    runner.add_sequence("d")           # reuses b's blocks
    step([SeqInput("d", [1, 2, 3, 4, 5], 1), SeqInput("a", [31], 1), SeqInput("c", [32], 1)])
    step([SeqInput("d", [6, 7], 2), SeqInput("a", [33, 34], 2)])
    return out


def _runner(model, backend=None) -> ModelRunner:
    return ModelRunner(model, CacheConfig(num_blocks=24, block_size=4), backend=backend)


def _run_case(path: str, mode: str, tp: TensorParallel) -> dict:
    if mode == "size_mismatch":
        tp = TensorParallel(tp.rank, 2 * tp.size)
    model, _ = load_model(path, tp=tp)
    info: dict = {}
    backend = None
    if mode == "cuda_ops":
        from specdec.kernels import gemv as gemv_module
        from specdec.kernels.triton_attention import TritonAttention

        model.set_fused_kernels(True)
        model.set_gemv_kernels(True)
        model.set_gemv_silu(True)
        model.set_gemv_norm(True)         # asked for; TP must keep it off
        model.ops.on_cpu = True           # the GEMV kernel on the CPU (interpreter)
        model.ops.norm_max_m = 16         # were the fusion on, every step would take it
        info["ops"] = model.ops.name
        info["fuse_norm"] = model.ops.fuse_norm
        calls = {"gemv": 0}
        original = gemv_module.gemv

        def counting(*a, **kw):
            calls["gemv"] += 1
            return original(*a, **kw)
        gemv_module.gemv = counting
        backend = TritonAttention()
    runner = _runner(model, backend)
    try:
        info["logits"] = _drive(runner)
    finally:
        if mode == "cuda_ops":
            gemv_module.gemv = original
            info["gemv_calls"] = calls["gemv"]
    info["kv"] = runner.kv.data.clone()
    info["kv_heads_local"] = model.num_kv_heads_local
    return info


def _rank_main(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for key, path, mode in jobs:
            try:
                results[key] = _run_case(path, mode, TensorParallel(rank, world))
            except Exception:  # noqa: BLE001 - reported by the case's test
                results[key] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, str(Path(out_dir) / f"rank{rank}.pt"))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_review")
    return {name: _make_checkpoint(root / name, arch, seed=i, **kw)
            for i, (name, (arch, kw)) in enumerate(CHECKPOINTS.items())}


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[str, dict]:
    """One rank, the torch op set: logits and the whole KV cache of the script."""
    ref = {}
    for name, path in checkpoints.items():
        model, _ = load_model(path)
        runner = _runner(model)
        ref[name] = {"logits": _drive(runner), "kv": runner.kv.data.clone()}
    return ref


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory) -> dict[int, list[dict]]:
    """world -> per-rank results {"ckpt/mode": {...}} of every case in CASES[world]."""
    results = {}
    for world, cases in CASES.items():
        out_dir = tmp_path_factory.mktemp(f"tp{world}")
        jobs = [(f"{name}/{mode}", str(checkpoints[name]), mode) for name, mode in cases]
        mp.start_processes(_rank_main, args=(world, _free_port(), jobs, str(out_dir)), nprocs=world,
                           join=True, start_method="spawn")
        results[world] = [torch.load(str(out_dir / f"rank{r}.pt")) for r in range(world)]
    return results


def _case(ranks, world: int, name: str, mode: str) -> list[dict]:
    per_rank = [ranks[world][r][f"{name}/{mode}"] for r in range(world)]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r} of {world}, {name}/{mode}:\n{res['error']}"
    return per_rank


def _assert_logits(got: list[torch.Tensor], want: list[torch.Tensor], atol, rtol, what: str) -> None:
    assert len(got) == len(want) == 16, what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}, item {i}"
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda m: f"{what}, item {i}: {m}")


# --- logits and KV through the runner --------------------------------------------------------------
@pytest.mark.parametrize("world,name", [(w, n) for w, cases in CASES.items() for n, m in cases if m == "torch"])
def test_tp_runner_logits_and_kv_match_one_rank(ranks, reference, checkpoints, world, name):
    cfg = ModelConfig.from_path(checkpoints[name])
    ref = reference[name]
    kvl = cfg.num_kv_heads // world
    for r, res in enumerate(_case(ranks, world, name, "torch")):
        _assert_logits(res["logits"], ref["logits"], ATOL, RTOL, f"{name} rank {r}/{world}")
        # The KV cache of rank r holds exactly KV heads r*kvl .. (r+1)*kvl of the one-rank cache
        # ([layers, 2, blocks, block_size, heads, head_dim]), stale slots after rollback included.
        assert res["kv_heads_local"] == kvl
        assert res["kv"].shape == ref["kv"].shape[:4] + (kvl, cfg.head_dim)
        torch.testing.assert_close(res["kv"], ref["kv"][..., r * kvl:(r + 1) * kvl, :], atol=ATOL, rtol=RTOL)


def test_cuda_path_ops_under_tp_match_one_rank_and_leave_norm_fusion_off(ranks, reference, checkpoints):
    """FusedLayerOps + GemvOps(SiLU epilogue) + TritonAttention on 2 ranks of Qwen2 (no o / MLP bias,
    so at one rank the add + RMSNorm fusion would be on): the fusion, which defers o_proj / down_proj
    past the all-reduce, stays off even when asked for; the GEMV really serves the steps."""
    for r, res in enumerate(_case(ranks, 2, "qwen2_tied", "cuda_ops")):
        assert res["ops"] == "fused+gemv+silu" and res["fuse_norm"] is False, res["ops"]
        assert res["gemv_calls"] > 0
        _assert_logits(res["logits"], reference["qwen2_tied"]["logits"], OPS_ATOL, OPS_RTOL,
                       f"cuda ops rank {r}/2")
        kv = reference["qwen2_tied"]["kv"]
        torch.testing.assert_close(res["kv"], kv[..., r:r + 1, :], atol=OPS_ATOL, rtol=OPS_RTOL)


def test_norm_fusion_is_a_one_rank_op_set(checkpoints):
    """Which op sets TP allows, without a process group: the same checkpoint builds the GEMV norm
    fusion at one rank and not at 2 or 4 (and never with o / MLP biases)."""
    cfg = ModelConfig.from_path(checkpoints["qwen2_tied"])
    names = {}
    for tp in (TensorParallel(), TensorParallel(0, 2), TensorParallel(1, 2)):
        model = build_model(cfg, torch.float32, "meta", tp, fused_kernels=False, gemv_kernels=True)
        model.set_gemv_norm(True)
        model.set_gemv_silu(True)
        names[tp.size, tp.rank] = (model.ops.name, model.ops.fuse_norm)
    assert names == {(1, 0): ("torch+gemv+silu+norm", True), (2, 0): ("torch+gemv+silu", False),
                     (2, 1): ("torch+gemv+silu", False)}
    biased = ModelConfig.from_path(checkpoints["llama_gqa4_bias"])
    model = build_model(biased, torch.float32, "meta", TensorParallel(), gemv_kernels=True)
    assert model.ops.fuse_norm is False


# --- loader slicing ------------------------------------------------------------------------------
def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1, "the checkpoint was meant to be saved in several shards"
    out = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


@pytest.mark.parametrize("name,world", [("llama_gqa4_bias", 2), ("llama_tp4", 4), ("qwen2_tied", 2)])
def test_loader_slices_each_rank_from_the_sharded_checkpoint(checkpoints, name, world):
    """Each rank's fused qkv / gate_up rows and o / down columns are its slice of the HF tensors
    (whole heads, GQA-consistent: rank r's q heads read rank r's KV heads), biases of column-parallel
    layers sliced, of row-parallel ones whole; replicated tensors identical."""
    path = checkpoints[name]
    cfg = ModelConfig.from_path(path)
    hf = _hf_tensors(path)
    d = cfg.head_dim
    hl, kvl, il = cfg.num_heads // world, cfg.num_kv_heads // world, cfg.intermediate_size // world
    assert hl // kvl == cfg.num_heads // cfg.num_kv_heads   # the GQA group is whole on every rank
    for r in range(world):
        model, _ = load_model(path, tp=TensorParallel(r, world))
        params = dict(model.named_parameters())
        rows = lambda t, n: t[r * n:(r + 1) * n]  # noqa: E731
        for i in range(cfg.num_layers):
            p, h = f"layers.{i}.", f"model.layers.{i}."
            q, k, v = (hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv")
            want = torch.cat([rows(q, hl * d), rows(k, kvl * d), rows(v, kvl * d)])
            assert torch.equal(params[p + "self_attn.qkv_proj.weight"], want), (name, r, i, "qkv")
            if cfg.qkv_bias:
                qb, kb, vb = (hf[h + f"self_attn.{x}_proj.bias"] for x in "qkv")
                want = torch.cat([rows(qb, hl * d), rows(kb, kvl * d), rows(vb, kvl * d)])
                assert torch.equal(params[p + "self_attn.qkv_proj.bias"], want), (name, r, i, "qkv bias")
            o = hf[h + "self_attn.o_proj.weight"]
            assert torch.equal(params[p + "self_attn.o_proj.weight"], o[:, r * hl * d:(r + 1) * hl * d])
            if cfg.o_bias:
                assert torch.equal(params[p + "self_attn.o_proj.bias"], hf[h + "self_attn.o_proj.bias"])
            else:
                assert p + "self_attn.o_proj.bias" not in params
            g, u, dn = (hf[h + f"mlp.{x}_proj.weight"] for x in ("gate", "up", "down"))
            assert torch.equal(params[p + "mlp.gate_up_proj.weight"], torch.cat([rows(g, il), rows(u, il)]))
            assert torch.equal(params[p + "mlp.down_proj.weight"], dn[:, r * il:(r + 1) * il])
            if cfg.mlp_bias:
                gb, ub, db = (hf[h + f"mlp.{x}_proj.bias"] for x in ("gate", "up", "down"))
                assert torch.equal(params[p + "mlp.gate_up_proj.bias"], torch.cat([rows(gb, il), rows(ub, il)]))
                assert torch.equal(params[p + "mlp.down_proj.bias"], db)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                assert torch.equal(params[p + norm + ".weight"], hf[h + norm + ".weight"])
        assert torch.equal(params["embed_tokens.weight"], hf["model.embed_tokens.weight"])
        assert torch.equal(params["norm.weight"], hf["model.norm.weight"])
        if cfg.tie_word_embeddings:
            assert model.lm_head is None
        else:
            assert torch.equal(params["lm_head.weight"], hf["lm_head.weight"])


# --- invalid configurations ------------------------------------------------------------------------
def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=64,
                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=12, rms_norm_eps=1e-6, max_position=64)
    return ModelConfig(**{**base, **kw})


NOT_DIVISIBLE = "is not divisible by tensor-parallel size"


@pytest.mark.parametrize("kw,size,field", [
    (dict(num_heads=6, num_kv_heads=2), 4, rf"num_attention_heads \(6\) {NOT_DIVISIBLE} 4"),
    (dict(num_heads=6, num_kv_heads=3), 2, rf"num_key_value_heads \(3\) {NOT_DIVISIBLE} 2"),
    (dict(num_heads=4, num_kv_heads=2), 4, rf"num_key_value_heads \(2\) {NOT_DIVISIBLE} 4"),
    (dict(num_heads=4, num_kv_heads=1), 2, rf"num_key_value_heads \(1\) {NOT_DIVISIBLE} 2"),
    (dict(num_kv_heads=4, intermediate_size=90), 4, rf"intermediate_size \(90\) {NOT_DIVISIBLE} 4"),
    (dict(num_heads=3, num_kv_heads=3, intermediate_size=66), 2, rf"num_attention_heads \(3\) {NOT_DIVISIBLE} 2"),
])
def test_indivisible_shapes_are_refused_naming_the_field(kw, size, field):
    """KV heads are not replicated across ranks: fewer KV heads than ranks is refused, like any
    other shape that does not split into whole heads / equal MLP slices, on every rank."""
    for rank in range(size):
        with pytest.raises(ValueError, match=field):
            build_model(_cfg(**kw), torch.float32, "meta", TensorParallel(rank, size))


def test_loader_refuses_kv_heads_fewer_than_ranks(checkpoints):
    with pytest.raises(ValueError, match=rf"num_key_value_heads \(2\) {NOT_DIVISIBLE} 4"):
        load_model(checkpoints["llama_gqa4_bias"], tp=TensorParallel(3, 4))


@pytest.mark.parametrize("rank,size", [(2, 2), (-1, 2), (0, 0), (0, -2)])
def test_rank_outside_world_is_refused(rank, size):
    with pytest.raises(ValueError, match=f"tensor-parallel rank {rank} outside world size {size}"):
        TensorParallel(rank, size)


def test_tp_forward_without_a_process_group_raises_instead_of_returning_partial_sums(checkpoints):
    assert not dist.is_initialized()
    model, _ = load_model(checkpoints["qwen2_tied"], tp=TensorParallel(0, 2))
    runner = _runner(model)
    runner.add_sequence("a")
    with pytest.raises((ValueError, RuntimeError), match="process group"):
        runner.step([SeqInput("a", [1, 2, 3])])


# --- findings --------------------------------------------------------------------------------------
# Found by this review (fixed: loader._shard checks the whole tensor): the loader sliced a
# column/row-parallel tensor to the rank's share BEFORE comparing shapes (models/loader.py, _place: `tensor[r * size:(r + 1) * size]` for q/k/v and gate/up,
# `tensor[:, r * cols:(r + 1) * cols]` for o/down; _copy then checks only the slice), so a checkpoint
# tensor LARGER than its config says is silently truncated instead of refused with CheckpointError,
# at one rank too (the slice [0:size] of a bigger tensor fits). Realistic trigger: a config.json
# without (or with a wrong) head_dim where head_dim != hidden / heads -- here Mistral with
# head_dim 16, hidden 48, 4 heads: from_hf derives 12, q_proj (64, 48) is cut to (48, 48), o_proj
# (48, 64) to (48, 48), and the model loads and computes garbage; under TP each rank also reads the
# wrong rows. Expected: CheckpointError naming the tensor and its full shape.
def _without_head_dim(path: Path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    del cfg["head_dim"]
    (path / "config.json").write_text(json.dumps(cfg))
    return "model.layers.0.self_attn.q_proj.weight"


def _oversized_k_and_down(path: Path) -> str:
    from safetensors.torch import load_file, save_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    for tensor, shape in (("model.layers.0.self_attn.k_proj.weight", (128, 48)),   # 8 KV heads, not 4
                          ("model.layers.1.mlp.down_proj.weight", (48, 128))):     # I = 128, not 64
        file = path / index["weight_map"][tensor]
        weights = load_file(str(file))
        weights[tensor] = torch.randn(shape)
        save_file(weights, str(file), metadata={"format": "pt"})
    return "model.layers.0.self_attn.k_proj.weight"


@pytest.mark.parametrize("corrupt", [_without_head_dim, _oversized_k_and_down],
                         ids=["no-head-dim", "oversized"])
def test_tensor_larger_than_config_is_refused(tmp_path, checkpoints, corrupt):
    import shutil

    path = Path(shutil.copytree(checkpoints["mistral_mha_headdim"], tmp_path / "ckpt"))
    first_bad = corrupt(path)
    silent = []
    for world in (1, 2, 4):
        for r in range(world):
            try:
                load_model(path, tp=TensorParallel(r, world))
            except CheckpointError as e:
                assert "model.layers." in str(e), e
                continue
            silent.append(f"rank {r}/{world}")
    assert not silent, (f"{first_bad} (and the like) larger than config.json says: loaded without an "
                        f"error, truncated to the rank's slice, at {', '.join(silent)}")


# Found by this review (fixed in TensorParallel.__post_init__): TensorParallel.size was never checked
# against the process group its all-reduce uses
# (models/llama.py, TensorParallel.all_reduce: torch.distributed.all_reduce over the default
# group). Ranks that build TensorParallel(rank, 4) in a gloo group of 2 load a quarter of the
# heads / MLP columns each, all-reduce 2 of the 4 shards and return wrong logits without an error.
# Expected: a clear error naming the tensor-parallel size and the group's world size (at build or
# at the first all-reduce). No in-tree caller builds TensorParallel yet (the engine does not), so
# this is API hardening for the wiring to come.
def test_tp_size_disagreeing_with_the_process_group_is_refused(ranks, reference):
    want = reference["llama_tp4"]["logits"]
    for r in range(2):
        res = ranks[2][r]["llama_tp4/size_mismatch"]
        if "error" in res:
            assert "size" in res["error"], res["error"]
            continue
        diff = max((g - w).abs().max().item() for g, w in zip(res["logits"], want) if w.numel())
        pytest.fail(f"rank {r}: TensorParallel(size=4) in a process group of 2 ran without an error; "
                    f"its logits are off the model's by up to {diff:.3g}")
