"""Control-flow errors internal to ray_elastic: raised and caught inside it,
never shown to a user. They share the picklable base `ElasticError` because
some cross process boundaries (a worker's call, a group leader's reply)."""

from __future__ import annotations

from ray_elastic.errors import ElasticError

__all__ = ["InputsAborted", "InputsLost", "StepAborted", "SumAgain"]


class InputsAborted(ElasticError, RuntimeError):
    """A worker's apply or reduction stopped waiting for its inputs: the
    controller said a slice's node was lost (worker/inputs.py)."""


class InputsLost(ElasticError, RuntimeError):
    """Fetching a worker's inputs failed outside Ray's own errors (a
    connection reset while the node holding them, or the worker's own,
    goes away)."""


class StepAborted(ElasticError):
    """A group leader's part of a step was called off by the driver (another
    group failed first); what it had issued is kept for a later try."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"step {step} called off by the driver")

    def __reduce__(self):
        return (type(self), (self.step,))


class SumAgain(ElasticError):
    """Internal to grouped_runner: a group leader died before the driver's
    sum of the groups' gradients was made; its replacement issued its part
    again, and the sum is made again. Never reaches the user."""
