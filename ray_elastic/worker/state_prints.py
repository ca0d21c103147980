"""State fingerprints taken off the step's path.

An apply that makes a state to be checked (`state_check_every`) starts
its fingerprint on a thread of its own and returns at once, as an apply
without a check does: the fingerprint waits for the update to be computed
and reads the state while the next step's gradients compute on it. The
next apply reports it (keyed by the step of the state), after
waiting for it if it is not done, and before its own update, which donates
the arrays the fingerprint reads. So a divergence is reported one step
later than the state it is in, which the controller's checks allow for
(control/integrity.py); the run's last state, which no apply follows, is
fingerprinted within its apply (`final_step`), and so is every state
held by a process that drives several devices (a slice of several
processes, or of several devices per process: worker/steps.py says why).

A state loaded in between (a rollback, a resize's reload) makes a pending
fingerprint void: it was of the state replaced, even at the same step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from ray_elastic.worker.fingerprint import state_fingerprint

__all__ = ["StatePrints"]


def _print(tree: Any) -> tuple[list[int], float]:
    import jax

    jax.block_until_ready(tree)  # the update first: it is not the check's time
    t0 = time.perf_counter()
    return state_fingerprint(tree), time.perf_counter() - t0


class StatePrints:
    """The fingerprint of one held state at a time, made on a thread."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        # (step, generation of the held state, seconds its apply waited for
        # the update, the fingerprint's future)
        self._pending: Optional[tuple[int, int, float, Future]] = None

    def begin(self, step: int, generation: int, tree: Any, waited: float = 0.0) -> None:
        """Fingerprint `tree`, the held state of `step` (computed: its
        apply waited `waited` seconds for it), on the thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="state-print")
        self.wait()
        self._pending = (step, generation, waited, self._pool.submit(_print, tree))

    def now(self, tree: Any) -> tuple[list[int], float]:
        """`tree`'s fingerprint made now, and its seconds."""
        return _print(tree)

    def wait(self) -> None:
        """Let a pending fingerprint finish: its arrays are about to be donated."""
        if self._pending is not None:
            self._pending[3].exception()

    def take(self, step: int, generation: int) -> Optional[tuple[list[int], float, float]]:
        """The pending fingerprint, its seconds on the thread, and the
        seconds the step's path waited for it (its apply for the update,
        this call for the thread), if it is of the held state (`step`,
        `generation`); None if there is none (a state not checked, or
        loaded since). Kept, so that a re-issued apply reports it again."""
        p = self._pending
        if p is None or p[:2] != (step, generation):
            return None
        t0 = time.perf_counter()
        prints, took = p[3].result()
        return prints, took, p[2] + time.perf_counter() - t0
