"""Helpers the end-to-end tests share: bitwise state equality, the events
of a run report by name, and a failure-free run's empty failure list."""

from __future__ import annotations

from typing import Optional

import numpy as np


def assert_same_state(a: dict, b: dict, step: Optional[int] = None) -> None:
    """Two final states (params and opt_state) equal bit for bit, at `step` if given."""
    import jax

    assert a["step"] == b["step"] and (step is None or a["step"] == step), (a["step"], b["step"], step)
    la, lb = jax.tree.leaves((a["params"], a["opt_state"])), jax.tree.leaves((b["params"], b["opt_state"]))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


def events(report, name: str) -> list[dict]:
    return [e for e in report.events if e["event"] == name]


def failures_of(report) -> list[tuple]:
    """A report's failures as (kind, slice, host, step, cause): a RunReport,
    or its JSON form (a dict, as `RunReport.to_dict` or a driver writes it)."""
    if isinstance(report, dict):
        return [(f["kind"], f["slice"], f["host"], f["step"], f.get("cause", "")) for f in report["failures"]]
    return [(f.kind, f.slice, f.host, f.step, f.cause) for f in report.failures]


def assert_no_failures(report) -> None:
    """A run with no fault injected recorded no failure: one that recovered
    (a phantom hang, a worker lost to the machine) would otherwise pass."""
    failures = failures_of(report)
    assert not failures, failures
