"""End to end the way users run it: a Ray cluster started with `ray start`,
the training script submitted with `ray job submit`.

The cluster is real and multi-node, on this one machine: a head node with no
CPUs (only the job's driver, the single controller, lives there) and two
worker nodes of one CPU each, every node a `ray start --block` process in its
own process group, on ports of its own and under a temp dir of its own, so it
neither meets nor stops any other Ray cluster running here. The job is
`examples/train_lm.py` with the repository as its working_dir.

Two ways to fail a slice mid-run, both in one job (-m slow):
- from inside the job: `--fault kill:0:300` makes the driver SIGKILL the
  worker process of slice 0 at step 300;
- from outside, as a crash would: the test finds slice 1's worker through
  the state API (class SliceWorker, placement group `...-slice1`) and sends
  it SIGKILL while the job trains.

The job must succeed, and its logs must show each failure detected and
recovered, with every requested step done.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_WORKER_NODES = 2
OBJECT_STORE_BYTES = 200 * 1024 * 1024
WORKER_PORTS_PER_NODE = 100
# The `ray` command of the environment running the tests.
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
if not os.path.exists(RAY):
    RAY = shutil.which("ray") or "ray"


class _Ports:
    """Ports for the test cluster, handed out from a block between Ray's
    default worker ports (10002-19999) and the kernel's ephemeral range
    (32768 up), from a random start. Every port Ray or gRPC picks "at random"
    comes from the ephemeral range, so a port probed free there could be
    taken by another cluster before ours binds it; here nothing else looks.
    Each port is still checked to be free on every address."""

    LOW, HIGH = 20000, 32768

    def __init__(self):
        self._next = random.randrange(self.LOW, self.HIGH - 2000)

    @staticmethod
    def _free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return True
            except OSError:
                return False

    def take(self, n: int = 1) -> int:
        """The first of n consecutive free ports."""
        while True:
            first = self._next
            self._next += n
            assert self._next <= self.HIGH, "no free ports left in the block"
            if all(self._free(p) for p in range(first, first + n)):
                return first


def _env(temp_dir: str) -> dict:
    """The environment of every `ray` command run against the test cluster:
    never another cluster's address, and token authentication (Ray's default
    once a token exists) with a token of this cluster's own."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = os.path.join(temp_dir, "auth_token")
    return env


def _node_ports(ports: _Ports) -> list[str]:
    """The ports of one node: all explicit, none shared with another node."""
    low = ports.take(WORKER_PORTS_PER_NODE)
    return [
        f"--node-manager-port={ports.take()}",
        f"--object-manager-port={ports.take()}",
        f"--dashboard-agent-listen-port={ports.take()}",
        f"--dashboard-agent-grpc-port={ports.take()}",
        f"--runtime-env-agent-port={ports.take()}",
        f"--metrics-export-port={ports.take()}",
        f"--min-worker-port={low}",
        f"--max-worker-port={low + WORKER_PORTS_PER_NODE - 1}",
    ]


def _pids_using(temp_dir: str) -> list[int]:
    """Processes whose command line or working directory is under our temp
    dir: every Ray process of our cluster (they carry its session dir), and
    the job's driver (its cwd is the unpacked working_dir there)."""
    mine = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:  # gone, or not ours to read
            continue
        if temp_dir in cmdline or cwd.startswith(temp_dir):
            mine.append(int(entry))
    return mine


