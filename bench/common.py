"""What every benchmark shares: environment record, measured copy bandwidth, model shapes, JSON output."""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts: make `specdec` importable from any working directory

import torch  # noqa: E402

from specdec.config import ModelConfig  # noqa: E402

# Shapes of public checkpoints (random weights: c and tokens/s depend on shapes, not values).
SHAPES = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),
    "llama-68m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                      num_key_value_heads=12, vocab_size=32000),
    "llama-160m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=12, vocab_size=32000),
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000),
}


# The layer kernel sets a benchmark compares in one run; "default" is what the servers run on an H200.
KERNEL_SETS = {
    "default": dict(fused=True, gemv=True, pdl=True, norm=True),
    "silu_gemv": dict(fused=True, gemv=True, pdl=True, norm=True, silu=True),  # SiLU * up in the gate_up GEMV
    "no_norm": dict(fused=True, gemv=True, pdl=True),  # add + RMSNorm as kernels of their own
    # the norm fusion at 1-token steps only (GemvOps.norm_max_m; the default takes steps of up to
    # 16 tokens; before session 27 wide models took 1, the 768-wide drafts 16)
    "norm_m1": dict(fused=True, gemv=True, pdl=True, norm=True, norm_max_m=1),
    # the norm fusion at steps of up to 64 rows (the b 8 verify's 40; the 7B's gate_up stays on the
    # BLAS above 16 rows, so there only the qkv consumer fuses): timed on the wide tiles in session
    # 31 (4.99 ms against 4.94), not yet on the narrow 64-row tiles that now serve those steps
    "norm_m64": dict(fused=True, gemv=True, pdl=True, norm=True, norm_max_m=64),
    # every norm consumer on PDL (gemv.consumer_pdl; the default launches consumers of 2..16 rows on
    # streams wider than gemv.NARROW_NORM_N without it): what the fusion lost on wide models before
    "consumer_pdl": dict(fused=True, gemv=True, pdl=True, norm=True, consumer_pdl=True),
    # the consumers launched without PDL do not let the next kernel launch before they end
    # (gemv.consumer_trigger; the default triggers it once their K loop is done)
    "consumer_no_trigger": dict(fused=True, gemv=True, pdl=True, norm=True, consumer_trigger=False),
    # the norm fusion with the consumer multiplying x by the norm weight on its K steps instead of
    # the producer writing the weighted stream (GemvOps.norm_ahead); m1: at 1-token steps only,
    # whatever the width (both: the default before session 24)
    "norm_late": dict(fused=True, gemv=True, pdl=True, norm=True, norm_ahead=False),
    "norm_m1_late": dict(fused=True, gemv=True, pdl=True, norm=True, norm_max_m=1, norm_ahead=False),
    # split-K GEMVs (the small drafts' o / down projections, the 7B's down at 2..16 rows) summed by
    # a second kernel instead of each tile's last program (gemv.SPLIT_REDUCE_MODES)
    "splitk_separate": dict(fused=True, gemv=True, pdl=True, norm=True, split_reduce="separate"),
    # the GEMV for steps of up to 16 rows only, the BLAS above (the default before session 31; the
    # default takes up to 64: verification at b 8 with γ = 4 is 40 rows, decode at b 32 is 32)
    "gemv_m16": dict(fused=True, gemv=True, pdl=True, norm=True, gemv_max_m=16),
    # up to 64 rows at any width (the default leaves projections wider than gemv.WIDE_MAX_N above
    # 16 rows, the 7B's gate_up and LM head, to the BLAS)
    "gemv_m64_all_n": dict(fused=True, gemv=True, pdl=True, norm=True, wide_max_n=None),
    # the attention's keys in an unmasked loop and a masked one (triton_attention.single_key_loop;
    # the default runs one masked loop: one software pipeline)
    "two_key_loops": dict(fused=True, gemv=True, pdl=True, norm=True, single_key_loop=False),
    # split plans without the small split tile (32 keys, 2 warps; triton_attention.small_split_tiles)
    "no_small_split": dict(fused=True, gemv=True, pdl=True, norm=True, small_split=False),
    # the split merge at 4 warps whatever its size (the default before session 26; triton_attention.merge_warps)
    "merge_w4": dict(fused=True, gemv=True, pdl=True, norm=True, merge_warps=4),
    # torch's products (> 16 rows: the b 8 verify, the b 32 decode, prompts) on cuBLAS, with its
    # split-K reduce kernel at 32-40 rows (kernels/blas.py; the default before session 29: cuBLASLt)
    "blas_cublas": dict(fused=True, gemv=True, pdl=True, norm=True, blas="cublas"),
    "no_pdl": dict(fused=True, gemv=True, pdl=False, norm=True),  # what programmatic dependent launch buys
    "cublas": dict(fused=True, gemv=False, pdl=True, blas="cublas"),  # what the GEMV buys (and its norm fusion)
    "torch_ops": dict(fused=False, gemv=False, pdl=False),  # no Triton at all
}


