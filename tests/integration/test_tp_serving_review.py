"""Adversarial review of tensor-parallel serving (serving/tensor_parallel.py): two-rank servers on
the CPU (gloo ranks), driven over raw gRPC, against a one-rank server of the same model.

- the ranks stay in step: bad and good sequences mixed in one step (ids outside the vocabulary,
  unknown and duplicate ids, too many drafts, NaN draft weights, undecodable bytes, lengths over
  max_model_len, releases of unknown ids), KV exhaustion with roll-backs and restarts, draft
  steps with keep / extend, unseeded sampled Verify and Propose steps (each rank must not draw its
  own seed), and several streams at once: every answer and the KV gauges equal the one-rank
  server's (target and draft), and a probe step after it (whose mirrored call carries rank 0's
  bookkeeping: a diverged rank exits 3, the server 1) still equals it;
- lifetime: SIGKILL of rank 1 ends the server (status 1) and its open stream; SIGKILL of the
  serving process takes rank 1 down, also when it comes right after the spawn; a rank lost while
  the server loads ends the server instead of a 10-minute wait in the rendezvous; SIGTERM while it
  loads, and SIGINT / SIGTERM sent to the whole process group (Ctrl-C in a terminal), drain and
  exit 0; a size the heads do not divide is a start-up error (status 2); no rank and no
  rendezvous folder is left behind.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from coordinator.launch import spawn_server, start_healthy, stop_all
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests.helpers.cluster import server_info
from tests.helpers.procs import alive, proc_children
from tests.helpers.streams import StepStream
from tests.helpers.tiny_models import make_pair

V = 320                                   # make_pair's vocabulary
BLOCK, NUM_BLOCKS, MAX_LEN, MAX_DRAFT = 8, 24, 128, 6
SERVER_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK), "--max-model-len", str(MAX_LEN),
               "--max-num-draft", str(MAX_DRAFT), "--warmup-batch-sizes", "1", "--grace", "5"]
TP2 = ["--tensor-parallel-size", "2"]
STEP_TIMEOUT = 20.0
PROMPT = [5, 17, 42, 99, 7, 3]


def ids(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def unids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def sampled(seed: int | None = None) -> pb.SamplingParams:
    s = pb.SamplingParams(temperature=1.0)
    if seed is not None:
        s.seed = seed
    return s


def probs(drafts: list[int], nan: bool = False) -> pb.Probs:
    """Dense fp16 rows, nearly uniform with twice the weight on each drafted token (so that about
    half the drafts are accepted by a near-uniform tiny target); NaN everywhere with `nan`."""
    w = np.full((len(drafts), V), 1.0, dtype=np.float32)
    w[np.arange(len(drafts)), drafts] = 2.0
    w /= w.sum(1, keepdims=True)
    if nan:
        w[:] = np.nan
    return pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=len(drafts), vocab_size=V,
                    values=w.astype("<f2").tobytes())


# --- processes ---------------------------------------------------------------------------------
def rank_pids(pid: int) -> list[int]:
    """The spawned ranks of a server (not spawn's resource tracker)."""
    return [c for c, cmd in proc_children(pid).items() if "spawn_main" in cmd]


def maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


def wait_for(cond, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def kill_all(pids) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def tp_server(root: Path, model: Path, role: str = "target", args=(), healthy: bool = True):
    """A server of two ranks (own log folder, own TMPDIR for the rendezvous folder); on exit
    whatever is left of it and its ranks is killed."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(root / "tmp"))
        proc = spawn_server(role, model, root, args=[*SERVER_ARGS, *TP2, *args])
    seen: set[int] = set()
    proc.seen_ranks = seen
    try:
        if healthy:
            start_healthy(proc, 120)
            seen.update(rank_pids(proc.popen.pid))
            assert len(seen) == 1, f"expected one spawned rank, got {seen}"
        yield proc
    finally:
        if proc.popen.poll() is None:
            seen.update(rank_pids(proc.popen.pid))
        stop_all([proc], timeout=5)
        kill_all(p for p in seen if alive(p))


def rendezvous_left(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tmp").glob("specdec-tp-*"))


class Stream(StepStream):
    step_timeout = STEP_TIMEOUT

    def close(self) -> None:
        self._requests.put(None)
        with contextlib.suppress(grpc.RpcError):
            self.call.cancel()


def verify_view(response) -> list[tuple]:
    return [(r.seq_id, r.accepted, r.next_token, r.error.code, r.error.message) for r in response.results]


def propose_view(response) -> list[tuple]:
    return [(r.seq_id, unids(r.tokens), r.probs.values, r.error.code, r.error.message) for r in response.results]


# --- the servers of most tests -----------------------------------------------------------------
class Servers:
    def __init__(self, procs: dict, channels: dict):
        self.procs, self.channels = procs, channels
        self.tp = pb_grpc.TargetStub(channels["tp"])
        self.one = pb_grpc.TargetStub(channels["one"])
        self.draft = pb_grpc.DraftStub(channels["draft"])
        self.draft_one = pb_grpc.DraftStub(channels["draft_one"])

    def info(self, name: str) -> pb.ModelInfo:
        return server_info(self.procs[name].address, "draft" if name.startswith("draft") else "target")

    def ranks_alive(self, settle: bool = True) -> None:
        """Every two-rank server and its rank 1 still run, after longer than the watch interval
        (a rank that left the group has ended its server by then) with `settle`; a probe after it
        needs none (the probe's forward fails without rank 1)."""
        if settle:
            time.sleep(1.2)
        for name in ("tp", "draft"):
            proc = self.procs[name]
            assert proc.popen.poll() is None, f"{name} server died:\n{proc.log_tail(30)}"
            assert all(alive(p) for p in proc.seen_ranks), f"{name}: rank 1 died:\n{proc.log_tail(30)}"

    def probe(self, seq_id: int = 190) -> None:
        """A fresh greedy sequence with drafts on both targets, answered alike (the mirrored call
        carries rank 0's bookkeeping: a rank that disagrees exits instead), then released."""
        views = []
        for stub in (self.tp, self.one):
            s = Stream(stub.Verify)
            try:
                r1 = s.step(pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=seq_id, new_tokens=ids(PROMPT),
                                                                        first=True)]))
                t = r1.results[0].next_token
                r2 = s.step(pb.VerifyRequest(step=2, seqs=[pb.VerifySeq(seq_id=seq_id, new_tokens=ids([t]),
                                                                        draft_tokens=ids([t, 3, t]))]))
                r3 = s.step(pb.VerifyRequest(step=3, release=[seq_id]))
                views.append(verify_view(r1) + verify_view(r2) + verify_view(r3))
            finally:
                s.close()
        assert views[0] == views[1]
        assert views[0][0][3] == 0 and views[0][1][3] == 0, views[0]

    def same_kv(self) -> None:
        a, b = self.info("tp"), self.info("one")
        assert (a.kv_blocks_free, a.num_sequences) == (b.kv_blocks_free, b.num_sequences)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("tp_review_models"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, pair):
    target, draft = pair
    root = tmp_path_factory.mktemp("tp_review")
    with contextlib.ExitStack() as stack:
        one_root = root / "one"
        one_root.mkdir()
        one = spawn_server("target", target, one_root, args=SERVER_ARGS)
        draft_one = spawn_server("draft", draft, one_root, args=SERVER_ARGS)
        stack.callback(stop_all, [one, draft_one], 5)
        tp = stack.enter_context(tp_server(root / "tp", target, healthy=False))
        dr = stack.enter_context(tp_server(root / "draft", draft, role="draft", healthy=False))
        procs = {"tp": tp, "one": one, "draft": dr, "draft_one": draft_one}
        for proc in procs.values():
            start_healthy(proc, 120)
        for name in ("tp", "draft"):
            procs[name].seen_ranks.update(rank_pids(procs[name].popen.pid))
            assert len(procs[name].seen_ranks) == 1
        channels = {n: stack.enter_context(grpc.insecure_channel(p.address)) for n, p in procs.items()}
        yield Servers(procs, channels)
        alive_before = {n: procs[n].popen.poll() is None for n in ("tp", "draft")}
        stop_all([procs["tp"], procs["draft"]], timeout=15)
        for name in ("tp", "draft"):
            if alive_before[name]:
                assert procs[name].popen.returncode == 0, procs[name].log_tail(30)
            assert wait_for(lambda: not any(alive(p) for p in procs[name].seen_ranks), 5), f"{name}: rank left"
            assert not rendezvous_left(root / name), f"{name}: rendezvous folder left"


