"""Frozen, validated settings. Every check runs when the object is built, so a
bad setting fails before any cluster resource is reserved, and each error
names the setting to change. docs/configuration.md lists every field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional, Union

from ray_elastic.errors import ConfigError
from ray_elastic.paths import work_path

__all__ = ["CpuSlice", "GpuSlice", "TpuSlice", "ElasticConfig", "KEEP_WORKERS_ENV", "SliceSpec"]

POLICIES = ("pause", "resize")
BATCH_MODES = ("accumulate", "shrink")
EXCHANGES = ("reduce_scatter", "direct")
EXCHANGE_DTYPES = (None, "bfloat16")
# "1" in the driver's environment: ElasticConfig.keep_workers defaults to True.
KEEP_WORKERS_ENV = "RAY_ELASTIC_KEEP_WORKERS"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(setting: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(setting, f"must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class CpuSlice:
    """A slice of CPU hosts: used by the tests, the demo, and CPU clusters."""

    hosts: int = 1
    cpus_per_host: int = 1
    devices_per_host: int = 1  # XLA host-platform devices per process

    def __post_init__(self):
        _positive_int("slice.hosts", self.hosts)
        _positive_int("slice.cpus_per_host", self.cpus_per_host)
        _positive_int("slice.devices_per_host", self.devices_per_host)

    @property
    def devices(self) -> int:
        """JAX devices in one slice: hosts x devices per host."""
        return self.hosts * self.devices_per_host

    def bundles(self) -> list[dict[str, float]]:
        return [{"CPU": float(self.cpus_per_host)} for _ in range(self.hosts)]

    def worker_env(self) -> dict[str, str]:
        return {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={self.devices_per_host}",
        }


@dataclasses.dataclass(frozen=True)
class GpuSlice:
    """A slice of GPU hosts; each worker sees its host's GPUs.

    gpus_per_host: whole GPUs per host (1 and up), or a share of one GPU
    (above 0, below 1: Ray's fractional GPUs), for slices that share a GPU
    (a notebook on a one-GPU head node, a test): each such worker's JAX
    sees the one GPU as one device and preallocates only its share of the
    GPU's memory (90% of it, leaving room for the CUDA context of each
    process), through XLA_PYTHON_CLIENT_MEM_FRACTION. Two slices at 0.5 on
    one GPU each take 45% of its memory.
    """

    hosts: int = 1
    gpus_per_host: Union[int, float] = 1
    cpus_per_host: int = 1

    def __post_init__(self):
        _positive_int("slice.hosts", self.hosts)
        g = self.gpus_per_host
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 < g < 1 or (g >= 1 and g == int(g))):
            raise ConfigError("slice.gpus_per_host", f"must be a whole number of GPUs (1 and up) or a share of "
                              f"one GPU (above 0, below 1), got {g!r}")
        _positive_int("slice.cpus_per_host", self.cpus_per_host)

    @property
    def shared(self) -> bool:
        """Each worker has a share of one GPU, beside other workers."""
        return self.gpus_per_host < 1

    @property
    def devices(self) -> int:
        """JAX devices in one slice: hosts x GPUs per host (one for a share of a GPU)."""
        return self.hosts * (1 if self.shared else int(self.gpus_per_host))

    def bundles(self) -> list[dict[str, float]]:
        one = {"CPU": float(self.cpus_per_host), "GPU": float(self.gpus_per_host)}
        return [dict(one) for _ in range(self.hosts)]

    def worker_env(self) -> dict[str, str]:
        env = {"JAX_PLATFORMS": "cuda"}
        if self.shared:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 * self.gpus_per_host:.3f}"
        return env


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU slice, reserved with `ray.util.tpu.SlicePlacementGroup`.

    Hosts and chips per host come from Ray's own TPU topology tables, never
    re-derived here.
    """

    topology: str = "2x2"
    accelerator_version: str = "v6e"
    chips_per_vm: Optional[int] = None

    def __post_init__(self):
        from ray.util import tpu

        from ray._private.accelerators import TPUAcceleratorManager

        for name in ("topology", "accelerator_version"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"slice.{name}", f"must be a string, got {getattr(self, name)!r}")
        try:
            version = tpu.get_tpu_version_from_type(self.accelerator_version.strip())
        except Exception as exc:  # ray raises ValueError for unknown types
            raise ConfigError("slice.accelerator_version", str(exc)) from None
        if not TPUAcceleratorManager.is_valid_tpu_accelerator_topology(
            tpu_accelerator_version=version, tpu_topology=self.topology.strip().lower()
        ):
            raise ConfigError(
                "slice.topology",
                f"{self.topology!r} is not a valid topology for TPU {version}",
            )
        if self.chips_per_vm is not None:
            _positive_int("slice.chips_per_vm", self.chips_per_vm)
        try:
            self._worker_resources
        except ValueError as exc:
            raise ConfigError("slice.chips_per_vm", str(exc)) from None

    @property
    def _worker_resources(self) -> tuple[int, dict[str, float]]:
        from ray.util import tpu

        return tpu.get_tpu_worker_resources(
            topology=self.topology.strip().lower(),
            accelerator_type=self.accelerator_version.strip(),
            chips_per_vm=self.chips_per_vm,
        )

    @property
    def hosts(self) -> int:
        return self._worker_resources[0]

    @property
    def devices(self) -> int:
        """JAX devices in one slice: its TPU chips, from Ray's tables."""
        n, resources = self._worker_resources
        return n * int(resources.get("TPU", 0))

    def bundles(self) -> list[dict[str, float]]:
        n, resources = self._worker_resources
        return [dict(resources) for _ in range(n)]

    def worker_env(self) -> dict[str, str]:
        return {"JAX_PLATFORMS": "tpu"}


