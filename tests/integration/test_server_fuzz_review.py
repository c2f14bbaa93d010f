"""Fuzz review of the model servers against the serving standard: "bad input gets a clear gRPC status
and message; nothing is lost: no leaked KV blocks, no hung streams, no dead server because of one
request".

Seeded random and adversarial Propose / Verify steps go DIRECTLY over gRPC to one pair of real
server processes (tiny model pair; 24 KV blocks of 8 tokens, max_model_len 128, max_num_draft 6,
so KV pressure and the length limit are easy to reach). Client-side shadows of every sequence's
state (the draft's tokens / confirmed base / KV length, the target's KV length) predict each
result: a valid sequence must be served, or refused with RESOURCE_EXHAUSTED only when its blocks
are really not there; a mutated one (one adversarial field each) must fail alone with the expected
code and a message naming that field; the rest of its batch is served. After every step the
servers' Info must match the shadows exactly (sequences held, free KV blocks): a leak shows at the
step that caused it. Around that: targeted cases (huge batches, duplicate ids, step numbers out of
order, release lists with unknown / duplicate ids, two streams driving the same ids concurrently, a
stream cancelled mid-step, a deadline mid-stream, a half-closed stream, undecodable bytes). After
the fuzz: both servers alive, SERVING (grpc.health.v1), answering Info, every KV block free once
every id is released, no ERROR in their logs, a greedy and a seeded sampled speculative loop give
the same bytes as before the fuzz, and both exit 0 on SIGTERM.

Reproduce with SPECDEC_FUZZ_SEED=<seed> (printed on failure); SPECDEC_FUZZ_STEPS sets the random
steps per server (default 400).
"""
from __future__ import annotations

import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.launch import spawn_server, start_healthy, stop_all
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.sampling.transport import decode_probs
from tests.helpers.cluster import server_info
from tests.helpers.streams import END, StepStream, describe
from tests.helpers.tiny_models import make_pair

SEED = int(os.environ.get("SPECDEC_FUZZ_SEED", "8675309"))
RANDOM_STEPS = int(os.environ.get("SPECDEC_FUZZ_STEPS", "400"))
V = 320                 # make_pair's vocabulary
MAX_LEN = 128           # --max-model-len
BLOCK = 8               # --block-size
NUM_BLOCKS = 24         # --num-blocks: 192 tokens of KV per server
MAX_DRAFT = 6           # --max-num-draft
SERVER_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK), "--max-model-len", str(MAX_LEN),
               "--max-num-draft", str(MAX_DRAFT), "--warmup-batch-sizes", "1"]
STEP_TIMEOUT = 30.0     # no step may take longer to be answered (a hang otherwise)
STREAM_DEADLINE = 240.0
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
INVALID, NOT_FOUND, EXHAUSTED, INTERNAL = 3, 5, 8, 13
# Every per-sequence error must name one of these (a field of the request, or the KV cache).
FIELDS = ("seq_id", "new_tokens", "draft_tokens", "draft_probs", "num_draft", "keep", "sampling", "kv cache",
          "max_model_len")
SERVICES = {"draft": "specdec.v1.Draft", "target": "specdec.v1.Target"}


def ids(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def unids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


# --- servers -----------------------------------------------------------------------------------
@dataclass
class Servers:
    procs: dict            # role -> coordinator.launch.Proc
    channels: dict         # role -> grpc.Channel
    draft: pb_grpc.DraftStub
    target: pb_grpc.TargetStub

    def stub(self, role: str):
        return self.draft if role == "draft" else self.target

    def info(self, role: str) -> pb.ModelInfo:
        return server_info(self.procs[role].address, role)

    def alive(self) -> None:
        for role, proc in self.procs.items():
            assert proc.popen.poll() is None, f"{role} server died:\n{proc.log_tail(60)}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_fuzz")
    target_path, draft_path = make_pair(root)
    procs = {"draft": spawn_server("draft", draft_path, root, args=SERVER_ARGS),
             "target": spawn_server("target", target_path, root, args=SERVER_ARGS)}
    channels = {}
    try:
        for proc in procs.values():
            start_healthy(proc, 120)
        channels = {r: grpc.insecure_channel(p.address, options=CHANNEL_OPTIONS) for r, p in procs.items()}
        yield Servers(procs, channels, pb_grpc.DraftStub(channels["draft"]), pb_grpc.TargetStub(channels["target"]))
    finally:
        for ch in channels.values():
            ch.close()
        alive = {r: p.popen.poll() is None for r, p in procs.items()}
        stop_all(list(procs.values()))
    # A server that survived the module must drain and exit 0 on SIGTERM.
    for role, proc in procs.items():
        if alive[role]:
            assert proc.popen.returncode == 0, f"{role} exit {proc.popen.returncode}:\n{proc.log_tail(40)}"


# Every seq id a test here may leave held when it fails: released after each test, so that one
# failure does not show up again as "KV not free" in the tests after it.
USED_IDS = sorted({*range(0, 50), *range(100, 2100), *range(300, 304), *range(400, 420), 777, *range(10_000, 10_009),
                   2**63 - 1, 2**64 - 2, 2**64 - 1})


@pytest.fixture(autouse=True)
def _release_after_each_test(request):
    yield
    if "servers" in request.fixturenames:
        servers = request.getfixturevalue("servers")
        for role in ("draft", "target"):
            try:
                servers.stub(role).Release(pb.ReleaseRequest(seq_ids=USED_IDS), timeout=10)
            except grpc.RpcError:
                pass


_END = END


class Stream(StepStream):
    """StepStream whose steps are checked: echoed step number, one result per sequence in order,
    and every per-sequence error naming a request field or the KV cache."""
    step_timeout = STEP_TIMEOUT

    def __init__(self, method, deadline: float = STREAM_DEADLINE):
        super().__init__(method, deadline)

    def step(self, request, timeout: float = STEP_TIMEOUT):
        response = super().step(request, timeout)
        assert response.step == request.step, f"step echoed as {response.step}, sent {request.step}"
        assert len(response.results) == len(request.seqs), \
            f"{len(response.results)} results for {len(request.seqs)} sequences"
        for i, (s, r) in enumerate(zip(request.seqs, response.results)):
            assert r.seq_id == s.seq_id, f"result {i} is for seq {r.seq_id}, asked {s.seq_id}"
            if r.HasField("error"):
                check_error(r.error, i)
        return response

    def close(self, timeout: float = STEP_TIMEOUT) -> None:
        """Half-closes; the server must end the stream with OK."""
        self._requests.put(_END)
        if self.ended is None:
            end = self.receive(timeout)
            assert end == "end", f"stream ended with {describe(end)}"
        self._reader.join(timeout)


def check_error(err: pb.SeqError, index: int) -> None:
    """A per-sequence error: a known code (INTERNAL is never right for bad input) and a message
    naming a field or resource; a convert-level message's `seqs[i].` index is the sequence's own."""
    assert err.code in (INVALID, NOT_FOUND, EXHAUSTED), f"seqs[{index}]: code {err.code}: {err.message!r}"
    assert err.message and any(f in err.message for f in FIELDS), f"seqs[{index}]: unclear {err.message!r}"
    m = re.match(r"seqs\[(\d+)\]\.", err.message)
    assert m is None or int(m.group(1)) == index, f"seqs[{index}]: message names another index: {err.message!r}"


def check_results(req, r, expected: dict, ok) -> None:
    """Sequence i of the step failed as expected[i] says (code, field), or passes ok(seq, result)."""
    for i, res in enumerate(r.results):
        if i in expected:
            expect_error(res, *expected[i], what=f"seqs[{i}]")
        else:
            ok(req.seqs[i], res)


