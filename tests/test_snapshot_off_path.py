"""Snapshots taken off the step's path, in one process (no Ray): the
snapshot an apply begins is finished after later steps have donated the
state's arrays to their updates, and still holds the state of its own step,
bitwise, under the replicated and the FSDP layout.
tests/test_snapshot_interval_e2e.py runs snapshots on a real cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DRIVER = os.path.join(os.path.dirname(__file__), "drivers", "snapshot_race_driver.py")


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_a_late_snapshot_holds_its_own_step(layout):
    out = subprocess.run([sys.executable, DRIVER, layout], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    f = json.loads(out.stdout.strip().splitlines()[-1])
    assert f["late_step"] == 2
    assert f["late_equal"], "the snapshot finished late differs from the state of its step"
    assert f["moved_on"], "the state did not change in two steps: the check could not fail"
    assert f["status"]["step"] == 2 and f["status"]["bytes"] == f["nbytes"] > 0
    assert "no snapshot of step 2 was begun" in f["refused"]
    # A worker set up outside Ray starts no Ray of its own (~8 s, and a dashboard).
    assert not f["ray_started"]


def test_a_snapshot_kept_before_its_arrays_are_donated_holds_their_host_copies_and_ravels_them_later():
    """The accelerator's path (the device copy did not fit): the next
    apply only waits for the leaves' host copies (`keep`); the ravel of
    the whole state is left to the snapshot thread (`views`)."""
    jax = pytest.importorskip("jax")
    import numpy as np

    from ray_elastic.worker.transfer import BegunSnapshot, host_ravel

    leaves = [jax.numpy.arange(6.0).reshape(2, 3), jax.numpy.full(4, 7.0)]
    expected = host_ravel(leaves)
    made, fetched = [], []

    def make(a):
        made.append(len(a))
        return host_ravel(a)

    def fetch(a):
        fetched.append(len(a))
        return [np.array(x) for x in a]

    begun = BegunSnapshot(4, leaves, make, False, fetch)
    begun.keep()
    assert fetched == [2] and made == []  # the copies only: no ravel on the apply's path
    for a in leaves:
        a.delete()  # what the next update's donation does to the held arrays
    begun.keep()  # a second keep copies nothing again
    assert fetched == [2]
    assert np.array_equal(begun.views(), expected) and made == [2]
    assert begun.views() is begun.views() and made == [2]
