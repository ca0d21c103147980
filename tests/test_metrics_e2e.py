"""MetricsCallback: its state machine with fake metric objects (fast), and
end to end: a real run on the local multi-node cluster with a real fault,
its metrics scraped from the Prometheus endpoint of the driver's node.

How the scrape works: the driver's core worker pushes `ray.util.metrics`
values to the metrics agent of its node every `metrics_report_interval_ms`
(10 s by default; the session cluster keeps Ray's default), and the agent
serves them at `http://127.0.0.1:<MetricsExportPort>/metrics`, the port
`ray.nodes()` gives for that node. Ray names them `ray_` + the metric's name.
The session cluster exports through OpenCensus (conftest.py says why); one
test scrapes a driver on a cluster of Ray's default, OpenTelemetry.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from types import SimpleNamespace

import pytest

from ray_elastic.callbacks import Callback, Phase, RunStatus
from ray_elastic.observe import metrics as rm
from ray_elastic.observe.metrics import STATE_CODES, STATES, MetricsCallback
from ray_elastic.observe.report import RunReport

# -- the callback's logic, with fake metric objects -----------------------------------


class _FakeMetric:
    def __init__(self):
        self.values: dict[tuple, float] = {}  # gauges: last value; counters: sum
        self.observed: list[tuple[tuple, float]] = []

    def set(self, v, tags):
        self.values[tuple(sorted(tags.items()))] = v

    def inc(self, v=1.0, tags=None):
        k = tuple(sorted(tags.items()))
        self.values[k] = self.values.get(k, 0) + v

    def observe(self, v, tags):
        self.observed.append((tuple(sorted(tags.items())), v))


@pytest.fixture
def fake_metrics(monkeypatch):
    keys = ["state", "state_code", "step", "steps_requested", "loss", "step_seconds", "live_slices",
            "goodput", "last_recovery", "failures", "rewound", "events", "recovery", "train_metric"]
    fakes = {k: _FakeMetric() for k in keys}
    monkeypatch.setattr(rm, "_METRICS", fakes)
    return fakes


def _g(fakes, key, run="r", **tags):
    return fakes[key].values.get(tuple(sorted({"run": run, **tags}.items())))


def _state(fakes, run="r"):
    on = [s for s in STATES if _g(fakes, "state", run, state=s) == 1.0]
    assert len(on) == 1, on
    assert _g(fakes, "state_code", run) == STATE_CODES[on[0]]
    return on[0]


def test_callback_tracks_a_run_with_a_failure(fake_metrics):
    clock = SimpleNamespace(now=0.0)
    cb = MetricsCallback("r", refresh_s=60, clock=lambda: clock.now)
    f = fake_metrics
    cb.on_start(SimpleNamespace(steps=10))
    assert _state(f) == "starting" and _g(f, "steps_requested") == 10 and _g(f, "step") == 0
    cb.on_event({"t": 1.0, "event": "start", "slices": [0, 1]})
    cb.on_state(RunStatus(Phase.TRAINING, 1.0, 0, 2))
    assert _state(f) == "training" and _g(f, "live_slices") == 2
    for k in range(1, 5):
        clock.now += 1.0
        cb.on_step(k, {"loss": 5.0 - k, "slices": 2, "step_s": 0.5})
    assert _g(f, "step") == 4 and _g(f, "loss") == 1.0 and _g(f, "step_seconds") == 0.5
    assert _g(f, "goodput") == pytest.approx(2.0 / 4.0)
    cb.on_event({"t": 5.0, "event": "detected", "kind": "process_died", "slice": 1, "host": 0, "step": 4})
    cb.on_state(RunStatus(Phase.RECOVERING, 5.0, 4, 1, pending=(1,)))
    assert _state(f) == "recovering" and _g(f, "live_slices") == 1
    assert _g(f, "failures", kind="process_died") == 1
    cb.on_event({"t": 5.1, "event": "rewind", "from_step": 4, "to_step": 3})
    assert _g(f, "step") == 3 and _g(f, "rewound") == 1
    cb.on_event({"t": 5.2, "event": "wait", "deadline_s": 60.0, "step": 3})
    cb.on_state(RunStatus(Phase.WAITING, 5.2, 3, 1, pending=(1,), deadline_s=60.0))
    assert _state(f) == "waiting"
    cb.on_event({"t": 9.0, "event": "grow", "joined": [1], "slices": [0, 1], "step": 3})
    cb.on_state(RunStatus(Phase.RECOVERING, 9.0, 3, 2, pending=(1,)))
    assert _state(f) == "recovering" and _g(f, "live_slices") == 2
    clock.now = 10.0
    cb.on_event({"t": 10.0, "event": "recovered", "slice": 1, "step": 4, "recovered_s": 5.5})
    cb.on_state(RunStatus(Phase.TRAINING, 10.0, 4, 2))
    cb.on_step(4, {"loss": 1.0, "slices": 2, "step_s": 0.5})
    assert _state(f) == "training" and _g(f, "last_recovery") == 5.5
    assert f["recovery"].observed == [((("run", "r"),), 5.5)]
    # The rewound step's time is not productive: 4 kept steps of 0.5 s in 10 s.
    assert _g(f, "goodput") == pytest.approx(2.0 / 10.0)
    cb.on_event({"t": 10.5, "event": "checkpoint_saved", "step": 4})  # unknown: counted, no harm
    assert _g(f, "events", event="checkpoint_saved") == 1 and _state(f) == "training"
    report = RunReport(policy="pause", num_slices=2, steps_requested=10, steps_completed=10, wall_s=20.0, productive_s=5.0)
    cb.on_state(RunStatus(Phase.DONE, 20.0, 10, 2))
    cb.on_end(report)
    assert _state(f) == "done" and _g(f, "step") == 10 and _g(f, "goodput") == 0.25
    cb.close()


def test_the_programs_metrics_are_gauges_by_name(fake_metrics):
    """Aux metrics and evals (whatever the program names them) go to one
    gauge, tagged by name; a metric keeps its last value on steps without it."""
    cb = MetricsCallback("r", refresh_s=60)
    f = fake_metrics
    cb.on_start(SimpleNamespace(steps=10))
    cb.on_step(1, {"loss": 2.0, "accuracy": 0.25, "eval/loss": 3.0, "slices": 2, "step_s": 0.5})
    cb.on_step(2, {"loss": 1.5, "accuracy": 0.5, "slices": 2, "step_s": 0.5})
    assert _g(f, "train_metric", name="accuracy") == 0.5 and _g(f, "train_metric", name="eval/loss") == 3.0
    assert _g(f, "train_metric", name="slices") is None and _g(f, "loss") == 1.5
    cb.close()


def test_failed_run_and_refresh_thread_stops(fake_metrics):
    cb = MetricsCallback("r", refresh_s=0.02, linger_s=0.1)
    cb.on_start(SimpleNamespace(steps=10))
    thread = cb._thread
    assert thread.is_alive()
    fake_metrics["step"].values.clear()
    time.sleep(0.1)
    assert _g(fake_metrics, "step") == 0  # set again by the refresher
    cb.on_state(RunStatus(Phase.FAILED, 3.0, 3, 2, reason="gave up"))
    cb.on_end(RunReport(policy="pause", num_slices=2, steps_requested=10, steps_completed=3, error="gave up"))
    assert _state(fake_metrics) == "failed"
    thread.join(timeout=5)
    assert not thread.is_alive()  # stopped by itself after linger_s


def test_metric_errors_never_reach_the_run(fake_metrics, caplog):
    fake_metrics["failures"].inc = None  # calling it raises TypeError
    cb = MetricsCallback("r", refresh_s=60)
    cb.on_start(SimpleNamespace(steps=3))
    cb.on_event({"t": 1.0, "event": "detected", "kind": "hung", "slice": 0, "host": 0, "step": 0})
    cb.on_step(1, {"loss": 1.0, "slices": 1, "step_s": 0.1})  # disabled, silent
    cb.on_end(RunReport(policy="pause", num_slices=1, steps_requested=3))
    assert "disabled after an error" in caplog.text
    cb.close()


# -- end to end: scrape Ray's Prometheus endpoint ------------------------------------

STEPS = 30
FAIL_AT = 10
GATE_STEP = 5
SCRAPE_TIMEOUT_S = 90.0  # the default report interval is 10 s
GATE_TIMEOUT_S = 45.0

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def scrape(port: int, run: str) -> dict[tuple, float]:
    """{(name, extra labels...): value} of one run's ray_elastic series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for name, labels, value in parse_prometheus(text):
        if name.startswith("ray_elastic_") and labels.get("run") == run:
            extra = tuple(sorted((k, v) for k, v in labels.items() if k in ("state", "kind", "event", "le")))
            found[(name, *extra)] = value
    return found


