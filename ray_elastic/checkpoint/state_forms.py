"""The forms a training state takes between processes, told apart by
their type (a worker's `load` takes any of them):

- `FlatState`: a replicated slice's in-memory snapshot, one flat buffer
  (made by one jitted ravel: one copy, not one per leaf);
- `HostBlocks`: one host's own blocks of a sharded state (its snapshot,
  its copy for the same host index of a joining slice);
- `WholeState`: whole host arrays: a replicated slice's copy for a joining
  slice, a checkpoint restored by the driver's writer.

A sharded checkpoint read by the hosts themselves is `HostRestore`
(host_writes.py): no state crosses the driver then.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["FlatState", "HostBlocks", "WholeState", "final_state", "whole_state"]


@dataclasses.dataclass(frozen=True)
class FlatState:
    step: int
    flat: Any  # 1-D numpy buffer of params then opt_state leaves (unflatten: store.py)


@dataclasses.dataclass(frozen=True)
class HostBlocks:
    step: int
    blocks: dict  # (tag "p" | "o", leaf index, block key) -> array (worker/shards.py)
    host: int

    def as_dict(self) -> dict:
        return {"step": self.step, "blocks": self.blocks, "host": self.host}


@dataclasses.dataclass(frozen=True)
class WholeState:
    step: int
    params: Any
    opt_state: Any
    meta: Optional[dict] = None  # a checkpoint's run facts

    def trees(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state}

    def as_dict(self) -> dict:
        return {"step": self.step, **self.trees()}


def final_state(copy) -> dict | tuple:
    """The user's `final_state`: {"step", "params", "opt_state"} of host
    arrays (replicated), or one {"step", "blocks", "host"} per host (sharded)."""
    return tuple(part.as_dict() for part in copy) if isinstance(copy, tuple) else copy.as_dict()


def whole_state(final: dict | tuple, template: Optional[dict] = None) -> dict:
    """{"step", "params", "opt_state"} of whole host arrays from a
    `final_state` of either form: as it is (replicated), or the hosts'
    blocks put together on `template`, the state's tree of shapes and
    dtypes (sharded)."""
    if not isinstance(final, tuple):
        return final
    from ray_elastic.checkpoint.store import assemble

    if template is None:
        raise ValueError("a sharded final state needs the state's template to be made whole")
    parts = [HostBlocks(p["step"], p["blocks"], p["host"]) for p in final]
    return {"step": parts[0].step, **assemble(parts, template)}
