"""What the DiLoCo end-to-end tests (plain and streaming) do with a run:
fit it, compare it with the reference loop (tests/diloco_reference.py)
within float32 rounding, or with another run bitwise.

The tolerances against the reference loop: the losses within 1e-5
relative, the params within 2e-4 absolute (magnitudes up to about 1).
Both sides compute the same float32 math, but as different XLA programs
(the worker's step is compiled over the slice's mesh, its shard
gradients summed on the devices; the loop's in one jit), so sums differ
in their last bits; Adam divides by the root of small second moments and
the outer Nesterov step (lr 0.3, momentum 0.9) carries each difference
on, so 12 steps bring them to about 1e-5 (24 to 1.5e-4). A run with
failures must equal the failure-free run bitwise: same program, same
order of every sum.
"""

from __future__ import annotations

import jax
import numpy as np

from ray_elastic import ElasticTrainer

LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-4


def fit(factory, config, steps: int, **kw):
    """(trainer, report, events) of a run that must complete."""
    events: list = []
    trainer = ElasticTrainer(factory, config, steps, keep_final_state=True, on_event=events.append, **kw)
    report = trainer.fit()
    assert report.steps_completed == steps
    return trainer, report, events


def close(trainer, report, reference) -> None:
    """The run's losses and final params against the reference loop's."""
    params, losses = reference
    np.testing.assert_allclose(report.losses, losses, rtol=LOSS_RTOL)
    for a, b in zip(jax.tree.leaves(trainer.final_params()), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL)


def bitwise_equal(a, b) -> bool:
    """Two trainers' final params, bit for bit."""
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.final_params()), jax.tree.leaves(b.final_params())))