@contextlib.contextmanager
def kernel_set(model, name: str):
    """Switch `model` to a kernel set; capture its CUDA graphs inside the block (a graph keeps the
    kernels, and the launch attributes, it was captured with)."""
    from specdec.kernels import blas, gemv, pdl, triton_attention
    chosen = KERNEL_SETS[name]
    model.set_fused_kernels(chosen["fused"])
    model.set_gemv_kernels(chosen["gemv"])
    model.set_gemv_silu(chosen.get("silu", False))
    model.set_gemv_norm(chosen.get("norm", False))
    if "norm_max_m" in chosen and hasattr(model.ops, "norm_max_m"):
        model.ops.norm_max_m = chosen["norm_max_m"]
    if "norm_ahead" in chosen and hasattr(model.ops, "norm_ahead"):
        model.ops.norm_ahead = chosen["norm_ahead"]
    reduce = chosen.get("split_reduce", "inline")
    if reduce == "inline" and torch.cuda.is_available():
        gemv._counters(torch.device("cuda", torch.cuda.current_device()))   # zeroed before any capture
    with (pdl.forced(chosen["pdl"]), gemv.split_reduce_forced(reduce),
          gemv.serve_max_m_forced(chosen.get("gemv_max_m", gemv.SERVE_MAX_M)),
          gemv.wide_max_n.forced(chosen.get("wide_max_n", gemv.WIDE_MAX_N)),
          triton_attention.merge_warps.forced(chosen.get("merge_warps", 0)),
          triton_attention.small_split_tiles.forced(chosen.get("small_split", True)),
          triton_attention.single_key_loop.forced(chosen.get("single_key_loop", True)),
          gemv.consumer_pdl.forced(chosen.get("consumer_pdl")),
          gemv.consumer_trigger.forced(chosen.get("consumer_trigger", True)),
          blas.forced(chosen.get("blas", blas.DEFAULT)) if torch.cuda.is_available() else contextlib.nullcontext()):
        yield


def graph_variant(spec: str) -> tuple[str, int, tuple[int, ...]]:
    """A kernel set with a server's graph bounds: "NAME[@MAX_MODEL_LEN[+C...]]" -> (kernel set,
    max_model_len or 0 for the benchmark's own, the shorter context bounds). "default@4096+256":
    the default kernels, graphs for 4096-token sequences and a set for contexts of up to 256
    (--max-model-len 4096 --graph-context-lens 256 on a server; cuda_graphs.GraphSets)."""
    name, _, bounds = spec.partition("@")
    if name not in KERNEL_SETS:
        raise ValueError(f"unknown kernel set {name!r} in {spec!r}; known: {', '.join(KERNEL_SETS)}")
    if not bounds:
        return name, 0, ()
    mml, *short = bounds.split("+")
    return name, int(mml), tuple(int(c) for c in short)


def variant_arg(spec: str) -> str:
    """argparse type of a graph_variant spec."""
    import argparse
    try:
        graph_variant(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def graphed_decode(model, batch: int, context: int = 128, block: int = 16, max_model_len: int = 0,
                   context_lens: tuple[int, ...] = (), query_len: int = 1):
    """(runner, staged batch): `batch` sequences of `context` tokens prefilled, a (batch, query_len)
    CUDA graph captured for sequences of up to max_model_len tokens (default context + 64; a server's
    is its --max-model-len, which sets the attention's KV splits; context_lens: its
    --graph-context-lens), and one step staged into it: a decode step, or with query_len > 1 a
    verification of query_len tokens a sequence (logits for each); runner.forward(staged) or
    runner.graphs.staged_graph(staged).graph.replay() then replays that step (cost_coefficient.py,
    timeline.py)."""
    from specdec.config import CacheConfig
    from specdec.runner import ModelRunner, SeqInput
    blocks_per_seq = -(-(context + query_len + 8) // block)
    runner = ModelRunner(model, CacheConfig(batch * blocks_per_seq + 1, block, torch.bfloat16))
    runner.enable_cuda_graphs(max_model_len=max_model_len or context + 64, query_lens=(query_len,),
                              batch_sizes=(batch,), context_lens=context_lens)
    for s in range(batch):
        runner.add_sequence(s)
    runner.step([SeqInput(s, list(range(1, context))) for s in range(batch)])
    return runner, runner.prepare([SeqInput(s, [7] * query_len, query_len) for s in range(batch)])


def hf_config(shape: str, max_position: int = 4096) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
            "max_position_embeddings": max_position, "rope_theta": 10000.0, "tie_word_embeddings": False,
            **SHAPES[shape]}


def model_config(shape: str, max_position: int = 4096) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(shape, max_position))


