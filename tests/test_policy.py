"""Unit tests for ray_elastic.control.policy.decide: pure, no cluster, time as floats."""

from __future__ import annotations

import pytest

from ray_elastic.config import ElasticConfig
from ray_elastic.errors import FailureKind, ReplacementTimeout, RetryBudgetExhausted
from ray_elastic.control.policy import (
    Continue,
    Fail,
    Grow,
    Shrink,
    SliceLost,
    SlicesView,
    Tick,
    Wait,
    decide,
)

T0 = 1000.0


def view(live, ready=(), retries=0, waiting_since=None, num_slices=4):
    return SlicesView(
        num_slices=num_slices,
        live=frozenset(live),
        ready_to_join=frozenset(ready),
        retries_used=retries,
        waiting_since=waiting_since,
    )


def lost(slice_id, step=7, kind=FailureKind.PROCESS_DIED):
    return SliceLost(slice_id=slice_id, kind=kind, step=step)


@pytest.fixture
def pause():
    return ElasticConfig(num_slices=4, policy="pause", timeout_s=60.0, max_retries=3)


@pytest.fixture
def resize():
    return ElasticConfig(
        num_slices=4, policy="resize", min_slices=2, timeout_s=60.0, max_retries=3
    )


# pause ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FailureKind))
def test_pause_waits_on_loss_with_deadline(pause, kind):
    d = decide(lost(2, kind=kind), view({0, 1, 2, 3}), pause, now=T0)
    assert d == Wait(deadline=T0 + 60.0)


def test_pause_keeps_waiting_before_timeout(pause):
    v = view({0, 1, 3}, waiting_since=T0)
    assert decide(Tick(), v, pause, now=T0 + 1.0) == Wait(T0 + 60.0)
    assert decide(Tick(), v, pause, now=T0 + 59.999) == Wait(T0 + 60.0)


def test_pause_waits_while_only_some_replacements_ready(pause):
    # 3 live + 0 ready < 4 required; still waiting even with 3 of 4.
    v = view({0, 1}, ready={2}, waiting_since=T0)
    assert decide(Tick(), v, pause, now=T0 + 10.0) == Wait(T0 + 60.0)


def test_pause_fails_with_replacement_timeout_at_deadline(pause):
    v = view({0, 1, 3}, waiting_since=T0)
    d = decide(Tick(), v, pause, now=T0 + 60.0)
    assert isinstance(d, Fail)
    assert isinstance(d.error, ReplacementTimeout)
    assert d.error.setting == "timeout_s"
    msg = str(d.error)
    assert "timeout_s" in msg
    assert "elastic_timeout_seconds" in msg
    assert "3 of the 4" in msg
    # the pause hint suggests the resize policy
    assert "resize" in msg


def test_pause_fails_after_deadline_too(pause):
    v = view({0, 1, 3}, waiting_since=T0)
    d = decide(Tick(), v, pause, now=T0 + 1e6)
    assert isinstance(d, Fail) and isinstance(d.error, ReplacementTimeout)


def test_pause_grows_when_all_slices_ready(pause):
    v = view({0, 1, 3}, ready={2}, waiting_since=T0)
    d = decide(Tick(), v, pause, now=T0 + 5.0)
    assert d == Grow(frozenset({0, 1, 2, 3}))


def test_pause_grows_even_at_deadline_if_ready(pause):
    # readiness is checked before the deadline
    v = view({0, 1, 3}, ready={2}, waiting_since=T0)
    assert decide(Tick(), v, pause, now=T0 + 600.0) == Grow(frozenset({0, 1, 2, 3}))


def test_pause_zero_timeout_fails_on_first_tick():
    cfg = ElasticConfig(num_slices=2, policy="pause", timeout_s=0)
    assert decide(lost(1), view({0, 1}, num_slices=2), cfg, now=T0) == Wait(T0)
    d = decide(Tick(), view({0}, waiting_since=T0, num_slices=2), cfg, now=T0)
    assert isinstance(d, Fail) and isinstance(d.error, ReplacementTimeout)


def test_pause_never_shrinks(pause):
    # even with plenty of survivors, pause waits
    d = decide(lost(0), view({0, 1, 2, 3}), pause, now=T0)
    assert isinstance(d, Wait)


# resize --------------------------------------------------------------------


def test_resize_shrinks_while_survivors_at_least_min(resize):
    d = decide(lost(1), view({0, 1, 2, 3}), resize, now=T0)
    assert d == Shrink(frozenset({0, 2, 3}))
    # down to exactly min_slices
    d = decide(lost(2), view({0, 2, 3}, retries=1), resize, now=T0)
    assert d == Shrink(frozenset({0, 3}))


