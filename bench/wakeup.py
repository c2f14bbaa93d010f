"""How long a process takes to notice a step frame on a socket, by how it waits for it.

    python3 bench/wakeup.py [--frames 400] [--gap-ms 2] [--modes blocking asyncio poll poll+grpc ...]

The trace of a speculative step (bench/trace_steps.py, session 17, H200 host) has the model servers
noticing a request 55 us after the coordinator wrote it, where the coordinator notices an answer in
22 us; both busy-poll their event loops. This measures the one-way time from a sender's write to a
receiver's read_frame returning (perf_counter is CLOCK_MONOTONIC: one clock for the host's
processes) for receivers that wait in different ways, each in a fresh process:

- blocking: a plain blocking recv on the main thread (the floor of Python + the kernel);
- asyncio: StreamReader + protos.wire.read_frame, the loop asleep in epoll between frames;
- poll: the same with specdec.busy_poll.BusyPoll kicked after each frame (the servers' default);
- poll+grpc: and a grpc.aio server in the loop, as every model server has;
- poll+torch: and torch imported, with an idle ThreadPoolExecutor thread (the engine thread);
  poll+cuda adds a CUDA context and a synchronised kernel after each frame (GPU hosts only);
- poll+pin, poll+cuda+pin: poll, or poll+cuda, with the receiving (event loop) thread pinned to one
  CPU and every other thread of the process moved off it (pin_loop_thread), once set up. On the
  H200 host (session 18) poll+cuda took 58.7 us against 39.7 for poll: whether a CPU of its own
  gives the loop back what the CUDA context's threads take;
- poll+shm, poll+grpc+shm, poll+cuda+shm: poll, poll+grpc or poll+cuda, with the frame written into shared slots
  (protos/shared_slots.py: the step channel's frames between processes of one host) and a doorbell
  on the socket; the receiver polls the slot (shared_slots.Inbox) as the servers and the
  coordinator do.

The sender waits --gap-ms between frames (a step's cadence) and for each frame's one-byte ack.
Medians and p90 in us; writes bench/results/wakeup.json. Beside them, the host's clock: its clock
source, the cost of the clock reads a polling event loop makes every turn (time.monotonic; the
traces stamp with perf_counter) and of one idle turn of a loop (asyncio.sleep(0) with nothing
else to run): a virtual machine whose clock reads leave the guest makes every polling turn longer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import ROOT, environment, table, write_result

MODES = ("blocking", "asyncio", "poll", "poll+grpc", "poll+torch", "poll+cuda", "poll+pin", "poll+cuda+pin",
         "poll+shm", "poll+grpc+shm", "poll+cuda+shm")
_STAMP = struct.Struct("<d")


def _frame(t: float) -> bytes:
    from protos.wire import frame
    return frame(_STAMP.pack(t) + bytes(200))   # about a Verify request of a few sequences


def sender(port: int, frames: int, gap_s: float, offer: str | None = None) -> None:
    """offer: the receiver's shared slots (hex of the offer): frames go through them."""
    from protos.shared_slots import TO_SERVER, SharedSlots
    from protos.wire import FRAME_SHARED, frame
    slots = SharedSlots.attach(bytes.fromhex(offer)) if offer else None
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(frames):
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:   # spins: the sender's own wake-up is not measured
            pass
        if slots is None:
            sock.sendall(_frame(time.perf_counter()))
        else:
            seq = slots.put(TO_SERVER, _STAMP.pack(time.perf_counter()) + bytes(200))
            sock.sendall(frame(seq.to_bytes(8, "little"), FRAME_SHARED))
        if sock.recv(1) != b"k":
            raise RuntimeError("receiver went away")
    sock.close()


def _listen() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    return srv, srv.getsockname()[1]


def receive_blocking(srv: socket.socket, frames: int) -> list[float]:
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(frames):
        head = conn.recv(5, socket.MSG_WAITALL)
        (length,) = struct.unpack("<I", head[:4])
        payload = conn.recv(length - 1, socket.MSG_WAITALL)
        out.append(time.perf_counter() - _STAMP.unpack(payload[:8])[0])
        conn.sendall(b"k")
    return out


async def receive_async(srv: socket.socket, frames: int, mode: str, slots=None) -> list[float]:
    from protos.shared_slots import TO_SERVER, Inbox, receive
    from specdec.busy_poll import BusyPoll
    poll = BusyPoll(0.02 if mode != "asyncio" else 0.0)
    extras = []
    if mode.startswith("poll+grpc"):
        import grpc
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        extras.append(server)
    work = None   # what the receiver does after each frame (poll+cuda: a synchronised kernel)
    if mode in ("poll+torch", "poll+cuda", "poll+cuda+pin", "poll+cuda+shm"):
        from concurrent.futures import ThreadPoolExecutor

        import torch
        executor = ThreadPoolExecutor(max_workers=1)
        executor.submit(lambda: None).result()
        extras.append(executor)
        if mode in ("poll+cuda", "poll+cuda+pin", "poll+cuda+shm"):
            x = torch.ones(1 << 20, device="cuda")

            def kernel():
                x.mul_(1.0)
                torch.cuda.synchronize()
            kernel()
            work = kernel
    if mode.endswith("+pin"):
        pin_loop_thread()
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        out = []
        inbox = Inbox(reader, slots, TO_SERVER, 0.02) if slots is not None else None
        for _ in range(frames):
            _, payload = await receive(reader, inbox)
            out.append(time.perf_counter() - _STAMP.unpack(payload[:8])[0])
            if work is not None:
                work()
            writer.write(b"k")
            poll.kick()
        got.set_result(out)
        if inbox is not None:
            inbox.close()
    server = await asyncio.start_server(serve, sock=srv)
    try:
        return await got
    finally:
        server.close()
        poll.close()
        for e in extras:
            if hasattr(e, "stop"):
                await e.stop(None)
            else:
                e.shutdown()


