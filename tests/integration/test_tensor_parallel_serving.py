"""Tensor-parallel model servers (serving/tensor_parallel.py) on the CPU: two gloo ranks per server.

- engine level: a two-rank TargetEngine verifies what a one-rank engine verifies (same acceptances
  and next tokens, step after step, greedy and seeded sampling), frees every block, and stops its
  other rank on close;
- a rank whose bookkeeping differs from rank 0's leaves the group (status 3) instead of entering
  a forward the others would wait in, and rank 0 is told; so does a rank whose mirrored call
  raises (status 4);
- through the services: a target and a draft of two ranks each serve greedy speculative requests
  that equal one-rank plain decoding token for token, Info says 2 ranks, all KV is freed, and
  stopping the servers leaves none of their ranks behind.
"""
from __future__ import annotations

import time

import pytest

from specdec.config import EngineConfig
from specdec.engine import TargetEngine, VerifySeqInput
from specdec.engine.types import SamplingParams
from specdec.serving import tensor_parallel
from tests.helpers.cluster import all_free, server_info, tiny_cluster, wait_kv_free
from tests.helpers.procs import alive, proc_children
from tests.helpers.tiny_models import make_pair
from tests.integration.test_services import run_many

PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 4], [200, 201, 202, 203, 204, 205, 206, 207, 208, 1]]


def engine_config(path, **kw) -> EngineConfig:
    return EngineConfig(model=path, block_size=4, num_blocks=48, warmup_batch_sizes=(1, 2), **kw)


def greedy_continuations(engine, prompts, n: int) -> list[list[int]]:
    """Plain greedy decoding of each prompt for n tokens on a one-rank engine (the reference)."""
    out = []
    for i, prompt in enumerate(prompts):
        seq = 1000 + i
        token = engine.verify([VerifySeqInput(seq, list(prompt), first=True)]).outputs[0].next_token
        tokens = [token]
        while len(tokens) < n:
            tokens.append(engine.verify([VerifySeqInput(seq, [tokens[-1]])]).outputs[0].next_token)
        engine.release([seq])
        out.append(tokens)
    return out


SAMPLED = SamplingParams(temperature=0.8, seed=11)


def run_script(engine, reference: list[list[int]]) -> list[list[tuple]]:
    """A speculative run over all prompts at once, as (seq, accepted, next token, error) per step:
    drafts that are the reference with one wrong token at varying places (some steps fully
    accepted), a seeded sampled sequence beside them, and a release of every sequence at the end."""
    last: dict[int, int] = {}
    emitted: dict[int, int] = {}
    outputs = []

    def step(inputs, release=()):
        result = engine.verify(inputs, list(release))
        outputs.append([(o.seq_id, o.accepted, o.next_token, o.error) for o in result.outputs])
        for o in result.outputs:
            emitted[o.seq_id] = emitted.get(o.seq_id, 0) + o.accepted + 1
            last[o.seq_id] = o.next_token

    step([VerifySeqInput(i, list(p), first=True) for i, p in enumerate(PROMPTS)]
         + [VerifySeqInput(9, [3, 1, 4, 1, 5], first=True, sampling=SAMPLED)])
    for n in range(4):
        inputs = []
        for i, ref in enumerate(reference):
            drafts = list(ref[emitted[i]:emitted[i] + 3])
            if n % 2 == i % 2 and drafts:
                k = min(n % 3, len(drafts) - 1)
                drafts[k] = (drafts[k] + 7) % 320                        # one wrong draft
            inputs.append(VerifySeqInput(i, [last[i]], drafts))
        step(inputs + [VerifySeqInput(9, [last[9]], sampling=SAMPLED)])
    step([], release=[0, 1, 2, 9])
    return outputs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("tp"))


def test_two_rank_target_engine_verifies_as_one_rank(pair):
    target_path, _ = pair
    one = TargetEngine(engine_config(target_path))
    reference = greedy_continuations(one, PROMPTS, 16)
    lost, failed = [], []
    tp = tensor_parallel.start(TargetEngine, engine_config(target_path, tensor_parallel_size=2),
                               on_rank_lost=lambda rank, status: lost.append((rank, status)),
                               on_call_failed=lambda name, error: failed.append(name))
    try:
        assert tp.warm_up()  # mirrored: rank 1 warms up too, or its forwards would not meet rank 0's
        info = tp.info()
        assert info.tensor_parallel_size == 2 and tp.engine.model_config.num_heads == 4
        assert tp.engine.runner.model.layers[0].self_attn.num_heads == 2   # each rank: half the heads
        want, got = run_script(one, reference), run_script(tp, reference)
        assert got == want
        accepted = [a for step in got[1:-1] for (_, a, _, _) in step]
        assert max(accepted) == 3 and min(accepted) == 0   # full and empty acceptances both ran
        assert tp.num_free_blocks == info.kv_blocks_total and tp.num_sequences() == 0
    finally:
        tp.close()
    assert not lost and not failed
    assert all(p.exitcode == 0 for p in tp._workers)


