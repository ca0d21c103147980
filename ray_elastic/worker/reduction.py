"""The cross-slice sums of a step, in an order fixed by the shard keys.

A step's gradient is the sum of its batch shards' gradients divided by
their summed weight (the shard count under the plain mean-loss contract).
Whichever slices computed or reduced them, the pieces are added in the
order of their keys (shards, or a reduction-tree node's first shard), so
every run with the same number of shards adds in the same order and a
resized run stays bitwise equal to a failure-free one. The shards' model
states (program.py) ride along in the same order, combined by their
declared reduction; per-shard scalars (loss, weight, aux metrics) travel
as they are and are combined once, at the apply (`step_values`). Pure
numpy over pytrees: runs in the workers (reduction-tree nodes and apply)
and in unit tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import numpy as np

__all__ = ["StepValues", "divided", "eval_values", "float32_values", "reduce_pieces", "step_values"]

# Per-shard scalars of a phase-1 payload, carried through the tree as they are.
PER_SHARD = ("loss", "weight", "aux", "eval")


def _pieces(part: dict) -> list[tuple[int, Any, Any, int]]:
    """(key, gradient sum, model state, count) of a phase-1 payload (one
    piece per shard) or of a reduction-tree partial sum (one piece keyed by
    its first shard)."""
    if "grads" in part:
        states = part.get("model_state") or {}
        return [(shard, g, states.get(shard), 1) for shard, g in part["grads"].items()]
    return [(part["key"], part["sum"], part.get("model_state"), part["count"])]


def reduce_pieces(tree_map: Callable, keys: Optional[tuple], parts: tuple, model_state_op: str = "sum") -> dict:
    """Sum the pieces of `parts` named by `keys` (None: all), in key order;
    their model states combine by `model_state_op` ("max", or a sum for
    every other reduction: the mean's division is the apply's).

    The order of additions depends only on the keys, so every run with the
    same number of shards adds in the same order, whichever slices computed
    or reduced them: a resized run stays bitwise equal to a failure-free
    one. A payload may carry shards of other tree nodes; those are skipped.
    """
    wanted = None if keys is None else set(keys)
    pieces: dict = {}
    per_shard: dict = {f: {} for f in PER_SHARD}
    for part in parts:
        if part is None:
            continue
        for key, value, state, count in _pieces(part):
            if wanted is None or key in wanted:
                pieces[key] = (value, state, count)
        for field in PER_SHARD:
            per_shard[field].update({s: v for s, v in part.get(field, {}).items()
                                     if wanted is None or _covered(s, part, wanted)})
    if wanted is not None and set(pieces) != wanted:
        raise RuntimeError(f"reduction node is missing pieces {sorted(wanted - set(pieces))}")
    order = sorted(pieces)
    copy = lambda t: None if t is None else tree_map(lambda a: np.array(a, copy=True), t)  # noqa: E731
    acc, state = copy(pieces[order[0]][0]), copy(pieces[order[0]][1])
    combine = _max_into if model_state_op == "max" else _add_into
    for key in order[1:]:
        acc = tree_map(_add_into, acc, pieces[key][0])
        if state is not None:
            state = tree_map(combine, state, pieces[key][1])
    return {"key": order[0], "sum": acc, "model_state": state, "count": sum(pieces[k][2] for k in order),
            **per_shard}


def _covered(shard: int, part: dict, wanted: set) -> bool:
    # A payload's scalars are per shard; a partial's belong to its key.
    return shard in wanted if "grads" in part else part["key"] in wanted


def _add_into(acc: np.ndarray, value) -> np.ndarray:
    acc += value
    return acc


def _max_into(acc: np.ndarray, value) -> np.ndarray:
    np.maximum(acc, value, out=acc)
    return acc


def divided(acc: np.ndarray, n: float) -> np.ndarray:
    acc /= n
    return acc


@dataclasses.dataclass(frozen=True)
class StepValues:
    """A step's scalars over the global batch: `loss` (sum of the shards'
    totals over the sum of their weights), `weight` (that sum), `aux`
    (each metric by its reduction), `shards` (how many); `divisor`: what
    the gradient's sum is divided by, and `metrics`: the loss and aux the
    update is given (its `post_update`'s), both in float32 as the devices
    make them (`float32_values`)."""

    loss: float
    weight: float
    aux: dict
    shards: int
    divisor: np.float32 = np.float32(1.0)
    metrics: Optional[dict] = None


def float32_values(totals: list, weights: list, aux: dict, reductions: Mapping[str, str], add: Callable,
                   maximum: Callable, f32: Callable) -> tuple:
    """(divisor, metrics) of a step from its shards' totals, weights and
    aux metrics in key order ({name: [value per shard]}), each addition a
    float32 one in that order: `add`, `maximum` and `f32` are numpy's on
    the host and jax.numpy's inside the one-slice step's program
    (device_step.py), which so divide by the same bits."""
    def fold(values):
        acc = values[0]
        for v in values[1:]:
            acc = add(acc, v)
        return acc

    divisor = fold(weights)
    metrics = {"loss": fold(totals) / divisor}
    for name, reduction in reductions.items():
        values = aux[name]
        if reduction == "sum":
            metrics[name] = fold(values)
        elif reduction == "mean":
            metrics[name] = fold(values) / f32(len(values))
        elif reduction == "max":
            acc = values[0]
            for v in values[1:]:
                acc = maximum(acc, v)
            metrics[name] = acc
        else:  # weighted_mean
            metrics[name] = fold([w * v for w, v in zip(weights, values)]) / divisor
    return divisor, metrics


def eval_values(total: dict, reductions: Mapping[str, str]) -> Optional[StepValues]:
    """The eval's figures of a reduced step, if it ran one: each shard's
    eval is {"total", "weight", "aux"}, combined as `step_values` does."""
    evals = total.get("eval") or {}
    if not evals:
        return None
    return step_values({"loss": {s: e["total"] for s, e in evals.items()},
                        "weight": {s: e["weight"] for s, e in evals.items()},
                        "aux": {s: e["aux"] for s, e in evals.items()}}, reductions)


def step_values(total: dict, reductions: Mapping[str, str]) -> StepValues:
    """Combine the per-shard scalars of a reduced step (`reduce_pieces`'
    result), in shard order, so the figures do not depend on the slices."""
    losses, weights, aux = total["loss"], total.get("weight", {}), total.get("aux", {})
    order = sorted(losses)
    w = {s: float(weights.get(s, 1.0)) for s in order}
    weight = math.fsum(w[s] for s in order)
    loss = sum(float(losses[s]) for s in order) / weight
    out = {}
    for name, reduction in reductions.items():
        values = [float(aux[s][name]) for s in order]
        if reduction == "sum":
            out[name] = sum(values)
        elif reduction == "mean":
            out[name] = sum(values) / len(values)
        elif reduction == "max":
            out[name] = max(values)
        else:  # weighted_mean
            out[name] = sum(w[s] * v for s, v in zip(order, values)) / weight
    f32 = np.float32
    divisor, metrics = float32_values([f32(losses[s]) for s in order], [f32(w[s]) for s in order],
                                      {name: [f32(aux[s][name]) for s in order] for name in reductions}, reductions,
                                      np.add, np.maximum, f32)
    return StepValues(loss=loss, weight=weight, aux=out, shards=len(order), divisor=f32(divisor),
                      metrics={k: f32(v) for k, v in metrics.items()})
