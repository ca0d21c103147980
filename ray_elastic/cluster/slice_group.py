"""Ray behind one small interface (`SliceProvisioner`): reserve a slice,
bring its workers up, tear it down. The steps themselves are run by the
dispatch layer on the workers this hands out.

A slice is one placement group with one bundle per host (STRICT_SPREAD: a
host per node), and it is the failure domain: any host failing fails the
slice. The placement group outlives its workers: when a node dies Ray moves
the group to RESCHEDULING and places it again once a node with room joins,
so a replacement slice is simply new workers queued on the same group.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_elastic.cluster import kept_workers
from ray_elastic.config import CpuSlice, GpuSlice, SliceSpec, TpuSlice
from ray_elastic.program import TrainProgram
from ray_elastic.failures import process_state
from ray_elastic.worker.predecessors import Predecessor
from ray_elastic.worker.readiness import phase_seconds
from ray_elastic.worker.exchange_stats import LINK_ENV
from ray_elastic.worker.warm_pool import PRELOAD_ENV, hook_env, usable_by
from ray_elastic.worker.actor import SliceWorker

__all__ = ["LiveSlice", "Provisioning", "RaySlices", "SliceProvisioner", "WAITING_CALLS"]

# A sharded checkpoint's write runs on its own thread (host_writes.py);
# `control` calls (abort_waits, liveness pings) reach a worker whose other
# threads wait.
# Gradient calls run on a thread of their own (`compute`): the reduce and
# apply calls that wait for them hold threads of the default group while
# they wait, and a pipelined gradient call (its argument, the apply before
# it, still coming) lets later calls start first: sharing the default
# group, a worker hosting a reduction tree's nodes could fill every thread
# with calls waiting for its own gradients, which then never ran.
# A snapshot's copy into the object store runs on its own thread too
# (`snapshot`), beside the next step's gradients.
_RemoteWorker = ray.remote(concurrency_groups={"checkpoint": 1, "control": 1, "compute": 1, "snapshot": 1})(SliceWorker)

# The default group's threads: reduce and apply calls wait for their
# inputs on them (gradient calls, snapshots, aborts and liveness pings have
# threads of their own: the groups above). Calls from one caller reach a
# worker in the order they were issued, which their inputs respect (a
# call's inputs come from calls issued before it), so a few threads would
# do. Calls from two callers do not: with group leaders the driver issues
# the top of the tree and the snapshotting slices' applies, a leader its
# group's copy of the sum, applies and next step's subtrees, and a worker
# can get the calls waiting on a driver's call before that call. With 3
# threads a group's first slice held its copy, its apply and the next
# step's subtree, all waiting for the driver's top-of-tree call queued
# behind them: the step stalled to its deadline (a false "hung"). So there
# is a thread for every call that can wait on one worker at once: two
# steps' (the one applied and the next, issued ahead), each at most one
# apply, one copy and one call per level of the tree while a level has no
# more calls than slices (fan-in 8: 4 levels up to 4096 slices), 2 x 6 =
# 12, and a margin. A waiting thread holds no CPU.
WAITING_CALLS = 16

# glibc's allocator, for every worker process (set at its start; a value
# in the driver's environment wins). A worker's calls run on several
# threads, each with its own malloc arena, and glibc raises its mmap
# threshold after large frees, so the buffers of every step (XLA's, the
# gradient sums, host copies) stayed allocated in each arena at their high-
# water mark. Allocations of 1 MiB and more go straight to mmap and back to
# the system on free, and two arenas serve all threads: a worker holding
# 145 MiB of a sharded state peaked at ~660 MiB of private memory instead
# of ~1030 MiB (`python -m bench sharded`), with no slower steps.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_ARENA_MAX": "2"}


def worker_env(spec: SliceSpec) -> dict[str, str]:
    # A simulated cross-slice link (benchmarks) set in the driver's environment reaches the workers.
    link = {LINK_ENV: os.environ[LINK_ENV]} if os.environ.get(LINK_ENV) else {}
    return {**{k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()}, **spec.worker_env(), **link}


@dataclasses.dataclass
class LiveSlice:
    slice_id: int
    workers: list  # actor handles, host order
    infos: list[dict]  # pid, node_id, ip per host
    ready_at: float = 0.0
    # Seconds per readiness phase (host 0's, the slowest host's where they
    # differ: the largest per phase), plus `report`: the last worker's
    # set-up done to the driver seeing it.
    phases: dict = dataclasses.field(default_factory=dict)
    # A sharded layout: every host holds its own blocks of the state, and
    # sends, snapshots and loads them itself (step_runner.senders).
    per_host: bool = False
    # Processes given up on that its hosts waited to see exit (_gone).
    predecessors: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Provisioning:
    slice_id: int
    workers: list
    info_refs: list
    setup_refs: list
    started_at: float


class SliceProvisioner(Protocol):
    """What the Ray backend asks of whatever provisions slices: RaySlices,
    or a drop-in such as the scale benchmark's simulated slices."""

    def __init__(self, spec: SliceSpec, program_factory: Callable[[], TrainProgram], seed: int, num_shards: int,
                 run_name: str, compile_cache_dir: str = "", warm_workers: int = 0, state_check_every: int = 0,
                 grad_check_every: int = 0, final_step: int = 0, keep_workers: bool = False): ...

    def start(self, slice_id: int) -> Provisioning:
        """Queue a slice's workers (on its placement group, made if new)."""

    def poll(self, p: Provisioning) -> Optional[LiveSlice]:
        """The slice once every host is set up; None while some are not."""

    def kill(self, workers: list, infos: Sequence[dict] = ()) -> None:
        """End the workers; `infos` (pid, started, node_id per host, where
        known) name their processes, which the slice's next workers on
        those nodes wait to see exit (worker/predecessors.py)."""

    def abandon_group(self, slice_id: int, evict: tuple = ()) -> None:
        """Leave the slice's placement group (a silent node holds a bundle);
        the next start makes a new one. `evict`: nodes no group of the run
        may use again (their chips computed wrong numbers)."""

    def reap_abandoned(self) -> None:
        """Remove abandoned groups whose nodes Ray has declared dead."""

    def group_nodes(self, slice_id: int) -> tuple:
        """The nodes the slice's placement group holds bundles on (none
        where it has no group, or none placed yet)."""

    def placement_group_state(self, slice_id: int) -> str: ...

    def shutdown(self, keep: Sequence[LiveSlice] = ()) -> None:
        """Remove the run's groups and workers; with `keep_workers`, park
        the `keep` slices (a completed run's) for the next run instead."""