def expect_error(result, code: int, field: str, what: str = "") -> None:
    assert result.HasField("error"), f"{what}: served, expected {code} naming {field!r}"
    assert result.error.code == code and field in result.error.message, \
        f"{what}: got {result.error.code} {result.error.message!r}, expected {code} naming {field!r}"


def check_draft_ok(seq: pb.DraftSeq, r: pb.DraftResult) -> list[int]:
    """A served proposal: num_draft ids in the vocabulary; probs iff sampled and drafting, with one
    decodable row per token that gives the token some mass."""
    assert not r.HasField("error"), r.error.message
    toks = unids(r.tokens)
    assert len(toks) == seq.num_draft and all(0 <= t < V for t in toks), toks
    sampled = seq.sampling.temperature >= 1e-5
    if not (sampled and seq.num_draft):
        assert not r.HasField("probs"), "probs for a greedy or empty proposal"
        return toks
    p = r.probs
    enc = pb.ProbsEncoding.Name(p.encoding).removeprefix("PROBS_ENCODING_")
    w = decode_probs(p.values, p.rows, p.vocab_size, enc, p.indices, p.row_lengths, max_vocab=V,
                     expected_rows=seq.num_draft)
    assert w.shape == (seq.num_draft, V)
    assert all(w[i, t] > 0 for i, t in enumerate(toks)), "a drafted token without mass in its row"
    return toks


def check_verify_ok(seq: pb.VerifySeq, r: pb.VerifyResult) -> None:
    assert not r.HasField("error"), r.error.message
    k = len(seq.draft_tokens) // 4
    if seq.partial_prefill:
        assert r.accepted == 0 and r.next_token == -1, (r.accepted, r.next_token)
    else:
        assert 0 <= r.accepted <= k and 0 <= r.next_token < V, (r.accepted, r.next_token, k)


def healthy(servers: Servers) -> None:
    servers.alive()
    for role, ch in servers.channels.items():
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICES[role]):
            status = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, f"{role} {name!r}: {status}"


def release_all(servers: Servers, seq_ids, timeout: float = 15.0) -> dict:
    """Releases the ids on both servers, then polls Info until every block is free and no sequence
    is held (a step cancelled in flight may still finish after the release); returns the Infos."""
    seq_ids = list(seq_ids)
    deadline = time.monotonic() + timeout
    while True:
        infos = {}
        for role in ("draft", "target"):
            servers.stub(role).Release(pb.ReleaseRequest(seq_ids=seq_ids), timeout=10)
            infos[role] = servers.info(role)
        if all(i.kv_blocks_free == i.kv_blocks_total == NUM_BLOCKS and i.num_sequences == 0
               for i in infos.values()):
            return infos
        assert time.monotonic() < deadline, f"KV not free after releasing every id: {infos}"
        time.sleep(0.1)


# --- random content ----------------------------------------------------------------------------
F32_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice([0, 1, V - 1, rng.randrange(V)]) for _ in range(n)]


def rand_sampling(rng: random.Random) -> pb.SamplingParams:
    """Valid sampling, often at its limits: greedy by 0, -0.0 or a temperature below 1e-5;
    sampled with top_k past the vocabulary, top_p at 0 (= off) or just below 1, min_p 1, huge
    temperatures, seeds at 0 and 2**64 - 1."""
    if rng.random() < 0.45:
        return pb.SamplingParams(temperature=rng.choice([0.0, -0.0, 1e-7, 9e-6]),
                                 top_k=rng.choice([0, 5]), top_p=rng.choice([0.0, 0.3]))
    s = pb.SamplingParams(temperature=rng.choice([0.7, 1.0, 1.5, 2e-5, 1e4, 3.4e38]),
                          top_k=rng.choice([0, 0, 1, 7, V - 1, V, 10**6, 2**31 - 1]),
                          top_p=rng.choice([0.0, 1.0, 1e-30, 0.5, 0.9, F32_BELOW_ONE]),
                          min_p=rng.choice([0.0, 0.0, 0.2, 1.0]))
    s.seed = rng.choice([0, 1, 7, 2**63, 2**64 - 1, rng.getrandbits(64)])
    return s


BAD_SAMPLING = [("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf),
                ("temperature", -1e-3), ("top_p", math.nan), ("top_p", 1.0001), ("top_p", -0.5),
                ("top_p", math.inf), ("min_p", math.nan), ("min_p", 1.5), ("min_p", -1.0),
                ("top_k", -1), ("top_k", -2**31)]
BAD_IDS = [-1, V, V + 1, 2**31 - 1, -2**31]


def valid_probs(rng: random.Random, rows: int, vocab: int = V) -> pb.Probs:
    """Random non-negative rows with mass: dense fp16 / bf16, or sparse; some zeros, subnormals."""
    w = np.array([rng.random() ** 3 for _ in range(rows * vocab)], dtype=np.float32).reshape(rows, vocab)
    w[w < 0.05] = 0.0
    w[:, rng.randrange(vocab)] += 0.5
    w[0, 0] = 1e-7 if rng.random() < 0.5 else w[0, 0]              # an fp16 subnormal
    w /= w.sum(1, keepdims=True)
    kind = rng.choice(["fp16", "bf16", "sparse"])
    if kind == "fp16":
        return pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=rows, vocab_size=vocab,
                        values=w.astype("<f2").tobytes())
    if kind == "bf16":
        bits = (w.view(np.uint32) >> 16).astype("<u2")           # truncation: still >= 0, finite
        return pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_BF16, rows=rows, vocab_size=vocab,
                        values=bits.tobytes())
    h = w.astype(np.float16)
    nz = [np.flatnonzero(h[r]) for r in range(rows)]
    return pb.Probs(encoding=pb.PROBS_ENCODING_SPARSE_FP16, rows=rows, vocab_size=vocab,
                    values=np.concatenate([h[r, c] for r, c in enumerate(nz)]).astype("<f2").tobytes(),
                    indices=ids(np.concatenate(nz)), row_lengths=ids([len(c) for c in nz]))


def sparse(rows_cols_vals, rows: int, vocab: int = V) -> pb.Probs:
    lengths = [len(rc) for rc in rows_cols_vals]
    cols = [c for rc in rows_cols_vals for c, _ in rc]
    vals = [v for rc in rows_cols_vals for _, v in rc]
    return pb.Probs(encoding=pb.PROBS_ENCODING_SPARSE_FP16, rows=rows, vocab_size=vocab,
                    values=np.asarray(vals, dtype="<f2").tobytes(), indices=ids(cols), row_lengths=ids(lengths))