def test_resize_waits_below_min_then_grows(resize):
    # survivors {0} < min_slices=2 -> wait
    d = decide(lost(3), view({0, 3}, retries=2), resize, now=T0)
    assert d == Wait(T0 + 60.0)
    # nothing ready yet -> keep waiting
    v = view({0}, waiting_since=T0, retries=3)
    assert decide(Tick(), v, resize, now=T0 + 10) == Wait(T0 + 60.0)
    # one replacement ready: 2 >= min_slices -> grow with live + ready
    v = view({0}, ready={3}, waiting_since=T0, retries=3)
    assert decide(Tick(), v, resize, now=T0 + 20) == Grow(frozenset({0, 3}))


def test_resize_grows_with_all_ready_slices(resize):
    v = view({0}, ready={1, 2, 3}, waiting_since=T0)
    assert decide(Tick(), v, resize, now=T0 + 1) == Grow(frozenset({0, 1, 2, 3}))


def test_resize_timeout_hint_names_min_slices(resize):
    v = view({0}, waiting_since=T0)
    d = decide(Tick(), v, resize, now=T0 + 60.0)
    assert isinstance(d, Fail) and isinstance(d.error, ReplacementTimeout)
    msg = str(d.error)
    assert "timeout_s" in msg
    assert "min_slices" in msg
    assert "1 of the 2" in msg


def test_resize_default_min_slices_is_one():
    cfg = ElasticConfig(num_slices=2, policy="resize")
    assert decide(lost(0), view({0, 1}, num_slices=2), cfg, now=T0) == Shrink(
        frozenset({1})
    )
    # losing the last slice must wait
    d = decide(lost(1), view({1}, retries=1, num_slices=2), cfg, now=T0)
    assert d == Wait(T0 + cfg.timeout_s)


# retry budget --------------------------------------------------------------


@pytest.mark.parametrize("policy", ["pause", "resize"])
def test_retry_budget_exhausted(policy):
    cfg = ElasticConfig(num_slices=4, policy=policy, max_retries=2)
    # below the budget: absorbed
    d = decide(lost(1), view({0, 1, 2, 3}, retries=1), cfg, now=T0)
    assert not isinstance(d, Fail)
    for used in (2, 3, 50):
        d = decide(lost(1, step=42), view({0, 1, 2, 3}, retries=used), cfg, now=T0)
        assert isinstance(d, Fail)
        assert isinstance(d.error, RetryBudgetExhausted)
        assert d.error.setting == "max_retries"
        msg = str(d.error)
        assert "max_retries" in msg
        assert "elastic_max_retries" in msg
        assert "slice 1" in msg and "step 42" in msg


def test_zero_retries_fails_on_first_loss():
    cfg = ElasticConfig(num_slices=2, policy="resize", max_retries=0)
    d = decide(lost(0), view({0, 1}, num_slices=2), cfg, now=T0)
    assert isinstance(d, Fail) and isinstance(d.error, RetryBudgetExhausted)


def test_retry_budget_checked_before_waiting_state(pause):
    d = decide(lost(0), view({0, 1}, retries=3, waiting_since=T0), pause, now=T0 + 5)
    assert isinstance(d, Fail) and isinstance(d.error, RetryBudgetExhausted)


# second loss while waiting --------------------------------------------------


def test_second_loss_while_waiting_keeps_first_deadline_pause(pause):
    first = decide(lost(2), view({0, 1, 2, 3}), pause, now=T0)
    assert first == Wait(T0 + 60.0)
    second = decide(
        lost(1), view({0, 1, 3}, retries=1, waiting_since=T0), pause, now=T0 + 30.0
    )
    assert second == Wait(T0 + 60.0)
    assert second.deadline == first.deadline


def test_second_loss_while_waiting_keeps_first_deadline_resize(resize):
    d = decide(
        lost(0), view({0}, retries=2, waiting_since=T0), resize, now=T0 + 45.0
    )
    assert d == Wait(T0 + 60.0)


# ticks ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["pause", "resize"])
def test_tick_with_ready_to_join_and_no_wait_grows(policy):
    cfg = ElasticConfig(num_slices=4, policy=policy)
    v = view({0, 1, 3}, ready={2})
    assert decide(Tick(), v, cfg, now=T0) == Grow(frozenset({0, 1, 2, 3}))


def test_tick_resize_regrows_partially_when_not_waiting(resize):
    # after a shrink to {0, 3}, one replacement comes back: grow at the boundary
    v = view({0, 3}, ready={1})
    assert decide(Tick(), v, resize, now=T0) == Grow(frozenset({0, 1, 3}))


@pytest.mark.parametrize("policy", ["pause", "resize"])
def test_tick_otherwise_continues(policy):
    cfg = ElasticConfig(num_slices=4, policy=policy)
    assert decide(Tick(), view({0, 1, 2, 3}), cfg, now=T0) == Continue()
    # a shrunk resize run with nothing ready also just continues
    assert decide(Tick(), view({0, 1}), cfg, now=T0 + 1e9) == Continue()


def test_decide_is_pure(pause):
    v = view({0, 1, 2, 3})
    e = lost(2)
    a = decide(e, v, pause, now=T0)
    b = decide(e, v, pause, now=T0)
    assert a == b
    assert v == view({0, 1, 2, 3})  # view untouched
