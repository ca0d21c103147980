"""When the controller may issue the next step before this one is done.

Pipelined dispatch (step_runner) issues step k+1's pure calls (gradients,
reduction tree) while step k is still running, on step k's slices and
shards. That pays only if the step boundary between them keeps the slices:
a pure function of the controller's view, so it is tested without Ray.
Whatever the boundary then does (a preemption notice, a failure, a slice
that came up meanwhile) wins: the runner drops calls issued for other
slices, shards or workers, and never reads their results.
"""

from __future__ import annotations

from typing import Mapping, Optional

from ray_elastic.config import ElasticConfig
from ray_elastic.control.policy import Continue, SlicesView, Tick, decide

__all__ = ["next_assignment"]


def next_assignment(view: SlicesView, config: ElasticConfig, step: int, steps: int, now: float,
                    assignment: Mapping[int, tuple]) -> Optional[dict]:
    """The shards of step `step` + 1 when it will run on the same slices as
    far as is known at `now` (the policy says Continue: nothing to join,
    not waiting), else None. None after the run's last step."""
    if step + 1 >= steps or not isinstance(decide(Tick(), view, config, now), Continue):
        return None
    return dict(assignment)