class RayStartCluster:
    """A head and worker nodes started with `ray start --block`."""

    def __init__(self, temp_dir: str):
        self.temp_dir = temp_dir
        self.env = _env(temp_dir)
        token = secrets.token_hex(32)
        with open(self.env["RAY_AUTH_TOKEN_PATH"], "w") as f:
            f.write(token)
        # For the clients in this process, which must not read or cache any
        # token (Ray's loader is process-wide): pass the header explicitly.
        self.headers = {"Authorization": f"Bearer {token}"}
        self.ports = _Ports()
        self.gcs_port = self.ports.take()
        self.dashboard_port = self.ports.take()
        self.gcs_address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.procs: list[subprocess.Popen] = []

    def ray(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run the `ray` command line against this cluster."""
        return subprocess.run(
            [RAY, *args], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        )

    def jobs(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard_url, headers=self.headers)

    def state(self):
        from ray.util.state import StateApiClient

        return StateApiClient(self.dashboard_url, headers=self.headers)

    def _start(self, name: str, args: list[str]) -> None:
        log = open(os.path.join(self.temp_dir, f"{name}.log"), "w")
        # A temp dir per node, as on separate machines: nodes on one machine
        # sharing one would race for the same socket names.
        cmd = [RAY, "start", "--block", "--disable-usage-stats", f"--temp-dir={self.temp_dir}/{name}",
               f"--object-store-memory={OBJECT_STORE_BYTES}", *args]
        # start_new_session: each node is its own process group, so it can
        # be stopped as a whole, and a ^C in pytest reaches none of them.
        self.procs.append(subprocess.Popen(
            cmd, env=self.env, cwd=self.temp_dir, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        ))
        log.close()

    def start(self) -> None:
        self._start("head", [
            "--head", f"--port={self.gcs_port}", "--num-cpus=0",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={self.ports.take()}",
            *_node_ports(self.ports),
        ])
        self._wait("the dashboard", lambda: self.jobs().list_jobs() is not None, timeout=120)
        for i in range(1, NUM_WORKER_NODES + 1):
            self._start(f"worker{i}", [
                f"--address={self.gcs_address}", "--num-cpus=1",
                *_node_ports(self.ports),
            ])
        self._wait(f"{NUM_WORKER_NODES + 1} alive nodes", lambda: self._alive_nodes() == NUM_WORKER_NODES + 1,
                   timeout=120)

    def _alive_nodes(self) -> int:
        from ray.util.state.common import ListApiOptions, StateResource

        nodes = self.state().list(
            StateResource.NODES, options=ListApiOptions(filters=[("state", "=", "ALIVE")]),
            raise_on_missing_output=False,
        )
        return len(nodes)

    def _wait(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"`{' '.join(p.args[:4])}` exited with {p.returncode}:\n{self.logs()}")
            try:
                if ready():
                    return
            except Exception as e:  # not up yet
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout} s (last error: {last!r}):\n{self.logs()}")
            time.sleep(1)

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.temp_dir)):
            if name.endswith(".log"):  # what each `ray start` printed
                with open(os.path.join(self.temp_dir, name), errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(out)

    def stop(self, grace_s: float = 3.0) -> list[int]:
        """Stop every node (workers first), then anything of ours left
        (SIGTERM, then SIGKILL after grace_s: Ray's graceful stop took all
        of 10 s here, for a cluster the test throws away).
        Returns the pids still alive afterwards (should be none)."""
        for p in reversed(self.procs):  # SIGTERM: `ray start --block` stops its processes
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # the whole group, whether or not its leader is gone
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        # Core workers and the job's driver may sit outside those groups.
        deadline = time.monotonic() + 20
        while (left := _pids_using(self.temp_dir)) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        return _pids_using(self.temp_dir)


@pytest.fixture(scope="module")
def ray_cluster():
    # A short folder of our own: Ray's socket paths must stay under 108
    # bytes, and everything of this cluster (sessions, logs, sockets) is in it.
    # A second try on a fresh cluster: on a loaded machine a `ray start`
    # worker can miss Ray's fixed 30 s for its raylet to register.
    for attempt in (1, 2):
        temp_dir = tempfile.mkdtemp(prefix="re-job-", dir="/tmp")
        cluster = RayStartCluster(temp_dir)
        try:
            cluster.start()
            break
        except (RuntimeError, TimeoutError) as e:
            left = cluster.stop()
            shutil.rmtree(temp_dir, ignore_errors=True)
            assert not left, f"processes of the test cluster still alive: {left}"
            if attempt == 2:
                raise
            print(f"\ntest cluster did not start ({str(e).splitlines()[0]}); trying a fresh one")
    try:
        yield cluster
    finally:
        left = cluster.stop()
        if os.environ.get("RAY_ELASTIC_KEEP_TEST_DIRS"):  # to read the nodes' logs
            print(f"test cluster's folder kept: {temp_dir}")
        else:
            shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the test cluster still alive: {left}"


def _submit(cluster: RayStartCluster, *train_args: str) -> str:
    # The interpreter running the tests: the cluster's own, which has
    # ray_elastic installed; a user's entrypoint would say `python`.
    entrypoint = [sys.executable, "examples/train_lm.py", *train_args]
    out = cluster.ray("job", "submit", "--address", cluster.dashboard_url, "--working-dir", ROOT,
                      "--no-wait", "--", *entrypoint, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"raysubmit_\w+", out.stdout + out.stderr)
    assert found, out.stdout + out.stderr
    return found.group(0)


def _wait_for(cluster: RayStartCluster, job_id: str, timeout: float, until_line: str | None = None) -> str:
    """Follow the job's log stream until the job ends (or a line of its logs
    matches the regex `until_line`); return its status."""
    import asyncio

    client = cluster.jobs()
    pattern = re.compile(until_line, re.M) if until_line is not None else None

    async def follow() -> None:
        while True:
            # The stream starts at the log's first line and closes once the
            # job has ended; one cut short (the dashboard under load) is
            # followed anew.
            text = ""
            try:
                async for chunk in client.tail_job_logs(job_id):
                    text += chunk
                    if pattern is not None and pattern.search(text):
                        return
            except RuntimeError:
                pass
            if client.get_job_status(job_id).is_terminal():
                return
            await asyncio.sleep(1)

    try:
        asyncio.run(asyncio.wait_for(follow(), timeout))
    except TimeoutError:
        status = client.get_job_status(job_id)
        cluster.ray("job", "stop", "--address", cluster.dashboard_url, job_id, timeout=30)
        pytest.fail(f"job {job_id} still {status} after {timeout} s; logs:\n{_logs(cluster, job_id)[-5000:]}")
    return str(client.get_job_status(job_id).value)


def _logs(cluster: RayStartCluster, job_id: str) -> str:
    out = cluster.ray("job", "logs", "--address", cluster.dashboard_url, job_id, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _assert_trained_through(logs: str, steps: int, kills: dict[int, int | None]) -> None:
    """One process_died detected and recovered per slice of `kills` (slice:
    the step it was killed at, None where unknown); every step done."""
    detected = re.findall(r"^\[\s*[\d.]+ s\] detected (\{.*\})$", logs, re.M)
    assert len(detected) == len(kills), logs[-5000:]
    assert all('"kind": "process_died"' in d for d in detected), detected
    assert sorted(int(re.search(r'"slice": (\d+)', d).group(1)) for d in detected) == sorted(kills), detected
    for slice_id, at_step in kills.items():
        step = r"\d+" if at_step is None else str(at_step)
        assert re.search(rf"^recovered from process_died of slice {slice_id} at step {step} in [\d.]+ s$", logs,
                         re.M), logs[-5000:]
    assert re.search(rf"^done: {steps} steps, final loss [\d.]+, driver pid \d+$", logs, re.M), logs[-5000:]


def _assert_readiness_phases(logs: str) -> None:
    """Every slice_ready event's phases are durations >= 0; a worker
    process of its own reports its start, one started ahead (the warm
    pool's) its taking, `warm_process`."""
    import json

    ready = [json.loads(m) for m in re.findall(r"^\[\s*[\d.]+ s\] slice_ready (\{.*\})$", logs, re.M)]
    assert ready, logs[-5000:]
    for e in ready:
        phases = e["phases"]
        assert all(v >= 0 for v in phases.values()), e
        assert "process_start" in phases or "warm_process" in phases, e


def test_sharded_job_trains_in_its_layout(ray_cluster):
    """The job driver takes the demo's model and layout options: FSDP over
    the 2 XLA devices of each 1-host slice, the small model, a short run
    with no fault."""
    steps = 20
    job_id = _submit(ray_cluster, "--slices", "2", "--sharding", "fsdp", "--devices-per-host", "2",
                     "--model", "small", "--steps", str(steps), "--log-every", "10")
    status = _wait_for(ray_cluster, job_id, timeout=200)
    logs = _logs(ray_cluster, job_id)
    assert status == "SUCCEEDED", logs[-5000:]
    layout = "training the example LM, model small, layout fsdp (mesh data=1 x fsdp=2 x tensor=1 over 2 devices per slice)"
    assert re.search(rf"^{re.escape(layout)}$", logs, re.M), logs[-5000:]
    assert re.search(r"^\[\s*[\d.]+ s\] slice_ready ", logs, re.M), logs[-5000:]
    assert not re.search(r"^\[\s*[\d.]+ s\] detected ", logs, re.M), logs[-5000:]
    assert re.search(rf"^step +10/{steps}  loss [\d.]+  slices 2$", logs, re.M), logs[-5000:]
    assert re.search(rf"^done: {steps} steps, final loss [\d.]+, driver pid \d+$", logs, re.M), logs[-5000:]


def _slice_worker_pid(cluster: RayStartCluster, slice_id: int) -> int:
    """The pid of the live SliceWorker of a slice, found as an operator
    would with `ray list actors --detail` and `ray list placement-groups`:
    a slice's placement group is named `<run>-slice<N>`."""
    import json

    def listed(*args: str) -> list[dict]:
        out = cluster.ray("list", *args, "--address", cluster.dashboard_url, "--detail", "--format", "json")
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    groups = {g["placement_group_id"]: g["name"] for g in listed("placement-groups", "-f", "state=CREATED")}
    actors = listed("actors", "-f", "class_name=SliceWorker", "-f", "state=ALIVE")
    pids = [
        a["pid"] for a in actors
        if groups.get(a.get("placement_group_id"), "").endswith(f"-slice{slice_id}") and a.get("pid")
    ]
    assert len(pids) == 1, (groups, actors)
    return int(pids[0])


@pytest.mark.slow
def test_job_survives_an_injected_fault_and_a_worker_killed_from_outside(ray_cluster):
    """Both ways to fail a slice, in one job (one job's start, placement
    and end serve both): slice 1's worker SIGKILLed from outside, as a
    crash would, once 50 steps are logged, and slice 0's from inside the
    job by `--fault kill:0:200`. Each is detected and recovered, and the
    job succeeds with every step done."""
    steps = 260
    job_id = _submit(ray_cluster, "--slices", "2", "--policy", "resize", "--steps", str(steps),
                     "--fault", "kill:0:200")
    # Mid-run: 50 steps done, some 150 to go before the second kill, for
    # the first one's replacement to join (several seconds at least).
    # The step line right-aligns its step number (observe.progress.step_line).
    status = _wait_for(ray_cluster, job_id, timeout=150, until_line=rf"^step +50/{steps} ")
    assert status == "RUNNING", _logs(ray_cluster, job_id)[-5000:]
    os.kill(_slice_worker_pid(ray_cluster, 1), signal.SIGKILL)
    status = _wait_for(ray_cluster, job_id, timeout=200)
    logs = _logs(ray_cluster, job_id)
    assert status == "SUCCEEDED", logs[-5000:]
    _assert_trained_through(logs, steps, {1: None, 0: 200})
    _assert_readiness_phases(logs)
