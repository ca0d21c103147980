"""Token authentication end to end, on a real head started the way the
shipped configs start one.

The head is `ray start --head` with RAY_AUTH_MODE=token and the token in
RAY_AUTH_TOKEN, as KubeRay's `authOptions.mode: token` gives every Ray
container (from its Secret), and with the health-check variables the shipped
manifests set on the head. It runs on ports of its own and under a temp dir
of its own, in its own process group, and is stopped by pid: never
`ray stop`, which would stop every other Ray cluster on this machine.

Every client runs as a user would run it, in a process of its own with an
environment of its own and a HOME of its own (so no ~/.ray/auth_token of
this machine is picked up):

- `ray job submit` with no token is refused (401), with a wrong token is
  refused (403), and nothing runs; with RAY_AUTH_MODE=token and the token
  (RAY_AUTH_TOKEN, or the file ~/.ray/auth_token) the job runs, and its
  entrypoint, a `ray.init()` driver like ray_elastic's trainer, connects to
  the cluster with the token the head passes on;
- the Python API: `JobSubmissionClient` with the `Authorization: Bearer`
  header, or with the environment alone;
- a driver outside the cluster (a notebook's `ray.init(address)`):
  connected with the token, refused without; Ray Client (`ray://`)
  refused without it;
- afterwards no file of the cluster (logs, events, job logs) and no client
  output holds the token.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "cluster-configs" / "raycluster-tpu-v6e.yaml"
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
if not os.path.exists(RAY):
    RAY = shutil.which("ray") or "ray"
# Greppable in every log and output, and like a real token (hex, 64 chars).
TOKEN = "7e57" + secrets.token_hex(30)
MARKER = "ray-elastic-auth-ok"
# The job's driver: connects to its cluster as ray_elastic's trainer does.
ENTRYPOINT = [sys.executable, "-c", f"import ray; ray.init(); print('{MARKER}', ray.get(ray.put(42)))"]


def _free_port_block(n: int) -> int:
    """The first of n consecutive free ports, from a random start between
    Ray's default worker ports and the kernel's ephemeral range (where
    nothing else picks ports at random)."""
    while True:
        first = random.randrange(20000, 32768 - n)
        ok = True
        for port in range(first, first + n):
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return first


def _pids_using(folder: str) -> list[int]:
    """Processes whose command line or working directory is under `folder`:
    every Ray process of the test head (they carry its session dir) and the
    job's driver (its cwd is the head's)."""
    mine = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if folder in cmdline or cwd.startswith(folder):
            mine.append(int(entry))
    return mine


def _base_env(home: str) -> dict:
    """The environment of a process of this test: none of this machine's
    Ray address or auth settings, a HOME of its own."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("RAY_AUTH", "RAY_health_check")) and k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    env.update(HOME=home, RAY_USAGE_STATS_ENABLED="0")
    return env


def _head_env_from_manifest() -> dict[str, str]:
    """The health-check variables the shipped manifests set on the head."""
    import yaml

    manifest = yaml.safe_load(MANIFEST.read_text())
    head = manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in head.get("env") or [] if "value" in e}
    assert any(k.startswith("RAY_health_check") for k in env), env
    return env


