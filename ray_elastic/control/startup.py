"""What a run says when its slices are not all up by the start-up
deadline. Two different problems look alike from the driver, and their
fixes differ: a slice Ray could not place (no set of nodes with its
bundles: the cluster is too small, or busy) and a slice placed whose
workers were still starting, importing JAX and compiling (a slow
start-up: the deadline is too short for it)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from ray_elastic.config import ElasticConfig
from ray_elastic.control.preflight import preflight
from ray_elastic.dispatch.outer_spec import OuterSpec
from ray_elastic.errors import RunFailed

__all__ = ["ray_backend", "start_timeout"]


def ray_backend(factory: Callable, config: ElasticConfig, steps: int, run_name: str, clock: Callable[[], float],
                provisioner: Optional[type], facts: Optional[dict]) -> tuple:
    """(the run's RayBackend, what a host needs): the program checked
    first (preflight), before any slice is reserved; `facts`: a resumed
    checkpoint's run facts (the exchange's order), else the config's."""
    from ray_elastic.cluster.ray_backend import RayBackend

    c = config
    needs = preflight(factory, c, steps)
    return RayBackend(
        c.slice, factory, c.seed, c.shards, run_name=run_name, compile_cache_dir=c.compile_cache_dir,
        provisioner=provisioner, clock=clock, warm_workers=c.warm_workers, slices_per_leader=c.slices_per_leader,
        num_slices=c.num_slices, heartbeat_timeout_s=c.heartbeat_timeout_s, state_check_every=c.state_check_every,
        grad_check_every=c.grad_check_every, final_step=steps,
        exchange=(c.exchange, c.exchange_dtype, (facts or c.run_facts())["exchange_blocks"]),
        keep_workers=c.keep_workers, step_program=c.one_slice_program,
        diloco=OuterSpec.of(c) if c.enable_diloco else None), needs


def start_timeout(config: ElasticConfig, ready: Iterable[int], placed: Callable[[int], bool],
                  wait_s: float) -> RunFailed:
    """The error for a start-up that ended with too few slices `ready`
    after `wait_s`; `placed(slice)` tells whether Ray placed that slice's
    group. It names the setting to change for the first problem found."""
    ready = set(ready)
    missing = [s for s in range(config.num_slices) if s not in ready]
    unplaced = [s for s in missing if not placed(s)]
    starting = [s for s in missing if s not in unplaced]
    bundles = config.slice.bundles()
    parts = []
    if unplaced:
        parts.append(f"slice(s) {unplaced} could not be placed (each needs {len(bundles)} host(s) of {bundles[0]}, "
                     "one per node): add nodes to the cluster, or lower num_slices")
    if starting:
        parts.append(f"slice(s) {starting} were placed, but their workers were still starting (a process, "
                     "JAX's import, the first compile): raise first_step_deadline_s, and keep compile_cache_dir "
                     "on a disk that lasts between runs")
    return RunFailed(
        f"only {len(ready)} of {config.num_slices} slices were ready within {wait_s:g} s (the larger of "
        f"timeout_s and first_step_deadline_s): {'; '.join(parts)}.",
        setting="num_slices" if unplaced else "first_step_deadline_s",
    )
