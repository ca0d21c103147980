"""Every error Ray documents that a step's calls can raise, and what it
says of the worker that raised it: the table `FailureLocator.classify`
reads. An error of the user's own code (a `RayTaskError` whose cause is
not Ray's) is in none of these rows and is raised to the user.

The rows are tried in order, most specific first: the first class an
error is an instance of decides. A row's answer is a failure kind, or
one of two ways to find it:
- DEATH: the worker is gone; whether its process, its node or a
  preemption took it is asked of the node (`_kind_of_death`);
- CONFIRM: Ray lost touch with the worker, which may come back; the
  locator pings it before calling it a failure.
"""

from __future__ import annotations

import re
from typing import Union

from ray import exceptions as rex

from ray_elastic.errors import FailureKind

__all__ = ["CONFIRM", "DEATH", "RAY_ERRORS", "answer", "memory_summary"]

DEATH = "death"
CONFIRM = "confirm"

RAY_ERRORS: tuple[tuple[type, Union[FailureKind, str]], ...] = (
    # Ray's memory monitor killed the worker (the node passed
    # RAY_memory_usage_threshold); the calls in flight get this, later
    # ones ActorDiedError (an OOM death is told by its message, `answer`).
    (rex.OutOfMemoryError, FailureKind.OOM),
    # A host's object store full of objects still in use, and its spill
    # disk too: the host has less memory than the run keeps there.
    (rex.ObjectStoreFullError, FailureKind.OOM),
    (rex.OutOfDiskError, FailureKind.OOM),
    (rex.ActorUnavailableError, CONFIRM),
    (rex.ActorDiedError, DEATH),
    (rex.RayActorError, DEATH),
    # The worker process running a call exited (a crash in native code).
    (rex.WorkerCrashedError, FailureKind.PROCESS_DIED),
    (rex.NodeDiedError, FailureKind.NODE_DIED),
    # A gradient or snapshot held on a lost node (its subclasses: the
    # owner died, a fetch timed out, reconstruction failed).
    (rex.ObjectLostError, FailureKind.NODE_DIED),
    # The slice's placement group was removed under its worker.
    (rex.ActorPlacementGroupRemoved, FailureKind.PROCESS_DIED),
    # Ray's own machinery failed around the call (an RPC, the worker's
    # core): the worker is asked whether it still lives.
    (rex.RaySystemError, DEATH),
    (rex.RpcError, DEATH),
    # A call cancelled while it ran: only ray_elastic cancels, and only
    # calls of a worker it gave up on.
    (rex.TaskCancelledError, FailureKind.PROCESS_DIED),
    # A wait with a timeout ran out: the worker did not answer in time.
    (rex.GetTimeoutError, FailureKind.HUNG),
)

# How Ray's memory monitor words a kill (node_manager's message, Ray 2.60;
# the older wording too), in the error of a call in flight and in the
# death cause of the actor.
_OOM_WORDS = ("running low on memory", "memory monitor", "killed due to memory")
_NODE_MEMORY = (re.compile(r"was ([\d.]+)\s*GB used\s*/\s*([\d.]+)\s*GB limit"),
                re.compile(r"was ([\d.]+)\s*GB\s*/\s*([\d.]+)\s*GB\s*\("))
_THRESHOLD = (re.compile(r"threshold of \d+B \(([\d.]+)% of"),
              re.compile(r"memory usage threshold of (\d+(?:\.\d+)?)"))
_WORKER_MEMORY = re.compile(r"memory used=([\d.]+)\s*GB")


def answer(exc: BaseException) -> Union[FailureKind, str, None]:
    """The row's answer for `exc`, or None where no row takes it."""
    for cls, kind in RAY_ERRORS:
        if isinstance(exc, cls):
            if kind == DEATH and _killed_for_memory(exc):
                return FailureKind.OOM
            return kind
    return None


def _killed_for_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(w in text for w in _OOM_WORDS)


def memory_summary(exc: BaseException) -> str:
    """One line for an out-of-memory error: what the worker used and
    what the node had, as Ray's message gives them."""
    text = str(exc)
    if isinstance(exc, (rex.ObjectStoreFullError, rex.OutOfDiskError)):
        what = "object store full" if isinstance(exc, rex.ObjectStoreFullError) else "object store and spill disk full"
        return f"{what} on the host's node: {text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__}"
    parts = ["killed by Ray's memory monitor"]
    used = [float(x) for x in _WORKER_MEMORY.findall(text)]
    if used:  # the workers it chose to kill: the largest is the one that grew
        parts.append(f"the worker used {max(used):.2f} GB")
    node = next((m for m in (r.search(text) for r in _NODE_MEMORY) if m), None)
    if node:
        at = f"the node was at {float(node.group(1)):.2f} GB of {float(node.group(2)):.2f} GB"
        limit = next((m for m in (r.search(text) for r in _THRESHOLD) if m), None)
        if limit:
            value = float(limit.group(1))
            at += f" (kill threshold {value / 100 if value > 1 else value:.2f})"
        parts.append(at)
    return parts[0] + ("; " + "; ".join(parts[1:]) if parts[1:] else "")