USED_IDS = list(range(0, 200))


@pytest.fixture(autouse=True)
def _release_after(request):
    yield
    if "servers" in request.fixturenames:
        s = request.getfixturevalue("servers")
        for stub in (s.tp, s.one, s.draft, s.draft_one):
            with contextlib.suppress(grpc.RpcError):
                stub.Release(pb.ReleaseRequest(seq_ids=USED_IDS), timeout=10)


def run_verify_script(stub, script) -> list:
    """script(step) drives one stream; returns what it recorded."""
    stream = Stream(stub.Verify)
    try:
        return script(stream.step)
    finally:
        stream.close()


def greedy_reference(stub, prompt: list[int], n: int, seq_id: int = 199) -> list[int]:
    def script(step):
        out = [step(pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=seq_id, new_tokens=ids(prompt),
                                                                first=True)])).results[0].next_token]
        while len(out) < n:
            out.append(step(pb.VerifyRequest(step=len(out) + 1, seqs=[pb.VerifySeq(
                seq_id=seq_id, new_tokens=ids([out[-1]]))])).results[0].next_token)
        step(pb.VerifyRequest(step=n + 1, release=[seq_id]))
        return out
    return run_verify_script(stub, script)


# --- the ranks stay in step ---------------------------------------------------------------------
def test_bad_and_good_sequences_in_one_step_answer_as_one_rank(servers):
    """Each step mixes served sequences (greedy with drafts from the reference, one wrong; a
    seeded sampled one) with sequences that fail alone, before and after them, and releases of
    unknown ids: the two-rank server answers every step as the one-rank server does, holds the
    same KV, and its ranks are still in step."""
    reference = greedy_reference(servers.one, PROMPT, 24)
    bad = [
        pb.VerifySeq(seq_id=2, new_tokens=ids([5, V]), first=True),                      # id = vocab
        pb.VerifySeq(seq_id=3, new_tokens=ids([-1]), first=True),                        # negative id
        pb.VerifySeq(seq_id=4, new_tokens=ids([5])),                                     # unknown
        pb.VerifySeq(seq_id=5, first=True),                                              # no tokens
        pb.VerifySeq(seq_id=6, new_tokens=ids([1] * (MAX_LEN + 5)), first=True),        # too long
        pb.VerifySeq(seq_id=7, new_tokens=ids([5]), draft_tokens=ids([1, 2]), first=True,
                     sampling=sampled(3)),                                               # no probs
        pb.VerifySeq(seq_id=8, new_tokens=ids([5]), draft_tokens=ids([1] * (MAX_DRAFT + 1)),
                     first=True),                                                        # too many drafts
        pb.VerifySeq(seq_id=9, new_tokens=ids([5]), draft_tokens=ids([1]), first=True,
                     partial_prefill=True),                                              # drafts + partial
        pb.VerifySeq(seq_id=10, new_tokens=ids([5]), draft_tokens=ids([1, 2]), first=True,
                     sampling=sampled(4), draft_probs=probs([1, 2], nan=True)),         # NaN weights
        pb.VerifySeq(seq_id=11, new_tokens=b"\x01\x02\x03", first=True),              # undecodable
        pb.VerifySeq(seq_id=14, new_tokens=ids([5]), sampling=pb.SamplingParams(temperature=float("nan")),
                     first=True),                                                        # NaN temperature
    ]
    duplicate = pb.VerifySeq(seq_id=1, new_tokens=ids([1, 2]), first=True)              # 1 again: a restart?

    def script(step):
        views, emitted = [], 1
        r = step(pb.VerifyRequest(step=1, release=[999, 2**64 - 1], seqs=[
            *bad[:5], pb.VerifySeq(seq_id=1, new_tokens=ids(PROMPT), first=True), *bad[5:],
            pb.VerifySeq(seq_id=12, new_tokens=ids([8, 9, 10]), first=True),
            pb.VerifySeq(seq_id=13, new_tokens=ids([4, 4, 4]), first=True, sampling=sampled(21)), duplicate]))
        views.append(verify_view(r))
        last = {x.seq_id: x.next_token for x in r.results if not x.error.code}
        assert set(last) == {1, 12, 13} and last[1] == reference[0], views[-1]
        for n in range(1, 7):
            drafts = list(reference[emitted:emitted + 4])
            drafts[n % 4] = (drafts[n % 4] + 11) % V                     # one wrong draft
            d13 = [(last[13] + n) % V, (last[13] * 3) % V]
            seq12 = pb.VerifySeq(seq_id=12, new_tokens=ids([last[12]]), draft_tokens=ids([last[12], 1, 2]))
            seq13 = pb.VerifySeq(seq_id=13, new_tokens=ids([last[13]]), draft_tokens=ids(d13),
                                 sampling=sampled(21), draft_probs=probs(d13))
            if n == 3:       # a held sequence's bad step fails alone and leaves it as it was
                seq12 = pb.VerifySeq(seq_id=12, new_tokens=ids([last[12]]), draft_tokens=ids([2, -5]))
            if n == 5:
                seq13 = pb.VerifySeq(seq_id=13, new_tokens=ids([last[13]]), draft_tokens=ids(d13),
                                     sampling=sampled(21), draft_probs=probs(d13[:1]))
            chosen = bad[n % 3::3]
            seqs = [*chosen[:2], pb.VerifySeq(seq_id=1, new_tokens=ids([last[1]]), draft_tokens=ids(drafts)),
                    *chosen[2:], seq12, seq13, duplicate]
            r = step(pb.VerifyRequest(step=n + 1, seqs=seqs, release=[4, 5, 2**63]))
            views.append(verify_view(r))
            got = {x.seq_id: x for x in r.results if not x.error.code}
            assert set(got) == {1, 12, 13} - {12 if n == 3 else 13 if n == 5 else 0}, views[-1]
            assert got[1].accepted == n % 4 and got[1].next_token == reference[emitted + n % 4]
            emitted += n % 4 + 1
            last.update({s: x.next_token for s, x in got.items()})
        views.append(verify_view(step(pb.VerifyRequest(step=99, release=[1, 12]))))
        return views

    want = run_verify_script(servers.one, script)
    got = run_verify_script(servers.tp, script)
    assert got == want
    servers.same_kv()
    released = [stub.Release(pb.ReleaseRequest(seq_ids=[13, 13, 4, 2**64 - 1]), timeout=10)
                for stub in (servers.tp, servers.one)]
    assert released[0].released == released[1].released == 1
    assert released[0].kv_blocks_free == released[1].kv_blocks_free == NUM_BLOCKS
    servers.ranks_alive(settle=False)
    servers.probe()


