"""Process memory for the benches, from /proc/<pid>/status (Linux).

The kernel keeps one peak, VmHWM, which counts shared pages too: for a Ray
worker, the object-store pages it touched while writing its snapshot or
reading another slice's gradients, which are the store's memory, not the
process's. `PeakSampler` samples the parts of the resident set (RssAnon:
private; RssShmem: shared, e.g. the object store) in a thread and keeps
each one's peak, so a worker's own memory and its share of the store can
be told apart, and compared with a plain JAX process that has no store.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def status(pid: int) -> dict:
    """VmHWM, VmRSS and VmRSS's parts of a process now, in bytes; {} if it
    is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in FIELDS:
                    out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class PeakSampler:
    """Peaks of VmRSS, RssAnon and RssShmem per process, sampled every
    `period_s` in a thread. `pids` is called on every round (the processes
    may not exist yet when sampling starts); a pid's peaks are kept after it
    exits."""

    def __init__(self, pids: Callable[[], Iterable[int]], period_s: float = 0.02):
        self._pids = pids
        self.period_s = period_s
        self.peaks: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-peak-sampler")

    def sample(self) -> None:
        try:
            pids = list(self._pids())
        except Exception:  # noqa: BLE001 (the trainer not ready yet: next round)
            return
        for pid in pids:
            now = status(pid)
            if not now:
                continue
            peak = self.peaks.setdefault(pid, {"samples": 0})
            peak["samples"] += 1
            for k in ("VmRSS", "RssAnon", "RssShmem"):
                peak[f"peak_{k}"] = max(peak.get(f"peak_{k}", 0), now.get(k, 0))
            peak["VmHWM"] = now.get("VmHWM", 0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def start(self) -> "PeakSampler":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peaks

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
