"""Draw a run's timeline as a PNG: steps against wall time, failures and
recoveries marked, live slices on a second axis, loss underneath.

    ray-elastic timeline run.events.jsonl -o run.png     # an EventLog file
    ray-elastic timeline --report run.json -o run.png    # a RunReport JSON

An events file (`ray_elastic.observe.events.EventLog`) has a record per step, so the
step curve is exact, rewinds included. A report has only the kept steps'
durations; the curve is rebuilt from them, pinned to the events' times (a
step is never drawn before the event that preceded it, and a "recovered"
event gives its step's exact time).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple, Optional

from ray_elastic.errors import EventsFileError, TimelineInputError
from ray_elastic.observe.events import read_events

__all__ = ["RunTimeline", "StepPoint", "load_timeline", "draw_timeline"]




class StepPoint(NamedTuple):
    t: float  # when the step completed, seconds since the start
    step: int
    slices: Optional[int] = None
    loss: Optional[float] = None
    step_s: Optional[float] = None  # how long it took


@dataclasses.dataclass
class RunTimeline:
    events: list[dict]  # controller events, with "t" and "event"
    steps: list[StepPoint]
    steps_requested: Optional[int] = None
    policy: Optional[str] = None
    num_slices: Optional[int] = None
    source: str = ""  # "events" or "report"
    summary: Optional[dict] = None


_META = {"run", "step", "summary"}


def load_timeline(path: str, kind: Optional[str] = None) -> RunTimeline:
    """Read an events file or a report (`kind` "events" or "report"; None:
    tell them apart from the content)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise TimelineInputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TimelineInputError(f"{path}: is a directory") from None
    except UnicodeDecodeError:
        raise TimelineInputError(f"{path}: not a text file (expected an events file or a run report JSON)") from None
    if not text.strip():
        raise TimelineInputError(f"{path}: empty file")
    whole: Any = None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        pass
    if kind == "report" or (kind is None and isinstance(whole, dict) and "events" in whole):
        if not isinstance(whole, dict) or "events" not in whole:
            raise TimelineInputError(
                f"{path}: not a run report (expected the JSON object `ray-elastic demo --report` "
                "or RunReport.write writes, with \"events\" and \"step_times\")"
            )
        return _from_report(whole, path)
    try:
        records = read_events(path)
    except EventsFileError as e:
        raise TimelineInputError(
            f"{e} -- expected an events file (JSON lines from EventLog) or a run report JSON"
        ) from None
    return _from_records(records, path)


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _from_records(records: list[dict], path: str) -> RunTimeline:
    events = [r for r in records if r.get("event") not in _META and _num(r.get("t")) is not None]
    steps = [
        StepPoint(float(r["t"]), int(r["step"]), r.get("slices"), _num(r.get("loss")), _num(r.get("step_s")))
        for r in records
        if r.get("event") == "step" and _num(r.get("t")) is not None and _num(r.get("step")) is not None
    ]
    head = next((r for r in records if r.get("event") == "run"), {})
    summary = next((r for r in records if r.get("event") == "summary"), None)
    if not events and not steps:
        raise TimelineInputError(f"{path}: no events or steps with a time \"t\" in it")
    return RunTimeline(
        events=events, steps=steps, steps_requested=head.get("steps"), policy=head.get("policy"),
        num_slices=head.get("num_slices"), source="events", summary=summary,
    )


def _from_report(rep: dict, path: str) -> RunTimeline:
    events = [e for e in rep.get("events") or [] if isinstance(e, dict) and _num(e.get("t")) is not None]
    times = [float(x) for x in rep.get("step_times") or []]
    slices = list(rep.get("slices_per_step") or [])
    losses = list(rep.get("losses") or [])
    if not events and not times:
        raise TimelineInputError(f"{path}: the report has no events and no step times")
    # Pins: "recovered" gives when its step completed; other events say the
    # run held `step` at time t, so the next step ends no sooner than
    # t + its duration.
    exact: dict[int, float] = {}
    floor: dict[int, float] = {}
    for e in events:
        name, t = e["event"], float(e["t"])
        if name == "recovered" and _num(e.get("step")) is not None:
            exact[int(e["step"])] = t
        elif name == "start":
            floor[0] = max(floor.get(0, 0.0), t)
        elif _num(e.get("step")) is not None and name in ("grow", "shrink", "wait"):
            s = int(e["step"])
            floor[s] = max(floor.get(s, 0.0), t)
    steps = []
    t = floor.get(0, 0.0)
    for i, dt in enumerate(times):
        t = max(t, floor.get(i, t)) + dt
        t = exact.get(i + 1, t)
        steps.append(StepPoint(t, i + 1, slices[i] if i < len(slices) else None,
                               _num(losses[i]) if i < len(losses) else None, dt))
    return RunTimeline(
        events=events, steps=steps, steps_requested=rep.get("steps_requested"), policy=rep.get("policy"),
        num_slices=rep.get("num_slices"), source="report",
        summary={k: rep.get(k) for k in ("steps_completed", "final_loss", "wall_s", "goodput", "error")},
    )


