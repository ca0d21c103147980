"""Where a worker's time goes between its creation and ready: the phases
`python -m bench ready` and the `slice_ready` event report."""

from __future__ import annotations

import os
import time
from typing import Optional

__all__ = ["phase_seconds", "readiness_phases"]

# A process started less than this before the actor's creation was started
# for it: Ray starts one 1 to 20 ms after the creation here, and the
# kernel's start time is floored to a clock tick (10 ms), so such a process
# can read as started first. A warm one started seconds earlier (its
# imports alone take over a second).
_YOUNG_S = 0.05


def readiness_phases(created_at: Optional[float], module_at: float, init_at: float, marks: list,
                     process_at: Optional[float] = None) -> dict:
    """Seconds per readiness phase, in order (`marks`: (name, wall time)
    from the start of set-up on; the other times wall clock too;
    `process_at`: when this process started, read from the kernel when
    not given). Every phase is a duration >= 0. The first ones depend on
    the process the actor landed in:

    - a process started for this actor (after its creation):
      - process_start: the driver creating the actor to this process
        existing (one read as started up to 50 ms before the creation
        counts here: a clock tick's rounding);
      - actor_load: the process existing to this module imported:
        Python and Ray's worker starting, the actor's class loaded;
      - args_load: the constructor's arguments unpickled (the program
        factory: its module's imports, jax, flax and optax for the
        example) to the constructor running;
    - a process started before the actor's creation (a warm pool's
      process, worker/warm_pool.py, or another idle one Ray kept):
      - warm_process: the driver creating the actor, which takes the
        process, to the constructor running: Ray handing the process the
        actor, its class and arguments loaded (what the warm pool
        imported ahead is not imported again);

    then, in every process:

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

    The creation is read on the driver's clock and the rest on the
    worker's: on two machines they agree only to NTP's precision, so a
    difference between them that comes out below zero counts as 0.
    """
    out: dict = {}
    proc_at = _process_started_at() if process_at is None else process_at
    if created_at is not None:
        if proc_at is not None and proc_at < created_at - _YOUNG_S:
            out["warm_process"] = phase_seconds(created_at, init_at)
        else:
            start = created_at if proc_at is None else max(created_at, proc_at)  # a tick's rounding can put it first
            if proc_at is not None:
                out["process_start"] = phase_seconds(created_at, proc_at)
            loaded = max(module_at, start)
            out["actor_load"] = phase_seconds(start, loaded)
            out["args_load"] = phase_seconds(loaded, init_at)
    out["queue"] = phase_seconds(init_at, marks[0][1])
    for (_, a), (name, b) in zip(marks, marks[1:]):
        out[name] = phase_seconds(a, b)
    return out


def phase_seconds(start: float, end: float) -> float:
    """A readiness phase: seconds from `start` to `end` (wall clock),
    rounded; 0 where a clock step, or two machines' clocks, put `end`
    first."""
    return round(max(0.0, end - start), 4)


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