def driver_metrics_port() -> int:
    """The metrics port of the node the driver is on: its agent exports what
    the driver records."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == me)
    assert node["Alive"] and node.get("MetricsExportPort"), node
    return int(node["MetricsExportPort"])


def _wait_for_series(port: int, run: str, want: dict, timeout_s: float) -> tuple[bool, dict]:
    """Scrape until every series in `want` has its value; (ok, last scrape)."""
    deadline = time.monotonic() + timeout_s
    last: dict = {}
    while True:
        try:
            last = scrape(port, run)
        except OSError:
            pass
        if all(last.get(k) == v for k, v in want.items()):
            return True, last
        if time.monotonic() >= deadline:
            return False, last
        time.sleep(0.5)


class ScrapeGate(Callback):
    """Holds the run at a point until the endpoint shows the values the run
    has there (at most GATE_TIMEOUT_S), so the test sees the metrics move
    with the run, not only their final values. Placed after the
    MetricsCallback, so the metrics are already recorded when it runs."""

    def __init__(self, port: int, run: str):
        self.port, self.run = port, run
        self.results: dict[str, tuple[bool, dict]] = {}

    def on_step(self, step, metrics):
        if step == GATE_STEP:
            self.results["training"] = _wait_for_series(self.port, self.run, {
                ("ray_elastic_step",): float(GATE_STEP),
                ("ray_elastic_state", ("state", "training")): 1.0,
                ("ray_elastic_live_slices",): 2.0,
            }, GATE_TIMEOUT_S)

    def on_state(self, status):
        if status.phase == Phase.RECOVERING and "detected" not in self.results:
            self.results["detected"] = _wait_for_series(self.port, self.run, {
                ("ray_elastic_state", ("state", "recovering")): 1.0,
                ("ray_elastic_state", ("state", "training")): 0.0,
                ("ray_elastic_failures_total", ("kind", "process_died")): 1.0,
                ("ray_elastic_live_slices",): 1.0,
            }, GATE_TIMEOUT_S)


@pytest.mark.cluster
def test_metrics_scraped_from_prometheus_endpoint(nodes, lm_factory):
    from ray_elastic import ElasticConfig, ElasticTrainer, Fault

    nodes(2)
    port = driver_metrics_port()
    run = f"test-{uuid.uuid4().hex[:8]}"
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=120.0)
    metrics = MetricsCallback(run, refresh_s=1.0, linger_s=SCRAPE_TIMEOUT_S + 30)
    gate = ScrapeGate(port, run)
    trainer = ElasticTrainer(
        lm_factory, config, STEPS, faults=(Fault("kill", 1, FAIL_AT),), callbacks=[metrics, gate],
    )
    try:
        report = trainer.fit()
        assert report.steps_completed == STEPS
        assert [f.kind for f in report.failures] == ["process_died"]
        # While the run went on, the endpoint showed it training at step
        # GATE_STEP, then recovering from the failure.
        for point in ("training", "detected"):
            assert point in gate.results, f"the run never reached the {point} gate"
            ok, last = gate.results[point]
            assert ok, f"{point}: the endpoint did not show the run's values within {GATE_TIMEOUT_S} s: {last}"
        _check_final(port, run, report)
    finally:
        metrics.close()


def _check_final(port, run, report):
    want = {
        ("ray_elastic_step",): float(STEPS),
        ("ray_elastic_steps_requested",): float(STEPS),
        ("ray_elastic_state", ("state", "done")): 1.0,
        ("ray_elastic_state", ("state", "training")): 0.0,
        ("ray_elastic_state_code",): float(STATE_CODES["done"]),
        ("ray_elastic_live_slices",): 2.0,
        ("ray_elastic_failures_total", ("kind", "process_died")): 1.0,
        ("ray_elastic_recovery_seconds_count",): 1.0,
    }
    ok, last = _wait_for_series(port, run, want, SCRAPE_TIMEOUT_S)
    missing = {k: (last.get(k), v) for k, v in want.items() if last.get(k) != v}
    assert ok, f"series not (yet) right after {SCRAPE_TIMEOUT_S} s: {missing}\nscraped: {last}"
    assert last[("ray_elastic_goodput",)] == pytest.approx(report.goodput, abs=1e-6)
    assert 0 < last[("ray_elastic_goodput",)] < 1
    recovered_s = report.failures[0].recovered_s
    assert last[("ray_elastic_last_recovery_seconds",)] == pytest.approx(recovered_s, rel=1e-6)
    # The histogram has the one recovery in the right bucket (Ray's exporter
    # approximates _sum from bucket midpoints, so only the buckets are exact).
    buckets = {float(dict(k[1:])["le"]): v for k, v in last.items() if k[0] == "ray_elastic_recovery_seconds_bucket"}
    assert buckets and all(v == (1.0 if le >= recovered_s else 0.0) for le, v in buckets.items()), (recovered_s, buckets)
    assert last[("ray_elastic_step_seconds",)] > 0
    assert abs(last[("ray_elastic_loss",)] - report.final_loss) < 1e-6
    assert last[("ray_elastic_events_total", ("event", "detected"))] == 1.0
    assert last[("ray_elastic_events_total", ("event", "recovered"))] == 1.0


# A driver of its own on a cluster of Ray's default metrics settings (the
# tests' clusters use Ray's other exporter: conftest.py), reporting every
# second, not Ray's 10 s, so the scrape comes sooner: it sets the run's
# gauges as a run would, says its node's metrics port, and holds them until
# its stdin closes.
DEFAULT_PATH_DRIVER = """
import sys
from types import SimpleNamespace
import ray
from ray_elastic.callbacks import Phase, RunStatus
from ray_elastic.cluster.local_cluster import LocalCluster
from ray_elastic.observe.metrics import MetricsCallback
cluster = LocalCluster(num_nodes=0, dashboard=False, log_monitor=False)
try:
    cluster.connect()
    me = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == me)
    metrics = MetricsCallback(sys.argv[1], refresh_s=0.5)
    metrics.on_start(SimpleNamespace(steps=7))
    metrics.on_state(RunStatus(Phase.TRAINING, 1.0, 0, 1))
    metrics.on_step(3, {"loss": 1.5, "slices": 1, "step_s": 0.25})
    print("PORT", node["MetricsExportPort"], flush=True)
    sys.stdin.read()
    metrics.close()
