"""The tie-break between two replicas whose states differ.

With two slices a state check that disagrees cannot say which one went
wrong (control/integrity.py). Every step is a deterministic function of
(state, step, shards), whichever slice computes it, so the state the
replicas should hold at the divergent step can be made again from the
newest snapshot both agreed on, and compared:

- with a ready spare: the spare loads that snapshot and replays the steps
  alone, every shard assigned to it: a third computation, on other chips;
  a slice whose fingerprints differ from the spare's is named (none when
  both do);
- without one, each of the two slices loads it and replays the steps
  alone: a slice whose replay makes its own state of that step again is
  consistent; when exactly one of the two is, the other is named (its
  state was made wrong once, or its chips make wrong numbers unevenly).
  Two that each repeat their own result (a fault that repeats exactly) or
  neither leave it unnamed, as before.

Either way the run then goes on as after any divergence: a named slice is
evicted, and every live slice rolls back to the verified snapshot (the
replays' states are not kept: a named slice's would be the suspect one).

A gradient cross-check between two slices that disagree is told apart
the same way, with no replay: each cross-check step's state is kept as a
snapshot while two slices are live (checking.py), so the spare, or else
each of the two, loads that very state (the one both computed from,
whatever earlier gradients made it) and computes the shard's gradient
again (`settle_grads`); `judge` reads the fingerprints as it reads the
states'. Two that each repeat their own gradient (a fault that lasts, on
one of them) then get a known answer to match: each computes again the
gradient of the newest cross-check both had agreed on, from that check's
state (the newest verified snapshot, which the store keeps); the slice
whose chips went bad since no longer makes it.

`judge` is pure; `settle` and `settle_grads` carry the work out on the
backend.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Optional, Sequence

from ray_elastic.control.integrity import Divergence
from ray_elastic.errors import without_frames

__all__ = ["judge", "settle", "settle_grads"]

# Seconds a replay's load and fingerprint may take, at least.
_REPLAY_BASE_S = 60.0

Prints = Mapping[int, tuple]  # host -> that host's fingerprints of the state


def judge(found: Divergence, original: Mapping[int, Prints], replayed: Mapping[int, Prints],
          spare: Optional[int] = None, redo: str = "replayed it", made: str = "state") -> Divergence:
    """`found` (unnamed, two slices) with the slice the replays single out
    named, or as it was. `original`: each slice's fingerprints of the
    state of `found.step`; `replayed`: those of the same state made again
    (by the `spare`, or by each slice itself), for the slices whose replay
    came back. `redo` and `made` word the detail: how it was made again,
    and what."""
    if spare is not None:
        truth = replayed.get(spare)
        if truth is None:
            return found
        odd = sorted((s, h) for s, prints in original.items() for h, fp in prints.items() if truth.get(h) != fp)
        if not odd or len({s for s, _ in odd}) == len(original):  # none, or both: no majority
            return found
        how = f"the spare, slice {spare}, {redo} and agrees with the other"
    else:
        consistent = {s for s in original if replayed.get(s) == original[s]}
        if len(consistent) != 1 or len(replayed) != len(original):
            return found
        [bad] = [s for s in original if s not in consistent]
        odd = sorted((bad, h) for h, fp in original[bad].items() if original[next(iter(consistent))].get(h) != fp)
        how = (f"each slice {redo} alone: slice {next(iter(consistent))} made its own {made} again, "
               f"slice {bad} did not")
    return dataclasses.replace(found, named=tuple(odd), detail=f"{found.detail}; tie-break: {how}")


def _no_phase(phase: str = "grads") -> None:
    """A replay's steps have no faults to fire as their phases are issued."""


def _settle_calls(backend, slice_id: int, step: int) -> None:
    """After a failed replay step: let the slice's calls still in flight
    end (or give up waiting for inputs), so none runs under the rollback's
    load; the next step finds the slice lost if it is."""
    try:
        backend.held_steps([slice_id], step, abort_waits=True)
    except Exception as e:  # a SliceFailure, or no answer: the next step sees it
        without_frames(e)


