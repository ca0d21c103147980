"""Unit tests for ray_elastic.errors: hierarchy and pickling."""

from __future__ import annotations

import pickle

from ray import cloudpickle  # what Ray uses between processes
import pytest

from ray_elastic import errors
from ray_elastic.errors import (
    FAILURE_TYPES,
    ConfigError,
    ElasticError,
    FailureKind,
    NodeDied,
    ReplacementTimeout,
    RetryBudgetExhausted,
    RunFailed,
    SliceFailure,
    SliceCorrupted,
    SliceStraggling,
    SlicePreempted,
    WorkerHung,
    WorkerProcessDied,
    WorkerOutOfMemory,
)

SLICE_FAILURES = [SliceFailure, WorkerProcessDied, NodeDied, WorkerHung, SlicePreempted]
RUN_FAILURES = [RunFailed, RetryBudgetExhausted, ReplacementTimeout]
DUMPERS = [
    pytest.param(lambda e: pickle.loads(pickle.dumps(e)), id="pickle"),
    pytest.param(
        lambda e: pickle.loads(pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)),
        id="pickle-highest",
    ),
    pytest.param(lambda e: cloudpickle.loads(cloudpickle.dumps(e)), id="cloudpickle"),
]


@pytest.mark.parametrize("roundtrip", DUMPERS)
@pytest.mark.parametrize("cls", SLICE_FAILURES)
def test_slice_failure_roundtrip(cls, roundtrip):
    e = cls(slice_id=3, host=1, step=17, cause="SIGKILL from test")
    back = roundtrip(e)
    assert type(back) is cls
    assert (back.slice_id, back.host, back.step, back.cause) == (3, 1, 17, "SIGKILL from test")
    assert back.kind is cls.kind
    assert str(back) == str(e)
    assert "slice 3 host 1" in str(back) and "step 17" in str(back)
    assert cls.kind.value in str(back)


@pytest.mark.parametrize("roundtrip", DUMPERS)
@pytest.mark.parametrize("cls", SLICE_FAILURES)
def test_slice_failure_fields_roundtrip(cls, roundtrip):
    """What the dispatch layer finds with a failure (the step's partial
    work, a silent node, gradients a group leader kept) is declared on
    SliceFailure and survives pickling: a group leader sends its failures
    to the driver through Ray."""
    from ray_elastic.dispatch.step_runner import PartialStep

    plain = roundtrip(cls(3, 1, 17, "gone"))
    assert (plain.partial, plain.node_silent, plain.leader_partial) == (None, False, False)
    partial = PartialStep(17, {0: (0,), 3: (1,)}, {0: {0: "grads of 0"}})
    e = cls(3, 1, 17, "gone", partial=partial, node_silent=True, leader_partial=True)
    back = roundtrip(e)
    assert type(back) is cls and back.kind is cls.kind and str(back) == str(e)
    assert back.partial == partial and back.node_silent is True and back.leader_partial is True
    moved = back.replace(partial=None)  # as a leader sends one, its partial kept back
    assert type(moved) is cls and moved.partial is None and moved.node_silent and moved.leader_partial
    assert (moved.slice_id, moved.host, moved.step, moved.cause) == (3, 1, 17, "gone")


@pytest.mark.parametrize("roundtrip", DUMPERS)
@pytest.mark.parametrize("cls", RUN_FAILURES)
def test_run_failed_roundtrip(cls, roundtrip):
    e = cls("ran out; raise max_retries", setting="max_retries")
    back = roundtrip(e)
    assert type(back) is cls
    assert back.setting == "max_retries"
    assert str(back) == "ran out; raise max_retries"
    assert back.args == e.args


@pytest.mark.parametrize("roundtrip", DUMPERS)
def test_run_failed_default_setting_roundtrip(roundtrip):
    back = roundtrip(RunFailed("boom"))
    assert back.setting == ""
    assert str(back) == "boom"


@pytest.mark.parametrize("roundtrip", DUMPERS)
def test_config_error_roundtrip(roundtrip):
    e = ConfigError("slice.topology", "'3x3' is not valid")
    back = roundtrip(e)
    assert type(back) is ConfigError
    assert back.setting == "slice.topology"
    assert back.problem == "'3x3' is not valid"
    assert str(back) == "slice.topology: '3x3' is not valid" == str(e)


