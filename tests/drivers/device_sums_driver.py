"""Run SliceWorkers in this process (no Ray) and drive one step's calls
through every path the exchange plan takes, as the controller does; print
JSON facts for tests/test_device_sums.py.

Every run takes STEPS steps of the same 4-shard global batch:
- host: the direct hand-off (no plan): every shard's gradient on the host,
  summed there in key order (the reference);
- one_slice: one slice computes every shard (plan: 1 block): the sums stay
  on the devices, nothing of the gradient is sent;
- one_of_two: one live slice of a 2-slice membership (2 blocks, split
  after a resize): both blocks summed on the devices, the tree over them;
- two_slices: 2 slices of 2 shards (1 chunk, no owner): each apply takes
  its own block from its devices and the other's copied in;
- three_slices: 3 slices, 3 chunks summed by their owners on the host
  (4 shards over 3 slices: the blocks split);
- finished: two slices, one lost after its gradient call: the survivor
  computes the lost slice's shards in a second call of the same step;
- one_of_three: one slice of a 3-slice membership (3 blocks);
- one_program: one slice, its step one program, update included (the
  default on an accelerator): the same math, equal to float rounding;
- bf16: two slices with a bfloat16 wire, against one slice with it.

Usage: driver.py replicated|fsdp [devices]
"""

import functools
import json
import os
import sys

layout_name = sys.argv[1]
devices = int(sys.argv[2]) if len(sys.argv) > 2 else 2
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import examples.lm as lm  # noqa: E402
from ray_elastic.dispatch.exchange_plan import ExchangePlan  # noqa: E402
from ray_elastic.paths import work_path  # noqa: E402
from ray_elastic.worker.actor import SliceWorker  # noqa: E402

SHARDS = 4
STEPS = 3
FAN_IN = 8
shape = lm.Layout() if layout_name == "replicated" else lm.sharded_layout(layout_name)
factory = functools.partial(lm.make_program, lm.LMConfig(), shape)


POOL = []  # (worker, its step-0 state), by slice id: set up once, reset for each run


def worker(slice_id):
    """Slice `slice_id`'s worker, holding the step-0 state. Set up once
    and reset by loading that state for each run (a set-up costs more
    than a run's steps), as a replacement's worker loads a state."""
    while len(POOL) <= slice_id:
        w = SliceWorker(len(POOL), 0, 1, factory, 0, SHARDS)
        w.setup(None, work_path("xla-cache"))
        POOL.append((w, w.state()))
    w, start = POOL[slice_id]
    w.load_state(start)
    return w


def plan(chunks, blocks, wire=None, program="auto"):
    return ExchangePlan(chunks=chunks, blocks=blocks, shards=tuple(range(SHARDS)), fan_in=FAN_IN, wire_dtype=wire,
                        step_program=program)


def sent_bytes(chunk):
    if not chunk:
        return 0
    return sum(int(a.nbytes) for segs in chunk["pieces"].values() for a in segs)


def state_of(w):
    leaves = jax.tree.leaves((w.params, w._held.opt_state))
    return [np.asarray(jax.device_get(a)) for a in leaves]


def run_host():
    w = worker(0)
    losses = []
    for k in range(STEPS):
        _, payload = w.compute_grads(k, tuple(range(SHARDS)))
        losses.append(w.apply(k, False, [payload])["loss"])
    return losses, [state_of(w)], 0


def run_slices(groups, p, blocks_note=None):
    """`groups`: each slice's shards; `p`: the step's plan."""
    ws = [worker(i) for i in range(len(groups))]
    losses, sent = [], 0
    for k in range(STEPS):
        outs = [w.compute_grads(k, shards, plan=p) for w, shards in zip(ws, groups)]
        chunks = [o[1:] for o in outs]
        sent += sum(sent_bytes(c) for cs in chunks for c in cs)
        if p.chunks == 1:
            applied = [w.apply(k, False, [cs[0] for cs in chunks]) for w in ws]
        else:
            owners = [ws[c % len(ws)].reduce_chunk(k, p, c, [cs[c] for cs in chunks])[1] for c in range(p.chunks)]
            applied = [w.apply(k, False, owners) for w in ws]
        assert len({m["loss"] for m in applied}) == 1, applied
        losses.append(applied[0]["loss"])
    return losses, [state_of(w) for w in ws], sent


def run_finished():
    """Slice 1 is lost after its gradient call: slice 0 computes its shards
    in a second call of the same step, then applies both of its own."""
    p = plan(1, 2)
    ws = [worker(0), worker(1)]
    losses = []
    for k in range(STEPS):
        first = ws[0].compute_grads(k, (0, 2), plan=p)
        if k == 1:
            second = ws[0].compute_grads(k, (1, 3), plan=p)  # the lost slice's block
            losses.append(ws[0].apply(k, False, [first[1], second[1]])["loss"])
            ws[1].load_state(ws[0].state())
            continue
        other = ws[1].compute_grads(k, (1, 3), plan=p)
        applied = [w.apply(k, False, [first[1], other[1]]) for w in ws]
        losses.append(applied[0]["loss"])
    return losses, [state_of(w) for w in ws], None


results = {
    "host": run_host(),
    "one_slice": run_slices([(0, 1, 2, 3)], plan(1, 1)),
    "one_of_two": run_slices([(0, 1, 2, 3)], plan(1, 2)),
    "two_slices": run_slices([(0, 2), (1, 3)], plan(1, 2)),
    "three_slices": run_slices([(0, 3), (1,), (2,)], plan(3, 3)),
    "finished": run_finished(),
    "one_of_three": run_slices([(0, 1, 2, 3)], plan(1, 3)),
    "one_program": run_slices([(0, 1, 2, 3)], plan(1, 1, program="one")),
    "bf16_one": run_slices([(0, 1, 2, 3)], plan(1, 2, "bfloat16")),
    "bf16_two": run_slices([(0, 2), (1, 3)], plan(1, 2, "bfloat16")),
}
states = {name: r[1] for name, r in results.items()}  # each run's slices' states, taken as it ended


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


facts = {
    "losses": {name: r[0] for name, r in results.items()},
    "sent": {name: r[2] for name, r in results.items()},
    # Every slice of a run holds the same state, bitwise.
    "slices_agree": {name: all(same(s[0], t) for t in s[1:]) for name, s in states.items()},
    # Runs whose sums follow the same order (the same blocks) against each
    # other: numpy's sums (the direct hand-off, the owners') and the
    # devices' give the same bits.
    "equal": {f"{a}={b}": same(states[a][0], states[b][0]) for a, b in (
        ("host", "one_slice"), ("one_of_two", "two_slices"), ("one_of_two", "finished"),
        ("one_of_three", "three_slices"), ("bf16_one", "bf16_two"))},
    # Another order, or the wire's rounding, changes the bits.
    "differs": {f"{a}!={b}": not same(states[a][0], states[b][0]) for a, b in (
        ("one_slice", "one_of_two"), ("one_of_two", "bf16_one"))},
    # The one program: the host's losses to float32 rounding (the test
    # checks), its state within a tenth of one Adam step of the host's after
    # STEPS steps (Adam moves a param by about the learning rate, 3e-3,
    # whatever its gradient's size: where a gradient near zero rounds
    # otherwise, its param's step differs by a fraction of that).
    "one_program_close": bool(all(np.allclose(a, b, rtol=1e-4, atol=3e-4)
                                  for a, b in zip(states["host"][0], states["one_program"][0]))),
    "gradient_bytes": int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(POOL[0][0].params))),
}
print(json.dumps(facts))
