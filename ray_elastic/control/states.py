"""The controller's run state (`Running`, `Waiting`, `Stopping`), the
failures whose recovery is still open, and how both read to a user: the
one `RunStatus` the controller announces to callbacks (`status`)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

from ray_elastic.callbacks import Phase, RunStatus

__all__ = ["OpenFailure", "RunState", "Running", "Stopping", "Waiting", "status"]


@dataclasses.dataclass(frozen=True)
class Running:
    fresh: bool = True  # the next step is the first since a (re)start: it may compile


@dataclasses.dataclass(frozen=True)
class Waiting:
    since: float  # training paused for replacements since then
    until: Optional[float] = None  # when the policy stops waiting


@dataclasses.dataclass(frozen=True)
class Stopping:
    reason: str


RunState = Union[Running, Waiting, Stopping]


@dataclasses.dataclass
class OpenFailure:
    """A failure whose recovery (the next completed step) is pending."""

    slice_id: int
    step: int  # the step in flight when it happened
    t_fault: float
    steps_rewound: int = 0
    restored_from: str = ""
    compute_redone: Optional[float] = None  # None: steps_rewound whole steps


def status(state: RunState, open_failures: Sequence[OpenFailure], started: bool, outcome: str,
           t: float, step: int, live_slices: int, error: str = "") -> RunStatus:
    """The user's view of the run (callbacks' `on_state`), from the
    controller's own state. outcome: "" while the run goes on, else the
    end's ("completed", "failed", "preempted")."""
    pending = tuple(sorted({f.slice_id for f in open_failures}))
    deadline_s, reason = None, ""
    if outcome:
        phase = Phase.DONE if outcome == "completed" else Phase.FAILED
        reason = error or ("" if outcome == "completed" else outcome)
    elif isinstance(state, Stopping):
        phase, reason = Phase.STOPPING, state.reason
    elif isinstance(state, Waiting):
        phase = Phase.WAITING
        deadline_s = None if state.until is None else round(state.until - state.since, 3)
    elif pending:
        phase = Phase.RECOVERING
    elif started:
        phase = Phase.TRAINING
    else:
        phase = Phase.STARTING
    return RunStatus(phase, round(t, 4), step, live_slices, pending, deadline_s, reason)