def environment() -> dict:
    import transformers
    import triton
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "host": platform.node()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sms=p.multi_processor_count, gpus=torch.cuda.device_count(),
                   memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        env["device"] = f"cpu: {cpu_model()} ({os.cpu_count()} cores)"
    return env


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, where platform.processor() is often empty)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


FLUSH_BYTES = 512 * 2**20   # what cold_ms reads (or zeroes) between calls: ten times an H200's L2


@functools.lru_cache(maxsize=1)
def _flush_buffer() -> torch.Tensor:
    return torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")


def graph_of(fn, warmup: int = 0):
    """A replay callable of a CUDA graph that captured one fn() call; warmup calls (on a side
    stream) first where fn has not run yet (compiles, allocator pools)."""
    if warmup:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def cold_ms(fn, warmup: float = 10.0, rep: float = 50.0, flush: str = "read") -> float:
    """Median device milliseconds of fn() (CUDA events around each call), the L2 emptied before
    each call; warmup and rep are milliseconds of calls, as in triton.testing.do_bench.

    flush="read" empties the L2 by reading FLUSH_BYTES: the lines left behind are clean, as after
    the weight reads that come before attention or a GEMV in a forward. flush="write" is what
    do_bench does (it zeroes a 256 MB buffer): that leaves the L2 full of dirty lines, and the timed
    call pays for writing them back to HBM while it reads. `flush_cost_us` measures the difference."""
    buf = _flush_buffer()
    evict = {"read": buf.sum, "write": buf.zero_}[flush]
    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        evict()
        fn()
    t1.record()
    torch.cuda.synchronize()
    estimate = t0.elapsed_time(t1) / 5
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    n = max(1, int(rep / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        evict()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def flush_cost_us(nbytes: int = 64 * 2**20) -> dict:
    """Microseconds of one read of nbytes (a sum) after each flush: what the write flush's dirty
    lines add to a call that only reads, measured beside the read flush."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    out = {f: 1e3 * cold_ms(x.sum, flush=f) for f in ("read", "write")}
    out["read_bytes"] = nbytes
    return out


def wall_ms(fn, n: int = 200) -> float:
    """Median host ms of fn() followed by a synchronize (after 10 warm-up calls)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Bytes/s of a large device-to-device copy, read + write counted: the HBM ceiling we use."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cold_ms(lambda: dst.copy_(src), warmup=25, rep=200)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def write_result(name: str, result: dict) -> Path:
    """bench/results/<name>.json, and a copy under $OUT when the device tool set it."""
    text = json.dumps(result, indent=1, default=str)
    path = ROOT / "bench" / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{name}.json").write_text(text)
    return path


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec)."""
    head = " | ".join(h for _, h, _ in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" | ".join(format(r.get(k), f) if r.get(k) is not None else "-" for k, _, f in columns))
    return "\n".join(lines)


@contextlib.contextmanager
def baseline_tree(baseline: str):
    """Yields (folder, commit): another commit's packages with this checkout's bench scripts copied
    in, so a benchmark can run the same measurement over that code (an A/B across commits).
    `baseline` is a commit (checked out as a temporary git worktree, removed afterwards) or a
    folder holding a commit's coordinator, protos, specdec, draft_server and target_server and a
    COMMIT file naming it (the device has no git history: `git archive C coordinator protos
    specdec draft_server target_server | tar -x -C DIR`, carried)."""
    import shutil
    import subprocess
    import tempfile
    given = Path(baseline).is_dir()
    if given:
        tree = Path(baseline).resolve()
        commit = (tree / "COMMIT").read_text().strip() if (tree / "COMMIT").exists() else baseline
    else:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", baseline], capture_output=True,
                                text=True, check=True).stdout.strip()
        tree = Path(tempfile.mkdtemp(prefix="specdec-base-")) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), baseline], check=True)
    try:
        bench = tree / "bench"
        bench.mkdir(exist_ok=True)
        for script in (ROOT / "bench").glob("*.py"):  # the packages stay the baseline's
            (bench / script.name).write_bytes(script.read_bytes())
        shutil.copytree(ROOT / "bench" / "data", bench / "data", dirs_exist_ok=True)
        models = tree / "models"
        if models.is_symlink() and not models.exists():  # a link made on another machine (carried)
            models.unlink()
        if not models.exists():
            models.symlink_to(ROOT / "models")
        yield tree, commit
    finally:
        if not given:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
