"""specdec/trace.py's stamps and bench/trace_steps.py's join: each coordinator call matched with the
server's handling of the same (rpc, step) between its write and its read, the parts' medians per rpc
and batch, and the coordinator's time between the calls of spec steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the benchmarks are scripts: `common` is top-level

import trace_steps  # noqa: E402

US = 1e-6


def write(folder: Path, role: str, pid: int, events: list) -> None:
    (folder / f"{role}-{pid}.json").write_text(json.dumps({"role": role, "pid": pid, "events": events}))


def call_events(rpc: str, step: int, batch: int, t0: float, parts: dict[str, float]):
    """A call's coordinator and server stamps starting at t0, each part (us) after the one before."""
    coord, server, t = [], [], t0
    coord.append(("c_built", rpc, step, batch, t))
    t += parts["c_send"] * US
    coord.append(("c_write", rpc, step, 0, t))
    t += parts["wire_in"] * US
    server.append(("s_read", rpc, step, batch, t))
    t += parts["s_parse"] * US
    server.append(("s_parsed", rpc, step, 0, t))
    t += parts["step"] * US
    server.append(("s_ready", rpc, step, 0, t))
    t += parts["s_send"] * US
    server.append(("s_write", rpc, step, 0, t))
    t += parts["wire_out"] * US
    coord.append(("c_read", rpc, step, 0, t))
    t += parts["c_parse"] * US
    coord.append(("c_parsed", rpc, step, 0, t))
    return coord, server, t


def summarized(folder: Path, coord: list, draft: list, target: list) -> list[dict]:
    """summarize's rows (no warm-up) of one coordinator's stamps and its two servers'."""
    write(folder, "coordinator", 1, coord)
    write(folder, "draft", 2, draft)
    write(folder, "target", 3, target)
    return trace_steps.summarize(trace_steps.joined_calls(*trace_steps.load(folder)), warmup=0)


def test_parts_between_calls_and_a_second_coordinator(tmp_path):
    parts = {"Propose": dict(c_send=10, wire_in=50, s_parse=5, step=1000, s_send=30, wire_out=20, c_parse=3),
             "Verify": dict(c_send=12, wire_in=40, s_parse=6, step=4000, s_send=35, wire_out=25, c_parse=4)}
    runs = []
    for coordinator in range(2):   # the same servers serve two coordinators, whose steps both start at 1
        coord, draft, target = [], [], []
        t = 100.0 + coordinator * 10
        for step in range(1, 31):
            c, s, t = call_events("Propose", step, 8, t, parts["Propose"])
            coord += c
            draft += s
            t += 70 * US   # the proposals checked, the Verify built
            c, s, t = call_events("Verify", step, 8, t, parts["Verify"])
            coord += c
            target += s
            t += 150 * US   # the answer applied, the next Propose built
        runs.append((coord, draft, target))
        write(tmp_path, "coordinator", 10 + coordinator, coord)
    write(tmp_path, "draft", 1, [e for _, d, _ in runs for e in d])
    write(tmp_path, "target", 2, [e for _, _, tg in runs for e in tg])
    # a plain step (Verify without a Propose) is no spec step
    c, s, _ = call_events("Verify", 99, 8, 200.0, parts["Verify"])
    write(tmp_path, "coordinator", 12, c)
    write(tmp_path, "target", 3, s)

    calls = trace_steps.joined_calls(*trace_steps.load(tmp_path))
    assert len(calls) == 2 * 2 * 30 + 1
    rows = trace_steps.summarize(calls, warmup=5)
    assert [(r["rpc"], r["batch"], r["calls"]) for r in rows] == [("Propose", 8, 50), ("Verify", 8, 50)]
    for row in rows:
        for name, value in parts[row["rpc"]].items():
            assert row[f"{name}_us"] == pytest.approx(value, abs=0.01), (row["rpc"], name)
        expected_outside = sum(parts[row["rpc"]].values()) - parts[row["rpc"]]["step"]
        assert row["outside_step_us"] == pytest.approx(expected_outside, abs=0.01)
    verify = rows[1]
    assert verify["c_propose_to_verify_us"] == pytest.approx(70, abs=0.01)
    assert verify["c_verify_to_propose_us"] == pytest.approx(150, abs=0.01)
    assert rows[0]["c_propose_to_verify_us"] is None


def test_a_server_stamp_outside_the_calls_window_is_not_joined(tmp_path):
    parts = dict(c_send=10, wire_in=50, s_parse=5, step=100, s_send=30, wire_out=20, c_parse=3)
    coord, server, _ = call_events("Verify", 1, 1, 100.0, parts)
    write(tmp_path, "coordinator", 1, coord)
    write(tmp_path, "target", 2, [(p, r, s, b, t + 5.0) for p, r, s, b, t in server])   # another run's step 1
    assert trace_steps.joined_calls(*trace_steps.load(tmp_path)) == []


