"""Smoke test of the benchmark runner (bench/compare.py, bench/scale.py)
with tiny settings on the session's local cluster: the outputs have the
promised shape. The full benchmark (`python -m bench compare`) is not
part of the test suite.

Not here, to keep CI within its time: `bench hoststart`, `bench sizes
--quick` and `bench exchange` (three to four minutes each). What they
exercise of ray_elastic runs in the suite (tests/test_host_cache.py and
test_host_writes.py; test_exchange_e2e.py counts the exchange's bytes in
the workers); their own code is checked by running them, a few minutes
each: `python -m bench hoststart --runs 1`, `python -m bench sizes
--quick`, `python -m bench exchange --sizes 2 --steps 6`."""

from __future__ import annotations

import json
import os

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.cluster


def _png(path: str) -> None:
    assert os.path.exists(path), path
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path
    assert os.path.getsize(path) > 2000


@pytest.mark.slow
def test_compare_tiny(cluster, nodes, lm_factory, tmp_path):
    pytest.importorskip("matplotlib")
    from bench import compare

    nodes(2)
    result = compare.run(
        cluster, runs=1, systems=["ray_elastic-resize"], scenarios=["kill"], steps=24, fail_at=8,
        overhead_pairs=0, factory=lm_factory, log=lambda *a: None,
    )
    files = compare.write(result, str(tmp_path))

    with open(files["json"]) as f:
        data = json.load(f)
    for key in ("mode", "settings", "cells", "runs", "chaos", "overheads", "goals", "wall_s", "files"):
        assert key in data, key
    (run,) = data["runs"]
    assert run["system"] == "ray_elastic-resize" and run["scenario"] == "kill"
    assert run["error"] is None
    assert run["steps_completed"] == 24
    assert 0 < run["detected_s"] <= run["recovered_s"] < 30
    assert run["steps_rewound"] == 0  # resize completes the step in flight on the survivor
    assert 0 < run["goodput"] <= 1
    assert run["timeline"] and run["timeline"][-1][1] == 24
    assert [m["event"] for m in run["markers"]][:2] == ["fault", "detected"]
    # Recovery as users feel it: the rate back, and the time lost.
    for key in ("rate_recovered_s", "lost_s", "lost_end_s", "rate"):
        assert key in run, key
    assert run["rate"]["pre_rate"] > 0 and run["lost_end_s"] is not None
    if run["rate_recovered_s"] is not None:  # None when a loaded machine never gets back to 90%
        assert run["rate_recovered_s"] >= run["recovered_s"] - 0.05
        assert run["lost_s"] is not None
    (cell,) = [c for c in data["cells"] if c["status"] == "ok"]
    assert cell["recovered_s"]["n"] == 1 and cell["recovered_s"]["median"] > 0
    for key in ("rate_recovered_s", "lost_s", "lost_end_s"):
        assert key in cell, key
    assert data["goals"]["steps_redone"] == {"max": 0, "n": 1, "met": True}

    with open(files["md"]) as f:
        md = f.read()
    rows = [line for line in md.splitlines() if line.startswith("| ray_elastic-resize | kill |")]
    assert len(rows) == 1 and "n/a" not in rows[0]
    assert "| system | scenario | runs | detection (s) |" in md
    assert "| fault → rate back (s) | time lost (s) | time lost by the end (s) |" in md
    assert "### Goals" in md
    for name in data["files"]["png"]:
        _png(os.path.join(tmp_path, name))
    assert "timeline-ray_elastic-resize-kill.png" in data["files"]["png"]
    assert "recovery.png" in data["files"]["png"]


@pytest.mark.slow
def test_scale_tiny(cluster, tmp_path):
    pytest.importorskip("matplotlib")
    from bench import scale

    result = scale.run(sizes=[4, 16], steps=14, failures=2, log=lambda *a: None)
    assert [r["slices"] for r in result["rows"]] == [4, 16]
    for r in result["rows"]:
        assert r["step_wall_s"] > 0 and r["step_cpu_s"] > 0 and r["step_wall_ctl_s"] > 0
        assert r["failures"] == 2 and r["failure_s"]["n"] == 2
        assert r["recovered_s"]["median"] > 0
        assert r["replacements"] == 2  # each failure queued one replacement slice
        assert all(v > 0 for k, v in r["apply_submit"].items() if k.startswith("per_step"))
    assert result["slopes"]["step_cpu_ctl_s"]["all"] is not None
    text = scale.table(result)
    assert text.count("\n| 4 |") == 2 and text.count("\n| 16 |") == 2  # controller and Ray tables
    _png(scale.chart(result, str(tmp_path / "scale.png")))


