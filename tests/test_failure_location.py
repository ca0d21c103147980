"""FailureLocator: a collective error on one host of a multi-host slice
is pinned on the peer that is gone (peer_failure), and a step past its
deadline on the dead or silent host (hung): pure logic over a fake probe;
tests/test_sharded_e2e.py removes a real node, test_snapshots_e2e.py kills
a real host."""

from __future__ import annotations

import dataclasses

import pytest
from ray import exceptions as rex

from ray_elastic.errors import FailureKind
from ray_elastic.failures.location import FailureLocator, runtime_error
from ray_elastic.worker.inputs import InputsAborted, InputsLost


class JaxRuntimeError(RuntimeError):  # the name JAX's own error has
    pass


def _task_error(cause: BaseException) -> rex.RayTaskError:
    return rex.RayTaskError("compute_grads", "traceback", cause)


@dataclasses.dataclass
class _Slice:
    workers: list
    infos: list


class _Probe:
    def __init__(self, lost=(), dead=(), states=None):
        self.lost, self.dead = set(lost), set(dead)
        self.states = dict(states or {})  # pid -> process_state's answer

    def node_alive(self, node_id):
        return node_id not in self.lost

    def raylet_reachable(self, node_id):
        return node_id not in self.lost

    def raylet_answers(self, node_id):
        return node_id not in self.lost

    def ping(self, worker, timeout_s):
        if worker in self.dead:
            raise rex.ActorDiedError()

    def process_state(self, node_id, pid):
        return self.states.get(pid)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def _live():
    return {0: _Slice(["w00", "w01"], [{"node_id": "n00"}, {"node_id": "n01"}]),
            1: _Slice(["w10", "w11"], [{"node_id": "n10"}, {"node_id": "n11"}])}


def _locator(probe):
    clock = _Clock()
    return FailureLocator(probe, clock, clock.sleep, confirm_s=1.0)


def test_runtime_error_is_jax_s_not_the_program_s():
    assert runtime_error(_task_error(JaxRuntimeError("Gloo all-reduce failed")))
    assert not runtime_error(_task_error(ValueError("bad batch")))
    assert not runtime_error(ValueError("not from a task"))


def test_a_lost_peer_node_takes_the_blame():
    f = _locator(_Probe(lost={"n10"})).peer_failure(_task_error(JaxRuntimeError("reset")), _live(), 1, 1, step=3)
    assert (f.kind, f.slice_id, f.host, f.step) == (FailureKind.NODE_DIED, 1, 0, 3)


def test_a_dead_peer_process_takes_the_blame():
    f = _locator(_Probe(dead={"w01"})).peer_failure(_task_error(JaxRuntimeError("reset")), _live(), 0, 0, step=5)
    assert (f.kind, f.slice_id, f.host) == (FailureKind.PROCESS_DIED, 0, 1)


def test_every_peer_alive_means_the_program_s_own_error():
    assert _locator(_Probe()).peer_failure(_task_error(JaxRuntimeError("oom")), _live(), 0, 0, step=1) is None


@pytest.mark.parametrize("exc", [_task_error(ValueError("bad")), rex.ActorDiedError()])
def test_other_errors_are_not_collective_failures(exc):
    assert _locator(_Probe(lost={"n01"})).peer_failure(exc, _live(), 0, 0, step=1) is None


class _BusyProbe(_Probe):
    """`busy` workers do not answer a ping in time."""

    def __init__(self, busy=(), **kw):
        super().__init__(**kw)
        self.busy = set(busy)

    def ping(self, worker, timeout_s):
        if worker in self.busy:
            raise rex.GetTimeoutError()
        super().ping(worker, timeout_s)


def test_a_step_past_its_deadline_blames_the_dead_peer_of_the_waiting_host():
    """Host 1 of slice 1 did its part of the step, then died; host 0 waits
    in a collective with it. Only host 0's call is still waiting, yet host 1
    is the failure, found dead, not host 0 as hung."""
    f = _locator(_Probe(dead={"w11"})).hung([(1, 0)], _live(), step=5, deadline_s=5.0)
    assert (f.kind, f.slice_id, f.host) == (FailureKind.PROCESS_DIED, 1, 1)


def test_a_dead_host_wins_over_a_host_that_does_not_answer():
    f = _locator(_BusyProbe(busy={"w10"}, dead={"w11"})).hung([(1, 0)], _live(), step=5, deadline_s=5.0)
    assert (f.kind, f.host) == (FailureKind.PROCESS_DIED, 1)


def test_a_host_that_does_not_answer_is_the_hung_one():
    f = _locator(_BusyProbe(busy={"w11"})).hung([(1, 0)], _live(), step=5, deadline_s=5.0)
    assert (f.kind, f.slice_id, f.host) == (FailureKind.HUNG, 1, 1)
    assert f.node_silent is False and "answers" in f.cause


@pytest.mark.parametrize("cause", [InputsLost("step 4's inputs: OSError: Connection reset by peer"),
                                   InputsAborted("step 4's inputs given up: a slice was lost")])
def test_inputs_that_could_not_be_fetched_blame_the_slice_on_a_lost_node(cause):
    """An apply fetches the other slices' gradients itself (worker/inputs.py): one
    that could not is a node loss, blamed on the slice whose node is gone,
    not a bug of the program."""
    loc, live = _locator(_Probe(lost={"n10"})), _live()
    kind = loc.classify_call(_task_error(cause), live, 0, 0)
    assert kind == FailureKind.NODE_DIED and loc.blame(0, kind, live) == 1


def test_a_program_error_in_an_apply_is_still_raised():
    with pytest.raises(rex.RayTaskError, match="traceback"):
        _locator(_Probe()).classify_call(_task_error(ValueError("bad")), _live(), 0, 0)
