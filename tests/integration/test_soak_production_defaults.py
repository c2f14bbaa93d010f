"""Soak of the production-default serving combination, three real processes on loopback, tiny models.

The chaos review (test_chaos_review.py) runs its burst with the coordinator's defaults on a CPU
(no --pipeline for most of it, --gamma fixed, no --verify-ahead on the target, one KV size, and
--max-waiting 128 so that nothing is refused for capacity). On a GPU the defaults differ: the target
stages the next step ahead (--verify-ahead), the draft drafts ahead during the verify (--pipeline),
and a deployment sizes --max-waiting / --spec-max-batch / --gamma. This soak drives that
combination, with a draft that has less KV than the target (so some requests decode plainly for
want of draft KV), a small batch and queue (so requests are refused with RESOURCE_EXHAUSTED under
load), chunked prompts, and a mixed workload: greedy and seeded sampled requests, stop strings and
stop token ids, speculation on/off and num_draft 1..8, clients that cancel before the first token or
mid-stream, very short deadlines, requests over the KV limit and invalid ones.

Checked afterwards: (1) every stream ended within HANG_S with a status the docs allow for what its
client did (a capacity refusal is the coordinator's "capacity:" message, never a server's KV
refusal); (2) every greedy stream's tokens are (a prefix of) plain decoding's, exactly when
completed, and plain seeded sampled streams equal their undisturbed run; (3) both servers hold no
KV block and no sequence (Info and their /metrics gauges), the coordinator runs nothing; (4) all
processes alive and healthy, a fresh speculative request equals plain decoding, and two requests
that need the whole target KV between them are admitted side by side (no leaked reservation); no
Traceback or ERROR in any log.

Seed: SPECDEC_SOAK_SEED (default 39).
"""
from __future__ import annotations

import asyncio
import os
import random
import time
import urllib.request

import grpc
import pytest

from coordinator.client import Chunk, Client, build_request
from protos import specdec_pb2_grpc as pb_grpc
from tests.helpers.workload import (SHORT_PROMPTS, Outcome, Planned, Recipe, Reference, collect, run_alone,
                                    stream_problems)
from tests.helpers.cluster import (all_free, assert_alive_and_serving, log_offsets, logged_lines, side_by_side,
                                   tiny_cluster, wait_kv_free)

SEED = int(os.environ.get("SPECDEC_SOAK_SEED", "39"))
TARGET_BLOCKS = 64            # 16 tokens each: two 512-token requests fill the target
DRAFT_BLOCKS = 40             # fewer: a second long request decodes plainly
MAX_BATCH = 4
MAX_WAITING = 6
SPREAD_S = 6.0                # requests start within this many seconds
HANG_S = 45.0                 # no stream may take longer than this to end
OK, CANCELLED, DEADLINE = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with tiny_cluster(tmp_path_factory.mktemp("soak"),
                      server_args=["--num-blocks", str(DRAFT_BLOCKS)],
                      target_args=["--num-blocks", str(TARGET_BLOCKS), "--verify-ahead"],
                      coordinator_args=["--max-batch-size", str(MAX_BATCH), "--max-waiting", str(MAX_WAITING),
                                        "--num-draft", "4", "--gamma", "auto", "--spec-max-batch", "3",
                                        "--prefill-chunk", "32", "--pipeline", "--draft-retry", "0.5"]) as c:
        yield c


# --- requests ----------------------------------------------------------------------------------
PROMPTS = SHORT_PROMPTS
LONG_PROMPT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 6  # chunked (> 32 tokens)