@pytest.mark.slow
def test_scale_pipelined_tiny(cluster):
    """Fake slices with a set step time: pipelined dispatch issues steps
    ahead, a failure while it does loses no step (resize), and the bench
    compares it with pipelining off."""
    from bench import scale

    r = scale.measure(8, steps=12, failures=2, step_s=0.2, pipeline=True)
    assert r["pipelined"] and r["steps_issued_ahead"] > 0
    assert r["failures"] == 2 and r["steps_rewound"]["max"] == 0
    result = scale.pipelined(sizes=[16], step_s=0.2, steps=8, log=lambda *a: None, slices_per_leader=8)
    off, on, grouped = result["rows"]
    assert not off["pipelined"] and off["steps_issued_ahead"] == 0
    assert on["pipelined"] and on["steps_issued_ahead"] >= 6
    assert on["step_wall_s"] > 0.15  # the clock is honoured: no step beats its compute by much
    assert on["clock_cpu_per_step_s"] > 0  # the simulated workers' side, read from the clock actors
    # Through group leaders: 2 of them, every step issued ahead, their CPU read apart.
    assert grouped["leaders"] == 2 and grouped["steps_issued_ahead"] >= 6
    assert grouped["step_wall_s"] > 0.15 and grouped["leader_cpu_per_step_s"] > 0
    # The fakes measured against real actors making the same calls.
    (cal,) = result["calibration"]
    assert cal["slices"] == 16 and cal["real_cpu_s"] > 0 and cal["fake_cpu_s"] > 0
    table = scale.pipelined_table(result)
    assert "| 16 | yes | – |" in table and "| 16 | yes | 2 |" in table and "real actors" in table


@pytest.mark.slow
def test_call_floor_tiny(cluster):
    """`python -m bench scale --floor`: every call pattern runs its steps
    at the compute's pace (no step beats it: the simulated slices compute
    one step at a time), and one bare call per slice costs the driver less
    per step than today's two calls per slice and the reduction tree; with
    the calls made by group leaders, the driver's share is smaller still,
    and the leaders' own CPU is measured."""
    from bench import call_floor

    result = call_floor.run(sizes=[64], rounds=1, steps=6, step_s=0.2, log=lambda *a: None)
    cells = {c["pattern"]: c for c in result["cells"]}
    assert set(cells) == set(call_floor.PATTERNS)
    for c in cells.values():
        assert c["step_wall_mean_s"] > 0.19, c
        assert c["driver_cpu_per_step_s"] > 0 and c["sim_cpu_per_step_s"] > 0, c
    assert cells["bare"]["driver_cpu_per_step_s"] < cells["today"]["driver_cpu_per_step_s"]
    assert cells["grouped"]["driver_cpu_per_step_s"] < cells["today"]["driver_cpu_per_step_s"]
    assert cells["grouped"]["leaders"] == 2 and cells["grouped"]["leaders_cpu_per_step_s"] > 0
    assert cells["today"]["leaders"] == 0
    assert "| 64 | folded | 1 + tree |" in call_floor.table(result)


def test_fake_slices_failure_is_actor_died(cluster):
    """The fake's failure is a real ActorDiedError from ray.get."""
    import ray
    from ray import exceptions as rex

    from bench.fake_slices import dead_ref

    with pytest.raises(rex.ActorDiedError):
        ray.get(dead_ref(), timeout=30)


@pytest.mark.slow
def test_ready_tiny(cluster, nodes, lm_factory):
    """`python -m bench ready`: every phase of a replacement's way to ready
    is measured, and they add up to about the whole; by default the
    replacement starts in the warm process its predecessor asked for."""
    from bench import ready

    nodes(1)
    result = ready.run(runs=1, variants=("default",), factory=lm_factory, log=lambda *a: None)
    med = result["variants"]["default"]["median"]
    first = ("process_start", "actor_load", "args_load", "warm_process")  # by the process it starts in
    for key in [k for k in ready.PHASES if k not in first] + ["ready", "ready_and_state", "first_step"]:
        assert key in med, key
    assert med["compile"] > 0 and med["first_state"] > 0 and med["ready"] > 0 and med["first_step"] > 0
    parts = sum(med[k] for k in ready.PHASES if k != "first_state" and k in med)
    assert parts <= med["ready"] + 0.5
    assert all(med[k] >= 0 for k in ready.PHASES if k in med), med
    assert "placement → ready" in ready.table(result)
    # The warm pool: an idle process beside the worker, which the
    # replacement started in (its process older than its creation).
    assert med["warm_processes"] >= 1 and med["warm_rss_mb"] > 0 and "warm_process" in med
    # Ray's own floor: a bare actor, and one with the worker's imports.
    floor = result["ray_floor"]
    assert 0 < floor["empty"] < floor["imports"]
    assert "Ray's floor here" in ready.table(result)


