"""The snapshot interval on a real cluster: under the default
(`snapshot_every_replicated="auto"`) snapshots are measured and spaced by
the Young–Daly interval the report states, and a loss of every slice at
once redoes no more steps than the report said it would, ending bitwise
equal to a failure-free run. Snapshots are copied off the step's path.
`all_slices_mtbf_s` is set short so the interval fits a short run."""

from __future__ import annotations

import pytest

from ray_elastic import ElasticConfig, ElasticTrainer, Fault
from ray_elastic.control.snapshot_schedule import PROBE_STEP
from tests.run_checks import assert_no_failures, assert_same_state

pytestmark = pytest.mark.cluster

STEPS = 40
FAIL_AT = 32
MTBF_S = 20.0  # interval sqrt(2 C M): a few steps of the small LM here


def _run(factory, config, faults=()):
    trainer = ElasticTrainer(factory, config, STEPS, faults=faults, keep_final_state=True)
    return trainer, trainer.fit()


def test_every_slice_lost_redoes_at_most_the_stated_steps(nodes, lm_factory):
    nodes(2)
    config = ElasticConfig(num_slices=2, policy="pause", all_slices_mtbf_s=MTBF_S)
    assert config.snapshot_every_replicated == "auto"
    ref, ref_report = _run(lm_factory, config)
    assert_no_failures(ref_report)
    snaps = ref_report.snapshots
    assert snaps, "no snapshot measured"
    assert snaps[0]["step"] == PROBE_STEP
    for s in snaps:
        assert s["bytes_per_host"] > 0 and s["seal_s"] >= 0 and s["interval"] >= 1
        assert s["max_redo_steps"] == s["interval"] + s["steps_overlapped"]
    # Each snapshot after the probe comes the interval chosen after the one before it.
    for before, after in zip(snaps, snaps[1:]):
        assert after["step"] - before["step"] == before["interval"]
    assert ref_report.snapshot_interval == snaps[-1]["interval"]

    trainer, report = _run(lm_factory, config, faults=(Fault("kill", 0, FAIL_AT), Fault("kill", 1, FAIL_AT)))
    assert report.steps_completed == STEPS
    # The bound in force when the loss struck: the newest snapshot measured
    # before it (snapshots measured after the rewind may have smaller steps).
    first_loss = next(i for i, e in enumerate(report.events) if e["event"] == "detected")
    stated = [e for e in report.events[:first_loss] if e["event"] == "snapshot"][-1]["max_redo_steps"]
    assert [f.restored_from for f in report.failures][-1] == "snapshot"
    redone = max(f.steps_rewound for f in report.failures)
    assert 1 <= redone <= stated, (redone, stated)
    assert_same_state(trainer.final_state, ref.final_state, STEPS)
