"""The GPU serving path: engines on cuda capture CUDA graphs at construction and replay them for
draft and verify steps, ragged batches included (a draft feeding 1 or 2 tokens per sequence,
verifies of mixed k); greedy speculative output through the services (servers on cuda, one GPU and,
with two, the draft on the second) equals greedy plain output."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from coordinator.launch import local_cluster
from specdec.config import EngineConfig
from specdec.engine import DraftEngine, TargetEngine
from specdec.runner import SeqInput
from tests.helpers.graph_runners import eager_and_graphed
from tests.integration.test_services import run_many
from tests.unit.test_engines import PROMPTS, plain_greedy, speculative

pytestmark = pytest.mark.gpu

MODELS = Path(__file__).resolve().parents[2] / "models"
CODE_PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n\n\ndef main(", "class Point:\n",
                "for i in range(10):\n    print(", "    def __init__(self, x, y):\n        self.x = x\n",
                "with open(path) as f:\n", "if __name__ == '__main__':\n", "try:\n    import numpy"]


def test_ragged_batches_replay_graphs_with_eager_logits(tmp_path):
    runners, prompts = eager_and_graphed(tmp_path, query_lens=(1, 2, 5), batch_sizes=(1, 2, 4))
    outs = []
    for runner in runners:
        got = []
        for s in prompts:
            runner.add_sequence(s)
        got += runner.step([SeqInput(s, ids, 1) for s, ids in prompts.items()])       # eager prefill
        for step in range(3):
            # draft-like: 2, 1 and 2 tokens, logits of the last only (bucket (4, 2))
            got += runner.step([SeqInput(0, [step, 3], 1), SeqInput(1, [4]), SeqInput(2, [5, step], 1)])
            # verify-like, mixed k: 5, 3 and 1 tokens, logits of all (bucket (4, 5))
            got += runner.step([SeqInput(0, [1, 2, 3, 4, step], 5), SeqInput(1, [6, 7, step], 3),
                                SeqInput(2, [8], 1)])
            # a sequence that only appends (no logits) beside one that decodes
            got += runner.step([SeqInput(1, [9], 0), SeqInput(2, [step])])
        outs.append(got)
    assert runners[0].graphs is None and runners[1].graphs.replays == 9
    for eager, graphed in zip(*outs):
        assert graphed.shape == eager.shape and torch.isfinite(graphed).all()
        torch.testing.assert_close(graphed, eager, atol=2e-4, rtol=0)
    # padding tokens wrote nothing (slot -1): both caches hold the same K/V everywhere
    torch.testing.assert_close(runners[1].kv.data, runners[0].kv.data, atol=2e-4, rtol=0)


def test_engines_replay_graphs_and_stay_exact():
    def config(name):
        return EngineConfig(model=MODELS / name, device="cuda", dtype=torch.float32, num_blocks=512,
                            max_model_len=512, max_num_draft=8, warmup_batch_sizes=(1, 2, 4))

    draft, target = DraftEngine(config("draft")), TargetEngine(config("target"))
    assert draft.runner.graphs.query_lens == (1, 2)
    assert target.runner.graphs.query_lens == tuple(range(1, 10))
    for engine in (draft, target):
        assert all(t > 0 for t in engine.warm_up().values())
    before = draft.graph_replays, target.graph_replays
    reference = plain_greedy(target, PROMPTS, 24)
    got, drafted, accepted = speculative(draft, target, PROMPTS, [4, 2, 0, 5], 24)
    assert got == reference
    assert 0 < accepted <= drafted
    assert draft.graph_replays > before[0] and target.graph_replays > before[1]
    assert draft.num_free_blocks == target.num_free_blocks == 512


def _graph_log(log_path: Path) -> tuple[int, int]:
    """(graphs captured, warm-up forwards that replayed one) from a server log."""
    text = log_path.read_text()
    captured = re.findall(r"captured (\d+) CUDA graphs", text)
    replayed = re.findall(r"warm-up: (\d+) forwards replayed CUDA graphs", text)
    return (int(captured[-1]) if captured else 0, int(replayed[-1]) if replayed else 0)


@pytest.mark.parametrize("draft_device", ["cuda:0", "cuda:1"])
def test_services_on_cuda_greedy_speculative_equals_plain(tmp_path, draft_device):
    if torch.cuda.device_count() < int(draft_device[-1]) + 1:
        pytest.skip("needs a second GPU")
    # fp32: bf16 may flip near-ties between a k+1 verify and 1-token steps
    args = ["--dtype", "float32", "--kv-memory", "1GiB", "--max-model-len", "512", "--max-num-draft", "8",
            "--warmup-batch-sizes", "1,2,4", "--graph-batch-sizes", "1,2,4,8"]
    with local_cluster(MODELS / "target", MODELS / "draft", device="cuda:0", draft_device=draft_device,
                       server_args=args, coordinator_args=["--max-batch-size", "8", "--num-draft", "4"],
                       log_dir=tmp_path, startup_timeout=300) as cluster:
        params = dict(max_new_tokens=48, ignore_eos=True)
        plain = run_many(cluster.coordinator, CODE_PROMPTS, 1, speculate=False, **params)
        for concurrency in (1, 8):
            spec = run_many(cluster.coordinator, CODE_PROMPTS, concurrency, num_draft=4, **params)
            assert spec == plain
        assert all(len(o) == 48 for o in plain)
        for role in ("target", "draft"):
            captured, replayed = _graph_log(tmp_path / f"{role}_server.log")
            assert captured > 0 and replayed > 0, role
        # --pipeline auto: pipelined speculation with the draft on a GPU of its own, not on a shared one
        decided = re.findall(r"pipelined speculation (on|off)", (tmp_path / "coordinator.log").read_text())
        assert decided and decided[-1] == ("on" if draft_device == "cuda:1" else "off")