def base_recipes(rng: random.Random) -> dict[str, Recipe]:
    r = [Recipe(f"greedy[{i}]", p, {"max_new_tokens": rng.choice([24, 40]), "ignore_eos": True})
         for i, p in enumerate(PROMPTS)]
    r += [Recipe("greedy-eos", PROMPTS[0], {"max_new_tokens": 64}),
          Recipe("one-token", PROMPTS[1], {"max_new_tokens": 1, "ignore_eos": True}),
          Recipe("long-prompt", LONG_PROMPT, {"max_new_tokens": 48, "ignore_eos": True}),
          Recipe("long-ids", list(range(1, 251)), {"max_new_tokens": 60, "ignore_eos": True}),
          # ends at max_model_len (512): the last steps' drafts and staged-ahead steps are cut to fit
          Recipe("to-max-len", [rng.randrange(1, 320) for _ in range(490)], {"max_new_tokens": 100,
                                                                            "ignore_eos": True}),
          Recipe("at-max-len", [rng.randrange(1, 320) for _ in range(511)], {"max_new_tokens": 5})]
    r += [Recipe("sampled[0]", PROMPTS[2], {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0.8,
                                            "top_k": 40, "seed": 5}, "sampled"),
          Recipe("sampled[1]", PROMPTS[4], {"max_new_tokens": 32, "ignore_eos": True, "temperature": 1.1,
                                            "top_p": 0.9, "min_p": 0.02, "seed": 6, "num_draft": 3}, "sampled"),
          Recipe("sampled-plain", PROMPTS[5], {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0.9,
                                               "seed": 7, "speculate": False}, "sampled-plain")]
    r += [Recipe("bad-num_draft", PROMPTS[3], {"num_draft": 99}, "invalid", INVALID, "num_draft"),
          Recipe("bad-token", [3, 999], {}, "invalid", INVALID, "token id 999"),
          Recipe("bad-stop", PROMPTS[3], {"stop": ["x", ""]}, "invalid", INVALID, "stop[1]")]
    return {x.name: x for x in r}


def printable_pair(text: str, rng: random.Random) -> str | None:
    spots = [i for i in range(3, len(text) - 2) if all(33 <= ord(ch) < 127 for ch in text[i:i + 2])]
    return text[(i := rng.choice(spots)):i + 2] if spots else None


@pytest.fixture(scope="module")
def references(cluster):
    """Each recipe's output alone, before the soak: greedy ones by plain decoding."""
    rng = random.Random(SEED)
    recipes = base_recipes(rng)
    refs: dict[str, Reference] = {}
    with Client(cluster.coordinator) as client:
        for r in list(recipes.values()):
            if r.kind == "greedy":
                refs[r.name] = run_alone(client, r, speculate=False)
            elif r.kind in ("sampled", "sampled-plain"):
                refs[r.name] = run_alone(client, r)
        for i in (0, 2, 4):  # stop strings and a stop token taken from the outputs, so they do stop
            base = recipes[f"greedy[{i}]"]
            stop = printable_pair(refs[base.name].text, rng)
            if stop is not None:
                s = Recipe(f"stop-string[{i}]", base.prompt, {**base.params, "stop": ["\x07never", stop]})
                recipes[s.name], refs[s.name] = s, run_alone(client, s, speculate=False)
                assert refs[s.name].finish == "stop" and stop not in refs[s.name].text
        base = recipes["greedy[1]"]
        s = Recipe("stop-token", base.prompt, {**base.params, "stop_token_ids": [refs[base.name].tokens[7]]})
        recipes[s.name], refs[s.name] = s, run_alone(client, s, speculate=False)
        assert refs[s.name].finish == "stop"
    return recipes, refs


# --- the soak ----------------------------------------------------------------------------------
BEHAVIOURS = ("read-all", "read-all", "read-all", "cancel-before-first", "cancel-mid", "deadline", "stall")
ALLOWED = {"read-all": {OK, EXHAUSTED}, "stall": {OK, EXHAUSTED}, "cancel-before-first": {CANCELLED, OK, EXHAUSTED},
           "cancel-mid": {CANCELLED, OK, EXHAUSTED}, "deadline": {DEADLINE, OK, EXHAUSTED}}


