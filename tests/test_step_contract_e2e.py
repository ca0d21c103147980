"""The step contract on real clusters: a program written like a real train
step (token-weighted loss with padding, dropout keys per (step, shard),
z-loss and accuracy as aux metrics, an eval, skipped non-finite steps;
and a CNN whose batch norm statistics are model state) computes what a
plain single-process JAX loop computes on the same global batch, and a
run with failures ends bitwise equal to one without.

Tolerance of the comparison with the plain loop: float32 rounding only.
ray_elastic sums each shard's loss and gradient on its own (over the
devices of its slice) and adds the shards in shard order; the plain loop
sums the whole batch in one XLA reduction, so the additions happen in
another order. Losses agree within 1.1e-7 relative (measured; 1e-5
asserted). Over the 12 AdamW steps here that moves params by a few 1e-6 (the
update divides by sqrt(v), which magnifies the last bits of gradients
near zero; measured over 20 steps: at most 9e-6); per-shard weighting instead moves
them by about 6e-2 (checked below), three orders of magnitude beyond. The
attention's key biases are left out: their exact gradient is zero (a key
bias shifts every logit of a query alike, and softmax ignores that), so
Adam drives them by rounding noise alone, in both runs alike.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ray_elastic import CpuSlice, ElasticConfig, ElasticTrainer, Fault
from tests.run_checks import assert_no_failures

pytestmark = pytest.mark.cluster

STEPS = 12
SHARDS = 4
SEED = 0
EVAL_EVERY = 4
PARAM_ATOL = 5e-5  # absolute, on params of magnitude ~0.02-1 (see the docstring)
LOSS_RTOL = 1e-5


def _token_config():
    import examples.lm_tokens as lt

    return lt.TokenLMConfig(eval_every=EVAL_EVERY)


@pytest.fixture(scope="module")
def token_factory():
    import examples.lm as lm
    import examples.lm_tokens as lt

    return functools.partial(lt.make_program, _token_config(), lm.sharded_layout("fsdp"))


# The token LM's slices: one host, FSDP over its two devices. On two hosts,
# each reading its own rows, it runs in tests/test_grain_e2e.py.
TOKEN_SHAPE = dict(hosts=1, devices=2)


def _config(hosts=2, devices=1, **kw) -> ElasticConfig:
    kw.setdefault("num_slices", 2)
    kw.setdefault("batch_shards", SHARDS)
    kw.setdefault("step_deadline_floor_s", 10.0)
    kw.setdefault("timeout_s", 180.0)
    kw.setdefault("seed", SEED)
    return ElasticConfig(slice=CpuSlice(hosts=hosts, devices_per_host=devices), **kw)


def _whole(parts: list, like) -> list:
    """The whole leaves of a sharded final state (one part per host)."""
    import jax

    leaves = [np.zeros(a.shape, a.dtype) for a in jax.tree.leaves(like)]
    for part in parts:
        for (tag, i, key), block in part["blocks"].items():
            if tag == "p":
                leaves[i][tuple(slice(a, b) for a, b in key)] = block
    return leaves


def _plain_run(config, per_shard: bool = False):
    """A plain JAX loop on one process over the same global batches and
    dropout keys: (losses, eval losses by state step, final params)."""
    import jax
    import jax.numpy as jnp
    import optax

    import examples.lm as lm
    import examples.lm_tokens as lt
    from ray_elastic import skip_nonfinite, TrainState

    params = lm.init_params(config.lm, jax.random.PRNGKey(SEED))
    opt = lm.make_optimizer(config.lm)
    opt_state = opt.init(params)
    keys = lambda step: [jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(SEED), step), s)  # noqa: E731
                         for s in range(SHARDS)]

    def loss_of(p, batches, rngs):
        if per_shard:  # the mistake the test must catch: a mean of shard means
            sums = [lt._shard_sums(config, p, b, r, True) for b, r in zip(batches, rngs)]
            return sum(s[0] / s[1] for s in sums) / len(sums)
        return lt.plain_loss(config, p, batches, rngs)

    @jax.jit
    def step_fn(p, o, batches, rngs):
        loss, g = jax.value_and_grad(loss_of)(p, batches, rngs)
        updates, new_o = opt.update(g, o, p)
        new = skip_nonfinite(TrainState(p, o), TrainState(optax.apply_updates(p, updates), new_o), g,
                             {"loss": loss})
        return loss, new.params, new.opt_state

    @jax.jit
    def eval_fn(p, batches):
        sums = [lt._shard_sums(config, p, b, None, False) for b in batches]
        return sum(s[0] for s in sums) / sum(s[1] for s in sums)

    eval_batches = [lt.make_eval_batch(config, SEED, s, SHARDS) for s in range(SHARDS)]
    losses, evals = [], {}
    for step in range(STEPS):
        if step % EVAL_EVERY == 0:
            evals[step] = float(eval_fn(params, eval_batches))
        batches = [lt.make_batch(config, SEED, step, s, SHARDS) for s in range(SHARDS)]
        loss, params, opt_state = step_fn(params, opt_state, batches, keys(step))
        losses.append(float(loss))
    return losses, evals, params


@pytest.fixture(scope="module")
def token_run(cluster, token_factory):
    cluster.ensure_nodes(2)
    trainer = ElasticTrainer(token_factory, _config(policy="pause", **TOKEN_SHAPE), STEPS, keep_final_state=True)
    report = trainer.fit()
    assert report.steps_completed == STEPS and not report.failures
    return trainer, report


def test_token_weighted_run_equals_a_plain_jax_loop(token_run):
    trainer, report = token_run
    config = _token_config()
    losses, evals, params = _plain_run(config)
    np.testing.assert_allclose(report.losses, losses, rtol=LOSS_RTOL)
    import jax

    got = _whole(trainer.final_state, params)
    kept = sorted(_leaves_without_zero_gradient())
    want = [np.asarray(a) for a in jax.tree.leaves(params)]
    worst = max(float(np.max(np.abs(got[i] - want[i]))) for i in kept)
    assert worst < PARAM_ATOL, worst
    # The eval of the state after step k comes with step k + 1's metrics.
    for k, value in evals.items():
        np.testing.assert_allclose(report.metrics_per_step[k]["eval/loss"], value, rtol=LOSS_RTOL)
    # Per-shard weighting (a mean of shard means) is told apart: far outside the tolerance.
    _, _, wrong = _plain_run(config, per_shard=True)
    off = max(float(np.max(np.abs(got[i] - np.asarray(w)))) for i, w in enumerate(jax.tree.leaves(wrong)) if i in kept)
    assert off > 10 * PARAM_ATOL, off


def test_aux_metrics_reach_every_step_and_the_report(token_run):
    _, report = token_run
    assert len(report.metrics_per_step) == STEPS
    for k, m in enumerate(report.metrics_per_step):
        assert 0.0 <= m["accuracy"] <= 1.0 and m["z_loss"] > 0
        # Real tokens of the global batch: even shards long documents, odd ones short.
        assert 0 < m["tokens"] < SHARDS * 8 * 64
        assert ("eval/loss" in m) == (k % EVAL_EVERY == 0), (k, m)
    step_events = [e for e in report.events if e["event"] == "step"] or None
    assert step_events is None or "accuracy" in step_events[-1]


def _same_parts(a: list, b: list) -> None:
    """Two sharded final states (one part per host) bitwise equal: params,
    optimizer state and model state alike."""
    assert len(a) == len(b)
    for pa, pb in zip(a, b):
        assert pa["step"] == pb["step"] and pa["blocks"].keys() == pb["blocks"].keys()
        for key in pa["blocks"]:
            np.testing.assert_array_equal(pa["blocks"][key], pb["blocks"][key], err_msg=str(key))


def _added_on_detect(cluster):
    added = []

    def on_event(e):  # the replacement node arrives from outside, as an autoscaler's would
        if e["event"] == "detected" and not added:
            added.append(cluster.add_node())

    return on_event


# The default run takes the token LM through a resize kill with Grain's
# records (tests/test_grain_e2e.py) and the CNN through a node removal
# under pause (below); this one takes the token LM through a node removal
# under resize. The policy and the fault are the controller's, not the
# step's: the other pairs repeat a path these take.
@pytest.mark.parametrize("policy,fault", [
    pytest.param("resize", "remove_node", marks=pytest.mark.slow),
])
def test_token_lm_through_a_failure_ends_bitwise_equal(cluster, token_factory, token_run, policy, fault):
    """Dropout keys, token weights, aux metrics and evals through a lost
    slice: the same state and the same figures as the failure-free run."""
    cluster.ensure_nodes(2)
    base_trainer, base = token_run
    trainer = ElasticTrainer(token_factory, _config(policy=policy, **TOKEN_SHAPE), STEPS, keep_final_state=True,
                             faults=(Fault(fault, slice_id=1, step=7),), remove_node=cluster.remove_node,
                             on_event=_added_on_detect(cluster) if fault == "remove_node" else None)
    report = trainer.fit()
    assert report.steps_completed == STEPS and len(report.failures) == 1
    _same_parts(trainer.final_state, base_trainer.final_state)
    assert report.losses == base.losses
    assert report.metrics_per_step == base.metrics_per_step  # aux metrics and evals, bit for bit


# -- the CNN: batch norm statistics as model state ---------------------------


@pytest.fixture(scope="module")
def cnn_factory():
    import examples.cnn as cnn

    return functools.partial(cnn.make_program, cnn.CNNConfig())


CNN_STEPS = 12


@pytest.fixture(scope="module")
def cnn_run(cluster, cnn_factory):
    cluster.ensure_nodes(2)
    trainer = ElasticTrainer(cnn_factory, _config(hosts=1, policy="pause"), CNN_STEPS, keep_final_state=True)
    report = trainer.fit()
    assert report.steps_completed == CNN_STEPS and not report.failures
    return trainer, report


def test_cnn_batch_stats_follow_the_plain_loop(cnn_run):
    """The model state is carried: the running statistics move every step
    as the mean of the shards' (a synchronized batch norm) and equal a
    plain loop's, within float32 rounding (the shards' statistics are
    averaged in shard order here, in one reduction there)."""
    import jax
    import jax.numpy as jnp
    import optax

    import examples.cnn as cnn

    trainer, report = cnn_run
    config = cnn.CNNConfig()
    program = cnn.make_program(config)
    params = program.init_params(jax.random.PRNGKey(SEED))
    stats = program.init_model_state(jax.random.PRNGKey(SEED))
    opt_state = program.optimizer.init(params)
    losses = []
    for step in range(CNN_STEPS):
        batches = [cnn.make_batch(config, SEED, step, s, SHARDS) for s in range(SHARDS)]

        def loss_of(p):
            outs = [cnn.CNN(config.features).apply({"params": p, "batch_stats": stats}, b["images"], train=True,
                                                   mutable=["batch_stats"]) for b in batches]
            xent = [optax.softmax_cross_entropy_with_integer_labels(o[0], b["labels"]).sum()
                    for o, b in zip(outs, batches)]
            new = jax.tree.map(lambda *s: sum(s) / len(s), *[o[1]["batch_stats"] for o in outs])
            return sum(xent) / sum(len(b["labels"]) for b in batches), new

        (loss, stats), g = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = program.optimizer.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    np.testing.assert_allclose(report.losses, losses, rtol=1e-5)
    got = trainer.final_state["opt_state"]["model_state"]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(stats)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    init = program.init_model_state(jax.random.PRNGKey(SEED))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(init)))
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in report.metrics_per_step)
    del jnp


@pytest.mark.parametrize("policy,fault", [
    ("pause", "remove_node"),
    pytest.param("resize", "kill", marks=pytest.mark.slow),
])
def test_cnn_through_a_failure_ends_bitwise_equal(cluster, cnn_factory, cnn_run, policy, fault):
    """The batch statistics come back with the params from the survivors
    or a snapshot: the run ends bitwise equal, model state included."""
    import jax

    cluster.ensure_nodes(2)
    base_trainer, base = cnn_run
    trainer = ElasticTrainer(cnn_factory, _config(hosts=1, policy=policy), CNN_STEPS, keep_final_state=True,
                             faults=(Fault(fault, slice_id=1, step=5),), remove_node=cluster.remove_node,
                             on_event=_added_on_detect(cluster) if fault == "remove_node" else None)
    report = trainer.fit()
    assert report.steps_completed == CNN_STEPS and len(report.failures) == 1
    assert report.losses == base.losses
    a, b = trainer.final_state, base_trainer.final_state
    assert a["step"] == b["step"] == CNN_STEPS
    for x, y in zip(jax.tree.leaves((a["params"], a["opt_state"])), jax.tree.leaves((b["params"], b["opt_state"]))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- microbatches ----------------------------------------------------------------


def test_microbatches_compute_the_same_steps(cluster):
    """Each shard's 8 rows scanned as 4 microbatches of 2 on the device:
    the same losses and params as whole shards, to float32 rounding (the
    rows' gradients are added in another grouping), on a sharded layout
    (the microbatches take rows of every device)."""
    import examples.lm as lm

    cluster.ensure_nodes(2)
    runs = []
    for k in (1, 4):
        factory = functools.partial(lm.make_program, lm.LMConfig(), lm.sharded_layout("fsdp"), None, k)
        config = ElasticConfig(num_slices=2, batch_shards=SHARDS, policy="pause", timeout_s=120.0,
                               slice=CpuSlice(hosts=1, devices_per_host=2))
        trainer = ElasticTrainer(factory, config, 8, keep_final_state=True)
        report = trainer.fit()
        assert_no_failures(report)
        runs.append((report, trainer.final_state))
    (plain, a), (micro, b) = runs
    np.testing.assert_allclose(micro.losses, plain.losses, rtol=LOSS_RTOL)
    kept = _leaves_without_zero_gradient()
    for pa, pb in zip(a, b):
        for key in pa["blocks"]:
            if key[0] == "p" and key[1] in kept:
                np.testing.assert_allclose(pa["blocks"][key], pb["blocks"][key], atol=PARAM_ATOL, err_msg=str(key))


def _leaves_without_zero_gradient() -> set:
    """The example LM's param leaf indices but the attention key biases
    (see the module's docstring)."""
    import jax

    import examples.lm as lm

    abstract = jax.eval_shape(functools.partial(lm.init_params, lm.LMConfig()), jax.random.PRNGKey(0))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    return {i for i, n in enumerate(paths) if "['key']['bias']" not in n}


# -- a non-finite loss ---------------------------------------------------------------


DIVERGING = dict(learning_rate=1e4, grad_clip_norm=0.0)  # the loss of step 2 is NaN (step 1's is ~2e9)


def test_a_non_finite_loss_ends_the_run_keeping_the_state_before_it(cluster, tmp_path):
    """Without a post_update, the run ends with NonFiniteLoss naming the
    step, before that step is applied: the state of the step before is
    saved as a checkpoint and handed back, finite."""
    import jax

    import examples.lm as lm
    from ray_elastic import CheckpointConfig, NonFiniteLoss

    cluster.ensure_nodes(2)
    path = str(tmp_path / "ckpt")
    factory = functools.partial(lm.make_program, lm.LMConfig(**DIVERGING))
    trainer = ElasticTrainer(factory, _config(hosts=1, policy="pause"), 6, keep_final_state=True,
                             checkpoint=CheckpointConfig(path, save_every=0, save_at_end=False))
    with pytest.raises(NonFiniteLoss) as e:
        trainer.fit()
    assert e.value.step == 2 and e.value.setting == "program.post_update"
    assert "skip_nonfinite" in str(e.value)
    assert trainer.report.outcome == "failed" and trainer.report.steps_completed == 2
    assert trainer.final_state["step"] == 2
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(trainer.final_state["params"]))
    from ray_elastic.checkpoint.store import CheckpointStore

    assert CheckpointStore(path).latest_committed() == 2


def test_skip_nonfinite_keeps_training_past_non_finite_steps(cluster):
    """With post_update=skip_nonfinite (the token LM's), the same diverging
    steps are skipped: the run completes, its params stay finite."""
    import jax

    import examples.lm as lm
    import examples.lm_tokens as lt

    cluster.ensure_nodes(2)
    config = lt.TokenLMConfig(lm=lm.LMConfig(**DIVERGING), dropout_rate=0.0, eval_every=0)
    trainer = ElasticTrainer(functools.partial(lt.make_program, config), _config(hosts=1, policy="pause"), 6,
                             keep_final_state=True)
    report = trainer.fit()
    assert report.steps_completed == 6
    assert_no_failures(report)
    # Step 1's loss is ~1.6e15 and the gradient of the shards' summed losses is not finite:
    # that update is skipped, and so is every later one alike.
    assert report.losses[1] > 1e12 and report.losses[-1] > 1e12, report.losses
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(trainer.final_state["params"]))


