"""Where a step's transport goes, part by part, from the stamps the processes write with
SPECDEC_TRACE_DIR set (specdec/trace.py): each Propose / Verify of the coordinator joined with the
server's handling of it by (rpc, step) and time, and the median of each part per rpc and batch.

    SPECDEC_TRACE_DIR=/tmp/tr python3 bench/e2e.py --sections 7b --drafts llama-68m
    python3 bench/trace_steps.py /tmp/tr [--warmup 20]

Parts of one call (us):  c_send  serialise + write on the coordinator;  wire_in  from the write to
the server's frame read (the kernel and the server's wake-up);  s_parse;  step (the server's
step_seconds);  s_send  the server's answer serialised and written;  wire_out  to the
coordinator's frame read;  c_parse. Inside the server's step (where it wrote the stamps):  s_pre  the
request converted;  e_plan  the engine's release, admission and plans;  e_launch  the forward's host
arrays, staging and launches (graph replays);  e_wait  from the last launch until the results are on
the host (the device's work that the launches did not hide, and the copy);  e_post  the engine's
acceptance and bookkeeping;  s_post  the answer built. How the frames reached a reader polling
shared slots:  turn_in / turn_out  the server's / coordinator's time between its last look at the
empty slot and its read (its poll interval when the frame came: wire_in's floor where it polled);
by_poll / by_socket / by_waiting  the share of frames seen by polling the slot, woken by their
doorbell (or sent over the socket), or there before the reader asked. Between calls on the coordinator:  c_propose_to_verify
(proposal checks and the Verify built) and  c_verify_to_propose  (the answer applied, the next
step planned and its Propose built), spec steps only. outside_step is a call's time on the
coordinator (c_built to c_parsed) less the server's step. Writes bench/results/trace_steps.json.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
import sys
from pathlib import Path

from common import environment, table, write_result

CALL_PARTS = [("c_send", "c_built", "c_write"), ("wire_in", "c_write", "s_read"), ("s_parse", "s_read", "s_parsed"),
              ("step", "s_parsed", "s_ready"), ("s_send", "s_ready", "s_write"), ("wire_out", "s_write", "c_read"),
              ("c_parse", "c_read", "c_parsed")]
# The server's step (s_parsed .. s_ready) in parts, from the stamps inside it (specdec/trace.py);
# a part is left out of a call whose server did not stamp both ends (a step with no forward).
STEP_PARTS = [("s_pre", "s_parsed", "s_engine"), ("e_plan", "s_engine", "e_launch"),
              ("e_launch", "e_launch", "e_launched"), ("e_wait", "e_launched", "e_synced"),
              ("e_post", "e_synced", "s_engined"), ("s_post", "s_engined", "s_ready")]
ARRIVALS = ("poll", "socket", "waiting")   # protos/shared_slots.Inbox.arrival


def load(folder: Path) -> tuple[list[dict], list[dict]]:
    """(coordinator processes, server processes): per process {(rpc, step) -> [{point: t, 'batch': n}]},
    a list per key since a server serves several coordinators over its life (e2e.py starts one per
    configuration) and a coordinator's step numbers start again with it."""
    coords, servers = [], []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        calls: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
        starts = "c_built" if data["role"] == "coordinator" else "s_read"
        for point, rpc, step, batch, t in data["events"]:
            if point == starts or not calls[(rpc, step)]:
                calls[(rpc, step)].append({})
            call = calls[(rpc, step)][-1]
            call[point] = t
            if batch:
                call["batch"] = batch
        (coords if data["role"] == "coordinator" else servers).append(calls)
    return coords, servers


def joined_calls(coords: list[dict], servers: list[dict]) -> list[dict]:
    """Every coordinator call with the server's stamps of the same (rpc, step) that lie between its
    write and its read (the one server handling it), as {rpc, step, batch, points...}; calls
    without a complete set are left out."""
    index: dict[tuple[str, int], list[tuple[float, dict]]] = collections.defaultdict(list)
    for calls in servers:
        for key, handled in calls.items():
            index[key] += [(h["s_read"], h) for h in handled if "s_read" in h]
    for entries in index.values():
        entries.sort(key=lambda e: e[0])
    out = []
    for calls in coords:
        for (rpc, step), made in calls.items():
            for c in made:
                if not all(p in c for p in ("c_built", "c_write", "c_read", "c_parsed")):
                    continue
                entries = index.get((rpc, step), [])
                i = bisect.bisect_left(entries, c["c_write"], key=lambda e: e[0])
                if i == len(entries) or entries[i][0] > c["c_read"]:
                    continue
                s = entries[i][1]
                if all(p in s for p in ("s_parsed", "s_ready", "s_write")):
                    out.append({"rpc": rpc, "step": step, "batch": c.get("batch", 0), "coordinator": id(calls),
                                **{k: v for k, v in s.items() if k != "batch"}, **c})
    return out


