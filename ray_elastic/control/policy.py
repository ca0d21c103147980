"""Recovery policies: pure functions of (event, view of the slices, time).

The controller builds a `SlicesView`, asks `decide`, and carries out the
returned decision. Nothing here touches Ray or reads the clock, so every
branch is unit-tested without a cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from ray_elastic.config import ElasticConfig
from ray_elastic.errors import (
    FailureKind,
    ReplacementTimeout,
    RetryBudgetExhausted,
    RunFailed,
)

__all__ = [
    "SliceLost",
    "Tick",
    "SlicesView",
    "Continue",
    "Shrink",
    "Wait",
    "Grow",
    "Fail",
    "decide",
]


# Events -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SliceLost:
    """One slice failed; already sorted into a kind."""

    slice_id: int
    kind: FailureKind
    step: int


@dataclasses.dataclass(frozen=True)
class Tick:
    """A step boundary, or a beat while waiting for replacements."""


Event = Union[SliceLost, Tick]


@dataclasses.dataclass(frozen=True)
class SlicesView:
    """What the controller knows about its slices at one moment."""

    num_slices: int
    live: frozenset[int]  # slices training now
    ready_to_join: frozenset[int]  # replacements built and warmed up
    retries_used: int  # failures absorbed so far, not counting this event
    waiting_since: Optional[float] = None  # set while training is paused


# Decisions ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Continue:
    """Go on training with the live slices."""


@dataclasses.dataclass(frozen=True)
class Shrink:
    """Train on at once with these (surviving) slices."""

    slices: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Wait:
    """Pause training until replacements are ready, at most until `deadline`."""

    deadline: float


@dataclasses.dataclass(frozen=True)
class Grow:
    """At this step boundary, train with these slices (live plus joined)."""

    slices: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Fail:
    error: RunFailed


Decision = Union[Continue, Shrink, Wait, Grow, Fail]


def decide(event: Event, view: SlicesView, config: ElasticConfig, now: float) -> Decision:
    if isinstance(event, SliceLost):
        return _on_loss(event, view, config, now)
    return _on_tick(view, config, now)


def _on_loss(event: SliceLost, view: SlicesView, config: ElasticConfig, now: float) -> Decision:
    if view.retries_used >= config.max_retries:
        return Fail(
            RetryBudgetExhausted(
                f"slice {event.slice_id} failed ({event.kind.value}) at step "
                f"{event.step}, and the run had already absorbed "
                f"{view.retries_used} failures: the retry budget is spent. "
                "Raise max_retries (MaxText: elastic_max_retries) to absorb more.",
                setting="max_retries",
            )
        )
    survivors = view.live - {event.slice_id}
    if config.policy == "resize" and len(survivors) >= config.required_slices:
        return Shrink(frozenset(survivors))
    if view.waiting_since is not None:
        # A second loss while already waiting keeps the first deadline.
        return Wait(view.waiting_since + config.timeout_s)
    return Wait(now + config.timeout_s)


def _joinable(view: SlicesView) -> frozenset[int]:
    """Live slices plus ready ones, up to num_slices in all: ready slices
    beyond that stay as hot spares (lowest ids join first)."""
    room = max(0, view.num_slices - len(view.live))
    return frozenset(view.live) | frozenset(sorted(view.ready_to_join)[:room])


def _on_tick(view: SlicesView, config: ElasticConfig, now: float) -> Decision:
    ready = _joinable(view)
    if view.waiting_since is None:
        return Grow(ready) if ready != view.live else Continue()
    if len(ready) >= config.required_slices:
        return Grow(ready)
    deadline = view.waiting_since + config.timeout_s
    if now >= deadline:
        setting = "timeout_s (MaxText: elastic_timeout_seconds)"
        hint = f"Raise {setting}, or add capacity to the cluster"
        if config.policy == "pause":
            hint += ", or use policy='resize' to train on with fewer slices"
        else:
            hint += ", or lower min_slices (MaxText: elastic_min_slice_count)"
        return Fail(
            ReplacementTimeout(
                f"waited {config.timeout_s:g} s for replacement slices; only "
                f"{len(ready)} of the {config.required_slices} required are "
                f"ready. {hint}.",
                setting="timeout_s",
            )
        )
    return Wait(deadline)