def test_kv_exhaustion_roll_backs_and_restarts_answer_as_one_rank(servers):
    """24 blocks of 8 tokens: prompts and drafts that run out of KV (RESOURCE_EXHAUSTED for the
    later sequences of a step, nothing held for them), restarts of held ids with `first`, releases
    inside steps, a prompt at max_model_len: every answer and the free blocks after every step
    equal the one-rank server's."""
    rng = random.Random(5)
    prompts = {i: [rng.randrange(V) for _ in range(30 + i)] for i in range(20, 26)}   # 50.. tokens

    def script(step, address):
        views, last = [], {}

        def run(seqs, release=()):
            r = step(pb.VerifyRequest(step=len(views) + 1, seqs=seqs, release=list(release)))
            info = server_info(address, "target")
            views.append((verify_view(r), info.kv_blocks_free, info.num_sequences))
            for x in r.results:
                if not x.error.code:
                    last[x.seq_id] = x.next_token
            return r

        run([pb.VerifySeq(seq_id=i, new_tokens=ids(prompts[i]), first=True) for i in range(20, 24)])
        for n in range(4):
            run([pb.VerifySeq(seq_id=i, new_tokens=ids([last[i]]),
                              draft_tokens=ids([(last[i] + k * n) % V for k in range(MAX_DRAFT)]))
                 for i in sorted(last)])
        run([pb.VerifySeq(seq_id=21, new_tokens=ids(prompts[21][:10]), first=True),             # restart: shorter
             pb.VerifySeq(seq_id=24, new_tokens=ids(prompts[24]), first=True),
             pb.VerifySeq(seq_id=25, new_tokens=ids(prompts[25]), first=True)], release=[20])
        last.pop(20, None)
        run([pb.VerifySeq(seq_id=26, new_tokens=ids([1] * (MAX_LEN - 1)), first=True),         # at the limit
             pb.VerifySeq(seq_id=22, new_tokens=ids([last[22]]), draft_tokens=ids([1, 2, 3]))])
        run([pb.VerifySeq(seq_id=i, new_tokens=ids([last[i]]), draft_tokens=ids([last[i]] * 3))
             for i in sorted(last) if i != 22], release=[22])
        run([], release=list(range(20, 27)))
        return views

    results = {}
    for name, stub in (("one", servers.one), ("tp", servers.tp)):
        stream = Stream(stub.Verify)
        try:
            results[name] = script(stream.step, servers.procs[name].address)
        finally:
            stream.close()
    assert results["tp"] == results["one"]
    codes = [code for view, _, _ in results["one"] for (_, _, _, code, _) in view]
    assert 8 in codes and codes.count(0) > 10, codes                     # exhausted and served both ran
    assert results["tp"][-1][1:] == (NUM_BLOCKS, 0)
    servers.ranks_alive(settle=False)
    servers.probe()