def settle(found: Divergence, metrics: Mapping[tuple[int, int], dict], snapshots, backend, spares: Sequence[int],
           shards: int, event: Callable[..., None], clock: Callable[[], float] = time.monotonic,
           step_deadline_s: float = 60.0) -> Divergence:
    """Try to name the slice behind an unnamed state divergence between
    two slices (a `tie_break` event says how it went); `found` as it was
    when there is nothing to replay from or the replays fail. A replay is
    a run of ordinary steps on the replaying slice alone, all `shards`
    assigned to it, so its gradients are summed in the very order of every
    other step (a resized run's bits are a full one's); each gets
    `step_deadline_s`."""
    original: dict = {}
    for (s, h), m in metrics.items():
        fp = m.get("fingerprints", {}).get(found.step)
        if fp is not None:
            original.setdefault(s, {})[h] = tuple(fp)
    if found.named or len(original) != 2:
        return found
    got = snapshots.restore_source(backend.node_alive, at_most=found.verified)
    if got is None:  # the rollback goes back further too (integrity.roll_back)
        event("tie_break", step=found.step, by=None, named=[], reason="no verified snapshot to replay from")
        return found
    start, ref = got
    spare = min(spares) if spares else None
    replayers = [spare] if spare is not None else sorted(original)
    t0, replayed, wait_s = clock(), {}, max(_REPLAY_BASE_S, step_deadline_s)
    for s in replayers:
        try:
            backend.load([s], ref, timeout_s=wait_s)
            for k in range(start, found.step):
                backend.run_step(k, [s], {s: tuple(range(shards))}, frozenset(), step_deadline_s, _no_phase)
            replayed[s] = {h: tuple(fp) for h, fp in enumerate(backend.fetch(backend.fingerprint(s),
                                                                              timeout_s=wait_s))}
        except Exception:  # lost, hung or failed in its replay: no vote from that slice
            _settle_calls(backend, s, found.step)
    settled = judge(found, original, replayed, spare)
    event("tie_break", step=found.step, replayed_from=start, by="spare" if spare is not None else "replay",
          slices=replayers, named=[list(k) for k in settled.named], seconds=round(clock() - t0, 3))
    return settled


def settle_grads(found: Divergence, check, prints: Mapping[int, Mapping[int, int]], snapshots, backend,
                 spares: Sequence[int], event: Callable[..., None], clock: Callable[[], float] = time.monotonic,
                 wait_s: float = _REPLAY_BASE_S, known: Optional[tuple] = None,
                 shards: int = 0) -> Optional[Divergence]:
    """Try to name the slice behind an unnamed cross-check mismatch
    between two slices (`check`, a CrossCheck; `prints`: each slice's
    {host: fingerprint} of the shard's gradient): the spare, or else each
    of the two, loads the snapshot of the check's step and computes the
    gradient again. Two that each repeat their own (a lasting fault)
    then face a known answer, `known`: (the newest cross-check both
    agreed on, its {host: fingerprint}); each loads that check's state
    (the newest verified snapshot) and computes its shard again, and the
    one that no longer makes the agreed gradient is named. `found` as it
    was when the snapshots are gone (a `tie_break` event says how it
    went). None (no divergence) when the two, computing again, both make
    the gradient the step applied and only the checker's first print
    stands apart: nothing wrong entered the state, and one computation
    not repeated names no slice (`_checker_not_repeated`)."""
    original = {s: dict(p) for s, p in prints.items() if p}
    if found.named or len(original) != 2:
        return found
    snapshots.wait_sealed(timeout=wait_s)  # the check step's snapshot may still be sealing
    got = snapshots.restore_source(backend.node_alive, at_most=check.step)
    if got is None or got[0] != check.step:
        event("tie_break", step=check.step, by=None, named=[], reason="no snapshot of the cross-check's step")
        return found
    spare = min(spares) if spares else None
    t0 = clock()
    slices = [spare] if spare is not None else sorted(original)
    again = _recompute(backend, slices, got[1], check.step, check.shard, wait_s)
    if spare is None and _checker_not_repeated(check, original, again):
        # The slices now hold the check step's state: the steps since are
        # taken again (the same bits: a step is a deterministic function
        # of its state, step and shards); if that fails, the run rolls
        # back as after any divergence no slice is named for.
        back = _retake(backend, slices, check.step, found.step, shards, wait_s)
        event("tie_break", step=check.step, of="gradient", shard=check.shard, by="replay", slices=slices,
              named=[], dismissed="the checker's first computation was not repeated; both slices computed the "
              "gradient the step applied again", retaken=back, seconds=round(clock() - t0, 3))
        return None if back else found
    settled = judge(found, original, again, spare, redo="computed it again", made="gradient")
    fields = {"by": "spare" if spare is not None else "replay", "slices": sorted(again) if spare is None else [spare]}
    if (not settled.named and spare is None and known is not None and known[0].step < check.step
            and all(again.get(s) == original[s] for s in original)):
        settled, fields = _known_answer(settled, known, snapshots, backend, slices, wait_s), {
            "by": "known_answer", "slices": slices, "known_step": known[0].step, "known_shard": known[0].shard}
    event("tie_break", step=check.step, of="gradient", shard=check.shard, **fields,
          named=[list(k) for k in settled.named], seconds=round(clock() - t0, 3))
    return settled


