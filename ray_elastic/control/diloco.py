"""DiLoCo's rounds, as the controller carries them out (docs/diloco.md).

Each configured slice is a replica with its own data (replica r takes the
batch shards s with s mod num_slices == r) and its own inner state. Every
`diloco_sync_period` steps, and at the run's end, a synchronization
averages the live replicas' deltas into the outer step (worker/diloco.py,
dispatch/diloco_runner.py). Between synchronizations the replicas share
nothing, so a lost replica costs the others no step:

- resize: the lost replica leaves its round; the survivors synchronize
  among themselves (their count divides); a replacement joins at the next
  round's start with the global params, outer state and the inner
  optimizer state of the live replica with the lowest id (the same
  choice every run makes, so equal failures give equal bits);
- pause: a replacement (a hot spare at once) loads the lost replica's
  state of the round's start, kept in the object store at every
  synchronization, and recomputes the replica's inner steps of the round
  before the run goes on: the round ends with every replica, bitwise as
  without the failure.

Pure bookkeeping but for the calls it makes through the backend and
membership it is given.
"""

from __future__ import annotations

from typing import Mapping, Optional

from ray_elastic.checkpoint.config import CheckpointConfig
from ray_elastic.config import ElasticConfig
from ray_elastic.control.diloco_saves import DilocoCheckpoints
from ray_elastic.control.membership import Membership, StateSource
from ray_elastic.dispatch.outer_spec import OuterSpec
from ray_elastic.errors import SliceFailure

__all__ = ["Rounds"]


class Rounds:
    """Which replica each slice is, where a round starts, and whether a
    synchronization is owed; off (`on` False) unless config.enable_diloco."""

    def __init__(self, config: ElasticConfig, steps: int, emit=lambda name, **fields: None,
                 checkpoint: Optional[CheckpointConfig] = None):
        self.on = config.enable_diloco
        self._period = config.diloco_sync_period
        self._replicas_n = config.num_slices
        self._shards = config.shards
        self._policy = config.policy
        self._steps = steps
        self._emit = emit
        self.replicas: dict[int, int] = {s: s for s in range(config.num_slices)}  # slice -> replica
        self.round_start = 0  # the step the current round started at (its global params')
        self._round_states: dict[int, object] = {}  # replica -> its state at round_start (pause)
        # Durable checkpoints (diloco_saves.py), with a CheckpointConfig.
        self.checkpoints = None
        if self.on and checkpoint is not None:
            spec = OuterSpec(config.diloco_outer_lr, config.diloco_outer_momentum)
            self.checkpoints = DilocoCheckpoints(checkpoint, {**config.run_facts(), "num_replicas": config.num_slices},
                                                 spec, steps, config.policy, emit)

    def preflight(self) -> Optional[int]:
        """The step a DiLoCo run resumes from (its storage checked first); None without checkpoints."""
        return self.checkpoints.preflight() if self.checkpoints is not None else None

    def saves(self, members: Membership):
        """The DiLoCo run's saves (what the controller calls as it calls saves.py's); None without."""
        return self.checkpoints.bind(self, members) if self.checkpoints is not None else None

    def round_state_refs(self) -> dict:
        """replica -> its state's ref at the round's start (pause), as kept."""
        return dict(self._round_states)

    def keep_round_states(self, by_slice: Mapping) -> None:
        """Keep these slices' states (refs) as their replicas' round-start states (pause)."""
        if self._policy == "pause":
            self._round_states = {self.replicas[s]: ref for s, ref in by_slice.items()}

    def shards_of(self, replica: int) -> tuple:
        return tuple(s for s in range(self._shards) if s % self._replicas_n == replica)

    def assignment(self, live) -> dict:
        return {s: self.shards_of(r) for s, r in self.replica_map(live).items()}

    def boundary(self, step: int) -> bool:
        """Whether a round ends at `step` (steps done)."""
        return step > 0 and (step % self._period == 0 or step == self._steps)

    def owed(self, step: int) -> bool:
        """Whether the live slices must synchronize before going on from `step`."""
        return self.on and self.boundary(step) and self.round_start < step

    def may_join(self, step: int) -> bool:
        """Whether ready slices may join at `step`: under resize only at a
        round's start; under pause at any step (they catch up)."""
        return not self.on or self._policy == "pause" or step == self.round_start

    def synchronize(self, step: int, members: Membership, deadline_s: float) -> None:
        live = sorted(members.live)
        took, moved = members.backend.synchronize(step, live, {s: self.replicas[s] for s in live}, deadline_s)
        self._emit("diloco_sync", step=step, replicas=took if took is not None else "adopted", slices=live,
                   bytes_across_slices=moved, **({"lost": sorted(set(range(self._replicas_n)) - set(took))}
                                                 if took is not None and len(took) < self._replicas_n else {}))
        self.round_start = step
        if step < self._steps:  # the round's start, for a replacement to recompute from
            self.keep_round_states(members.backend.round_states(live))

    def restart(self, step: int) -> None:
        """The run went back to `step` with no live slice (a fresh start)."""
        self.round_start, self._round_states = step, {}

    def join(self, new: list, step: int, members: Membership, deadline_s: float) -> bool:
        """Ready slices `new` join the live ones: each takes a missing
        replica (lowest first) and its state (see the module's doc).
        False if a load failed (membership re-queued what it must)."""
        live = sorted(members.live)
        held = {self.replicas[s] for s in live}
        missing = [r for r in range(self._replicas_n) if r not in held]
        taken = dict(zip(sorted(new), missing))
        donor = live[0]
        if step == self.round_start:  # the donor's state is the round's start: params = the global params
            if not members.join(list(taken), StateSource("live", step, members.backend.state(donor))):
                return False
            self.replicas.update(taken)
            members.backend.adopt(list(taken), donor, step, deadline_s)
            return True
        for s, r in taken.items():
            start: Optional[object] = self._round_states.get(r)
            source = StateSource("snapshot", self.round_start, start) if start is not None else StateSource("initial", 0)
            if not members.join([s], source):
                return False
            self.replicas[s] = r
            try:
                members.backend.catch_up(s, donor, range(self.round_start, step), self.shards_of(r),
                                         deadline_s * max(1, step - self.round_start))
            except SliceFailure:
                members.lose(s)
                return False
            self._emit("diloco_caught_up", slice=s, replica=r, steps=step - self.round_start)
        return True

    def replica_map(self, live) -> Mapping[int, int]:
        """slice -> replica of the live slices; a slice that went live
        without joining (a ready spare taken at the start in place of a
        training slice that was not up) takes the lowest free replica."""
        for s in sorted(set(live) - set(self.replicas)):
            taken = {self.replicas[t] for t in live if t in self.replicas}
            self.replicas[s] = min(r for r in range(self._replicas_n) if r not in taken)
        return {s: self.replicas[s] for s in sorted(live)}
