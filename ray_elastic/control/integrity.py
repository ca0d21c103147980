"""State checks: the slices are data-parallel replicas whose state is
bitwise identical after every step, so fingerprints of it that differ
mean one slice's memory or math went wrong (silent data corruption).

Every `state_check_every` steps each host fingerprints its new state,
one fingerprint per local device of the shards that device holds
(worker/fingerprint.py), on a thread while the next step's gradients
compute, and returns it with the next apply's metrics (with the same
apply at the run's last step: worker/state_prints.py). The same host index of every slice holds the same
shards, so they are compared host by host:
- under a replicated layout every device of a slice holds the same bits,
  so a slice whose devices disagree among themselves names itself;
- the slices whose fingerprints differ from those of a strict majority
  of the slices are named (three or more slices);
- with no strict majority (two slices that differ, or a three-way split)
  the divergence is found but no slice named: the run rolls back all
  the same, and counts it against max_retries.

A check that agrees verifies its step: a snapshot of that step or older
is one no corrupted state had reached, and the rollback goes to the
newest such snapshot.

A gradient computed wrong leaves the replicas equal (every slice applies
the same mean), so every `grad_check_every` steps one shard's gradient is
computed again by other slices (`GradChecks`): the slice that owns the
shard rotates, and the next one or two live slices recompute it (two when
three or more are live, so that a mismatch is settled at once by a
majority of three computations, with no replay). A slice whose
fingerprint differs is named; the rollback goes back to the newest
snapshot no older than its last clean cross-check, since a persistent
fault may have corrupted every gradient it sent since. With two live
slices a mismatch has no majority: a tie-break computes the shard again
from the check step's state (tie_break.settle_grads); if it names no one,
it is handled as an unnamed divergence.

`StateChecks` and `GradChecks` are pure (the controller feeds them the
step's metrics); `roll_back` carries the rollback out on the slices.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Optional

from ray_elastic.errors import RunFailed, SliceCorrupted

__all__ = ["CrossCheck", "Divergence", "GradChecks", "StateChecks", "roll_back", "spend_retry"]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The state of `step` differs between replicas. `named`: (slice,
    host) of each replica found odd (empty: none could be told apart);
    `verified`: the newest step whose check agreed."""

    step: int
    named: tuple[tuple[int, int], ...]
    verified: int
    detail: str
    rolls_back = True  # every live slice goes back to a verified snapshot

    def failure(self) -> Optional[SliceCorrupted]:
        """The failure that evicts the first slice named (None: none was)."""
        if not self.named:
            return None
        s, h = self.named[0]
        return SliceCorrupted(s, h, self.step - 1, self.detail)


class StateChecks:
    def __init__(self, every: int, start_step: int = 0):
        self.every = every  # 0: off
        self.verified = start_step  # the newest step the replicas agreed on (or the run started from)

    def restart(self, step: int) -> None:
        """The run goes on from `step` (a rollback, a cold start): a state
        every live slice loaded from one copy."""
        self.verified = step

    @staticmethod
    def timing(metrics: Mapping[tuple[int, int], dict]) -> dict:
        """For a step whose metrics carry fingerprints: {"check_s": the
        slowest host's seconds fingerprinting (on its fingerprint thread,
        while the step's gradients computed), "check_wait_s": the longest
        any host's apply waited for one (what the check added to the
        step)}; {} otherwise."""
        took = [m["fingerprint_s"] for m in metrics.values() if "fingerprint_s" in m]
        waited = [m.get("fingerprint_wait_s", 0.0) for m in metrics.values() if "fingerprint_s" in m]
        return {"check_s": max(took), "check_wait_s": max(waited)} if took else {}

    def check(self, metrics: Mapping[tuple[int, int], dict]) -> Optional[Divergence]:
        """Compare the fingerprints in a step's metrics ((slice, host) ->
        the apply's metrics, whose "fingerprints" are {state's step:
        prints}: a host reports the state it held at the step's start,
        and the new one at the run's last step); None when they agree (or
        there are none)."""
        steps = sorted({t for m in metrics.values() for t in m.get("fingerprints", {})})
        for t in steps:
            prints = {key: tuple(m["fingerprints"][t]) for key, m in metrics.items() if t in m.get("fingerprints", {})}
            found = self._compare(t, prints, metrics)
            if found is not None:
                return found
        return None

    def _compare(self, step: int, prints: Mapping[tuple[int, int], tuple], metrics) -> Optional[Divergence]:
        """The fingerprints of the state of `step`, (slice, host) -> prints."""
        odd: set[tuple[int, int]] = set()
        notes = []
        for key, fp in prints.items():
            if metrics[key].get("replicated") and len(set(fp)) > 1:
                odd.add(key)
                notes.append(f"slice {key[0]} host {key[1]}: its devices hold different bits")
        unresolved = False
        for host in sorted({h for _, h in prints}):
            # A slice that named itself on this host is left out of the
            # vote: its prints are known bad and are what differs from
            # the others, so with two slices the one left agrees alone
            # (not "no majority" beside a slice that was named).
            by_slice = {s: fp for (s, h), fp in prints.items() if h == host and (s, h) not in odd}
            counts = collections.Counter(by_slice.values())
            if len(counts) <= 1:
                continue
            top, n = counts.most_common(1)[0]
            if 2 * n > len(by_slice):
                for s, fp in by_slice.items():
                    if fp != top:
                        odd.add((s, host))
                        notes.append(f"slice {s} host {host} differs from {n} of {len(by_slice)} slices")
            else:
                unresolved = True
                notes.append(f"host {host}: no majority among slices {sorted(by_slice)}")
        if not odd and not unresolved:
            self.verified = max(self.verified, step)
            return None
        return Divergence(step, tuple(sorted(odd)), self.verified, "; ".join(notes))