def half_bits(rows: int, vocab: int, bad: int, encoding=pb.PROBS_ENCODING_DENSE_FP16) -> pb.Probs:
    """Uniform dense rows with one weight replaced by the 16-bit pattern `bad`."""
    one = 0x1C00 if encoding == pb.PROBS_ENCODING_DENSE_FP16 else 0x3B80   # ~1/256 in fp16 / bf16
    bits = np.full(rows * vocab, one, dtype="<u2")
    bits[rows * vocab // 2] = bad
    return pb.Probs(encoding=encoding, rows=rows, vocab_size=vocab, values=bits.tobytes())


def bad_probs(rng: random.Random, k: int) -> tuple[pb.Probs, str]:
    """Draft probabilities for k >= 1 drafts that are wrong in one way, and the field named."""
    good = valid_probs(rng, k)
    choices: list[tuple[Callable[[], pb.Probs], str]] = [
        (lambda: valid_probs(rng, k + 1), "draft_probs.rows"),
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=0, vocab_size=V), "draft_probs.rows"),
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=-1, vocab_size=V), "draft_probs.rows"),
        (lambda: valid_probs(rng, k, V + 1), "draft_probs.vocab_size"),
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_SPARSE_FP16, rows=k, vocab_size=2**31 - 1,
                          row_lengths=ids([0] * k)), "draft_probs.vocab_size"),
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=k, vocab_size=0), "draft_probs.vocab_size"),
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=k, vocab_size=-V), "draft_probs.vocab_size"),
        (lambda: pb.Probs(encoding=rng.choice([4, 7, 2**31 - 1, -1]), rows=k, vocab_size=V,
                          values=good.values), "draft_probs.encoding"),
        (lambda: half_bits(k, V, 0x7E00), "draft_probs.values"),                   # fp16 NaN
        (lambda: half_bits(k, V, 0x7C00), "draft_probs.values"),                   # fp16 +inf
        (lambda: half_bits(k, V, 0xBC00), "draft_probs.values"),                   # fp16 -1.0
        (lambda: half_bits(k, V, 0x8001), "draft_probs.values"),                   # fp16 -subnormal
        (lambda: half_bits(k, V, 0x7FC0, pb.PROBS_ENCODING_DENSE_BF16), "draft_probs.values"),  # bf16 NaN
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=k, vocab_size=V,
                          values=bytes(2 * k * V)), "draft_probs.values"),         # rows without mass
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=k, vocab_size=V,
                          values=half_bits(k, V, 0x1C00).values[:-1]), "draft_probs.values"),  # odd bytes
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_BF16, rows=k, vocab_size=V,
                          values=half_bits(k, V, 0x1C00).values + b"\0\0"), "draft_probs.values"),
        (lambda: pb.Probs(encoding=pb.PROBS_ENCODING_SPARSE_FP16, rows=k, vocab_size=V, row_lengths=b"\1\0\0"),
         "draft_probs.row_lengths"),
        (lambda: _patched_lengths(k, -1), "draft_probs.row_lengths"),
        (lambda: _patched_lengths(k, V + 1), "draft_probs.row_lengths"),
        (lambda: sparse([[(-1, 1.0)]] * k, k), "draft_probs.indices"),
        (lambda: sparse([[(V, 1.0)]] * k, k), "draft_probs.indices"),
        (lambda: sparse([[(5, 0.5), (5, 0.5)]] * k, k), "draft_probs.indices"),    # a column twice
        (lambda: _short_indices(k), "draft_probs.indices"),
        (lambda: sparse([[(5, math.nan)]] * k, k), "draft_probs.values"),
        (lambda: sparse([[(5, -0.5), (6, 1.0)]] * k, k), "draft_probs.values"),
        (lambda: sparse([[(5, 0.0)]] * k, k), "draft_probs.values"),               # a row without mass
    ]
    make, name = rng.choice(choices)
    return make(), name


def _patched_lengths(k: int, first_length: int) -> pb.Probs:
    p = sparse([[(3, 1.0)]] * k, k)
    p.row_lengths = ids([first_length] + [1] * (k - 1))
    return p


def _short_indices(k: int) -> pb.Probs:
    p = sparse([[(3, 0.5), (9, 0.5)]] * k, k)
    p.indices = p.indices[:-4]
    return p


# --- client-side shadows of the servers' sequences --------------------------------------------
@dataclass
class DraftSeqState:
    n: int      # tokens the draft holds (confirmed + proposed)
    base: int   # of them confirmed
    kv: int     # tokens in its KV


@dataclass(eq=False)
class Op:
    """One sequence of a generated step: the proto, and what must come back: expect None = a valid
    sequence (served, or RESOURCE_EXHAUSTED when its blocks are not there); else (code, field)."""
    msg: object
    expect: tuple[int, str] | None
    plan: dict = field(default_factory=dict)
    why: str = "valid"


class DraftShadow:
    def __init__(self):
        self.seqs: dict[int, DraftSeqState] = {}

    def kv_blocks(self) -> int:
        return sum(blocks(s.kv) for s in self.seqs.values())

    def valid(self, rng: random.Random, sid: int) -> Op:
        st = self.seqs.get(sid)
        sampling = rand_sampling(rng)
        if st is not None and rng.random() > 0.12:
            drafted = st.n - st.base
            keep = rng.randint(0, drafted)
            extend = rng.random() < 0.25
            new = [] if extend else rand_tokens(rng, rng.choice([0, 1, 1, 2]))
            pre = st.n if extend else st.base + keep + len(new)
            nd = min(rng.randint(0, MAX_DRAFT), MAX_LEN - pre)
            if nd >= 0:
                msg = pb.DraftSeq(seq_id=sid, keep=keep, new_tokens=ids(new), num_draft=nd, sampling=sampling,
                                  extend=extend)
                return Op(msg, None, dict(first=False, keep=keep, extend=extend, pre=pre, nd=nd))
        nd = rng.randint(0, MAX_DRAFT)
        n = rng.choice([1, 2, rng.randint(3, 40), rng.randint(3, MAX_LEN - nd)])
        msg = pb.DraftSeq(seq_id=sid, first=True, new_tokens=ids(rand_tokens(rng, n)), num_draft=nd,
                          sampling=sampling)
        if rng.random() < 0.3:   # keep and extend are ignored with first
            msg.keep, msg.extend = rng.choice([-5, 99, 2**31 - 1]), rng.random() < 0.5
        return Op(msg, None, dict(first=True, pre=n, nd=nd))

    def mutated(self, rng: random.Random, sid: int, unheld: int) -> Op:
        op = self.valid(rng, sid)
        m, st = op.msg, self.seqs.get(sid)
        choices = ["num_draft_high", "num_draft_low", "odd_bytes", "bad_id", "unknown", "first_empty",
                   "too_long", "sampling"]
        if not m.first:
            choices += ["keep_high", "keep_low", "extend_new"]
        kind = rng.choice(choices)
        if kind == "num_draft_high":
            m.num_draft = rng.choice([MAX_DRAFT + 1, 100, 2**31 - 1])
            return Op(m, (INVALID, "num_draft"), why=kind)
        if kind == "num_draft_low":
            m.num_draft = rng.choice([-1, -2**31])
            return Op(m, (INVALID, "num_draft"), why=kind)
        if kind == "odd_bytes":
            m.new_tokens += b"\x01\x02\x03"[:rng.randint(1, 3)]
            return Op(m, (INVALID, "new_tokens"), why=kind)
        if kind == "bad_id":
            toks = unids(m.new_tokens) or [5]
            toks[rng.randrange(len(toks))] = rng.choice(BAD_IDS)
            m.new_tokens, m.extend = ids(toks), False
            return Op(m, (INVALID, "new_tokens"), why=kind)
        if kind == "unknown":
            m = pb.DraftSeq(seq_id=unheld, keep=0, new_tokens=ids([5]), num_draft=1)
            return Op(m, (NOT_FOUND, "seq_id"), why=kind)
        if kind == "first_empty":
            m.first, m.new_tokens = True, b""
            return Op(m, (INVALID, "new_tokens"), why=kind)
        if kind == "too_long":
            nd = rng.randint(0, MAX_DRAFT)
            m = pb.DraftSeq(seq_id=sid, first=True, new_tokens=ids([7] * (MAX_LEN - nd + rng.randint(1, 30))),
                            num_draft=nd)
            return Op(m, (INVALID, "max_model_len"), why=kind)
        if kind == "sampling":
            name, value = rng.choice(BAD_SAMPLING)
            setattr(m.sampling, name, value)
            return Op(m, (INVALID, f"sampling.{name}"), why=f"sampling.{name}={value}")
        drafted = st.n - st.base
        if kind == "keep_high":
            m.keep = rng.choice([drafted + 1, drafted + 50, 2**31 - 1])
            return Op(m, (INVALID, "keep"), why=kind)
        if kind == "keep_low":
            m.keep = rng.choice([-1, -2**31])
            return Op(m, (INVALID, "keep"), why=kind)
        m.extend, m.new_tokens = True, ids([rng.randrange(V)])   # extend_new
        return Op(m, (INVALID, "new_tokens"), why=kind)

    # Admission as the standard asks (blocks a step's own truncation frees are free) and as the
    # engine's reservation may be more cautious about (free blocks at the step's start only).
    def admit(self, op: Op, budget: dict) -> str:
        """'ok' when the blocks must be there, 'exhausted' when they cannot be, 'either' between;
        the budgets and shadow's KV changes of admission are applied (not those of the outcome)."""
        sid, p = op.msg.seq_id, op.plan
        st = self.seqs.get(sid)
        if p["first"]:
            if st is not None:   # a restart: the old state goes before its blocks are reserved
                budget["impl"] += blocks(st.kv)
                budget["spec"] += blocks(st.kv)
                del self.seqs[sid]
            have = 0
        else:
            kv = min(st.kv, p["pre"] if p["extend"] else st.base + p["keep"])
            if kv == p["pre"] and p["nd"]:
                kv -= 1
            budget["spec"] += blocks(st.kv) - blocks(kv)   # the plan's truncation frees these
            st.kv = kv
            have = blocks(kv)
        need = max(0, blocks(p["pre"] + max(p["nd"] - 1, 0)) - have)
        p["need"] = need
        if need > budget["spec"]:
            return "exhausted"
        return "ok" if need <= budget["impl"] else "either"

    def served(self, op: Op, budget: dict, toks: list[int]) -> None:
        sid, p = op.msg.seq_id, op.plan
        budget["impl"] -= p["need"]
        budget["spec"] -= p["need"]
        st = self.seqs.get(sid)
        base = p["pre"] if p["first"] or not p["extend"] else st.base + p["keep"]
        self.seqs[sid] = DraftSeqState(n=p["pre"] + len(toks), base=base, kv=p["pre"] + max(p["nd"] - 1, 0))

    def refused(self, op: Op) -> None:
        if op.plan["first"]:
            self.seqs.pop(op.msg.seq_id, None)


