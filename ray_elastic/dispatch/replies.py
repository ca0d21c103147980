"""What a group leader answers its driver (leader.py answers,
grouped_runner.py reads): one small frozen dataclass per kind of answer,
told apart by its class. They cross a process boundary, so they hold
plain data, refs, tree.Top and a SliceFailure (whose fields pickle with
it)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union

from ray_elastic.errors import SliceFailure

__all__ = ["Applied", "CalledOff", "Failed", "LeaderReply", "LeaderPhase", "Ready", "Reissued"]


class LeaderPhase(str, enum.Enum):
    """Where a leader's step failed. In its gradient phase (with its
    subtrees), which depends on nothing outside its group: a failure of
    its own. In the apply: possibly only an echo of a failure elsewhere
    (the driver's sum never came), so the driver ranks it last."""

    GRADS = "grads"
    APPLY = "apply"


@dataclasses.dataclass(frozen=True)
class Ready:
    """`begin` or `finish`: the group's gradient calls and subtrees of the
    step are issued; the subtrees' tops, in shard order, for the driver to
    sum."""

    tops: tuple  # of tree.Top
    shards_recomputed: int = 0  # finish: how many of its range's shards the group computed again


@dataclasses.dataclass(frozen=True)
class Applied:
    """`step`: the group applied the step."""

    metrics: dict  # (slice, host) -> the apply's metrics
    next_tops: Optional[tuple]  # the next step's subtrees' tops, issued behind the applies; None if not issued


@dataclasses.dataclass(frozen=True)
class Reissued:
    """`step`: a gradient or subtree call of the group was re-issued, so the
    driver's sum over the first tops is void: the subtrees were made again
    over the gradients (all in), and these are their tops, to sum again."""

    tops: tuple  # of tree.Top


@dataclasses.dataclass(frozen=True)
class CalledOff:
    """The driver called the call off (`abort`) before it ended."""


@dataclasses.dataclass(frozen=True)
class Failed:
    """A slice of the group was lost: the failure, sorted as the driver
    would, and where in the step."""

    failure: SliceFailure
    phase: LeaderPhase


LeaderReply = Union[Ready, Applied, Reissued, CalledOff, Failed]
