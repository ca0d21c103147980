"""A model that constrains its activations by logical names (the example
LM with `logical_activations`, MaxText's way) trains on a slice of 4
devices under the sharded layouts (the constraints act within a slice's
mesh, traced alike whichever hosts hold its devices; the slices only add
whole gradients; a two-host slice's mesh runs in tests/test_sharded_e2e.py),
computing what the same model
without the constraints computes: a constraint moves data, not math.
Tolerance: float32 rounding (the constraints change how XLA splits the
sums; 1e-5 relative asserted, where a wrong batch or a wrong row would
move the loss by far more). Which
shards each activation gets in the compiled step is read in
tests/test_maxtext_layout.py."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from ray_elastic import CpuSlice, ElasticConfig, ElasticTrainer

pytestmark = pytest.mark.cluster

STEPS = 6


def _run(cluster, sharding: str, constrained: bool):
    import examples.lm as lm

    cluster.ensure_nodes(1)
    config = dataclasses.replace(lm.LMConfig(), logical_activations=constrained)
    factory = functools.partial(lm.make_program, config, lm.sharded_layout(sharding))
    cfg = ElasticConfig(num_slices=1, policy="pause", seed=0, step_deadline_floor_s=20.0, timeout_s=120.0,
                        slice=CpuSlice(hosts=1, devices_per_host=4))
    report = ElasticTrainer(factory, cfg, STEPS).fit()
    assert report.steps_completed == STEPS and not report.failures
    return report.losses


# fsdp_tp holds fsdp's constraints and tensor parallelism's.
@pytest.mark.parametrize("sharding", ["fsdp_tp"])
def test_logical_activation_constraints_train_as_the_unconstrained_model(cluster, sharding):
    constrained = _run(cluster, sharding, True)
    free = _run(cluster, sharding, False)
    assert constrained == pytest.approx(free, rel=1e-5)
    assert constrained[-1] < constrained[0]
