"""What a run reports: a timeline of events and a summary, as JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

__all__ = ["FailureRecord", "RunReport"]


@dataclasses.dataclass
class FailureRecord:
    kind: str
    slice: int
    host: int
    step: int  # the step in flight when the slice failed
    detected_s: float  # fault (or first sign of it) -> exception in the driver
    recovered_s: Optional[float] = None  # fault -> first step completed after it
    steps_rewound: int = 0  # steps whose work was thrown away
    compute_redone: float = 0.0  # steps of compute done again (a fraction when only a lost slice's shards were)
    slices_after: int = 0  # slices training right after the recovery
    restored_from: str = ""  # "live" (survivors' state) or "snapshot"
    cause: str = ""


@dataclasses.dataclass
class RunReport:
    policy: str
    num_slices: int
    steps_requested: int
    spare_slices: int = 0
    steps_completed: int = 0
    driver_pid_start: int = 0
    driver_pid_end: int = 0
    final_loss: float = float("nan")
    wall_s: float = 0.0
    productive_s: float = 0.0  # time in steps whose results were kept
    failures: list[FailureRecord] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    step_times: list[float] = dataclasses.field(default_factory=list)
    slices_per_step: list[int] = dataclasses.field(default_factory=list)
    # Per step, the program's aux metrics (and evals on the steps that ran one).
    metrics_per_step: list[dict[str, float]] = dataclasses.field(default_factory=list)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    outcome: str = "completed"  # completed | preempted | failed
    resumed_from: Optional[int] = None  # checkpoint step a cold start resumed from
    checkpoints: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Per snapshot taken with two or more live slices (control/snapshotting.py):
    # step, bytes_per_host, seal_s, views_cpu_s, step_path_s, interval, max_redo_steps.
    snapshots: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def snapshot_interval(self) -> Optional[int]:
        """The interval between snapshots last chosen (None: none measured);
        a loss of every slice redoes at most `max_redo_steps` of the last."""
        return self.snapshots[-1]["interval"] if self.snapshots else None

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["goodput"] = self.goodput
        d["snapshot_interval"] = self.snapshot_interval
        return d

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
