"""The soak bench's pure parts (bench/soak.py, `python -m bench soak`):
the bitwise check, the seeded order, the figures and the checks, on plain
data. The soak itself makes its own cluster on Ray's default health
checks and is checked by running it (end of this file)."""

from __future__ import annotations

import numpy as np


def test_bitwise_compares_every_array():
    from bench.soak import bitwise

    a = {"params": {"w": np.arange(6, dtype=np.float32), "b": np.zeros(2, np.float32)}, "opt_state": (np.ones(3),)}
    same = {"params": {"w": np.arange(6, dtype=np.float32), "b": np.zeros(2, np.float32)}, "opt_state": (np.ones(3),)}
    assert bitwise(a, same) == {"equal": True, "arrays": 3, "mismatched": []}
    off = {**same, "params": {**same["params"], "w": np.nextafter(same["params"]["w"], np.float32(9))}}
    r = bitwise(a, off)
    assert not r["equal"] and r["mismatched"] == ["['params']['w']"]
    assert not bitwise(a, {"params": same["params"]})["equal"]
    assert bitwise(None, same)["why"] == "no final state"


def test_plan_steps():
    from bench.soak import GOODPUT_GUESS, plan_steps

    n = plan_steps(10.0, 0.05, ["pause"])
    assert n == int(600 * GOODPUT_GUESS["pause"] / 0.05)
    both = plan_steps(10.0, 0.05, ["pause", "resize"])
    assert n < both < plan_steps(10.0, 0.05, ["resize"])


def test_the_seeded_order_has_every_kind_its_weight_in_each_cycle():
    import random

    from bench.soak_chaos import KINDS, WEIGHTS, cycle_of

    a, b = cycle_of(KINDS, random.Random(3)), cycle_of(KINDS, random.Random(3))
    assert a == b and a != cycle_of(KINDS, random.Random(4))
    assert {k: a.count(k) for k in KINDS} == {k: WEIGHTS[k] for k in KINDS}
    assert sum(a.count(k) for k in ("kill", "stop", "term")) > len(a) / 2  # process faults weighted up


def test_a_diloco_leg_ends_at_a_rounds_end_and_takes_no_eviction_faults():
    from bench.soak import DILOCO_PERIOD, leg_kinds, round_end
    from bench.soak_chaos import KINDS

    assert round_end("pause", 37) == 37
    assert round_end("diloco", DILOCO_PERIOD) == DILOCO_PERIOD
    assert round_end("diloco", DILOCO_PERIOD + 1) == 2 * DILOCO_PERIOD
    assert set(KINDS) - set(leg_kinds("diloco", KINDS)) == {"corrupt", "slow"}
    assert leg_kinds("resize", KINDS) == list(KINDS)


def test_spread_gives_the_median_and_the_99th_percentile():
    from bench.soak_figures import spread

    s = spread(list(range(1, 101)) + [None])
    assert s["n"] == 100 and s["median"] == 50.5 and 99 < s["p99"] < 100
    assert spread([2.0])["p99"] == 2.0 and spread([]) == {"n": 0}


class _Faults:
    def __init__(self, faults):
        self.faults = faults


def test_each_detection_is_matched_to_one_fault_and_the_rest_are_not_the_benchs():
    from bench.soak_figures import fault_rows

    faults = [{"i": 0, "kind": "kill", "slice": 1, "t": 10.0, "pid": 5},
              {"i": 1, "kind": "term", "slice": 2, "t": 10.5, "pid": 6, "window": "recovery"}]
    events = [{"event": "detected", "t": 10.2, "slice": 1, "kind": "process_died"},
              {"event": "preempt_notice", "t": 10.6, "slice": 2},
              {"event": "detected", "t": 10.7, "slice": 2, "kind": "preempted"},
              {"event": "recovered", "t": 11.0, "slice": 1, "steps_rewound": 0},
              {"event": "detected", "t": 30.0, "slice": 0, "kind": "hung", "cause": "no heartbeat"}]
    steps = [(9.0, 100, 3), (11.0, 101, 3), (12.0, 102, 3)]
    rows, unexpected = fault_rows(_Faults(faults), events, steps)
    assert [r["failure_kind"] for r in rows] == ["process_died", "preempted"]
    assert rows[0]["detected_s"] == 0.2 and rows[0]["recovered_s"] == 1.0 and rows[0]["steps_rewound"] == 0
    assert [r["steps_redone"] for r in rows] == [0, 0]
    assert rows[1]["detected_s"] == 0.1 and rows[1]["window"] == "recovery"  # the notice detects a SIGTERM
    assert [u["kind"] for u in unexpected] == ["hung"]
    assert "pid" not in rows[0]


def test_steps_redone_are_the_reports_of_steps_done_before_the_fault():
    from bench.soak_figures import steps_redone

    # Steps 1-5 done; a fault at t=5.5 rolls back to step 3: 4 and 5 run again, then 6.
    seen = [(float(t), t, 3) for t in range(1, 6)] + [(6.0, 4, 3), (7.0, 5, 3), (8.0, 6, 3)]
    assert steps_redone(seen, 5.5, float("inf")) == 2
    assert steps_redone(seen, 5.5, 6.5) == 1  # the next fault's from then on
    assert steps_redone(seen, 7.5, float("inf")) == 0


def _leg(**kw) -> dict:
    r = {"error": None, "outcome": "completed", "steps_completed": 50, "steps_requested": 50,
         "failures": [{"i": 0, "kind": "kill", "slice": 0, "t": 1.0, "detected_s": 0.1, "recovered_s": 0.5}],
         "unexpected_failures": [], "bench_errors": [], "failures_unrecovered": 0, "kinds": ["kill"],
         "by_kind": {"kill": {}}, "bitwise": {"equal": True, "arrays": 3, "mismatched": []},
         "leaks": {"none": True, "leaked": {"nodes": 0}}}
    return {**r, **kw}


def test_the_checks_fail_a_leak_a_foreign_failure_and_a_short_count():
    from bench.soak_figures import checks

    ok = {"settings": {"failures": 1}, "runs": {"pause": _leg()}}
    assert checks(ok) == []
    leaked = {"settings": {}, "runs": {"pause": _leg(leaks={"none": False, "leaked": {"placement_groups": 1}})}}
    assert "leaked {'placement_groups': 1}" in checks(leaked)[0]
    foreign = {"settings": {}, "runs": {"pause": _leg(unexpected_failures=[{"kind": "hung"}])}}
    assert "did not inject" in checks(foreign)[0]
    short = {"settings": {"failures": 2}, "runs": {"pause": _leg()}}
    assert "1 of the 2 faults" in checks(short)[0]


# The soak itself (a cluster of its own on Ray's default health checks,
# faults, gs:// checkpoints: two minutes at its smallest) is checked by
# running it, as tests/test_bench_smoke.py says; each part of it an e2e
# test covers (test_checkpoints_e2e, test_node_loss_e2e, test_elastic_e2e).