def test_unseeded_sampled_verify_keeps_the_ranks_in_step(servers):
    """A sampled sequence without a seed (the API allows it; the coordinator always sends one):
    the ranks must take the same acceptances, so rank 0 must not let each rank draw its own seed.
    Otherwise their KV lengths part and rank 1 stops the group: the server dies."""
    def script(step):
        out = []
        r = step(pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=30 + i, new_tokens=ids(PROMPT[i:]), first=True,
                                                            sampling=sampled()) for i in range(3)]))
        last = {x.seq_id: x.next_token for x in r.results}
        for n in range(6):
            seqs = []
            for s, t in last.items():
                drafts = [(t + 1 + k) % V for k in range(4)]
                seqs.append(pb.VerifySeq(seq_id=s, new_tokens=ids([t]), draft_tokens=ids(drafts),
                                         sampling=sampled(), draft_probs=probs(drafts)))
            r = step(pb.VerifyRequest(step=n + 2, seqs=seqs))
            for x in r.results:
                assert not x.error.code and 0 <= x.accepted <= 4 and 0 <= x.next_token < V, x
                last[x.seq_id] = x.next_token
                out.append(x.accepted)
        step(pb.VerifyRequest(step=99, release=list(last)))
        return out

    accepted = run_verify_script(servers.tp, script)
    assert 0 < sum(accepted) < 4 * len(accepted)          # acceptance was random, not all or nothing
    servers.ranks_alive(settle=False)
    servers.probe()
    assert servers.info("tp").kv_blocks_free == NUM_BLOCKS


