"""Where a worker's time goes between its creation and ready: the phases
`python -m bench ready` and the `slice_ready` event report."""

from __future__ import annotations

import os
import time
from typing import Optional

__all__ = ["readiness_phases"]


def readiness_phases(created_at: Optional[float], module_at: float, init_at: float, marks: list) -> dict:
    """Seconds per readiness phase, in order (`marks`: (name, wall time)
    from the start of set-up on; the other times wall clock too):

    - process_start: the driver creating the actor to this process
      existing (negative: Ray reused or prestarted the process);
    - actor_load: the process existing (or the creation, if later) to
      this module imported: Python and Ray's worker starting, the
      actor's class loaded;
    - args_load: the constructor's arguments unpickled (the program
      factory: its module's imports, jax, flax and optax for the
      example) to the constructor running;
    - queue: the constructor to `setup` starting (the calls before it);
    - imports: jax and optax (the program's own, e.g. flax, count in
      program_build);
    - jax_init: jax.distributed (multi-host slices) and the backend;
    - program_build: the program factory;
    - initial_state: the step-0 state's functions lowered (its shapes);
      the state itself is compiled and made when first needed (with
      RAY_ELASTIC_EAGER_SETUP=1, as before: here);
    - compile: the step's functions (grad, update, flatten), ahead of
      time, through the persistent compile cache when it is set.
    """
    out: dict = {}
    proc_at = _process_started_at()
    if created_at is not None:
        start = created_at
        if proc_at is not None:
            out["process_start"] = round(proc_at - created_at, 4)
            start = max(proc_at, created_at)
        loaded = max(module_at, start)
        out["actor_load"] = round(loaded - start, 4)
        out["args_load"] = round(init_at - loaded, 4)
    out["queue"] = round(marks[0][1] - init_at, 4)
    for (_, a), (name, b) in zip(marks, marks[1:]):
        out[name] = round(b - a, 4)
    return out


def _process_started_at() -> Optional[float]:
    """This process's start on the wall clock, to the kernel's clock tick
    (Linux: its start in ticks since boot, against CLOCK_BOOTTIME; psutil's
    create_time rests on a boot time rounded to the second). None where
    /proc is not there."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
