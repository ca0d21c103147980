"""Durable checkpoints with Orbax, on local disk, a shared filesystem or
`gs://bucket/prefix`.

One step is one Orbax checkpoint (`PATH/<step>/state` for params and
optimizer state, `PATH/<step>/meta` for the data position and run facts),
written by a `CheckpointManager`, so plain Orbax restores it. Only steps
Orbax marks finalized (an atomic rename locally, `commit_success.txt` on
GCS) are ever restored; anything else is an incomplete step, swept aside
before a restore or a save so it can never block one.

The state is replicated on every slice, so one writer suffices: a small
actor next to the driver takes the newest in-memory snapshot from the
object store and writes it, off the step loop. A writer killed mid-write is
replaced like any failed worker; a failed save drops its manager, so no
failed save is ever cached.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import tempfile
import threading
import time
from typing import Any, Callable, Optional

from ray_elastic.errors import ConfigError, ElasticError, RunFailed

__all__ = [
    "CheckpointConfig",
    "CheckpointStore",
    "StepInfo",
    "StorageError",
    "CheckpointStorageFailed",
]

log = logging.getLogger("ray_elastic")
# gcsfs warns on every call when no cloud credentials exist (an emulator, a
# public bucket); that is not news to our users.
logging.getLogger("gcsfs").setLevel(logging.ERROR)

# Settings that point Orbax (etils/gcsfs and tensorstore) at a GCS
# emulator; passed on to the writer process when set in the driver.
STORAGE_ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_CLOUD_PROJECT", "GOOGLE_APPLICATION_CREDENTIALS")


_import_lock = threading.Lock()


def _ocp():
    """orbax.checkpoint, imported once under a lock: its package import is
    not thread-safe, and the writer serves calls on two threads."""
    with _import_lock:
        import orbax.checkpoint as ocp
        from orbax.checkpoint.path import step  # noqa: F401 (same reason)

        return ocp


class StorageError(ElasticError):
    """Checkpoint storage could not be read or written."""

    def __init__(self, message: str):
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0],))


class CheckpointStorageFailed(RunFailed):
    """Checkpoint saves kept failing; the state was rescued to local disk."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """path: local folder or gs://bucket/prefix.
    save_every: steps between checkpoints (0: only at preemption and end).
    keep: committed steps kept; older ones are deleted.
    continuous: start the next save as soon as the previous one commits
        (save_every is then a floor, not a cadence).
    save_at_end: checkpoint the final step.
    storage_retries / retry_backoff_s: a failing write is retried this many
        times, doubling the wait each time, before the save counts as failed.
    max_failed_saves: consecutive failed saves before the run stops, after
        rescuing the state to `rescue_dir`.
    save_timeout_s: a save still running after this long (a storage that
        stopped answering) is abandoned and its writer replaced.
    """

    path: str
    save_every: int = 100
    keep: int = 3
    continuous: bool = False
    save_at_end: bool = True
    storage_retries: int = 4
    retry_backoff_s: float = 0.5
    max_failed_saves: int = 3
    save_timeout_s: float = 600.0
    rescue_dir: str = os.path.join(tempfile.gettempdir(), "ray_elastic", "rescue")

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path.strip():
            raise ConfigError("checkpoint.path", "must be a folder or gs://bucket/prefix")
        scheme = self.path.split("://", 1)[0] if "://" in self.path else ""
        if scheme not in ("", "file", "gs"):
            raise ConfigError("checkpoint.path", f"scheme {scheme!r} is not supported; use a folder or gs://")
        if scheme == "gs" and not self.path[len("gs://"):].split("/")[0]:
            raise ConfigError("checkpoint.path", f"{self.path!r} names no bucket")
        for name in ("save_every", "storage_retries"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"checkpoint.{name}", f"must be an integer >= 0, got {v!r}")
        for name in ("keep", "max_failed_saves"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"checkpoint.{name}", f"must be an integer >= 1, got {v!r}")
        if not isinstance(self.save_timeout_s, (int, float)) or self.save_timeout_s <= 0:
            raise ConfigError("checkpoint.save_timeout_s", f"must be > 0, got {self.save_timeout_s!r}")
        if not isinstance(self.retry_backoff_s, (int, float)) or self.retry_backoff_s < 0:
            raise ConfigError("checkpoint.retry_backoff_s", f"must be >= 0, got {self.retry_backoff_s!r}")

    def due(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step: int
    committed: bool
    bytes: int
    mtime: float
    name: str


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run a storage call with a deadline: a dead server must not hang us."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise StorageError(f"{what}: no answer from the storage within {timeout_s:g} s") from None
    finally:
        pool.shutdown(wait=False)


def refresh_listings() -> None:
    """Forget gcsfs's cached directory listings in this process: another
    process (the writer, a killed writer) may have changed the bucket."""
    try:
        import gcsfs
    except ImportError:
        return
    # Every cached instance: etils builds its own, with other arguments.
    for fs in list(getattr(gcsfs.GCSFileSystem, "_cache", {}).values()):
        fs.invalidate_cache()


class CheckpointStore:
    """Orbax checkpoints of one run under one path."""

    def __init__(self, path: str, keep: int = 3, retries: int = 4, backoff_s: float = 0.5, sleep=time.sleep):
        from etils import epath

        self.path = path
        self.dir = epath.Path(path)
        self.keep = keep
        self.retries = retries
        self.backoff_s = backoff_s
        self._sleep = sleep
        self._mgr = None  # reused across saves until one fails

    # -- checks and listing --------------------------------------------------

    def preflight(self, timeout_s: float = 30.0) -> None:
        """Prove the path is writable before anything is reserved."""

        def probe():
            if self.path.startswith("gs://"):
                import gcsfs

                bucket = self.path[len("gs://"):].split("/")[0]
                fs = gcsfs.GCSFileSystem()
                try:
                    if not fs.exists(bucket):
                        raise StorageError(
                            f"checkpoint.path: bucket gs://{bucket} does not exist (or is not visible "
                            "with these credentials). Create it or point checkpoint.path elsewhere."
                        )
                except StorageError:
                    raise
                except Exception as e:
                    raise StorageError(f"checkpoint.path: cannot reach gs://{bucket}: {e}") from None
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                probe = self.dir / ".ray_elastic_write_probe"
                probe.write_text(str(time.time()))
                probe.unlink()
            except StorageError:
                raise
            except Exception as e:
                raise StorageError(f"checkpoint.path: cannot write to {self.path}: {type(e).__name__}: {e}") from None

        _bounded(probe, timeout_s, f"checkpoint.path {self.path}")

    def _fresh_listing(self) -> None:
        if self.path.startswith("gs://"):
            refresh_listings()

    def steps(self, sizes: bool = False) -> list[StepInfo]:
        """Every step folder, committed or not, oldest first. `sizes` walks
        each folder for its bytes and time (for listings, not saves)."""
        ostep = _ocp().path.step
        self._fresh_listing()

        out = []
        if not self.dir.exists():
            return out
        for child in self.dir.iterdir():
            name = child.name
            number = name.split(".")[0]
            if not number.isdigit() or not child.is_dir():
                continue
            committed = (not ostep.is_tmp_checkpoint(child)) and ostep.is_checkpoint_finalized(child)
            size, mtime = _tree_size(child) if sizes else (0, 0.0)
            out.append(StepInfo(int(number), committed, size, mtime, name))
        return sorted(out, key=lambda s: (s.step, s.name))

    def committed_steps(self) -> list[int]:
        return [s.step for s in self.steps() if s.committed]

    def latest_committed(self) -> Optional[int]:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def sweep(self) -> list[str]:
        """Delete step folders that never committed (a writer or node died
        mid-write), so they can't block a restore or a later save."""
        removed = []
        for info in self.steps():
            if not info.committed:
                (self.dir / info.name).rmtree(missing_ok=True)
                removed.append(info.name)
        if removed:
            log.warning("checkpoint: removed incomplete step folders %s under %s", removed, self.path)
        return removed

    # -- save and restore ----------------------------------------------------

    def _new_manager(self):
        ocp = _ocp()
        return ocp.CheckpointManager(
            self.dir,
            options=ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True, enable_async_checkpointing=False),
        )

    def _drop_manager(self) -> None:
        mgr, self._mgr = self._mgr, None
        if mgr is not None:
            try:
                mgr.close()
            except Exception:
                pass

    def open(self) -> None:
        """Sweep incomplete steps and build the manager saves reuse."""
        if self._mgr is None:
            self._fresh_listing()
            self.sweep()
            self._mgr = self._new_manager()

    def save(self, step: int, state: dict, meta: dict) -> dict:
        """Write and commit one step, retrying transient errors with backoff.

        Saves reuse one manager (building one and sweeping the folder cost
        as much CPU as a small save, which competes with training where the
        writer shares CPUs with it). After any failure the manager is
        dropped and the folder swept before the next attempt: a failed save
        is never cached, and a half-written step never lingers."""
        ocp = _ocp()

        t0 = time.perf_counter()
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                if self._mgr is None:
                    self._fresh_listing()
                    self.sweep()
                    if step in self.committed_steps():
                        break  # already durable (a retry after a lost reply)
                    self._mgr = self._new_manager()
                elif step in self._mgr.all_steps():
                    break  # written before a rewind; training is deterministic
                saved = self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
                self._mgr.wait_until_finished()
                if not saved:
                    # Orbax declines steps at or below its newest one; a
                    # newer committed step exists, so nothing is lost.
                    log.warning("checkpoint: step %d not written, step %s is newer", step, self._mgr.latest_step())
                break
            except Exception as e:
                self._drop_manager()
                if attempt == self.retries:
                    raise StorageError(
                        f"saving step {step} to {self.path} failed after {attempt + 1} attempts: {type(e).__name__}: {e}"
                    ) from None
                log.warning("checkpoint save of step %d failed (%s); retrying in %.1f s", step, e, wait)
                self._sleep(wait)
                wait *= 2
        seconds = time.perf_counter() - t0
        size, _ = _tree_size(self.dir / str(step))
        return {"step": step, "seconds": seconds, "bytes": size}

    def restore(self, step: Optional[int] = None, template: Any = None) -> tuple[Any, dict]:
        """(state, meta) of a committed step (default: the newest)."""
        ocp = _ocp()

        self.sweep()
        step = self.latest_committed() if step is None else step
        if step is None:
            raise StorageError(f"no committed checkpoint under {self.path}")
        self._drop_manager()  # a restore reads what is on storage now
        mgr = self._new_manager()
        state_arg = ocp.args.StandardRestore(template) if template is not None else ocp.args.StandardRestore()
        restored = mgr.restore(step, args=ocp.args.Composite(state=state_arg, meta=ocp.args.JsonRestore()))
        mgr.close()
        return restored.state, dict(restored.meta)

    def read_meta(self, step: int) -> dict:
        """The run facts saved with a step (seed, slices, step), without
        reading its arrays."""
        return _read_meta(self, step)