class TargetShadow:
    def __init__(self):
        self.kv: dict[int, int] = {}

    def kv_blocks(self) -> int:
        return sum(blocks(n) for n in self.kv.values())

    def valid(self, rng: random.Random, sid: int) -> Op:
        start = self.kv.get(sid)
        first = start is None or rng.random() < 0.12
        start = 0 if first else start
        partial = rng.random() < 0.15
        k = 0 if partial else rng.choice([0, 1, 2, rng.randint(0, MAX_DRAFT)])
        room = MAX_LEN - start - k - (0 if partial else 1)
        if room < 1:
            first, start, k, partial = True, 0, rng.randint(0, MAX_DRAFT), False
            room = MAX_LEN - k - 1
        n = min(room, rng.choice([1, 1, 2, 3, rng.randint(1, 40)] if not first else
                                 [1, 2, rng.randint(3, 40), rng.randint(3, MAX_LEN)]))
        sampling = rand_sampling(rng)
        msg = pb.VerifySeq(seq_id=sid, new_tokens=ids(rand_tokens(rng, n)), draft_tokens=ids(rand_tokens(rng, k)),
                           sampling=sampling, first=first, partial_prefill=partial)
        if k and (sampling.temperature >= 1e-5 or rng.random() < 0.2):
            msg.draft_probs.CopyFrom(valid_probs(rng, k, rng.choice([V, V, V, 200])))
        return Op(msg, None, dict(first=first, start=start, n=n, k=k, partial=partial))

    def mutated(self, rng: random.Random, sid: int, unheld: int) -> Op:
        op = self.valid(rng, sid)
        m = op.msg
        k = op.plan["k"]
        kind = rng.choice(["new_empty", "odd_new", "odd_drafts", "bad_new_id", "bad_draft_id", "too_many_drafts",
                           "partial_with_drafts", "no_probs", "probs", "probs", "probs", "unknown",
                           "too_long", "sampling"])
        if kind == "new_empty":
            m.new_tokens = b""
            return Op(m, (INVALID, "new_tokens"), why=kind)
        if kind == "odd_new":
            m.new_tokens += b"\x09"
            return Op(m, (INVALID, "new_tokens"), why=kind)
        if kind == "odd_drafts":
            m.draft_tokens += b"\x09\x00"
            return Op(m, (INVALID, "draft_tokens"), why=kind)
        if kind == "bad_new_id":
            toks = unids(m.new_tokens)
            toks[rng.randrange(len(toks))] = rng.choice(BAD_IDS)
            m.new_tokens = ids(toks)
            return Op(m, (INVALID, "new_tokens"), why=kind)
        if kind == "unknown":
            m = pb.VerifySeq(seq_id=unheld, new_tokens=ids([5]))
            return Op(m, (NOT_FOUND, "seq_id"), why=kind)
        if kind == "too_long":
            m = pb.VerifySeq(seq_id=sid, first=True, new_tokens=ids([7] * (MAX_LEN - k + rng.randint(0, 20))),
                             draft_tokens=ids([3] * k))
            return Op(m, (INVALID, "max_model_len"), why=kind)
        if kind == "sampling":
            name, value = rng.choice(BAD_SAMPLING)
            setattr(m.sampling, name, value)
            return Op(m, (INVALID, f"sampling.{name}"), why=f"sampling.{name}={value}")
        if kind == "too_many_drafts":
            m.draft_tokens, m.partial_prefill = ids([4] * rng.choice([MAX_DRAFT + 1, 40])), False
            m.ClearField("draft_probs")
            return Op(m, (INVALID, "draft_tokens"), why=kind)
        # The rest need drafts (and a sampled sequence where the probabilities matter).
        if m.partial_prefill or not k:
            k = rng.randint(1, MAX_DRAFT)
            m.draft_tokens = ids(rand_tokens(rng, k))
            if kind != "partial_with_drafts":
                m.partial_prefill = False
        # (Each error below is checked before the length: a sequence now too long still names it.)
        if kind == "bad_draft_id":
            toks = unids(m.draft_tokens)
            toks[rng.randrange(len(toks))] = rng.choice(BAD_IDS)
            m.draft_tokens, m.partial_prefill = ids(toks), False
            m.ClearField("draft_probs")
            return Op(m, (INVALID, "draft_tokens"), why=kind)
        if kind == "partial_with_drafts":
            m.partial_prefill = True
            m.ClearField("draft_probs")
            return Op(m, (INVALID, "draft_tokens"), why=kind)
        m.sampling.CopyFrom(pb.SamplingParams(temperature=1.0, seed=rng.getrandbits(64)))
        if kind == "no_probs":
            m.ClearField("draft_probs")
            return Op(m, (INVALID, "draft_probs"), why=kind)
        probs, name = bad_probs(rng, k)
        m.draft_probs.CopyFrom(probs)
        return Op(m, (INVALID, name), why=f"probs:{name}")

    def admit(self, op: Op, budget: dict) -> str:
        sid, p = op.msg.seq_id, op.plan
        if p["first"] and sid in self.kv:
            budget["impl"] += blocks(self.kv.pop(sid))
        have = 0 if p["first"] else blocks(self.kv[sid])
        need = max(0, blocks(p["start"] + p["n"] + p["k"]) - have)
        p["need"] = need
        return "ok" if need <= budget["impl"] else "exhausted"

    def served(self, op: Op, budget: dict, result: pb.VerifyResult) -> None:
        p = op.plan
        budget["impl"] -= p["need"]
        self.kv[op.msg.seq_id] = p["start"] + p["n"] + result.accepted

    def refused(self, op: Op) -> None:
        if op.plan["first"]:
            self.kv.pop(op.msg.seq_id, None)


