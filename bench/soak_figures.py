"""The soak's figures (bench/soak.py): per fault, per kind and per leg,
from a chaos run's events and the bench's own record of its faults; the
checks that make a leg pass; the Markdown table.

Per fault: detection (fault -> the run noticing: its `detected` event,
or the preemption notice for drain and SIGTERM), fault -> the next
completed step after the detection, the completed steps run again before
the next fault (`steps_redone`: reports of a step at or below the highest
reported before the fault). Per
kind and overall: the medians and 99th percentiles of those. Per leg:
failures by kind and by window, failures the bench did not inject (a
`detected` event matched to no fault), steps redone, goodput, the
final state against the failure-free run, and what was leaked.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Optional

from bench.common import steady_step_time, summary
from bench.soak_chaos import DRAIN_DEADLINE_S, KINDS, NOTICE_KINDS, WINDOWS

KIND_NAMES = {"kill": "worker SIGKILL", "remove_node": "node removed", "stop": "worker SIGSTOP (hang)",
              "freeze_node": "node frozen", "drain": f"drain notice ({DRAIN_DEADLINE_S:.0f} s deadline)",
              "term": "worker SIGTERM", "oom": "out of memory (Ray's monitor)", "corrupt": "silent corruption",
              "slow": "slow slice (straggler)"}


def spread(values: list) -> dict:
    """summary() (median, min, max, quartiles) with the 99th percentile."""
    out = summary(values)
    vals = sorted(v for v in values if v is not None)
    if len(vals) >= 2:
        out["p99"] = statistics.quantiles(vals, n=100, method="inclusive")[98]
    elif vals:
        out["p99"] = vals[0]
    return out


def fault_rows(chaos, events: list, steps_seen: list) -> tuple[list, list]:
    """(a row per fault the bench fired, the detections matched to none)."""
    detections = [e for e in events if e["event"] == "detected"]
    used: set = set()
    rows = []
    for i, f in enumerate(chaos.faults):
        row = {k: v for k, v in f.items() if k != "pid"}
        j = next((j for j, e in enumerate(detections) if j not in used and e["t"] >= f["t"]
                  and e.get("slice") == f["slice"]), None)
        det = None if j is None else detections[j]
        if j is not None:
            used.add(j)
        seen = det
        if f["kind"] in NOTICE_KINDS:
            seen = next((e for e in events if e["event"] == "preempt_notice" and e["t"] >= f["t"]
                         and e.get("slice") == f["slice"]), None) or det
        row["detected_s"] = round(seen["t"] - f["t"], 4) if seen else None
        row["failure_kind"] = det.get("kind") if det else None
        row["cause"] = (det.get("cause") or "")[:200] if det else None
        row["recovered_s"] = None
        if det is not None:
            nxt = next((t for t, _, _ in steps_seen if t > det["t"]), None)
            row["recovered_s"] = None if nxt is None else round(nxt - f["t"], 4)
            back = next((e for e in events if e["event"] == "recovered" and e["t"] >= det["t"]
                         and e.get("slice") == f["slice"]), None)
            if back is not None:
                row["steps_rewound"] = back.get("steps_rewound")
                row["restored_from"] = back.get("restored_from")
        until = chaos.faults[i + 1]["t"] if i + 1 < len(chaos.faults) else float("inf")
        row["steps_redone"] = steps_redone(steps_seen, f["t"], until)
        rows.append(row)
    unexpected = [{k: e.get(k) for k in ("t", "kind", "slice", "step", "cause")}
                  for j, e in enumerate(detections) if j not in used]
    return rows, unexpected


def steps_redone(steps_seen: list, since: float, until: float) -> int:
    """Completed steps run again after a fault at `since` (until the next
    fault): reports, between the two, of a step at or below the highest
    reported before it. `steps_seen`: (t, step, slices) of every report."""
    done = max((s for t, s, _ in steps_seen if t < since), default=0)
    return sum(1 for t, s, _ in steps_seen if since <= t < until and s <= done)


def _group(rows: list) -> dict:
    return {
        "n": len(rows),
        "detected_as": sorted({r["failure_kind"] or "—" for r in rows}),
        "detected_s": spread([r["detected_s"] for r in rows]),
        "recovered_s": spread([r["recovered_s"] for r in rows]),
        "steps_redone": sum(r["steps_redone"] for r in rows),
        "steps_redone_max": max((r["steps_redone"] for r in rows), default=0),
        "not_recovered": sum(1 for r in rows if r["recovered_s"] is None),
    }


def analyse(report, steps_seen: list, chaos, *, name: str, error: Optional[str]) -> dict:
    """A chaos run's figures."""
    rows, unexpected = fault_rows(chaos, report.events, steps_seen)
    start_t = next((e["t"] for e in report.events if e["event"] == "start"), 0.0)
    wall = report.wall_s
    after_start = max(1e-9, wall - start_t)
    thin = max(1, len(steps_seen) // 3000)
    return {
        "leg": name,
        "steps_requested": chaos.trainer.steps,
        "steps_completed": report.steps_completed,
        "outcome": report.outcome,
        "error": error or (report.error or None),
        "wall_s": round(wall, 3),
        "start_s": round(start_t, 3),
        "productive_s": round(report.productive_s, 3),
        "goodput": round(report.goodput, 4),
        "goodput_after_start": round(report.productive_s / after_start, 4),
        "step_time_s": steady_step_time(report),
        "steps_run": len(steps_seen),
        "steps_redone_total": len(steps_seen) - report.steps_completed,  # every report past the first of its step
        "failures": rows,
        "failures_recorded": len(report.failures),
        "failures_unrecovered": sum(1 for f in report.failures if f.recovered_s is None),
        "unexpected_failures": unexpected,
        "bench_errors": chaos.errors,
        "by_kind": {k: _group([r for r in rows if r["kind"] == k]) for k in KINDS if any(r["kind"] == k for r in rows)},
        "by_window": {w: _group([r for r in rows if r.get("window") == w])
                      for w in WINDOWS if any(r.get("window") == w for r in rows)},
        "all": _group(rows),
        "checkpoints": len(report.checkpoints),
        "restores": [{k: e.get(k) for k in ("t", "source", "step")} for e in report.events if e["event"] == "restore"],
        "bench_node_changes_s": round(chaos.bench_s, 3),
        "tight_node_renewed": chaos.tight_renewed,
        "timeline": [[t, s] for t, s, _ in steps_seen[::thin]],
    }


def checks(result: dict) -> list[str]:
    """FAIL lines (empty: passed)."""
    fails = []
    for name, r in result["runs"].items():
        if r["error"] or r["outcome"] != "completed" or r["steps_completed"] != r["steps_requested"]:
            fails.append(f"{name}: the run did not finish ({r['steps_completed']}/{r['steps_requested']} steps, "
                         f"outcome {r['outcome']}, error {r['error']})")
        if not r["failures"]:
            fails.append(f"{name}: no fault was injected")
        target = result["settings"].get("failures")
        if target is not None and len(r["failures"]) < target:
            fails.append(f"{name}: {len(r['failures'])} of the {target} faults asked for were injected")
        for f in r["failures"]:
            if f["detected_s"] is None or f["recovered_s"] is None:
                fails.append(f"{name}: fault {f['i']} ({f['kind']}, slice {f['slice']} at {f['t']:.1f} s) "
                             f"{'not detected' if f['detected_s'] is None else 'not recovered'}")
        if r["unexpected_failures"]:
            fails.append(f"{name}: {len(r['unexpected_failures'])} failure(s) the bench did not inject: "
                         f"{r['unexpected_failures'][:3]}")
        if r.get("bench_errors"):
            fails.append(f"{name}: the bench's own errors: {r['bench_errors'][:3]}")
        if r["failures_unrecovered"]:
            fails.append(f"{name}: {r['failures_unrecovered']} failure(s) in the report never recovered")
        missing = sorted(set(r["kinds"]) - set(r["by_kind"]))
        if missing and not result["settings"].get("partial_kinds_ok"):
            fails.append(f"{name}: fault kinds never injected: {missing}")
        bw = r.get("bitwise")
        if bw is not None and not bw["equal"]:
            fails.append(f"{name}: final state differs from the failure-free run "
                         f"({bw.get('why') or str(len(bw['mismatched'])) + ' arrays: ' + ', '.join(bw['mismatched'][:5])})")
        leaks = r.get("leaks")
        if leaks is not None and not leaks["none"]:
            fails.append(f"{name}: leaked {({k: v for k, v in leaks['leaked'].items() if v})}")
    return fails


def _fmt(s: Optional[dict], spec: str = ".2f") -> str:
    if not s or not s.get("n"):
        return "—"
    return f"{format(s['median'], spec)} / {format(s['p99'], spec)}"


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def table(result: dict) -> str:
    st = result["settings"]
    lines = []
    for name, r in result["runs"].items():
        lines += [
            f"#### Soak, {name}: {r['settings']}; {r['steps_completed']} steps in {r['wall_s'] / 60:.1f} min",
            "",
            "| fault | n | detected as | detection (s), median / p99 | fault → next step (s), median / p99 "
            "| steps redone |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for kind, k in r["by_kind"].items():
            lines.append(f"| {KIND_NAMES.get(kind, kind)} | {k['n']} | {', '.join(k['detected_as'])} "
                         f"| {_fmt(k['detected_s'])} | {_fmt(k['recovered_s'])} | {k['steps_redone']} |")
        for window, k in r["by_window"].items():
            lines.append(f"| fired mid-{window} (of the above) | {k['n']} | | {_fmt(k['detected_s'])} "
                         f"| {_fmt(k['recovered_s'])} | {k['steps_redone']} |")
        a = r["all"]
        lines += [f"| **all** | {a['n']} | | {_fmt(a['detected_s'])} | {_fmt(a['recovered_s'])} | {a['steps_redone']} |",
                  ""]
    names = list(result["runs"])
    lines += ["| figure | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(result["runs"][n]) for n in names) + " |")

    row("run length", lambda r: f"{r['wall_s'] / 60:.1f} min")
    row("faults injected (detected, recovered)", lambda r: "{} ({}, {})".format(
        len(r["failures"]), sum(f["detected_s"] is not None for f in r["failures"]),
        sum(f["recovered_s"] is not None for f in r["failures"])))
    row("failures the bench did not inject", lambda r: str(len(r["unexpected_failures"])))
    row("steps redone (completed steps rolled back and run again)",
        lambda r: f"{r['all']['steps_redone']} ({r['steps_redone_total']})")
    row("goodput, whole run / from the first step", lambda r: f"{_pct(r['goodput'])} / {_pct(r['goodput_after_start'])}")
    row("checkpoints committed", lambda r: str(r["checkpoints"]))
    row("final state bitwise equal to the failure-free run", lambda r: "—" if r.get("bitwise") is None else (
        f"yes ({r['bitwise']['arrays']} arrays)" if r["bitwise"]["equal"]
        else f"NO ({len(r['bitwise']['mismatched'])} of {r['bitwise']['arrays']} arrays differ)"))
    row("leaked: processes, nodes, placement groups, object-store bytes", lambda r: "—" if r.get("leaks") is None else (
        "none" if r["leaks"]["none"] else ", ".join(f"{k} {v}" for k, v in r["leaks"]["leaked"].items() if v)))
    lines.append("")
    lines.append("PASS: every fault detected and recovered, no other failure, every run finished, final states "
                 "bitwise equal, nothing leaked" if not result["fails"]
                 else "\n".join(f"FAIL: {x}" for x in result["fails"]))
    if st.get("wall_s"):
        lines.append(f"Whole soak: {st['wall_s'] / 60:.1f} min.")
    return "\n".join(lines)


def write(result: dict, out: str) -> dict:
    """soak.json and soak.md under `out`."""
    os.makedirs(out, exist_ok=True)
    files = {"json": os.path.join(out, "soak.json"), "md": os.path.join(out, "soak.md")}
    with open(files["json"], "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(files["md"], "w") as f:
        f.write(table(result) + "\n")
    return files
