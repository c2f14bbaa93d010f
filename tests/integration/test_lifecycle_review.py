"""Process lifecycle review, as an operator meets it, with real processes on loopback (tiny models).

What works (plain tests):
- SIGTERM to the coordinator with streams in flight: past --grace the clients end at once with
  UNAVAILABLE, the coordinator exits 0 and every KV block on both servers is free again.
- The target SIGKILLed mid-stream and not back within --connect-timeout: the streams end with
  UNAVAILABLE naming the target, the draft holds nothing; the target back on its port is used again.
- A coordinator started before its servers waits for them (bounded: one that never comes ends
  the coordinator with exit 1 and a message naming the server); it holds its port meanwhile,
  health NOT_SERVING, and refuses calls with UNAVAILABLE saying what it waits for.
- `specdec serve`: a child that dies stops the other two (exit 1), and nothing is left running.

Bugs found (2, 3 and 5 fixed: coordinator/app.py's random sequence-id base, SO_REUSEPORT off on
every gRPC server, and `specdec serve`'s children asking for SIGTERM when it dies (launch.py's
DIE_WITH_PARENT); 1 by specdec/serving/owners.py (the servers free the sequences of a coordinator
gone for --orphan-timeout); 4 by Coordinator.check_target):
1. A coordinator that dies without its shutdown (SIGKILL, OOM) leaves its sequences' KV on both
   servers for good: the servers free a sequence only on Release, never when the coordinator's
   step connection ends. A fresh coordinator then gets RESOURCE_EXHAUSTED from the target for a
   request that fits the (idle) cluster.
2. Two coordinators on the same servers corrupt each other's outputs: both number sequences
   1, 2, 3 ... and the servers key KV by that id alone, so the second coordinator's `first` message
   drops the first one's sequence and the first one's next step continues the second's context.
3. A second server (or coordinator) started on a port a running one holds starts and serves: gRPC
   binds with SO_REUSEPORT, and the kernel spreads new connections over the two processes.
4. A target restarted while the coordinator is idle is not read afresh: its new limits (here a
   smaller KV) are never taken, so a request the coordinator should refuse at admission streams
   tokens and then fails with the target's RESOURCE_EXHAUSTED (and keeps doing so).
5. `specdec serve` killed with SIGKILL leaves its three children running (new sessions, no parent
   death signal): ports held, and a new `specdec serve` on the same --port starts beside them (3.).
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import launch
from coordinator.client import Client
from coordinator.launch import (REPO_ROOT, Proc, free_port, restart, spawn_server, start_healthy, start_process,
                                stop_all)
from tests.helpers.cluster import server_info
from tests.helpers.procs import alive, proc_children
from tests.helpers.tiny_models import make_pair

NUM_BLOCKS = 64          # per server, 16 tokens each
ORPHAN_TIMEOUT_S = 2.0
SERVER_ARGS = ["--warmup-batch-sizes", "1", "--num-blocks", str(NUM_BLOCKS), "--orphan-timeout", str(ORPHAN_TIMEOUT_S)]
LONG = {"max_new_tokens": 400, "ignore_eos": True}


# --- helpers -------------------------------------------------------------------------------------
class Servers:
    def __init__(self, root: Path):
        self.root = root
        self.target_path, self.draft_path = make_pair(root / "models")
        self.logs = root / "logs"
        self.logs.mkdir()
        self.target = spawn_server("target", self.target_path, self.logs, args=SERVER_ARGS)
        self.draft = spawn_server("draft", self.draft_path, self.logs, args=SERVER_ARGS)
        for p in (self.target, self.draft):
            start_healthy(p, 120)

    def held(self) -> dict[str, tuple[int, int]]:
        """role -> (KV blocks used, sequences held)."""
        out = {}
        for role, proc in (("target", self.target), ("draft", self.draft)):
            i = server_info(proc.address, role)
            out[role] = (i.kv_blocks_total - i.kv_blocks_free, i.num_sequences)
        return out

    def wait_free(self, timeout: float = 5.0) -> dict[str, tuple[int, int]]:
        deadline = time.monotonic() + timeout
        while True:
            held = self.held()
            if all(v == (0, 0) for v in held.values()) or time.monotonic() > deadline:
                return held
            time.sleep(0.1)

    def start_afresh_if_held(self) -> None:
        """Frees whatever a test left behind: the servers start afresh when they hold anything (a
        coordinator's sequence ids start at a random base, so they cannot be released by range)."""
        if any(n for _, n in self.held().values()):
            for proc in (self.target, self.draft):
                restart(proc)


def start_coordinator(log_dir: Path, target: str, draft: str | None = None, args=(), name="coordinator",
                      wait: bool = True, port: int | None = None) -> Proc:
    port = port or free_port()
    argv = [sys.executable, "-m", "coordinator", "--target", target, "--host", "127.0.0.1", "--port", str(port),
            *args, *(["--draft", draft] if draft else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    proc = start_process(Proc(name, f"127.0.0.1:{port}", None, log_dir / f"{name}.log", argv, env))
    if wait:
        start_healthy(proc, 60, attempts=1)
    return proc


class Stream(threading.Thread):
    """One Generate call read to its end on a thread: .tokens, .code (OK or the status), .ended_at."""

    def __init__(self, address: str, prompt, **params):
        super().__init__(daemon=True)
        self.address, self.prompt, self.params = address, prompt, params
        self.tokens: list[int] = []
        self.code, self.details, self.ended_at = None, "", None
        self.started = threading.Event()
        self.start()

    def run(self):
        try:
            with Client(self.address) as client:
                for chunk in client.generate(self.prompt, **self.params):
                    self.tokens += chunk.token_ids
                    if self.tokens:
                        self.started.set()
            self.code = "OK"
        except grpc.RpcError as e:
            self.code, self.details = e.code().name, e.details()
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


def wait_started(streams, timeout: float = 30.0) -> None:
    for s in streams:
        assert s.started.wait(timeout), "a stream never produced a token"


def wait_exit(proc: Proc, timeout: float) -> int | None:
    try:
        return proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def log_lines(proc: Proc, *words: str) -> list[str]:
    return [line for line in proc.log_since_start().splitlines() if any(w in line for w in words)]


# --- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    s = Servers(tmp_path_factory.mktemp("lifecycle"))
    try:
        yield s
    finally:
        stop_all([s.target, s.draft])


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """Every process a test starts (a child of this one) is gone when it ends, but the module's
    servers (which a test may restart); one that is not is killed and the test fails."""
    before = set(proc_children(os.getpid()))
    yield
    time.sleep(0.2)
    if "servers" in request.fixturenames:
        s = request.getfixturevalue("servers")
        before |= {s.target.popen.pid, s.draft.popen.pid}
    left = {pid: cmd for pid, cmd in proc_children(os.getpid()).items() if pid not in before and alive(pid)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


@pytest.fixture
def clean(servers):
    """The module's servers hold nothing before and after the test."""
    servers.start_afresh_if_held()
    yield servers
    servers.start_afresh_if_held()


# --- what works ----------------------------------------------------------------------------------
def test_sigterm_to_the_coordinator_ends_streams_promptly_and_frees_kv(clean, tmp_path):
    servers = clean
    coord = start_coordinator(tmp_path, servers.target.address, servers.draft.address, ["--grace", "0.3"])
    try:
        streams = [Stream(coord.address, f"def add(a, b): {i}", timeout=60, **LONG) for i in range(2)]
        wait_started(streams)
        assert any(v[1] for v in servers.held().values())
        t0 = time.monotonic()
        coord.popen.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(15)
        rc = wait_exit(coord, 15)
    finally:
        stop_all([coord])
    assert rc == 0, coord.log_tail()
    for s in streams:
        assert s.code == "UNAVAILABLE" and 0 < len(s.tokens) < LONG["max_new_tokens"], (s.code, s.details)
        assert s.ended_at - t0 < 3.0
    assert servers.wait_free() == {"target": (0, 0), "draft": (0, 0)}  # released at shutdown


def test_coordinator_waits_for_servers_started_after_it(servers, tmp_path):
    tport, dport = free_port(), free_port()
    coord = start_coordinator(tmp_path, f"127.0.0.1:{tport}", f"127.0.0.1:{dport}",
                              ["--connect-timeout", "60", "--draft-retry", "0.5"], wait=False)
    procs = [coord]
    try:
        time.sleep(2)
        assert coord.popen.poll() is None  # still waiting, not dead
        # Bound meanwhile: health NOT_SERVING, and a call is refused saying what it waits for.
        with grpc.insecure_channel(coord.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with Client(coord.address) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate("hi", max_new_tokens=2, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"waiting for its servers (target 127.0.0.1:{tport}" in err.value.details()
        for role, model, port in (("target", servers.target_path, tport), ("draft", servers.draft_path, dport)):
            procs.append(launch._spawn(f"{role}_server", f"{role}_server",
                                       ["--model", str(model), "--port", str(port), *SERVER_ARGS], port, tmp_path,
                                       {"OMP_NUM_THREADS": "1"}))
        launch.wait_healthy(coord, 60)
        with Client(coord.address) as client:
            chunks = list(client.generate("def add(a, b):", max_new_tokens=16, ignore_eos=True, timeout=30))
        assert sum(len(c.token_ids) for c in chunks) == 16
    finally:
        stop_all(procs)


def test_coordinator_without_a_target_exits_1_naming_it(tmp_path):
    port = free_port()
    coord = start_coordinator(tmp_path, f"127.0.0.1:{port}", args=["--connect-timeout", "1"], wait=False)
    rc = wait_exit(coord, 30)
    stop_all([coord])
    assert rc == 1
    assert f"target server at 127.0.0.1:{port} did not answer Info within 1s" in coord.log_since_start()


def test_coordinator_stopped_while_waiting_for_its_servers_exits_0(tmp_path):
    coord = start_coordinator(tmp_path, f"127.0.0.1:{free_port()}", args=["--connect-timeout", "120"], wait=False)
    try:
        deadline = time.monotonic() + 30
        while "waiting for" not in _generate_outcome(coord.address) and time.monotonic() < deadline:
            time.sleep(0.2)
        coord.popen.send_signal(signal.SIGTERM)
        rc = wait_exit(coord, 10)
    finally:
        stop_all([coord])
    assert rc == 0 and "stopped while waiting for the servers" in coord.log_since_start(), coord.log_tail(5)


def _generate_outcome(address: str) -> str:
    try:
        with Client(address) as client:
            list(client.generate("hi", max_new_tokens=1, timeout=2))
    except grpc.RpcError as e:
        return e.details() or ""
    return "served"


def test_target_killed_and_not_back_ends_streams_then_is_used_again(clean, tmp_path):
    """Restarts the module's target on its port (the tests after it use the new process)."""
    servers = clean
    coord = start_coordinator(tmp_path, servers.target.address, servers.draft.address,
                              ["--connect-timeout", "2"])
    try:
        streams = [Stream(coord.address, f"def add(a, b): {i}", timeout=60, **LONG) for i in range(2)]
        wait_started(streams)
        t0 = time.monotonic()
        servers.target.popen.kill()
        servers.target.popen.wait(10)
        for s in streams:
            s.join(20)
        for s in streams:
            assert s.code == "UNAVAILABLE" and "not back" in s.details and servers.target.address in s.details
            assert s.ended_at - t0 < 6.0
        assert server_info(servers.draft.address, "draft").num_sequences == 0
        launch.restart(servers.target)
        with Client(coord.address) as client:
            chunks = list(client.generate("def add(a, b):", max_new_tokens=16, ignore_eos=True, timeout=30))
        assert sum(len(c.token_ids) for c in chunks) == 16
    finally:
        stop_all([coord])


# --- bugs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_crashed_coordinator_leaves_no_kv_behind(clean, tmp_path, transport):
    # Fixed (specdec/serving/owners.py): each server frees a coordinator's sequences once none of
    # its step connections has been open for --orphan-timeout seconds (ORPHAN_TIMEOUT_S here), on
    # the step channel (auto) and on the gRPC stream alike.
    servers = clean
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(1, 300) for _ in range(440)]  # 28 of 64 blocks each
    a = start_coordinator(tmp_path, servers.target.address, servers.draft.address, name="coordA",
                          args=["--step-channel", transport])
    try:
        with Client(a.address) as client:
            for _ in range(2):  # ids 1, 2 done: the crashed streams are 3 and 4
                list(client.generate("hi", max_new_tokens=2))
        streams = [Stream(a.address, prompt(), max_new_tokens=60, ignore_eos=True, timeout=60) for _ in range(2)]
        wait_started(streams)
        assert all(n == 2 for _, n in servers.held().values())
        a.popen.kill()   # SIGKILL / OOM: no shutdown, no Release
        a.popen.wait(10)
        killed = time.monotonic()
        for s in streams:
            s.join(10)
    finally:
        stop_all([a])
    # Held while A might still come back, freed once it has been gone for the timeout.
    assert all(n == 2 for _, n in servers.held().values()) or time.monotonic() - killed >= ORPHAN_TIMEOUT_S
    held = servers.wait_free(ORPHAN_TIMEOUT_S + 10)
    assert held == {"target": (0, 0), "draft": (0, 0)}, held
    assert time.monotonic() - killed >= ORPHAN_TIMEOUT_S
    b = start_coordinator(tmp_path, servers.target.address, servers.draft.address, name="coordB")
    try:
        with Client(b.address) as client:   # an idle cluster, to B: the request fits
            try:
                chunks = list(client.generate(prompt(), max_new_tokens=40, ignore_eos=True, timeout=60))
                outcome = ("OK", sum(len(c.token_ids) for c in chunks))
            except grpc.RpcError as e:
                outcome = (e.code().name, e.details())  # RESOURCE_EXHAUSTED target: kv cache ...
    finally:
        stop_all([b])
    held = servers.wait_free(5)
    assert outcome == ("OK", 40), outcome
    assert held == {"target": (0, 0), "draft": (0, 0)}, held


def test_two_coordinators_on_the_same_servers_stay_exact(clean, tmp_path):
    servers = clean
    a = start_coordinator(tmp_path, servers.target.address, servers.draft.address, name="coordA")
    b = start_coordinator(tmp_path, servers.target.address, servers.draft.address, name="coordB")
    p_a, p_b, params = "def add(a, b):", "The quick brown fox", dict(max_new_tokens=200, ignore_eos=True,
                                                                     speculate=False, timeout=60)
    try:
        with Client(a.address) as ca, Client(b.address) as cb:   # alone (seq 1 on each)
            ref_a = [t for c in ca.generate(p_a, **params) for t in c.token_ids]
            ref_b = [t for c in cb.generate(p_b, **params) for t in c.token_ids]
        sa = Stream(a.address, p_a, **params)   # seq 2 of A
        wait_started([sa])
        sb = Stream(b.address, p_b, **params)   # seq 2 of B, while A's runs
        sa.join(60)
        sb.join(60)
    finally:
        stop_all([a, b])
    assert (sa.code, sb.code) == ("OK", "OK"), (sa.details, sb.details)
    assert sa.tokens == ref_a and sb.tokens == ref_b


@pytest.mark.parametrize("what", ["target", "coordinator", "target --metrics-port", "coordinator --metrics-port"])
def test_a_second_process_on_a_port_in_use_exits_nonzero(servers, tmp_path, what):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    first = None
    held = socket.create_server(("0.0.0.0", 0))   # a metrics port in use
    metrics_port = str(held.getsockname()[1])
    if what == "target --metrics-port":
        port = str(free_port())
        argv = [sys.executable, "-m", "target_server", "--model", str(servers.target_path), "--port", port,
                "--metrics-port", metrics_port, *SERVER_ARGS]
        ready = "SERVING"
    elif what == "coordinator --metrics-port":
        port = str(free_port())
        argv = [sys.executable, "-m", "coordinator", "--target", servers.target.address, "--host", "127.0.0.1",
                "--port", port, "--metrics-port", metrics_port]
        ready = "coordinator listening"
    elif what == "target":
        port = servers.target.address.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "target_server", "--model", str(servers.target_path), "--port", port,
                *SERVER_ARGS]
        ready = "SERVING"
    else:
        first = start_coordinator(tmp_path, servers.target.address, name="first")
        port = first.address.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "coordinator", "--target", servers.target.address, "--host", "127.0.0.1",
                "--port", port]
        ready = "coordinator listening"
    second = start_process(Proc("second", f"127.0.0.1:{port}", None, tmp_path / "second.log", argv, env))
    try:
        deadline = time.monotonic() + 60
        while second.popen.poll() is None and ready not in second.log_since_start() and time.monotonic() < deadline:
            time.sleep(0.1)
        rc = second.popen.poll()
        log = second.log_since_start()
    finally:
        stop_all([second, *([first] if first else [])])
        held.close()
    assert rc not in (None, 0), f"the second {what} serves on port {port} beside the first:\n{second.log_tail(3)}"
    assert "cannot listen on" in log and "Traceback" not in log, log[-2000:]   # one clear line
    if what.endswith("--metrics-port"):
        assert f"--metrics-port {metrics_port}: cannot listen on" in log, log[-2000:]


def test_a_target_restarted_while_idle_is_read_afresh(servers, tmp_path):
    # Fixed (Coordinator.check_target): a step connection the target closed between requests
    # makes the next request's admission read its Info first.
    target = spawn_server("target", servers.target_path, tmp_path, args=["--warmup-batch-sizes", "1"])
    coord = None
    try:
        start_healthy(target, 60)
        coord = start_coordinator(tmp_path, target.address)
        with Client(coord.address) as client:
            list(client.generate("def add(a, b):", max_new_tokens=4))
        stop_all([target])
        target.argv += ["--num-blocks", "8"]   # 128 tokens of KV now
        launch.restart(target)
        got: list[int] = []
        with Client(coord.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                for chunk in client.generate("def add(a, b):", max_new_tokens=300, ignore_eos=True, timeout=30):
                    got += chunk.token_ids
    finally:
        stop_all([p for p in (coord, target) if p is not None])
    # Refused at admission, as for a target that had 8 blocks at start-up, not streamed then failed.
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "lower max_new_tokens" in err.value.details() and got == [], (err.value.details(), len(got))


def _serve(tmp_path: Path, port: int):
    """`specdec serve` on `port`; returns (its Popen, {pid: command} of its children)."""
    argv = [str(Path(sys.executable).parent / "specdec"), "serve", "--target", str(tmp_path / "models" / "target"),
            "--draft", str(tmp_path / "models" / "draft"), "--port", str(port), "--log-dir", str(tmp_path / "logs"),
            "--server-arg=--warmup-batch-sizes", "--server-arg=1"]
    serve = subprocess.Popen(argv, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: dict[int, str] = {}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and serve.poll() is None:
        children.update(proc_children(serve.pid))
        log = tmp_path / "logs" / "coordinator.log"
        if log.exists() and "coordinator listening" in log.read_text(errors="replace"):
            break
        time.sleep(0.1)
    children.update(proc_children(serve.pid))
    return serve, children


@pytest.fixture
def serve_root(servers, tmp_path):
    (tmp_path / "models").symlink_to(servers.target_path.parent)
    return tmp_path


def test_specdec_serve_stops_everything_when_a_child_dies(serve_root):
    serve, children = _serve(serve_root, free_port())
    try:
        assert len(children) == 3, children
        draft = next(pid for pid, cmd in children.items() if "draft_server" in cmd)
        os.kill(draft, signal.SIGKILL)
        rc = serve.wait(30)
        out = serve.stdout.read()
    finally:
        if serve.poll() is None:
            serve.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert rc == 1 and "draft_server exited with code -9" in out
    time.sleep(0.5)
    assert not [pid for pid in children if alive(pid)]


def test_specdec_serve_killed_leaves_no_children(serve_root):
    serve, children = _serve(serve_root, free_port())
    try:
        assert len(children) == 3, children
        serve.kill()
        serve.wait(10)
        deadline = time.monotonic() + 10   # (SIGTERM: each child shuts down, with nothing in flight)
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: cmd[:60] for pid, cmd in children.items() if alive(pid)}
    finally:
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after `specdec serve` was killed: {left}"