# --- reference runs ----------------------------------------------------------------------------
PROMPT = [5, 17, 42, 99, 7, 123, 64, 250, 3]
SEEDED = pb.SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=2**64 - 1)


def speculate(servers: Servers, base_id: int, steps: int = 5) -> list:
    """A greedy and a seeded sampled sequence, `steps` speculative steps each, straight between the
    servers; returns every byte that came back (drafts, probs, accepted, next tokens)."""
    draft, target = Stream(servers.draft.Propose), Stream(servers.target.Verify)
    sids, sampling = [base_id, base_id + 1], [pb.SamplingParams(), SEEDED]
    keep, new, out = [0, 0], [PROMPT, PROMPT], []
    for step in range(steps):
        prop = draft.step(pb.ProposeRequest(step=step, seqs=[
            pb.DraftSeq(seq_id=sids[i], keep=keep[i], new_tokens=ids(new[i]), num_draft=4, sampling=sampling[i],
                        first=step == 0) for i in range(2)]))
        ver = target.step(pb.VerifyRequest(step=step, seqs=[
            pb.VerifySeq(seq_id=sids[i], new_tokens=ids(new[i]), draft_tokens=prop.results[i].tokens,
                         draft_probs=prop.results[i].probs if i else None, sampling=sampling[i],
                         first=step == 0) for i in range(2)]))
        for i in range(2):
            assert not prop.results[i].HasField("error") and not ver.results[i].HasField("error")
            r = ver.results[i]
            out.append((prop.results[i].tokens, prop.results[i].probs.SerializeToString(), r.accepted,
                        r.next_token))
            keep[i], new[i] = r.accepted, [r.next_token]
    draft.close()
    target.close()
    release_all(servers, sids)
    return out


@pytest.fixture(scope="module")
def reference(servers):
    return speculate(servers, 1)


# --- targeted cases ----------------------------------------------------------------------------
def test_reference_loop_is_deterministic(servers, reference):
    assert speculate(servers, 3) == reference   # the same bytes under other seq ids, before any fuzz
    assert any(a > 0 for _, _, a, _ in reference[0::2]), "the greedy pair should accept some drafts"


def test_propose_adversarial_batch(servers, reference):
    s = Stream(servers.draft.Propose)
    p = ids([5, 6, 7, 8])
    req = pb.ProposeRequest(step=2**64 - 1, seqs=[
        pb.DraftSeq(seq_id=10, first=True, new_tokens=p, num_draft=3),                     # 0 ok
        pb.DraftSeq(seq_id=10, first=True, new_tokens=p, num_draft=3),                     # 1 duplicate
        pb.DraftSeq(seq_id=11, first=True, new_tokens=b"", num_draft=3),                   # 2 empty prompt
        pb.DraftSeq(seq_id=12, first=True, new_tokens=p, num_draft=MAX_DRAFT + 1),         # 3
        pb.DraftSeq(seq_id=13, first=True, new_tokens=p, num_draft=-1),                    # 4
        pb.DraftSeq(seq_id=14, first=True, new_tokens=ids([5, V]), num_draft=1),           # 5
        pb.DraftSeq(seq_id=15, first=True, new_tokens=ids([5, -1]), num_draft=1),          # 6
        pb.DraftSeq(seq_id=16, first=True, new_tokens=ids([2**31 - 1]), num_draft=1),      # 7
        pb.DraftSeq(seq_id=17, first=True, new_tokens=p + b"\x01\x02", num_draft=1),       # 8
        pb.DraftSeq(seq_id=18, keep=0, new_tokens=p, num_draft=1),                         # 9 not held
        pb.DraftSeq(seq_id=19, first=True, new_tokens=ids([1] * (MAX_LEN - 2)), num_draft=3),  # 10 too long
        pb.DraftSeq(seq_id=20, first=True, new_tokens=p, num_draft=2,
                    sampling=pb.SamplingParams(temperature=math.nan)),                     # 11
        pb.DraftSeq(seq_id=21, first=True, new_tokens=p, num_draft=2,
                    sampling=pb.SamplingParams(temperature=1.0, top_p=math.nan)),          # 12
        pb.DraftSeq(seq_id=22, first=True, new_tokens=p, num_draft=2,
                    sampling=pb.SamplingParams(temperature=1.0, top_k=2**31 - 1, min_p=1.0, seed=2**64 - 1)),  # 13 ok
        pb.DraftSeq(seq_id=2**64 - 1, first=True, new_tokens=p, num_draft=0, keep=-7, extend=True),  # 14 ok
        pb.DraftSeq(seq_id=0, extend=True, new_tokens=b"", num_draft=2),                   # 15 not held
    ], release=[99999, 99999, 10, 2**64 - 2])
    r = s.step(req)
    expected = {1: (INVALID, "seq_id"), 2: (INVALID, "new_tokens"), 3: (INVALID, "num_draft"),
                4: (INVALID, "num_draft"), 5: (INVALID, "new_tokens"), 6: (INVALID, "new_tokens"),
                7: (INVALID, "new_tokens"), 8: (INVALID, "seqs[8].new_tokens"), 9: (NOT_FOUND, "seq_id"),
                10: (INVALID, "max_model_len"), 11: (INVALID, "seqs[11].sampling.temperature"),
                12: (INVALID, "seqs[12].sampling.top_p"), 15: (NOT_FOUND, "seq_id")}
    check_results(req, r, expected, check_draft_ok)
    seqs = list(r.results)
    assert unids(seqs[0].tokens) == unids(reference_greedy(servers, [5, 6, 7, 8], 3))
    assert len(unids(seqs[13].tokens)) == 2 and seqs[13].probs.rows == 2
    assert not seqs[14].HasField("error") and seqs[14].tokens == b""
    info = servers.info("draft")
    assert info.num_sequences == 3   # 10, 22 and 2**64 - 1; nothing else holds KV

    # Continuations: keep above the proposal, keep negative, extend with tokens, extend without a
    # proposal (seq 2**64 - 1 drafted nothing: keep 0 only), an empty step, a release-only step.
    r = s.step(pb.ProposeRequest(step=5, seqs=[
        pb.DraftSeq(seq_id=10, keep=4, new_tokens=ids([9]), num_draft=1),
        pb.DraftSeq(seq_id=22, keep=-1, new_tokens=ids([9]), num_draft=1),
        pb.DraftSeq(seq_id=2**64 - 1, keep=1, extend=True, num_draft=2),
        pb.DraftSeq(seq_id=2**64 - 1, keep=0, extend=True, num_draft=2),
    ]))
    expect_error(r.results[0], INVALID, "keep", "keep above the proposal")
    expect_error(r.results[1], INVALID, "keep", "negative keep")
    expect_error(r.results[2], INVALID, "keep", "extend keeping a draft never proposed")
    expect_error(r.results[3], INVALID, "seq_id", "a duplicate of a failed sequence")
    r = s.step(pb.ProposeRequest(step=3, seqs=[
        pb.DraftSeq(seq_id=2**64 - 1, keep=0, extend=True, num_draft=2),
        pb.DraftSeq(seq_id=22, keep=2, extend=True, new_tokens=ids([9]), num_draft=1)]))
    assert len(unids(r.results[0].tokens)) == 2
    expect_error(r.results[1], INVALID, "new_tokens", "extend with new tokens")
    assert s.step(pb.ProposeRequest(step=0)).results == []
    # A held sequence one token short of max_model_len: any continuation that would pass it fails
    # (with drafts, with new tokens, extended), a step within it is served.
    r = s.step(pb.ProposeRequest(step=9, seqs=[
        pb.DraftSeq(seq_id=23, first=True, new_tokens=ids([3] * (MAX_LEN - 2)), num_draft=1)]))
    assert len(r.results[0].tokens) == 4
    r = s.step(pb.ProposeRequest(step=10, seqs=[pb.DraftSeq(seq_id=23, keep=1, new_tokens=ids([4]), num_draft=1)]))
    expect_error(r.results[0], INVALID, "max_model_len", "continuation past max_model_len")
    r = s.step(pb.ProposeRequest(step=11, seqs=[pb.DraftSeq(seq_id=23, keep=1, extend=True, num_draft=2)]))
    expect_error(r.results[0], INVALID, "max_model_len", "extension past max_model_len")
    r = s.step(pb.ProposeRequest(step=12, seqs=[pb.DraftSeq(seq_id=23, keep=1, new_tokens=ids([4]), num_draft=0)]))
    assert not r.results[0].HasField("error") and r.results[0].tokens == b""
    s.step(pb.ProposeRequest(step=1, release=[10, 22, 23, 2**64 - 1, 10]))
    info = servers.info("draft")
    assert info.num_sequences == 0 and info.kv_blocks_free == NUM_BLOCKS
    s.close()
    healthy(servers)


