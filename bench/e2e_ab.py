"""An A/B of bench/e2e.py: two configurations run in alternating passes (A, B, B, A, ...) in one
call, and a table of per-row medians with B / A ratios, since a single pass on these hosts moves
by more than most changes do.

    python3 bench/e2e_ab.py --passes 3 --b-args=--draft-args=--no-sampled-chains -- \\
        --sections 7b --drafts llama-68m --temperature 0.8 --top-k 50 --deadline 100
    python3 bench/e2e_ab.py --passes 3 --b-env SPECDEC_DRAFT_DEVICE_SPARSE=0 -- --sections 7b ...
    python3 bench/e2e_ab.py --passes 3 --a-code 0fb5329 -- --sections 7b --drafts llama-68m

--a-code runs side A over another commit's packages (a commit, or a folder made with git archive
where there is no git history: common.baseline_tree) with this checkout's bench scripts, and
without --a-args / --a-env the same arguments as B: this checkout against that commit.

Arguments after `--` go to every pass; --a-args / --b-args (one string each) and --a-env / --b-env
(NAME=VALUE, repeatable) to one side. Each pass is its own e2e.py process (fresh servers). Rows are
matched by (pair, gpus, batch). bench/results/e2e.json (e2e_smoke.json with --smoke) is left as it
was; every pass's rows go into bench/results/e2e_ab.json with the medians, rewritten after each
pass (with "complete": false until the last), so a call cut short by its time limit keeps the
passes it finished.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

from pathlib import Path

from common import ROOT, baseline_tree, environment, table, write_result

# What is compared per row (e2e.py's keys) and how the table names them.
METRICS = [("spec_tok_s", "spec tok/s", ".0f"), ("plain_tok_s", "plain tok/s", ".0f"),
           ("speedup", "speedup", ".2f"), ("speedup_steady", "steady speedup", ".2f"),
           ("step_ms_spec", "spec step ms", ".2f"),
           ("draft_host_ms_spec", "draft host ms", ".2f"), ("target_host_ms_spec", "target host ms", ".2f"),
           ("draft_serving_ms_spec", "draft serving ms", ".2f"), ("target_serving_ms_spec", "target serving ms", ".2f"),
           ("overhead_ms_spec", "transport ms", ".2f"), ("c", "c", ".3f")]
RESULTS = ROOT / "bench" / "results"


ORDERS = ("abba", "ab")   # --order's choices, the default first


def result_file(args: list[str], root: Path = ROOT) -> Path:
    """Where e2e.py with these arguments, run from the checkout `root`, writes its rows."""
    return root / "bench" / "results" / ("e2e_smoke.json" if "--smoke" in args else "e2e.json")


def row_key(row: dict) -> tuple:
    return (row.get("pair"), row.get("gpus"), row.get("batch"))


def summarize(passes: dict[str, list[list[dict]]]) -> list[dict]:
    """passes: side -> one list of e2e rows per pass. One summary row per (pair, gpus, batch) that
    both sides measured (a row without spec_tok_s, a pass that failed it, does not count): each
    metric's median per side (and the values), and B / A of the medians."""
    measured = {side: [r for rows in passes[side] for r in rows if r.get("spec_tok_s") is not None]
                for side in ("A", "B")}
    out = []
    for key in dict.fromkeys(row_key(r) for r in measured["A"] + measured["B"]):   # first-seen order
        got = {side: [r for r in measured[side] if row_key(r) == key] for side in ("A", "B")}
        if not got["A"] or not got["B"]:
            continue
        row = {"pair": key[0], "gpus": key[1], "batch": key[2], "passes_a": len(got["A"]), "passes_b": len(got["B"])}
        for m, _, _ in METRICS:
            for side in ("A", "B"):
                vals = [r[m] for r in got[side] if r.get(m) is not None]
                row[f"{m}_{side.lower()}_values"] = vals
                row[f"{m}_{side.lower()}"] = statistics.median(vals) if vals else None
            a, b = row[f"{m}_a"], row[f"{m}_b"]
            row[f"{m}_ratio"] = b / a if a and b is not None else None
        out.append(row)
    return out


