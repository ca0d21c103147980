"""Every error a user of ray_elastic can meet, in one picklable hierarchy.
(Control-flow errors that never leave ray_elastic are in failures/internal.py.)

Failures of workers are sorted once, where they enter the controller
(`failures.location.FailureLocator.classify`), into the closed set `FailureKind`. Each exception
carries plain data (ints, strings), so it survives pickling between
processes and can be caught in a notebook, a job driver, or a test. (A
slice failure's `partial` is the exception: the calls of a step in
flight, for the process that made them; a group leader keeps its own and
sends the driver the failure without it.)
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "ElasticError",
    "ConfigError",
    "FailureKind",
    "SliceFailure",
    "without_frames",
    "WorkerProcessDied",
    "NodeDied",
    "WorkerHung",
    "SlicePreempted",
    "WorkerOutOfMemory",
    "RunFailed",
    "NonFiniteLoss",
    "RetryBudgetExhausted",
    "ReplacementTimeout",
    "StorageError",
    "CheckpointStorageFailed",
    "CheckpointSaveFailed",
    "StateLoadFailed",
    "CheckpointDamaged",
    "EventsFileError",
    "TimelineInputError",
]


class ElasticError(Exception):
    """Base of every ray_elastic error."""


class ConfigError(ElasticError, ValueError):
    """A setting is invalid; `setting` names it. Raised before any cluster
    resource is reserved for everything the driver can check alone (configs,
    faults, paths, group-leader ranges). What depends on the program or on
    a slice's devices (a layout's mesh against the devices, a batch that
    does not split over them, group leaders with a sharded layout) is found
    when the workers set up or at the first step, and ends the run with
    this error."""

    def __init__(self, setting: str, problem: str):
        self.setting = setting
        self.problem = problem
        super().__init__(f"{setting}: {problem}")

    def __reduce__(self):
        return (type(self), (self.setting, self.problem))


class FailureKind(str, enum.Enum):
    """The closed set of ways a slice can fail."""

    PROCESS_DIED = "process_died"  # a worker process exited or was killed
    NODE_DIED = "node_died"  # the node hosting a worker left the cluster
    HUNG = "hung"  # no step finished within the step deadline
    PREEMPTED = "preempted"  # the node was drained with a preemption notice
    CORRUPTED = "corrupted"  # its state or math differs from the other replicas' (silent data corruption)
    STRAGGLER = "straggler"  # it computed its shards slower than the others for many steps, and was swapped out
    OOM = "oom"  # a host ran out of memory: Ray's memory monitor killed its worker, or its object store or spill disk filled


class SliceFailure(ElasticError):
    """A slice was lost. The controller catches these and recovers by policy.

    Beside where and why, a failure carries what the controller's recovery
    needs to know of it, set where it is found: `partial`, what the step
    had done (dispatch.step_runner.PartialStep: the survivors' gradients,
    kept so the step can be finished rather than redone); `node_silent`,
    the host's node answers nothing (frozen or cut off: it keeps its
    bundle of the slice's placement group, so the replacement needs a new
    group); `leader_partial`, a group leader kept its group's survivors'
    gradients (the partial itself stays on the leader)."""

    kind: FailureKind = FailureKind.PROCESS_DIED

    def __init__(self, slice_id: int, host: int, step: int, cause: str, partial: Any = None,
                 node_silent: bool = False, leader_partial: bool = False):
        self.slice_id = slice_id
        self.host = host
        self.step = step
        self.cause = cause
        self.partial = partial
        self.node_silent = node_silent
        self.leader_partial = leader_partial
        super().__init__(
            f"slice {slice_id} host {host} failed at step {step} "
            f"({self.kind.value}): {cause}"
        )

    def __reduce__(self):
        return (type(self), (self.slice_id, self.host, self.step, self.cause, self.partial, self.node_silent,
                             self.leader_partial))

    def replace(self, **changes: Any) -> "SliceFailure":
        """A copy of this failure, of the same kind, with the fields named in
        `changes` changed (as dataclasses.replace)."""
        fields = dict(slice_id=self.slice_id, host=self.host, step=self.step, cause=self.cause,
                      partial=self.partial, node_silent=self.node_silent, leader_partial=self.leader_partial)
        fields.update(changes)
        return type(self)(**fields)


def without_frames(e: BaseException) -> BaseException:
    """`e`, and every exception it was raised from or while handling, with
    its traceback dropped; returns `e`. A failure found as a value and then
    raised (`lost = locator.watch(...); raise lost`) is held by the frame
    its own traceback holds: a reference cycle, freed only when Python's
    cyclic collector next runs, which can be many minutes in a long run.
    Until then every ObjectRef those frames held (a step's gradient chunks,
    its calls still pending) keeps its object in Ray's object store. The
    controller drops the frames of each failure it handles: a failure's
    kind, place and cause are what it acts on, never its traceback."""
    stack, seen = [e], set()
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        x.__traceback__ = None
        stack += [x.__cause__, x.__context__]
    return e


class WorkerProcessDied(SliceFailure):
    kind = FailureKind.PROCESS_DIED


class NodeDied(SliceFailure):
    kind = FailureKind.NODE_DIED


class WorkerHung(SliceFailure):
    kind = FailureKind.HUNG


class SlicePreempted(SliceFailure):
    kind = FailureKind.PREEMPTED


class SliceCorrupted(SliceFailure):
    """The slice's replicas of the state (or its recomputed gradient)
    differ from the others': its chips compute or hold wrong numbers. It
    is evicted (its nodes never used again in the run) and the run rolls
    back to a snapshot no corrupted computation touched."""

    kind = FailureKind.CORRUPTED


class SliceStraggling(SliceFailure):
    """The slice computed its gradients slower than the others by
    `straggler_factor` for `straggler_steps` steps in a row (and
    `straggler_min_s` seconds of its gradient calls), and is taken
    out at a step boundary (a spare takes its place, or, under resize,
    the others train on without it when that is faster): no step is lost.
    Its node is not used again in the run."""

    kind = FailureKind.STRAGGLER


class WorkerOutOfMemory(SliceFailure):
    """A host of the slice ran out of memory: Ray's memory monitor killed
    its worker (the node's memory passed `RAY_memory_usage_threshold`), or
    its object store and spill disk were full. The cause names what the
    node had and, where the run's preflight estimated it, what a host of
    this run needs. Recovered like a lost process; a run that needs more
    than its hosts have fails the same way again and ends when its retry
    budget is spent, with this cause."""

    kind = FailureKind.OOM


FAILURE_TYPES = {
    FailureKind.PROCESS_DIED: WorkerProcessDied,
    FailureKind.NODE_DIED: NodeDied,
    FailureKind.HUNG: WorkerHung,
    FailureKind.PREEMPTED: SlicePreempted,
    FailureKind.CORRUPTED: SliceCorrupted,
    FailureKind.STRAGGLER: SliceStraggling,
    FailureKind.OOM: WorkerOutOfMemory,
}


class RunFailed(ElasticError):
    """The run cannot go on. The message names the setting to change."""

    def __init__(self, message: str, setting: str = ""):
        self.setting = setting
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0], self.setting))


class NonFiniteLoss(RunFailed):
    """A step's loss over the global batch is not finite and the program has
    no `post_update` to skip such steps. Raised before the step is applied:
    the state of the step before it is kept (the last snapshot and
    checkpoint hold it)."""

    def __init__(self, step: int, loss: float):
        self.step, self.loss = step, loss
        super().__init__(f"the loss of step {step} is {loss} (not finite); lower the learning rate, or set "
                         "TrainProgram(post_update=ray_elastic.skip_nonfinite) to skip such steps",
                         "program.post_update")

    def __reduce__(self):
        return (type(self), (self.step, self.loss))


class RetryBudgetExhausted(RunFailed):
    """More failures happened than `max_retries` allows."""


class ReplacementTimeout(RunFailed):
    """Not enough slices came back within `timeout_s`."""


class CheckpointStorageFailed(RunFailed):
    """Checkpoint saves kept failing; the state was rescued to local disk."""


class CheckpointSaveFailed(RunFailed):
    """A checkpoint save failed in ray_elastic's own code, not in the
    storage; the state was rescued to local disk and the message says where."""


class StorageError(ElasticError):
    """Checkpoint storage could not be read or written."""

    def __init__(self, message: str):
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0],))


class CheckpointDamaged(StorageError):
    """A committed checkpoint step does not hold what was written: a file is
    missing, shorter, or its bytes or an array's differ from the checksums
    recorded at save time. Names the step, the file (relative to the step
    folder) and why."""

    def __init__(self, step: int, file: str, reason: str):
        self.step = step
        self.file = file
        self.reason = reason
        super().__init__(f"checkpoint step {step} is damaged: {file}: {reason}")

    def __reduce__(self):
        return (type(self), (self.step, self.file, self.reason))


class EventsFileError(ElasticError, ValueError):
    """An events file (EventLog's JSON lines) cannot be read; names the file and line."""


class TimelineInputError(ElasticError, ValueError):
    """`ray-elastic timeline` was given something it cannot draw."""


class StateLoadFailed(ElasticError):
    """Loading a state into joining slices failed; `dead` names the slices
    that died meanwhile (none: the state's source was bad)."""

    def __init__(self, dead: list, cause: str):
        self.dead = list(dead)
        self.cause = cause
        super().__init__(f"loading the state into slices failed ({cause}); dead: {self.dead}")

    def __reduce__(self):
        return (type(self), (self.dead, self.cause))