class RaySlices:
    """Creates and removes the slices of one run (a SliceProvisioner)."""

    def __init__(
        self,
        spec: SliceSpec,
        program_factory: Callable[[], TrainProgram],
        seed: int,
        num_shards: int,
        run_name: str,
        compile_cache_dir: str = "",
        warm_workers: int = 0,
        state_check_every: int = 0,
        grad_check_every: int = 0,
        final_step: int = 0,
        keep_workers: bool = False,
    ):
        self.spec = spec
        self._warm = warm_workers
        self._checks = (state_check_every, grad_check_every, final_step)
        # The warm pool's set-up hook is part of the workers' runtime
        # environment, so the processes it keeps match the next replacement.
        self._env = {**worker_env(spec),
                     **(hook_env(program_factory, program_module=isinstance(spec, CpuSlice)) if warm_workers else {})}
        self._factory = program_factory
        self._seed = seed
        self._num_shards = num_shards
        self._cache_dir = compile_cache_dir
        self._run_name = run_name
        self._pgs: dict[int, Any] = {}
        self._tpu_handles: dict[int, Any] = {}
        self._generation: dict[int, int] = {}  # placement groups made per slice so far
        self._abandoned: list = []  # groups left on a silent node, removed once Ray declares it dead
        self._reaped_at = 0.0
        self._evicted: set[str] = set()  # node ids no new group may use
        self._predecessors: list[Predecessor] = []  # processes given up on: new workers wait for them to exit
        self._unread: list = []  # the watchers' replies to `end`, held so that Ray does not report them
        self._stale_ended = False  # the warm processes of this driver's earlier runs that this one cannot use
        # Slices kept from this driver's last run serve this one where
        # everything their workers were built from is the same, whether
        # this run keeps its own or not (kept_workers.py).
        self._keep = keep_workers
        # The warm pool's part of the environment names the program's
        # module for new processes to import ahead: of no matter to a
        # started one, which imports this run's program as it unpickles it.
        self._process_key = kept_workers.process_key(program_factory, spec, worker_env(spec), compile_cache_dir)
        self._keep_key = kept_workers.kept_key(program_factory, self._process_key, seed, num_shards)

    # -- placement groups -------------------------------------------------

    def _placement_group(self, slice_id: int) -> PlacementGroup:
        pg = self._pgs.get(slice_id)
        if pg is not None:
            return pg
        generation = self._generation.get(slice_id, 0)
        name = f"{self._run_name}-slice{slice_id}" + (f"-g{generation}" if generation else "")
        if isinstance(self.spec, TpuSlice):
            from ray.util.tpu import SlicePlacementGroup

            handle = SlicePlacementGroup(
                topology=self.spec.topology,
                accelerator_version=self.spec.accelerator_version,
                chips_per_vm=self.spec.chips_per_vm,
                strategy="STRICT_SPREAD",
                name=name,
            )
            self._tpu_handles[slice_id] = handle
            pg = handle.placement_group
        else:
            bundles = self.spec.bundles()
            # Ray labels every node with its id: a selector keeps the group
            # off the evicted ones. (A TPU slice's group is made by
            # ray.util.tpu, which takes no selector.)
            away = ([{"ray.io/node-id": f"!in({','.join(sorted(self._evicted))})"}] * len(bundles)
                    if self._evicted else None)
            pg = placement_group(bundles, strategy="STRICT_SPREAD", name=name, bundle_label_selector=away)
        self._pgs[slice_id] = pg
        return pg

    def _actor_options(self, pg: PlacementGroup, host: int) -> dict:
        bundle = dict(self.spec.bundles()[host])
        opts: dict[str, Any] = {
            "num_cpus": bundle.pop("CPU", 0),
            "max_restarts": 0,
            # Reduce and apply calls wait for their inputs on threads of
            # this group (WAITING_CALLS).
            "max_concurrency": WAITING_CALLS,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=host
            ),
            "runtime_env": {"env_vars": self._env},
        }
        if "GPU" in bundle:
            opts["num_gpus"] = bundle.pop("GPU")
        if bundle:
            opts["resources"] = bundle
        return opts

    # -- workers ----------------------------------------------------------

    def start(self, slice_id: int) -> Provisioning:
        """Queue a slice's workers; they start once its group is placed."""
        if not self._stale_ended:
            self._stale_ended = True
            self._end_stale_warm()
        kept = self._kept(slice_id)
        if kept is not None:
            return kept
        pg = self._placement_group(slice_id)
        hosts = len(self.spec.bundles())
        created_at = time.time()  # wall clock: the workers time their phases from it
        workers = [
            _RemoteWorker.options(**self._actor_options(pg, h)).remote(
                slice_id, h, hosts, self._factory, self._seed, self._num_shards, created_at=created_at
            )
            for h in range(hosts)
        ]
        coordinator = workers[0].coordinator_address.remote() if hosts > 1 else None
        return Provisioning(
            slice_id=slice_id,
            workers=workers,
            info_refs=[w.info.remote() for w in workers],
            setup_refs=[w.setup.remote(coordinator, self._cache_dir, self._warm, *self._checks,
                                       predecessors=tuple(self._predecessors)) for w in workers],
            started_at=time.monotonic(),
        )

    def _kept(self, slice_id: int) -> Optional[Provisioning]:
        """The slice's workers kept from this driver's last run, renewed
        for this one; None where there are none (its placement group is
        then made or reused: every slice still kept is released first, as
        its resources may be the ones needed)."""
        before = kept_workers.held()
        if not before:
            return None
        # A slice this run started before (a replacement) takes none: the
        # kept ones left are of no use to it, and may hold the node it needs.
        kept = None if slice_id in self._pgs else kept_workers.take(self._process_key, self._keep_key, slice_id)
        if kept is None:
            kept_workers.release_workers()
        left = kept_workers.held()
        for gone in before:  # released: new workers on their nodes wait for their processes to exit (an accelerator's memory)
            if gone is not kept and not any(gone is k for k in left) and gone.session == kept_workers.session():
                self.kill(gone.workers, gone.infos)
        if kept is None:
            return None
        self._pgs[slice_id] = kept.placement_group
        if kept.tpu_handle is not None:
            self._tpu_handles[slice_id] = kept.tpu_handle
        # A kept multi-host slice keeps its JAX system: no coordinator to
        # start. Its workers start the run after any call left from the
        # last ("compute" group): as they are, or with this run's program.
        if kept.key == self._keep_key:
            setup_refs = [w.renew.options(concurrency_group="compute").remote(slice_id, self._warm, *self._checks)
                          for w in kept.workers]
        else:
            setup_refs = [w.reprogram.options(concurrency_group="compute").remote(
                slice_id, self._factory, self._seed, self._num_shards, self._cache_dir, self._warm, *self._checks)
                for w in kept.workers]
        return Provisioning(slice_id=slice_id, workers=kept.workers, info_refs=[w.info.remote() for w in kept.workers],
                            setup_refs=setup_refs, started_at=time.monotonic())

    @staticmethod
    def poll(p: Provisioning) -> Optional[LiveSlice]:
        """The slice once every worker is set up; None while still coming.

        Raises what a worker raised if its set-up failed.
        """
        refs = p.info_refs + p.setup_refs
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(done) < len(refs):
            for ref in done:  # surface a failed worker early
                ray.get(ref)
            return None
        infos = ray.get(p.info_refs)
        setups = ray.get(p.setup_refs)
        per_host = any(bool((r or {}).get("per_host")) for r in setups)
        return LiveSlice(p.slice_id, p.workers, infos, ready_at=time.monotonic(), phases=_phases(setups),
                         predecessors=_gone(setups),
                         per_host=per_host)

    def kill(self, workers: list, infos: Sequence[dict] = ()) -> None:
        gone = [Predecessor(i["pid"], i["started"], i["node_id"]) for i in infos if "started" in i]
        self._predecessors.extend(gone)
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone
                pass
        for p in gone:  # a stopped or GIL-bound process never makes the graceful exit Ray's kill waits for
            try:
                self._unread.append(process_state.watcher_for(p.node_id).end.remote(p.pid, p.started))
            except Exception:  # the node is gone: so is the process
                pass
        self._read_done()

    def _end_stale_warm(self) -> None:
        """Ask every node that has a watcher (every node this driver's
        slices ran on) to end the idle warm processes of this job that
        this run's workers cannot start in (warm_pool.usable_by); the
        replies are read like the watchers' others."""
        job = ray.get_runtime_context().get_job_id()
        keep = usable_by(self._env)
        for node in ray.nodes():
            watcher = process_state.existing_watcher(node["NodeID"]) if node["Alive"] else None
            if watcher is not None:
                self._unread.append(watcher.end_idle.remote(job, PRELOAD_ENV, keep))

    def _read_done(self) -> None:
        """Read the watchers' replies that came (an error too: its node
        went, and with it the process), so that Ray reports none."""
        done, self._unread = ray.wait(self._unread, num_returns=len(self._unread), timeout=0) if self._unread else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception:
                pass

    def abandon_group(self, slice_id: int, evict: tuple = ()) -> None:
        """Give the slice a new placement group on its next start (away
        from the `evict` nodes, as every group of the run after it). The old
        one holds a bundle on a node that does not answer (frozen, cut
        off), which Ray frees only once its health checks declare the node
        dead; removing the group now could let Ray place the new one on
        that node. It is parked and removed once Ray reschedules it (the
        node declared dead), so it never competes with the slices for new
        nodes for long."""
        self._evicted.update(evict)
        pg = self._pgs.pop(slice_id, None)
        self._generation[slice_id] = self._generation.get(slice_id, 0) + 1
        handle = self._tpu_handles.pop(slice_id, None)
        if pg is not None and evict:  # a live node: freed now, the selector keeps new groups off it
            _remove(pg, handle)
        elif pg is not None:
            self._abandoned.append((pg, handle))

    def reap_abandoned(self, every_s: float = 1.0) -> None:
        """Remove parked groups whose silent node Ray has declared dead."""
        if not self._abandoned or time.monotonic() - self._reaped_at < every_s:
            return
        self._reaped_at = time.monotonic()
        keep = []
        for pg, handle in self._abandoned:
            try:
                state = ray.util.placement_group_table(pg).get("state", "")
            except Exception:
                state = ""
            if state in ("CREATED", "PREPARED"):
                keep.append((pg, handle))  # its node still counts as alive
            else:
                _remove(pg, handle)
        self._abandoned = keep

    def group_nodes(self, slice_id: int) -> tuple:
        pg = self._pgs.get(slice_id)
        if pg is None:
            return ()
        try:
            placed = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        except Exception:  # the GCS busy or the group gone: nothing known
            return ()
        # A bundle not placed has the nil node id (all 0xff) or none.
        return tuple(sorted({n for n in placed.values() if n and set(n) != {"f"}}))

    def placement_group_state(self, slice_id: int) -> str:
        pg = self._pgs.get(slice_id)
        if pg is None:
            return "NONE"
        table = ray.util.placement_group_table(pg)
        return table.get("state", "UNKNOWN")

    def shutdown(self, keep: Sequence[LiveSlice] = ()) -> None:
        self._read_done()
        for pg, handle in self._abandoned:
            _remove(pg, handle)
        self._abandoned = []
        for live in keep if self._keep else ():
            if live.slice_id in self._pgs and _reusable(live.workers):
                kept_workers.park(kept_workers.KeptSlice(
                    self._keep_key, self._process_key, live.slice_id, self._pgs.pop(live.slice_id),
                    self._tpu_handles.pop(live.slice_id, None), list(live.workers), list(live.infos),
                    kept_workers.session()))
        for slice_id, pg in self._pgs.items():
            _remove(pg, self._tpu_handles.get(slice_id))
        self._pgs.clear()
        self._tpu_handles.clear()


