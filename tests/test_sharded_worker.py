"""Sharded layouts inside one process (no Ray): the example LM's FSDP x
tensor-parallel layout on 4 XLA CPU devices. The host-by-host
exchange gives bitwise the state one slice computing every shard gets;
a host loads only blocks of its own index. Plus the Layout's validation.
tests/test_sharded_e2e.py runs the same on a real multi-node cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ray_elastic.errors import ConfigError
from ray_elastic.layout import Layout

DRIVER = os.path.join(os.path.dirname(__file__), "drivers", "sharded_worker_driver.py")


# FSDP alone runs on a real cluster in test_sharded_e2e.py; here FSDP x TP.
@pytest.fixture(scope="module", params=["fsdp_tp"])
def facts(request):
    out = subprocess.run([sys.executable, DRIVER, request.param], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return request.param, json.loads(out.stdout.strip().splitlines()[-1])


def test_exchange_matches_one_slice_bitwise(facts):
    _, f = facts
    for two_a, two_b, one in f["losses"]:
        assert two_a == two_b == one
    assert f["losses"][-1][0] < f["losses"][0][0]
    assert f["same"] and f["loads_ok"]
    assert "loads host to host" in f["refused"]


def test_blocks_follow_the_layout(facts):
    sharding, f = facts
    shape, spec, blocks = f["shards"]["block_0/mlp_in/kernel"]  # (embed, mlp)
    if sharding == "fsdp":  # embed over 4 devices
        assert spec == "P('fsdp', None)"
        assert blocks == [[shape[0] // 4, shape[1]]] * 4
    else:  # embed over fsdp=2, mlp over tensor=2
        assert spec == "P('fsdp', 'tensor')"
        assert blocks == [[shape[0] // 2, shape[1] // 2]] * 4
    shape, spec, blocks = f["shards"]["ln_final/scale"]  # kept whole
    assert blocks == [shape] * 4


def test_layout_validation():
    assert Layout().plan(8).axis_sizes == (8,)
    plan = Layout.from_maxtext(ici_fsdp_parallelism=-1, ici_tensor_parallelism=2, params={}).plan(8)
    assert (plan.axis_names, plan.axis_sizes, plan.batch_axes) == (("data", "fsdp", "tensor"), (1, 4, 2), ("data", "fsdp"))
    with pytest.raises(ConfigError, match="layout.mesh"):
        Layout.from_maxtext(ici_fsdp_parallelism=3, params={}).plan(4)
    with pytest.raises(ConfigError, match="layout.mesh"):
        Layout.from_maxtext(ici_fsdp_parallelism=-1, ici_tensor_parallelism=3, params={}).plan(4)
    with pytest.raises(ConfigError, match="layout.mesh"):
        Layout(mesh=(("fsdp", -1), ("tensor", -1)))
    with pytest.raises(ConfigError, match="layout.rules"):
        Layout(mesh=(("fsdp", 2),), params={}, rules=(("embed", "model"),))
    with pytest.raises(ConfigError, match="layout.mesh"):
        Layout(params={})
    with pytest.raises(ConfigError, match="layout.batch_axes"):
        Layout(mesh=(("tensor", 2),), params={})