def test_proposals_with_bad_sequences_extensions_and_kv_exhaustion_answer_as_one_rank(servers):
    """The draft's state is more than its KV lengths (each sequence's proposed tokens, which the
    bookkeeping does not compare): steps mixing served proposals (greedy and seeded sampled, keep,
    extend) with sequences that fail alone, prompts that run out of KV, restarts and releases give
    the same tokens, the same draft distributions and the same errors as a one-rank draft."""
    rng = random.Random(9)
    long = {i: [rng.randrange(V) for _ in range(95)] for i in (68, 69)}

    def script(step, address):
        views, last = [], {}

        def run(seqs, release=()):
            r = step(pb.ProposeRequest(step=len(views) + 1, seqs=seqs, release=list(release)))
            info = server_info(address, "draft")
            views.append((propose_view(r), info.kv_blocks_free, info.num_sequences))
            last.update({x.seq_id: unids(x.tokens) for x in r.results if not x.error.code})
            return r

        run([pb.DraftSeq(seq_id=63, new_tokens=ids([5]), num_draft=2),                         # unknown
             pb.DraftSeq(seq_id=60, new_tokens=ids(PROMPT), num_draft=4, first=True),
             pb.DraftSeq(seq_id=64, new_tokens=ids([5, V]), num_draft=2, first=True),          # id = vocab
             pb.DraftSeq(seq_id=61, new_tokens=ids(PROMPT[::-1]), num_draft=4, first=True),
             pb.DraftSeq(seq_id=65, new_tokens=ids([5]), num_draft=MAX_DRAFT + 1, first=True),  # too many
             pb.DraftSeq(seq_id=62, new_tokens=ids([9, 8, 7]), num_draft=3, first=True, sampling=sampled(12)),
             pb.DraftSeq(seq_id=66, num_draft=2, first=True),                                   # no tokens
             pb.DraftSeq(seq_id=67, new_tokens=ids([1] * MAX_LEN), num_draft=1, first=True),   # too long
             pb.DraftSeq(seq_id=60, new_tokens=ids([1]), num_draft=1, first=True)],             # 60 again
            release=[999])
        for n in range(4):
            seqs = [pb.DraftSeq(seq_id=60, keep=n % 5, new_tokens=ids([(last[60] + [3])[0]]), num_draft=4),
                    pb.DraftSeq(seq_id=61, keep=1, num_draft=2, extend=True) if n % 2 else
                    pb.DraftSeq(seq_id=61, keep=2, new_tokens=ids([4]), num_draft=3),
                    pb.DraftSeq(seq_id=62, keep=n % 4, new_tokens=ids([7]), num_draft=3, sampling=sampled(12)),
                    pb.DraftSeq(seq_id=62 if n == 2 else 70, keep=9, new_tokens=ids([1]), num_draft=1),  # bad keep
                    pb.DraftSeq(seq_id=61 if n == 3 else 71, new_tokens=ids([2]), num_draft=1,
                                extend=True)]                                                 # 61 twice / unknown
            if n == 1:
                seqs += [pb.DraftSeq(seq_id=i, new_tokens=ids(p), num_draft=4, first=True) for i, p in long.items()]
            run(seqs, release=[69] if n == 3 else ())
        run([pb.DraftSeq(seq_id=60, new_tokens=ids(PROMPT[:3]), num_draft=5, first=True),      # restart
             pb.DraftSeq(seq_id=68, keep=4, new_tokens=ids([1]), num_draft=MAX_DRAFT)], release=[61])
        run([], release=[60, 62, 68])
        return views

    results = {}
    for name, stub in (("draft_one", servers.draft_one), ("draft", servers.draft)):
        stream = Stream(stub.Propose)
        try:
            results[name] = script(stream.step, servers.procs[name].address)
        finally:
            stream.close()
    # Tokens, errors and KV exactly; the distributions to fp16 rounding (the sharded matmuls and
    # the all-reduce sum in another order than one rank's matmul).
    exact = {n: [([(v[0], v[1], len(v[2]), *v[3:]) for v in view], *kv) for view, *kv in r]
             for n, r in results.items()}
    assert exact["draft"] == exact["draft_one"]
    for (view, *_), (want, *_) in zip(results["draft"], results["draft_one"]):
        for v, w in zip(view, want):
            np.testing.assert_allclose(np.frombuffer(v[2], "<f2"), np.frombuffer(w[2], "<f2"), atol=2e-3)
    codes = [code for view, _, _ in results["draft_one"] for (*_, code, _) in view]
    assert {3, 5, 8} <= set(codes) and codes.count(0) > 12, codes
    assert any(probs for view, _, _ in results["draft_one"] for (_, _, probs, _, _) in view)
    assert results["draft"][-1][1:] == (NUM_BLOCKS, 0)
    servers.ranks_alive()