def reference_greedy(servers: Servers, prompt: list[int], nd: int) -> bytes:
    """Greedy drafts of a prompt on a fresh stream and id (released after)."""
    r = list(servers.draft.Propose(iter([pb.ProposeRequest(seqs=[pb.DraftSeq(
        seq_id=777, first=True, new_tokens=ids(prompt), num_draft=nd)], release=[])]), timeout=STEP_TIMEOUT))[0]
    servers.draft.Release(pb.ReleaseRequest(seq_ids=[777]), timeout=10)
    return r.results[0].tokens


def test_verify_adversarial_batch(servers):
    s = Stream(servers.target.Verify)
    p = ids([5, 6, 7])
    sampled = pb.SamplingParams(temperature=1.0, seed=11)
    onto_5 = sparse([[(5, 1.0)]], 1)                               # all mass on token 5
    req = pb.VerifyRequest(step=7, seqs=[
        pb.VerifySeq(seq_id=30, new_tokens=p, draft_tokens=ids([9]), first=True),                   # 0 ok
        pb.VerifySeq(seq_id=30, new_tokens=p, first=True),                                          # 1 duplicate
        pb.VerifySeq(seq_id=31, new_tokens=b"", first=True),                                        # 2
        pb.VerifySeq(seq_id=32, new_tokens=p, draft_tokens=ids([9] * (MAX_DRAFT + 1)), first=True),  # 3
        pb.VerifySeq(seq_id=33, new_tokens=p, draft_tokens=ids([9]), partial_prefill=True, first=True),  # 4
        pb.VerifySeq(seq_id=34, new_tokens=p, draft_tokens=ids([9]), sampling=sampled, first=True),  # 5 no probs
        pb.VerifySeq(seq_id=35, new_tokens=ids([5, V]), first=True),                                # 6
        pb.VerifySeq(seq_id=36, new_tokens=p, draft_tokens=ids([-1]), first=True),                  # 7
        pb.VerifySeq(seq_id=37, new_tokens=p),                                                      # 8 not held
        pb.VerifySeq(seq_id=38, new_tokens=ids([1] * MAX_LEN), first=True),                         # 9 too long
        pb.VerifySeq(seq_id=39, new_tokens=ids([1] * MAX_LEN), partial_prefill=True, first=True),   # 10 ok: fills
        pb.VerifySeq(seq_id=41, new_tokens=p, draft_tokens=ids([150, 3]), sampling=sampled,         # 11 ok, narrow
                     draft_probs=valid_probs(random.Random(1), 2, 100), first=True),                # vocab: q(150)=0
        pb.VerifySeq(seq_id=42, new_tokens=p, draft_tokens=ids([9]), sampling=sampled, draft_probs=onto_5,
                     first=True),                                                                   # 12 ok, q(9)=0
        pb.VerifySeq(seq_id=43, new_tokens=p, draft_tokens=ids([9]), draft_probs=valid_probs(random.Random(2), 1),
                     sampling=pb.SamplingParams(temperature=3.4e38, top_k=2**31 - 1, top_p=1e-30, min_p=1.0,
                                                seed=2**64 - 1), first=True),                       # 13 ok
        pb.VerifySeq(seq_id=44, new_tokens=p, draft_tokens=ids([9]), first=True,                    # 14 ok: greedy,
                     draft_probs=pb.Probs(encoding=0, rows=5, values=b"junk")),                     # no probs read
        pb.VerifySeq(seq_id=2**64 - 1, new_tokens=p, first=True,
                     sampling=pb.SamplingParams(temperature=-1.0)),                                 # 15
        pb.VerifySeq(seq_id=45, new_tokens=p, draft_tokens=ids([9, 9]), sampling=sampled, first=True,
                     draft_probs=half_bits(2, V, 0x7E00)),                                          # 16 NaN
    ], release=[30, 30, 2**64 - 1, 123456])
    r = s.step(req)
    expected = {1: (INVALID, "seq_id"), 2: (INVALID, "new_tokens"), 3: (INVALID, "seqs[3].draft_tokens"),
                4: (INVALID, "draft_tokens"), 5: (INVALID, "draft_probs"), 6: (INVALID, "new_tokens"),
                7: (INVALID, "draft_tokens"), 8: (NOT_FOUND, "seq_id"), 9: (INVALID, "max_model_len"),
                15: (INVALID, "seqs[15].sampling.temperature"), 16: (INVALID, "seqs[16].draft_probs.values")}
    check_results(req, r, expected, check_verify_ok)
    assert r.results[11].accepted == 0 and r.results[12].accepted == 0   # a draft of q = 0 is never accepted
    info = servers.info("target")
    assert info.num_sequences == 6 and info.kv_blocks_free == NUM_BLOCKS - 16 - 5 * 1
    nxt = r.results[0].next_token
    r = s.step(pb.VerifyRequest(step=6, seqs=[
        pb.VerifySeq(seq_id=39, new_tokens=ids([5])),                            # past max_model_len
        pb.VerifySeq(seq_id=30, new_tokens=ids([nxt]), draft_tokens=ids([9])),   # ok
        pb.VerifySeq(seq_id=41, new_tokens=ids([5]), first=True),                # a restart: ok
        pb.VerifySeq(seq_id=42, new_tokens=ids([5])),                            # released below: NOT_FOUND
    ], release=[42]))
    expect_error(r.results[0], INVALID, "max_model_len", "verify past max_model_len")
    expect_error(r.results[3], NOT_FOUND, "seq_id", "released in the same step")
    assert not r.results[1].HasField("error") and not r.results[2].HasField("error")
    s.close()
    release_all(servers, [30, 39, 41, 43, 44])
    healthy(servers)


