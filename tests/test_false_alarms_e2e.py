"""Healthy runs raise no failure, on a real local cluster.

A liveness check that fires on a busy, healthy worker evicts it and throws
work away. Ray asks every worker for a full garbage collection whenever a
node's object store fills up (snapshots of a large state do that), and a
collection holds the worker's GIL while it walks the heap: a worker
whose heap is large (JAX's own objects, a program's Python-side tables)
could not answer its liveness pings for that long, and was called hung.
Here the workers hold a heap of several million objects and the driver
asks for Ray's collections (the very request the raylets make) all through
the run: no failure may come of it, and no collection may hold a worker's
Python still for long (the heap built at set-up is frozen out of them:
worker/gc_pauses.py).
"""

from __future__ import annotations

import os

import pytest

from ray_elastic import Callback, ElasticConfig, ElasticTrainer

pytestmark = pytest.mark.cluster

# Tracked objects a worker's program holds: on this 2-core machine a full
# collection of them alone takes 0.7 s, longer while the other worker
# computes.
HEAP_OBJECTS = 8_000_000
# A collection of what a step leaves behind takes milliseconds; one that
# walked the table would take several times this.
MAX_PAUSE_S = 0.25
STEPS = 24


def _heavy_heap_factory(objects: int):
    """The example LM, with a Python-side table of `objects` lists kept
    alive by its batch function (as a tokenizer's vocabulary would be), in
    the workers: the driver's copy of the program only has its shapes
    checked, and a table there would slow every collection of the test
    process for the rest of the session."""
    driver = os.getpid()

    def make():
        import dataclasses

        import examples.lm as lm

        program = lm.make_program(lm.LMConfig())
        table = [[i] for i in range(objects)] if os.getpid() != driver else []
        inner = program.make_batch

        def make_batch(seed, step, shard, num_shards, _table=table):
            return inner(seed, step, shard, num_shards)

        return dataclasses.replace(program, make_batch=make_batch)

    return make


# Ray's own request to every worker for gc.collect(), which a raylet
# sends when its object store is full (a private Ray call: this test's
# stand-in for a full store, made on demand). Asked every third step from
# the third on (by step count, not by time: a fast run still gets them);
# each reaches the workers while they compute the next steps.
ASK_EVERY = 3


def test_workers_with_a_large_heap_are_not_called_hung_through_ray_collections(nodes):
    nodes(2)
    from ray._private.internal_api import global_gc

    asked = []
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=120.0)
    pauses, full = [], []

    class Watch(Callback):
        def on_step(self, step, metrics):
            # past the first steps, whose pings wait longer; not after the last
            if step % ASK_EVERY == 0 and step < STEPS:
                global_gc()
                asked.append(step)
            pauses.append(metrics["gc_pause_s"])
            full.append(metrics["gc_full"])

    report = ElasticTrainer(_heavy_heap_factory(HEAP_OBJECTS), config, STEPS, callbacks=[Watch()]).fit()
    assert len(asked) == STEPS // ASK_EVERY - 1, "the collections were asked for while the run trained"
    assert report.failures == [], [(f.kind, f.slice, f.host, f.step, f.cause) for f in report.failures]
    assert report.steps_completed == STEPS
    assert sum(full) >= 2, "Ray's collections reached both workers"
    assert max(pauses) < MAX_PAUSE_S, pauses
