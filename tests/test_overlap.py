"""The exchange's windows against other work (worker/overlap.py): pure
bookkeeping of spans, each pair counted once whichever ends last."""

from __future__ import annotations

import threading

import pytest

from ray_elastic.worker.overlap import KINDS, SpanOverlap


def test_a_batch_read_half_inside_a_window_counts_half_either_order():
    for order in ("window first", "batch first"):
        o = SpanOverlap()
        spans = [("exchange", 10.0, 12.0), ("batch", 11.0, 13.0)]
        for kind, a, b in (spans if order == "window first" else spans[::-1]):
            o.add(kind, a, b)
        got = o.as_dict()
        assert got["exchange_window_s"] == pytest.approx(2.0)
        assert got["batch_s"] == pytest.approx(2.0)
        assert got["batch_in_exchange_s"] == pytest.approx(1.0), order


def test_work_beside_no_window_and_each_kind_apart():
    o = SpanOverlap()
    o.add("compute", 0.0, 1.0)
    o.add("exchange", 1.0, 1.5)  # opens as the compute ends: touches it, covers none of it
    o.add("snapshot", 1.2, 2.0)
    o.add("batch", 3.0, 4.0)  # after the window
    got = o.as_dict()
    assert got["compute_in_exchange_s"] == 0.0
    assert got["snapshot_in_exchange_s"] == pytest.approx(0.3)
    assert got["batch_in_exchange_s"] == 0.0
    assert got["compute_s"] == pytest.approx(1.0) and got["snapshot_s"] == pytest.approx(0.8)


def test_several_windows_and_reads_add_up():
    o = SpanOverlap()
    for k in range(10):  # a step a second: window [k+0.5, k+0.9], read [k+0.8, k+1.0]
        o.add("exchange", k + 0.5, k + 0.9)
        o.add("batch", k + 0.8, k + 1.0)
    got = o.as_dict()
    assert got["exchange_window_s"] == pytest.approx(4.0)
    assert got["batch_in_exchange_s"] == pytest.approx(1.0)


def test_only_known_kinds_and_a_span_never_below_zero():
    o = SpanOverlap()
    with pytest.raises(ValueError):
        o.add("lunch", 0.0, 1.0)
    o.add("batch", 2.0, 1.0)  # a clock that went back: an empty span
    assert o.as_dict()["batch_s"] == 0.0
    assert set(KINDS) == {"compute", "batch", "snapshot"}


def test_threads_adding_at_once_lose_nothing():
    o = SpanOverlap()

    def add(kind):
        for k in range(500):
            o.add(kind, float(k), k + 0.5)

    threads = [threading.Thread(target=add, args=(k,)) for k in ("exchange", "batch")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = o.as_dict()
    assert got["exchange_window_s"] == pytest.approx(250.0) and got["batch_s"] == pytest.approx(250.0)
    # Each read equals one window: counted at most once (at all, when the
    # two threads kept within `keep` spans of each other).
    assert 0.0 <= got["batch_in_exchange_s"] <= 250.0 + 1e-9
