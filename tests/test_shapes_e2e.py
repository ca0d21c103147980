"""The slice shapes users run, through saves, restores and failures, on a
real local cluster: one and two hosts per slice, one and two devices per
host, and every layout (replicated, fsdp, fsdp_tp), in four shapes that
between them hold each of those at least once (SHAPES; why not all eleven
combinations: below).

For each shape, one run under pause (2 slices, the example LM, small):
- a periodic checkpoint (step 3) and a final one (step STEPS), both
  committed and restorable (every byte and array checked);
- a worker SIGKILLed at step 4: its replacement loads the newest in-memory
  snapshot (snapshots every step) and finishes the step in flight;
- a drain notice (SIGTERM to a worker) at step 5: the last completed step
  is committed before the slice is taken out.
Then two cold starts from its checkpoints:
- onto the same topology under resize, from step 3 (written before the
  failures), with a node removed at step 4 in a phase of a step (its
  gradients, the reduction, the apply; REMOVED_IN): no step is redone,
  and the run ends bitwise equal to the pause run that had the kill and the drain;
- onto another topology (one slice of other hosts x devices, the same
  layout and global batch), from step 6: its losses follow the run's
  (rtol 1e-5: another device count sums the same numbers in another
  order), and its own final save commits.

The default run covers every scenario on the one-host sharded shape
(DEFAULT); the other shapes are `-m slow` (one and a half to three and a
half minutes per shape here).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ray_elastic import CheckpointConfig, CpuSlice, ElasticConfig, ElasticTrainer, Fault
from ray_elastic.checkpoint import CheckpointStore

pytestmark = pytest.mark.cluster

STEPS = 10
SAVE_EVERY = 3  # periodic saves at 3, 6 and 9, the final one at STEPS
KILL_AT = 4
SHARDS = 4  # two per slice
DRAIN_AT = 5  # a notice is seen a step or two after it is given: steps must follow it
# (hosts per slice, devices per host, layout). Four of the eleven
# combinations, chosen so that each host count, each device count and each
# layout is in one at least, and the shapes where failures take paths of
# their own are all here: several devices on one host (1x2, a v5e-8 or an
# 8-GPU box), several hosts of one device (2x1, whose hosts hold different
# blocks of a sharded state), and both at once with tensor parallelism
# (2x2). The seven others repeat a path one of these takes: one-device
# hosts (1x1) are most of the rest of the suite's runs, and two-host
# replicated slices are test_step_contract_e2e's, test_grain_e2e's and the
# DiLoCo tests'. Running all eleven took CI past its time limit.
SHAPES = [(1, 2, "replicated"), (1, 2, "fsdp_tp"), (2, 1, "fsdp"), (2, 2, "fsdp_tp")]
# The default run: a one-host sharded shape (the most common real one, 8
# GPUs or a v5e-8 per slice) with several devices and fsdp_tp, and a node
# removed in its reduction and in its apply. Two-host slices through the
# same failures, saves and restores, and cold starts onto other hosts:
# tests/test_sharded_e2e.py (2 x 2 fsdp) by default; every other case here
# under -m slow (half a minute to a minute and more each).
DEFAULT = {(1, 2, "fsdp_tp")}
OTHER_TOPOLOGY = {(1, 2): (2, 1), (2, 1): (1, 2), (2, 2): (1, 2)}
PHASES = ("grads", "reduce", "apply")
# A phase's path is what the survivor finishes: the lost slice's shards
# (grads), the tree's sums (reduce), its hosts' all-or-none apply (apply).
# The two-host sharded slices, whose survivors' loads met the dead peer's
# collectives in the reduction and the apply, go through every phase (2x1)
# and through the apply with tensor parallelism too (2x2); the one-host
# sharded shape and the replicated one through the apply. Replicated slices
# lose a slice in the gradients (Fault's default phase: most e2e tests')
# and the reduction (tests/test_exchange_e2e.py) elsewhere.
REMOVED_IN = {
    (1, 2, "replicated"): ("apply",), (1, 2, "fsdp_tp"): ("apply",), (2, 1, "fsdp"): PHASES,
    (2, 2, "fsdp_tp"): ("apply",),
}
REMOVALS = [(shape, phase) for shape in SHAPES for phase in REMOVED_IN[shape]]
# And a two-host sharded shape: after a cold start (no snapshot to reload),
# the other slice's node lost in the apply must not fail the survivor,
# whose hosts apply the step all or none (dispatch/applies.py).
DEFAULT_REMOVALS = {((1, 2, "fsdp_tp"), "apply"), ((2, 1, "fsdp"), "apply")}  # the others: -m slow


def item_order(item) -> int:
    """The order tests/conftest.py runs this module's tests in: a shape's
    one after another (its pause run, its replays, its removals, then its
    cold start onto another topology), so that each run starts in the
    slices the run before kept (KEPT_MODULES) instead of ending them for
    another shape's and starting its own."""
    params = item.callspec.params
    return SHAPES.index(params["shape"] if "shape" in params else params["case"][0])


