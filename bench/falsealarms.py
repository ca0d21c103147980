"""False alarms: the demo commands the README and docs give, run with no
fault injected, must raise no failure.

Each command is `ray-elastic demo` as a user types it (its own local
cluster, Ray's defaults, the demo's defaults) with `--fail-at -1` (nothing
injected) and `--steps N`; the commands are alternated round by round, so
a noisy stretch of the shared machine falls on all of them. Per command:
the failures of every run (each one is a false alarm: a healthy slice
evicted, work thrown away) and the step times' median, mean and p99 over
the steps after the first (the first compiles).

    python -m bench falsealarms [--steps 200] [--runs 1] [--variants NAME,...]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# name -> the demo's options, as README.md and docs/ give them (their
# fault options dropped: these runs inject nothing).
COMMANDS: dict[str, list[str]] = {
    "default": [],
    "pause": ["--policy", "pause"],
    "spare-resize": ["--spare-slices", "1"],
    "spare-pause": ["--policy", "pause", "--spare-slices", "1"],
    "3-slices": ["--slices", "3"],
    "lm-tokens": ["--example", "lm-tokens"],
    "lm-grain": ["--example", "lm-grain"],
    "cnn": ["--example", "cnn"],
    "fsdp-2x2": ["--hosts-per-slice", "2", "--devices-per-host", "2", "--sharding", "fsdp"],
    "fsdp_tp-2x2-medium": ["--hosts-per-slice", "2", "--devices-per-host", "2", "--sharding", "fsdp_tp",
                           "--model", "medium"],
    "fsdp-2x1-large": ["--hosts-per-slice", "2", "--devices-per-host", "1", "--sharding", "fsdp",
                       "--model", "large"],
}


def one_run(name: str, steps: int, work: str, timeout_s: float) -> dict:
    """One demo command, no fault: its failures and step times."""
    report = os.path.join(work, f"{name}-{time.monotonic_ns()}.json")
    cmd = [sys.executable, "-m", "ray_elastic.cli", "demo", *COMMANDS[name], "--fail-at", "-1",
           "--steps", str(steps), "--report", report]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        rc, tail = out.returncode, (out.stdout + out.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e.stdout or "")[-1500:]
    wall = time.monotonic() - t0
    if not os.path.exists(report):
        return {"name": name, "rc": rc, "wall_s": wall, "failures": None, "error": tail}
    with open(report) as f:
        r = json.load(f)
    times = r["step_times"][1:]
    return {
        "name": name, "rc": rc, "wall_s": wall, "steps": r["steps_completed"], "outcome": r["outcome"],
        "failures": [{k: f[k] for k in ("kind", "slice", "host", "step", "cause")} for f in r["failures"]],
        # Gradient checks whose only odd print was the checker's, not
        # repeated (control/tie_break.py): no failure, but counted here.
        "dismissed_checks": sum(1 for e in r["events"] if e["event"] == "tie_break" and e.get("dismissed")),
        "median_s": statistics.median(times) if times else None,
        "mean_s": statistics.fmean(times) if times else None,
        "p99_s": _p99(times),
        "goodput": r.get("goodput"),
    }


def _p99(values: list[float]):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def run(steps: int = 200, runs: int = 1, variants=None, timeout_s: float = 3600.0) -> dict:
    names = list(variants or COMMANDS)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(runs):
            for name in names:
                row = one_run(name, steps, work, timeout_s)
                row["round"] = r
                rows.append(row)
                print(f"  {name} round {r}: failures {_count(row)}, median {_fmt(row.get('median_s'))} s, "
                      f"{row['wall_s']:.0f} s", flush=True)
    return {"steps": steps, "runs": runs, "rows": rows,
            "false_failures": sum(_count(row) if isinstance(_count(row), int) else 1 for row in rows)}


def _count(row: dict):
    return "no report" if row["failures"] is None else len(row["failures"])


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def table(result: dict) -> str:
    lines = [f"No fault injected, {result['steps']} steps per run, {result['runs']} run(s) per command "
             "(alternated); step times over the steps after the first.", "",
             "| command | failures per run | dismissed checks | median step (s) | mean step (s) | p99 step (s) "
             "| goodput |",
             "|---|---|---|---|---|---|---|"]
    by_name: dict = {}
    for row in result["rows"]:
        by_name.setdefault(row["name"], []).append(row)
    for name, rows in by_name.items():
        opts = " ".join(COMMANDS[name]) or "(defaults)"
        med = statistics.median([r["median_s"] for r in rows if r.get("median_s") is not None] or [float("nan")])
        mean = statistics.median([r["mean_s"] for r in rows if r.get("mean_s") is not None] or [float("nan")])
        p99 = max([r["p99_s"] for r in rows if r.get("p99_s") is not None] or [float("nan")])
        good = statistics.median([r["goodput"] for r in rows if r.get("goodput") is not None] or [float("nan")])
        fails = ", ".join(str(_count(r)) for r in rows)
        dismissed = sum(r.get("dismissed_checks", 0) for r in rows)
        lines.append(f"| `{name}`: {opts} | {fails} | {dismissed} | {med:.3f} | {mean:.3f} | {p99:.3f} | {good:.2f} |")
    failed = [(r["name"], f) for r in result["rows"] for f in (r["failures"] or [])]
    lines += ["", f"False failures in all: {result['false_failures']}"]
    for name, f in failed:
        lines.append(f"- {name}: {f['kind']} slice {f['slice']} host {f['host']} step {f['step']}: {f['cause']}")
    return "\n".join(lines)
