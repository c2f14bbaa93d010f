"""Start target server, draft server and coordinator as local subprocesses and wait for their health.

Used by `specdec serve`, by the integration tests and by the demo:

    with local_cluster(target_path, draft_path, device="cpu") as cluster:
        Client(cluster.coordinator)...
        cluster.metrics["coordinator"]  # "127.0.0.1:PORT" of its Prometheus /metrics

Every process gets a free loopback port for gRPC and one for /metrics.
"""
from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
# Processes started from here get SIGTERM when the thread that started them ends (Linux
# PR_SET_PDEATHSIG): `specdec serve` sets it, so that a SIGKILLed serve (the OOM killer, a
# container's stop timeout) leaves no servers holding its ports. Off for library use, where the
# starting thread may end before the processes should.
DIE_WITH_PARENT = False
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM once the parent's starting thread is gone."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):   # (not Linux: nothing to ask for)
        pass


class LaunchError(RuntimeError):
    """A process of the cluster died or did not become healthy; the message has its log's tail."""


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=256)


def free_port() -> int:
    """A loopback port nothing listens on now and that this process has not handed out lately.

    The kernel may give a port it just gave to a closed socket again, so two calls in a row can
    return the same number; a server's gRPC and /metrics ports then collide and it dies at start-up
    ("Failed to bind"). Remembering the recent ports rules that out within one process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port


@dataclass
class Proc:
    name: str
    address: str
    popen: subprocess.Popen | None
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    metrics_address: str | None = None  # host:port of its /metrics
    log_start: int = 0  # the log's size when this run of the process started

    def log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class Cluster:
    target: str
    draft: str | None
    coordinator: str
    procs: dict[str, Proc] = field(default_factory=dict)
    log_dir: Path | None = None
    metrics: dict[str, str] = field(default_factory=dict)  # role -> host:port of its /metrics


def wait_healthy(proc: Proc, timeout: float) -> None:
    """Polls grpc.health.v1 Check until SERVING; fails early when the process exits."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(proc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.popen.poll() is not None:
                raise LaunchError(f"{proc.name} exited with code {proc.popen.returncode} during start-up; "
                                  f"log {proc.log_path}:\n{proc.log_tail()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"{proc.name} at {proc.address} not healthy after {timeout:.0f}s; "
                                  f"log {proc.log_path}:\n{proc.log_tail()}")
            time.sleep(0.2)


def _spawn(name: str, module: str, args: Sequence[str], port: int, log_dir: Path,
           extra_env: dict[str, str] | None = None) -> Proc:
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = log_dir / f"{name}.log"
    metrics_port = free_port()
    argv = [sys.executable, "-m", module, *args, "--metrics-port", str(metrics_port)]
    return start_process(Proc(name, f"127.0.0.1:{port}", None, log_path, argv, env,
                       metrics_address=f"127.0.0.1:{metrics_port}"))


def start_process(proc: Proc) -> Proc:
    """Runs proc.argv in a new session, output appended to its log; sets proc.popen."""
    with open(proc.log_path, "ab") as log:
        proc.log_start = log.tell()
        proc.popen = subprocess.Popen(proc.argv, cwd=REPO_ROOT, env=proc.env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent if DIE_WITH_PARENT and sys.platform == "linux" else None)
    return proc


_BIND_FAILURES = ("Failed to bind to address", "Address already in use")


def start_healthy(proc: Proc, timeout: float, attempts: int = 3) -> Proc:
    """wait_healthy for a process whose ports free_port chose: when another process took one of them
    between the choice and the bind (any outgoing connection's ephemeral port can), the process dies
    saying so at once; it is then started again on fresh ports, up to `attempts` runs in all."""
    for _ in range(attempts - 1):
        try:
            wait_healthy(proc, timeout)
            return proc
        except LaunchError:
            if proc.popen.poll() is None or not any(m in proc.log_since_start() for m in _BIND_FAILURES):
                raise
        _fresh_ports(proc)
        start_process(proc)
    wait_healthy(proc, timeout)
    return proc