def make_plan(recipes: dict[str, Recipe], rng: random.Random, n: int) -> list[Planned]:
    valid = [r for r in recipes.values() if r.kind != "invalid"]
    other = [r for r in recipes.values() if r.kind == "invalid"]
    plan = []
    for i in range(n):
        recipe = rng.choice(other) if rng.random() < 0.1 else rng.choice(valid)
        behaviour = "read-all" if recipe.kind == "invalid" else rng.choice(BEHAVIOURS)
        p = Planned(i, recipe, behaviour, delay=rng.uniform(0, SPREAD_S))
        if recipe.kind == "greedy":
            p.extra = rng.choice([{"speculate": False}, {}, {"speculate": True},
                                  {"num_draft": rng.randint(1, 8)}, {"num_draft": rng.randint(1, 8)}])
        if behaviour == "deadline":
            p.timeout = rng.choice([0.001, rng.uniform(0.005, 0.05), rng.uniform(0.05, 0.6)])
        elif behaviour == "cancel-mid":
            p.cut = rng.randint(1, 4)
        elif behaviour == "stall":
            p.cut, p.pause = rng.randint(1, 3), rng.uniform(0.2, 1.0)
        plan.append(p)
    # A spike: more requests at one moment than batch + queue hold (some are refused for capacity).
    long_ones = [r for r in valid if r.kind == "greedy" and r.params["max_new_tokens"] >= 40]
    for j in range(MAX_BATCH + MAX_WAITING + 6):
        plan.append(Planned(n + j, rng.choice(long_ones), "read-all", delay=SPREAD_S / 2,
                            extra=rng.choice([{}, {"speculate": False}, {"num_draft": rng.randint(1, 8)}])))
    return plan


async def run_one(stub, p: Planned) -> Outcome:
    out = Outcome(p)
    await asyncio.sleep(p.delay)
    call = stub.Generate(p.recipe.request(**p.extra), timeout=p.timeout)
    try:
        if p.behaviour == "cancel-before-first":
            await asyncio.sleep(0)
            call.cancel()
        else:
            while True:
                if p.behaviour == "cancel-mid" and len(out.chunks) >= p.cut:
                    call.cancel()
                    break
                if p.behaviour == "stall" and len(out.chunks) == p.cut:
                    await asyncio.sleep(p.pause)
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                out.chunks.append(Chunk.from_pb(response))
        out.code, out.details = await call.code(), await call.details()
    except grpc.aio.AioRpcError as e:
        out.code, out.details = e.code(), e.details() or ""
    return out


async def soak(address: str, plan: list[Planned]) -> list[Outcome]:
    channels = [grpc.aio.insecure_channel(address) for _ in range(3)]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]

    async def guarded(p: Planned) -> Outcome:
        try:
            return await asyncio.wait_for(run_one(stubs[p.index % 3], p), HANG_S + p.delay)
        except asyncio.TimeoutError:
            return Outcome(p, hung=True)
    try:
        return list(await asyncio.gather(*(guarded(p) for p in plan)))
    finally:
        for c in channels:
            await c.close()


@pytest.fixture(scope="module")
def soaked(cluster, references):
    recipes, refs = references
    plan = make_plan(recipes, random.Random(SEED + 1), n=150)
    offsets = log_offsets(cluster)
    t0 = time.monotonic()
    outcomes = asyncio.run(soak(cluster.coordinator, plan))
    counts: dict[str, int] = {}
    for o in outcomes:
        key = "HUNG" if o.hung else o.code.name
        counts[key] = counts.get(key, 0) + 1
    print(f"\nsoak seed {SEED}: {len(plan)} requests in {time.monotonic() - t0:.1f}s: {counts}")
    return outcomes, recipes, refs, offsets, counts