def test_huge_batches_share_the_kv_and_nothing_more(servers):
    """Thousands of one-token sequences in one step: exactly as many are served as there are free
    blocks, the others get RESOURCE_EXHAUSTED naming the KV cache; duplicates fail alone."""
    n = 2000
    ver = pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=100 + i % (n - 50), new_tokens=ids([i % V]), first=True)
                                         for i in range(n)])
    prop = pb.ProposeRequest(step=1, seqs=[pb.DraftSeq(seq_id=100 + i, new_tokens=ids([i % V]), num_draft=MAX_DRAFT,
                                                       first=True, sampling=SEEDED if i % 2 else None)
                                           for i in range(n)])
    for role, req in (("target", ver), ("draft", prop)):
        s = Stream(servers.stub(role).Verify if role == "target" else servers.draft.Propose)
        r = s.step(req, timeout=60)
        served = [x for x in r.results if not x.HasField("error")]
        exhausted = [x for x in r.results if x.error.code == EXHAUSTED]
        dups = [x for x in r.results if x.error.code == INVALID]
        assert len(served) == NUM_BLOCKS, f"{role}: {len(served)} served"
        assert len(exhausted) + len(dups) == n - NUM_BLOCKS and all("kv cache" in x.error.message for x in exhausted)
        assert all("seq_id" in x.error.message for x in dups) and (role == "draft" or len(dups) == 50)
        for i, x in enumerate(r.results):
            if not x.HasField("error") and role == "draft":
                check_draft_ok(req.seqs[i], x)
        assert servers.info(role).kv_blocks_free == 0
        s.close()
    release_all(servers, range(100, 100 + n))
    healthy(servers)


# Found by this review (fixed): a draft step that does not grow a sequence (it ends holding exactly
# the blocks it held) was refused with RESOURCE_EXHAUSTED when the KV was full, and the same request
# sent again was served: ModelEngine.admit_step took its budget once before the loop, and
# DraftEngine._plan then truncated the sequence's KV to its surviving drafts (freeing blocks the
# budget never counted). The budget is now read at each sequence's turn.
def test_draft_step_that_needs_no_new_block_is_served_when_the_kv_is_full(servers):
    s = Stream(servers.draft.Propose)
    r = s.step(pb.ProposeRequest(step=1, seqs=[
        pb.DraftSeq(seq_id=200, first=True, new_tokens=ids(range(5, 13)), num_draft=6),    # KV 8 + 5: 2 blocks
        pb.DraftSeq(seq_id=201, first=True, new_tokens=ids([7] * 128), num_draft=0),       # 16 blocks
        pb.DraftSeq(seq_id=202, first=True, new_tokens=ids([8] * 48), num_draft=0)]))      # 6 blocks
    assert not any(x.HasField("error") for x in r.results)
    assert servers.info("draft").kv_blocks_free == 0
    try:
        # Every draft rejected, the target's token appended, 6 new drafts: 9 tokens and KV 14, 2 blocks.
        again = pb.ProposeRequest(step=2, seqs=[pb.DraftSeq(seq_id=200, keep=0, new_tokens=ids([9]), num_draft=6)])
        first_try = s.step(again).results[0]
        resend = s.step(again).results[0]
        assert not resend.HasField("error"), resend.error.message    # served once the block came free
        assert not first_try.HasField("error"), \
            f"refused a step that needs no new block: {first_try.error.code} {first_try.error.message!r}"
    finally:
        s.close()
    release_all(servers, [200, 201, 202])


# Found by this review (fixed): bytes that are not a VerifyRequest / ProposeRequest ended the stream
# with INTERNAL and an ERROR traceback in the log (specdec/serving/errors.py status_of knew no
# DecodeError): bad input reported as the server's own failure. Now INVALID_ARGUMENT, logged at INFO.
def test_undecodable_request_is_invalid_argument(servers):
    for role, method in (("target", "/specdec.v1.Target/Verify"), ("draft", "/specdec.v1.Draft/Propose")):
        call = servers.channels[role].stream_stream(method)   # raw bytes both ways
        with pytest.raises(grpc.RpcError) as e:
            list(call(iter([b"\xff\xff\xff\x07"]), timeout=STEP_TIMEOUT))
        assert e.value.details(), "no message"
        healthy(servers)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, \
            f"{role}: undecodable request answered {e.value.code()}: {e.value.details()!r}"


# --- streams -----------------------------------------------------------------------------------
def test_two_streams_drive_the_same_ids_concurrently(servers):
    """Four streams (two per server) at once, all on seq ids 300..303: restarts, continuations,
    releases and bad fields race; every step is answered well formed, no status ends a stream."""
    def worker(role: str, k: int, failures: list):
        rng = random.Random(SEED * 7 + k)
        s = Stream(servers.stub(role).Verify if role == "target" else servers.draft.Propose)
        try:
            for step in range(12):
                seqs = []
                for sid in rng.sample(range(300, 304), rng.randint(1, 4)):
                    first = rng.random() < 0.4
                    toks = ids(rand_tokens(rng, rng.randint(1, 20) if first else 1))
                    if role == "target":
                        seqs.append(pb.VerifySeq(seq_id=sid, new_tokens=toks, first=first,
                                                 draft_tokens=ids(rand_tokens(rng, rng.randint(0, 3)))))
                    else:
                        seqs.append(pb.DraftSeq(seq_id=sid, new_tokens=toks, first=first, keep=0,
                                                num_draft=rng.randint(0, MAX_DRAFT), sampling=rand_sampling(rng)))
                release = rng.sample(range(300, 304), rng.randint(0, 1)) + [2**64 - 1]
                req = (pb.VerifyRequest if role == "target" else pb.ProposeRequest)(
                    step=rng.getrandbits(64), seqs=seqs, release=release)
                r = s.step(req)
                for i, x in enumerate(r.results):
                    if not x.HasField("error"):
                        (check_verify_ok if role == "target" else check_draft_ok)(req.seqs[i], x)
            s.close()
        except BaseException as e:   # noqa: BLE001  (reported by the main thread)
            failures.append(f"{role} stream {k}: {e!r}")
    failures: list[str] = []
    threads = [threading.Thread(target=worker, args=(role, k, failures))
               for role in ("draft", "target") for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert not failures, failures
    release_all(servers, range(300, 304))
    healthy(servers)


def test_cancelled_expired_and_half_closed_streams(servers):
    # Cancelled mid-step: a prompt step (engine thread) and a big sampled proposal, cancelled at once.
    t = Stream(servers.target.Verify)
    t.send(pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=400 + i, new_tokens=ids([3] * 100), first=True,
                                                       draft_tokens=ids([4] * 3)) for i in range(2)]))
    d = Stream(servers.draft.Propose)
    d.send(pb.ProposeRequest(step=1, seqs=[pb.DraftSeq(seq_id=400 + i, new_tokens=ids([3] * 40), first=True,
                                                       num_draft=MAX_DRAFT, sampling=SEEDED) for i in range(4)]))
    time.sleep(0.005)
    t.call.cancel()
    d.call.cancel()
    for s in (t, d):
        end = s.receive()
        assert isinstance(end, grpc.RpcError) or hasattr(end, "results"), describe(end)
    healthy(servers)
    # Cancelled while idle, after a served step.
    t = Stream(servers.target.Verify)
    t.step(pb.VerifyRequest(step=2, seqs=[pb.VerifySeq(seq_id=410, new_tokens=ids([3, 4]), first=True)]))
    t.call.cancel()
    assert isinstance(t.receive(), grpc.RpcError)
    # A deadline that passes mid-stream ends it with DEADLINE_EXCEEDED; the next stream is served.
    d = Stream(servers.draft.Propose, deadline=2.0)
    d.step(pb.ProposeRequest(step=3, seqs=[pb.DraftSeq(seq_id=411, new_tokens=ids([3]), first=True, num_draft=2)]))
    time.sleep(2.5)
    d.send(pb.ProposeRequest(step=4, seqs=[pb.DraftSeq(seq_id=411, keep=2, new_tokens=ids([3]), num_draft=2)]))
    end = d.receive()
    assert isinstance(end, grpc.RpcError) and end.code() == grpc.StatusCode.DEADLINE_EXCEEDED, describe(end)
    # Half-closed with a step in flight: the step is answered, then the stream ends OK.
    t = Stream(servers.target.Verify)
    t.send(pb.VerifyRequest(step=5, seqs=[pb.VerifySeq(seq_id=412, new_tokens=ids([3] * 60), first=True)]))
    t.send(_END)
    r = t.receive()
    assert hasattr(r, "results") and not r.results[0].HasField("error"), describe(r)
    assert t.receive() == "end"
    # Nothing sent at all: an empty stream ends OK.
    e = Stream(servers.target.Verify)
    e.close()
    release_all(servers, list(range(400, 404)) + [410, 411, 412])
    healthy(servers)


