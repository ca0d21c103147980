"""Ray's memory monitor kills a real worker (a node whose raylet runs with
a memory threshold just above what the machine uses, a real leak in the
worker past it): the failure is of kind `oom`, its cause names what the
worker used and the node had beside what the run needs, and the run
recovers by policy. tests/test_ray_errors.py has every other error Ray
documents for a step's calls."""

from __future__ import annotations

import time

import psutil
import pytest

from ray_elastic import Callback, ElasticConfig, ElasticTrainer, Fault

pytestmark = pytest.mark.cluster

LEAK_MB = 3000
STEPS = 40
LEAK_AT = 5
# The leak takes a second or two to grow and is held 3 s: a run whose
# steps are fast (a warm machine: ~25 ms each) ended before the memory
# monitor's kill, and the test saw no failure. From the leak on, each step
# waits this long in the driver, so the run outlasts the leak.
PACE_S = 0.15


class Paced(Callback):
    def on_step(self, step, metrics):
        if step >= LEAK_AT:
            time.sleep(PACE_S)


def _settled_use(limit_s: float = 15.0) -> float:
    """The machine's memory in use (a fraction), once processes that an
    earlier test ended have let theirs go: read with them still exiting,
    the threshold came out too high for the leak to cross."""
    end, last = time.monotonic() + limit_s, None
    while True:
        vm = psutil.virtual_memory()
        now = vm.total - vm.available
        if last is not None and (abs(now - last) < 50e6 or time.monotonic() > end):
            return now / vm.total
        last = now
        time.sleep(1.0)


def test_a_worker_killed_by_rays_memory_monitor_is_an_oom_failure_the_run_recovers_from(cluster, lm_factory):
    cluster.ensure_nodes(1)
    used = _settled_use()
    # 1 GB past what the machine uses: the run's own growth (its workers
    # starting) stays under it, the leak takes the node over it.
    threshold = min(0.9, used + 1.0e9 / psutil.virtual_memory().total)
    tight = cluster.add_node(env={"RAY_memory_usage_threshold": f"{threshold:.4f}",
                                  "RAY_memory_monitor_refresh_ms": "100"})
    try:
        on_tight = None

        def where(e):
            nonlocal on_tight
            if e["event"] == "start":
                on_tight = next(s for s in (0, 1) if trainer.hosts(s)[0]["node_id"] == tight)

        trainer = ElasticTrainer(lm_factory, ElasticConfig(num_slices=2, policy="resize", timeout_s=120), STEPS,
                                 faults=(Fault("oom", 0, LEAK_AT, ms=LEAK_MB), Fault("oom", 1, LEAK_AT, ms=LEAK_MB)),
                                 on_event=where, callbacks=[Paced()])
        report = trainer.fit()
    finally:
        if tight in cluster.nodes:
            cluster.remove_node(tight)
    assert report.steps_completed == STEPS
    # The tight node's worker (a replacement killed again there too, on a
    # machine whose memory moved meanwhile): nothing else.
    assert report.failures and all(x.kind == "oom" and x.slice == on_tight for x in report.failures), \
        (report.failures, on_tight)
    f = report.failures[0]
    assert "killed by Ray's memory monitor" in f.cause and "the node was at" in f.cause, f.cause
    assert "the run needs at least" in f.cause, f.cause
