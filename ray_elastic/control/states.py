"""The controller's run state (`Running`, `Waiting`, `Stopping`) and the
failures whose recovery is still open: plain data the controller keeps."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

__all__ = ["OpenFailure", "RunState", "Running", "Stopping", "Waiting"]


@dataclasses.dataclass(frozen=True)
class Running:
    fresh: bool = True  # the next step is the first since a (re)start: it may compile


@dataclasses.dataclass(frozen=True)
class Waiting:
    since: float  # training paused for replacements since then


@dataclasses.dataclass(frozen=True)
class Stopping:
    reason: str


RunState = Union[Running, Waiting, Stopping]


@dataclasses.dataclass
class OpenFailure:
    """A failure whose recovery (the next completed step) is pending."""

    slice_id: int
    step: int  # the step in flight when it happened
    t_fault: float
    steps_rewound: int = 0
    restored_from: str = ""
    compute_redone: Optional[float] = None  # None: steps_rewound whole steps