SliceSpec = Union[CpuSlice, GpuSlice, TpuSlice]


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """How a run survives failures.

    policy: "pause" waits for every slice to come back (pause and resume);
        "resize" trains on with at least `min_slices` (replica resize).
    min_slices: for "resize", 1 .. num_slices - 1 (default 1). For "pause"
        it is num_slices and may be left unset.
    timeout_s: how long to wait for replacement slices before failing.
    max_retries: failures the whole run may absorb.
    snapshot_every: steps between in-memory snapshots while one slice is
        live. 1 (the default) keeps the work redone after a failure to the
        step in flight; 0 turns snapshots off.
    snapshot_every_replicated: the same while two or more slices are live.
        Their memory already holds the state in as many failure domains, so
        losing any one node or slice still redoes only the step in flight;
        snapshots then guard only against losing every slice at once.
        "auto" (the default) takes the Young-Daly interval from a
        snapshot's measured cost and `all_slices_mtbf_s`
        (control/snapshot_schedule.py): as often as they pay for
        themselves. An int fixes the interval.
    all_slices_mtbf_s: the mean time between losses of every slice at
        once that "auto" plans for (default 86400: one a day); each such
        loss seen in the run shortens the estimate. A loss of every slice
        redoes at most the interval this gives (the run's report says it).
    batch_on_resize: "accumulate" (default) keeps the global batch constant
        by gradient accumulation on the survivors, so the optimisation is the
        one a failure-free run does; "shrink" drops the lost slices' shards.
    step_deadline_floor_s / step_deadline_factor: a step that takes longer
        than max(floor, factor * median step time) marks its slice hung.
    first_step_deadline_s: the same for a (re)start's first step (with the compile).
    heartbeat_timeout_s: while a step runs, every host of a slice still
        computing is pinged on a thread of its own (a healthy worker answers
        however long its step); one that leaves a ping unanswered this long
        is hung (a stopped process, a frozen node), found in about this
        long instead of at the step deadline (failures/heartbeats.py); in a
        new process's first step, while it compiles, 15 s or this,
        whichever is longer. 0 turns heartbeats off.
    state_check_every: every this many steps each device fingerprints the
        state it holds and the controller compares the replicas (default
        10; 1 checks every step: a thread reads the state while the next
        step's gradients compute, and the next apply reports it; a slice
        of several hosts reads it within the apply). A slice whose state
        differs from the others' is evicted as corrupted and the run rolls
        back to the newest snapshot the replicas agreed on
        (control/integrity.py, docs/integrity.md). 0 turns the checks off.
    grad_check_every: every this many steps one shard's gradient is
        computed again by the next one or two live slices (rotating) and
        the fingerprints compared, which catches a slice whose gradients
        are wrong (they leave the replicas equal). Default 50; 0: off.
    straggler_factor / straggler_steps / straggler_min_s: a slice whose
        gradients take more than factor times the other slices' median per
        shard, for that many steps in a row and that many seconds of its
        gradient calls (a lasting slowdown, not a host busy for a moment),
        is a straggler: with a ready spare it is swapped out at a step
        boundary (no step lost; its node not used again); under resize
        without one it is taken out when the others alone are faster (n /
        (n - 1) below its slowdown); else it is reported (event, metric,
        progress line). Defaults 1.3, 10 and 10 s; a factor of 0: off.
    spare_slices: standby slices reserved, started and compiled ahead of
        time (they hold no training state): on a failure a spare takes the
        failed slice's place at the next step boundary, and the failed
        slice's replacement becomes the new spare (their hardware all run).
    batch_shards: the shards of each step's global batch (default
        num_slices, one per slice). Set it to the original run's value to
        resume a checkpoint on another number of slices with the same data
        and optimisation (each slice then computes several shards).
    compile_cache_dir: XLA's persistent compilation cache on each worker
        host; a replacement worker then loads the step program instead of
        compiling it (about 3.7 s to 0.9 s for the example model here).
        Hosts 1 and up of a CPU slice, which JAX's cache does not serve,
        keep their own compiled functions in it (worker/host_cache.py).
        "" turns it off.
    warm_workers: 1 keeps an idle worker process beside each worker, with
        Ray up and JAX, Optax and (CPU slices) the program's module
        imported, for a replacement on that host to start in: it is ready
        ~4 s sooner here (`python -m bench ready`). Costs one idle process
        per worker (224 MB resident here; a run ends those it cannot use).
        0 turns it off (worker/warm_pool.py). Where the job has its own
        worker_process_setup_hook, the process starts but imports nothing.
    keep_workers: False (the default): a run's slices end with it. True: a
        run that completes keeps its slices (placement groups, processes,
        compiled steps) for this driver's next `fit` of the slice shape:
        one of the same program, seed and shard count only makes its step-0
        state anew, another program builds and compiles its own in the
        kept processes; both compute what new workers would, bitwise. Kept
        slices hold their resources until this driver starts a slice that
        cannot use them (another shape, edited code, a replacement),
        `ray_elastic.release_workers()` or the driver's exit
        (cluster/kept_workers.py). For notebooks, sweeps and test suites;
        RAY_ELASTIC_KEEP_WORKERS=1 in the driver's environment: True.
    slices_per_leader: 0 (the default): the driver calls every slice
        itself, two calls per slice per step plus the reduction tree. N:
        one group leader actor per about N slices, beside the driver, makes
        its group's calls, and the driver makes one per leader per step
        (dispatch/grouped_runner.py). For hundreds of slices: at 1024 slices the
        driver's own calls take about 1.4 s of CPU per step, and through
        leaders of 32 slices about 0.1 s (`python -m bench scale --floor`).
        Same results, bitwise; replicated layouts and
        batch_on_resize="accumulate" only. Costs a process per leader.
        Leaders hand gradients on directly, whatever `exchange` says.
    exchange: how the slices sum their gradients. "reduce_scatter" (the
        default): a reduce-scatter and an all-gather, a host moving about
        2(n-1)/n of its gradient per step, as a ring all-reduce does.
        "direct": every apply takes every slice's gradients (n-1 per host).
        Same results, bitwise, at one shard per slice (docs/concepts.md).
    exchange_dtype: None (the default): gradients cross slices in their
        own dtype. "bfloat16" halves the bytes; the owners sum in float32
        (docs/benchmarks.md measures the loss's move).
    one_slice_program: "auto", "one", "update_apart" (docs/configuration.md).
    enable_diloco, diloco_sync_period, diloco_outer_lr,
        diloco_outer_momentum: DiLoCo, by MaxText's names and defaults
        (False, 36, 0.3, 0.9): each slice a replica training alone on its
        own shards, synchronized every diloco_sync_period steps by an outer
        Nesterov step over the replicas' mean delta (docs/diloco.md). The
        checks that compare replicas and the per-step snapshots are off.
    enable_streaming_diloco, num_diloco_fragments,
        num_communication_overlapping_steps, communication_overlapping_alpha:
        Streaming DiLoCo, by MaxText's names (False, 4, 0, 0.0): the params
        cut into num_diloco_fragments fragments of about equal bytes (whole
        leaves, in the tree's order), one fragment synchronized every
        round(diloco_sync_period / num_diloco_fragments) steps in turn; the
        new global fragment reaches the replicas
        num_communication_overlapping_steps steps later, mixed as
        alpha * inner + (1 - alpha) * global (docs/diloco.md).
    """

    num_slices: int = 2
    slice: SliceSpec = dataclasses.field(default_factory=CpuSlice)
    policy: str = "pause"
    min_slices: Optional[int] = None
    timeout_s: float = 300.0
    max_retries: int = 10
    snapshot_every: int = 1
    snapshot_every_replicated: Union[int, str] = "auto"
    all_slices_mtbf_s: float = 86400.0
    batch_on_resize: str = "accumulate"
    step_deadline_floor_s: float = 10.0
    step_deadline_factor: float = 10.0
    heartbeat_timeout_s: float = 1.0
    state_check_every: int = 10
    grad_check_every: int = 50
    straggler_factor: float = 1.3
    straggler_steps: int = 10
    straggler_min_s: float = 10.0
    first_step_deadline_s: float = 120.0
    compile_cache_dir: str = work_path("xla-cache")
    seed: int = 0
    spare_slices: int = 0
    warm_workers: int = 1
    keep_workers: bool = dataclasses.field(default_factory=lambda: os.environ.get(KEEP_WORKERS_ENV, "") == "1")
    batch_shards: Optional[int] = None
    slices_per_leader: int = 0
    exchange: str = "reduce_scatter"
    exchange_dtype: Optional[str] = None
    one_slice_program: str = "auto"
    enable_diloco: bool = False
    diloco_sync_period: int = 36
    diloco_outer_lr: float = 0.3
    diloco_outer_momentum: float = 0.9
    enable_streaming_diloco: bool = False
    num_diloco_fragments: int = 4
    num_communication_overlapping_steps: int = 0
    communication_overlapping_alpha: float = 0.0

    def __post_init__(self):
        _positive_int("num_slices", self.num_slices)
        self._check_diloco()
        if not isinstance(self.slice, (CpuSlice, GpuSlice, TpuSlice)):
            raise ConfigError("slice", f"must be a CpuSlice, GpuSlice or TpuSlice, got {self.slice!r}")
        if self.policy not in POLICIES:
            raise ConfigError(
                "policy", f"unknown policy {self.policy!r}; use one of {POLICIES}"
            )
        if self.policy == "pause":
            if self.min_slices not in (None, self.num_slices):
                raise ConfigError(
                    "min_slices",
                    f"policy 'pause' needs all {self.num_slices} slices; "
                    f"got min_slices={self.min_slices}. Use policy='resize' "
                    "to train on fewer slices.",
                )
        else:
            m = 1 if self.min_slices is None else self.min_slices
            if not _count(m) or m < 1 or m > self.num_slices:
                raise ConfigError(
                    "min_slices",
                    f"must be between 1 and num_slices={self.num_slices}, got {m!r}",
                )
            if self.num_slices == 1:
                raise ConfigError(
                    "policy",
                    "'resize' needs num_slices >= 2; with one slice use 'pause'",
                )
        if not _number(self.timeout_s) or self.timeout_s < 0:
            raise ConfigError("timeout_s", f"must be >= 0 seconds, got {self.timeout_s!r}")
        if not _count(self.max_retries) or self.max_retries < 0:
            raise ConfigError("max_retries", f"must be >= 0, got {self.max_retries!r}")
        if self.snapshot_every_replicated != "auto" and (
                not _count(self.snapshot_every_replicated) or self.snapshot_every_replicated < 1):
            raise ConfigError(
                "snapshot_every_replicated", f"must be \"auto\" or >= 1, got {self.snapshot_every_replicated!r}"
            )
        if not _number(self.all_slices_mtbf_s) or self.all_slices_mtbf_s <= 0:
            raise ConfigError("all_slices_mtbf_s", f"must be > 0 seconds, got {self.all_slices_mtbf_s!r}")
        if not _count(self.snapshot_every) or self.snapshot_every < 0:
            raise ConfigError(
                "snapshot_every", f"must be >= 0 (0 turns snapshots off), got {self.snapshot_every!r}"
            )
        if self.batch_on_resize not in BATCH_MODES:
            raise ConfigError(
                "batch_on_resize",
                f"unknown mode {self.batch_on_resize!r}; use one of {BATCH_MODES}",
            )
        if self.batch_shards is not None:
            _positive_int("batch_shards", self.batch_shards)
            if self.batch_on_resize == "shrink" and self.batch_shards != self.num_slices:
                raise ConfigError("batch_shards", f"batch_on_resize='shrink' gives each slice its own shard, so "
                                  f"batch_shards must equal num_slices={self.num_slices}; got {self.batch_shards}. "
                                  "Use batch_on_resize='accumulate' (the default) or leave batch_shards unset")
        if not _count(self.warm_workers) or self.warm_workers not in (0, 1):
            # One per host is what a replacement takes, and each worker that
            # takes one asks for the next: more would only pile up.
            raise ConfigError("warm_workers", f"must be 1 (the warm pool on) or 0 (off), got {self.warm_workers!r}")
        if not isinstance(self.keep_workers, bool):
            raise ConfigError("keep_workers", f"must be True or False, got {self.keep_workers!r}")
        if not _count(self.spare_slices) or self.spare_slices < 0:
            raise ConfigError("spare_slices", f"must be an integer >= 0, got {self.spare_slices!r}")
        if not _count(self.slices_per_leader) or self.slices_per_leader < 0 or self.slices_per_leader == 1:
            raise ConfigError("slices_per_leader", f"must be 0 (no group leaders) or at least 2, "
                              f"got {self.slices_per_leader!r}")
        if self.slices_per_leader:
            if self.slices_per_leader >= self.num_slices:
                raise ConfigError("slices_per_leader", f"{self.slices_per_leader} slices per leader with "
                                  f"num_slices={self.num_slices} makes one leader, which only adds a hop: "
                                  "set 0, or fewer slices per leader")
            if self.batch_on_resize != "accumulate":
                raise ConfigError("slices_per_leader", "group leaders need batch_on_resize='accumulate' "
                                  "(each group computes its own range of shards); set 0 to use 'shrink'")
        if self.exchange not in EXCHANGES:
            raise ConfigError("exchange", f"unknown exchange {self.exchange!r}; use one of {EXCHANGES}")
        if self.one_slice_program not in ("auto", "one", "update_apart"):
            raise ConfigError("one_slice_program", f"use 'auto', 'one' or 'update_apart', not {self.one_slice_program!r}")
        if self.exchange_dtype not in EXCHANGE_DTYPES:
            raise ConfigError("exchange_dtype", f"must be one of {EXCHANGE_DTYPES}, got {self.exchange_dtype!r}")
        if self.exchange_dtype is not None and (self.exchange != "reduce_scatter" or self.slices_per_leader):
            raise ConfigError("exchange_dtype", "a narrower dtype on the wire needs exchange='reduce_scatter' "
                              "and no group leaders; set exchange_dtype=None")
        for name in ("step_deadline_floor_s", "step_deadline_factor", "first_step_deadline_s"):
            if not _number(getattr(self, name)) or getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)!r}")
        if not _number(self.heartbeat_timeout_s) or self.heartbeat_timeout_s < 0:
            raise ConfigError("heartbeat_timeout_s", f"must be >= 0 seconds (0 turns heartbeats off), "
                              f"got {self.heartbeat_timeout_s!r}")
        if not _number(self.straggler_factor) or not (self.straggler_factor == 0 or self.straggler_factor > 1):
            raise ConfigError("straggler_factor", f"must be > 1 (times the other slices' time) or 0 (off), "
                              f"got {self.straggler_factor!r}")
        if not _count(self.straggler_steps) or self.straggler_steps < 1:
            raise ConfigError("straggler_steps", f"must be an integer >= 1, got {self.straggler_steps!r}")
        if not _number(self.straggler_min_s) or self.straggler_min_s < 0:
            raise ConfigError("straggler_min_s", f"must be >= 0 seconds, got {self.straggler_min_s!r}")
        for name in ("state_check_every", "grad_check_every"):
            if not _count(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(name, f"must be an integer >= 0 steps (0 turns the checks off), "
                                  f"got {getattr(self, name)!r}")

    def _check_diloco(self) -> None:
        if not isinstance(self.enable_diloco, bool):
            raise ConfigError("enable_diloco", f"must be True or False, got {self.enable_diloco!r}")
        _positive_int("diloco_sync_period", self.diloco_sync_period)
        if not _number(self.diloco_outer_lr) or self.diloco_outer_lr <= 0:
            raise ConfigError("diloco_outer_lr", f"must be > 0, got {self.diloco_outer_lr!r}")
        if not _number(self.diloco_outer_momentum) or not 0 <= self.diloco_outer_momentum < 1:
            raise ConfigError("diloco_outer_momentum", f"must be in [0, 1), got {self.diloco_outer_momentum!r}")
        self._check_streaming()
        if not self.enable_diloco:
            return
        if self.slices_per_leader or self.exchange != "reduce_scatter" or self.exchange_dtype is not None:
            raise ConfigError("enable_diloco", "DiLoCo synchronizes through the reduce-scatter exchange: set "
                              "slices_per_leader=0, exchange='reduce_scatter' and exchange_dtype=None")
        if self.shards % self.num_slices:
            raise ConfigError("batch_shards", f"DiLoCo gives each of the {self.num_slices} replicas the same "
                              f"number of shards: batch_shards must be a multiple of num_slices, got {self.shards}")
        # The replicas differ between synchronizations by design: the
        # checks that compare them, and the snapshots that stand in for
        # any replica, do not apply (docs/diloco.md).
        for name in ("state_check_every", "grad_check_every", "snapshot_every"):
            object.__setattr__(self, name, 0)

    def _check_streaming(self) -> None:
        if not isinstance(self.enable_streaming_diloco, bool):
            raise ConfigError("enable_streaming_diloco", f"must be True or False, got {self.enable_streaming_diloco!r}")
        _positive_int("num_diloco_fragments", self.num_diloco_fragments)
        v = self.num_communication_overlapping_steps
        if not _count(v) or v < 0:
            raise ConfigError("num_communication_overlapping_steps", f"must be an integer >= 0, got {v!r}")
        a = self.communication_overlapping_alpha
        if not _number(a) or not 0 <= a < 1:
            raise ConfigError("communication_overlapping_alpha", f"must be in [0, 1), got {a!r}")
        if not self.enable_streaming_diloco:
            return
        if not self.enable_diloco:
            raise ConfigError("enable_streaming_diloco", "Streaming DiLoCo is a form of DiLoCo: set enable_diloco=True "
                              "too, or enable_streaming_diloco=False")
        period = self.num_diloco_fragments * self.diloco_fragment_every
        if v >= period:
            raise ConfigError("num_communication_overlapping_steps", f"a fragment's new global params must reach the "
                              f"replicas before it synchronizes again, every {period} steps here; got {v}")

    @property
    def diloco_fragment_every(self) -> int:
        """Streaming DiLoCo: steps between two fragments' synchronizations
        (MaxText's round(diloco_sync_period / num_diloco_fragments), at least 1)."""
        return max(1, int(round(self.diloco_sync_period / self.num_diloco_fragments)))

    @property
    def shards(self) -> int:
        """Shards of each step's global batch."""
        return self.num_slices if self.batch_shards is None else self.batch_shards

    @property
    def exchange_blocks(self) -> int:
        """The blocks the gradients' sum is ordered by (dispatch/exchange_plan.py):
        one per slice of the full membership under the reduce-scatter; one
        per shard (shard order) under the direct hand-off and group leaders."""
        return self.shards if self.exchange == "direct" or self.slices_per_leader else self.num_slices

    @property
    def adopted_facts(self) -> tuple:
        """The run facts a resumed run takes from its checkpoint rather
        than checks: the sum's order, where the exchange can follow it."""
        return () if self.exchange == "direct" or self.slices_per_leader else ("exchange_blocks",)

    def run_facts(self) -> dict:
        """What a checkpoint records of the run: seed and batch_shards
        (a resumed run must have the same: the same data), exchange_blocks."""
        return {"seed": self.seed, "batch_shards": self.shards, "exchange_blocks": self.exchange_blocks}

    @property
    def required_slices(self) -> int:
        """Slices the run needs to take a step."""
        if self.policy == "pause":
            return self.num_slices
        return 1 if self.min_slices is None else self.min_slices

    @classmethod
    def from_maxtext(
        cls,
        num_slices: int,
        elastic_timeout_seconds: float = 300.0,
        elastic_max_retries: int = 10,
        elastic_min_slice_count: int = -1,
        **rest: Any,
    ) -> "ElasticConfig":
        """Build from MaxText's flag names. `elastic_min_slice_count=-1`
        (MaxText's default) means every slice is required: pause and resume.
        """
        if elastic_min_slice_count == -1 or elastic_min_slice_count == num_slices:
            policy, min_slices = "pause", None
        else:
            policy, min_slices = "resize", elastic_min_slice_count
        return cls(
            num_slices=num_slices,
            policy=policy,
            min_slices=min_slices,
            timeout_s=elastic_timeout_seconds,
            max_retries=elastic_max_retries,
            **rest,
        )
