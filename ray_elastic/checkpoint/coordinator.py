"""The driver's side of durable checkpoints: one writer actor (or, for a
sharded state, the hosts of one slice: host_writes.py), at most one save
in flight, and what to do when a save fails.

Saves never block the step loop: the controller hands over a snapshot
already in the object store and polls the result at step boundaries. A
writer that dies mid-write is replaced and its half-written step swept
aside; a storage error is retried with backoff inside the writer; after
`max_failed_saves` failed saves in a row the newest state is rescued to
local disk and the run stops with an error naming both places. A save that
fails in ray_elastic's own code, not in the storage, rescues the state at
once and stops the run the same way: retrying a bug would not help.

A damaged step (integrity.py) is never restored: the cold-start check, the
in-run listing and the restore itself move it aside as `<step>.damaged`,
emit `checkpoint_damaged` (step, file, reason) and use the next-newest
committed step; `restored_step` is the step a restore really delivered.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Callable, Optional, Sequence

import ray
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.checkpoint.config import CheckpointConfig
from ray_elastic.checkpoint.host_writes import HostRestore
from ray_elastic.checkpoint.state_forms import FlatState
from ray_elastic.checkpoint.store import STORAGE_ENV, CheckpointStore
from ray_elastic.checkpoint.writer import CheckpointWriter
from ray_elastic.errors import (
    CheckpointDamaged, CheckpointSaveFailed, CheckpointStorageFailed, ConfigError, RunFailed, StorageError,
)

__all__ = ["CheckpointCoordinator"]

log = logging.getLogger("ray_elastic")

_RemoteWriter = ray.remote(CheckpointWriter)


class CheckpointCoordinator:
    def __init__(self, config: CheckpointConfig, run_facts: dict, emit: Callable[..., None],
                 run_name: str = "ray_elastic", adopt: Sequence[str] = ()):
        self.config = config
        self.run_name = run_name  # the rescue folder's name under config.rescue_dir
        # seed, batch_shards: must match on restore; exchange_blocks (the
        # order of the gradients' sum): taken from the checkpoint where
        # `adopt` names it, so a resumed run adds as the first one did.
        self.facts = dict(run_facts)
        self._adopt = tuple(adopt)
        self._emit = emit
        self.store = CheckpointStore(config.path, keep=config.keep, retries=config.storage_retries, backoff_s=config.retry_backoff_s)
        self._writer = None
        self._template_ref = None
        self._warm_ref = None
        self._inflight: Optional[tuple[int, Any, float]] = None  # step, ref, t0
        self.failed_in_a_row = 0
        self.last_saved: Optional[int] = None
        self.saves: list[dict] = []
        self.restored_step: Optional[int] = None  # what the last restore_ref delivered
        self.damaged: list[dict] = []  # steps found damaged and moved aside, this run
        self._intact: set[int] = set()  # steps whose files were checked in this run
        # Sharded states: the hosts of a slice write their own shards
        # (host_writes.py) through this (parts, path, keep, meta, save_id)
        # -> one ref per host; None: the writer actor writes.
        self._on_hosts: Optional[Callable[..., list]] = None

    # -- before anything is reserved ------------------------------------------

    def preflight(self) -> Optional[int]:
        """Check the storage, sweep incomplete steps, and return the step a
        cold start resumes from (None: fresh run): the newest committed step
        whose every byte matches its checksums, damaged newer ones moved
        aside. (Read in full here, at the cost of a second read, because
        the controller takes this step as the one restored; a controller
        that reads `restored_step` after restore_ref could make this
        `full=False`.) Raises before any cluster resource is taken."""
        try:
            self.store.preflight()
            self.store.sweep()
            latest, damaged = self.store.newest_intact(full=True)
        except StorageError as e:
            raise ConfigError("checkpoint.path", str(e)) from None
        self._report_damage(damaged, resumes_from=latest)
        if latest is None:
            return None
        self._intact.add(latest)
        try:
            meta = self.store.read_meta(latest)
        except Exception as e:
            raise ConfigError("checkpoint.path", f"step {latest} under {self.config.path}: run facts unreadable: {e}") from None
        if "batch_shards" not in meta and "num_slices" in meta:
            meta = dict(meta, batch_shards=meta["num_slices"])  # written before batch_shards existed
        if "exchange_blocks" in self._adopt:  # a checkpoint from before the fact added in shard order
            self.facts["exchange_blocks"] = meta.get("exchange_blocks", meta.get("batch_shards"))
        for key, value in self.facts.items():
            if key in meta and meta[key] != value and key != "exchange_blocks":
                raise ConfigError(
                    key,
                    f"the checkpoint at {self.config.path} (step {latest}) was written with "
                    f"{key}={meta[key]}, this run has {key}={value}; resuming would not see "
                    f"the same data. Set {key}={meta[key]} or use a new checkpoint.path.",
                )
        self.last_saved = latest
        return latest

    # -- the writer --------------------------------------------------------------

    def _writer_handle(self):
        if self._writer is None:
            env = {k: os.environ[k] for k in STORAGE_ENV if k in os.environ}
            self._writer = _RemoteWriter.options(
                num_cpus=0,
                # Next to the driver: it shares the driver's fate anyway,
                # and never competes with a slice for its node.
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
                runtime_env={"env_vars": env},
            ).remote(self.config.path, self.config.keep, self.config.storage_retries, self.config.retry_backoff_s)
        return self._writer

    def start_writer(self) -> None:
        """Start the writer and its imports now, alongside the slices."""
        self._warm_ref = self._writer_handle().warm.remote()

    @property
    def writes_on_hosts(self) -> bool:
        """Whether the hosts of a slice write the saves (a sharded state)."""
        return self._on_hosts is not None

    @property
    def writer_running(self) -> bool:
        """Whether a writer actor is up (one is made on first use)."""
        return self._writer is not None

    def writer_pid(self) -> int:
        return ray.get(self._writer_handle().pid.remote())

    def set_template(self, worker) -> None:
        """Learn the state's tree structure once, kept on the driver's node."""
        if self._template_ref is None:
            self._template_ref = ray.put(ray.get(worker.state_template.remote()))
        if self._warm_ref is not None:
            # Ready before the first step, so its start-up never competes
            # with training; a writer that fails here is replaced on use.
            try:
                ray.get(self._warm_ref, timeout=120)
            except rex.RayError as e:
                log.warning("checkpoint writer did not start cleanly (%s); it is replaced on first use", type(e).__name__)
                self._writer = None
            self._warm_ref = None

    def use_hosts(self, save_on_hosts: Callable[..., list]) -> None:
        """A sharded state: saves and restores run on the slices' hosts,
        each its own shards, so no process holds the whole state. The
        writer actor is not needed (the rescue writes from the driver)."""
        self._on_hosts = save_on_hosts
        self.shutdown()

    # -- restore ----------------------------------------------------------------

    def load_into(self, load: Callable[[Any], None], step: Optional[int]) -> int:
        """Load committed `step` (default: the newest) into the live slices
        through `load(source)` (the backend's load) and return the step
        loaded: an older one where newer ones prove damaged, each reported
        and moved aside. A sharded state is read by the hosts themselves
        (source: a HostRestore)."""
        if self._on_hosts is None:
            load(self.restore_ref(step))
            return self.restored_step
        for s in reversed(self.store.committed_steps()):
            if step is not None and s > step:
                continue
            try:
                load(HostRestore(self.config.path, self.config.keep, s))
            except CheckpointDamaged as d:
                self.damaged_on_load(d)
                continue
            self.restored_step = s
            self._intact.add(s)
            return s
        raise StorageError(f"no intact committed checkpoint under {self.config.path}")

    def restore_ref(self, step: Optional[int] = None):
        """An object ref that resolves to the state of committed `step`
        (default: the newest) or, if that step is damaged, of the newest
        intact one before it. Waits for the restore (the caller waits for
        it anyway) so that `self.restored_step` says which step the ref
        holds; damaged steps are reported as `checkpoint_damaged` events.
        Raises StorageError if no intact committed step is left."""
        if self._on_hosts is not None:
            # A sharded state: the slices' hosts read their own shards
            # (backend.load); a damaged step raises CheckpointDamaged there.
            self.restored_step = step if step is not None else self.latest_committed()
            if self.restored_step is None:
                raise StorageError(f"no intact committed checkpoint under {self.config.path}")
            return HostRestore(self.config.path, self.config.keep, self.restored_step)
        writer = self._writer_handle()
        try:
            ray.get(writer.pid.remote(), timeout=30)
        except rex.RayError:
            self._writer = None  # it died: restore through a new one
            writer = self._writer_handle()
        info_ref, state_ref = writer.restore.options(num_returns=2).remote(step, self._template_ref)
        try:
            info = ray.get(info_ref, timeout=self.config.save_timeout_s)
        except rex.GetTimeoutError:
            raise StorageError(f"restoring step {step} from {self.config.path}: no answer within "
                               f"checkpoint.save_timeout_s={self.config.save_timeout_s:g}") from None
        except rex.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, StorageError) else StorageError(str(e).splitlines()[0])) from None
        self._report_damage(info["damaged"], resumes_from=info["step"])
        self.restored_step = info["step"]
        self._intact.add(info["step"])
        if step is not None and info["step"] != step:
            log.error("checkpoint: asked to restore step %d, restored step %d (newer ones damaged)", step, info["step"])
        return state_ref

    def damaged_on_load(self, damage: CheckpointDamaged) -> None:
        """A step the hosts found damaged while reading it: moved aside and
        reported, so the next restore takes the next-newest."""
        self._intact.discard(damage.step)
        self._report_damage([self.store.mark_damaged(damage)], resumes_from=None)

    def latest_committed(self) -> Optional[int]:
        """The newest committed step not found damaged. A step not checked
        yet in this run gets the quick check (sizes, metadata digests);
        damaged steps are moved aside and reported on the way."""
        try:
            step, damaged = self.store.newest_intact(full=False, known_good=frozenset(self._intact))
        except Exception as e:  # storage down: no checkpoint to offer
            log.warning("checkpoint: cannot list %s: %s", self.config.path, e)
            return None
        self._report_damage(damaged, resumes_from=step)
        if step is not None:
            self._intact.add(step)
        return step

    def _report_damage(self, damaged: list[dict], resumes_from: Optional[int]) -> None:
        for d in damaged:
            self.damaged.append(d)
            self._emit("checkpoint_damaged", step=d["step"], file=d["file"], reason=d["reason"],
                       moved_to=d["moved_to"], instead=resumes_from)
            log.error("checkpoint step %d under %s is damaged: %s: %s. Moved aside as %s; %s.",
                      d["step"], self.config.path, d["file"], d["reason"], d["moved_to"],
                      f"using step {resumes_from} instead" if resumes_from is not None else "no intact step left")

    # -- saving -----------------------------------------------------------------

    def busy(self) -> bool:
        return self._inflight is not None

    @staticmethod
    def copied(ref, timeout_s: float) -> bool:
        """Whether the state copy behind `ref` is made (in the object store
        of its node, not fetched here) within `timeout_s`."""
        done, _ = ray.wait([ref], timeout=timeout_s, fetch_local=False)
        return bool(done)

    def submit(self, step: int, snapshot_ref, urgent: bool = False) -> None:
        """Start saving `snapshot_ref` as `step`. Storage errors surface
        later, in `poll`; an error raised here is ray_elastic's own: the
        state is rescued and the run stops (CheckpointSaveFailed)."""
        try:
            self._submit(step, snapshot_ref, urgent)
        except RunFailed:
            raise
        except (StorageError, OSError) as e:  # the storage's (sweeping a failed save): counted, retried
            self._failed(step, f"{type(e).__name__}: {e}"[:300])
        except Exception as e:
            raise self.fail_internal(step, snapshot_ref, e) from e

    def _submit(self, step: int, snapshot_ref, urgent: bool) -> None:
        meta = {**self.facts, "step": step, "time": time.time()}
        if self._on_hosts is not None:  # a sharded state: its hosts write their own shards
            if self.failed_in_a_row:
                self.store.sweep()  # the failed save's half-written step
            refs = self._on_hosts(snapshot_ref, self.config.path, self.config.keep, meta, uuid.uuid4().hex)
            self._inflight = (step, refs, time.monotonic())
            self._emit("checkpoint_started", step=step, hosts=len(refs))
            return
        ref = self._writer_handle().save.remote(step, snapshot_ref, self._template_ref, meta, urgent)
        self._inflight = (step, ref, time.monotonic())
        self._emit("checkpoint_started", step=step)

    def poll(self, block_s: float = 0.0) -> None:
        """Settle the save in flight if it has finished."""
        if self._inflight is None:
            return
        step, ref, t0 = self._inflight
        refs = ref if isinstance(ref, list) else [ref]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=block_s)
        if len(done) < len(refs):
            if time.monotonic() - t0 > self.config.save_timeout_s:
                # The storage stopped answering: abandon the write (its
                # half-written step is swept by the next save).
                self._inflight = None
                self.shutdown()
                self._failed(step, f"no commit within checkpoint.save_timeout_s={self.config.save_timeout_s:g}")
            return
        self._inflight = None
        try:
            info = ray.get(ref)
            if isinstance(ref, list):  # the hosts' writes: host 0 committed the step
                info = dict(info[0], hosts=len(info), bytes_per_host=[i["bytes_written"] for i in info])
        except rex.RayActorError as e:
            if isinstance(ref, list):  # a host died mid-write: the step never committed
                self._failed(step, f"a host of the writing slice died during the write ({type(e).__name__})")
                return
            self._writer = None  # replaced on next use; its half-written step is swept then
            self._failed(step, f"the checkpoint writer died during the write ({type(e).__name__})")
            return
        except (rex.ObjectLostError, rex.OwnerDiedError) as e:
            self._emit("checkpoint_failed", step=step, reason=f"snapshot lost before it was written: {type(e).__name__}")
            return
        except rex.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
            self._failed(step, str(cause).splitlines()[0][:300])
            return
        self.failed_in_a_row = 0
        self.last_saved = step
        info["latency_s"] = time.monotonic() - t0
        self.saves.append(info)
        self._emit("checkpoint_saved", step=step, seconds=round(info["seconds"], 4), bytes=info["bytes"])

    def _failed(self, step: int, reason: str) -> None:
        self.failed_in_a_row += 1
        self._emit("checkpoint_failed", step=step, reason=reason, in_a_row=self.failed_in_a_row)
        log.warning("checkpoint of step %d failed: %s", step, reason)

    def must_stop(self) -> bool:
        return self.failed_in_a_row >= self.config.max_failed_saves

    def save_now(self, step: int, snapshot_ref, timeout_s: float) -> bool:
        """Save and wait for the commit (preemption, end of run)."""
        deadline = time.monotonic() + timeout_s
        while self._inflight is not None and time.monotonic() < deadline:
            self.poll(block_s=min(0.5, max(0.0, deadline - time.monotonic())))
        if self.last_saved == step:
            return True
        self.submit(step, snapshot_ref, urgent=True)
        while self._inflight is not None and time.monotonic() < deadline:
            self.poll(block_s=min(0.5, max(0.0, deadline - time.monotonic())))
        return self.last_saved == step

    def rescue(self, step: int, snapshot_ref, run_name: str) -> str:
        """Write the newest state to local disk when the storage keeps
        failing, so nothing trained is lost silently."""
        from ray_elastic.checkpoint.store import assemble, unflatten

        folder = os.path.join(self.config.rescue_dir, run_name)
        template = ray.get(self._template_ref)
        # A ref, or a value already in the driver (the pinned snapshot).
        value = lambda x: ray.get(x) if isinstance(x, ray.ObjectRef) else x  # noqa: E731
        if isinstance(snapshot_ref, tuple):  # a sharded state: one part per host
            state = assemble([value(p) for p in snapshot_ref], template)
        else:
            snapshot = value(snapshot_ref)
            state = unflatten(snapshot.flat, template) if isinstance(snapshot, FlatState) else snapshot.trees()
        CheckpointStore(folder, keep=1, retries=1).save(step, state, {**self.facts, "step": step})
        return folder

    def _rescued(self, step: int, snapshot_ref, run_name: str) -> str:
        """Rescue the state; what the error tells the user about it."""
        try:
            where = self.rescue(step, snapshot_ref, run_name)
        except Exception as e:  # pragma: no cover - both storages down
            return f"Rescuing the state to {self.config.rescue_dir} failed too: {e}."
        self._emit("checkpoint_rescued", step=step, path=where)
        return f"The state of step {step} was saved to {where} (Orbax; resume by pointing checkpoint.path there)."

    def fail_internal(self, step: int, snapshot_ref, error: BaseException) -> CheckpointSaveFailed:
        """A save failed in ray_elastic's own code: the state is rescued
        and the run stops with an error saying where it is."""
        log.error("checkpoint of step %d failed inside ray_elastic", step, exc_info=error)
        self._emit("checkpoint_failed", step=step, reason=f"internal: {type(error).__name__}: {error}"[:300])
        kept = self._rescued(step, snapshot_ref, self.run_name)
        return CheckpointSaveFailed(
            f"saving the checkpoint of step {step} to {self.config.path} failed in ray_elastic itself, not in "
            f"the storage ({type(error).__name__}: {error}). {kept} This is a bug in ray_elastic: please report it "
            "with this message. Meanwhile, checkpoint.path=None trains on in-memory snapshots only.",
            setting="checkpoint.path",
        )

    def fail_with_rescue(self, step: int, snapshot_ref, run_name: str) -> CheckpointStorageFailed:
        kept = self._rescued(step, snapshot_ref, run_name)
        return CheckpointStorageFailed(
            f"{self.failed_in_a_row} checkpoint saves in a row to {self.config.path} failed "
            f"(last: {self.saves[-1] if self.saves else 'none succeeded'}). {kept} Fix the storage "
            "or change checkpoint.path; raise checkpoint.max_failed_saves to tolerate longer outages.",
            setting="checkpoint.path",
        )

    def shutdown(self) -> None:
        if self._writer is not None:
            try:
                ray.kill(self._writer)
            except Exception:
                pass
            self._writer = None
