"""The gradient reduction: in-order sums over shards, whether the pieces
come straight from phase-1 payloads or through the controller's tree of
partial sums (pure logic; the end-to-end tests run it on real workers)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ray_elastic.dispatch.step_runner import APPLY_FAN_IN
from ray_elastic.worker.reduction import reduce_pieces


def _payload(shards, rng_seed=0):
    grads, losses = {}, {}
    for s in shards:
        rng = np.random.default_rng(1000 + s)
        grads[s] = {"w": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
        losses[s] = float(s) / 10
    return {"grads": grads, "loss": losses}


def _flat_mean(n):
    """The old apply's arithmetic: shard 0 copied, the rest added in order,
    divided by n."""
    gs = [_payload([s])["grads"][s] for s in range(n)]
    out = {}
    for k in gs[0]:
        acc = np.array(gs[0][k], copy=True)
        for g in gs[1:]:
            acc += g[k]
        acc /= n
        out[k] = acc
    return out


def _tree(parts_by_shard, n, assign):
    """The controller's tree: groups of APPLY_FAN_IN consecutive keys, each
    reduced from whichever payloads hold them, down to one node."""
    nodes, built = [(s, [assign[s]]) for s in range(n)], False
    while len(nodes) > APPLY_FAN_IN or (built and len(nodes) > 1):
        built = True
        nxt = []
        for j in range(0, len(nodes), APPLY_FAN_IN):
            group = nodes[j:j + APPLY_FAN_IN]
            keys = tuple(k for k, _ in group)
            parts = [p for _, ps in group for p in ps]
            nxt.append((keys[0], [reduce_pieces(jax.tree.map, keys, tuple(parts))]))
        nodes = nxt
    return [p for _, ps in nodes for p in ps]


def _mean(parts):
    total = reduce_pieces(jax.tree.map, None, tuple(parts))
    return {k: v / total["count"] for k, v in total["sum"].items()}, total


@pytest.mark.parametrize("n", [1, 2, 3, APPLY_FAN_IN])
def test_direct_payloads_match_the_in_order_mean_bitwise(n):
    """Up to the fan-in, apply sums the payloads as before, whichever slice
    computed which shard."""
    expected = _flat_mean(n)
    for split in ([list(range(n))], [[s] for s in range(n)], [list(range(0, n, 2)), list(range(1, n, 2))]):
        parts = [_payload(shards) for shards in split if shards]
        total = reduce_pieces(jax.tree.map, None, tuple(parts))
        assert total["count"] == n
        for k in expected:
            got = np.array(total["sum"][k], copy=True)
            got /= n
            np.testing.assert_array_equal(got, expected[k])


@pytest.mark.parametrize("n", [APPLY_FAN_IN + 1, 64, 100])
def test_tree_is_bitwise_the_same_for_any_assignment(n):
    """Above the fan-in the tree's additions depend only on the shard count:
    all slices live, or survivors computing a lost slice's shards, give the
    same bits; and the result is the mean (to float error)."""
    results = []
    for live in (list(range(n)), list(range(0, n, 3)), [0]):
        held = {s: [] for s in live}
        for shard in range(n):
            held[live[shard % len(live)]].append(shard)
        payload_of = {s: _payload(shards) for s, shards in held.items()}
        assign = {shard: payload_of[s] for s, shards in held.items() for shard in shards}
        parts = _tree(None, n, assign)
        assert len(parts) == 1
        mean, total = _mean(parts)
        assert total["count"] == n and sorted(total["loss"]) == list(range(n))
        results.append(mean)
    for other in results[1:]:
        for k in results[0]:
            np.testing.assert_array_equal(other[k], results[0][k])
    exact = _flat_mean(n)
    for k in exact:
        np.testing.assert_allclose(results[0][k], exact[k], rtol=1e-5, atol=1e-6)


def test_a_node_missing_a_piece_fails_loudly():
    with pytest.raises(RuntimeError, match="missing pieces"):
        reduce_pieces(jax.tree.map, (0, 1, 2), (_payload([0, 1]),))