def pin_loop_thread() -> tuple[int, set[int]] | None:
    """The calling thread on the last CPU this process may use, every other thread of the process
    on the rest (Linux: sched_setaffinity takes a thread id). Returns (the loop's CPU, the others'
    CPUs), or None where there is one CPU or no per-thread affinity."""
    import os
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    mine, rest = cpus[-1], set(cpus[:-1])
    me = threading.get_native_id()
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, {mine} if tid == me else rest)
        except (ProcessLookupError, PermissionError):   # a thread that ended, or one we may not move
            pass
    return mine, rest


def receiver(mode: str, frames: int, gap_s: float) -> list[float]:
    """Runs one mode: the receiver here, the sender in a child process."""
    srv, port = _listen()
    slots = None
    if mode.endswith("+shm"):
        from protos.shared_slots import SharedSlots
        slots = SharedSlots.create()
    child = subprocess.Popen([sys.executable, __file__, "--send", str(port), "--frames", str(frames),
                              "--gap-ms", str(gap_s * 1e3)] + (["--offer", slots.offer().hex()] if slots else []),
                             cwd=ROOT)
    try:
        if mode == "blocking":
            return receive_blocking(srv, frames)
        srv.setblocking(False)
        return asyncio.run(receive_async(srv, frames, mode, slots))
    finally:
        if slots is not None:
            slots.close_offer()
        if child.wait(60):
            raise RuntimeError(f"sender failed ({child.returncode})")
        srv.close()


def host_clock(calls: int = 200_000, turns: int = 20_000) -> dict:
    """The clock source (Linux) and medians of 5 rounds: ns per time.monotonic() and per
    time.perf_counter() call, us per idle event-loop turn."""
    try:
        source = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource").read_text().strip()
    except OSError:
        source = None

    def per_call_ns(clock) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            clock()
        return 1e9 * (time.perf_counter() - t0) / calls

    async def spin() -> float:
        t0 = time.perf_counter()
        for _ in range(turns):
            await asyncio.sleep(0)
        return 1e6 * (time.perf_counter() - t0) / turns
    rounds = [(per_call_ns(time.monotonic), per_call_ns(time.perf_counter), asyncio.run(spin())) for _ in range(5)]
    monotonic, perf, turn = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {"clocksource": source, "monotonic_ns": monotonic, "perf_counter_ns": perf, "loop_turn_us": turn}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", choices=MODES)
    ap.add_argument("--frames", type=int, default=400)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--send", type=int, help=argparse.SUPPRESS)       # the sender process
    ap.add_argument("--offer", help=argparse.SUPPRESS)                # its shared slots (hex)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)   # one receiver mode, JSON out
    a = ap.parse_args(argv)
    if a.send:
        sender(a.send, a.frames, a.gap_ms / 1e3, a.offer)
        return 0
    if a.one:
        print(json.dumps(receiver(a.one, a.frames, a.gap_ms / 1e3)))
        return 0
    import torch
    modes = a.modes or [m for m in MODES if "cuda" not in m or torch.cuda.is_available()]
    rows = []
    for mode in modes:   # each in a fresh process: what one mode imports does not reach the next
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--frames", str(a.frames),
                              "--gap-ms", str(a.gap_ms)], capture_output=True, text=True, cwd=ROOT, timeout=600)
        if out.returncode:
            rows.append({"mode": mode, "error": out.stderr[-500:]})
            continue
        lat = sorted(json.loads(out.stdout.strip().splitlines()[-1])[a.frames // 10:])   # warm-up left out
        rows.append({"mode": mode, "frames": len(lat), "median_us": 1e6 * statistics.median(lat),
                     "p90_us": 1e6 * lat[int(0.9 * (len(lat) - 1))], "min_us": 1e6 * lat[0]})
    clock = host_clock()
    write_result("wakeup", {"benchmark": "wakeup", "environment": environment(), "gap_ms": a.gap_ms, "rows": rows,
                            "clock": clock})
    print(f"clock source {clock['clocksource']}: time.monotonic {clock['monotonic_ns']:.0f} ns, perf_counter "
          f"{clock['perf_counter_ns']:.0f} ns a call; an idle event-loop turn {clock['loop_turn_us']:.2f} us")
    print(f"one-way write -> read_frame returned, us ({a.frames} frames, {a.gap_ms} ms apart)")
    print(table(rows, [("mode", "receiver waits by", "s"), ("median_us", "median", ".1f"), ("p90_us", "p90", ".1f"),
                       ("min_us", "min", ".1f")]))
    for r in rows:
        if "error" in r:
            print(f"{r['mode']} failed: {r['error']}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
