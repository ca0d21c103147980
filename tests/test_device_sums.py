"""The step's sums on the devices (worker/device_sums.py), inside one
process (no Ray): SliceWorkers driven through every path of the exchange
plan as the controller drives them, replicated and sharded. The sums made
on the devices give the bits numpy's give (the direct hand-off, the
owners' chunk sums) in the same order; one slice sends nothing; several
send one gradient per host per step (half of it in bfloat16).
tests/test_exchange_e2e.py and the resize tests run the same paths on a
real cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

DRIVER = os.path.join(os.path.dirname(__file__), "drivers", "device_sums_driver.py")
STEPS = 3


@pytest.fixture(scope="module", params=[("replicated", 2), ("fsdp", 4)], ids=["replicated-2dev", "fsdp-4dev"])
def facts(request):
    layout, devices = request.param
    out = subprocess.run([sys.executable, DRIVER, layout, str(devices)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sums_on_the_devices_give_numpys_bits_in_the_same_order(facts):
    assert facts["equal"] and all(facts["equal"].values()), facts["equal"]
    assert all(facts["slices_agree"].values()), facts["slices_agree"]
    # The check can fail: another order of the same shards, or the wire's
    # rounding, changes the state's bits.
    assert all(facts["differs"].values()), facts["differs"]


def test_one_program_is_the_same_math_to_float_rounding(facts):
    # The update compiled with the gradient (an accelerator's default): the
    # compiler may fuse its multiplies and adds, so not bitwise; allclose.
    assert facts["one_program_close"]
    assert facts["sent"]["one_program"] == 0
    assert facts["losses"]["one_program"][0] == facts["losses"]["host"][0]  # the first step's loss, before any update
    np.testing.assert_allclose(facts["losses"]["one_program"], facts["losses"]["host"], rtol=1e-6)


def test_losses_follow_the_order_of_the_sums(facts):
    losses = facts["losses"]
    assert losses["host"] == losses["one_slice"]
    assert losses["one_of_two"] == losses["two_slices"] == losses["finished"]
    assert losses["one_of_three"] == losses["three_slices"]
    assert losses["host"][-1] < losses["host"][0]  # it trains


def test_one_slice_sends_nothing_and_several_send_one_gradient_each(facts):
    sent, grad = facts["sent"], facts["gradient_bytes"]
    for alone in ("one_slice", "one_of_two", "one_of_three", "bf16_one", "one_program"):
        assert sent[alone] == 0, (alone, sent)
    # Two slices: one sum per slice per step (their blocks, summed on the
    # devices first), no shard's gradient on its own.
    assert sent["two_slices"] == 2 * STEPS * grad, (sent, grad)
    assert sent["bf16_two"] == STEPS * grad, (sent, grad)
    # Three slices, 4 shards: slice 0 holds block 0 whole (shards 0 and 3),
    # so each slice sends one sum.
    assert sent["three_slices"] == 3 * STEPS * grad, (sent, grad)


def test_an_accelerators_snapshot_raveled_on_the_host_is_the_devices_ravel():
    """On an accelerator a replicated snapshot is copied leaf by leaf and
    raveled on the host (worker/transfer.py): the same bytes as the jitted
    ravel the CPU path keeps, mixed dtypes (Adam's int32 count) included."""
    import jax
    import optax
    from jax.flatten_util import ravel_pytree

    from ray_elastic.worker.transfer import host_ravel

    params = {"a": jax.numpy.arange(12.0).reshape(3, 4) / 7, "b": -jax.numpy.arange(5.0) * 1e-30}
    state = (params, optax.adamw(1e-3).init(params))
    flat = np.asarray(ravel_pytree(state)[0])
    mine = host_ravel(jax.tree.leaves(state))
    assert mine.dtype == flat.dtype and np.array_equal(mine, flat)
    assert not np.array_equal(host_ravel(jax.tree.leaves((state[1], state[0]))), flat)  # the order counts


def test_a_snapshot_is_copied_on_the_devices_only_where_the_copy_fits():
    """worker/transfer.py's rule, with a TPU v5e's figures (16.9 GB): the
    341M example LM holds 4.3 GB and its step takes 8.9 GB of scratch, so
    a 4.1 GB copy does not fit (the copy once made that step fail, out of
    memory); at 152M (2.0 GB held, 1.8 GB copy, ~4.4 GB scratch) it does.
    A device that does not tell its memory gets no copy."""
    from ray_elastic.worker.transfer import device_copy_fits

    v5e = 16.9e9
    assert not device_copy_fits({"bytes_limit": v5e, "bytes_in_use": 4.31e9}, int(4.1e9), int(8.88e9))
    assert device_copy_fits({"bytes_limit": v5e, "bytes_in_use": 2.03e9}, int(1.83e9), int(4.4e9))
    assert not device_copy_fits(None, 1, 0)
    assert not device_copy_fits({}, 1, 0)
    # The margin: 5% of the device's memory stays free.
    assert device_copy_fits({"bytes_limit": 100, "bytes_in_use": 0}, 45, 50)
    assert not device_copy_fits({"bytes_limit": 100, "bytes_in_use": 0}, 46, 50)


def test_a_programs_footprint_is_its_scratch_and_its_new_outputs():
    """device_step.footprint: a compiled program's memory beyond its
    arguments; an update donating its input adds no output of its own."""
    import jax

    from ray_elastic.worker.device_step import footprint

    x = jax.numpy.ones((256, 256), jax.numpy.float32)
    fresh = jax.jit(lambda a: a * 2).lower(x).compile()
    donated = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
    assert footprint((fresh,)) >= x.nbytes
    assert footprint((donated,)) < footprint((fresh,))
    assert footprint((fresh, donated)) == footprint((fresh,))
    assert footprint((fresh, object())) is None  # no memory analysis: unknown
    assert footprint(()) is None
