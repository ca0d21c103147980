"""The training state a worker holds, and the step it is the result of.

The state lies on the slice's mesh as its layout says (layout.py):
replicated, every device holding all of it, or sharded, each host holding
its own blocks. Two of the worker's actor threads touch it: the step's
calls, and a joining slice's donor copying it out (`SliceWorker.state`)
or a load replacing it, hence the locks.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

__all__ = ["HeldState"]


class HeldState:
    """params and opt_state (global JAX arrays, None until made or loaded),
    `step`: how many steps they are the result of (-1 before set-up), and
    `last_apply`: the metrics of the apply that made them (None after a
    load), so that an apply re-issued for a step already taken returns
    them instead of applying twice."""

    def __init__(self) -> None:
        self.params: Any = None
        self.opt_state: Any = None
        self.step = -1
        self.last_apply: Optional[dict] = None
        # Counts the states held other than by an apply (set-up, loads): a
        # fingerprint begun of one is void once another is held.
        self.generation = 0
        # Held by an apply and by a copy of the state (a donor's `state`,
        # on a second actor thread), so that the apply does not replace
        # the state while it is being copied.
        self.lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._initial: Any = None

    def start(self, initial) -> None:
        """At set-up: step 0, its state made by `initial.make()` when
        first needed (`ensure`), not now: a replacement loads the live
        state instead."""
        self.params = self.opt_state = None
        self.step = 0
        self.generation += 1
        self._initial = initial

    def ensure(self) -> None:
        """Make the step-0 state if no state is held yet (a slice that
        starts the run; a replacement loads one instead)."""
        with self._init_lock:
            if self.params is None:
                params, self.opt_state = self._initial.make()
                self.params = params

    def advance(self, params: Any, opt_state: Any) -> None:
        """An apply's result: the state of the next step. The caller holds
        `lock` and sets `last_apply` once its metrics are made."""
        self.params, self.opt_state = params, opt_state
        self.step += 1

    def hold(self, params: Any, opt_state: Any, step: int) -> int:
        """Replace the state by a loaded one, of `step`."""
        return self.hold_made(lambda: (params, opt_state), step)

    def hold_made(self, make: Callable[[], tuple], step: int) -> int:
        """Replace the state by `make()`'s (params, opt_state), of `step`,
        made under the locks: an apply or a copy on another thread, and the
        step-0 state's making, wait for the whole load."""
        with self.lock, self._init_lock:
            self.params, self.opt_state = make()
            self.step = step
            self.last_apply = None
            self.generation += 1
        return step
