"""What a run says when its slices are not all up by the start-up
deadline. Two different problems look alike from the driver, and their
fixes differ: a slice Ray could not place (no set of nodes with its
bundles: the cluster is too small, or busy) and a slice placed whose
workers were still starting, importing JAX and compiling (a slow
start-up: the deadline is too short for it)."""

from __future__ import annotations

from typing import Callable, Iterable

from ray_elastic.config import ElasticConfig
from ray_elastic.errors import RunFailed

__all__ = ["start_timeout"]


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
