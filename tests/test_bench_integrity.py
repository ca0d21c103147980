"""bench/integrity.py's summary, tables and files from a result of the
shape its run makes (no cluster: the runs are the bench's own)."""

from __future__ import annotations

import json

from bench import integrity


def _result() -> dict:
    rows = []
    for size, on, off in (("small", (0.080, 0.099), (0.092, 0.094)), ("large", (4.62, 4.20), (4.60, 4.16))):
        for r in range(2):
            rows.append({"size": size, "every": 1, "round": r, "median_step_s": on[r], "median_check_s": 0.003,
                         "median_wait_s": 0.0004})
            rows.append({"size": size, "every": 0, "round": r, "median_step_s": off[r], "median_check_s": None})
    return {
        "overhead": rows, "rounds": 2, "steps": 30, "warmup_steps": 4,
        "cross": {"grad_check_every": 10, "checks": 6, "median_step_s": 0.145, "excess_per_check_s": 0.0178,
                  "overhead_at_50_pct": 0.244},
        "catch": {"fault_step": 10, "found_at_step": 11, "named": [[1, 0]], "rolled_back_to": 5,
                  "steps_rewound": [6], "kinds": ["corrupted"], "fault_to_found_s": 0.158, "recovered_s": 3.7,
                  "bitwise_equal": True},
        "catch_grads": {"fault_step": 7, "grad_check_every": 3, "found_at_step": 10, "named": [[1, 0]],
                        "detail": "d", "last_clean_step": 6, "rolled_back_to": 5, "kinds": ["corrupted"],
                        "bitwise_equal": True},
        "straggler": {"median_step_s": 0.08, "slow_ms": 40, "slow_from_step": 10,
                      "detected": {"steps_per_s": 7.4, "failures": ["straggler"], "steps_rewound": [0],
                                   "median_step_late_s": 0.09, "named_at_step": 21, "ratio": 2.6,
                                   "action": "swap", "swapped_at_step": 21},
                      "kept_slow": {"steps_per_s": 8.2, "failures": [], "steps_rewound": [],
                                    "median_step_late_s": 0.12}},
    }


def test_summary_takes_medians_over_rounds():
    s = integrity.summary(_result())
    assert s["small"]["median_step_on_s"] == (0.080 + 0.099) / 2 and s["small"]["median_step_off_s"] == 0.093
    assert abs(s["large"]["check_pct_of_step"] - 100 * 0.003 / 4.38) < 1e-9
    assert abs(s["small"]["wait_pct_of_step"] - 100 * 0.0004 / 0.093) < 1e-9
    # Each round's on against its own off: 0.080/0.092 and 0.099/0.094.
    assert [round(d, 6) for d in s["small"]["round_differences_pct"]] == [round(100 * (0.080 / 0.092 - 1), 6),
                                                                          round(100 * (0.099 / 0.094 - 1), 6)]


def test_tables_and_files(tmp_path):
    r = _result()
    md = integrity.table(r)
    for heading in ("State checks", "Gradient cross-checks", "A bit flipped", "A straggler", "every gradient"):
        assert heading in md, heading
    assert "| 0.1450 | 0.0178 | 0.24% |" in md
    assert "| 0.00300 | 0.00040 | 0.43% |" in md  # small: on its thread, waited, waited / step
    paths = integrity.write(r, str(tmp_path))
    with open(paths["json"]) as f:
        assert json.load(f)["summary"]["small"]["step_difference_pct"] < 0
    with open(paths["md"]) as f:
        assert f.read().strip() == md.strip()