def test_unseeded_sampled_proposals_feed_every_draft_rank_the_same_tokens(servers):
    """A two-rank draft proposes without a seed, then keeps the whole proposal and drafts greedily:
    each rank's KV must hold the proposed tokens rank 0 answered with. The greedy drafts must equal
    those of a sequence that was given the same tokens as its prompt (a rank that drew its own
    tokens feeds them to its heads: the drafts go wrong silently, no bookkeeping differs)."""
    stream = Stream(servers.draft.Propose)
    try:
        prompts = {40 + i: PROMPT[i:] + [11 * i] for i in range(3)}
        r = stream.step(pb.ProposeRequest(step=1, seqs=[
            pb.DraftSeq(seq_id=s, new_tokens=ids(p), num_draft=4, first=True, sampling=sampled())
            for s, p in prompts.items()]))
        proposed = {x.seq_id: unids(x.tokens) for x in r.results}
        assert all(len(t) == 4 for t in proposed.values()), propose_view(r)
        r = stream.step(pb.ProposeRequest(step=2, seqs=[
            pb.DraftSeq(seq_id=s, keep=4, new_tokens=ids([7]), num_draft=4) for s in prompts]))
        kept = {x.seq_id: unids(x.tokens) for x in r.results}
        r = stream.step(pb.ProposeRequest(step=3, seqs=[
            pb.DraftSeq(seq_id=s + 10, new_tokens=ids(p + proposed[s] + [7]), num_draft=4, first=True)
            for s, p in prompts.items()]))
        fresh = {x.seq_id - 10: unids(x.tokens) for x in r.results}
        stream.step(pb.ProposeRequest(step=4, release=[*prompts, *(s + 10 for s in prompts)]))
    finally:
        stream.close()
    assert kept == fresh
    servers.ranks_alive()
    assert servers.info("draft").num_sequences == 0


