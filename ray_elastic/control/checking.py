"""The controller's checks of its slices' work: the state fingerprints
compared after each checked step and the gradient cross-checks issued
before a step and judged after it (control/integrity.py), and the slices'
gradient times (control/stragglers.py). One finding per step at most
comes back to the controller: a `Divergence` (the slice named is evicted
and the run rolls back) or a `Straggler` to take out (no rollback).

A cross-check's recomputation is issued on the checking slices' compute
thread before the step's own gradient calls, so it runs on the state of
its step; the step before a cross-check is therefore not pipelined into
it (`no_ahead`): a call issued ahead could run first and move the state.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from ray_elastic.config import ElasticConfig
from ray_elastic.control.integrity import CrossCheck, Divergence, GradChecks, StateChecks
from ray_elastic.control.stragglers import Straggler, Stragglers
from ray_elastic.control.tie_break import settle, settle_grads

__all__ = ["Checks"]

_FETCH_S = 30.0  # a recomputation is done before its slice's gradients of the step: it is in by the step's end


class Checks:
    def __init__(self, config: ElasticConfig, event):
        self._event = event  # a `diverged` or `straggler` event per finding
        self._config = config
        self.stragglers = Stragglers(config.straggler_factor, config.straggler_steps, config.straggler_min_s)
        self.state = StateChecks(config.state_check_every)
        self.grads = GradChecks(config.grad_check_every)
        self._issued: Optional[tuple[CrossCheck, dict]] = None  # the cross-check in flight, its refs per slice
        self._backend: Any = None

    def keep_state(self, step: int, live: int) -> bool:
        """Whether the state of `step` must be kept as a snapshot: that of a
        cross-check between two slices whose state is checked too, for a
        tie-break to compute the shard's gradient again from
        (tie_break.settle_grads)."""
        return live == 2 and self.grads.due(step) and self.state.every > 0 and step % self.state.every == 0

    def no_ahead(self, step: int) -> bool:
        """Whether step `step` must not be issued ahead (a cross-check's)."""
        return self.grads.due(step)

    def issue(self, step: int, live, assignment: Mapping[int, tuple], backend) -> None:
        """Before step `step`'s calls: a due cross-check's recomputations."""
        self._issued, self._backend = None, backend
        check = self.grads.plan(step, sorted(live), assignment)
        if check is not None:
            self._issued = (check, {s: backend.recompute(s, step, check.shard) for s in check.checkers})

    def after_step(self, step: int, metrics: Mapping[tuple[int, int], dict], snapshots,
                   spares: Sequence[int] = (), backend: Any = None,
                   deadline_s: float = 60.0) -> Optional[Divergence | Straggler]:
        """Step `step` is done (the state is that of `step`): compare (two
        replicas that differ go to a tie-break on `backend`, whose steps
        get twice the step deadline `deadline_s`: one slice computes all
        the shards); tell the
        snapshot store which snapshots no corruption can have reached; look
        for a straggler (`spares`: ready slices that could take its place)."""
        found = self.state.check(metrics) if self.state.every else None
        if found is not None and not found.named and backend is not None:
            found = settle(found, metrics, snapshots, backend, spares, self._config.shards, self._event,
                           step_deadline_s=2 * deadline_s)
        issued, self._issued = self._issued, None
        if found is None and issued is not None and issued[0].step == step - 1:
            prints = self._prints(issued, metrics)
            found = self.grads.judge(issued[0], prints)
            # Told apart only on a state the replicas agreed on (a state
            # check of the check's step): on one that differed, the copy
            # loaded could be the wrong one, and so would the verdict.
            if found is not None and not found.named and backend is not None and self.state.every \
                    and self.state.verified >= issued[0].step:
                found = settle_grads(found, issued[0], prints, snapshots, backend, spares, self._event,
                                     wait_s=max(60.0, 2 * deadline_s), known=self.grads.agreed,
                                     shards=self._config.shards)
        live = {s for s, _ in metrics}
        verified = self.state.verified if self.state.every else step
        snapshots.verified_through(min(verified, self.grads.floor(live)) if self.grads.every else verified)
        if found is not None:
            self._event("diverged", step=found.step, named=[list(k) for k in found.named], verified=found.verified,
                        detail=found.detail)
            return found
        slow = self.stragglers.observe(step, metrics, spare_ready=bool(spares), policy=self._config.policy,
                                       required=self._config.required_slices)
        if slow is not None:
            self._event("straggler", step=step, slice=slow.slice_id, host=slow.host, ratio=slow.ratio,
                        steps=slow.steps, action=slow.action)
        return slow if slow is not None and slow.action != "report" else None

    def _prints(self, issued: tuple, metrics: Mapping[tuple[int, int], dict]) -> dict:
        check, refs = issued
        out: dict = {check.owner: {h: m["grad_prints"][check.shard] for (s, h), m in metrics.items()
                                   if s == check.owner and check.shard in m.get("grad_prints", {})}}
        for s, host_refs in refs.items():
            try:
                got = self._backend.fetch(host_refs, timeout_s=_FETCH_S)
            except Exception:  # the checker was lost or late: the check is missed
                continue
            if got and got[0] is not None:  # None from host 0: the state had moved on, the check is missed
                out[s] = {h: fp for h, fp in enumerate(got) if fp is not None}
        return out

    def restart(self, step: int, cold: bool = False) -> None:
        """The run goes on from `step` (a rollback; `cold`: a cold start)."""
        self._issued = None
        self.state.restart(step)
        self.grads.restart(step, cold)

    @staticmethod
    def timing(metrics: Mapping[tuple[int, int], dict]) -> dict:
        return StateChecks.timing(metrics)