def run_pass(args: list[str], env: dict[str, str], timeout: float, root: Path = ROOT) -> tuple[list[dict], float, int]:
    """One e2e.py process of the checkout `root`: its rows (none if it wrote no new result), seconds,
    return code."""
    out = result_file(args, root)
    before = out.stat().st_mtime_ns if out.exists() else None
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(root / "bench" / "e2e.py"), *args], cwd=root,
                          env={**os.environ, **env}, timeout=timeout)
    fresh = out.exists() and out.stat().st_mtime_ns != before
    rows = json.loads(out.read_text()).get("rows", []) if fresh else []
    return rows, time.perf_counter() - t0, proc.returncode


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--a-env / --b-env: expected NAME=VALUE, got {item!r}")
        env[name] = value
    return env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    common = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=3, help="passes per side (alternating)")
    ap.add_argument("--order", choices=ORDERS, default=ORDERS[0],
                    help="abba (default): A B, B A, A B, ...: every other pair of passes swaps its order, so a "
                         "side that gains from running second (session 36 saw B win every pass of two A/Bs "
                         "in which nothing should have differed by that much) gains as often on both sides; "
                         "ab: A B in every pair")
    ap.add_argument("--a-args", default="", help="e2e.py arguments of side A only, one string")
    ap.add_argument("--b-args", default="", help="e2e.py arguments of side B only, one string")
    ap.add_argument("--a-env", action="append", default=[], help="NAME=VALUE for side A's processes")
    ap.add_argument("--b-env", action="append", default=[], help="NAME=VALUE for side B's processes")
    ap.add_argument("--a-code", help="side A runs over this commit's (or folder's) packages")
    ap.add_argument("--pass-timeout", type=float, default=300.0, help="seconds one e2e.py pass may take")
    a = ap.parse_args(own)
    # `timeout` (gpu_suite.sh) ends a call with SIGTERM: as SystemExit, so that the result files the
    # passes overwrite are put back and the running pass's processes are killed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sides = {"A": (common + shlex.split(a.a_args), parse_env(a.a_env)),
             "B": (common + shlex.split(a.b_args), parse_env(a.b_env))}
    if sides["A"] == sides["B"] and not a.a_code:
        raise SystemExit("e2e_ab: sides A and B are the same configuration")
    with contextlib.ExitStack() as stack:
        roots = {"A": ROOT, "B": ROOT}
        code = {"A": "this checkout", "B": "this checkout"}
        if a.a_code:
            roots["A"], code["A"] = stack.enter_context(baseline_tree(a.a_code))

        def report(summary: list[dict], log: list[dict], complete: bool) -> Path:
            return write_result("e2e_ab", {
                "benchmark": "e2e_ab", "environment": environment(), "common_args": common,
                "a": {"args": sides["A"][0], "env": sides["A"][1], "code": code["A"]},
                "b": {"args": sides["B"][0], "env": sides["B"][1], "code": code["B"]},
                "passes": a.passes, "order": a.order, "complete": complete, "summary": summary, "log": log})

        passes, log = run_passes(sides, roots, a.passes, a.pass_timeout, order=a.order,
                                 after_pass=lambda p, lg: report(summarize(p), lg, False))
    summary = summarize(passes)
    path = report(summary, log, True)
    cols = [("pair", "pair", "s"), ("gpus", "gpus", "d"), ("batch", "b", "d")]
    for m, name, fmt in METRICS:
        cols += [(f"{m}_a", f"{name} A", fmt), (f"{m}_b", f"{name} B", fmt), (f"{m}_ratio", "B/A", ".3f")]
    for side in ("A", "B"):
        print(f"{side}: {code[side]}: {shlex.join(sides[side][0])} {sides[side][1]}")
    print(f"medians of {a.passes} passes per side, order {a.order}")
    print(table(summary, cols))
    print(f"wrote {path}")
    return 0 if all(entry["returncode"] == 0 for entry in log) else 1


def pass_order(i: int, order: str) -> tuple[str, str]:
    """The sides of pair i (from 0) in the order they run."""
    return ("B", "A") if order == "abba" and i % 2 else ("A", "B")


def run_passes(sides: dict, roots: dict[str, Path], n: int, timeout: float, order: str = ORDERS[0],
               after_pass=None) -> tuple[dict, list[dict]]:
    """n pairs of passes of each side's (args, env) from its checkout, each pair in pass_order's
    order; the result files they overwrite are put back as they were. after_pass(passes, log), if
    given, runs after each pass with what there is so far."""
    outs = {result_file(args, roots[side]) for side, (args, _) in sides.items()}
    saved = {out: out.read_bytes() for out in outs if out.exists()}
    passes: dict[str, list[list[dict]]] = {"A": [], "B": []}
    log = []
    try:
        for i in range(n):
            for side in pass_order(i, order):
                args, env = sides[side]
                rows, secs, rc = run_pass(args, env, timeout, roots[side])
                passes[side].append(rows)
                log.append({"pass": i + 1, "side": side, "seconds": secs, "returncode": rc, "rows": rows})
                print(f"pass {i + 1} {side}: rc {rc}, {len(rows)} rows, {secs:.0f}s", flush=True)
                if after_pass is not None:
                    after_pass(passes, log)
    finally:
        for out, data in saved.items():
            out.write_bytes(data)
    return passes, log


if __name__ == "__main__":
    raise SystemExit(main())