def test_concurrent_streams_on_two_ranks_answer_as_one_rank(servers):
    """Six streams at once (inline decode/verify steps on the event loop and prompt steps on the
    engine thread interleave, their mirrored calls queue for the engine), each its own sequence
    with drafts, restarts and a seeded sampled step: each stream's answers equal the one-rank
    server's for the same stream."""
    def script_for(k: int):
        seq_id = 50 + k

        def script(step):
            views = []
            r = step(pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=seq_id, new_tokens=ids(PROMPT + [k] * (k + 1)),
                                                                first=True)]))
            views.append(verify_view(r))
            t = r.results[0].next_token
            for n in range(8):
                if n == 4 and k % 2:     # a restart with a prompt: the engine thread, not inline
                    seq = pb.VerifySeq(seq_id=seq_id, new_tokens=ids(PROMPT[::-1] + [t]), first=True)
                elif n % 3 == 2:
                    d = [t, (t + k) % V]
                    seq = pb.VerifySeq(seq_id=seq_id, new_tokens=ids([t]), draft_tokens=ids(d),
                                       sampling=sampled(100 + k), draft_probs=probs(d))
                else:
                    seq = pb.VerifySeq(seq_id=seq_id, new_tokens=ids([t]), draft_tokens=ids([t, t, (t * k) % V]))
                r = step(pb.VerifyRequest(step=n + 2, seqs=[seq]))
                views.append(verify_view(r))
                t = r.results[0].next_token
            step(pb.VerifyRequest(step=99, release=[seq_id]))
            return views
        return script

    def run_all(stub) -> dict:
        out, errors = {}, []

        def worker(k):
            try:
                out[k] = run_verify_script(stub, script_for(k))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        return out

    want, got = run_all(servers.one), run_all(servers.tp)
    assert got == want
    assert all(code == 0 for views in got.values() for v in views for (*_, code, _) in v)
    servers.same_kv()
    servers.ranks_alive()


# --- lifetime -----------------------------------------------------------------------------------
def test_sigkill_of_rank_one_ends_the_server_and_its_streams(tmp_path, pair):
    with tp_server(tmp_path, pair[0]) as proc:
        (rank1,) = proc.seen_ranks
        channel = grpc.insecure_channel(proc.address)
        stream = Stream(pb_grpc.TargetStub(channel).Verify)
        try:
            stream.step(pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=1, new_tokens=ids(PROMPT), first=True)]))
            os.kill(rank1, signal.SIGKILL)
            stream.send(pb.VerifyRequest(step=2, seqs=[pb.VerifySeq(seq_id=1, new_tokens=ids([3]))]))
            end = stream.receive(timeout=15)
            assert not hasattr(end, "results") or end.results[0].error.code == 0   # served before the kill, or ended
            assert wait_for(lambda: proc.popen.poll() is not None, 10), "server still running without its rank 1"
        finally:
            stream.close()
            channel.close()
        assert proc.popen.returncode == 1
        log = proc.log_since_start()   # the watch saw rank 1 go, or the step's all-reduce failed first
        assert "tensor-parallel rank 1 exited" in log or "cannot be trusted to agree" in log


def test_sigkill_of_the_serving_process_takes_its_rank_down(tmp_path, pair):
    with tp_server(tmp_path, pair[0]) as proc:
        everything = set(proc_children(proc.popen.pid))      # rank 1 and spawn's resource tracker
        proc.popen.kill()
        proc.popen.wait()
        assert wait_for(lambda: not any(alive(p) for p in everything), 8), \
            [proc_children(1).get(p) for p in everything if alive(p)]


def first_rank(proc, timeout: float = 30.0) -> int:
    """Rank 1's pid as soon as the server has spawned it (it is still importing torch)."""
    found = []
    assert wait_for(lambda: found.extend(rank_pids(proc.popen.pid)) or found, timeout, 0.01), proc.log_tail()
    proc.seen_ranks.update(found)
    return found[0]


