"""What the controller asks of the cluster, in its own terms: slices by id,
never actor handles. `RayBackend` (cluster/ray_backend.py) is the real one;
tests drive the controller over a pure-Python fake of this interface."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from ray_elastic.dispatch.step_runner import StepResult

__all__ = ["SliceBackend", "SliceUp"]


@dataclasses.dataclass(frozen=True)
class SliceUp:
    """A slice whose workers finished setting up (JAX up, step compiled)."""

    slice_id: int
    setup_s: float
    # Seconds per part of setup_s (process_start, actor_load, args_load,
    # or warm_process in a process started ahead; queue, imports,
    # jax_init, program_build, initial_state, compile, report: see
    # readiness.readiness_phases); empty where the backend does not time them.
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # Worker processes given up on that its hosts waited to see exit
    # first (pids, those killed, seconds: worker/predecessors.py).
    predecessors: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class SliceBackend(Protocol):
    def start(self, slice_id: int, new_group: bool = False, evict: tuple = ()) -> None:
        """Queue the slice's workers (a replacement reuses its placement
        group, unless `new_group`: the old one holds a bundle on a node
        that does not answer; or `evict`: nodes no slice of the run may
        use again, given a new group away from them); any workers it had
        are torn down first."""

    def poll(self, block_s: float = 0.0) -> list[SliceUp]:
        """Slices set up since the last poll, waiting up to block_s for
        one. Raises RunFailed when a worker cannot start at all."""

    def run_step(
        self, step: int, slices: Sequence[int], assignment: Mapping[int, tuple],
        takers: frozenset, deadline_s: float, on_issued: Callable[[], None],
        ahead: Optional[Mapping[int, tuple]] = None,
    ) -> StepResult:
        """One step on these slices, or a SliceFailure. `ahead`: the next
        step's assignment, when the controller expects it on the same
        slices: its pure calls may be issued before this step is done."""

    def finish_step(self, partial: Any, slices: Sequence[int], takers: frozenset, deadline_s: float) -> StepResult:
        """Complete a step that lost a slice in its gradient phase (the
        failure's `partial`) on these slices, keeping the gradients already
        computed; or a SliceFailure."""

    def applied(self, step: int, slices: Sequence[int]) -> Optional[StepResult]:
        """The result of a step that failed after these slices had applied
        it (they hold the step after it): their metrics and snapshots, or
        None if none of their applies can be read."""

    def load(self, slices: Sequence[int], source: Any, timeout_s: float) -> None:
        """Load a state (a ref) into every host of these slices. Raises
        StateLoadFailed naming the slices that died meanwhile."""

    def held_steps(self, slices: Sequence[int], step: int, abort_waits: bool = False) -> dict[int, int]:
        """The step each slice's state is at (-1 for a slice whose hosts
        hold different steps), or a SliceFailure. `abort_waits`: the
        lost slice's node is gone or silent, so its gradients may never
        arrive: the survivors' calls still waiting for them give up."""

    def locate(self, slices: Sequence[int], step: int, cause: BaseException) -> Any:
        """The SliceFailure behind a failed call to several slices: the
        first host that does not answer."""

    def state(self, slice_id: int) -> Any:
        """A ref to the slice's current state."""

    def fetch(self, ref: Any, timeout_s: Optional[float] = None) -> Any: ...

    def hosts(self, slice_id: int) -> list[dict]:
        """pid, node_id and ip of each host of a set-up slice."""

    def node_alive(self, node_id: str) -> bool: ...

    def placed(self, slice_id: int) -> bool:
        """Whether Ray has placed the slice's group (each host has its
        node), whether or not its workers are set up yet."""

    def slow_down(self, slice_id: int, host: int, ms: int) -> None:
        """Make the host take `ms` longer per gradient call (a `slow` fault)."""

    def corrupt(self, slice_id: int, host: int, target: str, lasting: bool) -> None:
        """Make the host flip a bit of its state or gradient (a `corrupt` fault)."""

    def recompute(self, slice_id: int, step: int, shard: int) -> list:
        """Have the slice compute shard `shard`'s gradient at step `step`
        again (a cross-check): each host's fingerprint of it (refs, for
        `fetch`), issued before the step's own calls."""

    def fingerprint(self, slice_id: int) -> list:
        """Each host's fingerprint of the state the slice holds (refs, for
        `fetch`): a tie-break's, after the slice replayed steps alone."""

    def retire(self, slice_id: int) -> None:
        """Tear the slice's workers down (its placement group stays)."""

    def attach_checkpoints(self, coordinator: Any, slice_id: int) -> None:
        """Give the checkpoint coordinator the state's structure."""

    def shutdown(self, keep: bool = False) -> None:
        """End the run's slices (`keep`: the run completed; its live slices
        may be kept for the driver's next run: cluster/kept_workers.py)."""
