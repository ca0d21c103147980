"""The cross-slice exchange (reduce-scatter and all-gather, the default) on
a real local Ray cluster with real JAX workers: each host takes in about
2(n-1)/n of its gradient's bytes per step, counted in the workers; a
worker SIGKILLed while the step's chunks are being summed (phase
"reduce") is recovered under resize (0 steps redone: the survivors re-own
its chunks and compute only its shards) and under pause, and both runs
end bitwise equal to the failure-free one. At one shard per slice the
exchange gives the direct hand-off's bits."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import ray

from ray_elastic import Callback, CpuSlice, ElasticConfig, ElasticTrainer, Fault

pytestmark = pytest.mark.cluster

STEPS = 8
FAIL_AT = 3
# Above the ring bound a host may take in the chunks' uneven split (an
# element) and, when the owner of chunk 0 is another slice, the step's
# per-shard scalars: a few hundred bytes on gradients of megabytes.
SLACK = 1.05

# (slices, layout, batch shards). Every test takes its case through a
# module-scoped parameter, so pytest runs a case's tests one after
# another: the kill and direct runs then start in the slices the
# failure-free run kept (KEPT_MODULES), and each case's slices are started
# once. Three and four slices, one shard each or two, one of each layout:
# the chunks' split and owners are the slice count's, the same code in
# either layout. Two slices' bytes are the device sums' test's
# (tests/test_device_sums.py: one sum per slice per step), and nearly every
# other e2e test runs two slices through a failure, bitwise.
CASES = [
    (3, "replicated", 3),
    (4, "fsdp", 8),  # two shards per slice: one block (their sum) leaves each
]


def _id(case) -> str:
    return "-".join(map(str, case))


def _case_params():
    return [pytest.param(c, id=_id(c)) for c in CASES]


def _factory(layout: str):
    import examples.lm as lm

    if layout == "replicated":
        return functools.partial(lm.make_program, lm.LMConfig())
    return functools.partial(lm.make_program, lm.LMConfig(), lm.sharded_layout(layout))


def _config(slices: int, layout: str, shards: int, **kw) -> ElasticConfig:
    devices = 1 if layout == "replicated" else 2
    return ElasticConfig(num_slices=slices, slice=CpuSlice(devices_per_host=devices), batch_shards=shards,
                         timeout_s=180.0, **kw)


class _Exchange(Callback):
    """Every live worker's exchange counters, read at the last step."""

    def __init__(self):
        self.stats: dict = {}

    def on_start(self, trainer):
        self.trainer = trainer

    def on_step(self, step, metrics):
        if step != STEPS:
            return
        t = self.trainer
        for s in sorted(t.members.live):
            got = ray.get([w.exchange_stats.remote() for w in t.members.backend.workers(s)], timeout=60)
            self.stats.update({(s, h): st for h, st in enumerate(got)})


def _run(slices, layout, shards, faults=(), **kw):
    seen = _Exchange()
    trainer = ElasticTrainer(_factory(layout), _config(slices, layout, shards, **kw), STEPS, faults=faults,
                             keep_final_state=True, callbacks=[seen])
    report = trainer.fit()
    assert report.steps_completed == STEPS
    return trainer, report, seen.stats


def _leaves(state) -> list:
    import jax

    if isinstance(state, (list, tuple)):  # sharded: one part per host, its blocks
        return [part["blocks"][k] for part in state for k in sorted(part["blocks"], key=str)]
    return jax.tree.leaves((state["params"], state["opt_state"]))


def _assert_bitwise_equal(a, b) -> None:
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _gradient_bytes(layout: str, final_state) -> int:
    """The gradient one host sends: the params' bytes (replicated), or its
    own blocks of them (sharded), read from the state, not the counters."""
    import jax

    import examples.lm as lm

    if layout == "replicated":
        shapes = jax.eval_shape(lm.make_program(lm.LMConfig()).init_params, jax.random.PRNGKey(0))
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    return sum(b.nbytes for (tag, _, _), b in final_state[0]["blocks"].items() if tag == "p")


@pytest.fixture(scope="module")
def baselines(cluster):
    return {}


