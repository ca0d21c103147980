"""Shared fixtures: one real multi-node Ray cluster for the whole session.

Ray clusters take seconds to start, so every cluster test shares one; each
test says how many worker nodes it needs and `nodes(n)` adds or removes idle
nodes to match, so a test that removes a node never starves the next one.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every Ray worker process leaves an event file in its session's logs, and
# every node's dashboard agent reads through the whole folder every 2 s to
# send new events to the dashboard. All the session cluster's nodes share
# one folder here, and a session starts hundreds of workers: with 400
# files, five agents used 0.27 of a core doing it (0.02 with none). The
# session cluster runs no dashboard to send them to, so its agents look
# once a minute (Ray's setting, inherited by every node started here).
os.environ.setdefault("SCAN_EVENT_DIR_INTERVAL_SECONDS", "60")
# Ray's default metrics path (OpenTelemetry) has the head node's agent take
# the GCS's histograms in one observation at a time; the GCS's grow with
# every actor and call of the session, and the agent's CPU with them: 109
# CPU-s in a default run of the suite, 45 through Ray's other exporter
# (OpenCensus), set here for every cluster the tests start. What
# ray_elastic records reaches Prometheus either way: test_metrics_e2e
# scrapes a run through this path and, on a cluster of Ray's defaults,
# through the default one.
os.environ.setdefault("RAY_enable_open_telemetry", "0")


@pytest.fixture(scope="session", autouse=True)
def driver_compile_cache():
    """The plain JAX loops the tests compare runs with are compiled in this
    process, most of its CPU time (~17 of the 22 CPU-s of the token LM's
    two reference loops), and again by every test that builds the same
    loop (a new function each time, so JAX's in-memory cache misses). XLA's
    persistent cache, which the workers use too (ElasticConfig's
    compile_cache_dir), keeps each executable once: the same bits, compiled
    once a session, and once a machine while the folder lasts."""
    try:
        import jax
    except ImportError:
        yield
        return
    from ray_elastic.paths import work_path

    jax.config.update("jax_compilation_cache_dir", work_path("xla-cache-tests"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield


@pytest.fixture(scope="session")
def cluster():
    from ray_elastic.cluster.local_cluster import LocalCluster

    # No dashboard web server: no test of this cluster reads it (the job
    # submission tests start clusters of their own), and its ten processes
    # cost CPU the whole session long. The nodes' agents, which export
    # the metrics, still run. No log monitor either: every driver of this
    # cluster connects with log_to_driver=False, and its polling of every
    # worker's log files (hundreds of workers a session) is ~50 CPU-s a
    # session.
    c = LocalCluster(num_nodes=2, dashboard=False, log_monitor=False)
    # The driver (this process) reports its metrics every 2 s, not Ray's
    # 10 s, so the Prometheus test sees them move sooner; set for the
    # connect only, so no node or worker started later inherits it.
    os.environ["RAY_metrics_report_interval_ms"] = "2000"
    try:
        c.connect(runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
    finally:
        os.environ.pop("RAY_metrics_report_interval_ms", None)
    yield c
    c.shutdown()


@pytest.fixture
def nodes(cluster):
    """nodes(n): make the cluster have exactly n live worker nodes."""
    return cluster.ensure_nodes


@pytest.fixture(scope="session")
def lm_factory():
    import examples.lm as lm

    return functools.partial(lm.make_program, lm.LMConfig())


@pytest.fixture(scope="session")
def failure_free(cluster, lm_factory):
    """failure_free(steps): (trainer, report) of a failure-free run of the
    example LM on 2 one-host slices, made once per step count for the
    session: the reference of every module that compares a recovered run
    with it (policy, snapshot and checkpoint settings change no value, and
    each such module checks its own runs against it bitwise)."""
    from ray_elastic import ElasticConfig, ElasticTrainer

    made: dict = {}

    def get(steps: int):
        if steps not in made:
            cluster.ensure_nodes(2)  # an earlier module may have left fewer
            trainer = ElasticTrainer(lm_factory, ElasticConfig(num_slices=2, policy="pause"), steps,
                                     keep_final_state=True)
            report = trainer.fit()
            assert report.steps_completed == steps and not report.failures, report.failures
            assert report.losses[-1] < report.losses[0]
            made[steps] = (trainer, report)
        return made[steps]

    return get


@pytest.fixture(scope="session")
def gcs():
    """A real GCS-compatible server on loopback, with Orbax pointed at it."""
    from tests.fake_gcs import FakeGcs

    server = FakeGcs().start()
    server.point_env()
    server.make_bucket("ckpt")
    yield server
    server.stop()


@pytest.fixture
def gcs_outage_fails_fast(monkeypatch):
    """gcsfs retries a refused connection 6 times, sleeping 1, 2, 4, 8 and
    16 s between tries (its retry count is fixed when the class is made),
    before it raises. A test of what an outage leaves behind needs the
    error, not the wait: gcsfs's backoff sleeps are cut to 10 ms; the
    outage (the server stopped), the tries and the error stay real."""
    import asyncio
    import types

    import gcsfs.retry

    real_sleep = asyncio.sleep

    async def short_sleep(seconds, *args, **kwargs):
        return await real_sleep(min(seconds, 0.01), *args, **kwargs)

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": short_sleep}))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """A module that defines `item_order(item)` has its tests run sorted by
    it (stably), in the places its tests had."""
    places: dict = {}
    for i, item in enumerate(items):
        if callable(getattr(getattr(item, "module", None), "item_order", None)):
            places.setdefault(item.module, []).append(i)
    for module, where in places.items():
        for i, item in zip(where, sorted((items[i] for i in where), key=module.item_order)):
            items[i] = item


# The modules whose runs mostly share a slice shape, one test after
# another: there a run that completes keeps its slices for the next
# (ElasticConfig.keep_workers, cluster/kept_workers.py), which takes them
# as they are (the same program, seed and shard count) or builds its own
# program in their processes. A new worker's start and first steps cost
# ~3 s a run here, a kept one's ~0.2 s (~1 s with another program), and all
# compute the same bits (tests/test_kept_workers_e2e.py).
# Modules left out change shape from test to test (a kept slice of
# another shape is ended first, which costs more than it saves), start
# drivers of their own on the shared cluster (the kept slices would hold
# the nodes those need) or look at how slices start and end.
KEPT_MODULES = {
    "test_diloco_e2e", "test_integrity_e2e", "test_shapes_e2e", "test_group_leaders_e2e", "test_grain_e2e",
    "test_streaming_diloco_e2e", "test_demo_e2e", "test_step_contract_e2e", "test_false_alarms_e2e",
    "test_snapshot_interval_e2e", "test_exchange_e2e", "test_checkpoint_integrity_e2e",
    "test_sharded_e2e", "test_elastic_e2e", "test_snapshots_e2e", "test_pretrained_e2e", "test_stragglers_e2e",
}


@pytest.fixture(autouse=True, scope="module")
def kept_between_tests(request):
    """ElasticConfig.keep_workers defaults to True in KEPT_MODULES; every
    slice kept ends with its module, so no module sees another's."""
    from ray_elastic.config import KEEP_WORKERS_ENV

    if request.module.__name__.rsplit(".", 1)[-1] not in KEPT_MODULES:
        yield
        return
    os.environ[KEEP_WORKERS_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(KEEP_WORKERS_ENV, None)
        import ray

        if ray.is_initialized():
            from ray_elastic import release_workers

            release_workers()