def test_rank_lost_while_the_server_loads_ends_the_server(tmp_path, pair):
    """Rank 1 dies before it joins the group: rank 0 must not wait in the rendezvous (10 minutes)."""
    with tp_server(tmp_path, pair[0], healthy=False) as proc:
        os.kill(first_rank(proc), signal.SIGKILL)
        assert wait_for(lambda: proc.popen.poll() is not None, 15), \
            f"server still loading 15s after losing rank 1:\n{proc.log_tail(10)}"
        assert proc.popen.returncode != 0


def test_serving_process_killed_right_after_the_spawn_leaves_no_rank(tmp_path, pair):
    """The server dies while rank 1 still imports torch: rank 1 must notice that its server is gone
    (its parent has changed by the time it looks) and exit. Exiting because the rendezvous failed
    does not count: on the CPU gloo happens to find rank 0's address and fail to connect, but a
    rank 0 that died before it registered (or NCCL, whose id is exchanged at the first collective)
    leaves rank 1 waiting there for GROUP_TIMEOUT (10 minutes)."""
    with tp_server(tmp_path, pair[0], healthy=False) as proc:
        rank1 = first_rank(proc)
        assert wait_for(lambda: "libtorch_cpu" in maps(rank1), 20, 0.01)   # it has read its arguments
        proc.popen.kill()                                                  # and imports torch
        proc.popen.wait()
        assert wait_for(lambda: not alive(rank1), 10), "rank 1 outlived its server"
        assert f"the serving process (pid {proc.popen.pid}) is gone" in proc.log_since_start(), \
            proc.log_since_start()[-1500:]


def test_sigterm_while_loading_stops_cleanly(tmp_path, pair):
    with tp_server(tmp_path, pair[0], healthy=False) as proc:
        first_rank(proc)
        proc.popen.send_signal(signal.SIGTERM)
        assert wait_for(lambda: proc.popen.poll() is not None, 40), proc.log_tail(10)
        assert proc.popen.returncode == 0, proc.log_tail(20)
        assert wait_for(lambda: not any(alive(p) for p in proc.seen_ranks), 5)
    assert not rendezvous_left(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_drains_and_exits_zero(tmp_path, pair, sig):
    """Ctrl-C in a terminal (or a service manager stopping the control group) signals every
    process of the server: rank 1 must not die of it; rank 0 drains its open stream (a step sent
    during the grace is served) and everything exits 0."""
    with tp_server(tmp_path, pair[0]) as proc:
        channel = grpc.insecure_channel(proc.address)
        stream = Stream(pb_grpc.TargetStub(channel).Verify)
        try:
            r = stream.step(pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=1, new_tokens=ids(PROMPT), first=True)]))
            os.killpg(proc.popen.pid, sig)
            time.sleep(1.5)                                    # past the rank watch's interval
            r = stream.step(pb.VerifyRequest(step=2, seqs=[pb.VerifySeq(
                seq_id=1, new_tokens=ids([r.results[0].next_token]), draft_tokens=ids([1, 2]))]))
            assert not r.results[0].error.code
            stream.step(pb.VerifyRequest(step=3, release=[1]))
        finally:
            stream.close()
            channel.close()
        assert wait_for(lambda: proc.popen.poll() is not None, 15), proc.log_tail(10)
        log = proc.log_since_start()
        assert proc.popen.returncode == 0, log[-2000:]
        assert "tensor-parallel rank 1 exited" not in log
        assert wait_for(lambda: not any(alive(p) for p in proc.seen_ranks), 5)
    assert not rendezvous_left(tmp_path)


def test_a_size_the_heads_do_not_divide_is_a_start_up_error(tmp_path, pair):
    """--tensor-parallel-size 3 on a model of 4 heads: exit status 2 naming the field (as other
    configuration errors), no rank and no rendezvous folder left."""
    with tp_server(tmp_path, pair[0], args=["--tensor-parallel-size", "3"], healthy=False) as proc:
        assert wait_for(lambda: proc.seen_ranks.update(rank_pids(proc.popen.pid)) or proc.popen.poll() is not None,
                        40), proc.log_tail(10)
        log = proc.log_since_start()
        assert proc.popen.returncode == 2, log[-2000:]
        assert "cannot start the target server: num_attention_heads (4) is not divisible" in log
        assert len(proc.seen_ranks) == 2
        assert wait_for(lambda: not any(alive(p) for p in proc.seen_ranks), 5)
    assert not rendezvous_left(tmp_path)
