"""Pipelined dispatch, the parts without Ray: when the controller lets the
next step be issued early (pipelining.next_assignment, and the controller
over the fake backend of test_controller), and when the runner uses or
drops calls issued ahead (calls.Issued.serves). The Ray side runs
in test_bench_smoke (fake slices with a set step time) and the e2e tests
(pipelining is on by default)."""

from __future__ import annotations

from ray_elastic import ElasticConfig
from ray_elastic.errors import FailureKind
from ray_elastic.control.pipelining import next_assignment
from ray_elastic.control.policy import SlicesView
from ray_elastic.dispatch.calls import Issued
from ray_elastic.dispatch.step_runner import StepRunner
from tests.test_controller import run

TWO = {0: (0,), 1: (1,)}


def view(live=(0, 1), ready=(), waiting_since=None, num_slices=2) -> SlicesView:
    return SlicesView(num_slices, frozenset(live), frozenset(ready), 0, waiting_since)


def test_next_step_is_issued_ahead_when_the_slices_stay():
    config = ElasticConfig(num_slices=2)
    assert next_assignment(view(), config, 3, 10, 0.0, TWO) == TWO


def test_not_after_the_last_step():
    assert next_assignment(view(), ElasticConfig(num_slices=2), 9, 10, 0.0, TWO) is None


def test_not_while_a_slice_is_ready_to_join():
    config = ElasticConfig(num_slices=2, policy="resize", min_slices=1)
    assert next_assignment(view(live=(0,), ready=(1,)), config, 3, 10, 0.0, {0: (0, 1)}) is None


def test_not_while_waiting_for_replacements():
    config = ElasticConfig(num_slices=2, policy="pause", timeout_s=60)
    assert next_assignment(view(live=(0,), waiting_since=0.0), config, 3, 10, 1.0, {0: (0, 1)}) is None


def test_a_hot_spare_does_not_stop_it():
    # A ready slice beyond num_slices is a spare: the slices stay.
    config = ElasticConfig(num_slices=2, spare_slices=1)
    assert next_assignment(view(ready=(2,)), config, 3, 10, 0.0, TWO) == TWO


def test_controller_offers_every_step_but_the_last():
    trainer, backend = run(ElasticConfig(num_slices=2), steps=6)
    trainer.fit()
    assert backend.aheads == [(k, TWO) for k in range(5)] + [(5, None)]


def test_after_a_failure_the_next_step_runs_on_what_the_boundary_decided():
    # The step that failed had offered its slices' assignment; the runner
    # is then handed another (the survivor's), so it drops what it issued.
    trainer, backend = run(ElasticConfig(num_slices=2, policy="resize", min_slices=1), steps=12)
    backend.fail_at[(4, 1)] = FailureKind.PROCESS_DIED
    report = trainer.fit()
    assert report.steps_completed == 12
    # Step 4 offered step 5 on both slices; slice 1 failed; step 4 ran
    # again on the survivor, offering step 5 on the survivor alone.
    assert backend.aheads[4:6] == [(4, TWO), (4, {0: (0, 1)})]
    assert backend.steps_run[4] == (4, (0,))


class _Slice:  # a LiveSlice stand-in: the runner compares them by identity
    workers: list = []


def test_calls_issued_ahead_serve_only_the_same_step_slices_and_shards():
    a, b = _Slice(), _Slice()
    live = {0: a, 1: b}
    issued = Issued(5, dict(live), dict(TWO), [], {}, [], [])
    assert issued.serves(5, live, TWO)
    assert not issued.serves(6, live, TWO)  # another step (a rewind, say)
    assert not issued.serves(5, {0: a}, {0: (0, 1)})  # a slice lost
    assert not issued.serves(5, {0: a, 1: _Slice()}, TWO)  # slice 1 replaced: new workers
    assert not issued.serves(5, live, {0: (1,), 1: (0,)})  # other shards


def test_runner_switch(monkeypatch):
    monkeypatch.setenv("RAY_ELASTIC_PIPELINE", "0")
    assert not StepRunner(None, lambda: 0.0).pipeline
    monkeypatch.delenv("RAY_ELASTIC_PIPELINE")
    assert StepRunner(None, lambda: 0.0).pipeline
    assert not StepRunner(None, lambda: 0.0, pipeline=False).pipeline