def summarize(calls: list[dict], warmup: int = 20) -> list[dict]:
    """Median microseconds of each part per (rpc, batch) over spec steps (a step with both a
    Propose and a Verify) after each coordinator's first `warmup` steps, and the coordinator's
    time between the two calls of a step and between a Verify and the next step's Propose."""
    by = {(c["coordinator"], c["rpc"], c["step"]): c for c in calls}
    groups: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    between: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for (coord, rpc, step), c in by.items():
        p, v = by.get((coord, "Propose", step)), by.get((coord, "Verify", step))
        if step <= warmup or p is None or v is None:
            continue
        batch = v["batch"]
        groups[(rpc, batch)].append(c)
        if rpc == "Verify":
            between[("c_propose_to_verify", batch)].append(v["c_built"] - p["c_parsed"])
            nxt = by.get((coord, "Propose", step + 1))
            if nxt is not None:
                between[("c_verify_to_propose", batch)].append(nxt["c_built"] - v["c_parsed"])
    rows = []
    for (rpc, batch), cs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row = {"rpc": rpc, "batch": batch, "calls": len(cs)}
        for name, a, b in CALL_PARTS:
            row[f"{name}_us"] = 1e6 * statistics.median(c[b] - c[a] for c in cs)
        for name, a, b in STEP_PARTS:
            vals = [c[b] - c[a] for c in cs if a in c and b in c]
            row[f"{name}_us"] = 1e6 * statistics.median(vals) if vals else None
        for side, way, read in (("s", "in", "s_read"), ("c", "out", "c_read")):
            turns = [c[read] - c[f"{side}_missed"] for c in cs if f"{side}_by_poll" in c and f"{side}_missed" in c]
            row[f"turn_{way}_us"] = 1e6 * statistics.median(turns) if turns else None
            told = [c for c in cs if any(f"{side}_by_{a}" in c for a in ARRIVALS)]
            for a in ARRIVALS:
                row[f"{way}_by_{a}"] = sum(f"{side}_by_{a}" in c for c in told) / len(told) if told else None
        row["outside_step_us"] = 1e6 * statistics.median(
            (c["c_parsed"] - c["c_built"]) - (c["s_ready"] - c["s_parsed"]) for c in cs)
        for name in ("c_propose_to_verify", "c_verify_to_propose"):
            vals = between.get((name, batch))
            row[f"{name}_us"] = 1e6 * statistics.median(vals) if vals and rpc == "Verify" else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="SPECDEC_TRACE_DIR of the run")
    ap.add_argument("--warmup", type=int, default=20, help="steps left out at the start of each coordinator")
    a = ap.parse_args(argv)
    coords, servers = load(a.folder)
    if not coords or not servers:
        print(f"no coordinator or no server stamps in {a.folder}", file=sys.stderr)
        return 1
    rows = summarize(joined_calls(coords, servers), a.warmup)
    write_result("trace_steps", {"benchmark": "trace_steps", "environment": environment(), "rows": rows})
    cols = [("rpc", "rpc", "s"), ("batch", "b", "d"), ("calls", "calls", "d")]
    cols += [(f"{name}_us", name, ".0f") for name, _, _ in CALL_PARTS]
    cols += [("outside_step_us", "outside step", ".0f"), ("c_propose_to_verify_us", "coord P->V", ".0f"),
             ("c_verify_to_propose_us", "coord V->P", ".0f")]
    print("medians, us per call (spec steps)")
    print(table(rows, cols))
    if any(row[f"{name}_us"] is not None for row in rows for name, _, _ in STEP_PARTS):
        print("\ninside the server's step (us; e_wait holds the device time the launches did not hide)")
        print(table(rows, cols[:3] + [(f"{name}_us", name, ".0f") for name, _, _ in STEP_PARTS]))
    if any(row["turn_in_us"] is not None or row["in_by_poll"] is not None for row in rows):
        print("\nhow the frames reached their reader (shared slots): its poll interval when one came (us), "
              "and the share seen by polling, woken by the socket, or waiting")
        arrival = [(f"turn_{w}_us", f"turn_{w}", ".1f") for w in ("in", "out")]
        arrival += [(f"{w}_by_{a}", f"{w} by {a}", ".2f") for w in ("in", "out") for a in ARRIVALS]
        print(table(rows, cols[:3] + arrival))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