def test_a_process_writes_its_stamps_at_exit_only_when_asked(tmp_path):
    code = ("from specdec import trace; trace.start('target'); "
            "trace.mark('s_read', 'Verify', 3, 8); trace.mark('s_parsed', 'Verify', 3, at=1.5)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECDEC_TRACE_DIR=str(tmp_path / "tr"))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    (path,) = (tmp_path / "tr").glob("target-*.json")
    data = json.loads(path.read_text())
    assert data["role"] == "target"
    assert [e[:4] for e in data["events"]] == [["s_read", "Verify", 3, 8], ["s_parsed", "Verify", 3, 0]]
    assert data["events"][1][4] == 1.5
    env.pop("SPECDEC_TRACE_DIR")
    env_off = dict(env, SPECDEC_TRACE_DIR="")
    subprocess.run([sys.executable, "-c", code], env=env_off, check=True, timeout=60)
    assert len(list((tmp_path / "tr").glob("*.json"))) == 1


def test_the_servers_step_in_parts_where_its_stamps_are(tmp_path):
    """STEP_PARTS: the server's step split by the stamps inside it (s_engine .. s_engined); a
    call whose server stamped only some of them (a step without a forward) counts in the parts
    it has; an rpc whose server stamped none of them has none (an older server)."""
    inner = dict(s_pre=20, e_plan=30, e_launch=100, e_wait=700, e_post=15)   # then s_post: the rest
    step_us = 1000
    parts = dict(c_send=10, wire_in=50, s_parse=5, step=step_us, s_send=30, wire_out=20, c_parse=3)
    coord, draft, target = [], [], []
    t = 100.0
    for step in range(1, 31):
        c, s, t_end = call_events("Propose", step, 4, t, parts)
        coord += c
        no_forward = step % 2 == 0   # half the steps: no e_launch .. e_synced, and a slower s_pre
        at, stamps = s[1][4], []    # from s_parsed
        for (name, _, end), us in zip(trace_steps.STEP_PARTS, inner.values()):
            at += (60 if no_forward and name == "s_pre" else us) * US
            if not (no_forward and end.startswith("e_")):
                stamps.append((end, at))
        draft += s[:2] + [(point, "Propose", step, 0, when) for point, when in stamps] + s[2:]
        c, s, t = call_events("Verify", step, 4, t_end + 50 * US, parts)
        coord += c
        target += s
        t += 100 * US
    propose, verify = summarized(tmp_path, coord, draft, target)
    assert (propose["rpc"], propose["calls"]) == ("Propose", 30)
    assert propose["s_pre_us"] == pytest.approx((20 + 60) / 2, abs=0.01)   # every call's
    for name in ("e_plan", "e_launch", "e_wait", "e_post"):   # the steps with a forward
        assert propose[f"{name}_us"] == pytest.approx(inner[name], abs=0.01), name
    rest = step_us - sum(inner.values())   # s_post of a step with a forward; 40 us less without
    assert propose["s_post_us"] == pytest.approx((rest + rest - 40) / 2, abs=0.01)
    assert all(verify[f"{name}_us"] is None for name, _, _ in trace_steps.STEP_PARTS)


def test_how_the_frames_reached_their_readers(tmp_path):
    """turn_in / turn_out: the reader's last empty look at the slot to its read, over the frames
    it saw by polling; by_*: the shares of how the frames came, over the calls that say."""
    parts = dict(c_send=10, wire_in=50, s_parse=5, step=1000, s_send=30, wire_out=20, c_parse=3)
    coord, draft, target = [], [], []
    t = 100.0
    for step in range(1, 21):
        for rpc, server in (("Propose", draft), ("Verify", target)):
            c, s, t = call_events(rpc, step, 2, t, parts)
            s_read, c_read = s[0][4], c[2][4]
            if rpc == "Propose":   # the draft polls 8 us apart; every other frame woke it by the socket first
                how = "socket" if step % 2 == 0 else "poll"
                s.insert(1, ("s_missed", rpc, step, 0, s_read - (40 if how == "socket" else 8) * US))
                s.insert(2, (f"s_by_{how}", rpc, step, 0, s_read))
            # the coordinator: every answer polled, 3 us apart; one in 5 there before it asked
            how = "waiting" if step % 5 == 0 else "poll"
            c.insert(3, ("c_missed", rpc, step, 0, c_read - 3 * US))
            c.insert(4, (f"c_by_{how}", rpc, step, 0, c_read))
            coord += c
            server += s
            t += 60 * US
    propose, verify = summarized(tmp_path, coord, draft, target)
    assert propose["turn_in_us"] == pytest.approx(8, abs=0.01)
    assert (propose["in_by_poll"], propose["in_by_socket"], propose["in_by_waiting"]) == (0.5, 0.5, 0.0)
    assert verify["turn_in_us"] is None and verify["in_by_poll"] is None   # a server that does not say
    for row in (propose, verify):
        assert row["turn_out_us"] == pytest.approx(3, abs=0.01)
        assert (row["out_by_poll"], row["out_by_waiting"], row["out_by_socket"]) == (0.8, 0.2, 0.0)
