"""The one place where Ray's errors become ray_elastic's failure kinds.

`classify` is called where a worker call's error enters the controller.
An `ActorUnavailableError` is *not* a death: the actor may be restarting
its connection. It is confirmed first (node state in the GCS, then a ping)
and only a confirmed loss becomes a failure.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import ray
from ray import exceptions as rex

from ray_elastic.errors import FAILURE_TYPES, FailureKind, SliceFailure

__all__ = ["classify", "is_node_alive", "TRANSIENT"]

TRANSIENT = None  # classify's answer for "not a failure: re-issue the call"


def is_node_alive(node_id: str) -> bool:
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return bool(node["Alive"])
    return False


def _kind_of_death(exc: BaseException, node_id: str) -> FailureKind:
    if getattr(exc, "preempted", False):
        return FailureKind.PREEMPTED
    if not is_node_alive(node_id):
        return FailureKind.NODE_DIED
    return FailureKind.PROCESS_DIED


def classify(
    exc: BaseException,
    node_id: str,
    ping: Callable[[float], None],
    confirm_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
) -> Optional[FailureKind]:
    """Sort a worker call's error into a FailureKind, or TRANSIENT.

    ping(timeout) must raise if the worker does not answer in time.
    Errors that are not about the worker's life (a bug in the user's loss
    function, say) are re-raised: retrying them would only fail again.
    """
    if isinstance(exc, rex.ActorDiedError):
        return _kind_of_death(exc, node_id)
    if isinstance(exc, rex.ActorUnavailableError):
        end = clock() + confirm_s
        while clock() < end:
            if not is_node_alive(node_id):
                return FailureKind.NODE_DIED
            try:
                ping(0.5)
                return TRANSIENT
            except rex.ActorDiedError as died:
                return _kind_of_death(died, node_id)
            except (rex.ActorUnavailableError, rex.GetTimeoutError):
                time.sleep(0.1)
        return FailureKind.NODE_DIED if not is_node_alive(node_id) else FailureKind.HUNG
    if isinstance(exc, (rex.ObjectLostError, rex.OwnerDiedError)):
        # A gradient or snapshot held on a lost node: the node is gone.
        return FailureKind.NODE_DIED
    raise exc


def failure(kind: FailureKind, slice_id: int, host: int, step: int, cause: str) -> SliceFailure:
    return FAILURE_TYPES[kind](slice_id, host, step, cause)