def _slices_series(tl: RunTimeline) -> list[tuple[float, int]]:
    """(t, live slices) change points, from events and step records."""
    pts: list[tuple[float, int, int]] = []  # (t, order, n)
    n: Optional[int] = None
    for e in tl.events:
        name, t = e["event"], float(e["t"])
        if name in ("start", "grow", "shrink") and isinstance(e.get("slices"), list):
            n = len(e["slices"])
        elif name == "detected" and n is not None:
            n = max(0, n - 1)
        else:
            continue
        pts.append((t, 0, n))
    for p in tl.steps:
        if isinstance(p.slices, int):
            pts.append((p.t, 1, p.slices))
    pts.sort()
    out: list[tuple[float, int]] = []
    for t, _, n in pts:
        if not out or out[-1][1] != n:
            out.append((t, n))
    return out


# How each event is drawn: (label, colour, line style, width).
_STYLE = {
    "fault": ("fault injected", "#d62728", "-", 2.0),
    "detected": ("failure detected", "#ff7f0e", "--", 2.0),
    "shrink": ("shrink (train on survivors)", "#8c564b", "-.", 1.6),
    "grow": ("grow (slice joined)", "#2ca02c", "-.", 1.6),
    "rewind": ("rewind", "#9467bd", ":", 2.0),
    "recovered": ("recovered (next step done)", "#2ca02c", "-", 2.0),
    "restore": ("restore from checkpoint", "#17becf", "--", 1.6),
    "slice_ready": ("replacement ready", "#7f7f7f", ":", 1.0),
}
_SKIP = {"reserve", "start", "end", "replace", "wait"}  # drawn otherwise, or noise


def _event_style(name: str):
    if name in _STYLE:
        return _STYLE[name]
    if "checkpoint" in name or "restore" in name:
        return (name.replace("_", " "), "#1f77b4", ":", 1.0)
    return (name.replace("_", " "), "#bcbd22", ":", 1.0)


