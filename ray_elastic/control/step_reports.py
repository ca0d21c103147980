"""What callbacks hear of each step (`on_step`): its loss and aux
metrics, how many slices computed it, its time, and the hosts' timings
and pauses.

A DiLoCo inner step that a replica was lost in, under pause, is held:
the survivors took it, and the replacement recomputes the lost replica's
part of it as it joins (control/diloco.py). Then the step is reported
with every replica's loss, as the failure-free run reports it."""

from __future__ import annotations

from typing import Optional, Sequence

from ray_elastic.callbacks import Callback
from ray_elastic.control.checking import Checks
from ray_elastic.worker.gc_pauses import step_pauses

__all__ = ["StepReports"]


class StepReports:
    """Steps as the callbacks hear of them; at most one held."""

    def __init__(self, callbacks: Sequence[Callback]):
        self._callbacks = callbacks  # the controller's list: callbacks added later hear too
        self._held: Optional[tuple[int, dict]] = None  # (step, its metrics)

    @property
    def holding(self) -> bool:
        return self._held is not None

    def report(self, step: int, result, step_s: float, slices: int, held: bool = False) -> None:
        """`step` is done (`result`: its StepResult); `held`: its report
        waits for `release` with every replica's loss."""
        metrics = {"loss": result.loss, **result.aux, "slices": slices, "step_s": step_s,
                   **Checks.timing(result.metrics), **step_pauses(result.metrics)}
        # One held before goes out as it is: a later report of the same step replaces it (ReportRecorder).
        self.release(step)
        if held:
            self._held = (step, metrics)
        else:
            self._emit(step, metrics)

    def release(self, run_step: int, full=None) -> None:
        """Report the held step, with `full`'s loss and aux metrics (the
        StepResult over every replica) if given, else as it is; dropped
        if the run went back before it (`run_step`: the steps it holds)."""
        held, self._held = self._held, None
        if held is not None and held[0] <= run_step:
            step, metrics = held
            self._emit(step, {**metrics, **({"loss": full.loss, **full.aux} if full is not None else {})})

    def _emit(self, step: int, metrics: dict) -> None:
        for cb in self._callbacks:
            cb.on_step(step, metrics)