@dataclasses.dataclass(frozen=True)
class CrossCheck:
    """At step `step`, shard `shard` (of slice `owner`) is computed again
    by the `checkers`."""

    step: int
    owner: int
    shard: int
    checkers: tuple[int, ...]


class GradChecks:
    def __init__(self, every: int, start_step: int = 0):
        self.every = every  # 0: off
        self._count = 0  # cross-checks planned: the rotation
        self._clean: dict[int, int] = {}  # slice -> the last step its gradients matched
        self._start = start_step
        # The newest check whose computations all agreed, with the agreed
        # {host: fingerprint}: a known answer (tie_break.settle_grads).
        self.agreed: Optional[tuple[CrossCheck, dict[int, int]]] = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step > 0 and step % self.every == 0

    def plan(self, step: int, live: list, assignment: Mapping[int, tuple]) -> Optional[CrossCheck]:
        """The cross-check of step `step` on these live slices, if due."""
        live = sorted(live)
        if not self.due(step) or len(live) < 2:
            return None
        i, n = self._count, len(live)
        self._count += 1
        owner = live[i % n]
        if not assignment.get(owner):
            return None
        return CrossCheck(step, owner, assignment[owner][0], tuple(live[(i + j) % n] for j in (1, 2) if j < n))

    def judge(self, check: CrossCheck, prints: Mapping[int, Optional[Mapping[int, int]]]) -> Optional[Divergence]:
        """Compare the fingerprints of the shard's gradient, per slice
        ({host: print} each; None: missed); None when they agree (every
        slice compared is clean at the check's step) or too few came."""
        votes = {s: tuple(sorted(p.items())) for s, p in prints.items() if p}
        if len(votes) < 2:
            return None
        counts = collections.Counter(votes.values())
        if len(counts) == 1:
            for s in votes:
                self._clean[s] = max(self._clean.get(s, self._start), check.step)
            self.agreed = (check, dict(next(iter(counts))))
            return None
        top, n = counts.most_common(1)[0]
        what = f"the gradient of shard {check.shard} at step {check.step}"
        if 2 * n > len(votes):
            odd = sorted(s for s, v in votes.items() if v != top)
            want = dict(top)
            named = tuple((s, min(h for h in {*dict(votes[s]), *want} if dict(votes[s]).get(h) != want.get(h)))
                          for s in odd)
            detail = f"{what}: slice(s) {odd} differ from {n} of {len(votes)} computations"
        else:
            odd, named = sorted(votes), ()
            detail = f"{what}: no majority among slices {sorted(votes)}"
        return Divergence(check.step + 1, named, min(self.clean(s) for s in odd), detail)

    def clean(self, slice_id: int) -> int:
        """The last step slice's gradients matched (the run's start if none)."""
        return self._clean.get(slice_id, self._start)

    def floor(self, live) -> int:
        """The oldest step a rollback may need: the live slices' last clean checks."""
        return min((self.clean(s) for s in live), default=self._start)

    def restart(self, step: int, cold: bool = False) -> None:
        """The run goes on from `step` (`cold`: a cold start from a
        checkpoint of it): checks past it are void."""
        self._start = step if cold else min(self._start, step)
        self._clean = {s: min(t, step) for s, t in self._clean.items()}
        if self.agreed is not None and (cold or self.agreed[0].step > step):
            self.agreed = None  # its state is gone with the snapshots past `step`


def roll_back(members, snapshots, found: Divergence, event, failures=()) -> Optional[int]:
    """Load the newest snapshot of `found.verified` or older (no corrupted
    state or gradient can have reached it) into every live slice; its step.
    None when no verified snapshot survives: the snapshots past the
    verified step are dropped and every live slice is queued again, so the
    run goes back as after losing them all (to a checkpoint at or before
    it, else the initial state) and never keeps a state a corrupted slice
    may have reached. The open `failures` are marked restored from it."""
    got = snapshots.restore_source(members.backend.node_alive, at_most=found.verified)
    if got is None:
        snapshots.discard_after(found.verified)
        for s in sorted(members.live):
            members.lose(s)
        event("restore", source="pending", step=found.verified, reason="no verified snapshot")
        for f in failures:
            f.restored_from = "pending"
        return None
    step, ref = got
    if members.live:
        members.backend.load(sorted(members.live), ref, timeout_s=60.0)
    snapshots.discard_after(step)
    event("restore", source="snapshot", step=step, verified=True)
    for f in failures:
        f.restored_from = "snapshot"
    return step


def spend_retry(found: Divergence, retries: int, max_retries: int) -> int:
    """A divergence no slice could be named for counts against
    max_retries (a lasting fault would repeat it): the retries used after
    it, or RunFailed once the budget is spent."""
    if retries >= max_retries:
        raise RunFailed(f"the replicas' states diverged at step {found.step} and no slice could be named "
                        f"({found.detail}); the retry budget is spent. Run three or more slices so that a "
                        "majority names the faulty one, or raise max_retries.", setting="max_retries")
    return retries + 1
