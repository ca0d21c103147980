"""The single controller: runs in the Ray driver, never restarts, and
carries out what the policy decides.

The loop, at every step boundary: take any preemption notice; let the
policy decide on membership (grow, wait, go on); run a step on the live
slices (step_runner, through the backend). A worker, node or hang failure
surfaces as a `SliceFailure` (sorted once, in failures/location.py); the slice
is torn down, a replacement is queued on its placement group, and
`policy.decide` says whether to train on (resize) or wait (pause).
Survivors keep their state in memory; new slices load it from the newest
snapshot or straight from a survivor (membership).

The run's state is one of `Running(fresh)`, `Waiting(since, until)` and
`Stopping(reason)`; everything else the loop needs is derived from the
slices, the snapshots and the step count.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from typing import Callable, Optional, Sequence

from ray_elastic.callbacks import Callback
from ray_elastic.checkpoint.config import CheckpointConfig
from ray_elastic.checkpoint.coordinator import CheckpointCoordinator
from ray_elastic.config import ElasticConfig
from ray_elastic.dispatch.assignment import assign_shards, leader_ranges
from ray_elastic.control.startup import ray_backend, start_timeout
from ray_elastic.errors import ConfigError, FailureKind, NonFiniteLoss, SliceFailure, SlicePreempted, without_frames
from ray_elastic.failures.faults import Fault, FaultInjector, check_faults
from ray_elastic.control.membership import Membership, StateSource
from ray_elastic.control.pipelining import next_assignment
from ray_elastic.control.policy import Fail, Grow, Shrink, SliceLost, SlicesView, Tick, Wait, decide
from ray_elastic.control.saves import Saves
from ray_elastic.control.preemption import DriverStop, PreemptionWatcher, SliceNotice
from ray_elastic.program import TrainProgram
from ray_elastic.observe.recording import ReportRecorder
from ray_elastic.observe.report import RunReport
from ray_elastic.control.states import OpenFailure, RunState, Running, Stopping, Waiting, status
from ray_elastic.checkpoint.snapshots import SnapshotStore
from ray_elastic.control.snapshotting import Snapshotting
from ray_elastic.control.checking import Checks
from ray_elastic.control.integrity import roll_back, spend_retry
from ray_elastic.checkpoint.state_forms import final_state
from ray_elastic.control.seams import Seams
from ray_elastic.control.diloco import Rounds
from ray_elastic.control.step_reports import StepReports

__all__ = ["Controller", "Seams"]  # Seams: control/seams.py

log = logging.getLogger("ray_elastic")


class Controller:
    """The control loop behind `ElasticTrainer` (ray_elastic/trainer.py,
    where its arguments are described), with the seams tests use."""

    def __init__(
        self,
        program_factory: Callable[[], TrainProgram],
        config: ElasticConfig,
        steps: int,
        *,
        callbacks: Sequence[Callback] = (),
        checkpoint: Optional[CheckpointConfig] = None,
        keep_final_state: bool = False,
        faults: Sequence[Fault] = (),
        remove_node: Optional[Callable[[str], None]] = None,
        freeze_node: Optional[Callable[[str], None]] = None,
        seams: Seams = Seams(),
    ):
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError("steps", f"must be a positive integer, got {steps!r}")
        check_faults(faults, config.num_slices, len(config.slice.bundles()))
        if config.slices_per_leader and any(f.phase != "grads" for f in faults):
            raise ConfigError("faults", "with slices_per_leader, faults fire at the gradient phase only (phase='grads')")
        if config.slices_per_leader and seams.backend is None:
            # Read now, not at import: tests lower the fan-in.
            from ray_elastic.dispatch import step_runner

            leader_ranges(config.shards, config.num_slices, config.slices_per_leader, step_runner.APPLY_FAN_IN)
        self.config = config
        self.steps = steps
        self._factory = program_factory
        self._clock = clock = seams.clock
        self._injector = FaultInjector(list(faults), remove_node, clock=clock, freeze_node=freeze_node)
        self.report = RunReport(
            policy=config.policy, num_slices=config.num_slices, steps_requested=steps, spare_slices=config.spare_slices,
        )
        # The recorder goes first, so every other callback's on_end sees a
        # complete report.
        self._callbacks: list[Callback] = [ReportRecorder(self.report), *callbacks]
        self._reports = StepReports(self._callbacks)
        self._keep_final_state = keep_final_state
        self.final_state: Optional[dict] = None
        self._final_template = None  # a sharded final state's tree of shapes and dtypes
        self._needs = None  # what a host needs (preflight's memory estimate), for an out-of-memory failure's cause
        self._provisioner = seams.provisioner
        self._backend = seams.backend
        self._run_name = f"ray_elastic-{uuid.uuid4().hex[:6]}"
        self._ckpt = None
        if checkpoint is not None and not config.enable_diloco:  # DiLoCo's own: control/diloco_saves.py
            self._ckpt = CheckpointCoordinator(checkpoint, config.run_facts(), self._event, self._run_name,
                                               adopt=config.adopted_facts)
        self._preemption = PreemptionWatcher()
        self._state: RunState = Running()
        self.step = 0  # steps completed in the state the live slices hold
        self.retries = 0
        self._step_durations: list[float] = []  # of kept steps, by step index
        self._open: list[OpenFailure] = []
        self._held = None  # (partial step, its failure): finished when paused slices are back
        self._t_step = 0.0  # when the step in flight started
        self._step_slices = 0  # how many slices it started on
        self._t0, self._started, self._outcome, self._error = 0.0, False, "", ""
        self._announced = None  # the RunStatus callbacks saw last
        self._handling: Optional[OpenFailure] = None  # the failure being recovered from, until it is open
        self.members: Optional[Membership] = None  # made by fit()
        self._snapshots: Optional[SnapshotStore] = None  # made by fit()
        self._saves: Optional[Saves] = None  # made by fit()
        self._checks, self._found = Checks(config, self._event), None  # the step's Divergence or Straggler
        self._rounds = Rounds(config, steps, self._event, checkpoint, self._injector)  # DiLoCo's (control/diloco.py); off unless enable_diloco

    # -- the loop ---------------------------------------------------------

    def fit(self) -> RunReport:
        if self._backend is None:
            from ray_elastic.cluster.ray_backend import connect

            connect()
        for cb in self._callbacks:
            cb.on_start(self)
        self._t0 = self._clock()
        backend, self._snapshots = None, None
        self._preemption.install()
        outcome, error = "completed", ""
        try:
            # Storage is checked, and a cold start found, before any slice is reserved.
            resume_from = self._ckpt.preflight() if self._ckpt else self._rounds.preflight()
            if self._ckpt:
                self._ckpt.start_writer()
            if self._backend is None:  # the program runs in the workers: checked here first (preflight)
                backend, self._needs = ray_backend(self._factory, self.config, self.steps, self._run_name, self._clock,
                                                   self._provisioner, self._ckpt.facts if self._ckpt else None)
            backend = self._backend or backend
            self._injector.use(backend)
            self._snapshots = SnapshotStore(fetch=backend.fetch)
            self.members = Membership(
                backend, self._snapshots, self._event, checkpoints=self._ckpt,
                load_timeout_s=max(30.0, self.config.first_step_deadline_s),
            )
            self._saves = (self._rounds.saves(self.members)
                           or Saves(self._ckpt, self._snapshots, self.members, self._run_name, self._event, self._clock))
            def wanted(s: int):  # why a snapshot the schedule did not ask for is needed, if it is
                if self._saves.due(s):
                    return "checkpoint"
                return "cross_check" if self._checks.keep_state(s, len(self.members.live)) else None
            self._snapshotting = Snapshotting(self.config, self._snapshots, wanted, self._event, self._clock())
            self._start()
            if self._ckpt:
                backend.attach_checkpoints(self._ckpt, min(self.members.live))
            if resume_from is not None:
                self._cold_start(resume_from)
            while self.step < self.steps or self._rounds.owed(self.step):
                if self._take_notice():
                    outcome = "preempted"
                    break
                stepping = False  # a failure found in a join or a DiLoCo synchronization had no step in flight
                try:  # a join at the boundary may find a live slice lost too
                    if not self._step_boundary():
                        continue
                    if self._rounds.owed(self.step):  # a DiLoCo round ends: the replicas synchronize
                        self._rounds.synchronize(self.step, self.members, self._deadline_s())
                        continue
                    stepping = True
                    self._take_step()
                except SliceFailure as f:
                    self._recover(f, in_flight=stepping)
                    continue
                self._after_step()
            else:
                self._saves.at_end(self.step)
            if self._keep_final_state and self.members.live:
                self.final_state = final_state(backend.fetch(backend.state(self._rounds.first(self.members.live))))
                if isinstance(self.final_state, tuple):  # sharded: the trees' shapes, to make whole arrays of
                    self._final_template = backend.template(min(self.members.live))
        except BaseException as e:  # RunFailed, a ConfigError found at set-up, a bug, Ctrl-C: all end the run
            outcome, error = "failed", str(e) or type(e).__name__
            if isinstance(e, NonFiniteLoss):  # found before its step is applied: the state before is kept
                self.final_state = self._saves.keep_before_error(self.step, e, self._keep_final_state,
                                                                 self._event) or self.final_state
            raise
        finally:
            self._preemption.uninstall()
            self._outcome, self._error = outcome, error
            self._reports.release(self.step)  # the run ends before a DiLoCo replacement joined: the survivors' loss
            self._event("end", steps=self.step, outcome=outcome, **({"error": error} if error else {}))
            if self._snapshots is not None:
                self._snapshots.close()
            self._rounds.close()
            if self._ckpt is not None:  # a preemption's save still in flight commits first (saves.py)
                (self._saves.finish if self._saves is not None else self._ckpt.shutdown)()
            if backend is not None:  # a completed run's slices serve the next where it keeps workers
                backend.shutdown(keep=outcome == "completed" and self.config.keep_workers)
            for cb in self._callbacks:
                cb.on_end(self.report)
        return self.report

    def add_callback(self, callback: Callback) -> None:
        """Add a callback before `fit` (one that needs the trainer itself)."""
        self._callbacks.append(callback)

    @property
    def checkpoints(self) -> Optional[CheckpointCoordinator]:
        """The driver's side of durable checkpoints; None without a CheckpointConfig."""
        return self._ckpt

    @property
    def snapshots(self) -> Optional[SnapshotStore]:
        """The in-memory snapshots (made by `fit`)."""
        return self._snapshots

    @property
    def state(self) -> RunState:
        """The controller's own run state (Running, Waiting or Stopping)."""
        return self._state

    def elapsed_s(self) -> float:
        """Seconds since `fit` started, on the controller's clock."""
        return self._clock() - self._t0

    def hosts(self, slice_id: int) -> list[dict]:
        """pid, node_id and ip of each host of a live or ready slice."""
        return self.members.backend.hosts(slice_id)

    def _event(self, name: str, **fields) -> None:
        event = {"t": round(self._clock() - self._t0, 4), "event": name, **fields}
        for cb in self._callbacks:
            cb.on_event(event)
        self._announce()

    def _announce(self) -> None:
        """Tell callbacks the run's state when it has changed: their one model of it."""
        failures = self._open + ([self._handling] if self._handling is not None else [])
        # The slice just found failed is not live, though membership has not dropped it yet.
        gone = {self._handling.slice_id} if self._handling is not None else set()
        live = len(self.members.live - gone) if self.members is not None else 0
        now = status(self._state, failures, self._started, self._outcome, self._clock() - self._t0,
                     self.step, live, self._error)
        last = self._announced
        if last is not None and (last.phase, last.pending, last.deadline_s) == (now.phase, now.pending, now.deadline_s):
            return
        self._announced = now
        for cb in self._callbacks:
            cb.on_state(now)

    def _view(self) -> SlicesView:
        m = self.members
        return SlicesView(
            num_slices=self.config.num_slices,
            live=frozenset(m.live),
            ready_to_join=frozenset(m.ready),
            retries_used=self.retries,
            waiting_since=self._state.since if isinstance(self._state, Waiting) else None,
        )

    def _start(self) -> None:
        m, c = self.members, self.config
        # Hot spares take the ids after the training slices'.
        for s in range(c.num_slices + c.spare_slices):
            m.start(s)
        self._event("reserve", slices=c.num_slices, spares=c.spare_slices)
        # Start-up includes worker processes importing JAX and compiling,
        # so it gets at least the first step's deadline.
        wait_s = max(self.config.timeout_s, self.config.first_step_deadline_s)
        deadline = self._clock() + wait_s
        # Training starts once its slices (the lowest ids) are up; spares
        # may follow.
        training = set(range(self.config.num_slices))
        while not training <= m.ready and self._clock() < deadline:
            m.poll(block_s=0.2)
        if len(m.ready) < self.config.required_slices:
            raise start_timeout(self.config, m.ready, m.backend.placed, wait_s)
        m.go_live(training if training <= m.ready else set(sorted(m.ready)[: self.config.num_slices]))
        self._started = True
        self._event("start", slices=sorted(m.live), spares=sorted(m.ready))

    def _step_boundary(self) -> bool:
        """Apply the policy at a step boundary. True when a step can run."""
        m = self.members
        m.poll()
        d = decide(Tick(), self._view(), self.config, self._clock())
        if isinstance(d, Fail):
            raise d.error
        if isinstance(d, Grow) and (self._rounds.may_join(self.step) or not m.live):
            new = sorted(d.slices - m.live)
            if self._join(new) and (new or isinstance(self._state, Waiting)):
                self._state = Running(fresh=True)
                self._announce()
                held, self._held = self._held, None
                if held is not None and held[0].step == self.step and held[1] in self._open:
                    self._finish_in_flight(*held)
                    return False  # the loop checks the step count and notices first
            return bool(m.live) and not isinstance(self._state, Waiting)
        if isinstance(d, Wait):
            m.poll(block_s=0.25)
            self._saves.settle()  # a preemption's save may commit while the run waits
            return False
        return True  # Continue

    def _join(self, new: list[int]) -> bool:
        if not new:
            return True
        had_live, kind = bool(self.members.live), "replica"
        if self._rounds.on and had_live:  # a DiLoCo replica joins its round (control/diloco.py)
            joined = self._rounds.join(new, self.step, self.members, self._deadline_s())
        else:  # DiLoCo with every replica lost: back to the round's start if it is kept (control/diloco.py)
            source = self._rounds.lost_all(self.members) if self._rounds.on else self.members.state_source(self.step)
            if not had_live:
                self._restore_from(source)
            joined, kind = (self._rounds.rejoin(new, source, self.members, self._deadline_s()) if self._rounds.on
                            else self.members.join(new, source)), source.kind
        if not joined:
            return False
        if self._reports.holding:  # a DiLoCo step a replica was lost in: with every replica's loss
            self._reports.release(self.step, self._rounds.recomputed())
        self._event("grow", joined=new, slices=sorted(self.members.live), spares=sorted(self.members.ready), step=self.step,
                    source=kind)
        return True

    def _restore_from(self, source: StateSource) -> None:
        """No live slice holds the state: the run goes back to the source's."""
        for f in self._open:
            f.restored_from = source.kind
        if source.kind == "initial" and self.step > 0:
            log.warning("no in-memory snapshot survived; restarting from step 0 (%d steps lost)", self.step)
        self._rewind_to(source.step)
        self._rounds.restart(source.step)
        if source.kind != "initial":
            self._event("restore", source=source.kind, step=source.step)

    def _rewind_to(self, step: int) -> None:
        for f in self._open:  # failures not yet recovered lose these steps too
            f.steps_rewound = max(f.steps_rewound, f.step + 1 - step)
        if step < self.step:
            self._event("rewind", from_step=self.step, to_step=step)
        self.step = step
        del self._step_durations[step:]
        self._snapshotting.restart(step)
        self._checks.restart(step)

    # -- one step -----------------------------------------------------------

    def _deadline_s(self) -> float:
        c = self.config
        fresh = isinstance(self._state, Running) and self._state.fresh
        if fresh or len(self._step_durations) < 3:
            return c.first_step_deadline_s
        recent = self._step_durations[-20:]
        return max(c.step_deadline_floor_s, c.step_deadline_factor * statistics.median(recent))

    def _take_step(self) -> None:
        k, m, t_start, c = self.step, self.members, self._clock(), self.config
        self._t_step, self._step_slices = t_start, len(m.live)
        assignment = (self._rounds.assignment(m.live) if self._rounds.on else
                      assign_shards(m.live, c.shards, c.batch_on_resize, getattr(m.backend, "ranges", None)))
        takers = self._snapshotting.takers(k + 1, m.live)

        def fire_faults(phase: str = "grads") -> None:
            for fired in self._injector.fire_due(k, m.hosts(), phase):
                self._event("fault", kind=fired.fault.kind, slice=fired.fault.slice_id, host=fired.fault.host,
                            step=k, phase=phase)

        ahead = None if self._checks.no_ahead(k + 1) else next_assignment(self._view(), c, k, self.steps,
                                                                          self._clock(), assignment)
        self._checks.issue(k, m.live, assignment, m.backend)
        result = (m.backend.run_inner(k, sorted(m.live), assignment, self._rounds.replica_map(m.live), self._deadline_s(),
                                      fire_faults) if self._rounds.on else
                  m.backend.run_step(k, sorted(m.live), assignment, takers, self._deadline_s(), fire_faults, ahead))
        self._complete_step(k, result, t_start)

    def _complete_step(self, k: int, result, t_start: float, recovered: bool = True,
                       slices: Optional[int] = None, held: bool = False) -> None:
        """Step k is done: its snapshots, time and metrics; `recovered`: the open failures are over (not while
        paused for a replacement); `slices`: how many computed it (default: the live ones); `held`: its report
        waits for a DiLoCo replacement's loss (step_reports.py)."""
        m = self.members
        self._preemption.record_step(result.metrics)
        t_end = self._clock()
        self._snapshotting.step_done(k + 1, result, t_end - t_start,
                                     lambda s: [h["node_id"] for h in m.backend.hosts(s)], self._deadline_s())
        t_end = self._clock()  # with a pinned copy's wait
        self.step = k + 1
        del self._step_durations[k:]
        self._step_durations.append(t_end - t_start)
        self._found = self._checks.after_step(self.step, result.metrics, self._snapshots, sorted(m.ready), m.backend,
                                              self._deadline_s())
        slices = len(m.live) if slices is None else slices
        if not recovered:
            return self._reports.report(self.step, result, t_end - t_start, slices, held)
        self._state = Running(fresh=False)
        for f in self._open:
            redone = float(f.steps_rewound) if f.compute_redone is None else f.compute_redone
            self._event(
                "recovered", slice=f.slice_id, step=self.step, recovered_s=round(t_end - f.t_fault, 4),
                steps_rewound=f.steps_rewound, compute_redone=round(redone, 4),
                restored_from=f.restored_from, slices_after=len(m.live),
            )
        self._open.clear()
        self._announce()
        self._reports.report(self.step, result, t_end - t_start, slices, held)

    # -- recovery -----------------------------------------------------------

    def _recover(self, f: SliceFailure, in_flight: bool = True, evict: tuple = ()) -> None:
        now, self._held, f = self._clock(), None, without_frames(f)  # frees what its frames held (errors.py)
        fired = self._injector.last_for(f.slice_id)
        # Measured from the injected fault, else from its first sign.
        t_fault = fired.at if fired is not None and fired.fault.step == f.step else now
        open_failure = self._handling = OpenFailure(f.slice_id, f.step, t_fault)
        if f.kind is FailureKind.OOM and self._needs is not None:  # what the node had, beside what the run needs
            f = f.replace(cause=f"{f.cause}; the run needs {self._needs.text()}")
        self._event("detected", kind=f.kind.value, slice=f.slice_id, host=f.host, step=f.step,
                    detected_s=round(now - t_fault, 4), cause=f.cause)
        log.warning("%s", f)
        d = decide(SliceLost(f.slice_id, f.kind, f.step), self._view(), self.config, now)
        self.retries += 1
        if isinstance(d, Fail):
            self.members.live.discard(f.slice_id)
            self.members.backend.retire(f.slice_id)
            raise d.error from f
        # A silent (frozen) node keeps its bundle of the slice's placement group until Ray
        # declares it dead, a lost one has it rescheduled: the replacement gets a new group.
        new_group = self.members.lose(f.slice_id, new_group=f.node_silent, evict=evict, host=f.host,
                                      node_died=f.kind is FailureKind.NODE_DIED)
        if not self.members.live:  # the loss snapshots guard against: every slice at once
            self._snapshotting.all_lost(now)
        self._event("replace", slice=f.slice_id, **({"new_group": True} if new_group else {}))
        try:
            self._reconcile(unreachable=f.kind.value in ("node_died", "hung"))
        except SliceFailure as again:  # another slice went while we looked
            self._open.append(open_failure)
            self._handling = None
            return self._recover(again)
        if isinstance(d, Shrink):
            self._event("shrink", slices=sorted(self.members.live), step=self.step)
        elif isinstance(d, Wait) and not isinstance(self._state, Waiting):
            self._state = Waiting(since=now, until=d.deadline)
            self._event("wait", deadline_s=round(d.deadline - now, 3), step=self.step)
        if not isinstance(self._state, Waiting):
            self._state = Running(fresh=True)
        open_failure.steps_rewound = max(0, (f.step + 1 if in_flight else f.step) - self.step)
        open_failure.restored_from = "live" if self.members.live else "pending"
        self._open.append(open_failure)
        self._handling = None
        self._announce()
        if in_flight and self.step == f.step + 1:  # the survivors had applied the step: it counts
            done = self.members.backend.applied(f.step, sorted(self.members.live))
            if done is not None:
                last, paused = self.step >= self.steps, isinstance(self._state, Waiting)  # last: nothing to wait for
                # DiLoCo: averaged over the replicas; under pause reported once the replacement recomputed it (`_join`).
                done, held = self._rounds.survivors_step(f.step, done, paused) if self._rounds.on else (done, False)
                # Computed by every slice of the step, the lost one included.
                self._complete_step(f.step, done, self._t_step, recovered=last or not paused, slices=self._step_slices,
                                    held=held)
                self._after_step()
        partial = f.partial
        if not (in_flight and partial is not None and self.step == f.step):
            return
        if isinstance(d, Shrink) and self.config.batch_on_resize == "accumulate":
            self._finish_in_flight(partial, open_failure)
        elif isinstance(d, Wait) and partial.payloads and getattr(self.members.backend, "ranges", None) is None:
            # Paused: the step is finished once the replacement (a spare at
            # once) has joined, with the survivors' gradients kept.
            self._held = (partial, open_failure)

    def _finish_in_flight(self, partial, open_failure: OpenFailure) -> None:
        """A slice lost mid-step: the survivors keep their gradients, the
        live slices (under pause, with the replacement) compute only the
        lost slice's shards and complete the step; no step is redone."""
        m, k = self.members, partial.step
        lost = [sh for s, shards in partial.assignment.items() if s not in partial.payloads for sh in shards]
        open_failure.steps_rewound = 0
        open_failure.compute_redone = len(lost) / self.config.shards
        t_start = self._clock()
        try:
            result = m.backend.finish_step(partial, sorted(m.live), self._snapshotting.takers(k + 1, m.live), self._deadline_s())
        except SliceFailure as again:
            open_failure.steps_rewound, open_failure.compute_redone = 1, None
            return self._recover(again)
        self._event("step_completed_on_survivors", step=k + 1, shards_recomputed=len(lost))
        self._complete_step(k, result, t_start)
        self._after_step()  # a checkpoint due at this step

    def _reconcile(self, unreachable: bool) -> None:
        """Bring the survivors to one common step after a failure mid-step."""
        if (target := self.members.reconcile(self.step, unreachable)) is not None:
            self._rewind_to(target)

    # -- checkpoints and preemption ----------------------------------------------

    def _cold_start(self, step: int) -> None:
        """Resume a new run from the newest committed checkpoint."""
        step = self._saves.cold_start(step, max(60.0, self.config.first_step_deadline_s), self.members.backend.load)
        self.step = step
        self._step_durations = [0.0] * step  # steps done by an earlier run
        self._snapshotting.restart(step)
        self._checks.restart(step, cold=True)
        self._event("restore", source="checkpoint", step=step, cold_start=True)

    def _after_step(self) -> None:
        found, self._found = self._found, None
        failure = found.failure() if found is not None else None
        if failure is not None:  # corrupted or a straggler: its node is not used again (checking.py)
            node = self.members.backend.hosts(failure.slice_id)[failure.host]["node_id"]
            self._recover(failure, in_flight=False, evict=(node,))
        if found is None or not found.rolls_back:
            return self._saves.after_step(self.step)
        if failure is None:  # a divergence no slice could be named for
            self.retries = spend_retry(found, self.retries, self.config.max_retries)
        step = roll_back(self.members, self._snapshots, found, self._event, self._open)
        if step is not None:
            self._rewind_to(step)
        elif not isinstance(self._state, Waiting):
            self._state = Waiting(since=self._clock(), until=self._clock() + self.config.timeout_s)

    def _take_notice(self) -> bool:
        """Handle a preemption notice at this step boundary. True when the run must stop (SIGTERM to the driver)."""
        notice = self._preemption.check(self.members.hosts(), self._clock(), time.time())
        if isinstance(notice, DriverStop):
            self._state = Stopping(notice.reason)
            self._announce()
            self._event("preempted", reason=notice.reason, step=self.step)
            saved = self._saves.now(self.step, timeout_s=60.0)
            self._event("preempt_saved" if saved else "preempt_unsaved", step=self.step)
            return True
        if isinstance(notice, SliceNotice):
            self._retire_preempted(notice)
        return False

    def _retire_preempted(self, n: SliceNotice) -> None:
        """Checkpoint the last completed step before the notice's deadline
        (beside training where another slice holds it: saves.py), then
        take the slice out at this step boundary: no step is redone."""
        self._event("preempt_notice", slice=n.slice_id, host=n.host, reason=n.reason,
                    deadline_s=round(n.left_s, 3), step=self.step)
        self._saves.before_preemption(self.step, n.slice_id, n.noticed_at, timeout_s=max(1.0, n.left_s - 1.0))
        self._recover(SlicePreempted(n.slice_id, n.host, self.step, n.reason), in_flight=False)
