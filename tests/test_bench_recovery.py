"""bench/compare.py's recovery-as-users-feel-it figures on made-up
timelines (no cluster)."""

from __future__ import annotations

import pytest

from bench.compare import user_recovery


def _steady(n, dt=0.1, t0=0.0, s0=1):
    return [[t0 + i * dt, s0 + i] for i in range(n)]


def test_pause_like_gap_then_full_rate():
    # 40 steps at 10/s, the fault at t=3.95 (after step 40), a 2 s gap, then 10/s again.
    tl = _steady(40) + _steady(60, t0=6.0, s0=41)
    u = user_recovery(tl, 3.95)
    assert u["pre_rate"] == pytest.approx(10.0)
    assert u["rate_recovered_s"] == pytest.approx(6.0 - 3.95)
    # At 6.0 s, a failure-free run is at 40 + 2.05 * 10 = 60.5 steps; the run at 41.
    assert u["lost_s"] == pytest.approx((6.0 - 3.95) - 1 / 10.0)
    assert u["lost_end_s"] == pytest.approx(u["lost_s"], abs=1e-6)


def test_rewind_counts_only_new_steps():
    # The fault after step 40; the run goes back to step 35 and redoes 36..40.
    tl = _steady(40) + [[5.0 + i * 0.1, 36 + i] for i in range(65)]
    u = user_recovery(tl, 3.95)
    # Step 41 (the first new one) completes at 5.0 + 5 * 0.1.
    assert u["rate_recovered_s"] == pytest.approx(5.5 - 3.95)
    assert u["lost_s"] == pytest.approx((5.5 - 3.95) - 1 / 10.0)


def test_slow_degraded_rate_is_the_reference_when_lower():
    # After the fault the run trains on at half the rate.
    tl = _steady(40) + _steady(60, dt=0.2, t0=4.2, s0=41)
    assert user_recovery(tl, 3.95)["rate_recovered_s"] is None  # never back to 90% of full
    u = user_recovery(tl, 3.95, degraded_ratio=0.5)
    assert u["rate_recovered_s"] == pytest.approx(4.2 - 3.95)
    assert u["lost_end_s"] > u["lost_s"]  # the slow stretch keeps losing time


def test_no_fault_or_no_timeline():
    assert user_recovery([], 1.0) == {}
    assert user_recovery(_steady(20), None) == {}
