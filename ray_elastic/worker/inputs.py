"""How a worker's apply and reduce calls get their inputs (the other
slices' gradient payloads, or partial sums): fetched by the call itself,
so that the controller can make it give up.

Passed as Ray call arguments, the inputs would be fetched by Ray before the
call starts, and Ray runs a worker's calls from the driver in order: until
they arrived, nothing else the driver asked of that worker would run. An
input whose only copy was on a node that just died arrives (as an error)
only after Ray's pull timeout (10 s) or its health checks declaring the
node dead, so a node loss at the wrong moment stalled the survivors'
recovery by that long. Fetched here, the wait ends as soon as the
controller says a slice was lost (worker.abort_waits), and the call raises
without changing anything. On a slice of several hosts an apply's inputs
are fetched by a call ahead of it (`take_inputs`) in the same way, and
held for it (`CallInputs.taken`): the slice's hosts then apply all or none
(dispatch/applies.py).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from ray_elastic.failures.internal import InputsAborted, InputsLost

__all__ = ["Aborts", "CallInputs", "InputsAborted", "InputsLost", "fetch_inputs", "POLL_S"]

POLL_S = 0.02  # how often a waiting call looks for an abort


class Aborts:
    """Which of a worker's waiting calls must give up. The controller's
    StepRunner numbers its calls by epoch (one per failure) and step.
    After a failure, the calls it issued ahead for the next step are void
    whatever was lost (it drops them), while the failed step's own applies
    are given up on only when the lost slice's node is gone or silent
    (after a process death its gradients still arrive and the survivors
    complete the step)."""

    def __init__(self) -> None:
        self._marks: dict[int, int] = {}  # epoch -> first step of it given up

    def abort(self, epoch: int, from_step: int = 0) -> None:
        """Calls of `epoch` or before, for step `from_step` or later."""
        self._marks[epoch] = min(from_step, self._marks.get(epoch, from_step))

    def covers(self, epoch: int, step: int) -> bool:
        # A copy: `abort` runs on the worker's control thread meanwhile.
        return any(epoch <= e and step >= first for e, first in list(self._marks.items()))


class CallInputs:
    """A worker's inputs for one run: what each call fetches (`fetch`),
    given up on as `aborts` says, the wait counted by `took_in`; and the
    inputs of an apply taken ahead of it (`take`: on a slice of several
    hosts every host's apply waits for every host's take, so that the
    slice applies a step on all its hosts or none, dispatch/applies.py)."""

    def __init__(self, where: str, took_in: Callable[[float], None]) -> None:
        self.aborts = Aborts()
        self._where, self._took_in = where, took_in
        self._taken: dict[tuple[int, int], tuple] = {}  # (step, epoch) -> an apply's inputs

    def fetch(self, refs: list, epoch: int, step: int) -> tuple:
        t0 = time.perf_counter()
        try:
            return fetch_inputs(refs, lambda: self.aborts.covers(epoch, step), f"{self._where}: step {step}'s inputs")
        finally:
            self._took_in(time.perf_counter() - t0)

    def take(self, refs: list, epoch: int, step: int) -> None:
        """Fetch the inputs of step `step`'s apply issued in `epoch`, and hold them for it."""
        self._taken[(step, epoch)] = self.fetch(refs, epoch, step)

    def taken(self, epoch: int, step: int, applied: bool) -> tuple:
        """The inputs taken for that apply, let go with those of earlier
        steps (a take given up on leaves its own); none if the step is
        `applied` already (a re-issued apply answers without them)."""
        got = self._taken.pop((step, epoch), None)
        for key in [key for key in self._taken if key[0] <= step]:  # in place: a take may add one meanwhile
            self._taken.pop(key, None)
        if got is None and not applied:
            raise RuntimeError(f"{self._where}: the apply of step {step} (epoch {epoch}) found no inputs taken")
        return got or ()


def fetch_inputs(refs: list, aborted: Callable[[], bool], what: str) -> tuple:
    """The values of `refs` (other items pass through), in order; raises
    InputsAborted once `aborted()` is true while some are still coming, the
    first failed input's own Ray error as soon as it is known (not once the
    others are in), or InputsLost when Ray's client itself
    fails (this worker's raylet gone: a broken pipe, a connection reset)."""
    import ray

    try:
        return _fetch(ray, refs, aborted, what)
    except (ray.exceptions.RayError, InputsAborted):
        raise
    except Exception as e:
        raise InputsLost(f"{what}: {type(e).__name__}: {e}") from e


def _fetch(ray, refs: list, aborted: Callable[[], bool], what: str) -> tuple:
    wanted = list(dict.fromkeys(r for r in refs if isinstance(r, ray.ObjectRef)))
    got: dict = {}
    left = wanted
    if wanted:
        ready, left = ray.wait(wanted, num_returns=len(wanted), timeout=0)
        if ready:
            got.update(zip(ready, ray.get(ready)))  # a failed input raises here
    if left:
        # Ray's wait cannot be interrupted: it runs on a thread of its own
        # (left behind on an abort until the input it waits for settles; it
        # holds no value), and hands each input on as it arrives. This
        # thread takes them, and looks for an abort in between. The first
        # that failed ends the wait: the call is void, and waiting on for
        # the others (a step's gradients still computing) would hold one of
        # the worker's threads for nothing.
        arrivals: queue.Queue = queue.Queue()
        stop = threading.Event()

        def hand_on(left=left):
            try:
                while left and not stop.is_set():
                    ready, left = ray.wait(left, num_returns=1, timeout=None)
                    arrivals.put(ready)
            except BaseException as e:  # raised below, on the call's thread
                arrivals.put(e)

        threading.Thread(target=hand_on, daemon=True, name="inputs").start()
        try:
            coming = len(left)
            while coming:
                if aborted():
                    raise InputsAborted(f"{what} given up: a slice was lost")
                try:
                    ready = arrivals.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if isinstance(ready, BaseException):
                    raise ready
                got.update(zip(ready, ray.get(ready)))  # a failed input raises here
                coming -= len(ready)
        finally:
            stop.set()
    return tuple(got[r] if isinstance(r, ray.ObjectRef) else r for r in refs)