@pytest.mark.slow
def test_contract_tiny(cluster, tmp_path):
    """`python -m bench contract`: one today/new-contract pair and one
    round of each microbatch variant; every figure is there and positive,
    the two contracts train the same thing, and under the default exchange
    (reduce_scatter: each slice sums its own shards before anything
    crosses) a host takes in one gradient per slice per apply, 2 in all,
    with 8 shards as with 2 shards of microbatches."""
    from bench import contract

    result = contract.run(cluster, runs=1, steps=12, log=lambda *a: None)
    # Its runs are failure-free: one that recorded a failure raised and was
    # run again (bench/contract.py), which must not hide it.
    assert not [r for r in result["retries"] if "FailureRecord(" in r["error"]], result["retries"]
    files = contract.write(result, str(tmp_path))
    with open(files["json"]) as f:
        data = json.load(f)
    for key in ("settings", "contract", "micro", "micro_losses", "runs", "wall_s", "retries"):
        assert key in data, key
    c = data["contract"]
    (pair,) = c["pairs"]
    assert pair["today_s"] > 0 and pair["context_s"] > 0 and pair["ratio"] > 0
    assert c["today_s"]["median"] > 0 and c["context_s"]["median"] > 0 and c["median_ratio"] > 0
    assert isinstance(c["met"], bool)
    assert c["loss_max_rel_diff"] < 1e-4  # the same model, data and optimizer
    assert 0 <= c["final_accuracy"] <= 1
    assert set(data["micro"]) == set(contract.MICRO)
    for name, m in data["micro"].items():
        assert m["step_time_s"]["median"] > 0, name
        assert m["bytes_in_per_apply"] > 0 and m["peak_private_max"] > 0 and m["peak_shared_max"] >= 0, name
        assert len(m["workers"]) == contract.SLICES and all(w["peak_RssAnon"] > 0 for w in m["workers"]), name
        assert all(e["applies"] > 0 for e in m["exchange"]), name
        assert all(x > 0 for x in m["final_loss"]), name
    eight, micro = (data["micro"][name] for name in contract.MICRO)
    assert data["settings"]["exchange"] == "reduce_scatter"
    assert eight["gradients_per_apply"] == pytest.approx(contract.SLICES)
    assert micro["gradients_per_apply"] == pytest.approx(contract.SLICES)
    with open(files["md"]) as f:
        md = f.read()
    assert "| median |" in md and "new / today" in md and "peak private (RssAnon)" in md


@pytest.mark.slow
def test_accel_cpu_tiny(cluster, nodes):
    """`python -m bench accel --cpu` on the session's cluster: every variant
    runs its steps, the kill is recovered with nothing redone, the slices
    count what crossed between them, and the table has every variant."""
    from bench import accel

    nodes(2)
    result = accel.run(cpu=True, steps=12, rounds=1, fail_at=6, log=lambda *a: None)
    v = result["variants"]
    assert set(v) == set(accel.VARIANTS)
    assert all(len(r["step_times"]) == 12 for runs in result["raw"].values() for r in runs)
    assert v["plain"]["ratio_to_plain"] == 1.0 and v["plain"]["cross_bytes_per_step"] == 0
    assert v["one_slice"]["cross_bytes_per_step"] == 0 and v["two_slices"]["cross_bytes_per_step"] > 0
    assert v["two_slices"]["failure_count"] == 0 and v["one_slice"]["failure_count"] == 0
    assert v["two_slices_kill"]["failures"] == ["process_died"] and v["two_slices_kill"]["steps_redone"] == 0
    assert all(f["host_peak_bytes"] > 0 for f in v.values())
    text = accel.table(result)
    assert all(f"| {name} |" in text for name in accel.VARIANTS)


def test_tpu_tiny():
    """`python -m bench tpu --size tiny` on CPU (no Ray cluster: each
    variant drives its SliceWorkers in a process of its own, as on the TPU
    machine): every variant runs its steps, one slice sends nothing and
    two send one sum each, one slice's losses and two slices' are bitwise
    equal (the update apart on CPU, the same order at 2 shards), the one
    program's within float32 rounding of plain's, a snapshot and a
    checkpoint come back, and the table has every row."""
    from bench import tpu

    result = tpu.run("tiny", variants=tpu.VARIANTS, steps=6, rounds=1)
    v = result["variants"]
    errors = {name: runs[0]["error"][-800:] for name, runs in v.items() if "error" in runs[0]}
    assert not errors, errors
    assert all(len(runs[0]["step_times"]) == 6 for runs in v.values())
    assert v["one_slice"][0]["bytes_off_device"] == 0 and v["diloco"][0]["bytes_off_device"] == 0
    grad = sum(4 * n for n in [tpu_params()])  # float32 gradient bytes per slice
    assert v["two_slices"][0]["bytes_off_device"] == 2 * grad
    assert v["one_slice"][0]["losses"] == v["two_slices"][0]["losses"] == v["one_slice_apart"][0]["losses"]
    plain = v["plain"][0]["losses"]
    for name in ("one_slice", "plain_micro", "diloco"):
        assert max(abs(a - b) / abs(b) for a, b in zip(v[name][0]["losses"], plain)) < 1e-5, name
    assert v["snapshot"][0]["snapshot_bytes"] > 0 and v["snapshot"][0]["snapshot_s"]
    assert v["checkpoint"][0]["restored_equal"] and v["checkpoint"][0]["restored_step"] == 6
    text = tpu.table(result)
    assert all(f"| {name} |" in text for name in tpu.VARIANTS)
    assert "two slices sharing the device" in text and "checkpoint (Orbax" in text


def tpu_params() -> int:
    """The tiny size's parameter count."""
    import jax

    import examples.lm as lm
    from bench import tpu

    program = lm.make_program(lm.LMConfig(**tpu.sizes()["tiny"]))
    shapes = jax.eval_shape(program.init_params, jax.random.PRNGKey(0))
    return sum(int(a.size) for a in jax.tree.leaves(shapes))
