"""The run report, recorded as a callback: it is built from the events and
steps every other callback sees, so the control loop keeps no report
bookkeeping of its own."""

from __future__ import annotations

import os
from typing import Any

from ray_elastic.callbacks import CONTROLLER_STEP_KEYS, Callback
from ray_elastic.observe.report import FailureRecord, RunReport

__all__ = ["ReportRecorder"]


class ReportRecorder(Callback):
    def __init__(self, report: RunReport):
        self.report = report
        self._open: list[FailureRecord] = []  # detected, not yet recovered

    def on_start(self, trainer: Any) -> None:
        self.report.driver_pid_start = os.getpid()

    def on_event(self, event: dict) -> None:
        r, name = self.report, event["event"]
        r.events.append(event)
        if name == "detected":
            rec = FailureRecord(
                kind=event["kind"], slice=event["slice"], host=event["host"], step=event["step"],
                detected_s=event["detected_s"], cause=event.get("cause", ""),
            )
            r.failures.append(rec)
            self._open.append(rec)
        elif name == "recovered":
            rec = next(f for f in self._open if f.slice == event["slice"])
            self._open.remove(rec)
            rec.recovered_s = event["recovered_s"]
            rec.steps_rewound = event["steps_rewound"]
            rec.compute_redone = event.get("compute_redone", float(rec.steps_rewound))
            rec.restored_from = event["restored_from"]
            rec.slices_after = event["slices_after"]
        elif name == "rewind":
            self._truncate(event["to_step"])
        elif name == "restore" and event.get("cold_start"):
            step = event["step"]  # steps done by an earlier run
            r.resumed_from = step
            r.losses = [float("nan")] * step
            r.step_times = [0.0] * step
            r.slices_per_step = [0] * step
            r.metrics_per_step = [{} for _ in range(step)]
        elif name == "snapshot":
            r.snapshots.append({k: v for k, v in event.items() if k not in ("event", "t")})
        elif name == "checkpoint_saved":
            r.checkpoints.append({k: event[k] for k in ("step", "seconds", "bytes")})
        elif name == "end":
            r.steps_completed = event["steps"]
            r.outcome = event["outcome"]
            r.error = event.get("error", "")
            r.wall_s = event["t"]
            r.productive_s = sum(r.step_times[: r.steps_completed])
            r.driver_pid_end = os.getpid()

    def _truncate(self, steps: int) -> None:
        r = self.report
        del r.losses[steps:], r.step_times[steps:], r.slices_per_step[steps:], r.metrics_per_step[steps:]

    def on_step(self, step: int, metrics: dict) -> None:
        r = self.report
        self._truncate(step - 1)  # a step redone after a rewind replaces the old one
        r.losses.append(metrics["loss"])
        r.step_times.append(metrics["step_s"])
        r.slices_per_step.append(metrics["slices"])
        r.metrics_per_step.append({k: v for k, v in metrics.items() if k not in CONTROLLER_STEP_KEYS})
        r.final_loss = metrics["loss"]
