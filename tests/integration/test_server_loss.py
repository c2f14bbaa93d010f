"""A model server that loses sequences mid-generation, as real processes on loopback: the target or
the draft drops them (Release from outside: the server answers NOT_FOUND on the next step) or dies
and comes back on its port. Each request still completes with exactly the greedy output of an
undisturbed plain-decoding run (the lossless invariant), and no KV is left behind."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from coordinator.client import Client
from coordinator.launch import restart
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from tests.helpers.cluster import all_free, tiny_cluster, wait_kv_free

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):"]
LONG = {"ignore_eos": True, "max_new_tokens": 200}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # prefill_chunk 16: a resend of prompt + output is chunked like a long prompt.
    with tiny_cluster(tmp_path_factory.mktemp("loss"),
                      coordinator_args=["--max-batch-size", "4", "--num-draft", "4", "--prefill-chunk", "16",
                                        "--draft-retry", "0.5", "--connect-timeout", "60",
                                        "--seq-id-base", "1"]) as c:   # (release_everything: ids 1..999)
        yield c


def ids_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def reference(cluster):
    with Client(cluster.coordinator) as client:
        return {p: ids_of(client.generate(p, speculate=False, **LONG)) for p in PROMPTS}


def coordinator_log(cluster) -> str:
    return cluster.procs["coordinator"].log_path.read_text(errors="replace")


def generate_through(cluster, prompts: list[str], disturb) -> dict[str, list]:
    """Starts one speculative stream per prompt, lets each emit its first chunk, calls disturb(),
    then reads every stream to its end; returns each prompt's chunks."""
    with Client(cluster.coordinator) as client:
        streams = {p: client.generate(p, num_draft=4, timeout=120, **LONG) for p in prompts}
        heads = {p: next(s) for p, s in streams.items()}  # generation is under way
        disturb()
        return {p: [heads[p], *s] for p, s in streams.items()}


def release_everything(address: str, role: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = (pb_grpc.DraftStub if role == "draft" else pb_grpc.TargetStub)(channel)
        return stub.Release(pb.ReleaseRequest(seq_ids=range(1, 1000)), timeout=10).released


def kill_and_restart(cluster, name: str) -> None:
    proc = cluster.procs[name]
    proc.popen.kill()  # a crash: no drain, the step stream breaks mid-step
    proc.popen.wait(10)
    restart(proc)


def assert_exact(chunks: dict[str, list], reference: dict[str, list[int]]) -> None:
    for prompt, got in chunks.items():
        assert ids_of(got) == reference[prompt], prompt
        assert got[-1].finish_reason == "length"


@pytest.mark.parametrize("role", ["target", "draft"])
def test_lost_sequences_are_resent_exactly(cluster, reference, role):
    """The server forgets every sequence between two steps (NOT_FOUND on the next one)."""
    address = cluster.target if role == "target" else cluster.draft
    released = []
    chunks = generate_through(cluster, PROMPTS[:2], lambda: released.append(release_everything(address, role)))
    assert released[0] >= 1  # it held the running sequences (else nothing was lost)
    assert_exact(chunks, reference)
    log = coordinator_log(cluster)
    assert "unknown to this server" in log if role == "target" else "draft lost sequence" in log
    assert all_free(wait_kv_free(cluster))


def test_target_restart_mid_generation_is_exact(cluster, reference):
    """The target dies mid-step and comes back: the coordinator waits for it, resends every running
    sequence from the start (chunked), and the clients see the undisturbed output, no error."""
    chunks = generate_through(cluster, PROMPTS, lambda: kill_and_restart(cluster, "target_server"))
    assert_exact(chunks, reference)
    assert "target server failed" in coordinator_log(cluster)
    assert all_free(wait_kv_free(cluster))


def test_draft_restart_mid_generation_is_exact(cluster, reference):
    """The draft dies mid-generation: plain decoding meanwhile, then speculation again on the new
    draft server (sequences resent with `first`); the output stays exact."""
    late: dict[str, list] = {}

    def disturb():
        kill_and_restart(cluster, "draft_server")
        # Admitted while the draft may still be down: its first proposal carries the whole context.
        thread = threading.Thread(target=lambda: late.update(
            generate_through(cluster, PROMPTS[2:], lambda: None)))
        thread.start()
        disturb.thread = thread

    chunks = generate_through(cluster, PROMPTS[:2], disturb)
    disturb.thread.join(120)
    assert_exact({**chunks, **late}, reference)
    # The new draft server may still be loading when those requests end (a loaded CI machine): the
    # coordinator resumes speculation once it answers; wait for that, bounded.
    deadline = time.monotonic() + 90
    while "speculation resumes" not in coordinator_log(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "speculation resumes" in coordinator_log(cluster)
    with Client(cluster.coordinator) as client:  # speculating again, still exact
        again = list(client.generate(PROMPTS[0], num_draft=4, **LONG))
    assert again[-1].usage.draft_tokens > 0 and ids_of(again) == reference[PROMPTS[0]]
    assert all_free(wait_kv_free(cluster))


def test_a_target_that_keeps_losing_a_sequence_ends_it_cleanly(cluster, reference):
    """Released again and again: after its resends the request ends with UNAVAILABLE and a clear
    message (or, if a resend got through, with the exact output); never wrong tokens, never a hang."""
    stop = threading.Event()

    def keep_releasing():
        while not stop.is_set():
            release_everything(cluster.target, "target")

    spammer = threading.Thread(target=keep_releasing)
    got: list[int] = []
    try:
        with Client(cluster.coordinator) as client:
            stream = client.generate(PROMPTS[1], num_draft=4, timeout=60, **LONG)
            got += next(stream).token_ids
            spammer.start()
            with pytest.raises(grpc.RpcError) as err:
                for chunk in stream:
                    got += chunk.token_ids
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "again after 2 resends" in err.value.details()
    except pytest.fail.Exception:
        assert got == reference[PROMPTS[1]]  # it completed despite the releases: still exact
    finally:
        stop.set()
        if spammer.is_alive():
            spammer.join(10)
    assert got == reference[PROMPTS[1]][:len(got)]
    assert all_free(wait_kv_free(cluster))
