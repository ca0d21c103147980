"""Every error Ray documents that a step's calls can raise is a failure
kind the policy handles (failures/ray_errors.py): one case per error,
built as Ray builds it, through the locator over a fake probe, and the
controller recovering from an out-of-memory kill on a fake backend.
tests/test_oom_e2e.py has Ray's memory monitor kill a real worker."""

from __future__ import annotations

import pytest
from ray import exceptions as rex
from ray.core.generated.common_pb2 import ActorDiedErrorContext

from ray_elastic import ElasticConfig
from ray_elastic.errors import FAILURE_TYPES, FailureKind, WorkerOutOfMemory
from ray_elastic.failures import ray_errors
from ray_elastic.failures.location import TRANSIENT, failure, short
from tests.test_controller import run
from tests.test_failure_location import _live, _locator, _Probe, _task_error

# Ray's memory monitor's words (node_manager), as a call in flight gets them.
OOM_TEXT = (
    "Task was killed due to the node running low on memory.\n"
    "Memory on the node (IP: 10.0.0.2, ID: 0b1f) where the task (actor ID: 5e2c, name=SliceWorker.__init__, "
    "pid=4242, memory used=17.31GB) was running was 22.46GB / 23.48GB (0.956533), which exceeds the memory usage "
    "threshold of 0.95. Ray killed this worker (ID: 9a1b) because it was the most recently scheduled task; "
    "to see more information about memory usage on this node, use `ray logs raylet.out -ip 10.0.0.2`."
)


# Ray 2.60's own words (captured from a real kill on this machine).
OOM_TEXT_260 = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: 5a73) "
    "was 3.14GB used / 23.54GB limit (0.133489)\nOOM kill reason: Memory usage 3361488896B exceeded threshold of "
    "3336441600B (13.2% of 25276071936B limit)\nRay killed 1 worker(s) based on the killing policy\n"
    "Selected to kill: (Actor(0c01): job ID=01000000, task name=A.__init__, pid=23442, actual memory used=1.77GB, "
    "worker ID=083d)\n"
)


def _died(message: str = "The actor is dead because its worker process has died.") -> rex.ActorDiedError:
    return rex.ActorDiedError(ActorDiedErrorContext(error_message=message, actor_id=b"\x01" * 16, class_name="W"))


CASES = [
    # (the error, the kind with the host's node alive, the kind with it lost)
    (rex.OutOfMemoryError(OOM_TEXT), FailureKind.OOM, FailureKind.OOM),
    (rex.OutOfMemoryError(OOM_TEXT_260), FailureKind.OOM, FailureKind.OOM),
    (rex.ObjectStoreFullError("object store full"), FailureKind.OOM, FailureKind.OOM),
    (rex.OutOfDiskError("disk full"), FailureKind.OOM, FailureKind.OOM),
    (_died(), FailureKind.PROCESS_DIED, FailureKind.NODE_DIED),
    (_died(OOM_TEXT), FailureKind.OOM, FailureKind.OOM),
    (rex.RayActorError(), FailureKind.PROCESS_DIED, FailureKind.NODE_DIED),
    (rex.WorkerCrashedError(), FailureKind.PROCESS_DIED, FailureKind.PROCESS_DIED),
    (rex.NodeDiedError("node died"), FailureKind.NODE_DIED, FailureKind.NODE_DIED),
    (rex.ObjectLostError("ab" * 14, "owner", "stack"), FailureKind.NODE_DIED, FailureKind.NODE_DIED),
    (rex.OwnerDiedError("ab" * 14, "owner", "stack"), FailureKind.NODE_DIED, FailureKind.NODE_DIED),
    (rex.ObjectFetchTimedOutError("ab" * 14, "owner", "stack"), FailureKind.NODE_DIED, FailureKind.NODE_DIED),
    (rex.ObjectReconstructionFailedError("ab" * 14, "owner", "stack"), FailureKind.NODE_DIED, FailureKind.NODE_DIED),
    (rex.ActorPlacementGroupRemoved(), FailureKind.PROCESS_DIED, FailureKind.PROCESS_DIED),
    (rex.RaySystemError("client error"), FailureKind.PROCESS_DIED, FailureKind.NODE_DIED),
    (rex.RpcError("connection reset"), FailureKind.PROCESS_DIED, FailureKind.NODE_DIED),
    (rex.TaskCancelledError(), FailureKind.PROCESS_DIED, FailureKind.PROCESS_DIED),
    (rex.GetTimeoutError(), FailureKind.HUNG, FailureKind.HUNG),
]


@pytest.mark.parametrize("exc,alive_kind,lost_kind", CASES, ids=[f"{type(c[0]).__name__}-{i}" for i, c in enumerate(CASES)])
def test_every_ray_error_of_a_call_is_a_failure_kind(exc, alive_kind, lost_kind):
    assert _locator(_Probe()).classify_call(exc, _live(), 0, 0) == alive_kind
    assert _locator(_Probe(lost={"n00"})).classify_call(exc, _live(), 0, 0) == lost_kind
    assert alive_kind in FAILURE_TYPES and lost_kind in FAILURE_TYPES


def test_an_unavailable_worker_is_confirmed_before_it_is_a_failure():
    exc = rex.ActorUnavailableError("connection lost", b"\x01" * 16)
    assert _locator(_Probe()).classify_call(exc, _live(), 0, 0) is TRANSIENT  # it answers: re-issue
    live = _live()
    assert _locator(_Probe(dead={live[0].workers[0]})).classify_call(exc, live, 0, 0) == FailureKind.PROCESS_DIED


def test_the_users_own_error_is_raised_not_retried():
    with pytest.raises(rex.RayTaskError):
        _locator(_Probe()).classify_call(_task_error(ZeroDivisionError("x")), _live(), 0, 0)


def test_a_memory_kill_names_what_the_worker_used_and_the_node_had():
    text = short(rex.OutOfMemoryError(OOM_TEXT))
    assert text == ("killed by Ray's memory monitor; the worker used 17.31 GB; the node was at 22.46 GB of "
                    "23.48 GB (kill threshold 0.95)")
    assert short(_died(OOM_TEXT)) == text
    assert short(rex.OutOfMemoryError(OOM_TEXT_260)) == (
        "killed by Ray's memory monitor; the worker used 1.77 GB; the node was at 3.14 GB of 23.54 GB "
        "(kill threshold 0.13)")
    assert "object store full" in short(rex.ObjectStoreFullError("x"))
    f = failure(FailureKind.OOM, 1, 0, 7, text)
    assert isinstance(f, WorkerOutOfMemory) and "(oom)" in str(f)


def test_every_row_of_the_table_is_a_ray_error():
    assert all(issubclass(cls, rex.RayError) for cls, _ in ray_errors.RAY_ERRORS)
    kinds = {k for _, k in ray_errors.RAY_ERRORS}
    assert kinds <= set(FailureKind) | {ray_errors.DEATH, ray_errors.CONFIRM}


@pytest.mark.parametrize("policy", ["pause", "resize"])
def test_an_out_of_memory_kill_is_recovered_by_policy(policy):
    config = ElasticConfig(num_slices=2, policy=policy, timeout_s=60)
    trainer, backend = run(config, steps=12)
    backend.fail_at[(4, 1)] = FailureKind.OOM
    report = trainer.fit()
    assert report.steps_completed == 12
    (f,) = report.failures
    assert f.kind == "oom" and f.slice == 1 and f.recovered_s is not None

