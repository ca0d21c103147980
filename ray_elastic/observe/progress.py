"""Progress of a run for a person watching it.

    trainer = ElasticTrainer(..., callbacks=[ProgressCallback(steps)])

In a terminal (`stream.isatty()`), one live line, redrawn in place:

    step 120/400 [######............]  30%  loss 3.2145  slices 2/2  0.21 s/step  eta 59 s

and, while the run waits for a replacement, `waiting 12 s for slice 1
(timeout 120 s)`, counted up once a second by a small daemon thread (the
hooks fire only on events and steps), which stops at `on_end`. Failures,
recoveries and the summary are printed as lines of their own above it.

Anywhere else (a log file, `ray job logs`), it stays quiet except for the
lines that matter: a failure detected, a wait for a replacement, the
recovery, a failed run, and the final summary.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Optional, TextIO

from ray_elastic.callbacks import CONTROLLER_STEP_KEYS, Callback, Phase, RunStatus

__all__ = ["ProgressCallback", "step_line"]

_CLEAR = "\r\x1b[K"


def _fmt_s(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


# How many of the program's own metrics the live line shows.
SHOWN_METRICS = 3


def step_line(step: int, total: int, metrics: dict) -> str:
    """A completed step as one log line: loss, the program's metrics (and
    evals) by name, live slices."""
    named = "".join(f"  {k} {_num(v, '.4g')}" for k, v in metrics.items()
                    if k not in CONTROLLER_STEP_KEYS and isinstance(v, (int, float)))
    return f"step {step:5d}/{total}  loss {_num(metrics['loss'], '.4f')}{named}  slices {metrics['slices']}"


class ProgressCallback(Callback):
    """total_steps: the run's steps. stream: where to write (stderr).
    events: in a terminal, "important" prints failures and recoveries as
        lines of their own, "all" prints every timeline event.
    refresh_s: how often the terminal line is redrawn between hooks.
    """

    def __init__(
        self,
        total_steps: int,
        stream: Optional[TextIO] = None,
        events: str = "important",
        refresh_s: float = 1.0,
        width: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        if events not in ("important", "all"):
            raise ValueError(f"ProgressCallback events: 'important' or 'all', got {events!r}")
        self.total = int(total_steps)
        self.stream = stream if stream is not None else sys.stderr
        self.events = events
        self.refresh_s = refresh_s
        self.width = width
        self._clock = clock
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.tty = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._line_shown = False
        # What the live line shows.
        self._step = 0
        self._loss: Optional[float] = None
        self._named: dict = {}  # the program's metrics (and evals) of the last step that had them
        self._slices: Optional[int] = None
        self._spares = 0  # hot spares ready
        self._num_slices: Optional[int] = None
        self._step_s: Optional[float] = None
        self._recent: list[float] = []  # recent step times, for the ETA
        self._mode = Phase.STARTING  # as the controller last announced (on_state)
        self._since: float = self._clock()  # when the current mode began
        self._wait_deadline_s: Optional[float] = None
        self._pending: list[int] = []  # slices being replaced
        self._synced_bytes = 0  # DiLoCo's deltas that crossed slices, every synchronization's
        self._note = ""  # last unusual event, shown on the line

    # -- hooks --------------------------------------------------------------------

    def on_start(self, trainer: Any) -> None:
        config = getattr(trainer, "config", None)
        self._num_slices = getattr(config, "num_slices", None)
        self._set_mode(Phase.STARTING)
        if self.tty:
            self._draw()
            self._stop.clear()
            self._thread = threading.Thread(target=self._refresh_loop, name="ray_elastic-progress", daemon=True)
            self._thread.start()

    def on_event(self, e: dict) -> None:
        name = e.get("event", "?")
        t = e.get("t", 0.0)
        lines: list[str] = []
        important = False
        with self._lock:
            if name in ("start", "grow", "shrink") and isinstance(e.get("slices"), list):
                self._slices = len(e["slices"])
            if isinstance(e.get("spares"), list):
                self._spares = len(e["spares"])
            if name == "detected":
                important = True
                self._slices = max(0, (self._slices or 1) - 1)
                lines.append(
                    f"[{t:8.2f} s] slice {e.get('slice')} failed ({e.get('kind')}) at step {e.get('step')}, "
                    f"detected in {_num(e.get('detected_s'), '.2f')} s"
                )
            elif name == "replace":
                s = e.get("slice")
                if s not in self._pending:
                    self._pending.append(s)
            elif name == "wait":
                important = True
                lines.append(
                    f"[{t:8.2f} s] waiting for a replacement of slice {self._pending_text()} "
                    f"(up to {_num(e.get('deadline_s'), '.0f')} s)"
                )
            elif name == "shrink":
                important = True
                lines.append(f"[{t:8.2f} s] training on {self._slices} slice(s) while slice {self._pending_text()} is replaced")
            elif name == "grow":
                joined = e.get("joined") or []
                self._pending = [s for s in self._pending if s not in joined]
                important = True
                lines.append(f"[{t:8.2f} s] slice(s) {', '.join(map(str, joined))} joined at step {e.get('step')}: {self._slices} live")
            elif name == "diverged":
                important = True
                named = ", ".join(f"slice {s} host {h}" for s, h in e.get("named") or []) or "no slice could be named"
                lines.append(f"[{t:8.2f} s] the replicas' states differ at step {e.get('step')} ({named}): "
                             f"rolling back to a snapshot of step {e.get('verified')} or before")
            elif name == "tie_break":
                important = True
                named = ", ".join(f"slice {s} host {h}" for s, h in e.get("named") or []) or "neither told apart"
                how = ("no verified snapshot to replay from" if e.get("by") is None else
                       f"{'the spare' if e.get('by') == 'spare' else 'each slice'} replayed it from step "
                       f"{e.get('replayed_from')} in {_num(e.get('seconds'), '.1f')} s: {named}")
                lines.append(f"[{t:8.2f} s] two replicas differ at step {e.get('step')}: {how}")
            elif name == "straggler":
                important = True
                what = {"swap": "swapping it for a spare", "remove": "training on without it"}.get(
                    e.get("action"), "reported only (no spare to swap it for)")
                lines.append(f"[{t:8.2f} s] slice {e.get('slice')} is a straggler ({_num(e.get('ratio'), '.2f')}x the "
                             f"others' time for {e.get('steps')} steps): {what}")
            elif name == "diloco_sync":
                important = True
                self._synced_bytes += int(e.get("bytes_across_slices") or 0)
                lost = f", replica(s) {e['lost']} left this round" if e.get("lost") else ""
                frag = f" fragment {e['fragment']}" if e.get("fragment") is not None else ""
                lines.append(f"[{t:8.2f} s] step {e.get('step')}: DiLoCo replicas {e.get('replicas')} synchronized{frag}, "
                             f"{_mb(e.get('bytes_across_slices'))} across slices ({_mb(self._synced_bytes)} in all){lost}")
            elif name == "diloco_sync_undone":
                important = True
                lines.append(f"[{t:8.2f} s] a synchronization cut short by the failure was taken back on "
                             f"{e.get('hosts')} host(s): the round from step {e.get('step')} ends again with every replica")
            elif name == "diloco_caught_up":
                important = True
                lines.append(f"[{t:8.2f} s] slice {e.get('slice')} took replica {e.get('replica')}'s place and "
                             f"recomputed its {e.get('steps')} inner step(s) of the round")
            elif name == "rewind":
                important = True
                self._step = int(e.get("to_step", self._step))
                lines.append(f"[{t:8.2f} s] rewound from step {e.get('from_step')} to {e.get('to_step')}")
            elif name == "recovered":
                important = True
                lines.append(
                    f"[{t:8.2f} s] recovered: step {e.get('step')} done {_num(e.get('recovered_s'), '.2f')} s "
                    f"after the fault, on {self._slices} slice(s)"
                )
            elif name not in ("reserve", "slice_ready", "fault", "end"):
                self._note = name.replace("_", " ") + (f" (step {e['step']})" if "step" in e else "")
            if self.tty and self.events == "all" and not important:
                fields = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event"))
                lines.append(f"[{t:8.2f} s] {name}" + (f": {fields}" if fields else ""))
            if lines and (self.tty or important):
                self._print(lines)
            elif self.tty:
                self._draw()

    def on_state(self, status: RunStatus) -> None:
        with self._lock:
            if status.phase != self._mode:
                self._set_mode(status.phase)
            self._wait_deadline_s = status.deadline_s
            if status.phase != Phase.STARTING:  # none are live yet: the line shows no count
                self._slices = status.live_slices
            if self.tty:
                self._draw()

    def on_step(self, step: int, metrics: dict) -> None:
        with self._lock:
            self._step = step
            self._loss = metrics.get("loss")
            self._named.update({k: v for k, v in metrics.items() if k not in CONTROLLER_STEP_KEYS
                                and isinstance(v, (int, float)) and not isinstance(v, bool)})
            self._slices = metrics.get("slices", self._slices)
            self._step_s = metrics.get("step_s")
            if isinstance(self._step_s, (int, float)):
                self._recent = (self._recent + [float(self._step_s)])[-20:]
            if self.tty:
                self._draw()

    def on_end(self, report: Any) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        with self._lock:
            self._mode = Phase.DONE
            done = getattr(report, "steps_completed", self._step)
            req = getattr(report, "steps_requested", self.total)
            error = getattr(report, "error", "")
            failures = getattr(report, "failures", []) or []
            loss = getattr(report, "final_loss", self._loss)
            lines = []
            if error:
                lines.append(f"run failed at step {done}/{req}: {error}")
            recs = [getattr(f, "recovered_s", None) for f in failures]
            recs = [r for r in recs if isinstance(r, (int, float))]
            lines.append(
                f"done: {done}/{req} steps, final loss {_num(loss, '.4f')}, "
                f"{len(failures)} failure(s)"
                + (f" (recovered in {', '.join(f'{r:.1f}' for r in recs)} s)" if recs else "")
                + f", wall {_num(getattr(report, 'wall_s', None), '.1f')} s, goodput {_num(getattr(report, 'goodput', None), '.2f')}"
            )
            self._print(lines, redraw=False)

    def message(self, text: str) -> None:
        """Print a line of one's own (above the live line in a terminal)."""
        with self._lock:
            self._print([text], redraw=self.tty and self._mode not in (Phase.DONE, Phase.FAILED))

    # -- drawing ---------------------------------------------------------------------

    def _set_mode(self, mode: Phase) -> None:
        self._mode = mode
        self._since = self._clock()
        if mode != Phase.WAITING:
            self._wait_deadline_s = None

    def _pending_text(self) -> str:
        return ", ".join(str(s) for s in self._pending) or "?"

    def status_line(self) -> str:
        """The live line's text (no control characters)."""
        with self._lock:
            now = self._clock()
            total = max(self.total, 1)
            frac = min(1.0, self._step / total)
            filled = int(round(frac * self.width))
            parts = [f"step {self._step}/{self.total} [{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:3.0f}%"]
            if self._mode == Phase.STARTING:
                parts.append(f"starting {_fmt_s(now - self._since)}")
            if self._loss is not None:
                parts.append(f"loss {_num(self._loss, '.4f')}")
            # The first few of the program's metrics: the line must fit a terminal.
            parts += [f"{name} {_num(v, '.4g')}" for name, v in list(self._named.items())[:SHOWN_METRICS]]
            if self._slices is not None:
                parts.append(f"slices {self._slices}" + (f"/{self._num_slices}" if self._num_slices else "")
                             + (f" +{self._spares} spare" if self._spares else ""))
            if self._mode == Phase.WAITING:
                text = f"waiting {_fmt_s(now - self._since)} for slice {self._pending_text()}"
                if isinstance(self._wait_deadline_s, (int, float)):
                    text += f" (timeout {_fmt_s(self._wait_deadline_s)})"
                parts.append(text)
            elif self._mode == Phase.STOPPING:
                parts.append(f"stopping {_fmt_s(now - self._since)}")
            elif self._mode == Phase.RECOVERING:
                parts.append(f"recovering {_fmt_s(now - self._since)}")
            else:
                if self._step_s is not None:
                    parts.append(f"{self._step_s:.2f} s/step")
                if self._recent and self._mode == Phase.TRAINING and self._step < self.total:
                    avg = sum(self._recent) / len(self._recent)
                    parts.append(f"eta {_fmt_s(avg * (self.total - self._step))}")
            if self._note:
                parts.append("last: " + self._note)
            return "  ".join(parts)

    def _draw(self) -> None:
        with self._lock:
            try:
                self.stream.write(_CLEAR + self.status_line())
                self.stream.flush()
            except (OSError, ValueError):  # a closed stream must not stop training
                return
            self._line_shown = True

    def _print(self, lines: list[str], redraw: bool = True) -> None:
        with self._lock:
            try:
                if self.tty and self._line_shown:
                    self.stream.write(_CLEAR)
                    self._line_shown = False
                for line in lines:
                    self.stream.write(line + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                return
            if self.tty and redraw:
                self._draw()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            with self._lock:
                if self._stop.is_set():
                    return
                self._draw()


def _mb(n) -> str:
    return f"{(n or 0) / 1e6:.2f} MB"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"