def _fresh_ports(proc: Proc) -> None:
    """New free ports for the --port and --metrics-port values of proc's command line."""
    argv = proc.argv
    for flag in ("--port", "--metrics-port"):
        if flag in argv:
            i = argv.index(flag) + 1
            if int(argv[i]) > 0:
                argv[i] = str(free_port())
    proc.address = f"{proc.address.rsplit(':', 1)[0]}:{argv[argv.index('--port') + 1]}"
    if proc.metrics_address is not None:
        proc.metrics_address = f"127.0.0.1:{argv[argv.index('--metrics-port') + 1]}"


def restart(proc: Proc, timeout: float = 120.0) -> Proc:
    """Stops (if needed) and starts a process again with the same command line, address and log;
    waits for its health. Tests use it to take a server away and bring it back."""
    stop_all([proc])
    wait_healthy(start_process(proc), timeout)
    return proc


def stop_all(procs: Sequence[Proc], timeout: float = 15.0) -> None:
    """SIGTERM (each server drains and frees its KV), then SIGKILL what is left after `timeout`."""
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


def spawn_server(role: str, model: str | Path, log_dir: Path, *, device: str = "cpu",
                 args: Sequence[str] = (), cpu_threads: int | None = 1) -> Proc:
    """Starts `python -m {role}_server` on a free loopback port (not waiting for its health)."""
    port = free_port()
    env = {"OMP_NUM_THREADS": str(cpu_threads)} if cpu_threads and device == "cpu" else {}
    return _spawn(f"{role}_server", f"{role}_server",
                  ["--model", str(model), "--port", str(port), "--device", device, *args],
                  port, Path(log_dir), env)


@contextlib.contextmanager
def local_cluster(target: str | Path, draft: str | Path | None, *, device: str = "cpu",
                  draft_device: str | None = None, coordinator_port: int | None = None,
                  server_args: Sequence[str] = (), coordinator_args: Sequence[str] = (),
                  log_dir: str | Path | None = None, startup_timeout: float = 180.0,
                  cpu_threads: int | None = 1, target_args: Sequence[str] = ()) -> Iterator[Cluster]:
    """Yields the three addresses once all processes answer health checks; stops them on exit.

    The two model servers load in parallel; the coordinator starts after them (it checks their
    vocabularies at start-up). cpu_threads: torch/OpenMP threads of a model server on the cpu device
    (None: torch's default). Two servers on one small machine otherwise each spin a thread per core
    between forwards and slow each other down ~10x. server_args go to both model servers,
    target_args to the target's after them."""
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="specdec-"))
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        procs: list[Proc] = []
        stack.callback(stop_all, procs)
        procs.append(spawn_server("target", target, log_dir, device=device, args=[*server_args, *target_args],
                                  cpu_threads=cpu_threads))
        d_proc = None
        if draft is not None:
            d_proc = spawn_server("draft", draft, log_dir, device=draft_device or device,
                                  args=server_args, cpu_threads=cpu_threads)
            procs.append(d_proc)
        for proc in procs:
            start_healthy(proc, startup_timeout)
        c_port = coordinator_port or free_port()
        c_args = ["--target", procs[0].address, "--host", "127.0.0.1", "--port", str(c_port),
                  *coordinator_args]
        if d_proc is not None:
            c_args += ["--draft", d_proc.address]
        coord = _spawn("coordinator", "coordinator", c_args, c_port, log_dir)
        procs.insert(0, coord)  # stopped first: it releases the servers' KV on the way out
        start_healthy(coord, startup_timeout, attempts=1 if coordinator_port else 3)
        yield Cluster(target=procs[1].address, draft=d_proc.address if d_proc else None,
                      coordinator=coord.address, procs={p.name: p for p in procs}, log_dir=log_dir,
                      metrics={p.name.removesuffix("_server"): p.metrics_address for p in procs})