def violations(o: Outcome, refs: dict[str, Reference]) -> list[str]:
    p, r = o.plan, o.plan.recipe
    bad, finishes = stream_problems(o, HANG_S)
    if finishes is None:
        return bad
    if r.kind == "invalid":
        if o.code != r.code or r.message not in o.details or o.chunks:
            bad.append(f"expected {r.code.name} {r.message!r}, got {o.code.name} {o.details!r}")
        return bad
    if o.code not in ALLOWED[p.behaviour]:
        bad.append(f"status {o.code.name} {o.details!r}")
    if o.code == EXHAUSTED and (o.chunks or not o.details.startswith("capacity:")):
        bad.append(f"RESOURCE_EXHAUSTED after {len(o.chunks)} chunks: {o.details!r}")
    if o.code == OK and not finishes:
        bad.append("status OK without a last chunk")
    tokens, text = collect(o.chunks)
    if r.kind == "sampled":  # speculative sampled: exact only for a fixed speculation schedule
        if finishes:
            last = o.chunks[-1]
            if (last.usage.completion_tokens != len(tokens) or last.finish_reason != "length"
                    or len(tokens) != r.params["max_new_tokens"]):
                bad.append(f"completed with {len(tokens)} tokens, {last.finish_reason}, {last.usage}")
        return bad
    ref = refs[r.name]
    if finishes:
        last = o.chunks[-1]
        if (tokens, text, last.finish_reason) != (ref.tokens, ref.text, ref.finish):
            bad.append(f"completed with {tokens} {text!r} {last.finish_reason}; "
                       f"expected {ref.tokens} {ref.text!r} {ref.finish}")
        if last.usage.completion_tokens != len(tokens):
            bad.append(f"usage {last.usage} for {len(tokens)} tokens")
    elif tokens != ref.tokens[:len(tokens)]:
        bad.append(f"received {tokens}, not a prefix of {ref.tokens}")
    return bad


# --- the checks --------------------------------------------------------------------------------
def test_every_stream_ends_with_an_allowed_status_and_exact_output(soaked):
    outcomes, recipes, refs, _, counts = soaked
    problems = [f"{o.plan.describe()}: {v}" for o in outcomes for v in violations(o, refs)]
    assert not problems, f"seed {SEED}:\n" + "\n".join(problems)
    # the soak did what it set out to do
    assert counts.get("OK", 0) >= 20 and counts.get("CANCELLED", 0) >= 5, counts
    assert counts.get("RESOURCE_EXHAUSTED", 0) >= 3 and counts.get("DEADLINE_EXCEEDED", 0) >= 3, counts
    spec_done = [o for o in outcomes if o.code == OK and o.plan.recipe.kind == "greedy"
                 and o.plan.extra.get("speculate") is not False and o.chunks[-1].usage.draft_tokens > 0]
    assert len(spec_done) >= 3  # greedy streams that did speculate and completed exactly


def metrics_of(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def gauge(samples: dict[str, float], name: str) -> list[float]:
    return [v for k, v in samples.items() if k == name or k.startswith(name + "{")]


def test_nothing_held_afterwards(cluster, soaked):
    infos = wait_kv_free(cluster, timeout=15)
    assert all_free(infos), {role: (i.kv_blocks_free, i.kv_blocks_total, i.num_sequences)
                             for role, i in infos.items()}
    assert infos["target"].kv_blocks_total == TARGET_BLOCKS and infos["draft"].kv_blocks_total == DRAFT_BLOCKS
    for role in ("target", "draft"):
        m = metrics_of(cluster.metrics[role])
        assert gauge(m, "specdec_kv_blocks_used") == [0.0], (role, gauge(m, "specdec_kv_blocks_used"))
        assert gauge(m, "specdec_running_sequences") == [0.0], role
    m = metrics_of(cluster.metrics["coordinator"])
    assert gauge(m, "specdec_running_sequences") == [0.0]


def test_servers_healthy_exact_and_reservations_returned(cluster, soaked):
    _, recipes, refs, _, _ = soaked
    assert_alive_and_serving(cluster)
    with Client(cluster.coordinator) as client:
        for name in ("greedy[0]", "long-prompt", "stop-token", "sampled-plain"):
            assert run_alone(client, recipes[name], num_draft=4) == refs[name], name
        spec = list(client.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True, num_draft=4))
        assert spec[-1].usage.draft_tokens > 0  # the draft is still in use
    # Two requests of 512 tokens need all 64 target blocks between them: both run side by side
    # unless a block or a reservation leaked.
    fill = Recipe("fill", list(range(1, 301)), {"max_new_tokens": 212, "ignore_eos": True})
    (a, b), most = side_by_side(cluster, fill.request(num_draft=4))
    a, b = ([Chunk.from_pb(r) for r in run] for run in (a, b))
    assert collect(a)[0] == collect(b)[0] and len(collect(a)[0]) == 212
    assert most == 2
    assert all_free(wait_kv_free(cluster))