# -- model state through checkpoints ---------------------------------------------------


@pytest.mark.parametrize("slices", [pytest.param(2, marks=pytest.mark.slow), 1])
def test_cnn_resumes_from_a_checkpoint_with_its_batch_stats(cluster, cnn_factory, cnn_run, tmp_path, slices):
    """A checkpoint holds the model state with the params: a cold start
    from the step-6 checkpoint of a first run (on 2 slices, or on 1:
    a restore onto another slice count) ends bitwise equal to the
    uninterrupted run, batch statistics included."""
    import jax

    from ray_elastic import CheckpointConfig

    cluster.ensure_nodes(2)
    base_trainer, base = cnn_run
    path = str(tmp_path / "ckpt")
    first = ElasticTrainer(cnn_factory, _config(hosts=1, policy="pause"), 6,
                           checkpoint=CheckpointConfig(path, save_every=0))
    first_report = first.fit()
    assert first_report.steps_completed == 6
    assert_no_failures(first_report)
    resumed = ElasticTrainer(cnn_factory, _config(hosts=1, policy="pause", num_slices=slices), CNN_STEPS,
                             keep_final_state=True, checkpoint=CheckpointConfig(path, save_every=0, save_at_end=False))
    report = resumed.fit()
    assert report.resumed_from == 6
    assert_no_failures(report)
    assert report.losses[6:] == base.losses[6:]
    a, b = resumed.final_state, base_trainer.final_state
    assert jax.tree.structure(a["opt_state"]) == jax.tree.structure(b["opt_state"])
    for x, y in zip(jax.tree.leaves((a["params"], a["opt_state"])), jax.tree.leaves((b["params"], b["opt_state"]))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
