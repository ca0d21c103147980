"""The LM fed by a Grain pipeline over an ArrayRecord file (shuffled,
tokenized, packed) on real clusters: the workers read exactly the records
a plain loop reads, each host reads only its rows, and a run with a kill
(resize) or a node removal (pause) ends bitwise equal to its failure-free
run.

The first loss is compared with a plain computation on the same records
at the same initial params: float32 rounding only (ray_elastic sums each
shard's loss on its own and adds the shards in order; measured agreement
about 1e-7 relative, 1e-5 asserted)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np
import pytest

from ray_elastic import CpuSlice, ElasticConfig, ElasticTrainer, Fault
from ray_elastic.errors import ConfigError

pytestmark = pytest.mark.cluster

STEPS = 12
SHARDS = 4
SEED = 0


def _grain_config(tmp, read_log=""):
    import examples.lm_grain as lg

    return lg.GrainLMConfig(data_dir=str(tmp), num_documents=1024, read_log=read_log)


def _config(**kw) -> ElasticConfig:
    kw.setdefault("num_slices", 2)
    kw.setdefault("batch_shards", SHARDS)
    kw.setdefault("step_deadline_floor_s", 10.0)
    kw.setdefault("timeout_s", 180.0)
    kw.setdefault("seed", SEED)
    return ElasticConfig(slice=CpuSlice(hosts=2, devices_per_host=1), **kw)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("grain")


@pytest.fixture(scope="module")
def grain_factory(data_dir):
    """Every host logs what it reads. Every run of the module has this
    program, so each starts in the slices the one before kept."""
    import examples.lm as lm
    import examples.lm_grain as lg

    log = str(data_dir / "reads")
    return functools.partial(lg.make_program, _grain_config(data_dir, log), lm.sharded_layout("fsdp"))


@pytest.fixture(scope="module")
def grain_run(cluster, grain_factory):
    """The failure-free run, and the reads its hosts logged (read at its
    end: the later runs of the module log to the same folder)."""
    cluster.ensure_nodes(4)
    trainer = ElasticTrainer(grain_factory, _config(policy="pause"), STEPS, keep_final_state=True)
    report = trainer.fit()
    assert report.steps_completed == STEPS and not report.failures
    log = grain_factory.args[0].read_log
    reads = [json.loads(line) for f in os.listdir(log) for line in open(os.path.join(log, f))]
    return trainer, report, reads


def test_the_first_loss_is_a_plain_loop_s_on_the_same_records(grain_run, data_dir):
    import jax

    import examples.lm_grain as lg
    from examples import lm

    _, report, _ = grain_run
    config = _grain_config(data_dir)
    params = lm.init_params(config.lm, jax.random.PRNGKey(SEED))
    ctx = type("Ctx", (), {"rng": None})()
    outs = [lg._loss_fn(config, params, b, ctx) for b in lg.plain_batches(config, 0, SHARDS)]
    plain = float(sum(o.total for o in outs) / sum(o.weight for o in outs))
    assert report.losses[0] == pytest.approx(plain, rel=1e-5)
    tokens = sum(float(o.weight) for o in outs)
    assert report.metrics_per_step[0]["tokens"] == tokens  # every real target of the global batch, counted once
    assert report.losses[-1] < report.losses[0]


def test_each_host_reads_only_its_rows(grain_run):
    """Two hosts per slice, pure FSDP (the batch splits over both): every
    step's read asks for one half of a shard, and across a slice's two
    hosts the halves cover the shard exactly once."""
    _, _, reads = grain_run
    steps = [r for r in reads if r["rows"] is not None]
    assert {r["pid"] for r in steps} and all(r["rows"] in ([0, 4], [4, 8]) for r in steps), steps[:4]
    for step in range(STEPS):
        for shard in range(SHARDS):
            halves = sorted(tuple(r["rows"]) for r in steps if r["step"] == step and r["shard"] == shard)
            # Read by one slice (2 hosts), each half once; a read ahead of the step past the end may add one.
            assert halves == [(0, 4), (4, 8)], (step, shard, halves)
    whole = [r for r in reads if r["rows"] is None]
    # Each host's compile reads shard 0 of step 0 whole, for its shapes (the
    # driver's check takes the rows from make_batch.rows_per_shard instead).
    assert len(whole) == 4


# What Grain adds to a failure is who reads the lost slice's rows: under
# resize a survivor (resize-kill). A replacement on a new node reads them
# from its own start as every worker does at its first step (the tests
# above); each policy with each fault, without Grain, is
# test_step_contract_e2e's token LM.
@pytest.mark.parametrize("policy,fault", [("resize", "kill")])
def test_grain_fed_run_through_a_failure_ends_bitwise_equal(cluster, grain_factory, grain_run, policy, fault):
    cluster.ensure_nodes(4)
    base_trainer, base, _ = grain_run
    added = []

    def on_event(e):  # the replacement node comes from outside, as an autoscaler's would
        if fault == "remove_node" and e["event"] == "detected" and not added:
            added.append(cluster.add_node())

    trainer = ElasticTrainer(grain_factory, _config(policy=policy), STEPS, keep_final_state=True,
                             faults=(Fault(fault, slice_id=1, step=5, host=1),), remove_node=cluster.remove_node,
                             on_event=on_event)
    report = trainer.fit()
    assert report.steps_completed == STEPS and len(report.failures) == 1
    assert report.losses == base.losses
    assert report.metrics_per_step == base.metrics_per_step
    a, b = trainer.final_state, base_trainer.final_state
    assert len(a) == len(b)
    for pa, pb in zip(a, b):
        assert pa["blocks"].keys() == pb["blocks"].keys()
        for key in pa["blocks"]:
            np.testing.assert_array_equal(pa["blocks"][key], pb["blocks"][key], err_msg=str(key))


def test_a_dataset_too_short_fails_before_any_slice_is_reserved(cluster, data_dir):
    """A finite pipeline (one pass over 40 documents: 32 rows) cannot feed
    3 steps of 4 shards x 8 rows; the driver says so before reserving."""
    import ray
    from ray.util import placement_group_table

    import examples.lm_grain as lg

    config = _grain_config(data_dir)
    groups = len(placement_group_table())

    def short_program():
        import grain

        from ray_elastic.data import GrainBatches, PackedDocuments

        docs = grain.MapDataset.source(grain.sources.ArrayRecordDataSource([lg.write_corpus(config)]))[:40]
        rows = PackedDocuments(docs.map(lg._tokenize), config.lm.seq_len + 1, docs_per_window=5, rows_per_window=4)
        return dataclasses.replace(lg.make_program(config), make_batch=GrainBatches(rows, 8))

    with pytest.raises(ConfigError, match=r"program.make_batch.*has 32 records.*runs out at step 1 of the 3"):
        ElasticTrainer(short_program, _config(), 3).fit()
    assert len(placement_group_table()) == groups
    assert ray.is_initialized()
