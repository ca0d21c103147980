"""A preemption's checkpoint (control/saves.py): saved beside training from
another live slice's copy when one holds the state and the writer actor
writes it; waited for otherwise. Pure bookkeeping against a coordinator
stand-in; the real saves run in test_checkpoints_e2e.py and
test_shapes_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

from ray_elastic.control.saves import Saves


class _Coordinator:
    """What Saves uses of CheckpointCoordinator: one save in flight,
    committed when the test says so."""

    def __init__(self, on_hosts: bool = False):
        self.writes_on_hosts = on_hosts
        self.config = SimpleNamespace(due=lambda step: False, continuous=False, save_at_end=False,
                                      save_timeout_s=1.0)
        self.inflight = None
        self.last_saved = None
        self.submitted: list = []
        self.done: set = set()  # steps whose write has finished
        self.failing: set = set()

    def copied(self, ref, timeout_s):
        return True

    def busy(self):
        return self.inflight is not None

    def submit(self, step, ref, urgent=False):
        assert self.inflight is None
        self.inflight = step
        self.submitted.append((step, ref, urgent))

    def poll(self, block_s=0.0):
        if self.inflight is not None and self.inflight in self.done:
            if self.inflight not in self.failing:
                self.last_saved = self.inflight
            self.inflight = None

    def save_now(self, step, ref, timeout_s):
        self.done.add(step)
        if self.inflight is not None:
            self.poll()
        self.submit(step, ref, urgent=True)
        self.poll()
        return self.last_saved == step

    def must_stop(self):
        return False


def _saves(ckpt, live=(0, 1)):
    events = []
    backend = SimpleNamespace(state=lambda s: f"copy-of-{s}", node_alive=lambda n: True)
    members = SimpleNamespace(live=set(live), backend=backend)
    snapshots = SimpleNamespace(restore_source=lambda alive: None, copy_of=lambda step: None)
    saves = Saves(ckpt, snapshots, members, "run", event=lambda name, **kw: events.append((name, kw)))
    return saves, events


def test_saved_from_a_survivor_s_copy_without_waiting():
    ckpt = _Coordinator()
    saves, events = _saves(ckpt)
    saves.before_preemption(7, slice_id=0, noticed_at=0.0, timeout_s=29.0)
    # Submitted from slice 1's copy (not the slice that goes), not yet committed: the run goes on.
    assert ckpt.submitted == [(7, "copy-of-1", True)] and events == []
    ckpt.done.add(7)
    saves.after_step(8)
    [(name, kw)] = events
    assert name == "preempt_saved" and kw["step"] == 7 and kw["run_waited"] is False


def test_waits_behind_a_save_in_flight_then_goes_in():
    ckpt = _Coordinator()
    saves, events = _saves(ckpt)
    ckpt.submit(5, "snap-5")  # a periodic save
    saves.before_preemption(7, slice_id=1, noticed_at=0.0, timeout_s=29.0)
    assert [s for s, *_ in ckpt.submitted] == [5]
    saves.after_step(8)  # still writing step 5
    assert [s for s, *_ in ckpt.submitted] == [5] and events == []
    ckpt.done.add(5)
    saves.after_step(9)
    assert ckpt.submitted[-1] == (7, "copy-of-0", True)
    ckpt.done.add(7)
    saves.after_step(10)
    assert [(n, kw["step"]) for n, kw in events] == [("preempt_saved", 7)]


def test_a_failed_save_is_reported_unsaved():
    ckpt = _Coordinator()
    saves, events = _saves(ckpt)
    saves.before_preemption(7, slice_id=0, noticed_at=0.0, timeout_s=29.0)
    ckpt.done.add(7)
    ckpt.failing.add(7)
    saves.after_step(8)
    assert [(n, kw["step"]) for n, kw in events] == [("preempt_unsaved", 7)]


def test_the_last_live_slice_and_a_sharded_state_wait_for_the_commit():
    for ckpt, live in ((_Coordinator(), (0,)), (_Coordinator(on_hosts=True), (0, 1))):
        saves, events = _saves(ckpt, live)
        saves.before_preemption(7, slice_id=0, noticed_at=0.0, timeout_s=29.0)
        assert ckpt.last_saved == 7  # committed before before_preemption returned
        [(name, kw)] = events
        assert name == "preempt_saved" and kw["run_waited"] is True


def test_the_run_s_end_waits_for_a_preemption_s_save():
    ckpt = _Coordinator()
    saves, events = _saves(ckpt)
    ckpt.submit(5, "snap-5")
    saves.before_preemption(7, slice_id=0, noticed_at=0.0, timeout_s=29.0)
    ckpt.done.update({5, 7})
    saves.at_end(9)  # save_at_end off: only what was asked for
    assert [s for s, *_ in ckpt.submitted] == [5, 7]
    assert [(n, kw["step"]) for n, kw in events] == [("preempt_saved", 7)]


def test_a_newer_notice_replaces_one_not_yet_started():
    ckpt = _Coordinator()
    saves, events = _saves(ckpt, live=(0, 1, 2))
    ckpt.submit(5, "snap-5")
    saves.before_preemption(7, slice_id=0, noticed_at=0.0, timeout_s=29.0)
    saves.before_preemption(8, slice_id=1, noticed_at=0.0, timeout_s=29.0)
    assert [(n, kw["step"]) for n, kw in events] == [("preempt_unsaved", 7)]
    ckpt.done.update({5, 8})
    saves.after_step(9)
    saves.after_step(10)
    assert [s for s, *_ in ckpt.submitted] == [5, 8]
    assert events[-1][0] == "preempt_saved" and events[-1][1]["step"] == 8


def test_a_save_is_taken_in_while_the_run_waits():
    ckpt = _Coordinator()
    saves, events = _saves(ckpt)
    saves.before_preemption(7, slice_id=0, noticed_at=0.0, timeout_s=29.0)
    saves.settle()
    assert events == []
    ckpt.done.add(7)
    saves.settle()  # no step ran: the controller waits for a replacement
    assert [(n, kw["step"]) for n, kw in events] == [("preempt_saved", 7)]