def test_no_error_in_any_log(cluster, soaked):
    """(Failed before bug 1 below was fixed: a short-deadline request that the coordinator refused
    logged two ERRORs with tracebacks when its deadline passed first.)"""
    offsets = soaked[3]
    assert not logged_lines(cluster, offsets)


# --- bug 1 (found by this soak; fixed) ---------------------------------------------------------
# A request whose deadline passed (or whose client cancelled) after the coordinator's Generate
# started but before it answered with an immediate status (INVALID_ARGUMENT from validation,
# RESOURCE_EXHAUSTED from the scheduler, UNAVAILABLE after a failure): context.abort() on the
# already finished call raises cygrpc's ExecuteBatchError, not AbortError. ErrorInterceptor took it
# for a handler crash: it counted specdec_errors_total{code="INTERNAL"}, logged ERROR "Generate
# failed" with a traceback, and called context.abort() a second time ("Abort already called!", a
# second ERROR). The client was unaffected, but every short-deadline client of a loaded or strict
# coordinator paged whoever alerts on INTERNAL / ERROR. Now Generate's refusals (service._abort)
# see that the call is over and record the client's end, and the interceptor does not abort a call
# that is over.
BUG1_DEADLINES = (0.0005, 0.001, 0.002, 0.003, 0.005)


def test_a_refused_request_whose_deadline_passed_is_not_an_internal_error(cluster, soaked):
    offsets = log_offsets(cluster)
    before = metrics_of(cluster.metrics["coordinator"])
    internal = 'specdec_errors_total{code="INTERNAL",role="coordinator"}'

    async def main():
        async with grpc.aio.insecure_channel(cluster.coordinator) as channel:
            stub = pb_grpc.GenerationStub(channel)
            # A running request keeps the coordinator's event loop busy with steps (the race needs it).
            busy = stub.Generate(build_request(PROMPTS[0], max_new_tokens=400, ignore_eos=True), timeout=60)
            await busy.read()
            codes = []
            for i in range(200):  # ~5% of these race the deadline (measured: 4-8 per 100)
                call = stub.Generate(build_request("hi", max_new_tokens=0),
                                     timeout=BUG1_DEADLINES[i % len(BUG1_DEADLINES)])
                try:
                    codes.append(await call.code())
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            busy.cancel()
            return codes
    codes = asyncio.run(main())
    assert set(codes) <= {INVALID, DEADLINE}, set(codes)
    assert all_free(wait_kv_free(cluster))
    after = metrics_of(cluster.metrics["coordinator"])
    assert after[internal] == before.get(internal, 0.0), "INTERNAL errors counted for requests the client ended"
    assert not logged_lines(cluster, offsets)


# --- bug 2 (found by this soak; fixed): a deadline was counted as a cancel ----------------------
# A client whose deadline expired mid-generation ended with DEADLINE_EXCEEDED but was counted as
# specdec_requests_total{code="CANCELLED"}, which the dashboard's failure ratio (code!~"OK|CANCELLED")
# leaves out, so deadline misses never showed as failures. Now a call the client ended is counted
# DEADLINE_EXCEEDED once its deadline has passed (service._client_end).
def test_a_deadline_expired_mid_generation_is_counted_as_deadline_exceeded(cluster, soaked):
    series = 'specdec_requests_total{code="DEADLINE_EXCEEDED"}'
    before = metrics_of(cluster.metrics["coordinator"]).get(series, 0.0)
    with Client(cluster.coordinator) as client:
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate(PROMPTS[0], max_new_tokens=400, ignore_eos=True, timeout=0.3))
    assert e.value.code() == DEADLINE
    assert all_free(wait_kv_free(cluster))
    assert metrics_of(cluster.metrics["coordinator"]).get(series, 0.0) == before + 1
