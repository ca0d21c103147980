"""DiLoCo's outer state on one host (worker/diloco.py) with real JAX: on
an accelerator the outer optimizer's state waits in host memory between
synchronizations, so an inner step's device holds the round's global
params and nothing more. Parking is forced here on CPU (where it is off
by default) and must change no bit of what the outer steps compute."""

from __future__ import annotations

import types

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from ray_elastic.dispatch.outer_spec import OuterSpec  # noqa: E402
from ray_elastic.worker.diloco import OuterState  # noqa: E402
from ray_elastic.worker.parked import HostParked  # noqa: E402

LAYOUT = types.SimpleNamespace(sharded=False)


def _where(a) -> str:
    return "host" if isinstance(a, HostParked) else "devices"


def _host(a) -> np.ndarray:
    return np.asarray(a.on_devices() if isinstance(a, HostParked) else a)


def _params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": jax.numpy.asarray(rng.standard_normal((64, 32), dtype=np.float32)),
            "b": jax.numpy.asarray(rng.standard_normal(32, dtype=np.float32))}


def _rounds(park, spec: OuterSpec, rounds: int = 4):
    """The outer state after `rounds` outer steps, each with a delta made
    from fixed inner params, and the memory kinds its state held between them."""
    outer = OuterState(LAYOUT, 0, park=park)
    outer.start(_params(0), spec, 0)
    kinds = {_where(a) for a in jax.tree.leaves(outer.state)}
    params = outer.global_copy(spec)
    for r in range(rounds):
        inner = jax.tree.map(lambda a, r=r: a * (1.0 - 0.01 * (r + 1)), params)
        delta = outer.delta(inner, spec)
        if spec.fragments:
            leaves = (r % 2,)
            g = jax.tree.leaves(delta)
            params = outer.apply({i: g[i] for i in leaves}, spec, 4 * (r + 1), inner, fragment=True)
        else:
            params = outer.apply(delta, spec, 4 * (r + 1), inner)
        kinds |= {_where(a) for a in jax.tree.leaves(outer.state)}
    return outer, params, kinds


@pytest.mark.parametrize("fragments", [0, 2])
def test_a_parked_outer_state_waits_in_host_memory_and_steps_bitwise_as_one_kept_on_the_devices(fragments):
    spec = OuterSpec(0.7, 0.9, fragments=fragments)
    kept, kept_params, kept_kinds = _rounds(False, spec)
    parked, parked_params, parked_kinds = _rounds(True, spec)
    assert kept_kinds == {"devices"}
    assert parked_kinds == {"host"}  # between every two outer steps, not only at the start
    # The global params stay on the devices: the inner steps read them.
    assert {_where(a) for a in jax.tree.leaves(parked.global_params)} == {"devices"}
    for a, b in zip(jax.tree.leaves((kept.global_params, kept.state, kept_params)),
                    jax.tree.leaves((parked.global_params, parked.state, parked_params))):
        assert _host(a).tobytes() == _host(b).tobytes()
    # The momentum moved: a check that the comparison above compared outer steps that did something.
    assert any(np.abs(_host(a)).max() > 0 for a in jax.tree.leaves(parked.state))


def test_a_parked_outer_state_is_copied_out_loaded_and_taken_back_as_it_was():
    spec = OuterSpec(0.7, 0.9)
    outer, _, _ = _rounds(True, spec, rounds=2)
    copy = outer.host_copy()
    again = OuterState(types.SimpleNamespace(sharded=False, params_spec=lambda: jax.eval_shape(lambda: _params(0)),
                                             param_specs=[types.SimpleNamespace(sharding=a.sharding)
                                                          for a in jax.tree.leaves(outer.global_params)]),
                       0, park=True)
    again.load(copy, spec)
    assert again.synced == outer.synced == 8
    assert {_where(a) for a in jax.tree.leaves(again.state)} == {"host"}
    for a, b in zip(jax.tree.leaves((outer.global_params, outer.state)), jax.tree.leaves((again.global_params, again.state))):
        assert _host(a).tobytes() == _host(b).tobytes()
    # An outer step taken back leaves the state as parked before it.
    before = [_host(a).copy() for a in jax.tree.leaves(outer.state)]
    params = outer.global_copy(spec)
    outer.apply(outer.delta(jax.tree.map(lambda a: a * 0.5, params), spec), spec, 12, params)
    assert outer.undo(8)[0] and outer.synced == 8
    assert all(np.array_equal(a, _host(b)) for a, b in zip(before, jax.tree.leaves(outer.state)))
    assert {_where(a) for a in jax.tree.leaves(outer.state)} == {"host"}


PARK_ON_FOUR_DEVICES = r"""
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ray_elastic.worker.parked import HostParked, park, unpark
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
tree = {"sharded": jax.device_put(x, NamedSharding(mesh, P("data", "model"))),
        "half": jax.device_put(x, NamedSharding(mesh, P("data"))),
        "replicated": jax.device_put(x, NamedSharding(mesh, P()))}
parked = park(tree)
assert all(isinstance(a, HostParked) for a in jax.tree.leaves(parked))
# one host copy per distinct block: 4, 2 and 1 of them
print({k: len({id(b) for _, b in v.blocks}) for k, v in parked.items()})
back = unpark(parked)
for k in tree:
    assert back[k].sharding == tree[k].sharding, k
    assert np.asarray(back[k]).tobytes() == x.tobytes(), k
print("ok")
"""


def test_parked_arrays_come_back_with_their_sharding_and_bits_under_every_layout():
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run([sys.executable, "-c", PARK_ON_FOUR_DEVICES], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    counts, done = out.stdout.splitlines()
    assert eval(counts) == {"sharded": 4, "half": 2, "replicated": 1} and done == "ok"