finally:
    cluster.shutdown()
"""


@pytest.mark.cluster
def test_metrics_reach_prometheus_on_ray_s_default_exporter(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_enable_open_telemetry", "RAY_ADDRESS", "RAY_metrics_report_interval_ms")}
    env["RAY_metrics_report_interval_ms"] = "1000"
    run = f"test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", DEFAULT_PATH_DRIVER, run], env=env, cwd=str(tmp_path),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("PORT "):
                break
        assert lines and lines[-1].startswith("PORT "), "".join(lines)[-3000:]
        port = int(lines[-1].split()[1])
        ok, last = _wait_for_series(port, run, {
            ("ray_elastic_step",): 3.0,
            ("ray_elastic_steps_requested",): 7.0,
            ("ray_elastic_state", ("state", "training")): 1.0,
            ("ray_elastic_loss",): 1.5,
            ("ray_elastic_live_slices",): 1.0,
        }, SCRAPE_TIMEOUT_S)
        assert ok, f"the run's series did not reach the endpoint in {SCRAPE_TIMEOUT_S} s: {last}"
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stdout.read()[-3000:]


def test_every_phase_has_a_state_code():
    """The gauge's states are the controller's phases, and the first six
    keep their codes (dashboards read them)."""
    assert set(STATES) == {p.value for p in Phase}
    assert STATES[:6] == ("starting", "training", "waiting", "recovering", "done", "failed")
