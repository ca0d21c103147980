"""The single controller: runs in the Ray driver, never restarts, and carries
out what the policy decides.

Each step has two phases. First every live slice computes the gradients of
its shards of the step's global batch; then every slice applies the mean of
all shard gradients, fetched from the object store. A worker, node or hang
failure anywhere surfaces here as a `SliceFailure` (sorted once, in
`failures.classify`), the slice is torn down, a replacement is queued on its
placement group, and `policy.decide` says whether to train on (resize) or
wait (pause). Survivors keep their state in memory; new slices load it from
the newest snapshot or straight from a survivor.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import threading
import time
import uuid
from typing import Any, Callable, Optional, Sequence

import ray
from ray import exceptions as rex

from ray_elastic import drain
from ray_elastic.callbacks import Callback, FunctionCallback
from ray_elastic.checkpoint.coordinator import CheckpointCoordinator
from ray_elastic.checkpoint import CheckpointConfig
from ray_elastic.config import ElasticConfig
from ray_elastic.data import assign_shards
from ray_elastic.errors import ElasticError, FailureKind, RunFailed, SliceFailure, SlicePreempted
from ray_elastic.failures import TRANSIENT, classify, failure, is_node_alive
from ray_elastic.faults import Fault, FaultInjector
from ray_elastic.policy import Continue, Fail, Grow, Shrink, SliceLost, SlicesView, Tick, Wait, decide
from ray_elastic.program import TrainProgram
from ray_elastic.report import FailureRecord, RunReport
from ray_elastic.slice_group import LiveSlice, Provisioning, RaySlices
from ray_elastic.snapshots import SnapshotStore

__all__ = ["ElasticTrainer"]

log = logging.getLogger("ray_elastic")

# Up to this many shards, every slice's apply call takes the phase-1
# payloads directly (one hop, fastest for a few slices); above, they go
# through a reduction tree of this fan-in, so the hand-off stays linear.
APPLY_FAN_IN = 8


class ElasticTrainer:
    """Train `steps` steps of the program on `config.num_slices` slices,
    surviving failures by `config.policy`.

    program_factory: a picklable zero-argument callable returning the
        TrainProgram; it runs inside each worker.
    faults: injected failures (tests, demo, benchmarks).
    remove_node: callback that removes a node, for `remove_node` faults.
    on_step: called in the driver after every completed step with
        (step, loss, live slice count).
    on_event: called in the driver's main thread with each timeline event
        (a dict with "t" and "event"), e.g. to add a replacement node.
    callbacks: `Callback` objects (progress, metrics, event logs).
    checkpoint: durable Orbax checkpoints (CheckpointConfig); with one, a
        new run on the same path resumes from its newest committed step.
    keep_final_state: fetch the final training state (host numpy arrays)
        into `self.final_state` before the workers are torn down.
    slices_backend: the class that provisions slices (default RaySlices:
        placement groups and worker actors); the scale benchmark passes
        simulated slices behind the same interface.
    """

    def __init__(
        self,
        program_factory: Callable[[], TrainProgram],
        config: ElasticConfig,
        steps: int,
        faults: tuple[Fault, ...] = (),
        remove_node: Optional[Callable[[str], None]] = None,
        on_step: Optional[Callable[[int, float, int], None]] = None,
        on_event: Optional[Callable[[dict], None]] = None,
        keep_final_state: bool = False,
        callbacks: Sequence[Callback] = (),
        checkpoint: Optional[CheckpointConfig] = None,
        clock: Callable[[], float] = time.monotonic,
        slices_backend: Optional[type] = None,
    ):
        if not isinstance(steps, int) or steps < 1:
            from ray_elastic.errors import ConfigError

            raise ConfigError("steps", f"must be a positive integer, got {steps!r}")
        for f in faults:
            if f.slice_id >= config.num_slices:
                from ray_elastic.errors import ConfigError

                raise ConfigError("faults", f"{f} names slice {f.slice_id}, but num_slices={config.num_slices}")
        self.config = config
        self.steps = steps
        self._factory = program_factory
        self._injector = FaultInjector(list(faults), remove_node)
        self._callbacks = list(callbacks)
        if on_step is not None or on_event is not None:
            self._callbacks.append(FunctionCallback(on_step, on_event))
        self._keep_final_state = keep_final_state
        self.final_state: Optional[dict] = None
        self._clock = clock
        self._backend = slices_backend or RaySlices
        self.report = RunReport(policy=config.policy, num_slices=config.num_slices, steps_requested=steps)

        self.live: dict[int, LiveSlice] = {}
        self.ready: dict[int, LiveSlice] = {}  # built, waiting to join
        self.coming: dict[int, Provisioning] = {}
        self.step = 0  # steps completed in the state the live slices hold
        self.retries = 0
        self.waiting_since: Optional[float] = None
        self._fresh = True  # next step is the first since a (re)start
        self._step_durations: list[float] = []  # of kept steps, by step index
        self._open: list[tuple[FailureRecord, float]] = []  # awaiting recovery
        self._snapshots = SnapshotStore()
        self._run_name = f"ray_elastic-{uuid.uuid4().hex[:6]}"
        self._ckpt: Optional[CheckpointCoordinator] = None
        if checkpoint is not None:
            self._ckpt = CheckpointCoordinator(
                checkpoint, {"seed": config.seed, "num_slices": config.num_slices}, self._event
            )
        self._preempt_reason: Optional[str] = None
        self._failed_joins = 0
        self._notices: dict[tuple[int, int], float] = {}  # (slice, host) -> SIGTERM time
        self._drain_checked = 0.0
        self._t0 = 0.0

    # -- public -----------------------------------------------------------

    def fit(self) -> RunReport:
        if not ray.is_initialized():
            ray.init()
        r = self.report
        r.driver_pid_start = os.getpid()
        for cb in self._callbacks:
            cb.on_start(self)
        self._t0 = self._clock()
        # Storage is checked, and a cold start found, before any slice is
        # reserved.
        resume_from = self._ckpt.preflight() if self._ckpt else None
        if self._ckpt:
            self._ckpt.start_writer()
        self._slices = self._backend(
            self.config.slice, self._factory, self.config.seed, self.config.num_slices,
            run_name=self._run_name,
            compile_cache_dir=self.config.compile_cache_dir,
        )
        previous_sigterm = self._catch_sigterm()
        try:
            self._start()
            if self._ckpt:
                self._ckpt.set_template(self.live[min(self.live)].workers[0])
                if resume_from is not None:
                    self._cold_start(resume_from)
            while self.step < self.steps:
                if self._preempt_reason:
                    self._stop_for_preemption()
                    break
                self._check_drains()
                if not self._advance_membership():
                    continue
                try:
                    self._take_step()
                except SliceFailure as f:
                    self._recover(f)
                    continue
                self._after_step()
            else:
                self._final_checkpoint()
            if self._keep_final_state and self.live:
                self.final_state = ray.get(self.live[min(self.live)].workers[0].state.remote())
        except RunFailed as e:
            r.error = str(e)
            r.outcome = "failed"
            raise
        finally:
            if previous_sigterm is not None:
                signal.signal(signal.SIGTERM, previous_sigterm)
            if self._ckpt:
                r.checkpoints = list(self._ckpt.saves)
            r.driver_pid_end = os.getpid()
            r.wall_s = self._clock() - self._t0
            r.steps_completed = self.step
            r.productive_s = sum(self._step_durations[: self.step])
            self._event("end", steps=self.step, outcome=r.outcome)
            self._shutdown()
            for cb in self._callbacks:
                cb.on_end(r)
        return r

    # -- membership -------------------------------------------------------

    def _event(self, name: str, **fields) -> None:
        event = {"t": round(self._clock() - self._t0, 4), "event": name, **fields}
        self.report.events.append(event)
        for cb in self._callbacks:
            cb.on_event(event)

    def _view(self) -> SlicesView:
        return SlicesView(
            num_slices=self.config.num_slices,
            live=frozenset(self.live),
            ready_to_join=frozenset(self.ready),
            retries_used=self.retries,
            waiting_since=self.waiting_since,
        )

    def _start(self) -> None:
        for s in range(self.config.num_slices):
            self.coming[s] = self._slices.start(s)
        self._event("reserve", slices=self.config.num_slices)
        # Start-up includes worker processes importing JAX and compiling,
        # so it gets at least the first step's deadline.
        wait_s = max(self.config.timeout_s, self.config.first_step_deadline_s)
        deadline = self._clock() + wait_s
        while len(self.ready) < self.config.num_slices:
            self._poll_coming(block_s=0.2)
            if self._clock() >= deadline:
                break
        if len(self.ready) < self.config.required_slices:
            bundles = self.config.slice.bundles()
            raise RunFailed(
                f"only {len(self.ready)} of {self.config.num_slices} slices (each "
                f"{len(bundles)} host(s) of {bundles[0]}) could be placed within "
                f"{wait_s:g} s (the larger of timeout_s and first_step_deadline_s). "
                "Add nodes to the cluster, lower num_slices, or raise timeout_s.",
                setting="num_slices",
            )
        self.live.update(self.ready)
        self.ready.clear()
        self._event("start", slices=sorted(self.live))

    def _poll_coming(self, block_s: float = 0.0) -> None:
        if block_s and self.coming:
            refs = [r for p in self.coming.values() for r in p.setup_refs]
            ray.wait(refs, num_returns=len(refs), timeout=block_s)
        for s, p in list(self.coming.items()):
            try:
                live = self._slices.poll(p)
            except rex.RayActorError as e:
                if getattr(e, "actor_init_failed", False):
                    # The worker's own constructor raised: a bug or a bad
                    # environment, not a hardware failure. Retrying won't help.
                    raise RunFailed(
                        f"the worker for slice {s} could not start: {_short(e)}. "
                        "Check that the program factory and its modules can be "
                        "imported and unpickled on the worker nodes.",
                        setting="program_factory",
                    ) from e
                log.warning("replacement for slice %d failed to start: %s", s, e)
                self._backend.kill(p.workers)
                self.coming[s] = self._slices.start(s)
                continue
            except rex.ObjectLostError as e:
                # The replacement itself died while starting (its node went
                # away, say): queue it again on the same placement group.
                log.warning("replacement for slice %d failed to start: %s", s, e)
                self._backend.kill(p.workers)
                self.coming[s] = self._slices.start(s)
                continue
            if live is not None:
                del self.coming[s]
                self.ready[s] = live
                self._event("slice_ready", slice=s, setup_s=round(live.ready_at - p.started_at, 3))

    def _advance_membership(self) -> bool:
        """Apply the policy at a step boundary. True when a step can run."""
        self._poll_coming()
        d = decide(Tick(), self._view(), self.config, self._clock())
        if isinstance(d, Fail):
            raise d.error
        if isinstance(d, Grow):
            if self._join(sorted(d.slices - set(self.live))):
                self.waiting_since = None
            return bool(self.live) and self.waiting_since is None
        if isinstance(d, Wait):
            self._poll_coming(block_s=0.25)
            return False
        return True  # Continue

    def _join(self, new: list[int]) -> bool:
        """Load the state into ready slices and make them live. False if
        the load failed: a joiner that died is queued again; if the joiners
        are fine, the state's source was bad (a snapshot copy on a node that
        just went) and is dropped, so the next try takes the next-newest."""
        if not new:
            return True
        source = self._state_source()
        refs = []
        for s in new:
            if source is not None:
                refs += [w.load_state.remote(source) for w in self.ready[s].workers]
        try:
            ray.get(refs, timeout=max(30.0, self.config.first_step_deadline_s))
        except rex.RayError as e:
            dead = [s for s in new if not _answers(self.ready[s].workers)]
            if not dead:
                self._snapshots.discard_latest()
            for s in dead:
                self._backend.kill(self.ready.pop(s).workers)
                self.coming[s] = self._slices.start(s)
            log.warning("loading state into slices %s failed (%s); %s", new, _short(e),
                        f"re-queued {dead}" if dead else "trying an older copy")
            self._failed_joins += 1
            if self._failed_joins >= 5:
                raise RunFailed(
                    f"slices {new} failed to load the training state {self._failed_joins} times in a row "
                    f"(last: {_short(e)}). The cluster may be losing nodes faster than it recovers; "
                    "check node health, or raise max_retries once it is stable.",
                    setting="max_retries",
                ) from e
            return False
        self._failed_joins = 0
        for s in new:
            self.live[s] = self.ready.pop(s)
        self._fresh = True
        self._event("grow", joined=new, slices=sorted(self.live), step=self.step)
        return True

    def _state_source(self):
        """Where joining slices load the state of `self.step` from: the
        newest snapshot when it is current, else a live slice's memory, else
        (no live slice) the newest snapshot, rolling the run back to it."""
        latest = self._snapshots.latest_step()
        if self.live:
            found = self._snapshots.restore_source(is_node_alive) if latest == self.step else None
            if found is not None:
                return found[1]
            donor = self.live[min(self.live)].workers[0]
            return donor.state.remote()
        found = self._snapshots.restore_source(is_node_alive)
        durable = self._ckpt.latest_committed() if self._ckpt else None
        if durable is not None and (found is None or durable > found[0]):
            # The newest of the in-memory snapshot and the committed checkpoint.
            self._rewind_to(durable)
            self._mark_open(restored_from="checkpoint")
            self._event("restore", source="checkpoint", step=durable)
            return self._ckpt.restore_ref(durable)
        if found is not None:
            step, source = found
            self._rewind_to(step)
            self._mark_open(restored_from="snapshot")
            self._event("restore", source="snapshot", step=step)
            return source
        self._mark_open(restored_from="initial")
        # No snapshot survives (snapshots off, none taken yet, or every copy
        # lost with its node): start over from the initial state.
        if self.step > 0:
            log.warning("no in-memory snapshot survived; restarting from step 0 (%d steps lost)", self.step)
        self._rewind_to(0)
        return None

    def _mark_open(self, restored_from: str) -> None:
        for rec, _ in self._open:
            rec.restored_from = restored_from

    def _rewind_to(self, step: int) -> None:
        for rec, _ in self._open:  # failures not yet recovered lose these steps too
            rec.steps_rewound = max(rec.steps_rewound, rec.step + 1 - step)
        if step < self.step:
            self._event("rewind", from_step=self.step, to_step=step)
        self.step = step
        del self._step_durations[step:]

    # -- one step -----------------------------------------------------------

    def _deadline_s(self) -> float:
        c = self.config
        if self._fresh or len(self._step_durations) < 3:
            return c.first_step_deadline_s
        recent = self._step_durations[-20:]
        return max(c.step_deadline_floor_s, c.step_deadline_factor * statistics.median(recent))

    def _take_step(self) -> None:
        k = self.step
        t_start = self._clock()
        deadline = t_start + self._deadline_s()
        assignment = assign_shards(self.live, self.config.num_slices, self.config.batch_on_resize)
        payloads: dict[int, Any] = {}  # slice -> its host 0's gradients (a ref)

        def grads_call(w, s: int, h: int):
            status, payload = w.compute_grads.options(num_returns=2).remote(k, assignment[s])
            if h == 0:
                payloads[s] = payload  # a re-issued call replaces it
            return status

        issued = [
            (s, h, grads_call(w, s, h), lambda w=w, s=s, h=h: grads_call(w, s, h))
            for s, sl in sorted(self.live.items())
            for h, w in enumerate(sl.workers)
        ]
        for fired in self._injector.fire_due(k, self.live):
            self._event("fault", kind=fired.fault.kind, slice=fired.fault.slice_id, host=fired.fault.host, step=k)
        self._gather(issued, k, deadline)
        grad_refs = self._reduce(k, assignment, payloads, deadline)

        takers = self._snapshot_takers(k + 1)
        issued2, snaps = [], {}
        for s, sl in sorted(self.live.items()):
            for h, w in enumerate(sl.workers):
                take = h == 0 and s in takers

                def call(w=w, take=take):
                    return w.apply.options(num_returns=2).remote(k, take, *grad_refs)

                m_ref, snap_ref = call()
                if take:
                    snaps[s] = snap_ref
                issued2.append((s, h, m_ref, lambda call=call: call()[0]))
        metrics = self._gather(issued2, k, deadline)
        for (s, h), m in metrics.items():
            if "preempt_notice_at" in m and (s, h) not in self._notices:
                self._notices[(s, h)] = m["preempt_notice_at"]
        for s, ref in snaps.items():
            self._snapshots.offer(k + 1, s, ref, self.live[s].infos[0]["node_id"])
        if len(snaps) == 1:
            # One live slice: no other failure domain holds the state until
            # the driver's pinned copy lands, so wait for it.
            self._snapshots.wait_pinned(timeout=self._deadline_s())

        t_end = self._clock()
        self.step = k + 1
        self._fresh = False
        del self._step_durations[k:]
        self._step_durations.append(t_end - t_start)
        loss = next(iter(metrics.values()))["loss"]
        r = self.report
        r.final_loss = loss
        del r.losses[k:], r.slices_per_step[k:], r.step_times[k:]
        r.losses.append(loss)
        r.slices_per_step.append(len(self.live))
        r.step_times.append(t_end - t_start)
        for rec, t_fault in self._open:
            rec.recovered_s = round(t_end - t_fault, 4)
            rec.slices_after = len(self.live)
            self._event("recovered", slice=rec.slice, step=self.step, recovered_s=rec.recovered_s)
        self._open.clear()
        step_metrics = {"loss": loss, "slices": len(self.live), "step_s": t_end - t_start}
        for cb in self._callbacks:
            cb.on_step(self.step, step_metrics)

    def _reduce(self, k: int, assignment: dict, payloads: dict, deadline: float) -> list:
        """The refs every slice's apply call takes: the phase-1 payloads
        themselves up to APPLY_FAN_IN shards, else the top of a tree of
        in-order partial sums over consecutive shards, fan-in APPLY_FAN_IN,
        computed on the slices' host-0 workers level by level. The tree
        keeps the driver's work and the ref hand-off linear in the number
        of slices (n apply calls of n refs each would be quadratic); its
        shape depends only on the shard count, so the additions happen in
        the same order in every run."""
        holder = {shard: payloads[s] for s, shards in assignment.items() for shard in shards}
        nodes = [(shard, [holder[shard]]) for shard in sorted(holder)]  # (key, refs holding it)
        reducers = sorted(self.live)
        while len(nodes) > APPLY_FAN_IN:
            issued, boxes = [], []
            for j in range(0, len(nodes), APPLY_FAN_IN):
                group = nodes[j:j + APPLY_FAN_IN]
                keys = tuple(key for key, _ in group)
                refs = list(dict.fromkeys(r for _, rs in group for r in rs))
                s = reducers[(j // APPLY_FAN_IN) % len(reducers)]
                box: list = []

                def call(w=self.live[s].workers[0], keys=keys, refs=refs, box=box):
                    status, partial = w.reduce.options(num_returns=2).remote(k, keys, *refs)
                    box[:] = [partial]
                    return status

                issued.append((s, 0, call(), call))
                boxes.append((keys[0], box))
            self._gather(issued, k, deadline)
            nodes = [(key, [box[0]]) for key, box in boxes]
        return list(dict.fromkeys(r for _, rs in nodes for r in rs))

    def _snapshot_takers(self, step: int) -> list[int]:
        """The slices whose reply to this step carries a snapshot: two, so
        that the copies sit in two failure domains. Every step while one
        slice holds the state; less often while live replicas also do."""
        c = self.config
        every = c.snapshot_every if len(self.live) < 2 else c.snapshot_every_replicated
        due = (c.snapshot_every and step % every == 0) or self._checkpoint_due(step)
        if not due:
            return []
        takers = sorted(self.live)[:2]
        self._snapshots.expect(step, len(takers))
        return takers

    # -- checkpoints and preemption ------------------------------------------------

    def _checkpoint_due(self, step: int) -> bool:
        c = self._ckpt
        if c is None:
            return False
        if c.config.due(step):
            return True
        return c.config.continuous and not c.busy() and step > (c.last_saved or 0)

    def _cold_start(self, step: int) -> None:
        """Resume a new run from the newest committed checkpoint."""
        ref = self._ckpt.restore_ref(step)
        loads = [w.load_state.remote(ref) for sl in self.live.values() for w in sl.workers]
        ray.get(loads, timeout=max(60.0, self.config.first_step_deadline_s))
        self.step = step
        self._step_durations = [0.0] * step  # steps done by an earlier run
        r = self.report
        r.resumed_from = step
        r.losses = [float("nan")] * step
        r.step_times = [0.0] * step
        r.slices_per_step = [0] * step
        self._event("restore", source="checkpoint", step=step, cold_start=True)

    def _current_snapshot(self):
        """A ref to the state of `self.step` (the newest snapshot if it is
        current, else a copy asked from a live slice)."""
        found = self._snapshots.restore_source(is_node_alive)
        if found is not None and found[0] == self.step:
            return found[1]
        return self.live[min(self.live)].workers[0].state.remote()

    def _after_step(self) -> None:
        c = self._ckpt
        if c is None:
            return
        c.poll()
        if c.must_stop():
            raise c.fail_with_rescue(self.step, self._current_snapshot(), self._run_name)
        if not c.busy() and self._checkpoint_due(self.step):
            c.submit(self.step, self._current_snapshot())

    def _final_checkpoint(self) -> None:
        c = self._ckpt
        if c is None or not c.config.save_at_end or not self.live:
            return
        if not c.save_now(self.step, self._current_snapshot(), timeout_s=300.0):
            raise c.fail_with_rescue(self.step, self._current_snapshot(), self._run_name)

    def _catch_sigterm(self):
        """SIGTERM to the driver (a preemption, a cancelled job): finish the
        step in flight, checkpoint it, exit cleanly."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            self._preempt_reason = "SIGTERM to the driver"

        return signal.signal(signal.SIGTERM, handler)

    def _stop_for_preemption(self) -> None:
        self._event("preempted", reason=self._preempt_reason, step=self.step)
        saved = False
        if self._ckpt is not None and self.live:
            saved = self._ckpt.save_now(self.step, self._current_snapshot(), timeout_s=60.0)
        self.report.outcome = "preempted"
        self._event("preempt_saved" if saved else "preempt_unsaved", step=self.step)

    def _check_drains(self, every_s: float = 0.5) -> None:
        """Preemption notices for a live slice, handled at a step boundary:
        a SIGTERM a worker reported with its last step, or a Ray drain
        notice (with a deadline) for one of the slice's nodes."""
        for (s, h), at in sorted(self._notices.items()):
            if s in self.live:
                del self._notices[(s, h)]
                self._retire_preempted(s, h, "SIGTERM to the worker", left_s=30.0, noticed_at=at)
                return
        now = self._clock()
        if now - self._drain_checked < every_s or not self.live:
            return
        self._drain_checked = now
        draining = drain.draining_nodes()
        if not draining:
            return
        for s, sl in sorted(self.live.items()):
            hit = [(h, i["node_id"]) for h, i in enumerate(sl.infos) if i["node_id"] in draining]
            if hit:
                h, node = hit[0]
                deadline_ms = draining[node]
                left = (deadline_ms / 1000.0 - time.time()) if deadline_ms else 60.0
                self._retire_preempted(s, h, f"node {node[:8]} drained for preemption", left_s=left, noticed_at=time.time())
                return

    def _retire_preempted(self, s: int, h: int, reason: str, left_s: float, noticed_at: float) -> None:
        """Checkpoint the last completed step before the notice's deadline,
        then take the slice out at this step boundary: no step is redone."""
        self._event("preempt_notice", slice=s, host=h, reason=reason, deadline_s=round(left_s, 3), step=self.step)
        if self._ckpt is not None:
            t0 = self._clock()
            ok = self._ckpt.save_now(self.step, self._current_snapshot(), timeout_s=max(1.0, left_s - 1.0))
            self._event(
                "preempt_saved" if ok else "preempt_unsaved", step=self.step,
                seconds=round(self._clock() - t0, 3), since_notice_s=round(time.time() - noticed_at, 3),
            )
        self._recover(SlicePreempted(s, h, self.step, reason), in_flight=False)

    def _gather(self, issued: list, k: int, deadline: float) -> dict:
        """Wait for every call; raise a SliceFailure on the first lost slice."""
        pending = {ref: (s, h, reissue) for s, h, ref, reissue in issued}
        out = {}
        while pending:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise self._hung(pending, k)
            waiting = list(pending)
            done, rest = ray.wait(waiting, num_returns=1, timeout=remaining)
            if done and rest:
                # Take everything else already finished in one go, so a
                # phase costs O(slices), not one wait per slice.
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                done += more
            for ref in done:
                s, h, reissue = pending.pop(ref)
                try:
                    out[(s, h)] = ray.get(ref)
                except rex.RayError as e:
                    kind = self._classify(e, s, h)
                    if kind is TRANSIENT:
                        pending[reissue()] = (s, h, reissue)
                        continue
                    s = self._blame(s, kind)
                    raise failure(kind, s, h, k, _short(e)) from None
        return out

    def _classify(self, e: BaseException, s: int, h: int):
        sl = self.live[s]
        worker = sl.workers[h]

        def ping(timeout: float) -> None:
            ray.get(worker.ping.remote(), timeout=timeout)

        return classify(e, sl.infos[h]["node_id"], ping)

    def _blame(self, s: int, kind: FailureKind) -> int:
        """A call can fail for a peer's sake (a gradient it fetched lived on
        a node that died): blame the slice that lost a node, if any."""
        if kind != FailureKind.NODE_DIED:
            return s
        for t in [s] + sorted(self.live):
            if any(not is_node_alive(i["node_id"]) for i in self.live[t].infos):
                return t
        return s

    def _hung(self, pending: dict, k: int) -> SliceFailure:
        # Find the host that does not answer a ping: the others of its slice
        # are only blocked on it. max_concurrency=2 lets pings pass a step.
        candidates = sorted({(s, h) for s, h, _ in pending.values()})
        for s, h in candidates:
            try:
                ray.get(self.live[s].workers[h].ping.remote(), timeout=0.5)
            except rex.GetTimeoutError:
                return failure(FailureKind.HUNG, s, h, k, f"no answer within the step deadline ({self._deadline_s():.1f} s)")
            except rex.RayError as e:
                kind = self._classify(e, s, h)
                if kind is not TRANSIENT:
                    return failure(kind, s, h, k, _short(e))
        s, h = candidates[0]
        return failure(FailureKind.HUNG, s, h, k, f"step did not finish within {self._deadline_s():.1f} s")

    # -- recovery -----------------------------------------------------------

    def _recover(self, f: SliceFailure, in_flight: bool = True) -> None:
        now = self._clock()
        fired = self._injector.last_for(f.slice_id)
        t_fault = now  # no injected fault: measure from the first sign of it
        if fired is not None and fired.fault.step == f.step:
            t_fault = fired.at_monotonic
        rec = FailureRecord(
            kind=f.kind.value, slice=f.slice_id, host=f.host, step=f.step,
            detected_s=round(now - t_fault, 4), cause=f.cause,
        )
        self.report.failures.append(rec)
        self._event("detected", kind=f.kind.value, slice=f.slice_id, host=f.host, step=f.step, detected_s=rec.detected_s)
        log.warning("%s", f)

        d = decide(SliceLost(f.slice_id, f.kind, f.step), self._view(), self.config, now)
        self.retries += 1
        failed = self.live.pop(f.slice_id)
        self._backend.kill(failed.workers)
        if isinstance(d, Fail):
            raise d.error from f
        self.coming[f.slice_id] = self._slices.start(f.slice_id)
        self._event("replace", slice=f.slice_id)
        try:
            self._reconcile()
        except SliceFailure as again:  # another slice went while we looked
            self._open.append((rec, t_fault))
            return self._recover(again)
        if isinstance(d, Shrink):
            self._event("shrink", slices=sorted(self.live), step=self.step)
        elif isinstance(d, Wait) and self.waiting_since is None:
            self.waiting_since = now
            self._event("wait", deadline_s=round(d.deadline - now, 3), step=self.step)
        rec.steps_rewound = (f.step + 1 if in_flight else f.step) - self.step
        rec.restored_from = "live" if self.live else "pending"
        rec.slices_after = len(self.live)
        self._fresh = True
        self._open.append((rec, t_fault))

    def _reconcile(self) -> None:
        """Bring the survivors to one common step after a failure mid-step.

        A failure during the apply phase can leave some survivors one step
        ahead of others. Keep the newer step where a complete snapshot of it
        exists; otherwise roll everyone back to the newest snapshot.
        """
        if not self.live:
            return
        order = sorted(self.live)
        try:
            held = ray.get([self.live[s].workers[0].held_step.remote() for s in order], timeout=30)
        except rex.RayError as e:
            raise self._first_dead(e, order) from None
        held_by = dict(zip(order, held))
        steps = set(held)
        if len(steps) == 1:
            self._rewind_to(held[0])
            return
        latest = self._snapshots.latest_step()
        target = max(steps) if latest == max(steps) else latest
        if target is None:
            target = min(steps)  # cannot happen with snapshots on; be safe
        found = self._snapshots.restore_source(is_node_alive) if latest is not None else None
        source = found[1] if found else None
        loads = [
            w.load_state.remote(source)
            for s in order
            if held_by[s] != target
            for w in self.live[s].workers
        ]
        try:
            ray.get(loads, timeout=60)
        except rex.RayError as e:
            raise self._first_dead(e, order) from None
        self._rewind_to(target)

    def _first_dead(self, e: BaseException, order: list[int]) -> SliceFailure:
        for s in order:
            for h, info in enumerate(self.live[s].infos):
                try:
                    ray.get(self.live[s].workers[h].ping.remote(), timeout=2)
                except rex.RayError as pe:
                    kind = self._classify(pe, s, h) or FailureKind.HUNG
                    return failure(kind, s, h, self.step, _short(pe))
        return failure(FailureKind.HUNG, order[0], 0, self.step, _short(e))

    def _shutdown(self) -> None:
        for sl in list(self.live.values()) + list(self.ready.values()):
            self._backend.kill(sl.workers)
        for p in self.coming.values():
            self._backend.kill(p.workers)
        self._snapshots.close()
        if self._ckpt is not None:
            self._ckpt.shutdown()
        self._slices.shutdown()


def _answers(workers: list, timeout_s: float = 2.0) -> bool:
    try:
        ray.get([w.ping.remote() for w in workers], timeout=timeout_s)
        return True
    except rex.RayError:
        return False


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
