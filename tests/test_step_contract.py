"""The step contract in pure logic (no Ray): `TrainProgram` validation, the
per-shard scalars' reductions (`step_values` / `eval_values`), model states
and eval entries through `reduce_pieces` (direct payloads and the tree's
partial sums, bitwise), the step's RNG key, `check_outputs` on really
lowered grad/eval functions, `update_function` with `post_update`, and
`NonFiniteLoss` pickling. The end-to-end tests run the same on workers."""

from __future__ import annotations

import functools
import math
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from ray_elastic.errors import ConfigError, NonFiniteLoss
from ray_elastic.program import LossOutput, TrainProgram, skip_nonfinite
from ray_elastic.worker.reduction import eval_values, reduce_pieces, step_values
from ray_elastic.worker.step_math import (check_outputs, eval_function, grad_function, join_slot, split_slot,
                                          step_key, update_function)


def _loss2(params, batch):
    return jnp.mean(batch["x"] @ params["w"])


def _program(loss_fn=_loss2, optimizer=optax.sgd(0.1), **kw):
    return TrainProgram(init_params=lambda key: {"w": jnp.zeros(3)}, loss_fn=loss_fn, optimizer=optimizer,
                        make_batch=lambda *a: {"x": np.zeros((4, 3), np.float32)}, **kw)


def _setting(setting, **kw):
    with pytest.raises(ConfigError) as e:
        _program(**kw)
    assert e.value.setting == setting, e.value
    return e.value


# 1. TrainProgram validation ---------------------------------------------------------------------

def _ctx_loss(params, batch, ctx):
    return LossOutput(total=jnp.sum(batch["x"] @ params["w"]), weight=4.0)


@pytest.mark.parametrize("field", ["aux", "eval_aux"])
def test_bad_metric_declarations(field):
    assert "median" in str(_setting(f"program.{field}", **{field: {"acc": "median"}}))
    for reserved in ("loss", "slices", "step_s"):
        assert "rename" in str(_setting(f"program.{field}", **{field: {reserved: "mean"}}))
    for bad in ("eval/acc", "", 3):
        _setting(f"program.{field}", **{field: {bad: "mean"}})
    assert _program(loss_fn=_ctx_loss, **{field: {"acc": "weighted_mean"}}).takes_context


def test_model_state_settings():
    init = lambda key: {"mu": jnp.zeros(3)}  # noqa: E731
    _setting("program.model_state_reduction", loss_fn=_ctx_loss, init_model_state=init)
    _setting("program.model_state_reduction", loss_fn=_ctx_loss, init_model_state=init, model_state_reduction="avg")
    _setting("program.loss_fn", loss_fn=_loss2, init_model_state=init, model_state_reduction="mean")
    assert _program(loss_fn=_ctx_loss, init_model_state=init, model_state_reduction="mean").has_model_state


def test_eval_every_and_post_update_settings():
    _setting("program.eval_every", eval_every=5)
    _setting("program.eval_every", eval_every=5, eval_fn=_ctx_loss)  # no make_eval_batch
    for bad in (-1, True, 2.0):
        _setting("program.eval_every", eval_every=bad)
    _setting("program.post_update", post_update="skip")
    _program(eval_every=5, eval_fn=_ctx_loss, make_eval_batch=lambda *a: {})


def test_takes_context():
    four = lambda config, params, batch, ctx: None  # noqa: E731
    assert _program(loss_fn=_ctx_loss).takes_context
    assert _program(loss_fn=functools.partial(four, "config")).takes_context
    assert not _program(loss_fn=_loss2).takes_context
    assert not _program(loss_fn=functools.partial(four, "config", "params")).takes_context


# 2. The step's scalars --------------------------------------------------------------------------

AUX = {"acc": "weighted_mean", "acc_m": "mean", "tok": "sum", "peak": "max"}


def _shard(s, total, weight, aux):
    return {"loss": {s: total}, "weight": {s: weight}, "aux": {s: aux}}


