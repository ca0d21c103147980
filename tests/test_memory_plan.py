"""The driver's memory preflight (control/memory_plan.py, preflight.py):
the estimate from the program's shapes against the bytes the real state
takes, the arithmetic of a host's needs, refusals naming the setting to
change, and on the real cluster a run that cannot fit refused before any
slice is reserved."""

from __future__ import annotations

import functools

import pytest

from ray_elastic import ConfigError, CpuSlice, ElasticConfig, ElasticTrainer
from ray_elastic.cluster.node_memory import Machine, machines
from ray_elastic.control.memory_plan import GB, HostNeeds, check_fits, host_needs, tree_bytes
from ray_elastic.control.preflight import state_needs


def test_the_estimate_is_the_bytes_of_the_real_state():
    import jax

    import examples.lm as lm

    program = lm.make_program(lm.LMConfig())
    needs = state_needs(program, ElasticConfig(num_slices=2))
    params = program.init_params(jax.random.PRNGKey(0))
    real = tree_bytes(params) + tree_bytes(program.optimizer.init(params))
    assert needs.state == real and needs.grads == tree_bytes(params)
    # A sharded layout over a slice's 2 hosts holds half of it on each.
    half = state_needs(lm.make_program(lm.LMConfig(), lm.sharded_layout("fsdp")),
                       ElasticConfig(num_slices=2, slice=CpuSlice(hosts=2)))
    assert half.state == real // 2 and half.grads == tree_bytes(params) // 2


def test_a_hosts_needs_count_the_snapshot_and_the_steps_gradients():
    n = host_needs(params=100, state=300, hosts=1, sharded=False, shards=2, num_slices=2, snapshots=True, on_host=True)
    assert (n.state, n.grads, n.store) == (300, 100, 300 + 2 * 100)
    assert n.host == n.store + 300 + 100
    # The direct hand-off, 16 shards: the apply takes the tree's 8, the slice computes 8 of its own.
    n = host_needs(params=100, state=300, hosts=1, sharded=False, shards=16, num_slices=2, snapshots=False,
                   on_host=False, exchange="direct")
    assert n.store == 8 * 100 and n.host == n.store  # on an accelerator the state is in device memory
    # The reduce-scatter: the slice's own sum, the chunks summed and gathered, whatever the shards.
    n = host_needs(params=100, state=300, hosts=1, sharded=False, shards=16, num_slices=4, snapshots=False,
                   on_host=False)
    assert n.store == 3 * 100
    n = host_needs(params=100, state=300, hosts=4, sharded=True, shards=2, num_slices=2, snapshots=True, on_host=True)
    assert (n.state, n.grads) == (75, 25)


def _needs(gb: float) -> HostNeeds:
    return HostNeeds(state=int(gb * GB), grads=0, store=0, on_host=True)


def test_a_host_larger_than_any_machine_is_refused_naming_the_slice():
    with pytest.raises(ConfigError) as e:
        check_fits(_needs(30), 2, [Machine("a", int(24 * GB), 16), Machine("b", int(20 * GB), 16)])
    assert e.value.setting == "slice" and "30.00 GB" in str(e.value) and "24.00 GB" in str(e.value)


def test_hosts_more_than_the_machines_together_are_refused_naming_num_slices():
    with pytest.raises(ConfigError) as e:
        check_fits(_needs(10), 5, [Machine("a", int(24 * GB), 16), Machine("b", int(24 * GB), 16)])
    assert e.value.setting == "num_slices" and "about 4 such hosts fit" in str(e.value)
    check_fits(_needs(10), 4, [Machine("a", int(24 * GB), 16), Machine("b", int(24 * GB), 16)])  # fits
    check_fits(_needs(1e6), 4, [])  # a cluster that tells nothing of its memory refuses nothing


@pytest.mark.cluster
def test_a_run_that_cannot_fit_is_refused_before_any_slice_is_reserved(cluster):
    import examples.lm as lm

    cluster.ensure_nodes(2)
    (machine,) = machines()  # the local cluster's nodes share this machine
    assert machine.memory > 1 * GB and machine.cpus >= 2
    # 2.1 M params x d_model: about 40 GB of params and Adam state, from shapes alone.
    big = functools.partial(lm.make_program, lm.LMConfig(d_model=4096, mlp_dim=16384, num_layers=48, num_heads=32))
    events = []
    trainer = ElasticTrainer(big, ElasticConfig(num_slices=2), 2, on_event=events.append)
    with pytest.raises(ConfigError) as e:
        trainer.fit()
    assert e.value.setting == "slice" and "sharded program.layout" in str(e.value)
    assert not any(ev["event"] == "reserve" for ev in events)
