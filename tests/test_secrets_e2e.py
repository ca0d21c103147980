"""No secret in what a run leaves behind: a real ray_elastic run, on the
session's local multi-node cluster, with a worker killed mid-run and
checkpoints, with a cluster token and storage credentials in the
environment of every Ray process, as on a production cluster (KubeRay puts
RAY_AUTH_TOKEN in every Ray container; GOOGLE_APPLICATION_CREDENTIALS names
a key file).

The secrets are distinctive fake values: the token itself, and a private
key inside the credentials file (the file's path is not a secret; its
content is). The worker nodes are replaced by fresh ones started with them
in their environment, so the slice workers carry them too. Afterwards the
events file, the report JSON, the metrics (what MetricsCallback recorded,
and Ray's Prometheus endpoint of the driver's node) and every file of the
cluster's Ray session folder (logs, events, job and runtime-env files)
written during the run are scanned for both strings.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

STEPS = 12
FAULT_AT = 5
FAKE_TOKEN = "re-fake-token-" + secrets.token_hex(16)
FAKE_KEY = "re-fake-private-key-" + secrets.token_hex(16)
SCRAPE_TIMEOUT_S = 60.0  # Ray pushes metrics every 10 s by default


class _Recording:
    """Forwards to a real ray.util.metrics object, keeping every call."""

    def __init__(self, metric, calls: list):
        self._metric, self._calls = metric, calls

    def __getattr__(self, name):
        attr = getattr(self._metric, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._calls.append((name, repr(args), repr(kwargs)))
            return attr(*args, **kwargs)

        return call


def files_holding(needles: list[str], folder: str, since: float) -> tuple[list[str], dict[str, list[str]]]:
    """(files scanned, {needle: files holding it}) among the regular files
    under `folder` modified at or after `since`."""
    scanned, found = [], {n: [] for n in needles}
    for path in Path(folder).rglob("*"):
        try:
            if not path.is_file() or path.is_symlink() or path.stat().st_mtime < since:
                continue
            data = path.read_bytes()
        except OSError:
            continue
        scanned.append(str(path))
        for n in needles:
            if n.encode() in data:
                found[n].append(str(path))
    return scanned, found


def _environ(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read().decode(errors="replace")


def _raylet_pids(node) -> list[int]:
    from ray._private import ray_constants

    return [i.process.pid for i in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode(errors="replace")


def _driver_metrics_port() -> int:
    import ray

    me = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == me)
    return int(node.get("MetricsExportPort") or 0)


@pytest.fixture
def secret_env(cluster, nodes, monkeypatch, tmp_path):
    """The secrets in the environment of this process (the driver) and of
    two fresh worker nodes; afterwards the nodes are replaced by clean ones."""
    key_file = tmp_path / "fake-service-account.json"
    key_file.write_text(json.dumps({
        "type": "service_account",
        "client_email": "trainer@my-project.iam.gserviceaccount.com",
        "private_key": f"-----BEGIN PRIVATE KEY-----\n{FAKE_KEY}\n-----END PRIVATE KEY-----\n",
    }))
    monkeypatch.setenv("RAY_AUTH_TOKEN", FAKE_TOKEN)  # auth is off on this cluster: only a secret to keep
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    cluster.ensure_nodes(0, park=False)
    nodes(2)  # started now: their raylets, and every worker they start, inherit the environment
    for node in cluster.nodes.values():
        for pid in _raylet_pids(node):
            env = _environ(pid)
            assert FAKE_TOKEN in env and str(key_file) in env, "the fresh nodes do not carry the secrets"
    try:
        yield key_file
    finally:
        monkeypatch.undo()
        cluster.ensure_nodes(0, park=False)
        nodes(2)


def test_no_secret_in_events_report_metrics_or_logs(cluster, lm_factory, secret_env, tmp_path, monkeypatch):
    from ray_elastic import CheckpointConfig, ElasticConfig, ElasticTrainer, Fault
    from ray_elastic.observe import metrics as rm
    from ray_elastic.observe.events import EventLog
    from ray_elastic.observe.metrics import MetricsCallback

    since = time.time() - 1
    calls: list = []
    monkeypatch.setattr(rm, "_METRICS", {k: _Recording(m, calls) for k, m in rm._metrics().items()})
    run = f"secrets-{os.getpid()}"
    events_path, report_path = tmp_path / "events.jsonl", tmp_path / "report.json"
    metrics = MetricsCallback(run, linger_s=SCRAPE_TIMEOUT_S)
    trainer = ElasticTrainer(
        lm_factory,
        ElasticConfig(num_slices=2, policy="resize", min_slices=1, timeout_s=120.0),
        STEPS,
        faults=(Fault("kill", 1, FAULT_AT),),
        callbacks=[metrics, EventLog(events_path)],
        checkpoint=CheckpointConfig(str(tmp_path / "ckpt"), save_every=4, keep=2),
    )
    try:
        report = trainer.fit()
        report.write(str(report_path))
        assert report.steps_completed == STEPS and len(report.failures) == 1, report.to_dict()

        # Ray's Prometheus endpoint on the driver's node: the run's series once pushed.
        port, text = _driver_metrics_port(), ""
        deadline = time.monotonic() + SCRAPE_TIMEOUT_S
        while port and time.monotonic() < deadline:
            try:
                text = _scrape(port)
            except OSError:
                text = ""
            if f'run="{run}"' in text and "ray_elastic_step" in text:
                break
            time.sleep(1)
    finally:
        metrics.close()

    outputs = {
        "events": events_path.read_text(),
        "report": report_path.read_text(),
        "recorded metrics": "\n".join(map(repr, calls)),
    }
    kinds = {json.loads(line)["event"] for line in outputs["events"].splitlines() if line.strip()}
    assert {"detected", "recovered", "checkpoint_saved"} <= kinds, kinds  # the run went through a failure and saves
    assert calls and any(run in c[2] for c in calls), calls[:5]
    if f'run="{run}"' in text:
        outputs["prometheus"] = text
    else:  # the endpoint did not show the run: what was recorded stands for it
        print(f"metrics: the run's series were not on port {port} within {SCRAPE_TIMEOUT_S} s; scanned the recorded values")
    for name, content in outputs.items():
        for secret in (FAKE_TOKEN, FAKE_KEY):
            assert secret not in content, f"a secret appears in the {name}"

    session = os.path.dirname(cluster.logs_dir)
    canary = Path(session, "logs", f"re-canary-{os.getpid()}.log")  # the scan does find a secret
    canary.write_text(FAKE_TOKEN)
    try:
        assert files_holding([FAKE_TOKEN], session, since)[1][FAKE_TOKEN] == [str(canary)]
    finally:
        canary.unlink()
    scanned, found = files_holding([FAKE_TOKEN, FAKE_KEY], session, since)
    names = {Path(s).name for s in scanned}
    assert any(n.startswith("worker-") for n in names) and "raylet.out" in names, sorted(names)[:50]
    assert not any(found.values()), f"secrets in Ray's session folder: {found}"