class TokenHead:
    def __init__(self):
        # Short: Ray's socket paths under it must stay below 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="re-auth-", dir="/tmp")
        self.homes = tempfile.mkdtemp(prefix="re-auth-homes-")  # clients' HOMEs, outside the cluster's folder
        # One block for the components and the workers: two blocks drawn
        # apart could overlap, which `ray start` refuses.
        first = _free_port_block(12 + 60)
        self.gcs_port, self.dashboard_port, self.client_port = first, first + 1, first + 2
        self.gcs = f"127.0.0.1:{self.gcs_port}"
        self.url = f"http://127.0.0.1:{self.dashboard_port}"
        self.workers = first + 12
        self.env = _base_env(self._home("head"))
        self.env.update(_head_env_from_manifest())
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)  # what KubeRay sets from its Secret
        self.proc: subprocess.Popen | None = None
        self.outputs: list[str] = []  # every client's stdout + stderr

    def _home(self, name: str) -> str:
        path = os.path.join(self.homes, name)
        os.makedirs(path, exist_ok=True)
        return path

    def start(self) -> None:
        p = self.gcs_port
        cmd = [
            RAY, "start", "--head", "--block", "--disable-usage-stats", f"--temp-dir={self.dir}/head",
            f"--port={p}", "--num-cpus=0", "--object-store-memory=100000000",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={self.client_port}",
            f"--node-manager-port={p + 3}", f"--object-manager-port={p + 4}",
            f"--dashboard-agent-listen-port={p + 5}", f"--dashboard-agent-grpc-port={p + 6}",
            f"--runtime-env-agent-port={p + 7}", f"--metrics-export-port={p + 8}",
            f"--min-worker-port={self.workers}", f"--max-worker-port={self.workers + 59}",
        ]
        with open(os.path.join(self.dir, "head.log"), "w") as log:
            self.proc = subprocess.Popen(
                cmd, env=self.env, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + 180
        last = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.log()}")
            try:
                JobSubmissionClient(self.url, headers=self.auth_header()).list_jobs()
                return
            except Exception as e:  # not up yet
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"no dashboard within 180 s ({last!r}):\n{self.log()}")
            time.sleep(1)

    def log(self) -> str:
        with open(os.path.join(self.dir, "head.log"), errors="replace") as f:
            return f.read()[-3000:]

    @staticmethod
    def auth_header() -> dict:
        return {"Authorization": f"Bearer {TOKEN}"}

    def client_env(self, how: str) -> dict:
        """A client's environment: `none` (no auth settings), `wrong` (token
        mode, another token), `env` (RAY_AUTH_TOKEN), `file` (the token in
        the client's ~/.ray/auth_token, as `ray get-auth-token --generate`
        leaves it)."""
        env = _base_env(self._home(f"client-{how}"))
        if how == "wrong":
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        elif how == "env":
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
        elif how == "file":
            token_file = Path(env["HOME"], ".ray", "auth_token")
            token_file.parent.mkdir(parents=True, exist_ok=True)
            token_file.write_text(TOKEN)
            env["RAY_AUTH_MODE"] = "token"
        else:
            assert how == "none", how
        return env

    def run(self, args: list[str], how: str, timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run(
            args, env=self.client_env(how), cwd=self.homes, capture_output=True, text=True, timeout=timeout,
        )
        self.outputs.append(out.stdout + out.stderr)
        return out

    def popen(self, args: list[str], how: str, extra_env: Optional[dict] = None) -> subprocess.Popen:
        return subprocess.Popen(
            args, env={**self.client_env(how), **(extra_env or {})}, cwd=self.homes, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )

    def collect(self, proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        self.outputs.append(out)
        return proc.returncode, out

    def stop(self) -> list[int]:
        """Stop the head (its process group, by pid) and anything of it left;
        the pids still alive afterwards (should be none)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:  # then SIGKILL: Ray's graceful stop used all of 15 s here
                    self.proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while (left := _pids_using(self.dir)) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        return _pids_using(self.dir)


@pytest.fixture(scope="module")
def head():
    h = TokenHead()
    try:
        h.start()
        yield h
    finally:
        left = h.stop()
        if os.environ.get("RAY_ELASTIC_KEEP_TEST_DIRS"):
            print(f"token head's folder kept: {h.dir}")
        else:
            shutil.rmtree(h.dir, ignore_errors=True)
        shutil.rmtree(h.homes, ignore_errors=True)
        assert not left, f"processes of the test head still alive: {left}"


def _submit(head: TokenHead, how: str) -> subprocess.CompletedProcess:
    return head.run([RAY, "job", "submit", "--address", head.url, "--", *ENTRYPOINT], how, timeout=180)


def _jobs(head: TokenHead) -> list:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head.url, headers=head.auth_header()).list_jobs()


def test_job_submit_is_refused_without_the_token(head):
    before = len(_jobs(head))
    out = _submit(head, "none")
    assert out.returncode != 0
    assert "Authentication required" in out.stderr and "Missing authentication token" in out.stderr, out.stderr[-2000:]
    out = _submit(head, "wrong")
    assert out.returncode != 0
    assert "Authentication failed" in out.stderr and "Invalid authentication token" in out.stderr, out.stderr[-2000:]
    assert len(_jobs(head)) == before, "a refused submission must not create a job"


@pytest.mark.parametrize("how", ["env", pytest.param("file", marks=pytest.mark.slow)])
def test_job_submit_runs_with_the_token(head, how):
    out = _submit(head, how)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert re.search(rf"^{MARKER} 42$", out.stdout, re.M), out.stdout[-3000:]
    assert re.search(r"Job 'raysubmit_\w+' succeeded", out.stdout + out.stderr), out.stdout[-2000:]


def test_python_job_client_with_the_token(head):
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobStatus, JobSubmissionClient

    # In this process, with the header; Ray's token loader is process-wide,
    # so this process never reads a token from its environment.
    with pytest.raises(AuthenticationError, match="Missing authentication token"):
        JobSubmissionClient(head.url).list_jobs()
    client = JobSubmissionClient(head.url, headers=head.auth_header())
    job_id = client.submit_job(entrypoint=shlex.join(ENTRYPOINT))
    deadline = time.monotonic() + 150
    while (status := client.get_job_status(job_id)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.monotonic() < deadline, f"job {job_id} still {status}"
        time.sleep(0.5)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED and f"{MARKER} 42" in logs, logs[-3000:]
    # In a process of its own, from the environment alone (RAY_AUTH_MODE +
    # RAY_AUTH_TOKEN), as a script or a RayJob's submitter would.
    code = (
        "from ray.job_submission import JobSubmissionClient; "
        f"print('jobs', len(JobSubmissionClient({head.url!r}).list_jobs()))"
    )
    out = head.run([sys.executable, "-c", code], "env")
    assert out.returncode == 0 and re.search(r"^jobs \d+$", out.stdout, re.M), (out.stdout + out.stderr)[-3000:]
    out = head.run([sys.executable, "-c", code], "none")
    assert out.returncode != 0 and "Missing authentication token" in out.stderr, (out.stdout + out.stderr)[-3000:]


def test_drivers_connect_only_with_the_token(head):
    """A driver outside the cluster (a notebook's `ray.init(address)`):
    connected with the token, from the environment or the token file, and
    refused without it. Ray Client (`ray://`) without the token is refused
    by the client server's authentication. Refused connections retry for
    seconds before they give up, so they run in the background while the
    others are checked. (Ray Client with the token is not run here: its
    per-client server is slow to start on a loaded machine.)"""
    driver = (
        "import json, ray; ray.init(address={address!r}); "
        "print('connected', json.dumps(sorted(ray.cluster_resources()))); ray.shutdown()"
    )
    to_gcs = [sys.executable, "-c", driver.format(address=head.gcs)]
    to_client = [sys.executable, "-c", driver.format(address=f"ray://127.0.0.1:{head.client_port}")]
    # Ray retries a refused connection for 20 s (GCS) and 30 s (Ray
    # Client) before it gives up: its own budgets, cut here to a few tries
    # (the refusal each try gets is the same).
    quick = {"RAY_gcs_server_port_wait_time_s": "3", "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1",
             "RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S": "1"}
    refused = {name: head.popen(cmd, "none", extra_env=quick) for name, cmd in (("gcs", to_gcs), ("ray client", to_client))}
    try:
        for how in ("env", "file"):
            out = head.run(to_gcs, how, timeout=150)
            assert out.returncode == 0 and "connected" in out.stdout, (out.stdout + out.stderr)[-3000:]
    finally:
        results = {name: head.collect(p, timeout=150) for name, p in refused.items()}
    rc, text = results["gcs"]
    assert rc != 0 and "connected" not in text, text[-3000:]
    assert "InvalidAuthToken" in text, text[-3000:]
    rc, text = results["ray client"]
    assert rc != 0 and "connected" not in text, text[-3000:]
    proxy_log = "".join(p.read_text(errors="replace") for p in Path(head.dir).rglob("ray_client_server.err"))
    assert "Authentication required but no authorization header provided" in proxy_log, proxy_log[-3000:]


def files_holding(needle: str, folder: str) -> tuple[list[str], list[str]]:
    """(files scanned, files holding `needle`) under `folder`: every regular
    file, read as bytes (sockets and links are skipped)."""
    scanned, found = [], []
    for path in Path(folder).rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        scanned.append(str(path))
        if needle.encode() in data:
            found.append(str(path))
    return scanned, found


def test_the_token_is_in_no_log_or_output(head):
    """Ray's logs, events and job logs of the head, and everything the
    clients printed: no token (it is only ever in the environment of the
    head and of the clients, and in a client's token file, outside that
    folder)."""
    _jobs(head)  # the head is still up: its logs are as complete as they get
    canary = Path(head.dir, "canary", "x.log")  # the scan does find a token
    canary.parent.mkdir()
    canary.write_text(f"...{TOKEN}...")
    assert files_holding(TOKEN, head.dir)[1] == [str(canary)]
    canary.unlink()
    scanned, found = files_holding(TOKEN, head.dir)
    names = {Path(s).name for s in scanned}
    assert any(n.startswith("job-driver-raysubmit_") for n in names), sorted(names)  # the jobs' own logs
    assert {"gcs_server.out", "raylet.out", "dashboard.log", "ray_client_server.err"} <= names, sorted(names)
    assert not found, f"the token appears in {found}"
    assert len(head.outputs) >= 8
    assert not [o for o in head.outputs if TOKEN in o], "a client printed the token"
