"""elastic_retry: the decorator for users' own driver loops."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from ray_elastic import ReplacementTimeout, RetryBudgetExhausted, WorkerProcessDied
from ray_elastic.retry import elastic_retry


def test_retries_then_succeeds_and_reports_each_retry():
    calls, retried = [], []

    @elastic_retry(max_retries=3, on_retry=lambda e, n: retried.append((type(e).__name__, n)))
    def train():
        calls.append(1)
        if len(calls) < 3:
            raise WorkerProcessDied(1, 0, len(calls), "killed")
        return "done"

    assert train() == "done"
    assert len(calls) == 3
    assert retried == [("WorkerProcessDied", 1), ("WorkerProcessDied", 2)]


def test_budget_spent_names_the_setting():
    @elastic_retry(max_retries=1)
    def train():
        raise WorkerProcessDied(0, 0, 5, "killed")

    with pytest.raises(RetryBudgetExhausted, match="max_retries") as info:
        train()
    assert info.value.setting == "max_retries"


def test_waits_for_ready_with_passed_in_time_and_times_out():
    now = [0.0]

    def sleep(s):
        now[0] += s

    @elastic_retry(max_retries=5, timeout_s=10, ready=lambda: False, clock=lambda: now[0], sleep=sleep)
    def train():
        raise WorkerProcessDied(0, 0, 1, "killed")

    with pytest.raises(ReplacementTimeout, match="timeout_s"):
        train()
    assert 10 <= now[0] <= 11


def test_other_errors_are_not_retried():
    calls = []

    @elastic_retry(max_retries=5)
    def train():
        calls.append(1)
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        train()
    assert len(calls) == 1


@pytest.mark.cluster
def test_real_actor_killed_inside_users_loop_is_retried(cluster):
    """A user's own loop drives a Ray actor; SIGKILL it mid-loop: the
    decorator catches Ray's error and the loop starts again on a new actor."""

    @ray.remote(num_cpus=0)
    class Counter:
        def __init__(self):
            self.n = 0

        def pid(self):
            return os.getpid()

        def add(self):
            self.n += 1
            return self.n

    attempts = []

    @elastic_retry(max_retries=2, ready=lambda: True)
    def loop():
        actor = Counter.remote()
        attempts.append(actor)
        total = 0
        for i in range(20):
            if len(attempts) == 1 and i == 5:
                os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
            total = ray.get(actor.add.remote())
        return total

    assert loop() == 20
    assert len(attempts) == 2
