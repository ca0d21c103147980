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

import threading

import pytest
import ray

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
    alive by its batch function (as a tokenizer's vocabulary would be)."""

    def make():
        import dataclasses

        import examples.lm as lm

        program = lm.make_program(lm.LMConfig())
        table = [[i] for i in range(objects)]
        inner = program.make_batch

        def make_batch(seed, step, shard, num_shards, _table=table):
            return inner(seed, step, shard, num_shards)

        return dataclasses.replace(program, make_batch=make_batch)

    return make


def _collect_while(stop: threading.Event, asked: list, every_s: float = 0.7) -> None:
    # Ray's own request to every worker for gc.collect(), which a raylet
    # sends when its object store is full (a private Ray call: this test's
    # stand-in for a full store, made on demand).
    from ray._private.internal_api import global_gc

    while not stop.wait(every_s):
        global_gc()
        asked.append(1)


def test_workers_with_a_large_heap_are_not_called_hung_through_ray_collections(nodes):
    nodes(2)
    ray.get([])
    stop, asked = threading.Event(), []
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=120.0)
    collector = threading.Thread(target=_collect_while, args=(stop, asked), daemon=True)

    pauses, full = [], []

    class Watch(Callback):
        def on_step(self, step, metrics):
            if step == 2:  # past the first steps, whose pings wait longer
                collector.start()
            pauses.append(metrics["gc_pause_s"])
            full.append(metrics["gc_full"])

    trainer = ElasticTrainer(_heavy_heap_factory(HEAP_OBJECTS), config, STEPS, callbacks=[Watch()])
    try:
        report = trainer.fit()
    finally:
        stop.set()
    assert len(asked) >= 2, "the collections were asked for while the run trained"
    assert report.failures == [], [(f.kind, f.slice, f.host, f.step, f.cause) for f in report.failures]
    assert report.steps_completed == STEPS
    assert sum(full) >= 2, "Ray's collections reached both workers"
    assert max(pauses) < MAX_PAUSE_S, pauses
