"""A worker's apply/reduce inputs, fetched by the call itself so that the
controller can make it give up (ray_elastic/worker/inputs.py), on a real Ray
cluster: an input that is still coming is waited for until an abort, which
ends the wait at once; inputs that are there, or fail, come back as Ray
gives them."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray

from ray_elastic.worker.inputs import CallInputs, InputsAborted, fetch_inputs

pytestmark = pytest.mark.cluster


@ray.remote(num_cpus=0)
class _Late:
    def value(self, delay_s: float):
        time.sleep(delay_s)
        return np.arange(4.0)


def test_inputs_come_through_in_order(cluster):
    a, b = ray.put(np.ones(3)), ray.put({"k": 2})
    later = _Late.remote().value.remote(0.3)
    got = fetch_inputs([a, None, later, b], lambda: False, "test")
    assert got[1] is None and got[3] == {"k": 2}
    np.testing.assert_array_equal(got[0], np.ones(3))
    np.testing.assert_array_equal(got[2], np.arange(4.0))


def test_an_abort_ends_the_wait_for_an_input_still_coming(cluster):
    late = _Late.remote()
    never = late.value.remote(60.0)  # stands in for an input on a lost node
    flag = threading.Event()
    threading.Timer(0.5, flag.set).start()
    t0 = time.monotonic()
    with pytest.raises(InputsAborted, match="given up"):
        fetch_inputs([ray.put(1), never], flag.is_set, "step 3's inputs")
    assert time.monotonic() - t0 < 10  # not the input's 60 s
    ray.kill(late)


def test_a_failed_input_raises_its_error(cluster):
    late = _Late.remote()
    ref = late.value.remote(30.0)
    time.sleep(0.2)
    ray.kill(late)
    with pytest.raises(ray.exceptions.RayActorError):
        fetch_inputs([ref], lambda: False, "test")


@ray.remote(num_cpus=0)
def _fails_after(delay_s: float):
    time.sleep(delay_s)
    raise ValueError("the slice's gradient call failed")


def test_a_failed_input_ends_the_wait_for_the_others(cluster):
    """A reduction whose inputs are a step's gradients: one slice's call
    fails while the others still compute. The call is void, and waiting on
    for the rest would hold one of the worker's threads for nothing."""
    late = _Late.remote()
    still_computing = late.value.remote(60.0)
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="gradient call failed"):
        fetch_inputs([still_computing, _fails_after.remote(0.3)], lambda: False, "step 4's inputs")
    assert time.monotonic() - t0 < 20  # not the other input's 60 s
    ray.kill(late)


def test_ray_s_client_failing_is_an_input_lost(cluster, monkeypatch):
    """On a worker whose raylet was just killed, Ray's client raises plain
    OSErrors (a broken pipe, a connection reset), which the driver would
    take for the program's own error: they become InputsLost, a node loss
    to the failure locator. (The OSError is raised by a stand-in for
    ray.wait here; the e2e chaos runs met the real one.)"""
    from ray_elastic.worker.inputs import InputsLost

    def broken(*a, **kw):
        raise OSError("Broken pipe")

    monkeypatch.setattr(ray, "wait", broken)
    with pytest.raises(InputsLost, match="Broken pipe"):
        fetch_inputs([ray.put(1)], lambda: False, "step 2's inputs")


def test_an_apply_gets_the_inputs_taken_for_it_and_no_others():
    """On a slice of several hosts an apply's inputs are taken ahead of it
    (take_inputs: dispatch/applies.py). The apply gets those taken for its
    own step and epoch, once; they go with it, and so do those of a take
    given up on for that step. A re-issued apply of a step applied already
    needs none; any other apply finding none fails rather than apply
    nothing."""
    waits: list = []
    inputs = CallInputs("slice 0 host 1", waits.append)
    inputs.take([1, 2], epoch=0, step=4)  # given up on: the step was issued again
    inputs.take([3], epoch=1, step=4)
    inputs.take([5], epoch=1, step=5)
    assert inputs.taken(1, 4, applied=False) == (3,)
    assert inputs.taken(1, 4, applied=True) == ()
    with pytest.raises(RuntimeError, match="no inputs taken"):
        inputs.taken(0, 4, applied=False)
    assert inputs.taken(1, 5, applied=False) == (5,)
    assert len(waits) == 3  # each take's wait, counted as the exchange's