# --- the random fuzz ---------------------------------------------------------------------------
def fuzz_server(servers: Servers, role: str, rng: random.Random, steps: int, stats: dict) -> list[int]:
    """`steps` random steps on two streams of one server, each checked against the shadow, with the
    server's Info compared to it after every step. Returns every id used."""
    shadow = DraftShadow() if role == "draft" else TargetShadow()
    stub = servers.stub(role)
    method = stub.Verify if role == "target" else stub.Propose
    streams = [Stream(method), Stream(method)]
    pool = [0, 2**64 - 1, 2**63 - 1] + list(range(10_000, 10_009))
    held = (lambda: set(shadow.seqs)) if role == "draft" else (lambda: set(shadow.kv))
    Request = pb.ProposeRequest if role == "draft" else pb.VerifyRequest
    for n in range(steps):
        where = f"{role} step {n} (SPECDEC_FUZZ_SEED={SEED})"
        if rng.random() < 0.08:   # a Release call between steps, with unknown and repeated ids
            gone = rng.sample(pool, rng.randint(0, 5)) + [2**62 + rng.randrange(10**6)]
            gone += gone[:1]
            reply = stub.Release(pb.ReleaseRequest(seq_ids=gone), timeout=10)
            assert reply.released == len(set(gone) & held()), where
            for sid in gone:
                (shadow.seqs if role == "draft" else shadow.kv).pop(sid, None)
            assert reply.kv_blocks_free == NUM_BLOCKS - shadow.kv_blocks(), where
        release = []
        if rng.random() < 0.3:
            release = rng.sample(sorted(held()), min(len(held()), rng.randint(0, 2))) + [2**62 + 5]
            release += release[:1]
            for sid in release:
                (shadow.seqs if role == "draft" else shadow.kv).pop(sid, None)
        width = rng.choice([0, 1, 2, 3, 4, 5, 8, len(pool)])
        ops: list[Op] = []
        for sid in rng.sample(pool, min(width, len(pool))):
            if rng.random() < 0.3:
                ops.append(shadow.mutated(rng, sid, 2**62 + rng.randrange(10**6)))
            else:
                ops.append(shadow.valid(rng, sid))
        valid = [op for op in ops if op.expect is None]
        if valid and rng.random() < 0.15:   # the same id twice in one step: the later one fails alone
            original = rng.choice(valid)
            dup = type(original.msg)()
            dup.CopyFrom(original.msg)
            ops.insert(rng.randint(ops.index(original) + 1, len(ops)), Op(dup, (INVALID, "seq_id"), why="duplicate"))
        step_no = rng.choice([n, 0, 2**64 - 1, rng.getrandbits(64), max(n - 3, 0)])
        req = Request(step=step_no, seqs=[op.msg for op in ops], release=release)
        r = rng.choice(streams).step(req)
        budget = {"impl": NUM_BLOCKS - shadow.kv_blocks()}
        budget["spec"] = budget["impl"]
        seen: set[int] = set()
        for i, (op, res) in enumerate(zip(ops, r.results)):
            what = f"{where}: seqs[{i}] {op.why}"
            if op.expect is not None:
                expect_error(res, *op.expect, what=what)
                stats[op.why.split("=")[0]] = stats.get(op.why.split("=")[0], 0) + 1
                continue
            assert op.msg.seq_id not in seen, what
            seen.add(op.msg.seq_id)
            outcome = shadow.admit(op, budget)
            if res.HasField("error"):
                assert res.error.code == EXHAUSTED and "kv cache" in res.error.message, \
                    f"{what}: a valid sequence refused: {res.error.code} {res.error.message!r}"
                assert outcome != "ok", f"{what}: refused though {op.plan['need']} blocks of {budget} were free"
                stats["exhausted"] = stats.get("exhausted", 0) + 1
                stats["exhausted_spuriously"] = stats.get("exhausted_spuriously", 0) + (outcome == "either")
                shadow.refused(op)
            else:
                assert outcome != "exhausted", f"{what}: served {op.plan['need']} blocks with only {budget} free"
                if role == "draft":
                    shadow.served(op, budget, check_draft_ok(op.msg, res))
                else:
                    check_verify_ok(op.msg, res)
                    shadow.served(op, budget, res)
                stats["served"] = stats.get("served", 0) + 1
        info = stub.Info(pb.InfoRequest(), timeout=10)
        assert (info.num_sequences, info.kv_blocks_free) == (len(held()), NUM_BLOCKS - shadow.kv_blocks()), \
            f"{where}: Info {info.num_sequences} seqs / {info.kv_blocks_free} free blocks, shadow {len(held())} / " \
            f"{NUM_BLOCKS - shadow.kv_blocks()} after {[(op.msg.seq_id, op.why) for op in ops]}, release {release}"
    for s in streams:
        s.close()
    return pool


def test_random_fuzz(servers):
    rng = random.Random(SEED)
    stats: dict[str, int] = {}
    t0 = time.perf_counter()
    used = []
    for role in ("draft", "target"):
        used += fuzz_server(servers, role, rng, RANDOM_STEPS, stats)
        healthy(servers)
    release_all(servers, used)
    print(f"fuzz seed {SEED}: {RANDOM_STEPS} steps per server in {time.perf_counter() - t0:.1f}s; {stats}")
    assert stats.get("served", 0) > RANDOM_STEPS and stats.get("exhausted", 0) > 0


# --- after everything --------------------------------------------------------------------------
def test_servers_unharmed_after_the_fuzz(servers, reference):
    healthy(servers)
    infos = release_all(servers, [])
    for role, info in infos.items():
        assert info.vocab_size == V and info.max_model_len == MAX_LEN and info.max_num_draft == MAX_DRAFT
    assert speculate(servers, 2**64 - 2) == reference   # the same bytes as before the fuzz
    assert speculate(servers, 5) == reference
    # No ERROR in either log (undecodable requests included: they are bad input, logged at INFO).
    for role, proc in servers.procs.items():
        records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", proc.log_path.read_text(errors="replace"))
        bad = [r for r in records if " ERROR " in r or "Traceback" in r]
        assert not bad, f"{role} log:\n" + "\n".join(bad[:3])