def _baseline(baselines, cluster, slices, layout, shards):
    key = (slices, layout, shards)
    if key not in baselines:
        cluster.ensure_nodes(slices)
        trainer, report, stats = _run(slices, layout, shards, policy="pause")
        assert not report.failures
        baselines[key] = (trainer.final_state, report, stats)
    return baselines[key]


@pytest.mark.parametrize("case", _case_params(), scope="module")
def test_bytes_per_host_are_at_the_ring_bound(baselines, cluster, case):
    slices, layout, shards = case
    state, report, stats = _baseline(baselines, cluster, slices, layout, shards)
    grad = _gradient_bytes(layout, state)
    ring = 2 * (slices - 1) / slices * grad
    assert len(stats) == slices
    for (s, h), st in sorted(stats.items()):
        per_step = st["bytes_from_other_slices"] / st["applies"]
        # Taken in: (n-1) chunks to sum, (n-1) sums back; never the whole
        # gradient of every other slice (the direct hand-off's (n-1) x).
        assert 0.95 * ring <= per_step <= SLACK * ring, (s, h, per_step, ring)
        # From 3 slices owners sum the chunks; at 2 the applies sum both gradients.
        assert (st["reduce_bytes_in"] > 0) == (slices > 2) and st["gather_bytes_in"] > 0
        # One piece per slice: what a host sends per step is one gradient.
        assert st["sent_bytes"] / st["applies"] == pytest.approx(grad, rel=0.01)
        # Each host's exchange windows (gradients ready to sums laid out,
        # worker/overlap.py) were timed, and none covers its own compute.
        assert st["exchange_window_s"] > 0 and st["compute_s"] > 0 and st["compute_in_exchange_s"] == 0
    assert report.losses[-1] < report.losses[0]


def _policy(case, first: bool) -> str:
    """Each case's kill runs under one policy: resize for replicated cases
    and pause for sharded ones. The other policy (-m slow) runs on the
    sharded case: resize finishes the step from the survivors' chunks,
    where pause redoes it as every other pause test does."""
    return ("resize" if case[1] == "replicated" else "pause") if first else (
        "pause" if case[1] == "replicated" else "resize")


@pytest.mark.parametrize("case", _case_params(), scope="module")
def test_a_worker_killed_mid_exchange_ends_bitwise_equal(baselines, cluster, case):
    _killed_mid_exchange(baselines, cluster, case, _policy(case, first=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(CASES[1], id=_id(CASES[1]))], scope="module")
def test_a_worker_killed_mid_exchange_under_the_other_policy(baselines, cluster, case):
    _killed_mid_exchange(baselines, cluster, case, _policy(case, first=False))


def _killed_mid_exchange(baselines, cluster, case, policy):
    slices, layout, shards = case
    state, _, _ = _baseline(baselines, cluster, slices, layout, shards)
    cluster.ensure_nodes(slices)
    fault = Fault("kill", slice_id=1, step=FAIL_AT, phase="reduce")
    trainer, report, _ = _run(slices, layout, shards, faults=(fault,), policy=policy)
    assert [(f.kind, f.slice, f.step) for f in report.failures] == [("process_died", 1, FAIL_AT)]
    if policy == "resize":
        # The survivors kept their gradients and computed only the lost
        # slice's shards: the step was finished, not redone.
        assert report.failures[0].steps_rewound == 0
    _assert_bitwise_equal(trainer.final_state, state)


@pytest.mark.parametrize("case", [pytest.param(CASES[0], id=_id(CASES[0]))], scope="module")
def test_one_shard_per_slice_gives_the_direct_hand_offs_bits(baselines, cluster, case):
    assert case == (3, "replicated", 3)
    state, _, _ = _baseline(baselines, cluster, *case)
    trainer, report, stats = _run(3, "replicated", 3, policy="pause", exchange="direct")
    assert not report.failures
    _assert_bitwise_equal(trainer.final_state, state)
    grad = _gradient_bytes("replicated", state)
    # The direct hand-off takes every other slice's whole gradient.
    assert all(st["bytes_from_other_slices"] / st["applies"] >= 2 * grad for st in stats.values())