def _reusable(workers: list, timeout_s: float = 2.0) -> bool:
    """Whether every worker of a slice can serve another run (no fault
    injected, no preemption notice: SliceWorker.reusable)."""
    try:
        return all(ray.get([w.reusable.remote() for w in workers], timeout=timeout_s))
    except Exception:
        return False


def _phases(setups: list) -> dict:
    """The slice's readiness phases from its hosts' set-up results: per
    phase the largest over the hosts, and `report` (the last host done to
    now, on the wall clock). A slice whose hosts started some in warm
    processes and some in new ones carries the phases of both kinds
    (`warm_process`; `process_start`, `actor_load`, `args_load`)."""
    out: dict = {}
    for r in setups:
        for k, v in (r or {}).get("phases", {}).items():
            out[k] = max(out.get(k, v), v)
    done = [r["ready_at"] for r in setups if r and "ready_at" in r]
    if done:
        out["report"] = phase_seconds(max(done), time.time())  # the worker's clock, then the driver's
    return out


def _gone(setups: list) -> dict:
    """The predecessors the slice's hosts waited for: pids, those killed,
    and the longest wait; empty where there were none."""
    found = [r["predecessors"] for r in setups if r and r.get("predecessors") is not None]
    pids = sorted(p for g in found for p in g.pids)
    if not pids:
        return {}
    return {"pids": pids, "killed": sorted(p for g in found for p in g.killed),
            "waited_s": max(g.waited_s for g in found)}


def _remove(pg, tpu_handle) -> None:
    try:
        remove_placement_group(pg)
    except Exception:
        pass
    if tpu_handle is not None:
        try:
            tpu_handle.shutdown()
        except Exception:
            pass
