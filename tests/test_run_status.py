"""The run's state as the controller announces it (`Callback.on_state`):
the one model progress and metrics show. Driven through the real
controller over the fake cluster of test_controller.py, on a fake clock."""

from __future__ import annotations

import io

import pytest

from ray_elastic import ElasticConfig, ProgressCallback
from ray_elastic.control.controller import Controller, Seams
from ray_elastic.callbacks import Callback, Phase
from ray_elastic.errors import ConfigError, FailureKind, ReplacementTimeout

from test_controller import FakeBackend, FakeClock


class Recorder(Callback):
    def __init__(self):
        self.seen: list = []  # ("event", name) and ("state", RunStatus), in order

    def on_event(self, event):
        self.seen.append(("event", event["event"]))

    def on_state(self, status):
        self.seen.append(("state", status))

    def phases(self) -> list[Phase]:
        return [x.phase for kind, x in self.seen if kind == "state"]

    def state_after(self, event: str):
        i = self.seen.index(("event", event))
        return next(x for kind, x in self.seen[i + 1:] if kind == "state")


def fit(config, steps, fail_at=(), capacity=True, callbacks=()):
    clock = FakeClock()
    backend = FakeBackend(clock, config.num_slices)
    backend.fail_at.update(dict(fail_at))
    backend.capacity = capacity
    rec = Recorder()
    trainer = Controller(lambda: None, config, steps, callbacks=[rec, *callbacks], seams=Seams(clock=clock, backend=backend))
    return trainer, rec


def test_pause_announces_waiting_then_recovering_then_training():
    trainer, rec = fit(ElasticConfig(num_slices=2, policy="pause", timeout_s=60), 12, {(3, 1): FailureKind.NODE_DIED})
    trainer.fit()
    assert rec.phases() == [Phase.STARTING, Phase.TRAINING, Phase.RECOVERING, Phase.WAITING, Phase.RECOVERING,
                           Phase.TRAINING, Phase.DONE]
    detected = rec.state_after("detected")
    assert detected.phase == Phase.RECOVERING and detected.live_slices == 1  # from the moment it is known
    waiting = rec.state_after("wait")
    assert waiting.phase == Phase.WAITING and waiting.pending == (1,) and waiting.deadline_s == 60.0
    assert waiting.live_slices == 1 and waiting.step == 3
    grown = rec.state_after("grow")
    assert grown.phase == Phase.RECOVERING and grown.live_slices == 2 and grown.pending == (1,)
    # Training again once the failure is recovered, before that step's on_step.
    assert rec.state_after("recovered").phase == Phase.TRAINING


def test_resize_announces_recovering_on_fewer_slices():
    trainer, rec = fit(ElasticConfig(num_slices=2, policy="resize", min_slices=1), 40, {(5, 1): FailureKind.PROCESS_DIED})
    trainer.fit()
    assert Phase.WAITING not in rec.phases()
    detected = rec.state_after("detected")
    assert detected.phase == Phase.RECOVERING and detected.pending == (1,)
    assert rec.phases() == [Phase.STARTING, Phase.TRAINING, Phase.RECOVERING, Phase.TRAINING, Phase.DONE]
    assert rec.phases()[-1] == Phase.DONE


def test_a_failed_run_ends_failed_with_its_reason():
    trainer, rec = fit(ElasticConfig(num_slices=2, policy="pause", timeout_s=30), 20,
                       {(4, 1): FailureKind.NODE_DIED}, capacity=False)
    with pytest.raises(ReplacementTimeout):
        trainer.fit()
    last = rec.phases()[-1]
    end = [x for kind, x in rec.seen if kind == "state"][-1]
    assert last == Phase.FAILED and "timeout_s" in end.reason


def test_progress_shows_the_announced_state():
    """ProgressCallback's line follows the controller's state, not its own
    reading of events: it says "waiting" exactly while the run waits."""
    stream = io.StringIO()
    progress = ProgressCallback(12, stream=stream)
    lines_while_waiting = []

    class Peek(Callback):
        def on_state(self, status):
            lines_while_waiting.append((status.phase, progress.status_line()))

    trainer, rec = fit(ElasticConfig(num_slices=2, policy="pause", timeout_s=60), 12,
                       {(3, 1): FailureKind.NODE_DIED}, callbacks=[progress, Peek()])
    trainer.fit()
    for phase, line in lines_while_waiting:
        assert ("waiting" in line) == (phase == Phase.WAITING), (phase, line)
    assert "waiting for a replacement of slice 1 (up to 60 s)" in stream.getvalue()


@pytest.mark.parametrize("error", [ConfigError("layout.mesh", "does not divide the slice"), KeyboardInterrupt()])
def test_any_error_ends_the_run_failed(error):
    """Not only RunFailed: an error found at the workers' set-up (a
    ConfigError), a bug, Ctrl-C. Callbacks see FAILED and the end event
    says so; the report is not 'completed'."""
    clock = FakeClock()
    backend = FakeBackend(clock, 2)

    def broken(*args, **kwargs):
        raise error

    backend.run_step = broken
    rec = Recorder()
    trainer = Controller(lambda: None, ElasticConfig(num_slices=2), 10, callbacks=[rec],
                         seams=Seams(clock=clock, backend=backend))
    with pytest.raises(type(error)):
        trainer.fit()
    end = [x for kind, x in rec.seen if kind == "state"][-1]
    assert end.phase == Phase.FAILED and end.reason
    assert trainer.report.outcome == "failed" and trainer.report.error


def test_an_error_before_any_slice_still_ends_the_run():
    """A failure while the run sets up (before any slice is reserved) still
    gives callbacks an end: FAILED, then on_end."""
    clock = FakeClock()
    backend = FakeBackend(clock, 2)
    ended = []

    class End(Callback):
        def on_end(self, report):
            ended.append(report.outcome)

    def broken(*args, **kwargs):
        raise RuntimeError("no capacity API")

    backend.start = broken
    rec = Recorder()
    trainer = Controller(lambda: None, ElasticConfig(num_slices=2), 10, callbacks=[rec, End()],
                         seams=Seams(clock=clock, backend=backend))
    with pytest.raises(RuntimeError):
        trainer.fit()
    assert rec.phases()[-1] == Phase.FAILED and ended == ["failed"]
