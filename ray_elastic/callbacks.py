"""Hooks for cross-cutting work (progress, metrics, event logs, adding a
replacement node in a demo). The controller calls them from the driver's
main thread; every hook has an empty default, so a callback overrides only
what it needs and the control loop never grows for them."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Optional

__all__ = ["CONTROLLER_STEP_KEYS", "Callback", "FunctionCallback", "Phase", "RunStatus"]

# The step metrics the controller adds to the program's: the loss, the
# live slices, the step's seconds and, on a step that reports state
# fingerprints, the seconds the slowest host took to make them and the
# longest any apply waited for them (control/integrity.py).
CONTROLLER_STEP_KEYS = ("loss", "slices", "step_s", "check_s", "check_wait_s", "gc_pause_s",
                        "gc_full")


class Phase(str, enum.Enum):
    """What a run is doing, as the controller announces it (`on_state`)."""

    STARTING = "starting"  # reserving and setting up slices, first compile
    TRAINING = "training"  # steps completing, no failure open
    RECOVERING = "recovering"  # a failure is open: training on fewer slices, or redoing work
    WAITING = "waiting"  # paused until a replacement slice is ready (policy "pause")
    STOPPING = "stopping"  # a preemption notice: saving, then ending the run
    DONE = "done"  # every requested step completed
    FAILED = "failed"  # ended early: an error, or stopped by a preemption


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """The run's state, announced by the controller each time it changes.

    t: seconds since the run started, when this state began.
    step: steps completed in the state the live slices hold.
    live_slices: slices training now. pending: slices being replaced.
    deadline_s: while WAITING, how long the policy waits for them.
    reason: while STOPPING or FAILED, why.
    """

    phase: Phase
    t: float
    step: int
    live_slices: int
    pending: tuple[int, ...] = ()
    deadline_s: Optional[float] = None
    reason: str = ""


class Callback:
    def on_start(self, trainer: Any) -> None:
        """Before any slice is reserved."""

    def on_event(self, event: dict) -> None:
        """A timeline event: {"t": seconds since start, "event": name, ...}."""

    def on_state(self, status: RunStatus) -> None:
        """The run's state changed (the controller's one model of it): starting,
        training, recovering, waiting, stopping, done or failed."""

    def on_step(self, step: int, metrics: dict) -> None:
        """After every completed step. metrics: loss, slices, step_s (and
        check_s and check_wait_s on a step that reports state
        fingerprints: the slowest host's seconds making them, the longest
        any apply waited for them), gc_pause_s and gc_full (the longest
        any host's garbage collector held its Python still since its last
        step, and the hosts' full collections), and the program's aux
        metrics by name (reduced over the global batch)."""

    def on_end(self, report: Any) -> None:
        """After the run, successful or not; report is the RunReport."""


class FunctionCallback(Callback):
    """Adapts plain functions: on_step(step, loss, slices), on_event(event)."""

    def __init__(
        self,
        on_step: Optional[Callable[[int, float, int], None]] = None,
        on_event: Optional[Callable[[dict], None]] = None,
    ):
        self._step = on_step
        self._event = on_event

    def on_event(self, event: dict) -> None:
        if self._event is not None:
            self._event(event)

    def on_step(self, step: int, metrics: dict) -> None:
        if self._step is not None:
            self._step(step, metrics["loss"], metrics["slices"])
