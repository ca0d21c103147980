"""State checks: the slices are data-parallel replicas whose state is
bitwise identical after every step, so fingerprints of it that differ
mean one slice's memory or math went wrong (silent data corruption).

Every `state_check_every` steps each host returns, with its apply's
metrics, one fingerprint per local device of the shards that device holds
(worker/fingerprint.py). The same host index of every slice holds the same
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
newest such snapshot. `StateChecks` is pure (the controller feeds it the
step's metrics); `roll_back` carries the rollback out on the slices.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Optional

from ray_elastic.errors import RunFailed

__all__ = ["Divergence", "StateChecks", "roll_back", "spend_retry"]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The state of `step` differs between replicas. `named`: (slice,
    host) of each replica found odd (empty: none could be told apart);
    `verified`: the newest step whose check agreed."""

    step: int
    named: tuple[tuple[int, int], ...]
    verified: int
    detail: str


class StateChecks:
    def __init__(self, every: int, start_step: int = 0):
        self.every = every  # 0: off
        self.verified = start_step  # the newest step the replicas agreed on (or the run started from)

    def restart(self, step: int) -> None:
        """The run goes on from `step` (a rollback, a cold start): a state
        every live slice loaded from one copy."""
        self.verified = step

    def after_step(self, step: int, metrics: Mapping[tuple[int, int], dict], snapshots) -> Optional[Divergence]:
        """Check the step (when checks are on) and tell the snapshot store
        which snapshots are verified (every one, with checks off)."""
        found = self.check(step, metrics) if self.every else None
        snapshots.verified_through(self.verified if self.every else step)
        return found

    @staticmethod
    def timing(metrics: Mapping[tuple[int, int], dict]) -> dict:
        """{"check_s": the slowest host's fingerprint seconds} for a checked
        step's metrics (what the check cost the step); {} otherwise."""
        took = [m["fingerprint_s"] for m in metrics.values() if "fingerprint_s" in m]
        return {"check_s": max(took)} if took else {}

    def check(self, step: int, metrics: Mapping[tuple[int, int], dict]) -> Optional[Divergence]:
        """Compare the fingerprints in the step's metrics ((slice, host) ->
        the apply's metrics); None when they agree (or there are none)."""
        prints = {key: tuple(m["fingerprint"]) for key, m in metrics.items() if "fingerprint" in m}
        if not prints:
            return None
        odd: set[tuple[int, int]] = set()
        notes = []
        for key, fp in prints.items():
            if metrics[key].get("replicated") and len(set(fp)) > 1:
                odd.add(key)
                notes.append(f"slice {key[0]} host {key[1]}: its devices hold different bits")
        unresolved = False
        for host in sorted({h for _, h in prints}):
            by_slice = {s: fp for (s, h), fp in prints.items() if h == host}
            counts = collections.Counter(by_slice.values())
            if len(counts) == 1:
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
            self.verified = step
            return None
        return Divergence(step, tuple(sorted(odd)), self.verified, "; ".join(notes))


def roll_back(members, snapshots, found: Divergence, event) -> Optional[int]:
    """Load the newest verified snapshot into every live slice; its step.
    None when no verified snapshot survives: the snapshots past the
    verified step are dropped and every live slice is queued again, so the
    run goes back as after losing them all (to a checkpoint at or before
    it, else the initial state) and never keeps a state a corrupted slice
    may have reached."""
    got = snapshots.restore_source(members.backend.node_alive, verified=True)
    if got is None:
        snapshots.discard_after(found.verified)
        for s in sorted(members.live):
            members.lose(s)
        event("restore", source="pending", step=found.verified, reason="no verified snapshot")
        return None
    step, ref = got
    if members.live:
        members.backend.load(sorted(members.live), ref, timeout_s=60.0)
    snapshots.discard_after(step)
    event("restore", source="snapshot", step=step, verified=True)
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
