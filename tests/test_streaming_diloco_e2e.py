"""Streaming DiLoCo on a real local cluster: the params in 2 fragments,
one synchronized every 2 steps in turn (diloco_sync_period 4), each new
global fragment mixed into the replicas one step later with alpha 0.5,
so every part of the schedule runs: runs that equal the plain loop of
tests/diloco_reference.py, a replica killed mid-round under resize (the
replacement joins at a fragment's synchronization with its donor's
whole inner state) and under pause with a hot spare (mid-round and
mid-synchronization), a cold start from a checkpoint written mid-round
(both bitwise the failure-free run), and a run over a slow simulated
link whose synchronizations overlap the next inner steps in time.

Tolerances against the reference loop: tests/diloco_checks.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ray_elastic import CheckpointConfig, CpuSlice, ElasticConfig, Fault
from tests.diloco_checks import LOSS_RTOL, PARAM_ATOL, bitwise_equal as _equal, close as _close, fit
from tests.diloco_reference import diloco_reference

pytestmark = pytest.mark.cluster

H, FRAGMENTS, OVERLAP, ALPHA = 4, 2, 1, 0.5
EVERY = H // FRAGMENTS
STEPS = 12


def _config(**kw) -> ElasticConfig:
    return ElasticConfig(enable_diloco=True, diloco_sync_period=H, enable_streaming_diloco=True,
                         num_diloco_fragments=FRAGMENTS, num_communication_overlapping_steps=OVERLAP,
                         communication_overlapping_alpha=ALPHA, straggler_factor=0, **kw)


def _fit(factory, config, steps=STEPS, **kw):
    return fit(factory, config, steps, **kw)


def _reference(factory, steps=STEPS, **kw):
    return diloco_reference(factory(), seed=0, shards=kw.pop("shards", 2), replicas=kw.pop("replicas", 2), steps=steps,
                            period=H, fragments=FRAGMENTS, overlap=OVERLAP, alpha=ALPHA, **kw)


@pytest.fixture(scope="module")
def free(cluster, lm_factory):
    """The failure-free Streaming DiLoCo run of 2 replicas (one one-host slice each)."""
    cluster.ensure_nodes(2)
    return _fit(lm_factory, _config(num_slices=2))


def test_two_replicas_equal_the_reference_loop(free, lm_factory):
    """Fragments 1, 0, 1, ... synchronize at steps 2, 4, 6, ..., each
    moving its own leaves' bytes only; the last step takes them all; the
    run equals the plain loop."""
    trainer, report, events = free
    syncs = [e for e in events if e["event"] == "diloco_sync"]
    assert [(e["step"], e.get("fragment")) for e in syncs] == [(2, 1), (4, 0), (6, 1), (8, 0), (10, 1), (12, None)]
    whole = syncs[-1]["bytes_across_slices"]
    parts = syncs[0]["bytes_across_slices"] + syncs[1]["bytes_across_slices"]
    assert abs(parts - whole) <= 0.02 * whole and max(e["bytes_across_slices"] for e in syncs[:-1]) < 0.6 * whole
    _close(trainer, report, _reference(lm_factory))


def test_resize_kill_mid_round(nodes, lm_factory):
    """Replica 1 is killed in inner step 5: replica 0's fragments
    synchronize alone until the replacement joins at a fragment's
    synchronization with replica 0's whole inner state; the run equals
    the reference loop given that membership."""
    nodes(2)
    # Slow steps: the replacement is up mid-run, on a loaded machine too.
    faults = [Fault("kill", 1, 5), Fault("slow", 0, 0, ms=300)]
    trainer, report, events = _fit(lm_factory, _config(num_slices=2, policy="resize"), steps=20, faults=faults)
    join = next(e["step"] for e in events if e["event"] == "grow")
    assert join % EVERY == 0 and 6 <= join < 20, join
    syncs = {e["step"]: e["replicas"] for e in events if e["event"] == "diloco_sync"}
    assert syncs[4] == [0, 1] and syncs[6] == [0] and syncs[20] == [0, 1], syncs
    reference = _reference(lm_factory, steps=20, active=lambda k, r: r == 0 or k < 5 or k >= join,
                           joins_from=lambda b, r: 0 if (b, r) == (join, 1) else None)
    _close(trainer, report, reference)


def test_resize_kill_mid_synchronization(nodes, lm_factory):
    """Replica 1 is killed as fragment 1's synchronization at step 6 goes
    out, overlapped with inner step 6, which replica 0 takes meanwhile.
    Unless replica 0's outer step already had both deltas in (then it
    stands), the synchronization runs again among the survivors, replica
    0 sending its delta of step 6, kept. The replacement joins at a later
    fragment's synchronization; the run equals the reference loop given
    that membership."""
    nodes(2)
    # Slice 0 slowed so that the replacement (4 to 6 s to ready on a loaded 2-core
    # machine) is up well before the run ends: at 300 ms it joined at step 18 or not at all.
    faults = [Fault("kill", 1, 6, phase="sync"), Fault("slow", 0, 0, ms=700)]
    trainer, report, events = _fit(lm_factory, _config(num_slices=2, policy="resize"), steps=20, faults=faults)
    assert [e["phase"] for e in events if e["event"] == "fault" and e["kind"] == "kill"] == ["sync"]
    join = next(e["step"] for e in events if e["event"] == "grow")
    assert join % EVERY == 0 and 8 <= join < 20, join
    syncs = {e["step"]: e["replicas"] for e in events if e["event"] == "diloco_sync"}
    assert syncs[4] == [0, 1] and syncs[6] in ([0], [0, 1], "adopted") and syncs[join] == [0], syncs
    with_1 = syncs[6] != [0]  # replica 1's delta of step 6 made it in before it died
    active = lambda k, r: r == 0 or k < 6 or k >= join  # noqa: E731
    reference = _reference(lm_factory, steps=20, active=active,
                           averaged=lambda b, r: active(b - 1, r) and (b, r, with_1) != (6, 1, False),
                           joins_from=lambda b, r: 0 if (b, r) == (join, 1) else None)
    _close(trainer, report, reference)


def test_cold_start_from_a_checkpoint_written_mid_round(nodes, free, lm_factory, tmp_path):
    """A run stops with a checkpoint of step 5 (the round started at 4,
    fragment 0's new global params not yet mixed in); a new run on the
    same path resumes it bitwise, losses included."""
    nodes(2)
    path = str(tmp_path / "ckpt")
    _fit(lm_factory, _config(num_slices=2), steps=5, checkpoint=CheckpointConfig(path, save_every=5, save_at_end=False))
    trainer, report, events = _fit(lm_factory, _config(num_slices=2), checkpoint=CheckpointConfig(path, save_every=100))
    restore = next(e for e in events if e["event"] == "restore")
    assert restore["step"] == 5 and restore["source"] == "checkpoint"
    assert _equal(trainer, free[0])
    assert report.losses[5:] == free[1].losses[5:]


def test_pause_with_a_spare_recomputes_the_round(nodes, free, lm_factory):
    """Replica 1 is killed in inner step 5: the spare loads its state of
    the round's start (step 4, fragment 0's synchronization), takes in
    fragment 0 one step later as the replica did, recomputes steps 4 and
    5, and the run ends bitwise equal to the failure-free one, losses
    included."""
    nodes(3)
    trainer, report, events = _fit(lm_factory, _config(num_slices=2, spare_slices=1), faults=[Fault("kill", 1, 5)])
    caught = [e for e in events if e["event"] == "diloco_caught_up"]
    # The survivor goes on meanwhile: the spare recomputes from the round's
    # start (step 4) to the step it joins at, 6 or later.
    joined = next(e["step"] for e in events if e["event"] == "grow")
    assert caught and caught[0]["replica"] == 1 and caught[0]["steps"] == joined - 4 >= 2, (caught, joined)
    assert _equal(trainer, free[0])
    assert report.losses == free[1].losses  # the step replica 1 was lost in: with the spare's loss


def test_pause_kill_mid_synchronization(nodes, free, lm_factory):
    """Replica 1 is killed while fragment 1's synchronization at step 6
    moves, overlapped with inner step 6 (V=1), which the survivor takes
    meanwhile: the survivor's outer step of that fragment, applied or
    not, is taken back; the spare recomputes replica 1's round (steps 4
    and 5, fragment 0 taken in before step 5), the fragment synchronizes
    again with both replicas (the survivor sends its delta of step 6,
    kept), and the spare takes step 6 too: bitwise the failure-free run."""
    nodes(3)
    trainer, report, events = _fit(lm_factory, _config(num_slices=2, spare_slices=1),
                                   faults=[Fault("kill", 1, 6, phase="sync")])
    assert [e["phase"] for e in events if e["event"] == "fault"] == ["sync"]
    caught = [e for e in events if e["event"] == "diloco_caught_up"]
    assert caught and caught[0]["replica"] == 1 and caught[0]["steps"] == 3, caught
    assert {e["step"]: e["replicas"] for e in events if e["event"] == "diloco_sync"}[6] == [0, 1]
    assert _equal(trainer, free[0])
    # Step 7 was in flight when replica 1 died: it is reported once the
    # spare has recomputed it, with both replicas' loss (docs/diloco.md, Metrics).
    assert report.losses == free[1].losses


def test_pause_kill_in_an_overlapped_step_with_a_save_due(nodes, free, lm_factory, tmp_path):
    """Replica 1 is killed in inner step 6, which runs beside fragment 1's
    synchronization at step 6, and a checkpoint is due at step 7: it is
    not written (that synchronization must end with every replica first,
    and replica 1's replacement has not joined), the spare recomputes the
    round, the synchronization runs again with both: bitwise the
    failure-free run."""
    nodes(3)
    trainer, report, events = _fit(lm_factory, _config(num_slices=2, spare_slices=1), faults=[Fault("kill", 1, 6)],
                                   checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), save_every=7, save_at_end=False))
    failed = [e for e in events if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [7] and "replacement has joined" in failed[0]["reason"], failed
    assert {e["step"]: e["replicas"] for e in events if e["event"] == "diloco_sync"}[6] == [0, 1]
    assert _equal(trainer, free[0])


def test_three_replicas_with_chunk_owners_through_a_kill_mid_synchronization(nodes, lm_factory):
    """3 replicas, so the exchange has an owner per chunk (reduce calls
    between the deltas and the applies, all issued at the boundary).
    Replica 2 is killed as fragment 1's synchronization at step 6 goes
    out (pause, a spare): the reduces and applies still waiting are given
    up, the synchronization runs again with the spare, and the run equals
    the plain loop of 3 replicas that lost nothing (the 2-replica test
    above checks the bitwise equality with the failure-free run)."""
    nodes(4)
    trainer, report, events = _fit(lm_factory, _config(num_slices=3, batch_shards=6, spare_slices=1), steps=8,
                                   faults=[Fault("kill", 2, 6, phase="sync")])
    assert [e["phase"] for e in events if e["event"] == "fault"] == ["sync"]
    assert {e["step"]: e["replicas"] for e in events if e["event"] == "diloco_sync"}[6] == [0, 1, 2]
    assert [e["replica"] for e in events if e["event"] == "diloco_caught_up"] == [2]
    params, losses = _reference(lm_factory, steps=8, shards=6, replicas=3)
    # Step 7 was in flight at the kill: reported with the spare's recomputed loss.
    np.testing.assert_allclose(report.losses, losses, rtol=LOSS_RTOL)
    for a, b in zip(jax.tree.leaves(trainer.final_params()), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, atol=PARAM_ATOL)


def test_fsdp_slices_of_two_hosts(nodes):
    """Each replica an fsdp-sharded slice of 2 hosts: a fragment's blocks
    cross slices host by host, and the run equals the plain loop."""
    import functools

    import examples.lm as lm

    nodes(4)
    factory = functools.partial(lm.make_program, lm.LMConfig(), lm.sharded_layout("fsdp"))
    trainer, report, _ = _fit(factory, _config(num_slices=2, slice=CpuSlice(hosts=2, devices_per_host=1)), steps=8)
    _close(trainer, report, _reference(factory, steps=8))


def test_the_exchange_overlaps_the_next_inner_steps(nodes, monkeypatch, lm_factory):
    """Over a slow simulated link (a fragment's delta takes about 0.46 s to
    come in, the whole params' 1.8 s), each fragment's synchronization is
    issued at its boundary and gathered V steps later: the replicas take
    inner step V meanwhile (`overlapped_steps`, read when each host's outer
    step is done), and the run still equals the plain loop. New workers:
    the link is read where a worker starts. Last in the module, as it
    releases the slices the other tests kept."""
    from ray_elastic import release_workers
    from ray_elastic.worker.exchange_stats import LINK_ENV

    release_workers()
    nodes(2)
    monkeypatch.setenv(LINK_ENV, "0.004")
    trainer, report, events = _fit(lm_factory, _config(num_slices=2, keep_workers=False), steps=6)
    syncs = {e["step"]: e for e in events if e["event"] == "diloco_sync"}
    assert sorted(syncs) == [2, 4, 6]
    assert [syncs[s].get("overlapped_steps") for s in (2, 4)] == [OVERLAP, OVERLAP], syncs
    assert "overlapped_steps" not in syncs[6]  # the run's last: every fragment, nothing after it
    _close(trainer, report, _reference(lm_factory, steps=6))
