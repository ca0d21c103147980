"""Run metrics in Ray's own metrics system (`ray.util.metrics`), so they show
in the Ray dashboard and on every node's Prometheus endpoint.

    trainer = ElasticTrainer(..., callbacks=[MetricsCallback("my-run")])

The callback runs in the driver; the driver's core worker hands the values to
the metrics agent of the driver's node, which serves them on that node's
`metrics_export_port` (`ray.nodes()[i]["MetricsExportPort"]`,
`http://<node>:<port>/metrics`). Ray pushes them every
`metrics_report_interval_ms` (10 s by default), so a scrape lags by up to that.

Ray puts `ray_` in front of every application metric, so the names below
(`elastic_*` in code) are scraped as `ray_elastic_*`:

| Prometheus name | type | tags | meaning |
|---|---|---|---|
| `ray_elastic_state` | gauge | run, state | 1 for the current state, 0 for the others |
| `ray_elastic_state_code` | gauge | run | the state as a number (`STATE_CODES`) |
| `ray_elastic_step` | gauge | run | steps completed in the kept state |
| `ray_elastic_steps_requested` | gauge | run | steps the run was asked for |
| `ray_elastic_loss` | gauge | run | loss of the last step |
| `ray_elastic_step_seconds` | gauge | run | duration of the last step |
| `ray_elastic_live_slices` | gauge | run | slices training now |
| `ray_elastic_spare_slices` | gauge | run | hot spares ready to take a failed slice's place |
| `ray_elastic_goodput` | gauge | run | time in kept steps / wall time so far |
| `ray_elastic_failures_total` | counter | run, kind | failures by kind (process_died, node_died, hung, preempted, corrupted, straggler) |
| `ray_elastic_rewound_steps_total` | counter | run | steps whose work was thrown away |
| `ray_elastic_events_total` | counter | run, event | every timeline event, by name (checkpoints too) |
| `ray_elastic_recovery_seconds` | histogram | run | fault -> next completed step, per failure |
| `ray_elastic_last_recovery_seconds` | gauge | run | the same, for the latest failure |
| `ray_elastic_snapshot_interval_steps` | gauge | run | steps between snapshots with two or more live slices, as last chosen |
| `ray_elastic_snapshot_seconds` | gauge | run | the last snapshot's cost on the step time (its steps over the median) |

Ray drops a gauge series that has not been set for two report intervals, so
a small daemon thread sets the gauges again every few seconds while the run
lives and for `linger_s` after it ends (so the final state, `done` or
`failed`, is scraped), then stops and lets the run's series age out.

A metrics error never stops training: it is logged once and the callback
goes quiet.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from ray_elastic.callbacks import CONTROLLER_STEP_KEYS, Callback, RunStatus

__all__ = ["MetricsCallback", "STATES", "STATE_CODES", "PROMETHEUS_PREFIX"]

log = logging.getLogger("ray_elastic")

# The controller's phases (callbacks.Phase); new ones go at the end, so a
# dashboard's codes keep their meaning.
STATES = ("starting", "training", "waiting", "recovering", "done", "failed", "stopping")
STATE_CODES = {s: i for i, s in enumerate(STATES)}
PROMETHEUS_PREFIX = "ray_"  # what Ray adds in front of application metrics

RECOVERY_BUCKETS_S = [0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800]

# One set of metric objects per process: several runs (callbacks) share them
# and tell their series apart by the `run` tag.
_METRICS: Optional[dict] = None
# Step metrics with gauges of their own; the others are the program's (elastic_train_metric).
OWN_STEP_KEYS = CONTROLLER_STEP_KEYS
_METRICS_LOCK = threading.Lock()


def _metrics() -> dict:
    global _METRICS
    with _METRICS_LOCK:
        if _METRICS is None:
            from ray.util.metrics import Counter, Gauge, Histogram

            run = ("run",)
            _METRICS = {
                "state": Gauge("elastic_state", "1 for the run's current state, 0 for the others", ("run", "state")),
                "state_code": Gauge(
                    "elastic_state_code",
                    "run state: " + ", ".join(f"{c}={s}" for s, c in STATE_CODES.items()),
                    run,
                ),
                "step": Gauge("elastic_step", "steps completed (in the kept state)", run),
                "steps_requested": Gauge("elastic_steps_requested", "steps the run was asked for", run),
                "loss": Gauge("elastic_loss", "loss of the last completed step", run),
                "train_metric": Gauge("elastic_train_metric", "the program's aux metrics (and evals) of the "
                                      "last step that reported them, by name", ("run", "name")),
                "step_seconds": Gauge("elastic_step_seconds", "duration of the last completed step", run),
                "live_slices": Gauge("elastic_live_slices", "slices training now", run),
                "spare_slices": Gauge("elastic_spare_slices", "hot spare slices ready to take a failed slice's place", run),
                "goodput": Gauge("elastic_goodput", "time in kept steps / wall time so far", run),
                "last_recovery": Gauge("elastic_last_recovery_seconds", "fault -> next completed step, latest failure", run),
                "snapshot_interval": Gauge("elastic_snapshot_interval_steps",
                                           "steps between snapshots with two or more live slices", run),
                "snapshot_seconds": Gauge("elastic_snapshot_seconds", "the last snapshot's cost on the step time", run),
                "failures": Counter("elastic_failures", "slice failures by kind", ("run", "kind")),
                "rewound": Counter("elastic_rewound_steps", "steps whose work was thrown away", run),
                "events": Counter("elastic_events", "timeline events by name", ("run", "event")),
                "recovery": Histogram(
                    "elastic_recovery_seconds", "fault -> next completed step, per failure",
                    boundaries=RECOVERY_BUCKETS_S, tag_keys=run,
                ),
            }
        return _METRICS


def _default_refresh_s() -> float:
    try:
        import ray

        interval_ms = ray._config.metrics_report_interval_ms()
    except Exception:
        interval_ms = 10_000
    # Ray exports at most once a second and forgets a gauge after two intervals.
    return max(0.5, min(5.0, max(interval_ms, 1000) / 2000.0))


class MetricsCallback(Callback):
    """Export a run's state, progress, failures and recovery times through
    `ray.util.metrics`. `run_name` is the `run` tag of every series.

    refresh_s: how often gauges are set again (default: half of Ray's report
        interval, at most 5 s). linger_s: how long they keep being set after
        the run ends.
    """

    def __init__(
        self,
        run_name: str,
        linger_s: float = 60.0,
        refresh_s: Optional[float] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run_name = str(run_name)
        self.linger_s = linger_s
        self.refresh_s = refresh_s
        self._clock = clock
        self._m: Optional[dict] = None
        self._lock = threading.Lock()
        self._gauges: dict[str, float] = {}  # metric key -> last value
        self._named: dict[str, float] = {}  # the program's metric name -> last value
        self._state = "starting"
        self._durations: list[float] = []  # of kept steps, by step index
        self._t_start: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._broken = False
        self._t_end: Optional[float] = None

    # -- hooks ----------------------------------------------------------------

    def on_start(self, trainer: Any) -> None:
        def start():
            self._t_start = self._clock()
            self._t_end = None
            self._durations = []
            self._m = _metrics()
            self._set_state("starting")
            steps = getattr(trainer, "steps", None)
            if steps is not None:
                self._set("steps_requested", steps)
            self._set("step", 0)
            self._set("live_slices", 0)
            self._set("goodput", 0.0)
            self._flush()
            self._stop.clear()
            self._thread = threading.Thread(target=self._refresh_loop, name=f"ray_elastic-metrics-{self.run_name}", daemon=True)
            self._thread.start()

        self._guard(start)

    def on_event(self, event: dict) -> None:
        self._guard(lambda: self._on_event(event))

    def on_state(self, status: RunStatus) -> None:
        self._guard(lambda: self._on_state(status))

    def on_step(self, step: int, metrics: dict) -> None:
        self._guard(lambda: self._on_step(step, metrics))

    def on_end(self, report: Any) -> None:
        self._guard(lambda: self._on_end(report))

    # -- what the hooks do ---------------------------------------------------------

    def _on_event(self, e: dict) -> None:
        if self._m is None:
            return
        name = str(e.get("event", "?"))
        self._m["events"].inc(1, tags={"run": self.run_name, "event": name})
        if name in ("start", "grow", "shrink") and isinstance(e.get("slices"), (list, tuple)):
            self._set("live_slices", len(e["slices"]))
        if isinstance(e.get("spares"), (list, tuple)):
            self._set("spare_slices", len(e["spares"]))
        if name == "detected":
            self._m["failures"].inc(1, tags={"run": self.run_name, "kind": str(e.get("kind", "unknown"))})
            self._set("live_slices", max(0, self._gauges.get("live_slices", 1) - 1))
        elif name == "rewind":
            dropped = int(e.get("from_step", 0)) - int(e.get("to_step", 0))
            if dropped > 0:
                self._m["rewound"].inc(dropped, tags={"run": self.run_name})
            to = int(e.get("to_step", len(self._durations)))
            del self._durations[to:]
            self._set("step", to)
        elif name == "snapshot":
            self._set("snapshot_interval", int(e.get("interval", 0)))
            self._set("snapshot_seconds", max(0.0, float(e.get("step_path_s", 0.0))))
        elif name == "recovered":
            rec = e.get("recovered_s")
            if isinstance(rec, (int, float)):
                self._m["recovery"].observe(float(rec), tags={"run": self.run_name})
                self._set("last_recovery", float(rec))
        self._flush()

    def _on_state(self, status: RunStatus) -> None:
        if self._m is None:
            return
        self._set_state(status.phase.value)
        self._flush()

    def _on_step(self, step: int, m: dict) -> None:
        if self._m is None:
            return
        step_s = float(m.get("step_s", 0.0))
        del self._durations[max(0, step - 1):]
        self._durations.append(step_s)
        self._set("step", step)
        self._set("step_seconds", step_s)
        if "loss" in m:
            self._set("loss", float(m["loss"]))
        if "slices" in m:
            self._set("live_slices", int(m["slices"]))
        with self._lock:
            self._named.update({k: float(v) for k, v in m.items() if k not in OWN_STEP_KEYS
                                and isinstance(v, (int, float)) and not isinstance(v, bool)})
        elapsed = self._clock() - (self._t_start or 0.0)
        if elapsed > 0:
            self._set("goodput", min(1.0, sum(self._durations) / elapsed))
        self._flush()

    def _on_end(self, report: Any) -> None:
        if self._m is None:
            return
        self._set("step", getattr(report, "steps_completed", self._gauges.get("step", 0)))
        if getattr(report, "wall_s", 0) > 0:
            self._set("goodput", float(report.goodput))
        self._flush()
        self._t_end = self._clock()

    # -- plumbing -------------------------------------------------------------------

    def _set(self, key: str, value: float) -> None:
        with self._lock:
            self._gauges[key] = float(value)

    def _set_state(self, state: str) -> None:
        self._state = state
        self._set("state_code", STATE_CODES[state])

    def _flush(self) -> None:
        """Set every gauge to its last value (also what keeps them alive)."""
        m = self._m
        if m is None:
            return
        tags = {"run": self.run_name}
        with self._lock:
            values = dict(self._gauges)
            state = self._state
            named = dict(self._named)
        for key, value in values.items():
            m[key].set(value, tags=tags)
        for name, value in named.items():
            m["train_metric"].set(value, tags={"run": self.run_name, "name": name})
        for s in STATES:
            m["state"].set(1.0 if s == state else 0.0, tags={"run": self.run_name, "state": s})

    def _refresh_loop(self) -> None:
        every = self.refresh_s if self.refresh_s is not None else _default_refresh_s()
        while not self._stop.wait(every):
            end = self._t_end
            if end is not None and self._clock() - end >= self.linger_s:
                return
            self._guard(self._flush)

    def close(self) -> None:
        """Stop refreshing now (the series then age out of Ray's exporter)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _guard(self, fn: Callable[[], None]) -> None:
        if self._broken:
            return
        try:
            fn()
        except Exception:  # metrics must never take a training run down
            self._broken = True
            log.warning("MetricsCallback(%r) disabled after an error", self.run_name, exc_info=True)