def test_step_values_by_hand_with_unequal_weights():
    a = _shard(0, 6.0, 3.0, {"acc": 1.0, "acc_m": 1.0, "tok": 3.0, "peak": 2.0})
    b = _shard(1, 2.0, 1.0, {"acc": 0.0, "acc_m": 0.0, "tok": 1.0, "peak": 5.0})
    merged = {k: {**a[k], **b[k]} for k in a}
    reverse = {k: {**b[k], **a[k]} for k in a}  # other insertion order
    v = step_values(merged, AUX)
    assert (v.loss, v.weight, v.shards) == (2.0, 4.0, 2)  # 8 / 4, not the mean of shard means (1.5)
    assert v.aux == {"acc": 0.75, "acc_m": 0.5, "tok": 4.0, "peak": 5.0}
    assert step_values(reverse, AUX) == v
    # The same through reduce_pieces, from one payload or one per shard.
    g = {"w": np.zeros(3, np.float32)}
    one = reduce_pieces(jax.tree.map, None, ({"grads": {0: g, 1: g}, **merged},))
    two = reduce_pieces(jax.tree.map, None, ({"grads": {1: g}, **b}, {"grads": {0: g}, **a}))
    assert step_values(one, AUX) == step_values(two, AUX) == v


def test_legacy_payloads_weigh_one_per_shard():
    v = step_values({"loss": {1: 3.0, 0: 1.0}}, {})
    assert (v.loss, v.weight, v.shards, v.aux) == (2.0, 2.0, 2, {})
    g = {"w": np.zeros(3, np.float32)}
    total = reduce_pieces(jax.tree.map, None, ({"grads": {0: g, 1: g}, "loss": {0: 1.0, 1: 3.0}},))
    assert step_values(total, {}).loss == 2.0


def test_eval_values():
    assert eval_values({"loss": {0: 1.0}, "eval": {}}, {}) is None
    ev = eval_values({"eval": {1: {"total": 2.0, "weight": 1.0, "aux": {"acc": 0.0}},
                               0: {"total": 6.0, "weight": 3.0, "aux": {"acc": 1.0}}}}, {"acc": "weighted_mean"})
    assert (ev.loss, ev.weight, ev.aux) == (2.0, 4.0, {"acc": 0.75})


# 3. Model states and evals through reduce_pieces -----------------------------------------------

N = 6


def _payload(shards):
    """A phase-1 payload of `shards`: random gradients and model states."""
    out = {"grads": {}, "model_state": {}, "loss": {}, "weight": {}, "aux": {}, "eval": {}}
    for s in shards:
        rng = np.random.default_rng(100 + s)
        out["grads"][s] = {"w": rng.standard_normal((5, 3)).astype(np.float32)}
        out["model_state"][s] = {"mu": rng.standard_normal(7).astype(np.float32),
                                 "var": rng.random((2, 2)).astype(np.float32)}
        out["loss"][s], out["weight"][s], out["aux"][s] = float(s), 1.0 + s, {"acc": s / 10}
        out["eval"][s] = {"total": 2.0 * s, "weight": 1.0, "aux": {"acc": s / 20}}
    return out


def _in_order(op, field):
    """Shard 0's copy combined with shards 1.. in order (the direct apply)."""
    states = [_payload([s])[field][s] for s in range(N)]
    acc = {k: np.array(v, copy=True) for k, v in states[0].items()}
    for st in states[1:]:
        for k in acc:
            acc[k] = np.maximum(acc[k], st[k]) if op == "max" else acc[k] + st[k]
    return acc


def _tree(assign, op):
    """Pairs of consecutive keys reduced from whichever payloads hold
    them, then the pairs' partials reduced at the apply."""
    partials = []
    for j in range(0, N, 2):
        keys = (j, j + 1)
        parts = tuple({id(assign[k]): assign[k] for k in keys}.values())
        partials.append(reduce_pieces(jax.tree.map, keys, parts, op))
    return reduce_pieces(jax.tree.map, None, tuple(partials), op)


def _assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y, strict=True)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_model_states_bitwise_for_any_split(op):
    expected = _in_order(op, "model_state")
    splits = ([list(range(N))], [[s] for s in range(N)], [[5, 3, 1], [4, 2, 0]])
    for split in splits:
        parts = [_payload(sh) for sh in split]
        copies = [jax.tree.map(np.copy, p) for p in parts]
        total = reduce_pieces(jax.tree.map, None, tuple(parts), op)
        assert total["count"] == N and total["key"] == 0
        _assert_bitwise(total["model_state"], expected)
        _assert_bitwise(total["sum"], _in_order("sum", "grads"))
        _assert_bitwise(parts, copies)  # the payloads are not written into
    # Through partial sums: the same bits whichever slices held which shards.
    trees = []  # all slices live, then survivors computing the lost slices' shards
    for live in ([0, 1, 2, 3, 4, 5], [0, 3], [2]):
        held = {s: [k for k in range(N) if live[k % len(live)] == s] for s in live}
        payload_of = {s: _payload(sh) for s, sh in held.items()}
        trees.append(_tree({k: payload_of[s] for s, sh in held.items() for k in sh}, op))
    pair = lambda st, k: jax.tree.map(  # noqa: E731
        lambda a, b: np.maximum(a, b) if op == "max" else a + b, st[k], st[k + 1])
    states = _payload(range(N))["model_state"]
    grouped = jax.tree.map(lambda a, b, c: np.maximum(np.maximum(a, b), c) if op == "max" else (a + b) + c,
                           pair(states, 0), pair(states, 2), pair(states, 4))
    for t in trees:
        assert t["count"] == N
        _assert_bitwise(t["model_state"], grouped)
        _assert_bitwise(t["sum"], trees[0]["sum"])
    if op == "max":
        _assert_bitwise(trees[0]["model_state"], expected)