@pytest.mark.parametrize("roundtrip", DUMPERS)
def test_failure_kind_roundtrip(roundtrip):
    for k in FailureKind:
        assert roundtrip(k) is k


def test_slice_failure_kinds_distinct_and_cover_failure_kind():
    subclasses = [WorkerProcessDied, NodeDied, WorkerHung, SlicePreempted, SliceCorrupted, SliceStraggling,
                  WorkerOutOfMemory]
    kinds = [c.kind for c in subclasses]
    assert len(set(kinds)) == len(kinds)
    assert set(kinds) == set(FailureKind)
    # every SliceFailure subclass defined in the module is accounted for
    defined = {
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, SliceFailure) and obj is not SliceFailure
    }
    assert defined == set(subclasses)


def test_failure_types_table():
    assert set(FAILURE_TYPES) == set(FailureKind)
    for kind, cls in FAILURE_TYPES.items():
        assert issubclass(cls, SliceFailure)
        assert cls.kind is kind


def test_failure_kind_is_str():
    assert FailureKind("node_died") is FailureKind.NODE_DIED
    assert FailureKind.HUNG == "hung"


@pytest.mark.parametrize(
    "cls", SLICE_FAILURES + RUN_FAILURES + [ConfigError, ElasticError]
)
def test_all_derive_from_elastic_error(cls):
    assert issubclass(cls, ElasticError)
    assert issubclass(cls, Exception)


def test_hierarchy():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(RetryBudgetExhausted, RunFailed)
    assert issubclass(ReplacementTimeout, RunFailed)
    assert not issubclass(RunFailed, SliceFailure)
    assert not issubclass(SliceFailure, RunFailed)


def test_every_exception_in_module_derives_from_elastic_error():
    excs = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    ]
    assert len(excs) >= 10
    for cls in excs:
        assert issubclass(cls, ElasticError), cls


def test_can_catch_as_elastic_error():
    with pytest.raises(ElasticError):
        raise NodeDied(0, 0, 0, "gone")
    with pytest.raises(ElasticError):
        raise ReplacementTimeout("late", setting="timeout_s")


def test_every_exception_class_lives_in_errors_py():
    """One hierarchy: no module of the package defines an exception class
    of its own except errors.py (what a user can meet) and
    failures/internal.py (control flow that never leaves ray_elastic);
    every one derives from ElasticError, and the public package exports
    none of the internal ones."""
    import importlib
    import inspect
    import pkgutil

    import ray_elastic
    from ray_elastic.failures import internal

    homes = ("ray_elastic.errors", "ray_elastic.failures.internal")
    elsewhere = []
    for mod in pkgutil.walk_packages(ray_elastic.__path__, "ray_elastic."):
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.name:
                if mod.name not in homes:
                    elsewhere.append(f"{mod.name}.{name}")
                else:
                    assert issubclass(obj, errors.ElasticError), name
    assert not elsewhere, f"exception classes outside errors.py and failures/internal.py: {elsewhere}"
    assert internal.__all__ and not set(internal.__all__) & (set(errors.__all__) | set(ray_elastic.__all__))


def test_without_frames_drops_the_tracebacks_of_the_whole_chain():
    """A failure raised while handling a call's error (`raise failure(...)
    from None` in `except RayError`): the call's error, its context, has
    frames of its own, which hold their locals. Each traceback of the
    chain goes; the exceptions and their messages stay."""
    import gc
    import weakref

    from ray_elastic.errors import WorkerProcessDied, without_frames

    class Chunk:
        pass

    held = []

    def call():
        chunk = Chunk()
        held.append(weakref.ref(chunk))
        error = RuntimeError("actor died")
        raise error  # a local: its frame and its traceback hold each other

    def step():
        try:
            call()
        except RuntimeError:
            raise WorkerProcessDied(1, 0, 5, "gone") from None

    gc.collect()
    gc.disable()
    try:
        try:
            step()
        except WorkerProcessDied as f:
            caught = f
        assert caught.__context__.__traceback__ is not None and held[0]() is not None  # the cycle, before
        assert without_frames(caught) is caught
        assert caught.__traceback__ is None and caught.__context__.__traceback__ is None
        assert str(caught.__context__) == "actor died" and caught.slice_id == 1
        assert held[0]() is None
    finally:
        gc.enable()
