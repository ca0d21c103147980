"""Charts of benchmark runs (matplotlib, Agg backend: no display needed).

- `timeline_png(runs, path)`: one subplot per run, completed step against
  wall time, the run's events (fault, detection, restart, restore, ...) as
  vertical lines;
- `bar_chart(rows, path)`: recovery time (fault to next completed step) per
  system and scenario, with min-max whiskers when a row carries a summary.

A run is a dict as `bench.raytrain.run_raytrain` returns: "system",
"scenario", "timeline" ([[t, step], ...]), "markers" ([{"t", "event"}, ...])
and optionally "recovered_s", "steps_rewound", "goodput".
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["timeline_png", "bar_chart", "MARKER_STYLES"]

# event -> (colour, line style)
MARKER_STYLES = {
    "fault": ("tab:red", "-"),
    "detect": ("tab:orange", "--"),
    "detected": ("tab:orange", "--"),
    "restart": ("tab:blue", ":"),
    "restore": ("tab:green", "-."),
    "recovered": ("tab:purple", "--"),
    "resize": ("tab:brown", ":"),
    "shrink": ("tab:brown", ":"),
    "grow": ("tab:olive", ":"),
    "wait": ("tab:gray", "--"),
    "drain_notice": ("tab:orange", ":"),
    "preempt_notice": ("tab:orange", ":"),
    "preempt_saved": ("tab:green", ":"),
    "rewind": ("tab:pink", "-."),
    "slice_ready": ("tab:cyan", ":"),
}
_OTHER = ("tab:gray", ":")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(value, spec: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:{spec}}{unit}"


def _title(run: dict) -> str:
    head = f"{run.get('system', '?')} / {run.get('scenario', '?')}"
    parts = []
    if "recovered_s" in run:
        parts.append(f"fault→next step {_fmt(run.get('recovered_s'), '.1f', ' s')}")
    if run.get("detected_s") is not None:
        parts.append(f"detected {_fmt(run['detected_s'], '.1f', ' s')}")
    if "steps_rewound" in run:
        parts.append(f"redone {_fmt(run.get('steps_rewound'), 'd')}")
    if "goodput" in run:
        parts.append(f"goodput {_fmt(run.get('goodput'), '.0%')}")
    if run.get("error") or any("time limit" in n for n in run.get("notes") or ()):
        parts.append("did not finish" if run.get("steps_completed", 0) < run.get("steps_requested", 0)
                     else "error")
    return head + (": " + ", ".join(parts) if parts else "")


def _segments(points: list) -> list[list]:
    """Split a timeline where the step goes back (a restart from an older
    checkpoint), so no line joins the two attempts."""
    out: list[list] = []
    for p in points:
        if not out or p[1] <= out[-1][-1][1]:
            out.append([])
        out[-1].append(p)
    return out


def timeline_png(runs: list[dict], path: str, title: Optional[str] = None) -> str:
    """One PNG, a subplot per run: step against wall time, events marked."""
    if not runs:
        raise ValueError("no runs to chart")
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.8 * len(runs) + 0.4), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        points = run.get("timeline") or []
        for i, segment in enumerate(_segments(points)):
            ts, steps = zip(*segment)
            ax.plot(ts, steps, ".-", color="black", markersize=3, linewidth=0.8,
                    label="completed step" if i == 0 else None)
        seen = set()
        for m in run.get("markers") or []:
            event = m.get("event", "?")
            colour, style = MARKER_STYLES.get(event, _OTHER)
            ax.axvline(m["t"], color=colour, linestyle=style, linewidth=1.4,
                       label=None if event in seen else event)
            if event == "restore" and m.get("step") is not None:
                ax.annotate(f"from {m['step']}", (m["t"], 0), xytext=(3, 3), textcoords="offset points",
                            fontsize=7, color=colour)
            seen.add(event)
        ax.set_title(_title(run), fontsize=9, loc="left")
        ax.set_ylabel("step")
        if run.get("wall_s"):  # show the whole run, e.g. a hang that was never resolved
            ax.set_xlim(0, max([run["wall_s"]] + [t for t, _ in points]) * 1.01)
        else:
            ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if points or seen:
            ax.legend(loc="upper left", fontsize=7, framealpha=0.8)
    axes[-1, 0].set_xlabel("wall time since start (s)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _value(v):
    """(centre, low, high) of a number or of a summary dict (bench.common.summary)."""
    if isinstance(v, dict):
        if not v.get("n"):
            return None, None, None
        return v["median"], v.get("min", v["median"]), v.get("max", v["median"])
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None, None, None
    return float(v), float(v), float(v)


def bar_chart(table_rows: list[dict], path: str, key: str = "recovered_s",
              ylabel: str = "fault → next completed step (s)", title: Optional[str] = None) -> str:
    """Grouped bars: one group per scenario, one bar per system.

    Each row: {"system", "scenario", key: number, summary dict or None}. A
    missing value (e.g. a hang never detected) is drawn as "n/a".
    """
    if not table_rows:
        raise ValueError("no rows to chart")
    plt = _plt()
    scenarios = list(dict.fromkeys(r["scenario"] for r in table_rows))
    systems = list(dict.fromkeys(r["system"] for r in table_rows))
    by = {(r["system"], r["scenario"]): r.get(key) for r in table_rows}
    width = 0.8 / len(systems)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(scenarios) * max(1, len(systems)) / 2 + 3), 4.2))
    top = max([_value(v)[2] or 0.0 for v in by.values()] + [1.0])
    for i, system in enumerate(systems):
        xs, hs, lo, hi, missing = [], [], [], [], []
        for j, scenario in enumerate(scenarios):
            x = j - 0.4 + width * (i + 0.5)
            if (system, scenario) not in by:
                continue
            c, low, high = _value(by[(system, scenario)])
            if c is None:
                missing.append(x)
                continue
            xs.append(x)
            hs.append(c)
            lo.append(c - low)
            hi.append(high - c)
        colour = colours[i % len(colours)]
        bars = ax.bar(xs, hs, width * 0.95, label=system, color=colour,
                      yerr=[lo, hi] if any(lo) or any(hi) else None, capsize=3)
        for rect, h in zip(bars, hs):
            ax.annotate(f"{h:.1f}", (rect.get_x() + rect.get_width() / 2, h), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
        for x in missing:
            ax.annotate("n/a", (x, 0), ha="center", va="bottom", fontsize=7, color=colour,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xlim(-0.5, len(scenarios) - 0.5)
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, top * 1.15)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curves_png(curves: dict, path: str, title: str, ylabel: str = "loss") -> str:
    """One PNG of one line per name in `curves` ({name: values by step, from step 1})."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, linewidth=1.0, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
