"""Run one host of a slice (no Ray): the same shard's gradient computed
three times at each of a few steps (the cross-check's recomputation twice,
then the step's own gradient call, then once more while a snapshot of the
state is being made on another thread) and the fingerprint of each, as
the cross-checks compare them. Prints JSON facts for
tests/test_grad_repeat.py.

Usage: driver.py LAYOUT DEVICES HOSTS HOST PORT
(LAYOUT replicated|fsdp|fsdp_tp; HOSTS > 1 starts a jax.distributed slice
over gloo with host 0's coordinator on 127.0.0.1:PORT).
"""

import functools
import json
import os
import sys
import threading

layout_name, devices, hosts, host, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.lm import LMConfig, make_program, sharded_layout  # noqa: E402
from ray_elastic.layout import Layout  # noqa: E402
from ray_elastic.worker.actor import SliceWorker  # noqa: E402
from ray_elastic.worker.fingerprint import host_fingerprint  # noqa: E402

STEPS, SHARD = 4, 1
layout = Layout() if layout_name == "replicated" else sharded_layout(layout_name)
w = SliceWorker(0, host, hosts, functools.partial(make_program, LMConfig(), layout), 0, 2)
w.setup(f"127.0.0.1:{port}" if hosts > 1 else None, "")
prints = []
for k in range(STEPS):
    again = [w.recompute(k, SHARD), w.recompute(k, SHARD)]
    _, payload = w.compute_grads(k, (0, 1))
    sent = host_fingerprint(payload["grads"][SHARD]) if payload is not None else None
    w.apply(k, True, [payload] if payload is not None else [])
    # The next step's check computed while the snapshot thread makes the
    # state's host views (as the actor's threads run them side by side).
    snap = threading.Thread(target=w.snapshot, args=(k,))
    snap.start()
    beside = w.recompute(k + 1, SHARD)
    snap.join()
    prints.append({"step": k, "recomputed": again, "sent": sent, "next_beside_snapshot": beside,
                   "next_alone": w.recompute(k + 1, SHARD)})
# Why a slice's hosts must run the check and the step's own gradients in
# one order (StepRunner.run_first): with host 1 running them the other way
# round, each program's collectives pair with the other program's on the
# other host, and nothing fails: the prints just come out other.
swapped = {}
if hosts > 1:
    k = STEPS
    order = ["check", "step"] if host == 0 else ["step", "check"]
    for what in order:
        if what == "check":
            swapped["check"] = w.recompute(k, SHARD)
        else:  # the step's own shard, another batch than the check's
            _, p = w.compute_grads(k, (0,))
            swapped["step"] = host_fingerprint(p["grads"][0])
    swapped["check_in_order"], swapped["step_in_order"] = w.recompute(k, SHARD), w.recompute(k, 0)
# The comparison can fail: a bit flipped once in a check's computation.
w.corrupt("check", False)
glitched = w.recompute(STEPS, SHARD)
print(json.dumps({"layout": layout_name, "host": host, "prints": prints,
                  "glitched": glitched, "clean": w.recompute(STEPS, SHARD), "swapped": swapped}))
