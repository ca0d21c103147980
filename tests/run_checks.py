"""Helpers the end-to-end tests share: bitwise state equality and the
events of a run report by name."""

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