def test_eval_entries_ride_through_partials():
    everything = _payload(range(N))
    # A node keeps only its own shards' scalars of a payload that holds more.
    node = reduce_pieces(jax.tree.map, (2, 3), (everything,))
    assert sorted(node["eval"]) == sorted(node["loss"]) == sorted(node["aux"]) == [2, 3]
    total = _tree({k: everything for k in range(N)}, "sum")
    assert total["eval"] == everything["eval"] and total["weight"] == everything["weight"]
    ev = eval_values(total, {"acc": "mean"})
    assert ev.loss == sum(2.0 * s for s in range(N)) / N and ev.shards == N
    assert ev.aux["acc"] == pytest.approx(sum(s / 20 for s in range(N)) / N)


# 4. The step's RNG key --------------------------------------------------------------------------

def test_step_key_is_a_function_of_seed_step_shard_only():
    def ref(seed, step, shard):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), step), shard)

    k = np.asarray(step_key(7, 3, 1))
    np.testing.assert_array_equal(k, np.asarray(ref(7, 3, 1)))
    traced = jax.jit(step_key, static_argnums=0)(7, jnp.int32(3), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(traced), k)
    others = [step_key(7, 3, 0), step_key(7, 4, 1), step_key(8, 3, 1), step_key(7, 1, 3)]
    assert all(not np.array_equal(np.asarray(o), k) for o in others)


# 5. check_outputs on lowered functions -----------------------------------------------------------

