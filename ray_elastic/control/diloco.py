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
  without the failure;
- a replica lost in an inner step: the survivors' step counts. Under
  pause its report waits for the replacement, which recomputes the lost
  replica's step as it catches up: the step reports every replica's loss,
  bitwise as without the failure (`survivors_step`, `recomputed`). Under
  resize nobody recomputes it: the step reports the survivors' mean, the
  replicas whose deltas the round's outer step averages;
- every replica lost at once: the run goes back to the newest of the
  round's start (under pause, where every replica's round-start state and
  a copy of the global params and outer state, kept beside them, are
  still readable) and the newest durable checkpoint; else to step 0.

Pure bookkeeping but for the calls it makes through the backend and
membership it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from ray_elastic.checkpoint.config import CheckpointConfig
from ray_elastic.config import ElasticConfig
from ray_elastic.control.diloco_saves import DilocoCheckpoints
from ray_elastic.control.membership import Membership, StateSource
from ray_elastic.dispatch.calls import StepResult, replica_mean
from ray_elastic.dispatch.outer_spec import OuterSpec
from ray_elastic.errors import FailureKind, RunFailed, SliceFailure

__all__ = ["Rounds"]


class Rounds:
    """Which replica each slice is, where a round starts, and whether a
    synchronization is owed; off (`on` False) unless config.enable_diloco."""

    def __init__(self, config: ElasticConfig, steps: int, emit=lambda name, **fields: None,
                 checkpoint: Optional[CheckpointConfig] = None, injector=None):
        self.on = config.enable_diloco
        self._spec = OuterSpec.of(config)
        # Streaming DiLoCo synchronizes one fragment every `every` steps.
        self._period = self._spec.every if self._spec.streaming else config.diloco_sync_period
        self._replicas_n = config.num_slices
        self._shards = config.shards
        self._sync_deadline_s = config.first_step_deadline_s
        self._injector = injector  # faults of phase "sync" (failures/faults.py)
        self._policy = config.policy
        self._steps = steps
        self._emit = emit
        self.replicas: dict[int, int] = {s: s for s in range(config.num_slices)}  # slice -> replica
        self.round_start = 0  # the step the current round started at (its global params')
        self._round_states: dict[int, object] = {}  # replica -> its state at round_start (pause)
        self._outer_copies: list = []  # (ref, its nodes) of the global params and outer state at round_start (pause)
        # Streaming DiLoCo with an overlap: the fragment synchronization in
        # flight while the next inner steps run (`synchronize`).
        self._pending: Optional[_Pending] = None
        self._members: Optional[Membership] = None  # the run's (`saves`)
        # Under pause, the step a replica was lost in: replica -> {host:
        # metrics} of those that took it, until the replacement's recomputed
        # step completes it (`survivors_step`, `recomputed`).
        self._held: Optional[_HeldStep] = None
        # Durable checkpoints (diloco_saves.py), with a CheckpointConfig.
        self.checkpoints = None
        if self.on and checkpoint is not None:
            self.checkpoints = DilocoCheckpoints(checkpoint, {**config.run_facts(), "num_replicas": config.num_slices,
                                                              "num_diloco_fragments": self._spec.fragments},
                                                 self._spec, steps, config.policy, emit)

    def preflight(self) -> Optional[int]:
        """The step a DiLoCo run resumes from (its storage checked first); None without checkpoints."""
        return self.checkpoints.preflight() if self.checkpoints is not None else None

    def saves(self, members: Membership):
        """The DiLoCo run's saves (what the controller calls as it calls
        saves.py's); None without. Binds the run's membership, whose live
        slices `owed` compares with an overlapped synchronization's."""
        self._members = members
        return self.checkpoints.bind(self, members) if self.checkpoints is not None else None

    def round_state_refs(self, node_alive=lambda node: True) -> dict:
        """replica -> a readable copy of its state at the round's start
        (pause): the first whose nodes all live; replicas with none left out."""
        out = {}
        for r, copies in self._round_states.items():
            ref = next((ref for ref, nodes in copies if all(node_alive(n) for n in nodes)), None)
            if ref is not None:
                out[r] = ref
        return out

    def keep_round_states(self, by_replica: Mapping) -> None:
        """Keep these replicas' round-start states (pause): for each, its
        copies as (ref, the nodes it lies on; none: the driver's)."""
        if self._policy == "pause":
            self._round_states = {r: list(copies) for r, copies in by_replica.items()}

    def shards_of(self, replica: int) -> tuple:
        return tuple(s for s in range(self._shards) if s % self._replicas_n == replica)

    def assignment(self, live) -> dict:
        return {s: self.shards_of(r) for s, r in self.replica_map(live).items()}

    def boundary(self, step: int) -> bool:
        """Whether a round ends at `step` (steps done)."""
        return step > 0 and (step % self._period == 0 or step == self._steps)

    def owed(self, step: int) -> bool:
        """Whether the live slices must synchronize before going on from
        `step`: a round ends, or the synchronization in flight must be
        gathered (its fragment is mixed in at `step`) or run again (a
        slice left or joined since it was issued)."""
        if not self.on:
            return False
        p = self._pending
        if self.boundary(step) and (p.boundary if p is not None else self.round_start) < step:
            return True
        return p is not None and (step >= p.boundary + self._spec.overlap
                                  or (self._members is not None and set(self._members.live) != p.slices))

    def may_join(self, step: int) -> bool:
        """Whether ready slices may join at `step`: under resize only at a
        round's start; under pause at any step (they catch up)."""
        return not self.on or self._policy == "pause" or step == self.round_start

    def synchronize(self, step: int, members: Membership, deadline_s: float) -> None:
        """What `owed` asked for at `step`: the synchronization in flight
        gathered (or run again), then the round's end at `step`, if it is
        one. Under Streaming DiLoCo with an overlap a fragment's
        synchronization is issued and the run goes on: the inner steps
        until its fragment is mixed in run while it moves."""
        live = sorted(members.live)
        fire = self._faults(step, members)
        if self._pending is not None:
            self.settle(step, deadline_s)
            if not (self.boundary(step) and self.round_start < step):
                return
        # Streaming: this step's fragment; the run's last synchronization takes them all.
        fragment = self._spec.synced_after(step) if step < self._steps else None
        # A synchronization moves a whole state's deltas: its deadline is
        # at least the first step's, never the inner steps' (no exchange).
        deadline_s = max(deadline_s, self._sync_deadline_s)
        # Not where a slice waits to join (resize): it joins once the round's start is synchronized.
        joiner = self._policy != "pause" and members.ready and len(live) < self._replicas_n
        if fragment is not None and self._spec.overlap and not joiner:
            # The states of the round's start (pause), made before any
            # overlapped step runs; kept once the synchronization is in.
            states = members.backend.round_states(live) if self._policy == "pause" else None
            members.backend.start_sync(step, live, self.replica_map(live), deadline_s, fire, fragment)
            self._pending = _Pending(step, fragment, self.round_start, frozenset(live), states)
            return
        took, moved = members.backend.synchronize(step, self.round_start, live, self.replica_map(live), deadline_s,
                                                  fire, **({"fragment": fragment} if fragment is not None else {}))
        self._synced(step, fragment, took, moved, members)

    def settle(self, step: int, deadline_s: float, whole: bool = False) -> bool:
        """Gather the synchronization in flight, or run it again among the
        live slices if a slice left or joined since (their deltas of its
        boundary are kept: worker/diloco.py); none in flight: nothing.
        `step`: the run's, which a failure found here is reported at.
        `whole` (a save): under pause, not among fewer replicas than it was
        issued to, whose replacement has yet to join: False then."""
        p, members = self._pending, self._members
        if p is None:
            return True
        live = sorted(members.live)
        if whole and self._policy == "pause" and not p.slices <= set(live):
            return False
        try:
            done = members.backend.finish_sync(live)
            if done is None:
                done = members.backend.synchronize(p.boundary, p.since, live, self.replica_map(live),
                                                   max(deadline_s, self._sync_deadline_s), fragment=p.fragment)
        except SliceFailure as f:  # found at the run's step, not the boundary's, which the run is past
            raise f.replace(step=step) from None
        self._pending = None
        states = None
        if p.states is not None:  # a joiner's state now is that of the boundary (`join`)
            states = {s: c for s, c in p.states.items() if s in members.live}
            if len(states) < len(live):
                states.update(members.backend.round_states(live, only=[s for s in live if s not in states]))
        self._synced(p.boundary, p.fragment, *done[:2], members, states, *done[2:])
        return True

    def _faults(self, step: int, members: Membership):
        def fire(phase: str = "sync") -> None:
            for fired in self._injector.fire_due(step, members.hosts(), phase) if self._injector else ():
                self._emit("fault", kind=fired.fault.kind, slice=fired.fault.slice_id, host=fired.fault.host,
                           step=step, phase=phase)
        return fire

    def _synced(self, step: int, fragment: Optional[int], took, moved: int, members: Membership,
                states: Optional[dict] = None, overlapped: Optional[int] = None) -> None:
        """The synchronization at `step` is in: the round starts there.
        `overlapped`: the inner steps every replica took while it moved."""
        live = sorted(members.live)
        lost = sorted(set(range(self._replicas_n)) - set(took)) if took is not None else []
        self._emit("diloco_sync", step=step, replicas=took if took is not None else "adopted", slices=live,
                   bytes_across_slices=moved, **({"fragment": fragment} if fragment is not None else {}),
                   **({"lost": lost} if lost else {}), **({"overlapped_steps": overlapped} if overlapped is not None else {}))
        self.round_start = step
        if step < self._steps and self._policy == "pause":  # the round's start, for a replacement to recompute from
            states = states if states is not None else members.backend.round_states(live)
            self.keep_round_states({self.replicas[s]: c for s, c in states.items()})
            self._outer_copies = members.backend.outer_copies(live)

    def restart(self, step: int) -> None:
        """The run went back to `step` with no live slice: a fresh start,
        or this round's start (its kept states stay, for the next failure)."""
        if self._pending is not None:  # its slices are all lost
            self._pending = None
            self._members.backend.drop_sync([])
        if step != self.round_start or step == 0:
            self._round_states, self._outer_copies = {}, []
        self.round_start = step
        if self._held is not None and self._held.step >= step:  # taken again from `step`: reported then
            self._held = None

    def first(self, live) -> int:
        """The live slice whose state is the run's final one: the lowest
        replica's under DiLoCo (its inner optimizer state is its own: the
        lowest slice id may be another replica's after a replacement, and
        the final state would differ from a failure-free run's), else the
        lowest slice."""
        return min(live, key=lambda s: self.replica_map(live)[s]) if self.on else min(live)

    def close(self) -> None:
        """The run is over: its kept round-start states and global copies
        go with it, or a driver that keeps the trainer would keep them in
        the object store (the soak counted them after a DiLoCo run)."""
        self._round_states, self._outer_copies, self._held = {}, [], None

    def lost_all(self, members: Membership) -> StateSource:
        """Where the run goes back to with every replica lost: this round's
        start (pause: every replica's round-start state and a global copy
        still readable; its ref: (replica -> state ref, global copy ref)),
        a newer durable checkpoint, or step 0."""
        alive = members.backend.node_alive
        starts = self.round_state_refs(alive)
        outer = next((ref for ref, nodes in self._outer_copies if all(alive(n) for n in nodes)), None)
        durable = self.checkpoints.latest() if self.checkpoints is not None else None
        memory = self.round_start if self.round_start > 0 and outer is not None and len(starts) == self._replicas_n else None
        if durable is not None and (memory is None or durable > memory):
            return StateSource("checkpoint", durable)
        if memory is not None:
            return StateSource("snapshot", memory, (starts, outer))
        return StateSource("initial", 0)

    def rejoin(self, new: list, source: StateSource, members: Membership, deadline_s: float) -> bool:
        """Ready slices `new` take up the run from `source` (`lost_all`'s),
        every replica lost: each takes a replica (lowest first) and its
        state. False if a load failed (membership re-queued what it must)."""
        if source.kind == "snapshot":
            starts, outer = source.ref
            taken = dict(zip(sorted(new), range(self._replicas_n)))
            for s, r in taken.items():
                if not members.join([s], StateSource("snapshot", source.step, starts[r])):
                    return False
                self.replicas[s] = r
            members.backend.load_outer(sorted(taken), outer, deadline_s)
            return True
        if not members.join(new, StateSource("initial", 0)):
            return False
        self.replicas = {s: r for s, r in zip(sorted(members.live), range(self._replicas_n))}
        if source.kind == "checkpoint":
            self.checkpoints.cold_start(source.step, deadline_s)
        return True

    def join(self, new: list, step: int, members: Membership, deadline_s: float) -> bool:
        """Ready slices `new` join the live ones: each takes a missing
        replica (lowest first) and its state (see the module's doc).
        False if a load failed or a joiner was lost (membership re-queued
        what it must); a live slice lost meanwhile raises its failure,
        the joiners back among the ready ones."""
        live = sorted(members.live)
        replicas = self.replica_map(live)
        missing = [r for r in range(self._replicas_n) if r not in replicas.values()]
        taken = dict(zip(sorted(new), missing))
        donor = min(live, key=lambda s: replicas[s])  # the live replica with the lowest id
        backend, pending = members.backend, self._pending
        try:
            if self._policy != "pause":  # resize: at a round's start, from the donor's state (its params: the global ones but under streaming)
                if not members.join(list(taken), StateSource("live", step, backend.state(donor))):
                    return False
                self.replicas.update(taken)
                backend.adopt(list(taken), donor, step, deadline_s)
                return True
            # Pause: an outer step a failure left applied on some hosts
            # is taken back: the round ends again with every replica.
            # One in flight (overlapped) is given up first: the joiners
            # recompute up to its boundary, and it runs again with them.
            if pending is not None:
                backend.drop_sync(live)
                # A joiner's slice id may be a lost one's: its state of the boundary is void.
                self._pending = pending = dataclasses.replace(
                    pending, states={s: c for s, c in pending.states.items() if s not in taken})
            undone = backend.undo_sync(live, self.round_start, deadline_s)
            if undone:
                self._emit("diloco_sync_undone", step=self.round_start, hosts=undone)
            starts = self.round_state_refs(backend.node_alive)
            for s, r in taken.items():
                if self.round_start > 0 and r not in starts:
                    raise RunFailed(f"replica {r}'s state of the round's start (step {self.round_start}) was lost "
                                    "with its node and the node of its copy: its inner steps of the round cannot be "
                                    "recomputed. Use policy='resize' where nodes are lost this often",
                                    setting="policy")
                source = StateSource("snapshot", self.round_start, starts[r]) if r in starts else StateSource("initial", 0)
                if not members.join([s], source):
                    if pending is not None:  # the others hold an earlier step than the run's
                        self._unjoin([t for t in taken if t != s and t in members.live], members)
                    return False
                self.replicas[s] = r
                upto = pending.boundary if pending is not None else step
                self._took(r, backend.catch_up(s, donor, range(self.round_start, upto), self.shards_of(r),
                                               deadline_s * max(1, upto - self.round_start)))
                self._emit("diloco_caught_up", slice=s, replica=r, steps=step - self.round_start)
            if pending is not None:  # its boundary synchronized with every replica, the joiners go on to `step`
                self.settle(step, deadline_s)
                for s, r in taken.items():
                    self._took(r, backend.catch_up(s, donor, range(pending.boundary, step), self.shards_of(r),
                                                   deadline_s * max(1, step - pending.boundary)))
        except SliceFailure as f:
            joined = [s for s in taken if s in members.live and s != f.slice_id]
            if f.slice_id in taken:
                # As the controller does for a live slice: a joiner whose node is gone or silent is replaced away from it.
                members.lose(f.slice_id, new_group=f.node_silent, host=f.host, node_died=f.kind is FailureKind.NODE_DIED)
                if pending is not None:  # the others hold an earlier step than the run's
                    self._unjoin(joined, members)
                return False
            self._unjoin(joined, members)
            raise
        return True

    def survivors_step(self, k: int, result: StepResult, paused: bool) -> tuple:
        """Inner step k, which a replica was lost in, as the survivors took
        it (`result`: their hosts' metrics): (its result, their loss and
        aux metrics averaged in replica order; whether its report waits
        for the replacement). Under pause (`paused`) it does: the
        replacement recomputes the lost replica's step k as it catches up
        (`join`), and `recomputed` gives the step with every replica's
        metrics. Under resize the lost replica leaves its round with its
        step: the survivors' mean is the step's."""
        replicas = self.replica_map({s for s, _ in result.metrics})
        if paused:
            held = _HeldStep(k, {})
            for (s, h), m in result.metrics.items():
                held.by_replica.setdefault(replicas[s], {})[h] = m
            self._held = held
        return StepResult(replica_mean(result.metrics, replicas), {}), paused

    def _took(self, replica: int, recomputed: Mapping) -> None:
        """A joiner recomputed `replica`'s inner steps (step -> its hosts'
        metrics): the held step's, if among them, completes it."""
        if self._held is not None and self._held.step in recomputed:
            self._held.by_replica[replica] = {h: m for (_, h), m in recomputed[self._held.step].items()}

    def recomputed(self) -> Optional[StepResult]:
        """The step `survivors_step` held, once every replica's metrics of
        it are in: its loss and aux metrics averaged over all of them in
        replica order, as without the failure (then it is forgotten);
        None until then."""
        held = self._held
        if held is None or len(held.by_replica) < self._replicas_n:
            return None
        self._held = None
        metrics = {(r, h): m for r in sorted(held.by_replica) for h, m in held.by_replica[r].items()}
        return StepResult(replica_mean(metrics, {r: r for r in held.by_replica}), {})

    @staticmethod
    def _unjoin(slices: list, members: Membership) -> None:
        """Joiners ready again: they load anew at the next join."""
        for s in slices:
            members.live.discard(s)
            members.ready.add(s)

    def replica_map(self, live) -> Mapping[int, int]:
        """slice -> replica of the live slices; a slice that went live
        without joining (a ready spare taken at the start in place of a
        training slice that was not up) takes the lowest free replica."""
        for s in sorted(set(live) - set(self.replicas)):
            taken = {self.replicas[t] for t in live if t in self.replicas}
            self.replicas[s] = min(r for r in range(self._replicas_n) if r not in taken)
        return {s: self.replicas[s] for s in sorted(live)}


@dataclasses.dataclass(frozen=True)
class _HeldStep:
    """An inner step a replica was lost in (pause): replica -> {host:
    its metrics} of the replicas whose step is in so far."""

    step: int
    by_replica: dict


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A fragment's synchronization in flight (`Rounds.synchronize`): its
    boundary, fragment, the round's start before it, the slices it was
    issued on, and (pause) their states of the boundary, kept once it is in."""

    boundary: int
    fragment: int
    since: int
    slices: frozenset
    states: Optional[dict]
