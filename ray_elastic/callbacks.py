"""Hooks for cross-cutting work (progress, metrics, event logs, adding a
replacement node in a demo). The controller calls them from the driver's
main thread; every hook has an empty default, so a callback overrides only
what it needs and the control loop never grows for them."""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["Callback", "FunctionCallback"]


class Callback:
    def on_start(self, trainer: Any) -> None:
        """Before any slice is reserved."""

    def on_event(self, event: dict) -> None:
        """A timeline event: {"t": seconds since start, "event": name, ...}."""

    def on_step(self, step: int, metrics: dict) -> None:
        """After every completed step. metrics: loss, slices, step_s."""

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
