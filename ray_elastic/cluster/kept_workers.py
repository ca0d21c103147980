"""Slices kept from one run for the next run of this driver
(`ElasticConfig.keep_workers`).

Starting a slice costs seconds that have nothing to do with training: a
placement group placed, a process started, JAX imported, the program built
and the step compiled (2 to 4 s a slice for the example model on a CPU
host, far more for a large model on accelerators). A driver that runs
`fit` again with the same program, seed and slice shape (a notebook
re-running a cell, a sweep over step counts, a test suite) can keep a
finished run's slices: their placement groups, processes and compiled
steps. The next run takes them and only makes its own step-0 state
(`SliceWorker.renew`), so it starts in a fraction of a second and computes
bit for bit what new workers compute. A run of another program, seed or
shard count on slices of the same shape (the same hosts, devices,
environment, compile cache and user code files) takes their processes and
JAX systems and builds and compiles its own program in them
(`SliceWorker.reprogram`): it skips the process start, the imports and
JAX's start, and computes what new workers compute too. A program that
changes JAX's global settings (`jax.config`) at build time leaves them
set for the next program of its processes.

Only a run that completed keeps its slices, and only those whose workers
say they are fit to (`SliceWorker.reusable`: no preemption notice, no
fault that outlasts its run; a `slow`, `gil` or `corrupt` fault does not,
as the next run's steps are made anew). Kept slices are released, their groups removed and
their processes ended, by the first run of this driver that cannot use
them (a different shape, environment, edited code or Ray session), by a slice
started with none kept for it (a new slice, a replacement: the node it
needs may be one they hold), by
`release_workers()`, and by Ray when the driver exits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import sys
import threading
from typing import Any, Optional

import ray
from ray.util.placement_group import remove_placement_group

__all__ = ["KeptSlice", "held", "kept_key", "park", "process_key", "release_workers", "session", "take"]

log = logging.getLogger("ray_elastic")


@dataclasses.dataclass
class KeptSlice:
    """One finished run's slice, parked for the next run."""

    key: str  # what its workers were built for (kept_key)
    process: str  # what its processes were started for (process_key)
    slice_id: int
    placement_group: Any
    tpu_handle: Any  # ray.util.tpu's SlicePlacementGroup, or None
    workers: list  # actor handles, host order
    infos: list  # pid, started, node_id per host: processes a later slice on those nodes waits to see exit
    session: tuple  # the Ray session it belongs to (session())


_lock = threading.Lock()
_kept: list[KeptSlice] = []


def process_key(program_factory: Any, *parts: Any) -> str:
    """A digest of what a slice's processes were started for (`parts`:
    slice shape, environment, compile cache) and of the code they could
    have imported: two runs share processes only where these are equal.
    cloudpickle writes a function of the driver's own (a notebook's cell)
    by value but one of a module by name only, and a process imports a
    module once: so the files (size and time) of the modules that could
    hold the program's code count, the factory's package's and every
    module loaded from outside the Python installation (the user's own).
    An edited module gets new processes, never stale ones."""
    from ray import cloudpickle

    return hashlib.sha256(cloudpickle.dumps((_code_files(program_factory),) + parts)).hexdigest()


def kept_key(program_factory: Any, process: str, *parts: Any) -> str:
    """A digest of everything a slice's workers were built from: their
    processes (`process`, process_key), the program factory and `parts`
    (seed, shard count). Two runs share workers as they are (compiled
    step and all) only where these are equal."""
    from ray import cloudpickle

    return hashlib.sha256(cloudpickle.dumps((program_factory, process) + parts)).hexdigest()


def _code_files(program_factory: Any) -> tuple:
    """(module, size, mtime) of every loaded module of the factory's
    top-level package or from outside the installation (sys.prefix and
    the like: the standard library and installed packages), ray_elastic's
    own left out (it loads its modules as a run needs them)."""
    while isinstance(program_factory, functools.partial):
        program_factory = program_factory.func
    top = (getattr(program_factory, "__module__", None) or "__main__").split(".")[0]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    installed = tuple({p + os.sep for p in prefixes} | {os.path.realpath(p) + os.sep for p in prefixes})
    out = []
    for name, mod in sorted(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if not path or name == "ray_elastic" or name.startswith("ray_elastic."):
            continue
        ours = name == top or name.startswith(top + ".")
        # The path as loaded first, resolved only where that does not tell:
        # resolving every module's (thousands in a notebook or a test
        # process) took ~45 ms a run.
        if not ours and (path.startswith(installed) or "site-packages" in path
                         or os.path.realpath(path).startswith(installed)):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def held() -> list[KeptSlice]:
    """The slices kept now."""
    with _lock:
        return list(_kept)


def park(kept: KeptSlice) -> None:
    with _lock:
        _kept.append(kept)


def take(process: str, key: str, slice_id: int, ping_timeout_s: float = 2.0) -> Optional[KeptSlice]:
    """A kept slice for slice `slice_id` of a run whose processes have the
    key `process` and whose workers the key `key`, its workers answering;
    None where there is none. Any kept slice of the same processes
    serves (a slice's number is only the run's name for it), first one
    built for the same program, then one of the same number. Every kept
    slice of another process key or Ray session is released first: it
    is of no use to this driver's runs from now on and holds resources
    they may need."""
    with _lock:
        mine = [k for k in _kept if k.process == process and k.session == session()]
        others = [k for k in _kept if k not in mine]
        _kept[:] = mine
        ranked = sorted(mine, key=lambda k: (k.key != key, k.slice_id != slice_id))
        found = ranked[0] if ranked else None
        if found is not None:
            _kept.remove(found)
    for k in others:
        _release(k)
    if found is None:
        return None
    try:
        ray.get([w.ping.remote() for w in found.workers], timeout=ping_timeout_s)
    except Exception as e:  # a worker or its node went while parked
        log.info("a kept worker of slice %d is gone (%s): starting new ones", found.slice_id, type(e).__name__)
        _release(found)
        return None
    return found


def release_workers() -> int:
    """End every slice kept for this driver's next run (their placement
    groups removed, their processes ended); returns how many there were."""
    with _lock:
        gone, _kept[:] = list(_kept), []
    for k in gone:
        _release(k)
    return len(gone)


def _release(k: KeptSlice) -> None:
    if k.session != session():  # that Ray session ended: so did its groups and processes
        return
    try:
        remove_placement_group(k.placement_group)  # ends the workers in it
    except Exception:
        pass
    if k.tpu_handle is not None:
        try:
            k.tpu_handle.shutdown()
        except Exception:
            pass


def session() -> tuple:
    """This driver's Ray session: its job and node (a new `ray.init`, on
    the same cluster or another, gives another)."""
    if not ray.is_initialized():
        return ()
    ctx = ray.get_runtime_context()
    return (ctx.get_job_id(), ctx.get_node_id())
