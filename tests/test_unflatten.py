"""The snapshot buffer <-> state tree round trip used by checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
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


def test_whole_state_puts_the_hosts_blocks_together_and_keeps_a_whole_one():
    import jax

    from ray_elastic.checkpoint.state_forms import whole_state

    template = {"params": {"w": jax.ShapeDtypeStruct((4, 2), np.float32)},
                "opt_state": (jax.ShapeDtypeStruct((2,), np.float32),)}
    parts = ({"step": 3, "host": 0, "blocks": {("p", 0, ((0, 2), (0, 2))): np.ones((2, 2), np.float32),
                                                ("o", 0, ((0, 2),)): np.arange(2, dtype=np.float32)}},
             {"step": 3, "host": 1, "blocks": {("p", 0, ((2, 4), (0, 2))): np.full((2, 2), 2, np.float32)}})
    whole = whole_state(parts, template)
    assert whole["step"] == 3
    np.testing.assert_array_equal(whole["params"]["w"], [[1, 1], [1, 1], [2, 2], [2, 2]])
    np.testing.assert_array_equal(whole["opt_state"][0], [0, 1])
    replicated = {"step": 1, "params": {}, "opt_state": ()}
    assert whole_state(replicated) is replicated
    with pytest.raises(ValueError, match="template"):
        whole_state(parts)
    with pytest.raises(ValueError, match="do not cover"):
        whole_state(parts[:1], template)