MESH = Mesh(np.array(jax.devices()[:1]), ("data",))
PARAMS = {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}
BATCH = {"x": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
I32 = jax.ShapeDtypeStruct((), jnp.int32)
STATE = {"mu": jax.ShapeDtypeStruct((3,), jnp.float32)}


def _lower_and_check(loss_fn, aux=None, state=False, make=grad_function):
    kw = dict(init_model_state=lambda key: {"mu": jnp.zeros(3)}, model_state_reduction="mean") if state else {}
    if make is eval_function:  # the function under test is the eval's
        kw.update(eval_fn=loss_fn, eval_aux=aux or {})
        loss_fn, aux = _ctx_loss, {}
    program = _program(loss_fn=loss_fn, aux=aux or {}, **kw)
    opt = jax.eval_shape(optax.sgd(0.1).init, PARAMS)
    slot = join_slot(program, opt, STATE if state else None)
    lowered = jax.jit(make(program, MESH, seed=0, num_shards=2)).lower(PARAMS, slot, BATCH, I32, I32)
    if make is grad_function:
        check_outputs(program, lowered.out_info, split_slot(program, slot)[1])
    else:
        check_outputs(program, (*lowered.out_info, None, None), None, fn="eval_fn", declared=program.eval_aux)


def _out(**kw):
    def loss(params, batch, ctx):
        y = batch["x"] @ params["w"]
        fields = {"total": jnp.sum(y), "weight": 4.0, "aux": {"acc": jnp.mean(y)}, "model_state": ctx.model_state}
        fields.update({k: v(y, ctx) if callable(v) else v for k, v in kw.items()})
        return LossOutput(**fields)
    return loss


def test_check_outputs_accepts_a_good_program():
    _lower_and_check(_out(model_state=lambda y, ctx: {"mu": ctx.model_state["mu"] + jnp.mean(y)}),
                     aux={"acc": "weighted_mean"}, state=True)
    _lower_and_check(_loss2)  # the plain contract
    _lower_and_check(_out(), aux={"acc": "mean"}, make=eval_function)


@pytest.mark.parametrize("loss_fn, aux, state, setting", [
    (lambda p, b, ctx: (jnp.sum(b["x"] @ p["w"]), 4.0), {}, False, "program.loss_fn"),  # a tuple
    (_out(), {}, False, "program.aux"),  # acc not declared
    (_out(aux={}), {"acc": "mean"}, False, "program.aux"),  # declared, not returned
    (_out(aux=lambda y, ctx: {"acc": y}), {"acc": "mean"}, False, "program.loss_fn"),  # non-scalar aux
    (_out(weight=lambda y, ctx: jnp.ones(4)), {"acc": "mean"}, False, "program.loss_fn"),  # non-scalar weight
    (_out(model_state=lambda y, ctx: {"mu": jnp.zeros(4)}), {"acc": "mean"}, True, "program.loss_fn"),
    (_out(model_state=lambda y, ctx: {"mu": jnp.zeros(3, jnp.int32)}), {"acc": "mean"}, True, "program.loss_fn"),
    (_out(model_state=lambda y, ctx: {"nu": ctx.model_state["mu"]}), {"acc": "mean"}, True, "program.loss_fn"),
])
def test_check_outputs_rejects(loss_fn, aux, state, setting):
    with pytest.raises(ConfigError) as e:
        _lower_and_check(loss_fn, aux=aux, state=state)
    assert e.value.setting == setting, e.value


def test_a_non_scalar_eval_total_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        _lower_and_check(_out(total=lambda y, ctx: y, aux={}), make=eval_function)
    assert e.value.setting == "program.eval_fn"


def test_a_non_scalar_total_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        _lower_and_check(_out(total=lambda y, ctx: y, aux={}))
    assert e.value.setting == "program.loss_fn"


# 6. update_function with post_update ------------------------------------------------------------

MOMENTUM = optax.sgd(0.1, momentum=0.9)  # an optimizer state that a step changes (its trace)


def _update(post_update, loss, grad=1.0, state=False):
    kw = dict(init_model_state=lambda key: {"mu": jnp.zeros(3)}, model_state_reduction="mean") if state else {}
    program = _program(loss_fn=_ctx_loss, optimizer=MOMENTUM, post_update=post_update, **kw)
    params = {"w": jnp.ones(3)}
    slot = join_slot(program, MOMENTUM.init(params), {"mu": jnp.zeros(3)} if state else None)
    new_state = {"mu": jnp.full(3, 5.0)} if state else None
    fn = jax.jit(update_function(program))
    return fn(params, slot, {"w": jnp.full(3, grad)}, new_state, {"loss": jnp.float32(loss)})


def test_skip_nonfinite_keeps_the_old_state():
    params, slot = _update(skip_nonfinite, 1.0)
    np.testing.assert_allclose(params["w"], np.full(3, 0.9), rtol=1e-6)
    np.testing.assert_array_equal(slot[0].trace["w"], np.ones(3))  # the momentum took the gradient
    for loss, grad in ((np.nan, 1.0), (np.inf, 1.0), (1.0, np.nan)):
        params, slot = _update(skip_nonfinite, loss, grad)
        np.testing.assert_array_equal(params["w"], np.ones(3))
        _assert_bitwise(slot, MOMENTUM.init({"w": jnp.ones(3)}))
    _, slot = _update(skip_nonfinite, np.nan, state=True)
    np.testing.assert_array_equal(slot["model_state"]["mu"], np.zeros(3))
    _, slot = _update(skip_nonfinite, 2.0, state=True)
    np.testing.assert_array_equal(slot["model_state"]["mu"], np.full(3, 5.0))
    params, _ = _update(None, np.nan)  # no post_update: the update goes in
    np.testing.assert_allclose(params["w"], np.full(3, 0.9), rtol=1e-6)


def test_post_update_must_return_a_train_state():
    for bad in (lambda old, new, g, m: tuple(new), lambda old, new, g, m: new.params):  # not a TrainState
        with pytest.raises(ConfigError) as e:
            _update(bad, 1.0)
        assert e.value.setting == "program.post_update"


# 7. NonFiniteLoss ---------------------------------------------------------------------------------

def test_non_finite_loss_pickles():
    e = NonFiniteLoss(12, float("nan"))
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is NonFiniteLoss and back.step == 12 and math.isnan(back.loss)
    assert back.setting == e.setting == "program.post_update"
    assert str(back) == str(e) and "step 12" in str(e) and "skip_nonfinite" in str(e)
