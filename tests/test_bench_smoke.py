"""Smoke test of the benchmark runner (bench/compare.py) and the device
bench (bench/tpu.py) with tiny settings: the outputs have the promised
shape. The full benchmark (`python -m bench compare`) is not part of the
test suite.

Not here, to keep CI within its time: `bench hoststart`, `bench sizes
--quick`, `bench exchange`, `bench contract`, `bench accel --cpu`,
`bench sharded --quick`, `bench scale`, `bench ready` and `bench soak`
(half a minute to ten minutes each on 2 cores; `bench sharded`'s gloo
rendezvous fails on a loaded machine). What they exercise of ray_elastic
runs in the suite (test_host_cache.py, test_host_writes.py,
test_exchange_e2e.py, test_step_contract_e2e.py, test_sharded_e2e.py,
test_shapes_e2e.py, test_readiness_phases.py, test_warm_pool.py,
test_checkpoints_e2e.py, test_node_loss_e2e.py); their own code is
checked by running them: `python -m bench hoststart --runs 1`, `python -m
bench sizes --quick`, `python -m bench exchange --sizes 2 --steps 6`,
`python -m bench contract --runs 1`, `python -m bench accel --cpu`,
`python -m bench sharded --quick`, `python -m bench scale --sizes 4,16
--steps 14 --failures 2`, `python -m bench ready --runs 1`, `python -m
bench soak --failures 2 --policy pause --kinds kill,term --interval 0.5,1
--no-reference`."""

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


def test_fake_slices_failure_is_actor_died(cluster):
    """The fake's failure is a real ActorDiedError from ray.get."""
    import ray
    from ray import exceptions as rex

    from bench.fake_slices import dead_ref

    with pytest.raises(rex.ActorDiedError):
        ray.get(dead_ref(), timeout=30)


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
        # DiLoCo's inner steps until its first outer step (then its params are the outer step's)
        losses = v[name][0]["losses"][:v[name][0].get("round")]
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, plain)) < 1e-5, name
    assert len(v["diloco"][0]["outer_s"]) == 1 and v["diloco"][0]["losses"][5] != plain[5]
    assert v["snapshot"][0]["snapshot_bytes"] > 0 and v["snapshot"][0]["snapshot_s"]
    assert v["checkpoint"][0]["restored_equal"] and v["checkpoint"][0]["restored_step"] == 6
    text = tpu.table(result)
    assert all(f"| {name} |" in text for name in tpu.VARIANTS) and "DiLoCo: device peak" in text
    assert "two slices sharing the device" in text and "checkpoint (Orbax" in text


def tpu_params() -> int:
    """The tiny size's parameter count."""
    import jax

    import examples.lm as lm
    from bench import tpu

    program = lm.make_program(lm.LMConfig(**tpu.sizes()["tiny"]))
    shapes = jax.eval_shape(program.init_params, jax.random.PRNGKey(0))
    return sum(int(a.size) for a in jax.tree.leaves(shapes))