def test_a_rank_that_diverges_leaves_the_group_and_rank_zero_is_told(pair):
    target_path, _ = pair
    lost, failed = [], []
    tp = tensor_parallel.start(TargetEngine, engine_config(target_path, tensor_parallel_size=2),
                               on_rank_lost=lambda rank, status: lost.append((rank, status)),
                               on_call_failed=lambda name, error: failed.append(name))
    try:
        tp.verify([VerifySeqInput(1, PROMPTS[0], first=True)])
        tp.engine.release([1])                     # rank 0 only: the ranks now disagree
        with pytest.raises(Exception):             # rank 1 is gone: the forward's all-reduce fails
            tp.verify([VerifySeqInput(2, PROMPTS[1], first=True)])
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lost == [(1, 3)]
        assert failed == ["verify"]   # a server would exit here: the call ran on rank 0 only
    finally:
        tp.close(timeout=5)


def test_a_mirrored_call_that_raises_on_another_rank_alone_ends_the_group(pair):
    """A failure of one GPU's rank only (here: a call only rank 1 receives, which raises there) may
    leave rank 0 in an all-reduce for the group timeout: the rank exits (status 4) and rank 0's
    watch is told, where it used to log the error and wait for the next call."""
    target_path, _ = pair
    lost = []
    tp = tensor_parallel.start(TargetEngine, engine_config(target_path, tensor_parallel_size=2),
                               on_rank_lost=lambda rank, status: lost.append((rank, status)),
                               on_call_failed=lambda name, error: None)
    try:
        tp.verify([VerifySeqInput(1, PROMPTS[0], first=True)])
        call = ("release", (None,), {}, tensor_parallel.bookkeeping(tp.engine))   # iterating None raises
        tp._senders[0].send_bytes(tensor_parallel.dumps_call(call))
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lost == [(1, 4)]
    finally:
        tp.close(timeout=5)


def test_two_rank_servers_serve_speculation_equal_to_one_rank_plain_decoding(tmp_path, pair):
    target_path, _ = pair
    reference = greedy_continuations(TargetEngine(engine_config(target_path)), PROMPTS, 12)
    with tiny_cluster(tmp_path, server_args=["--tensor-parallel-size", "2", "--torch-threads", "2"],
                      coordinator_args=["--num-draft", "3", "--max-batch-size", "4"]) as cluster:
        for role, address in (("target", cluster.target), ("draft", cluster.draft)):
            assert server_info(address, role).tensor_parallel_size == 2
            # rank 1 runs with the server's --torch-threads (launch sets OMP_NUM_THREADS=1 on the CPU)
            assert "rank 1 of 2 on cpu (2 torch threads)" in cluster.procs[f"{role}_server"].log_path.read_text()
        ranks = {cluster.procs[r].popen.pid: set(proc_children(cluster.procs[r].popen.pid)) for r in ("target_server", "draft_server")}
        assert all(len(c) >= 1 for c in ranks.values())   # rank 1 of each server (and spawn's tracker)
        spec = run_many(cluster.coordinator, PROMPTS, 3, max_new_tokens=12, num_draft=3, ignore_eos=True)
        plain = run_many(cluster.coordinator, PROMPTS, 3, max_new_tokens=12, speculate=False, ignore_eos=True)
        assert [list(s) for s in spec] == [list(p) for p in plain] == reference
        # Sampled speculation: the draft's distributions travel to rank 1 with the Verify call.
        sampled = [run_many(cluster.coordinator, PROMPTS, 3, max_new_tokens=12, num_draft=3, ignore_eos=True,
                            temperature=0.8, seed=5) for _ in range(2)]
        assert sampled[0] == sampled[1] and all(len(o) == 12 for o in sampled[0])
        assert all_free(wait_kv_free(cluster))
    deadline = time.monotonic() + 15
    while any(alive(c) for cs in ranks.values() for c in cs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [c for cs in ranks.values() for c in cs if alive(c)]


def test_mirrored_calls_carry_tensors_by_value():
    """dumps_call pickles tensors as their bytes (no shared-memory handles to pass per tensor):
    every dtype and shape the engines' inputs hold comes back equal, views and empties included."""
    import pickle

    import torch
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = [base.half(), base.bfloat16(), base.long(), base > 5, base.t(), base[1:, ::2],
               torch.tensor(3.5), torch.empty(0, 7, dtype=torch.float16)]
    call = ("verify", ([VerifySeqInput(1, [1, 2], [3], draft_probs=t) for t in tensors],), {}, (7, ()))
    data = tensor_parallel.dumps_call(call)
    back = pickle.loads(data)
    assert back[0] == "verify" and back[3] == (7, ())
    for got, want in zip((s.draft_probs for s in back[1][0]), tensors):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert b"torch.multiprocessing" not in data and b"rebuild_storage_fd" not in data
