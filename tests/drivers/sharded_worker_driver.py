"""Run SliceWorkers in this process (no Ray) on 4 XLA CPU devices under a
sharded layout; print JSON facts for tests/test_sharded_worker.py.

Two slices exchange their blocks (each computes one batch shard) and one
slice computes both: the same states, bitwise. Usage: driver.py fsdp|fsdp_tp
"""

import dataclasses
import functools
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from examples.lm import LMConfig, make_program, sharded_layout  # noqa: E402
from ray_elastic.worker.actor import SliceWorker  # noqa: E402
from ray_elastic.paths import work_path  # noqa: E402

sharding = sys.argv[1]
factory = functools.partial(make_program, LMConfig(), sharded_layout(sharding))


def worker(slice_id):
    w = SliceWorker(slice_id, 0, 1, factory, 0, 2)
    # The persistent compilation cache: 5 workers, one program.
    assert w.setup(None, work_path("xla-cache"))["per_host"] is True
    return w


a, b, one = worker(0), worker(1), worker(0)
losses = []
for k in range(3):
    _, pa = a.compute_grads(k, (0,))
    _, pb = b.compute_grads(k, (1,))
    ma = a.apply(k, False, [pa, pb])
    mb = b.apply(k, True, [pb, pa])  # parts in another order: summed by shard all the same
    _, snap_b = b.snapshot(k)  # the snapshot the apply began
    _, p1 = one.compute_grads(k, (0, 1))
    m1 = one.apply(k, False, [p1])
    losses.append((ma["loss"], mb["loss"], m1["loss"]))
state_a, state_one = a.state(), one.state()
same = state_a.blocks.keys() == state_one.blocks.keys() and all(
    np.array_equal(state_a.blocks[key], state_one.blocks[key]) for key in state_a.blocks)
fresh = worker(1)
fresh.load_state(snap_b)
refused = ""
try:
    worker(0).load_state(dataclasses.replace(snap_b, host=1))
except ValueError as e:
    refused = str(e)
_, pf = fresh.compute_grads(3, (0, 1))
_, po = one.compute_grads(3, (0, 1))
loads_ok = fresh.apply(3, False, [pf])["loss"] == one.apply(3, False, [po])["loss"]
shards = {}
for path, leaf in jax.tree_util.tree_leaves_with_path(a.params):
    name = "/".join(getattr(p, "key", str(p)) for p in path)
    shards[name] = [list(leaf.shape), str(leaf.sharding.spec), [list(s.data.shape) for s in leaf.addressable_shards]]
print(json.dumps({"losses": losses, "same": bool(same), "loads_ok": bool(loads_ok), "refused": refused,
                  "shards": shards}))