def _read_meta(store: "CheckpointStore", step: int) -> dict:
    import json

    return json.loads((store.dir / str(step) / "meta" / "metadata").read_text())


def _tree_size(path, depth: int = 6) -> tuple[int, float]:
    """Bytes and newest mtime under a step folder (a small, bounded walk:
    epath refuses recursive globs on GCS)."""
    total, mtime = 0, 0.0
    try:
        for p in path.iterdir():
            if p.is_dir():
                if depth:
                    t, m = _tree_size(p, depth - 1)
                    total, mtime = total + t, max(mtime, m)
                continue
            st = p.stat()
            total += int(st.length)
            mtime = max(mtime, float(st.mtime))
    except Exception:
        pass
    return total, mtime


def unflatten(flat, template) -> dict:
    """Rebuild the state tree from a snapshot's flat buffer. The buffer is
    `ravel_pytree((params, opt_state))`, so its order is that tuple's leaf
    order (not the order of a dict with those two keys)."""
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten((template["params"], template["opt_state"]))
    out, offset = [], 0
    for leaf in leaves:
        n = int(np.prod(leaf.shape, dtype=np.int64))
        out.append(np.asarray(flat[offset:offset + n]).reshape(leaf.shape).astype(leaf.dtype))
        offset += n
    if offset != flat.shape[0]:
        raise ValueError(f"snapshot has {flat.shape[0]} values, the state template needs {offset}")
    params, opt_state = jax.tree.unflatten(treedef, out)
    return {"params": params, "opt_state": opt_state}


