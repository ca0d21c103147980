"""Unit tests (no Ray cluster) for ray_elastic.worker.fingerprint: the
host (numpy) fingerprint sees every single-bit flip (and the order of leaves),
flip_payload_bit flips one bit of a copy, and on several CPU devices
state_fingerprint gives one print per device while flip_bit corrupts the
first shard's device only. The multi-device part runs in a process of its
own (XLA_FLAGS must be set before JAX starts; this process has one device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from ray_elastic.worker.fingerprint import flip_payload_bit, host_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _sample(dtype, n=7):
    rng = np.random.default_rng(0)
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-1000, 1000, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _with_bit_flipped(a, index, bit):
    out = a.copy()
    words = out.reshape(-1).view(_UINT[out.dtype.itemsize])
    words[index] ^= words.dtype.type(1) << words.dtype.type(bit)
    return out


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32, np.float64, np.int64, np.int8])
def test_every_single_bit_flip_at_several_positions_changes_the_host_fingerprint(dtype):
    a = _sample(dtype)
    base = host_fingerprint({"w": a, "b": np.ones(3, np.float32)})
    bits = a.dtype.itemsize * 8
    for index in (0, 3, a.size - 1):
        for bit in range(bits):
            flipped = _with_bit_flipped(a, index, bit)
            assert host_fingerprint({"w": flipped, "b": np.ones(3, np.float32)}) != base, (index, bit)


def test_flipping_any_bool_element_changes_the_host_fingerprint():
    a = np.array([True, False, True, False, False, True])
    base = host_fingerprint([a])
    for i in range(a.size):
        b = a.copy()
        b[i] = not b[i]
        assert host_fingerprint([b]) != base, i


def test_a_flip_in_a_later_leaf_changes_the_host_fingerprint():
    tree = {"a": np.zeros(4, np.float32), "b": np.arange(5, dtype=np.int32)}
    base = host_fingerprint(tree)
    assert host_fingerprint({**tree, "b": _with_bit_flipped(tree["b"], 4, 31)}) != base


def test_equal_trees_have_equal_host_fingerprints_and_signed_zero_differs():
    make = lambda: {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.int32(7),  # noqa: E731
                    "h": np.ones(4, ml_dtypes.bfloat16)}
    assert host_fingerprint(make()) == host_fingerprint(make())
    assert isinstance(host_fingerprint(make()), int) and 0 <= host_fingerprint(make()) < 2 ** 32
    # Bits, not values: -0.0 == 0.0 but their prints differ.
    assert host_fingerprint([np.array([0.0], np.float32)]) != host_fingerprint([np.array([-0.0], np.float32)])
    # A sum of words: moved values are not what failing chips do, and are not told apart.
    x, y = np.arange(3, dtype=np.float32), np.arange(3, 6, dtype=np.float32)
    assert host_fingerprint([x, y]) == host_fingerprint([y, x])


def test_small_and_large_arrays_alike_see_every_single_bit_flip():
    """Arrays under 64 KiB are summed in one buffer, larger ones alone."""
    big = np.linspace(-1, 1, 40_000, dtype=np.float32)  # 160 KB
    small = np.arange(7, dtype=np.int8)  # 7 bytes: padded to two words
    base = host_fingerprint([small, big])
    for a, b, i in ((small, big, 6), (big, small, 39_999), (big, small, 20_000)):
        for bit in (0, 7):
            flipped = _with_bit_flipped(a, i, bit)
            tree = [flipped, b] if a is small else [small, flipped]
            assert host_fingerprint(tree) != base, (i, bit)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32, np.float64, np.int8])
def test_flip_payload_bit_flips_one_bit_of_a_copy(dtype):
    first = _sample(dtype, 5).reshape(5, 1)
    second = np.arange(4, dtype=np.float32)
    tree = {"a": first, "b": second}
    keep_a, keep_b = first.copy(), second.copy()
    out = flip_payload_bit(tree)
    # The input is untouched (a copy comes back).
    assert np.array_equal(tree["a"].view(_UINT[first.dtype.itemsize]), keep_a.view(_UINT[first.dtype.itemsize]))
    assert np.array_equal(tree["b"], keep_b) and out["a"] is not first
    assert out["a"].shape == first.shape and out["a"].dtype == first.dtype
    # Exactly one bit differs, in the first array only.
    diff = np.bitwise_xor(out["a"].view(np.uint8), first.view(np.uint8))
    assert int(np.unpackbits(diff).sum()) == 1
    assert np.array_equal(out["b"], second)
    assert host_fingerprint(out) != host_fingerprint(tree)


def test_flip_payload_bit_on_a_one_element_array():
    a = np.array([1.5], np.float32)
    out = flip_payload_bit([a])
    assert a[0] == 1.5 and out[0][0] != 1.5
    assert host_fingerprint(out) != host_fingerprint([a])


def test_flip_payload_bit_on_a_bool_array_changes_its_fingerprint():
    a = np.array([True, False, True])
    assert host_fingerprint([flip_payload_bit([a])[0]]) != host_fingerprint([a])


DEVICES = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ray_elastic.worker.fingerprint import flip_bit, host_fingerprint, state_fingerprint

out = {{}}
devs = jax.devices()
out["n"] = len(devs)
mesh = Mesh(np.array(devs), ("d",))
rep = NamedSharding(mesh, P())
shd = NamedSharding(mesh, P("d"))

w = np.arange(32, dtype=np.float32).reshape(8, 4) / 7
b = np.arange(8, dtype=np.int32)
x = jax.device_put(w, rep)
y = jax.device_put(b, rep)
tree = {{"a": x, "b": y}}
out["rep"] = state_fingerprint(tree)
out["rep_again"] = state_fingerprint({{"a": jax.device_put(w.copy(), rep), "b": jax.device_put(b.copy(), rep)}})
out["rep_host"] = host_fingerprint({{"a": w, "b": b}})
flipped = flip_bit(tree)
out["rep_flipped"] = state_fingerprint(flipped)
out["rep_input_after"] = state_fingerprint(tree)
out["rep_first_device"] = x.addressable_shards[0].device.id
out["rep_others_equal_input"] = [bool(np.array_equal(np.asarray(s.data), w))
                                 for s in flipped["a"].addressable_shards[1:]]
out["b_unchanged"] = bool(np.array_equal(np.asarray(flipped["b"].addressable_shards[0].data), b))
out["sharding_kept"] = flipped["a"].sharding == x.sharding
d0 = np.asarray(flipped["a"].addressable_shards[0].data)
out["d0_bits_changed"] = int(np.unpackbits(np.bitwise_xor(d0.view(np.uint8), w.view(np.uint8))).sum())

z = jax.device_put(w, shd)
out["shd"] = state_fingerprint([z])
out["shd_host"] = [host_fingerprint([w[2 * i:2 * i + 2]]) for i in range(len(devs))]
out["shd_flipped"] = state_fingerprint(flip_bit([z]))
out["shd_first_device"] = z.addressable_shards[0].device.id
out["shd_first_index"] = str(z.addressable_shards[0].index)

# Every single-bit flip on the device path too, for a few dtypes (8-byte ones with x64).
misses = []
for dt in ["float32", "bfloat16", "int32", "bool", "float64", "int64", "int8"]:
    a = (np.arange(6) % 2 == 1) if dt == "bool" else np.asarray(jnp.arange(6).astype(dt))
    base = state_fingerprint([jax.device_put(a, devs[0])])
    if base != [host_fingerprint([a])]:
        misses.append((dt, "host and device prints differ"))
    size = a.dtype.itemsize
    uint = {{1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}}[size]
    for idx in (0, 5):
        for bit in (range(1) if dt == "bool" else range(8 * size)):
            c = a.copy()
            wv = c.view(uint)
            wv[idx] ^= uint(1) << uint(bit)
            if state_fingerprint([jax.device_put(c, devs[0])]) == base:
                misses.append((dt, idx, bit))
out["device_misses"] = misses
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def on_four_devices():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    got = subprocess.run([sys.executable, "-c", DEVICES.format(root=ROOT)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def test_state_fingerprint_gives_one_equal_print_per_device_of_a_replicated_tree(on_four_devices):
    r = on_four_devices
    assert r["n"] == 4
    assert len(r["rep"]) == 4 and len(set(r["rep"])) == 1
    assert r["rep"] == r["rep_again"]  # equal trees, equal prints
    assert r["rep"][0] == r["rep_host"]  # the device print is the host print of the same bits


def test_flip_bit_changes_only_the_first_device_of_a_replicated_array(on_four_devices):
    r = on_four_devices
    assert r["rep_first_device"] == 0
    assert r["rep_flipped"][0] != r["rep"][0]
    assert r["rep_flipped"][1:] == r["rep"][1:]
    assert r["rep_input_after"] == r["rep"]  # the input is not modified
    assert all(r["rep_others_equal_input"]) and r["b_unchanged"] and r["sharding_kept"]
    assert r["d0_bits_changed"] == 1


def test_flip_bit_changes_a_sharded_array_on_the_device_holding_the_first_shard(on_four_devices):
    r = on_four_devices
    assert r["shd"] == r["shd_host"]  # each device's print is over the shard it holds
    assert len(set(r["shd"])) == 4
    first = r["shd_first_device"]
    changed = [i for i in range(4) if r["shd_flipped"][i] != r["shd"][i]]
    assert changed == [first] and first == 0, (changed, first, r["shd_first_index"])


def test_every_single_bit_flip_changes_the_device_fingerprint(on_four_devices):
    assert on_four_devices["device_misses"] == []


def test_state_prints_take_reports_the_held_state_s_print_made_on_the_thread():
    import jax.numpy as jnp

    from ray_elastic.worker.fingerprint import state_fingerprint
    from ray_elastic.worker.state_prints import StatePrints

    tree = ({"w": jnp.arange(1000, dtype=jnp.float32)}, {"mu": jnp.ones((3, 5), jnp.bfloat16)})
    prints = StatePrints()
    assert prints.take(3, 1) is None  # none begun
    prints.begin(3, 1, tree)
    got = prints.take(3, 1)
    assert got is not None and got[0] == state_fingerprint(tree) and got[1] >= 0 and got[2] >= 0
    assert prints.take(3, 1)[0] == got[0]  # kept: a re-issued apply reports it again
    assert prints.take(3, 2) is None  # a state loaded since, even of the same step
    assert prints.take(4, 1) is None  # another step's state
    now, took = prints.now(tree)
    assert now == got[0] and took >= 0
    other = ({"w": jnp.arange(1000, dtype=jnp.float32) + 1}, tree[1])
    prints.begin(4, 1, other)
    prints.wait()
    assert prints.take(3, 1) is None and prints.take(4, 1)[0] != got[0]
