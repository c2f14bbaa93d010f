"""bench/timeline.py's bookkeeping: marginal times of overlapping (PDL) kernels sum to the span,
and kernels are labelled by their place in a layer."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks are scripts: `common` is top-level

from timeline import label, marginals, weight_bytes  # noqa: E402

LAYER = ["_add_rmsnorm_kernel", "_gemv_kernel", "_rope_store_kernel", "_paged_attention_kernel",
         "_merge_splits_kernel", "_gemv_kernel", "_add_rmsnorm_kernel", "_gemv_kernel",
         "_silu_mul_kernel", "_gemv_kernel"]


def _kernels(names, starts, durs):
    return [{"name": n, "start": float(s), "end": float(s + d), "dur": float(d)}
            for n, s, d in zip(names, starts, durs)]


def test_marginals_charge_overlap_once_and_sum_to_the_span():
    # b starts inside a (PDL) and ends after it; c ends before b does; d starts after a gap
    ks = _kernels("abcd", [0, 2, 3, 12], [5, 6, 2, 1])
    m = marginals(ks)
    assert m == [5.0, 3.0, 0.0, 5.0]           # d: the gap 8 -> 12 and its own 1 us
    assert sum(m) == pytest.approx(ks[-1]["end"] - ks[0]["start"])


def test_labels_name_projections_by_order_in_each_layer():
    names = ["indexSelectKernel", "elementwise_kernel"] + LAYER * 2 + ["_add_rmsnorm_kernel", "_gemv_kernel",
                                                                       "copy_kernel"]
    labels = label(_kernels(names, range(len(names)), [1] * len(names)), num_layers=2)
    assert labels[:2] == ["pre index", "pre elementwise"]
    layer = labels[2:2 + len(LAYER)]
    assert layer == ["rmsnorm attn", "gemv qkv", "rope", "attention", "merge", "gemv o", "rmsnorm mlp",
                     "gemv gate_up", "silu", "gemv down"]
    assert labels[2 + len(LAYER):2 + 2 * len(LAYER)] == layer
    assert labels[-3:] == ["post rmsnorm", "post gemv", "post copy"]


def test_labels_with_the_norms_folded_into_the_gemvs():
    """The default on the GPU: one norm before the first layer and one before the LM head."""
    fused = ["_gemv_kernel", "_rope_store_kernel", "_paged_attention_kernel", "_merge_splits_kernel",
             "_gemv_kernel", "_gemv_kernel", "_silu_mul_kernel", "_gemv_kernel"]
    names = ["indexSelectKernel", "_add_rmsnorm_kernel"] + fused * 2 + ["_add_rmsnorm_kernel", "_gemv_kernel"]
    labels = label(_kernels(names, range(len(names)), [1] * len(names)), num_layers=2)
    assert labels[:2] == ["pre index", "rmsnorm attn"]       # the embedding's norm feeds layer 0's qkv
    assert labels[2:2 + len(fused)] == ["gemv qkv", "rope", "attention", "merge", "gemv o", "gemv gate_up",
                                        "silu", "gemv down"]
    assert labels[-2:] == ["post rmsnorm", "post gemv"]


def test_labels_fall_back_to_kinds_when_the_layer_pattern_is_not_found():
    names = ["_gemv_kernel", "_add_rmsnorm_kernel", "_gemv_kernel"]
    assert label(_kernels(names, range(3), [1] * 3), num_layers=2) == ["gemv", "rmsnorm", "gemv"]


def test_weight_bytes_of_the_7b_projections():
    w = weight_bytes("llama-7b")
    assert w["gemv qkv"] == 2 * 4096 * 3 * 4096 and w["gemv gate_up"] == 2 * 4096 * 2 * 11008
    assert w["gemv down"] == w["gemv gate_up"] // 2 and w["post gemv"] == 2 * 4096 * 32000


def test_graph_variants_name_a_kernel_set_and_a_servers_graph_bounds():
    from common import graph_variant, variant_arg
    assert graph_variant("default") == ("default", 0, ())
    assert graph_variant("no_norm@4096") == ("no_norm", 4096, ())
    assert graph_variant("default@4096+256+1024") == ("default", 4096, (256, 1024))
    for bad in ("nope", "nope@4096", "default@x", "default@4096+y"):
        with pytest.raises((ValueError, argparse.ArgumentTypeError)):
            variant_arg(bad)
    assert variant_arg("default@4096+256") == "default@4096+256"


def test_kernel_sets_of_the_norm_fusion():
    import torch
    from common import kernel_set
    from specdec.kernels import gemv
    from specdec.models.loader import build_model
    from tests.helpers.op_sets import tiny_config
    model = build_model(tiny_config(), torch.float32, "cpu")
    with kernel_set(model, "norm_m1"):
        assert model.ops.fuse_norm and model.ops.norm_max_m == 1
    with kernel_set(model, "default"):
        assert model.ops.fuse_norm and model.ops.norm_max_m is None   # GemvOps.norm_bound's rule
        assert model.ops.norm_ahead and gemv.consumer_pdl.value is None
    with kernel_set(model, "consumer_pdl"):
        assert gemv.consumer_pdl.value is True and gemv.consumer_launch_pdl(5, 4096)
    assert gemv.consumer_pdl.value is None                           # put back after the block
    with kernel_set(model, "norm_m1_late"):                           # the default before session 24
        assert model.ops.fuse_norm and model.ops.norm_max_m == 1 and not model.ops.norm_ahead
    with kernel_set(model, "no_norm"):
        assert not model.ops.fuse_norm