def _cpu_class(background: bool, skip: frozenset = frozenset()) -> bool:
    """Put every thread of this process (but `skip`) in Linux's idle
    scheduling class, or back in the normal one. Threads started later
    (Orbax's, tensorstore's) inherit the class of the thread that starts
    them. Returns False where some thread could not be moved."""
    policy = getattr(os, "SCHED_IDLE" if background else "SCHED_OTHER", None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        return False
    ok = True
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in skip:
            continue
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except (OSError, ValueError):
            ok = False  # the thread ended, or no permission
    return ok


def _idle_class_reversible() -> bool:
    """Whether this process may leave the idle class again (unprivileged
    processes may not, under the usual RLIMIT_NICE of 0): tried on a
    scratch thread."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join()
    return bool(result and result[0])


class background_cpu:
    """Run a block in Linux's idle CPU class: its threads then take only
    CPU time nothing else wants, so a periodic save where the writer shares
    CPUs with training (a small head node, a laptop) waits for the steps'
    idle moments instead of slowing them (a nice value still takes a share).
    A block still running after `grace_s` (the CPUs are never idle) goes
    back to the normal class, so a save is late, never starved. Used only
    where the process may leave the class again; elsewhere the block runs
    in the normal class."""

    _reversible: Optional[bool] = None

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.escalated = False
        self._timer: Optional[threading.Timer] = None

    def __enter__(self):
        if background_cpu._reversible is None:
            background_cpu._reversible = _idle_class_reversible()
        if not background_cpu._reversible:
            return self
        # The timer thread stays in the normal class: it must run to lift
        # the block out of a CPU that is never idle.
        self._timer = threading.Timer(self.grace_s, self._escalate)
        self._timer.daemon = True
        self._timer.start()
        _cpu_class(background=True, skip=frozenset({self._timer.native_id}))
        return self

    def _escalate(self) -> None:
        self.escalated = True
        _cpu_class(background=False)
        log.warning("checkpoint writer: no idle CPU for %.0f s; saving at normal priority", self.grace_s)

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            _cpu_class(background=False)


# A periodic save still waiting for idle CPU after this long is given the
# normal class (see background_cpu).
BACKGROUND_SAVE_GRACE_S = 30.0


class CheckpointWriter:
    """Runs as a Ray actor next to the driver: turns snapshots from the
    object store into committed Orbax steps, and reads them back.

    Periodic saves run in the idle CPU class (`background_cpu`); urgent
    ones (a preemption notice, the end of the run) and restores in the
    normal class."""

    def __init__(self, path: str, keep: int, retries: int, backoff_s: float):
        self.store = CheckpointStore(path, keep=keep, retries=retries, backoff_s=backoff_s)

    def pid(self) -> int:
        return os.getpid()

    def warm(self) -> int:
        """Import Orbax and JAX and open the manager now, while the slices
        start, so the first save does not pay for it during training.
        (Normal CPU class: the run waits for this before its first step.)"""
        import jax  # noqa: F401

        _ocp()
        try:
            self.store.open()
        except Exception as e:  # the first save retries and reports it
            log.warning("checkpoint writer: cannot open %s yet: %s", self.store.path, e)
        return os.getpid()

    def save(self, step: int, snapshot: dict, template: Any, meta: dict, urgent: bool = False) -> dict:
        if urgent:
            return self._save(step, snapshot, template, meta)
        with background_cpu(BACKGROUND_SAVE_GRACE_S) as cpu:
            info = self._save(step, snapshot, template, meta)
        info["escalated"] = cpu.escalated
        return info

    def _save(self, step: int, snapshot: dict, template: Any, meta: dict) -> dict:
        if "flat" in snapshot:
            state = unflatten(snapshot["flat"], template)
        else:
            state = {"params": snapshot["params"], "opt_state": snapshot["opt_state"]}
        return self.store.save(step, state, {**meta, "step": step})

    def restore(self, step: Optional[int], template: Any) -> dict:
        import jax
        import numpy as np

        target = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template)
        state, meta = self.store.restore(step, target)
        return {"step": int(meta["step"]), "params": state["params"], "opt_state": state["opt_state"], "meta": meta}

    def read_meta(self, step: int) -> dict:
        return self.store.read_meta(step)
