"""A run's timeline as JSON lines, written as it happens.

    trainer = ElasticTrainer(..., callbacks=[EventLog("run.events.jsonl")])
    records = read_events("run.events.jsonl")

Every line is one JSON object with "t" (seconds since the run started, the
clock of the controller's events) and "event" (its name):

- `{"event": "run", ...}` first: policy, num_slices, steps, pid, wall-clock
  start time (`time_unix`);
- every timeline event of the controller, as it gave it (reserve, start,
  fault, detected, replace, shrink, wait, grow, rewind, recovered, end, and
  any later ones such as checkpoint events, and `kept_before_error` when a
  non-finite loss ends the run and the state before it is kept);
- `{"event": "step", "step", "loss", ..., "slices", "step_s"}` (with the
  program's aux metrics and evals by name) after completed
  steps (every `every`-th step, and always the first step after any other
  event and the last one), so step against time can be plotted;
- `{"event": "summary", ...}` last: steps completed, final loss, wall and
  productive time, goodput, failures, error.

Each line is flushed when written, so a driver that dies mid-run leaves a
readable file up to its last line; `read_events` skips a cut-off last line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Callable, Optional

from ray_elastic.callbacks import Callback
from ray_elastic.errors import EventsFileError

__all__ = ["EventLog", "read_events"]

log = logging.getLogger("ray_elastic")




def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None  # NaN / inf are not JSON
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in (sorted(x) if isinstance(x, (set, frozenset)) else x)]
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, float):
        return x
    try:  # numpy scalars and the like
        return _jsonable(x.item())
    except Exception:
        return str(x)


class EventLog(Callback):
    """Write the run's events and steps to `path` as JSON lines.

    every: write a step record every `every` steps (1: all of them); the
        first step after any other event and the last step are always written.
    append: add to an existing file instead of starting it afresh.
    fsync: also fsync each non-step line (survives a machine crash, not only
        a process crash).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        every: int = 1,
        append: bool = False,
        fsync: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"EventLog every: must be a positive integer, got {every!r}")
        self.path = os.fspath(path)
        self.every = every
        self.append = append
        self.fsync = fsync
        self._clock = clock
        self._f = None
        self._base: Optional[float] = None  # clock value at the run's t = 0
        self._steps_requested: Optional[int] = None
        self._force_step = True
        self._broken = False

    # -- hooks ------------------------------------------------------------------

    def on_start(self, trainer: Any) -> None:
        try:
            parent = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(parent, exist_ok=True)
            self._f = open(self.path, "a" if self.append else "w", encoding="utf-8")
        except OSError as e:
            self._broken = True
            log.warning("EventLog: cannot open %s (%s); no events will be written", self.path, e)
            return
        self._base = self._clock()
        self._force_step = True
        config = getattr(trainer, "config", None)
        self._steps_requested = getattr(trainer, "steps", None)
        self._write(
            {
                "t": 0.0,
                "event": "run",
                "policy": getattr(config, "policy", None),
                "num_slices": getattr(config, "num_slices", None),
                "min_slices": getattr(config, "required_slices", None),
                "steps": self._steps_requested,
                "pid": os.getpid(),
                "time_unix": round(time.time(), 3),
            },
            sync=True,
        )

    def on_event(self, event: dict) -> None:
        t = event.get("t")
        if isinstance(t, (int, float)):
            # Keep our clock on the controller's: it stamps an event just
            # before handing it to the callbacks.
            self._base = self._clock() - float(t)
        self._force_step = True
        self._write(dict(event), sync=True)

    def on_step(self, step: int, metrics: dict) -> None:
        last = self._steps_requested is not None and step >= self._steps_requested
        if not (self._force_step or last or step % self.every == 0):
            return
        self._force_step = False
        self._write({"t": round(self._now(), 4), "event": "step", "step": step, **metrics})

    def on_end(self, report: Any) -> None:
        if report is not None:
            self._write(
                {
                    "t": round(float(getattr(report, "wall_s", self._now())), 4),
                    "event": "summary",
                    "steps_requested": getattr(report, "steps_requested", None),
                    "steps_completed": getattr(report, "steps_completed", None),
                    "final_loss": getattr(report, "final_loss", None),
                    "wall_s": getattr(report, "wall_s", None),
                    "productive_s": getattr(report, "productive_s", None),
                    "goodput": getattr(report, "goodput", None),
                    "failures": [_asdict(f) for f in getattr(report, "failures", [])],
                    "error": getattr(report, "error", ""),
                },
                sync=True,
            )
        self.close()

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None

    # -- plumbing ----------------------------------------------------------------

    def _now(self) -> float:
        return self._clock() - self._base if self._base is not None else 0.0

    def _write(self, record: dict, sync: bool = False) -> None:
        if self._f is None or self._broken:
            return
        try:
            self._f.write(json.dumps(_jsonable(record), separators=(",", ":")) + "\n")
            self._f.flush()
            if sync and self.fsync:
                os.fsync(self._f.fileno())
        except (OSError, TypeError, ValueError) as e:  # never take the run down
            self._broken = True
            log.warning("EventLog: writing %s failed (%s); no more events will be written", self.path, e)


def _asdict(x: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    return x


def read_events(path: str | os.PathLike) -> list[dict]:
    """The records of an events file, in order. A cut-off last line (the
    writer died mid-line) is skipped; any other bad line raises
    `EventsFileError` naming the file and line."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise EventsFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise EventsFileError(f"{path}: is a directory, not an events file") from None
    except UnicodeDecodeError:
        raise EventsFileError(f"{path}: not a text file (expected JSON lines)") from None
    records = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if records and i == last and i == len(lines) - 1:  # no newline after it: cut off
                log.warning("%s: skipping a cut-off last line", path)
                break
            raise EventsFileError(f"{path}, line {i + 1}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "event" not in rec:
            raise EventsFileError(f"{path}, line {i + 1}: not an event record (a JSON object with an \"event\" field)")
        records.append(rec)
    return records
