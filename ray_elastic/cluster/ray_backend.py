"""The controller's cluster on Ray: slices provisioned as placement groups
of worker actors (slice_group.RaySlices, or a drop-in with the same
methods such as the scale bench's simulated slices), steps run by the
StepRunner, failures located by the FailureLocator."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray import exceptions as rex

from ray_elastic.cluster.backend import SliceUp
from ray_elastic.checkpoint.host_writes import HostRestore
from ray_elastic.errors import CheckpointDamaged, RunFailed, StateLoadFailed
from ray_elastic.dispatch.assignment import leader_ranges
from ray_elastic.failures.location import FailureLocator, RayProbe, ping_ref, short, watched_wait
from ray_elastic.dispatch.grouped_runner import GroupedRunner
from ray_elastic.cluster.slice_group import LiveSlice, Provisioning, RaySlices, SliceProvisioner
from ray_elastic.dispatch.calls import Call, Deadline
from ray_elastic.dispatch.diloco_runner import DilocoRunner
from ray_elastic.dispatch.exchange import ExchangeSpec
from ray_elastic.dispatch.outer_spec import OuterSpec
from ray_elastic.dispatch.step_runner import StepResult, StepRunner

__all__ = ["RayBackend", "connect"]

log = logging.getLogger("ray_elastic")

# Seconds a cross-check's recomputations may take before a step under
# group leaders is issued anyway (the check then finds the call missed).
_CHECK_FIRST_S = 120.0


def connect() -> None:
    """Join the Ray cluster (`ray.init()`: the one this driver runs in, or a
    new local one) unless this process already has."""
    if not ray.is_initialized():
        ray.init()


class RayBackend:
    def __init__(
        self, spec, program_factory: Callable, seed: int, num_shards: int, run_name: str,
        compile_cache_dir: str = "", provisioner: Optional[type] = None,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
        warm_workers: int = 0, slices_per_leader: int = 0, num_slices: int = 0, heartbeat_timeout_s: float = 0.0,
        state_check_every: int = 0, grad_check_every: int = 0, final_step: int = 0,
        exchange: tuple = ("reduce_scatter", None, 0), keep_workers: bool = False, diloco: Optional[OuterSpec] = None,
        step_program: str = "auto",
    ):
        cls = provisioner or RaySlices
        # Only Ray's own slices are kept: a drop-in provisioner (the scale
        # benchmark's simulated slices) knows nothing of it.
        self._keeps = keep_workers and provisioner is None
        self._slices: SliceProvisioner = cls(
            spec, program_factory, seed, num_shards, run_name=run_name, compile_cache_dir=compile_cache_dir,
            warm_workers=warm_workers, state_check_every=state_check_every,
            grad_check_every=grad_check_every, final_step=final_step,
            **({"keep_workers": True} if self._keeps else {}),
        )
        probe = RayProbe()
        beats = probe.heartbeats(clock, heartbeat_timeout_s) if heartbeat_timeout_s > 0 else None
        self.locator = FailureLocator(probe, clock, sleep, heartbeats=beats)
        self._clock = clock
        self.runner = StepRunner(self.locator, clock)
        if exchange[0] == "reduce_scatter":  # (kind, wire dtype, blocks: dispatch/exchange_plan.py)
            self.runner.exchange = ExchangeSpec(blocks=exchange[2] or max(num_slices, 1), wire_dtype=exchange[1],
                                                step_program=step_program)
        # With group leaders: the shard ranges the slices' groups compute
        # (assign_shards), and the runner that calls the leaders.
        self.ranges: Optional[list] = None
        if slices_per_leader:
            self.ranges, depth = leader_ranges(num_shards, num_slices, slices_per_leader, self.runner.fan_in)
            self.runner = GroupedRunner(self.locator, clock, self.ranges, depth)
        self._coming: dict[int, Provisioning] = {}
        self._lost_checked_at = float("-inf")  # when the starting slices' nodes were last checked
        self._up: dict[int, LiveSlice] = {}  # set up: ready to join, or live
        # DiLoCo's inner steps and synchronizations (dispatch/diloco_runner.py), on the same runner.
        self.diloco = None if diloco is None else DilocoRunner(self.runner, diloco, max(num_slices, 1), clock)

    # -- provisioning -----------------------------------------------------

    def start(self, slice_id: int, new_group: bool = False, evict: tuple = ()) -> None:
        self.retire(slice_id)
        if new_group or evict:
            self._slices.abandon_group(slice_id, evict)
        self._coming[slice_id] = self._slices.start(slice_id)

    def poll(self, block_s: float = 0.0) -> list[SliceUp]:
        self._slices.reap_abandoned()
        self._restart_on_lost_nodes()
        if block_s and self._coming:
            refs = [r for p in self._coming.values() for r in p.setup_refs]
            ray.wait(refs, num_returns=len(refs), timeout=block_s)
        up = []
        for s, p in list(self._coming.items()):
            try:
                live = self._slices.poll(p)
            except rex.RayActorError as e:
                if getattr(e, "actor_init_failed", False):
                    # The worker's own constructor raised: a bug or a bad
                    # environment, not a hardware failure. Retrying won't help.
                    raise RunFailed(
                        f"the worker for slice {s} could not start: {short(e)}. "
                        "Check that the program factory and its modules can be "
                        "imported and unpickled on the worker nodes.",
                        setting="program_factory",
                    ) from e
                self._restart(s, short(e))
                continue
            except (rex.ObjectLostError, rex.OutOfMemoryError, rex.WorkerCrashedError, rex.NodeDiedError) as e:
                # The replacement itself died while starting (its node went
                # away, Ray's memory monitor killed it): queue it again
                # (within the policy's timeout_s), on the same placement
                # group unless one of its nodes is gone.
                self._restart(s, short(e))
                continue
            if live is not None:
                self.locator.probe.watch(i["node_id"] for i in live.infos)
                del self._coming[s]
                self._up[s] = live
                up.append(SliceUp(s, round(live.ready_at - p.started_at, 3), dict(live.phases),
                                  dict(live.predecessors)))
        return up

    def placed(self, slice_id: int) -> bool:
        return self._slices.placement_group_state(slice_id) == "CREATED"

    def _restart(self, s: int, cause: str) -> None:
        """Start slice `s` again; where a node of its group is gone, on a
        new group kept off that node (left in the old one, the slice would
        wait for Ray's health checks to declare the node dead)."""
        gone = tuple(n for n in self._slices.group_nodes(s) if self.locator.node_lost(n))
        log.warning("slice %d did not start: %s%s", s, cause,
                    f"; a new placement group away from the lost node(s) {', '.join(gone)}" if gone else "")
        self.start(s, evict=gone)

    def _restart_on_lost_nodes(self, every_s: float = 1.0) -> None:
        """A slice still starting whose group holds a bundle on a node that
        is gone starts again at once, away from that node. Ray fails the
        workers on it only once its health checks declare the node dead:
        on Ray's defaults a replacement whose node was removed while it
        started waited ~21 s for that error here."""
        now = self._clock()
        if not self._coming or now - self._lost_checked_at < every_s:
            return
        self._lost_checked_at = now
        for s in list(self._coming):
            # The raylet's port alone: Ray's node table is one GCS call per
            # node asked, and a run's first start may ask of hundreds. Only
            # a refused connection counts, never a timeout: a healthy node
            # taken for lost here would be kept out of the run for good.
            if any(self.locator.probe.raylet_refuses(n) for n in self._slices.group_nodes(s)):
                self._restart(s, "a node of its placement group is gone")

    def retire(self, slice_id: int) -> None:
        self.runner.drop_ahead()
        if self.diloco is not None:
            self.diloco.forget(slice_id)
        for holder in (self._up, self._coming):
            gone = holder.pop(slice_id, None)
            if gone is not None:
                self._slices.kill(gone.workers, gone.infos if isinstance(gone, LiveSlice) else ())

    def hosts(self, slice_id: int) -> list[dict]:
        return self._up[slice_id].infos

    def workers(self, slice_id: int) -> list:
        """The worker actors of a live slice, in host order."""
        return list(self._up[slice_id].workers)

    def node_alive(self, node_id: str) -> bool:
        """Whether a copy of state on the node can still be read (the
        controller asks it of every snapshot or round-start copy it picks):
        not where the node's raylet refuses connections. Ray's node table
        lists a removed node as alive until its health checks give up (~1.5
        s with the shipped configs, ~30 s on Ray's defaults), and a copy
        read from it meanwhile stalls: the reader's raylet retries the pull
        only after `object_manager_pull_timeout_ms` (10 s)."""
        return not self.locator.node_lost(node_id)

    def slow_down(self, slice_id: int, host: int, ms: int) -> None:
        worker = self._up[slice_id].workers[host]
        ray.get(worker.slow_down.options(concurrency_group="control").remote(ms), timeout=30.0)

    def hold_gil(self, slice_id: int, host: int, ms: int) -> None:
        """Have a worker hold its GIL for `ms` (a `gil` fault); not waited
        for: the step goes on around it. Its reply is read once it comes."""
        worker = self._up[slice_id].workers[host]
        self.runner.unread.add(worker.hold_gil.options(concurrency_group="control").remote(ms))

    def eat_memory(self, slice_id: int, host: int, mb: int) -> None:
        """Have a worker allocate `mb` megabytes for a while (an `oom`
        fault); not waited for. Its reply (or the kill) is read once it comes."""
        worker = self._up[slice_id].workers[host]
        self.runner.unread.add(worker.eat_memory.options(concurrency_group="control").remote(mb))

    def corrupt(self, slice_id: int, host: int, target: str, lasting: bool) -> None:
        worker = self._up[slice_id].workers[host]
        ray.get(worker.corrupt.options(concurrency_group="control").remote(target, lasting), timeout=30.0)

    def recompute(self, slice_id: int, step: int, shard: int) -> list:
        """Each host's `recompute` call (refs), on its compute thread; the
        slice's gradient calls of `step` wait for all of them (run_first:
        every host runs the check's collectives before the step's)."""
        refs = [w.recompute.options(concurrency_group="compute").remote(step, shard)
                for w in self._up[slice_id].workers]
        if isinstance(self.runner, StepRunner):
            self.runner.run_first(step, slice_id, refs)
        else:  # group leaders issue the gradient calls: the check is done first
            ray.wait(refs, num_returns=len(refs), timeout=_CHECK_FIRST_S)
        return refs

    def fingerprint(self, slice_id: int) -> list:
        return [w.fingerprint.options(concurrency_group="compute").remote() for w in self._up[slice_id].workers]

    # -- steps and state --------------------------------------------------

    def _live(self, slices: Sequence[int]) -> dict[int, LiveSlice]:
        return {s: self._up[s] for s in slices}

    def run_step(
        self, step: int, slices: Sequence[int], assignment: Mapping[int, tuple],
        takers: frozenset, deadline_s: float, on_issued: Callable[[], None],
        ahead: Optional[Mapping[int, tuple]] = None,
    ) -> StepResult:
        live = self._live(slices)
        self.locator.started(live, step)
        return self.runner.run(step, live, assignment, takers, deadline_s, on_issued, ahead)

    # -- DiLoCo (control/diloco.py) ----------------------------------------

    def run_inner(self, step: int, slices: Sequence[int], assignment: Mapping[int, tuple],
                  replicas: Mapping[int, int], deadline_s: float, on_issued: Callable[..., None]) -> StepResult:
        live = self._live(slices)
        self.locator.started(live, step)
        return self.diloco.inner(step, live, assignment, replicas, deadline_s, on_issued)

    def synchronize(self, boundary: int, since: int, slices: Sequence[int], replicas: Mapping[int, int],
                    deadline_s: float, on_issued: Callable[..., None] = lambda phase="sync": None,
                    fragment: Optional[int] = None) -> tuple:
        live = self._live(slices)
        self.locator.started(live, boundary)
        return self.diloco.synchronize(boundary, since, live, replicas, deadline_s, on_issued, fragment)

    def start_sync(self, boundary: int, slices: Sequence[int], replicas: Mapping[int, int], deadline_s: float,
                   on_issued: Callable[..., None], fragment: int) -> None:
        """Issue a fragment's synchronization, overlapped with the inner
        steps that follow (DilocoRunner.start); `finish_sync` gathers it."""
        live = self._live(slices)
        self.locator.started(live, boundary)
        self.diloco.start(boundary, live, replicas, deadline_s, on_issued, fragment)

    def finish_sync(self, slices: Sequence[int]) -> Optional[tuple]:
        """The synchronization `start_sync` issued, gathered: (replicas
        averaged, bytes moved, inner steps overlapped); None where it must run again
        (`synchronize`), given up on: a slice left or joined since, or a
        call was re-issued. A slice lost in it raises its failure."""
        pending, live = self.diloco.pending, self._live(slices)
        if pending is None:
            return None
        if set(slices) != pending.slices:
            self.diloco.drop(live)
            return None
        return self.diloco.finish(live)

    def drop_sync(self, slices: Sequence[int]) -> None:
        """Give up on the synchronization `start_sync` issued (if any)."""
        self.diloco.drop(self._live(slices))

    def adopt(self, slices: Sequence[int], donor: int, boundary: int, deadline_s: float) -> None:
        """`slices` take `donor`'s global params and outer state (a joiner
        at a round's start, which loaded the donor's state: under Streaming
        DiLoCo its params are the donor's own, not the global ones)."""
        live = self._live([*slices, donor])
        self.diloco.adopt(list(slices), donor, live, boundary, Deadline.after(self._clock(), deadline_s),
                          None if self.diloco.spec.streaming else "all")

    def put(self, value: Any) -> Any:
        """`value` in the object store, owned by the driver (on its node)."""
        return ray.put(value)

    def outer_copy(self, slice_id: int) -> Any:
        """A slice's global params and outer state on the host (a tuple,
        one per host, under a sharded layout), as round_states' refs are."""
        sl, spec = self._up[slice_id], self.diloco.spec
        return tuple(w.diloco_global.remote(spec) for w in sl.workers) if sl.per_host else sl.workers[0].diloco_global.remote(spec)

    def outer_copies(self, slices: Sequence[int]) -> list:
        """Copies of the global params and outer state now, each (ref, the
        nodes it lies on), from two slices (on two slices' nodes): what a
        run that loses every replica goes back to, beside their round-start
        states. Owned by the driver."""
        return [(self.outer_copy(s), tuple(h["node_id"] for h in self.hosts(s))) for s in sorted(slices)[:2]]

    def load_outer(self, slices: Sequence[int], copy: Any, timeout_s: float) -> None:
        """Every host of `slices` holds `copy` as its global params and outer
        state: whole arrays, or `outer_copy`'s (a tuple: host i's from host i)."""
        spec = self.diloco.spec
        ray.get([w.diloco_load_outer.remote(copy[h] if isinstance(copy, tuple) else copy, spec)
                 for s in slices for h, w in enumerate(self._up[s].workers)], timeout=timeout_s)

    def undo_sync(self, slices: Sequence[int], since: int, deadline_s: float) -> int:
        """Every host of `slices` takes back an outer step past boundary
        `since` (one a failure left applied on some hosts only); returns
        how many hosts took one back."""
        live, wait = self._live(slices), Deadline.after(self._clock(), deadline_s)

        def on_hosts(hosts, fn):
            return self.diloco.runner.gather([Call(s, h, fn(live[s].workers[h]), lambda s=s, h=h: fn(live[s].workers[h]))
                                              for s, h in hosts], since, wait, live)

        held = on_hosts([(s, h) for s in slices for h in range(len(live[s].workers))], lambda w: w.diloco_synced.remote())
        past = [key for key, synced in held.items() if synced != since]
        if past:
            on_hosts(past, lambda w: w.diloco_synced.remote(since))
        return len(past)

    def round_states(self, slices: Sequence[int], only: Optional[Sequence[int]] = None) -> dict:
        """slice -> copies of its state now, each (ref, the nodes it lies
        on): the slice's own (a tuple of refs, one per host, under a
        sharded layout), made on the `compute` thread between inner
        steps, and one on the next slice's nodes (host i on host i), so a
        replica's round start outlives its node. Owned by the driver.
        `only`: of these slices alone (the next slice still among all)."""
        def own(s):
            sl = self._up[s]
            workers = sl.workers[:len(sl.workers) if sl.per_host else 1]
            refs = [w.flat_state.options(concurrency_group="compute").remote() for w in workers]
            self.diloco.hold_before_next(s, workers, refs)  # taken before the next inner step, not after
            return tuple(refs) if sl.per_host else refs[0]

        order = sorted(slices)
        out = {}
        for i, s in enumerate(order):
            if only is not None and s not in only:
                continue
            ref = own(s)
            copies = [(ref, tuple(h["node_id"] for h in self.hosts(s)))]
            if len(order) > 1:
                nxt = self._up[order[(i + 1) % len(order)]]
                parts = ref if isinstance(ref, tuple) else (ref,)
                held = tuple(nxt.workers[h].hold_copy.options(concurrency_group="snapshot").remote(part)
                             for h, part in enumerate(parts))
                copies.append((held if isinstance(ref, tuple) else held[0],
                               tuple(h["node_id"] for h in nxt.infos[:len(parts)])))
            out[s] = copies
        return out

    def catch_up(self, slice_id: int, donor: int, steps: range, shards: tuple, deadline_s: float) -> dict:
        """A joiner that loaded a replica's round-start state takes the
        round's global params and outer state from `donor` (unchanged
        since the round started) and recomputes the replica's inner
        `steps`, each after the last: step -> its hosts' metrics."""
        live = self._live([slice_id, donor])
        wait = Deadline.after(self._clock(), deadline_s)
        # Its params are the round-start state's (under Streaming DiLoCo
        # not the global ones: only a fragment synchronized then).
        self.diloco.adopt([slice_id], donor, live, steps.start, wait, None if self.diloco.spec.streaming else "all")
        return self.diloco.catch_up(slice_id, live, steps, shards, wait)

    def finish_step(self, partial: Any, slices: Sequence[int], takers: frozenset, deadline_s: float) -> StepResult:
        return self.runner.finish(partial, self._live(slices), takers, deadline_s)

    def applied(self, step: int, slices: Sequence[int]) -> Optional[StepResult]:
        # DiLoCo's: each host's own loss; the controller averages them over the replicas (control/diloco.py).
        return self.runner.applied(step, self._live(slices))

    def load(self, slices: Sequence[int], source: Any, timeout_s: float) -> None:
        self.runner.drop_ahead()
        if isinstance(self.runner, StepRunner):
            # A gradient call issued ahead and still to run would run on
            # some hosts before the load and on others after it (where it
            # fails at once, running no collective), and the hosts of the
            # slice would pair different programs' collectives from then on.
            self.runner.settle_dropped(Deadline.after(self._clock(), timeout_s), self._live(slices), only=True)
        if isinstance(source, HostRestore):  # every host reads its own shards of a checkpoint
            nonce = uuid.uuid4().hex
            refs = [w.restore_checkpoint.remote(source.path, source.keep, source.step, f"{nonce}/{s}")
                    for s in slices for w in self._up[s].workers]
        else:
            # A tuple is a sharded state, one part per host: host i loads
            # the part of host i of the slice it came from.
            refs = [w.load_state.remote(source[h] if isinstance(source, tuple) else source)
                    for s in slices for h, w in enumerate(self._up[s].workers)]
        try:
            # Survivors behind the others are watched as in a step; a
            # joining slice's new processes are left to the timeout.
            known = self.locator.known(self._live(slices))
            lost = self._wait_watched(refs, [s for s in slices for _ in self._up[s].workers], -1, timeout_s,
                                      only=known)
            if lost is not None:
                raise StateLoadFailed([lost.slice_id], lost.cause)
            ray.get(refs, timeout=1.0)
        except rex.RayTaskError as e:
            if isinstance(getattr(e, "cause", None), CheckpointDamaged):
                raise e.cause from None
            dead = [s for s in slices if not _answers(self._up[s].workers)]
            raise StateLoadFailed(dead, short(e)) from None
        except rex.RayError as e:
            dead = [s for s in slices if not _answers(self._up[s].workers)]
            raise StateLoadFailed(dead, short(e)) from None

    def held_steps(self, slices: Sequence[int], step: int, abort_waits: bool = False) -> dict[int, int]:
        order = sorted(slices)
        live = self._live(order)
        self.runner.settle_applies(timeout_s=30.0, slices=set(order), abort_waits=abort_waits,
                                   watch=lambda waiting: self.locator.watch(live, waiting, step))
        try:
            # Every host: under a sharded layout each host applies its own
            # blocks, so a failure mid-apply may leave a slice's hosts apart.
            refs = [w.held_step.remote() for s in order for w in self._up[s].workers]
            lost = self._wait_watched(refs, [s for s in order for _ in self._up[s].workers], step, 30.0)
            if lost is not None:
                raise lost
            held = ray.get(refs, timeout=1.0)
        except rex.RayError as e:
            raise self.locator.first_dead(e, self._live(order), step) from None
        out, i = {}, 0
        for s in order:
            n = len(self._up[s].workers)
            steps = set(held[i:i + n])
            out[s] = steps.pop() if len(steps) == 1 else -1
            i += n
        return out

    def _wait_watched(self, refs: list, slice_of: list, step: int, timeout_s: float, only=None):
        """failures.location.watched_wait for calls to hosts of the slices
        `slice_of` names (one per ref), watched as a step's are (`only`
        those of these slices, if given)."""
        live = self._live(sorted(set(slice_of)))

        def watch(waiting: set):
            waiting = waiting if only is None else waiting & only
            return self.locator.watch(live, waiting, step) if waiting else None

        return watched_wait(dict(zip(refs, slice_of)), watch, self._clock, timeout_s)

    def locate(self, slices: Sequence[int], step: int, cause: BaseException):
        """The SliceFailure behind a call to several slices that failed."""
        return self.locator.first_dead(cause, self._live(sorted(slices)), step)

    def state(self, slice_id: int) -> Any:
        sl = self._up[slice_id]
        if sl.per_host:  # each host's own blocks, never gathered in one place
            return tuple(w.state.remote() for w in sl.workers)
        return sl.workers[0].state.remote()

    def template(self, slice_id: int, timeout_s: float = 60.0) -> dict:
        """The state's tree of shapes and dtypes ({"params", "opt_state"})."""
        return ray.get(self._up[slice_id].workers[0].state_template.remote(), timeout=timeout_s)

    def fetch(self, ref: Any, timeout_s: Optional[float] = None) -> Any:
        if isinstance(ref, tuple):  # a sharded state: one part per host, kept a tuple
            return tuple(ray.get(list(ref), timeout=timeout_s))
        return ray.get(ref, timeout=timeout_s)

    def attach_checkpoints(self, coordinator: Any, slice_id: int) -> None:
        coordinator.set_template(self._up[slice_id].workers[0])
        if self._up[slice_id].per_host:  # sharded: the hosts write, not the writer actor
            coordinator.use_hosts(self._save_on_hosts)

    def _save_on_hosts(self, parts: tuple, path: str, keep: int, meta: dict, save_id: str) -> list:
        """Host i of one set-up slice writes the snapshot part of host i,
        with the other hosts of its slice (checkpoint/host_writes.py), on
        its checkpoint thread, beside training. One ref per host."""
        workers = self._up[min(self._up)].workers
        if not isinstance(parts, tuple) or len(parts) != len(workers):
            raise TypeError(f"a sharded snapshot is one part per host: expected a tuple of {len(workers)}, "
                            f"got {type(parts).__name__}")
        return [w.save_checkpoint.options(concurrency_group="checkpoint").remote(path, keep, meta, save_id, parts[h])
                for h, w in enumerate(workers)]

    def shutdown(self, keep: bool = False) -> None:
        """End the run's slices; `keep` (a completed run): those live are
        kept for this driver's next run where the run keeps workers
        (cluster/kept_workers.py)."""
        kept = [self._up.pop(s) for s in sorted(self._up)] if keep and self._keeps else []
        self.runner.drop_ahead()
        for s in list(self._up) + list(self._coming):
            self.retire(s)
        if isinstance(self.runner, GroupedRunner):
            self.runner.close()
        else:
            # A run that ends on an error leaves calls it gave up on (those
            # issued ahead of the failed step): read once done, so that Ray
            # prints no "Unhandled error" for them (dispatch/unread.py).
            self.runner.unread.sweep(timeout_s=2.0)
        if kept:
            self._slices.shutdown(keep=kept)
        else:
            self._slices.shutdown()
        if not isinstance(self.runner, GroupedRunner):
            # The workers retired, a call still kept has ended or will end
            # in an error: read those done, let go of the rest, so that the
            # driver holds no payload of the run (the soak counted them).
            self.runner.unread.sweep(timeout_s=2.0)
            self.runner.unread.release()


def _answers(workers: list, timeout_s: float = 2.0) -> bool:
    try:
        ray.get([ping_ref(w) for w in workers], timeout=timeout_s)
        return True
    except rex.RayError:
        return False
