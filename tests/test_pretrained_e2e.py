"""Fine-tuning from pretrained weights on a real cluster: a run starts
from the params a saved run ended with, read from its ray_elastic
checkpoint folder, from a plain Orbax checkpoint of the params tree, or
handed over as a tree; the three start identically, and weights that do
not fit the model are refused with the setting named."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ray_elastic import CheckpointConfig, ConfigError, ElasticConfig, ElasticTrainer
from tests.run_checks import assert_no_failures

pytestmark = pytest.mark.cluster

STEPS = 6


def _config() -> ElasticConfig:
    return ElasticConfig(num_slices=2, policy="pause", timeout_s=120.0)


@pytest.fixture(scope="module")
def saved_run(cluster, tmp_path_factory):
    import examples.lm as lm

    cluster.ensure_nodes(2)
    path = str(tmp_path_factory.mktemp("pretrain") / "ckpt")
    trainer = ElasticTrainer(functools.partial(lm.make_program, lm.LMConfig()), _config(), STEPS,
                             keep_final_state=True, checkpoint=CheckpointConfig(path, save_every=0))
    report = trainer.fit()
    assert report.steps_completed == STEPS
    assert_no_failures(report)
    return path, trainer.final_state, report


def _plain_first_loss(params) -> float:
    import jax

    import examples.lm as lm

    program = lm.make_program(lm.LMConfig())
    batches = [program.make_batch(0, 0, s, 2) for s in range(2)]
    return float(np.mean([float(jax.jit(program.loss_fn)(params, b)) for b in batches]))


def _fine_tune(source):
    import examples.lm as lm

    factory = functools.partial(lm.make_program, lm.LMConfig(), lm.Layout(), source)
    trainer = ElasticTrainer(factory, _config(), STEPS, keep_final_state=True)
    report = trainer.fit()
    assert_no_failures(report)
    return trainer, report


def test_fine_tuning_starts_from_the_saved_params(cluster, saved_run, tmp_path):
    import jax
    import orbax.checkpoint as ocp

    path, saved, base = saved_run
    cluster.ensure_nodes(2)
    from_folder, report = _fine_tune(path)
    # The first step's loss is that of the saved params (far below a fresh start's).
    want = _plain_first_loss(saved["params"])
    np.testing.assert_allclose(report.losses[0], want, rtol=1e-5)
    assert report.losses[0] < base.losses[0] - 0.3
    # A plain Orbax checkpoint of the params tree, and the tree itself, start alike, bit for bit.
    plain = str(tmp_path / "params")
    ocp.StandardCheckpointer().save(plain, saved["params"])
    ocp.StandardCheckpointer().wait_until_finished() if hasattr(ocp.StandardCheckpointer, "wait_until_finished") else None
    for source in (plain, jax.tree.map(np.asarray, saved["params"])):
        other, r = _fine_tune(source)
        assert r.losses == report.losses
        for a, b in zip(jax.tree.leaves(other.final_state), jax.tree.leaves(from_folder.final_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weights_that_do_not_fit_are_refused(cluster, saved_run):
    import jax

    _, saved, _ = saved_run
    cluster.ensure_nodes(2)
    wrong = jax.tree.map(np.asarray, saved["params"])
    wrong["head"]["bias"] = np.zeros(3, np.float32)
    with pytest.raises(ConfigError, match="program.pretrained.*head.*bias"):
        _fine_tune(wrong)
