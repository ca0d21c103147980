"""Durable checkpoints with Orbax, on local disk, a shared filesystem or
`gs://bucket/prefix`.

One step is one Orbax checkpoint (`PATH/<step>/state` for params and
optimizer state, `PATH/<step>/meta` for the data position and run facts),
written by a `CheckpointManager`, so plain Orbax restores it. Only steps
Orbax marks finalized (an atomic rename locally, `commit_success.txt` on
GCS) are ever restored; anything else is an incomplete step, swept aside
before a restore or a save so it can never block one. A failed save drops
its manager, so no failed save is ever cached.

Every step also records checksums of its arrays and files (integrity.py);
a restore checks them, and a step found damaged is moved aside as
`<step>.damaged` and the next-newest committed step is used instead.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable, Optional

from ray_elastic.checkpoint import integrity
from ray_elastic.errors import CheckpointDamaged, StorageError

__all__ = [
    "CheckpointStore", "StepInfo", "STORAGE_ENV", "assemble", "orbax_checkpoint", "refresh_listings", "tree_size", "unflatten",
]

log = logging.getLogger("ray_elastic")
# gcsfs warns on every call when no cloud credentials exist (an emulator, a
# public bucket); that is not news to our users.
logging.getLogger("gcsfs").setLevel(logging.ERROR)

# Settings that point Orbax (etils/gcsfs and tensorstore) at a GCS
# emulator; passed on to the writer process when set in the driver.
STORAGE_ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_CLOUD_PROJECT", "GOOGLE_APPLICATION_CREDENTIALS")


_import_lock = threading.Lock()


def orbax_checkpoint():
    """orbax.checkpoint, imported once under a lock: its package import is
    not thread-safe, and the writer serves calls on two threads."""
    with _import_lock:
        import orbax.checkpoint as ocp
        from orbax.checkpoint.path import step  # noqa: F401 (same reason)

        return ocp


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step: int
    committed: bool
    bytes: int
    mtime: float
    name: str
    damaged: bool = False  # moved aside as `<step>.damaged`: never restored


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
            problem = self._bucket_missing()
            if problem:
                raise StorageError(f"checkpoint.path: {problem}. Create it or point checkpoint.path elsewhere.")
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

    def missing(self, timeout_s: float = 30.0) -> Optional[str]:
        """What is missing for the path to be listed, None when nothing is:
        a local path must be an existing folder; on GCS, which has no
        folders, the bucket must exist, and a prefix with nothing under it
        is an empty folder. Raises StorageError when the storage does not
        answer."""

        def look() -> Optional[str]:
            if self.path.startswith("gs://"):
                return self._bucket_missing()
            if not self.dir.exists():
                return f"{self.path} does not exist"
            if not self.dir.is_dir():
                return f"{self.path} is not a folder"
            return None

        return _bounded(look, timeout_s, f"checkpoint.path {self.path}")

    def _bucket_missing(self) -> Optional[str]:
        """On GCS: why the path's bucket cannot be used (it does not exist),
        None when it can or the path is not on GCS; StorageError when GCS
        cannot be reached."""
        if not self.path.startswith("gs://"):
            return None
        import gcsfs

        bucket = self.path[len("gs://"):].split("/")[0]
        try:
            if gcsfs.GCSFileSystem().exists(bucket):
                return None
        except Exception as e:
            raise StorageError(f"checkpoint.path: cannot reach gs://{bucket}: {e}") from None
        return f"bucket gs://{bucket} does not exist (or is not visible with these credentials)"

    def _fresh_listing(self) -> None:
        if self.path.startswith("gs://"):
            refresh_listings()

    def steps(self, sizes: bool = False) -> list[StepInfo]:
        """Every step folder, committed or not, oldest first. `sizes` walks
        each folder for its bytes and time (for listings, not saves)."""
        ostep = orbax_checkpoint().path.step
        self._fresh_listing()

        out = []
        if not self.dir.exists():
            return out
        for child in self.dir.iterdir():
            name = child.name
            number = name.split(".")[0]
            if not number.isdigit() or not child.is_dir():
                continue
            damaged = integrity.is_damaged_name(name)
            committed = not damaged and (not ostep.is_tmp_checkpoint(child)) and ostep.is_checkpoint_finalized(child)
            size, mtime = tree_size(child) if sizes else (0, 0.0)
            out.append(StepInfo(int(number), committed, size, mtime, name, damaged))
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
            if not info.committed and not info.damaged:  # damaged ones stay, as evidence
                (self.dir / info.name).rmtree(missing_ok=True)
                removed.append(info.name)
        if removed:
            log.warning("checkpoint: removed incomplete step folders %s under %s", removed, self.path)
        return removed

    # -- save and restore ----------------------------------------------------

    def _new_manager(self):
        ocp = orbax_checkpoint()
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
        ocp = orbax_checkpoint()

        t0 = time.perf_counter()
        checksums = {"version": 1, "arrays": integrity.array_checksums(state)}
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
                saved = self._mgr.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                    **{integrity.ITEM: ocp.args.JsonSave(checksums)}))
                self._mgr.wait_until_finished()
                if saved:
                    self._write_manifest(step)
                else:
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
        size, _ = tree_size(self.dir / str(step))
        return {"step": step, "seconds": seconds, "bytes": size}

    def _write_manifest(self, step: int) -> None:
        """Record the committed step's files. A failure leaves the step
        committed but unverified (its arrays are still checked), so it is
        not a failed save."""
        try:
            integrity.write_manifest(self.path, str(step))
        except Exception as e:
            log.warning("checkpoint: step %d committed, but its %s could not be written (%s)", step, integrity.MANIFEST, e)

    def restore(self, step: Optional[int] = None, template: Any = None) -> tuple[Any, dict]:
        """(state, meta) of a committed step (default: the newest), checked
        against its checksums. Raises CheckpointDamaged (step, file, why)
        if it is damaged; `restore_intact` falls back instead."""
        self.sweep()
        step = self.latest_committed() if step is None else step
        if step is None:
            raise StorageError(f"no committed checkpoint under {self.path}")
        return self._restore_checked(step, template)

    def _restore_checked(self, step: int, template: Any) -> tuple[Any, dict]:
        ocp = orbax_checkpoint()

        self._drop_manager()  # a restore reads what is on storage now
        # Cheap first (sizes, metadata digests): most damage is named
        # before Orbax reads anything.
        verified = integrity.check_files(self.path, str(step), step, full=False)
        recorded = integrity.recorded_arrays(self.dir, step)
        mgr = self._new_manager()
        state_arg = ocp.args.StandardRestore(template) if template is not None else ocp.args.StandardRestore()
        try:
            restored = mgr.restore(step, args=ocp.args.Composite(state=state_arg, meta=ocp.args.JsonRestore()))
        except Exception as e:
            integrity.diagnose(self.path, step, e, verified)  # raises damage or outage where proven
            raise
        finally:
            mgr.close()
        if recorded:
            try:
                integrity.check_arrays(step, restored.state, recorded)
            except CheckpointDamaged:
                if verified:  # name the file whose bytes changed, if one did
                    integrity.check_files(self.path, str(step), step, full=True)
                raise
        return restored.state, dict(restored.meta)

    # -- damaged steps ----------------------------------------------------------

    def mark_damaged(self, damage: CheckpointDamaged) -> dict:
        """Move a damaged step aside so nothing restores it again; returns
        what happened, as plain data (for events)."""
        moved = integrity.mark_damaged(self.path, damage, [s.name for s in self.steps()])
        self._drop_manager()  # its list of steps is stale now
        self._fresh_listing()
        log.warning("checkpoint step %d under %s is damaged (%s: %s); moved aside as %s",
                    damage.step, self.path, damage.file, damage.reason, moved)
        return integrity.as_record(damage, moved)

    def verify(self, step: int) -> str:
        """Read every byte of a committed step and check it: files against
        their manifest, then the arrays Orbax restores (no template needed)
        against theirs. Raises CheckpointDamaged; returns what was checked."""
        files = integrity.check_files(self.path, str(step), step, full=True)
        arrays = integrity.recorded_arrays(self.dir, step) is not None
        self._restore_checked(step, self._whole_arrays(step))
        return {(True, True): "files and arrays", (True, False): "files", (False, True): "arrays"}.get(
            (files, arrays), "readable (no checksums recorded)")

    def _whole_arrays(self, step: int) -> Any:
        """A restore target of whole arrays on this process's first device,
        from the step's own metadata: a step written by several devices or
        hosts (a sharded state) is read back here whatever the topology
        it was saved on. None if the metadata cannot be read (the restore
        then says why)."""
        import jax
        from jax.sharding import SingleDeviceSharding

        try:
            meta = orbax_checkpoint().StandardCheckpointer().metadata(self.dir / str(step) / "state")
        except Exception:
            return None
        one = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                            getattr(meta, "item_metadata", meta))

    def newest_intact(self, full: bool, known_good: frozenset = frozenset()) -> tuple[Optional[int], list[dict]]:
        """The newest committed step whose files check out, moving damaged
        ones aside on the way: (step or None, what was moved). `full` reads
        every byte; otherwise sizes and metadata only."""
        moved = []
        for step in reversed(self.committed_steps()):
            if step in known_good:
                return step, moved
            try:
                integrity.check_files(self.path, str(step), step, full=full)
                return step, moved
            except CheckpointDamaged as d:
                moved.append(self.mark_damaged(d))
        return None, moved

    def restore_intact(self, step: Optional[int] = None, template: Any = None) -> tuple[Any, dict, int, list[dict]]:
        """Restore `step` (default: the newest), or if it is damaged the
        newest intact committed step before it, moving damaged ones aside:
        (state, meta, step restored, what was moved)."""
        self.sweep()
        moved = []
        for s in reversed(self.committed_steps()):
            if step is not None and s > step:
                continue
            try:
                state, meta = self._restore_checked(s, template)
                return state, meta, s, moved
            except CheckpointDamaged as d:
                moved.append(self.mark_damaged(d))
        damaged = "; ".join(integrity.describe(m) for m in moved)
        raise StorageError(f"no intact committed checkpoint under {self.path}" + (f" (damaged: {damaged})" if moved else ""))

    def read_meta(self, step: int) -> dict:
        """The run facts saved with a step (seed, slices, step), without
        reading its arrays."""
        return _read_meta(self, step)


def _read_meta(store: "CheckpointStore", step: int) -> dict:
    return json.loads((store.dir / str(step) / "meta" / "metadata").read_text())


def tree_size(path, depth: int = 6) -> tuple[int, float]:
    """Bytes and newest mtime under a step folder (a small, bounded walk:
    epath refuses recursive globs on GCS)."""
    total, mtime = 0, 0.0
    try:
        for p in path.iterdir():
            if p.is_dir():
                if depth:
                    t, m = tree_size(p, depth - 1)
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


def assemble(parts, template) -> dict:
    """Whole arrays from the hosts' blocks of a sharded state (each part a
    host's `HostBlocks` (blocks keyed (tag, leaf, block key)), as
    ray_elastic.worker.shards keys them; tag "p" params, "o" optimizer state).
    Only the rescue to local disk uses it (coordinator.py), when the
    storage keeps failing: there the driver holds the whole state once."""
    import jax
    import numpy as np

    trees = {}
    for tag, name in (("p", "params"), ("o", "opt_state")):
        leaves, treedef = jax.tree.flatten(template[name])
        out = [np.zeros(leaf.shape, leaf.dtype) for leaf in leaves]
        filled = [0] * len(leaves)
        for part in parts:
            for (t, i, key), block in part.blocks.items():
                if t != tag:
                    continue
                out[i][tuple(slice(a, b) for a, b in key)] = block
                filled[i] += int(np.asarray(block).size)
        short = [i for i, leaf in enumerate(leaves) if filled[i] < int(np.prod(leaf.shape, dtype=np.int64))]
        if short:
            raise ValueError(f"the hosts' blocks do not cover {name} leaves {short[:5]}")
        trees[name] = jax.tree.unflatten(treedef, out)
    return trees