def draw_timeline(tl: RunTimeline, out: str, title: Optional[str] = None) -> str:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    has_loss = any(p.loss is not None for p in tl.steps)
    fig, axes = plt.subplots(
        2 if has_loss else 1, 1, figsize=(13, 7.5 if has_loss else 5.2), sharex=True,
        gridspec_kw={"height_ratios": [3, 1.3]} if has_loss else None, squeeze=False,
    )
    ax = axes[0][0]
    lax = axes[1][0] if has_loss else None
    end_t = max([p.t for p in tl.steps] + [float(e["t"]) for e in tl.events] + [1e-3])

    # Spans: fault (or detection) -> recovered is down/degraded time; wait ->
    # grow is the wait for a replacement.
    spans = []
    t_first = next((float(e["t"]) for e in tl.events if e["event"] == "start"), None)
    if t_first is not None and t_first > 0:
        spans.append((0.0, t_first, "#c7c7c7", "starting (slices placed, workers up)"))
    open_fault: Optional[float] = None
    open_wait: Optional[float] = None
    for e in tl.events:
        name, t = e["event"], float(e["t"])
        if name in ("fault", "detected") and open_fault is None:
            open_fault = t
        elif name == "recovered" and open_fault is not None:
            spans.append((open_fault, t, "#ff9896", "fault → recovered"))
            open_fault = None
        if name == "wait" and open_wait is None:
            open_wait = t
        elif name in ("grow", "end") and open_wait is not None:
            spans.append((open_wait, t, "#ffdd71", "waiting for a replacement"))
            open_wait = None
    if open_fault is not None:
        spans.append((open_fault, end_t, "#ff9896", "fault → recovered"))
    if open_wait is not None:
        spans.append((open_wait, end_t, "#ffdd71", "waiting for a replacement"))

    handles: dict[str, Any] = {}
    for a in filter(None, (ax, lax)):
        for t0, t1, colour, label in spans:
            t1 = max(t1, t0 + end_t * 0.002)
            if label.startswith("waiting"):  # hatched, so it reads over the fault span
                kw = dict(facecolor="none", edgecolor="#d4a017", hatch="//", lw=0, alpha=0.8)
            else:
                kw = dict(facecolor=colour, alpha=0.35, lw=0)
            a.axvspan(t0, t1, zorder=0, **kw)
            handles.setdefault(label, Patch(label=label, **kw))

    # Vertical lines; frequent ones (checkpoints every N steps) drawn thinner.
    t_start = next((float(e["t"]) for e in tl.events if e["event"] == "start"), None)
    counts: dict[str, int] = {}
    for e in tl.events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    for e in tl.events:
        name = e["event"]
        if name in _SKIP or (name == "slice_ready" and (t_start is None or float(e["t"]) <= t_start)):
            continue  # the first slices coming up are not replacements
        label, colour, style, width = _event_style(name)
        alpha = 0.9 if counts[name] <= 20 else 0.35
        for a in filter(None, (ax, lax)):
            line = a.axvline(float(e["t"]), color=colour, ls=style, lw=width if counts[name] <= 20 else 0.7, alpha=alpha, zorder=2)
        handles.setdefault(label, line)

    # Steps against time (a rewind shows as a drop).
    if tl.steps:
        pts = [(p.t, 2, p.step) for p in tl.steps]
        # A step began where the one before it ended, unless the run was
        # stalled in between: hold the curve flat across such gaps.
        pts += [(p.t - p.step_s, 1, p.step - 1) for p in tl.steps if p.step_s is not None and p.step_s >= 0]
        if tl.source == "events":  # a rewind drops the curve at once
            for e in tl.events:
                if e["event"] == "rewind" and _num(e.get("to_step")) is not None and _num(e.get("from_step")) is not None:
                    pts += [(float(e["t"]), -1, int(e["from_step"])), (float(e["t"]), 0, int(e["to_step"]))]
        first = next((float(e["t"]) for e in tl.events if e["event"] == "start"), None)
        if first is not None and first <= tl.steps[0][0] and tl.steps[0][1] <= 1:
            pts.append((first, 0, 0))
        pts.sort()
        (h,) = ax.plot([t for t, _, _ in pts], [s for _, _, s in pts], color="#1f3b73", lw=2.0, zorder=3)
        if len(tl.steps) <= 200:
            ax.plot([p.t for p in tl.steps], [p.step for p in tl.steps], ".", color="#1f3b73", ms=4, zorder=3)
        handles["step" + (" (rebuilt from report)" if tl.source == "report" else "")] = h
    if tl.steps_requested:
        handles["steps requested"] = ax.axhline(tl.steps_requested, color="#1f3b73", lw=0.8, ls=":", alpha=0.6, zorder=1)
    ax.set_ylabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.25)

    # Live slices on the right axis.
    sl = _slices_series(tl)
    if sl:
        ax2 = ax.twinx()
        xs = [t for t, _ in sl] + [end_t]
        ys = [n for _, n in sl] + [sl[-1][1]]
        (h,) = ax2.step(xs, ys, where="post", color="#e377c2", lw=2.2, alpha=0.85, zorder=4)
        handles["live slices (right axis)"] = h
        top = max(ys + [tl.num_slices or 0])
        ax2.set_ylim(-0.1, top + 0.6)
        ax2.set_yticks(range(0, top + 1))
        ax2.set_ylabel("live slices", color="#c2188f")
        ax2.tick_params(axis="y", colors="#c2188f")

    if lax is not None:
        pts = []
        for p in tl.steps:
            if p.loss is None:
                continue
            if pts and p.step_s is not None and p.t - p.step_s > pts[-1][0]:
                pts.append((p.t - p.step_s, pts[-1][1]))  # no new loss across a stall
            pts.append((p.t, p.loss))
        lax.plot([p[0] for p in pts], [p[1] for p in pts], color="#444444", lw=1.4, zorder=3)
        lax.set_ylabel("loss")
        lax.grid(True, alpha=0.25)
        lax.set_xlabel("wall time since start (s)")
    else:
        ax.set_xlabel("wall time since start (s)")
    ax.set_xlim(0, end_t * 1.01)

    if title is None:
        bits = ["ray_elastic run"]
        if tl.policy:
            bits.append(f"policy={tl.policy}")
        if tl.num_slices:
            bits.append(f"slices={tl.num_slices}")
        s = tl.summary or {}
        if s.get("steps_completed") is not None:
            bits.append(f"steps {s['steps_completed']}/{tl.steps_requested}")
        if isinstance(s.get("goodput"), (int, float)):
            bits.append(f"goodput {s['goodput']:.2f}")
        if s.get("error"):
            bits.append("FAILED")
        title = "  ·  ".join(bits)
    ax.set_title(title)
    ax.legend(
        handles=list(handles.values()), labels=list(handles), loc="upper left",
        bbox_to_anchor=(1.07 if sl else 1.01, 1.0), fontsize=8, framealpha=0.9, borderaxespad=0,
    )
    fig.tight_layout()
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main_timeline(path: str, out: Optional[str] = None, kind: Optional[str] = None, title: Optional[str] = None) -> str:
    tl = load_timeline(path, kind)
    if out is None:
        root, _ = os.path.splitext(path)
        out = root + ".png"
    return draw_timeline(tl, out, title)