def _checker_not_repeated(check, original: Mapping[int, Mapping], again: Mapping[int, Mapping]) -> bool:
    """Whether only the checker's first computation stands apart: both
    slices, from the check step's state, computed again the owner's
    gradient (the one the step applied) and the checker did not make its
    own first print again. Nothing wrong entered the state, and no chip is
    shown to compute wrong: one computation that was not repeated is no
    evidence to evict a slice on (a lasting fault shows again at the
    next check)."""
    owner, checkers = check.owner, [s for s in original if s != check.owner]
    if owner not in original or len(checkers) != 1 or set(again) != set(original):
        return False
    [checker] = checkers
    return again[owner] == original[owner] == again[checker] != original[checker]


def _retake(backend, slices: Sequence[int], start: int, end: int, shards: int, wait_s: float) -> bool:
    """Take steps `start` .. `end` - 1 again on `slices` (which hold the
    state of `start`), every shard assigned round robin; whether all
    were taken."""
    if shards < 1:
        return False
    assignment = {s: tuple(range(i, shards, len(slices))) for i, s in enumerate(slices)}
    try:
        for k in range(start, end):
            backend.run_step(k, list(slices), assignment, frozenset(), wait_s, _no_phase)
    except Exception:  # lost or failed: the rollback to the verified state follows
        for s in slices:
            _settle_calls(backend, s, end)
        return False
    return True


def _recompute(backend, slices: Sequence[int], source, step: int, shard: int, wait_s: float) -> dict:
    """Each slice loads `source` (the state of `step`) and computes the
    gradient of `shard` again: {slice: {host: fingerprint}} of those that
    answered."""
    out: dict = {}
    for s in slices:
        try:
            backend.load([s], source, timeout_s=wait_s)
            fps = backend.fetch(backend.recompute(s, step, shard), timeout_s=wait_s)
            if fps and fps[0] is not None:  # None: the slice's state was not the check's (missed)
                out[s] = {h: fp for h, fp in enumerate(fps) if fp is not None}
        except Exception:  # lost or failed in its recomputation: no vote from that slice
            _settle_calls(backend, s, step)
    return out


def _known_answer(found: Divergence, known: tuple, snapshots, backend, slices: Sequence[int],
                  wait_s: float) -> Divergence:
    """Both slices repeat their own gradient: a lasting fault on one of
    them. Each computes again the gradient of the newest cross-check both
    had agreed on, from that check's state: a slice whose chips now
    compute wrong no longer makes it; the other does (a step is a
    deterministic function of its state, step and shard)."""
    check, agreed = known
    got = snapshots.restore_source(backend.node_alive, at_most=check.step)
    if got is None or got[0] != check.step:
        return found
    again = _recompute(backend, slices, got[1], check.step, check.shard, wait_s)
    if len(again) != len(slices):
        return found
    odd = sorted((s, h) for s in slices for h, fp in agreed.items() if again[s].get(h) != fp)
    bad = {s for s, _ in odd}
    if len(bad) != 1:  # both make it again (the fault is not lasting) or neither
        return found
    [b] = bad
    [good] = [s for s in slices if s != b]
    how = (f"each slice repeated its own gradient, then computed again that of shard {check.shard} at step "
           f"{check.step}, which both had agreed on: slice {good} made it again, slice {b} did not")
    return dataclasses.replace(found, named=tuple(odd), detail=f"{found.detail}; tie-break: {how}")
