"""The snapshot buffer <-> state tree round trip used by checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from ray_elastic.checkpoint import unflatten


def test_unflatten_inverts_ravel_of_params_and_adam_state():
    params = {"b": jnp.arange(3.0), "a": {"w": jnp.ones((2, 2))}}
    opt = optax.adamw(1e-3)
    state = opt.init(params)
    for _ in range(3):  # count becomes 3: an int leaf among floats
        updates, state = opt.update(jax.tree.map(jnp.ones_like, params), state, params)
    flat, _ = ravel_pytree((params, state))
    template = {
        "params": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
        "opt_state": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state),
    }
    out = unflatten(np.asarray(flat), template)
    for x, y in zip(jax.tree.leaves((params, state)), jax.tree.leaves((out["params"], out["opt_state"]))):
        np.testing.assert_array_equal(np.asarray(x), y)
        assert np.asarray(x).dtype == y.dtype
    assert int(out["opt_state"][0].count) == 3
