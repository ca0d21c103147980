"""Run a SliceWorker in this process (no Ray) on 4 XLA CPU devices and
take snapshots off the step's path: the snapshot an apply begins is
finished only after the next two steps have applied (donating the state's
arrays to their updates). Prints JSON facts for
tests/test_snapshot_off_path.py. Usage: driver.py replicated|fsdp
"""

import functools
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from examples.lm import LMConfig, make_program, sharded_layout  # noqa: E402
from ray_elastic.checkpoint.state_forms import FlatState  # noqa: E402
from ray_elastic.layout import Layout  # noqa: E402
from ray_elastic.worker.actor import SliceWorker  # noqa: E402
from ray_elastic.paths import work_path  # noqa: E402

layout = Layout() if sys.argv[1] == "replicated" else sharded_layout(sys.argv[1])
w = SliceWorker(0, 0, 1, functools.partial(make_program, LMConfig(), layout), 0, 2)
w.setup(None, work_path("xla-cache"))


def step(k, snapshot=False):
    _, payload = w.compute_grads(k, (0, 1))
    w.apply(k, snapshot, [payload])
    return payload


def values(state):
    """The snapshot's arrays, copied, in a fixed order."""
    if isinstance(state, FlatState):
        return [np.array(state.flat)]
    return [np.array(state.blocks[key]) for key in sorted(state.blocks, key=str)]


def copy_now():
    """The held state as its snapshot would have it, copied now."""
    w._transfer.begin_snapshot()
    return values(w.snapshot(w._held.step - 1)[1])


step(0)
payload = step(1, snapshot=True)
at_two = copy_now()  # the state after step 1, as a snapshot finished at once holds it
w.apply(1, True, [payload])  # a re-issued apply: idempotent, begins the snapshot again
step(2)
step(3)  # two updates have donated the arrays the views read
status, late = w.snapshot(1)
after_four = copy_now()
try:
    w.snapshot(1)
    refused = ""
except RuntimeError as e:
    refused = str(e)
print(json.dumps({
    "late_step": late.step,
    "late_equal": len(values(late)) == len(at_two) and all(np.array_equal(a, b) for a, b in zip(values(late), at_two)),
    "moved_on": not all(np.array_equal(a, b) for a, b in zip(after_four, at_two)),
    "status": status,
    "nbytes": int(sum(a.nbytes for a in at_two)),
    "refused": refused,
    # Nothing here asked for Ray: a worker built outside Ray starts none.
    "ray_started": "ray" in sys.modules and sys.modules["ray"].is_initialized(),
}))