def _params(cases, default):
    """Cases not in `default` are marked slow; ids read like 1x2-fsdp[-apply]."""
    def name(c):
        (h, d, layout), rest = (c[0], c[1:]) if isinstance(c[0], tuple) else (c, ())
        return "-".join((f"{h}x{d}", layout, *rest))

    return [pytest.param(c, id=name(c), marks=() if c in default else pytest.mark.slow) for c in cases]


def _factory(layout: str):
    import examples.lm as lm

    shape = lm.Layout() if layout == "replicated" else lm.sharded_layout(layout)
    return functools.partial(lm.make_program, lm.LMConfig(), shape)


def _config(hosts: int, devices: int, **kw) -> ElasticConfig:
    kw.setdefault("num_slices", 2)
    kw.setdefault("policy", "pause")
    return ElasticConfig(slice=CpuSlice(hosts=hosts, devices_per_host=devices), batch_shards=SHARDS,
                         step_deadline_floor_s=30.0, timeout_s=180.0, **kw)


def _assert_bitwise(a, b) -> None:
    """Two final states (a dict of whole arrays, or one part per host of
    blocks) equal bit for bit."""
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_bitwise(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_bitwise(a[key], b[key])
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _events(report, name):
    return [e for e in report.events if e["event"] == name]


@pytest.fixture(scope="module")
def runs():
    return {}


@pytest.fixture(autouse=True)
def reduction_tree(monkeypatch):
    """A reduction tree in every step (4 shards over fan-in 2), so that a
    fault in the reduction phase has a tree to hit; every run here sums in
    the same tree, so their results compare bitwise."""
    from ray_elastic.dispatch import step_runner
    monkeypatch.setattr(step_runner, "APPLY_FAN_IN", 2)


def _pause_run(shape, nodes, tmp_path_factory, runs):
    """The shape's run with a kill and a drain notice, and its checkpoints
    (cached: the cold starts and the removals compare with it)."""
    if shape in runs:
        return runs[shape]
    hosts, devices, layout = shape
    nodes(2 * hosts)
    path = str(tmp_path_factory.mktemp("shape") / "ck")
    faults = (Fault("kill", 1, KILL_AT, host=hosts - 1), Fault("term", 0, DRAIN_AT, host=0))
    config = _config(hosts, devices, snapshot_every=1, snapshot_every_replicated=1)  # snapshots every step
    trainer = ElasticTrainer(_factory(layout), config, STEPS, faults=faults,
                             checkpoint=CheckpointConfig(path, save_every=SAVE_EVERY, keep=10), keep_final_state=True)
    report = trainer.fit()
    runs[shape] = {"report": report, "state": trainer.final_state, "path": path}
    return runs[shape]


@pytest.mark.parametrize("shape", _params(SHAPES, DEFAULT))
def test_saves_restores_and_failures(shape, nodes, tmp_path_factory, runs):
    hosts, devices, layout = shape
    run = _pause_run(shape, nodes, tmp_path_factory, runs)
    report, path = run["report"], run["path"]
    assert report.steps_completed == STEPS
    # The kill: the replacement loaded the newest snapshot and finished the
    # step in flight (nothing redone). The drain: saved, then retired.
    kinds = [(f.kind, f.slice, f.steps_rewound) for f in report.failures]
    assert kinds == [("process_died", 1, 0), ("preempted", 0, 0)], kinds
    assert (report.failures[0].step, report.failures[0].host) == (KILL_AT, hosts - 1)
    assert len(report.losses) == STEPS  # every step's loss, the one the failure hit too
    grow = _events(report, "grow")[0]
    if report.failures[0].compute_redone == 0.5:
        # The replacement loaded the state of KILL_AT (its snapshot, or a
        # survivor's copy when that snapshot was still being sealed off the
        # step's path), then the step in flight was finished with the
        # survivor's gradient kept.
        assert grow["step"] == KILL_AT and grow["source"] in ("snapshot", "live"), grow
        assert _events(report, "step_completed_on_survivors")[0]["step"] == KILL_AT + 1
    else:  # the survivor had applied the step before the kill was seen
        assert report.failures[0].compute_redone == 0.0 and grow["step"] == KILL_AT + 1
    saved = _events(report, "preempt_saved")
    assert len(saved) == 1
    store = CheckpointStore(path)
    committed = store.committed_steps()
    assert {SAVE_EVERY, 2 * SAVE_EVERY, 3 * SAVE_EVERY, STEPS, saved[0]["step"]} <= set(committed), committed
    assert not _events(report, "checkpoint_failed")
    for step in committed:  # every byte and array against its checksums, on any topology
        assert store.verify(step) in ("files and arrays", "arrays")
    per_host = isinstance(run["state"], tuple)
    assert per_host == (layout != "replicated")
    # Saved from the other slice's copy while the run went on, but where
    # the hosts write their own shards (which may be the hosts going).
    assert saved[0]["run_waited"] is per_host
    if per_host:
        assert len(run["state"]) == hosts
        starts = _events(report, "checkpoint_started")
        assert starts and all(e.get("hosts") == hosts for e in starts), starts


CORRUPT_AT = 5


# Default: one host of two devices, sharded (the suite's time); a two-host
# slice's fingerprints, made within the apply, are compared every step in
# test_sharded_e2e's failure-free run, and 2x2-fsdp_tp here names host 1
# (-m slow; 2x1-fsdp would name the same host of the same two-host path).
@pytest.mark.parametrize("shape", _params([s for s in SHAPES if s != (2, 1, "fsdp")], {(1, 2, "fsdp_tp")}))
def test_two_slices_that_differ_are_told_apart_by_their_replays(shape, nodes, tmp_path_factory, runs):
    """A bit flipped once in the state of the last host of slice 1, two
    slices, no spare: each slice replays alone from the verified snapshot,
    every host its own part (a sharded slice's hosts hold different
    blocks), and the host that went wrong is named, evicted, and the run
    ends bitwise equal to the shape's pause run (the same math after any
    recovery, as the removals below check too). A replicated host of two
    devices needs no replay: the bit is flipped on one device's copy, so
    its devices disagree and name it at the check.

    No failure-free run of its own: its fingerprints are compared every
    step of this run, and a false alarm at any of them would add a
    failure to the one asserted."""
    hosts, devices, layout = shape
    ref = _pause_run(shape, nodes, tmp_path_factory, runs)
    nodes(2 * hosts)
    # Snapshots every step: one of the verified step is there to replay from.
    config = _config(hosts, devices, policy="resize", min_slices=1, state_check_every=1, snapshot_every=1,
                     snapshot_every_replicated=1)
    faults = (Fault("corrupt", 1, CORRUPT_AT, host=hosts - 1, target="state"),)
    trainer = ElasticTrainer(_factory(layout), config, STEPS, faults=faults, keep_final_state=True)
    report = trainer.fit()
    ties = _events(report, "tie_break")
    [diverged] = _events(report, "diverged")
    assert diverged["named"] == [[1, hosts - 1]], diverged
    if layout == "replicated" and devices > 1:
        assert not ties and "devices hold different bits" in diverged["detail"], (ties, diverged)
    else:
        assert len(ties) == 1, report.events
        [tie] = ties
        assert tie["by"] == "replay" and tie["named"] == [[1, hosts - 1]], [e for e in report.events if e["event"] in ("tie_break", "diverged", "detected", "restore", "replace")]
    assert [(f.kind, f.slice) for f in report.failures] == [("corrupted", 1)]
    assert report.steps_completed == STEPS
    _assert_bitwise(trainer.final_state, ref["state"])


def _only_step(path: str, step: int, tmp_path_factory) -> str:
    """A copy of the checkpoint folder holding only `step` (a cold start
    resumes from the newest committed step)."""
    import shutil

    out = str(tmp_path_factory.mktemp("one") / "ck")

    def other_steps(folder, names):
        return [n for n in names if folder == path and n.split(".")[0].isdigit() and int(n.split(".")[0]) != step]

    shutil.copytree(path, out, ignore=other_steps)
    return out


@pytest.mark.parametrize("case", _params(REMOVALS, DEFAULT_REMOVALS))
def test_cold_start_then_a_node_removed_at_each_phase_redoes_nothing(case, cluster, nodes, tmp_path_factory, runs,
                                                                     monkeypatch):
    """A cold start onto the same topology, under resize, from step 3
    (written before the pause run's failures); then a node of slice 1
    removed while step 4's gradients, reduction or apply are in flight.
    The survivor finishes the step (the lost slice's shard computed again
    unless a survivor had applied it already): no step is redone, and the
    run ends bitwise equal to the pause run, which had its own failures
    (the same math on any number of slices, and after any recovery)."""
    shape, phase = case
    hosts, devices, layout = shape
    run = _pause_run(shape, nodes, tmp_path_factory, runs)
    nodes(2 * hosts)
    # Phase by phase, so the removal lands in the phase it names (pipelined,
    # the tree and the applies are issued ahead and race the fault).
    monkeypatch.setenv("RAY_ELASTIC_PIPELINE", "0")
    fault = Fault("remove_node", 1, KILL_AT, host=hosts - 1, phase=phase)
    trainer = ElasticTrainer(_factory(layout), _config(hosts, devices, policy="resize", min_slices=1), STEPS,
                             faults=(fault,), remove_node=cluster.remove_node, keep_final_state=True,
                             checkpoint=CheckpointConfig(_only_step(run["path"], SAVE_EVERY, tmp_path_factory),
                                                         save_every=0, save_at_end=False))
    report = trainer.fit()
    assert report.steps_completed == STEPS
    assert _events(report, "restore")[0]["step"] == SAVE_EVERY
    fired = _events(report, "fault")
    assert [(e["step"], e["phase"]) for e in fired] == [(KILL_AT, phase)]
    (f,) = report.failures
    assert (f.slice, f.step) == (1, KILL_AT) and f.kind in ("node_died", "process_died")
    assert f.steps_rewound == 0, report.events
    assert f.compute_redone in (0.0, 0.5)  # 0: a survivor had applied the step already
    assert len(report.losses) == STEPS
    _assert_bitwise(trainer.final_state, run["state"])
    np.testing.assert_array_equal(report.losses[SAVE_EVERY:], run["report"].losses[SAVE_EVERY:])


# test_sharded_e2e cold-starts a two-host fsdp state onto other hosts by
# default; here the one sharded shape with tensor parallelism on one host
# goes onto two hosts (its tp axis split across processes). A replicated
# state is whole on every device, so onto any topology it loads as the
# sharded ones' restore onto the same one does.
@pytest.mark.parametrize("shape", _params([(1, 2, "fsdp_tp")], set()))
def test_cold_start_onto_another_topology(shape, nodes, tmp_path_factory, runs):
    """From step 6 onto one slice of other hosts x devices (it computes
    every shard of the global batch): the losses follow the run's."""
    hosts, devices, layout = shape
    run = _pause_run(shape, nodes, tmp_path_factory, runs)
    h2, d2 = OTHER_TOPOLOGY[(hosts, devices)]
    start = 2 * SAVE_EVERY
    nodes(h2)
    resumed = ElasticTrainer(_factory(layout), _config(h2, d2, num_slices=1), STEPS + 2,
                             checkpoint=CheckpointConfig(_only_step(run["path"], start, tmp_path_factory),
                                                         save_every=0, save_at_end=True))
    report = resumed.fit()
    assert _events(report, "restore")[0]["step"] == start and not report.failures
    np.testing.assert_allclose(report.losses[start:STEPS], run["report"].losses[start:STEPS], rtol=1e-5)
    # Its own final save, from the new topology, commits too.
    assert CheckpointStore(resumed._ckpt.config.path).latest_committed() == STEPS + 2
