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
without changing anything.
"""

from __future__ import annotations

import threading
from typing import Callable

from ray_elastic.errors import InputsAborted, InputsLost

__all__ = ["InputsAborted", "InputsLost", "fetch_inputs", "POLL_S"]

POLL_S = 0.02  # how often a waiting call looks for an abort




def fetch_inputs(refs: list, aborted: Callable[[], bool], what: str) -> tuple:
    """The values of `refs` (other items pass through), in order; raises
    InputsAborted once `aborted()` is true while some are still coming, a
    lost input's own Ray error, or InputsLost when Ray's client itself
    fails (this worker's raylet gone: a broken pipe, a connection reset)."""
    import ray

    try:
        return _fetch(ray, refs, aborted, what)
    except (ray.exceptions.RayError, InputsAborted):
        raise
    except Exception as e:
        raise InputsLost(f"{what}: {type(e).__name__}: {e}") from e


def _fetch(ray, refs: list, aborted: Callable[[], bool], what: str) -> tuple:
    pending = [r for r in refs if isinstance(r, ray.ObjectRef)]
    if pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
    if pending:
        # Ray's wait cannot be interrupted: it runs on a thread of its own
        # (left behind on an abort until Ray settles the input, as a value
        # or an error), and this one looks for an abort in between.
        arrived = threading.Event()

        def wait_all():
            try:
                ray.wait(pending, num_returns=len(pending), timeout=None)
            finally:
                arrived.set()

        threading.Thread(target=wait_all, daemon=True, name="inputs").start()
        while not arrived.wait(POLL_S):
            if aborted():
                raise InputsAborted(f"{what} given up: a slice was lost")
    got = [r for r in refs if isinstance(r, ray.ObjectRef)]
    values = iter(ray.get(got) if got else ())  # no refs: no Ray call (nor its auto-init)
    return tuple(next(values) if isinstance(r, ray.ObjectRef) else r for r in refs)
