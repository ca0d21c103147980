"""A host's part of the cross-slice exchange: a reduce-scatter and an
all-gather through Ray's object store, in the order the step's plan fixes
(dispatch/exchange_plan.py says which order, and why it never depends on
the slices).

1. The gradient call (`pieces`, `cut`): the host sums the shards it holds
   block by block (a block it holds whole leaves as one piece, so with the
   full membership one gradient leaves the slice), then cuts every piece
   into the plan's chunks, by element ranges over its leaves taken in
   order: views, no copy. Chunk c goes to its owner.
2. The owner of chunk c (`sum_chunk`) sums every source's chunk c in the
   plan's order and returns the sum (and, for chunk 0, the step's
   per-shard scalars and model states, combined).
3. Every host's apply (`assemble`) takes the owners' sums, in chunk order,
   and lays them back into whole leaves.

A host so takes in about 2(n-1)/n of its gradient's bytes per step, as a
ring all-reduce moves, and the additions of any one element happen in the
same order whatever the chunk boundaries and owners: a resized or
recovered run stays bitwise equal to a failure-free one. Pure numpy (the
model states go through the caller's `tree_map`): runs in the workers and
in unit tests.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ray_elastic.dispatch.exchange_plan import ExchangePlan

__all__ = ["aligned_empty", "assemble", "chunk_bytes", "cut", "fold", "in_plan_order", "pieces", "sum_chunk", "sum_meta",
           "wire"]

# Per-shard scalars a gradient call reports, carried to the apply with chunk 0.
SCALARS = ("loss", "weight", "aux", "eval")

# XLA's CPU client takes a host array without a copy when its data is
# aligned to this many bytes (numpy's own allocations are 16-byte aligned):
# the summed gradient then reaches a CPU slice's update with no copy (a
# copy measured ~0.47 s per 706 MB here).
ALIGN = 64


def aligned_empty(shape: tuple, dtype: Any) -> np.ndarray:
    """An uninitialized array whose data starts on an ALIGN-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _all_of_aligned(a: np.ndarray) -> bool:
    """Whether `a` is the whole of an `aligned_empty` array: writeable
    memory of its own, not a view of another array or of the object store."""
    base = a.base
    return (isinstance(base, np.ndarray) and base.base is None and base.flags.owndata and base.dtype == np.uint8
            and base.nbytes == a.nbytes + ALIGN and a.flags.writeable)


def fold(values: Sequence[list]) -> list:
    """The left fold of lists of arrays, element by element: ((v0 + v1) +
    v2) + ... A single value is returned as it is (no copy); else the sum
    is a fresh array (the inputs may be read-only object-store views)."""
    if len(values) == 1:
        return list(values[0])
    # A fresh, aligned array: one pass, not a copy and an add (`out`, also
    # for a 0-d leaf, where np.add would give a numpy scalar that `+=` below
    # would rebind rather than add into).
    acc = [np.add(a, b, out=aligned_empty(np.shape(a), np.result_type(a, b))) for a, b in zip(values[0], values[1])]
    for v in values[2:]:
        for a, b in zip(acc, v):
            a += b
    return acc


def tree(nodes: list, fan_in: int, add: Callable[[Sequence], Any]) -> Any:
    """Groups of `fan_in` consecutive nodes, each folded by `add`, level by
    level down to one."""
    while len(nodes) > 1:
        nodes = [add(nodes[j:j + fan_in]) for j in range(0, len(nodes), fan_in)]
    return nodes[0]


def in_plan_order(plan: ExchangePlan, by_key: dict, add: Callable[[Sequence], Any]) -> Any:
    """The sum of `by_key` ({("block", b) or ("shard", s): value}) in the
    plan's order: each block's value (its piece, or the fold of its single
    shards in key order), then the tree over the blocks. Every shard of the
    plan must be covered exactly once."""
    covered = sorted(s for kind, key in by_key for s in (plan.members(key) if kind == "block" else (key,)))
    if covered != sorted(plan.shards):
        missing = sorted(set(plan.shards) - set(covered))
        if missing:
            raise RuntimeError(f"the exchange is missing the gradients of shards {missing}")
        raise RuntimeError(f"the exchange got shards outside its plan or twice: {covered} for {list(plan.shards)}")
    nodes = [by_key[("block", b)] if ("block", b) in by_key else add([by_key[("shard", s)] for s in plan.members(b)])
             for b in plan.block_order()]
    return tree(nodes, plan.fan_in, add)


def pieces(plan: ExchangePlan, grads: dict) -> dict:
    """{("block", b): fold} for each block whose every shard is in `grads`
    (shard -> list of arrays), {("shard", s): arrays} for the others."""
    by_block: dict = {}
    for s in sorted(grads):
        by_block.setdefault(plan.block_of(s), []).append(s)
    out = {}
    for b, held in sorted(by_block.items()):
        if tuple(held) == plan.members(b):
            out[("block", b)] = fold([grads[s] for s in held])
        else:
            out.update({("shard", s): grads[s] for s in held})
    return out


def wire(leaves: list, dtype: Optional[Any]) -> list:
    """The arrays as they travel: cast to `dtype` (a numpy dtype), or as
    they are (None)."""
    return leaves if dtype is None else [a.astype(dtype) for a in leaves]


def cut(leaves: list, chunks: int) -> list:
    """`chunks` lists of 1-D views: the leaves' elements, taken in order,
    cut into as many ranges of (nearly) equal length; a range never spans
    two leaves (a leaf across a boundary gives a view to each chunk)."""
    total = sum(a.size for a in leaves)
    edges = [total * c // chunks for c in range(chunks + 1)]
    out: list = [[] for _ in range(chunks)]
    offset = 0
    for a in leaves:
        flat = np.ascontiguousarray(a).reshape(-1)
        for c in range(chunks):
            lo, hi = max(edges[c], offset), min(edges[c + 1], offset + a.size)
            if lo < hi:
                out[c].append(flat[lo - offset:hi - offset])
        offset += a.size
    return out


def chunk_bytes(chunk: Optional[dict]) -> int:
    """Gradient bytes in a source's chunk or an owner's sum (0 for a gate)."""
    if not chunk:
        return 0
    if "sum" in chunk:
        return sum(int(a.nbytes) for a in chunk["sum"])
    return sum(int(a.nbytes) for segs in chunk["pieces"].values() for a in segs)


def sum_chunk(plan: ExchangePlan, c: int, parts: Sequence[Optional[dict]], tree_map: Callable,
              model_state_op: str = "sum") -> dict:
    """The owner's sum of chunk c over every source's chunk c (`parts`;
    None: a gate from a host that sends nothing), in the plan's order,
    summed in float32 when the wire's dtype is narrower and sent back in
    it. Chunk 0 also carries the step's per-shard scalars and its model
    states' sum (the same order; "max" combines by maximum)."""
    got = [p for p in parts if p]
    wrong = [p["chunk"] for p in got if p["chunk"] != c]
    if wrong:
        raise RuntimeError(f"chunk {c}'s owner was given chunks {wrong}")
    by_key: dict = {}
    wire_type = None
    for p in got:
        for key, segs in p["pieces"].items():
            if key in by_key:
                raise RuntimeError(f"the exchange got {key} twice")
            if plan.wire_dtype is not None and segs:
                wire_type = segs[0].dtype
                segs = [a.astype(np.float32) for a in segs]
            by_key[key] = segs
    summed = in_plan_order(plan, by_key, fold)
    if wire_type is not None:
        summed = [a.astype(wire_type) for a in summed]
    out = {"chunk": c, "sum": summed, "count": len(plan.shards)}
    if c == 0:
        out.update(sum_meta(plan, got, tree_map, model_state_op))
    return out


def sum_meta(plan: ExchangePlan, parts: Sequence[Optional[dict]], tree_map: Callable,
             model_state_op: str = "sum") -> dict:
    """The step's per-shard scalars and its model states' sum (in the
    plan's order; "max" combines by maximum) from the sources' chunks 0
    (`parts`; None: a gate)."""
    meta: dict = {f: {} for f in SCALARS}
    states: dict = {}
    for p in parts:
        if not p:
            continue
        for f in SCALARS:
            meta[f].update(p["meta"].get(f, {}))
        states.update(p["meta"].get("model_state") or {})
    meta["model_state"] = None
    if states:
        combine = np.maximum if model_state_op == "max" else np.add
        add = lambda vs: _fold_trees(vs, tree_map, combine)  # noqa: E731
        meta["model_state"] = in_plan_order(plan, {("shard", s): v for s, v in states.items()}, add)
    return meta


def _fold_trees(values: Sequence, tree_map: Callable, combine: Callable) -> Any:
    if len(values) == 1:
        return values[0]
    acc = tree_map(lambda a: np.array(a, copy=True), values[0])
    for v in values[1:]:
        acc = tree_map(lambda a, b: combine(a, b, out=a), acc, v)
    return acc


def assemble(sums: Sequence[dict], template: Sequence[Any]) -> list:
    """The whole leaves from the owners' sums (any order; every chunk of
    the step once), each of the template's shape and dtype (objects with
    `.shape` and `.dtype`)."""
    order = sorted(sums, key=lambda s: s["chunk"])
    if [s["chunk"] for s in order] != list(range(len(order))):
        raise RuntimeError(f"the apply got chunks {[s['chunk'] for s in order]}, not each of 0..{len(order) - 1}")
    segments = iter(a for s in order for a in s["sum"])
    out = []
    for spec in template:
        size = math.prod(spec.shape)
        seg = next(segments) if size else None
        if (seg is not None and seg.size == size and seg.dtype == spec.dtype
                and (seg.flags.owndata or _all_of_aligned(seg))):
            out.append(seg.reshape(spec.shape))  # a whole leaf summed here: already a fresh array of its own
            continue
        buf = aligned_empty((size,), spec.dtype)
        filled = 0
        while filled < size:
            seg = next(segments) if seg is None else seg
            buf[filled:filled + seg.size] = seg
            filled += seg.size
            seg = None
        out.append(buf.reshape(spec.shape))
    if next(segments, None) is not None:
        raise RuntimeError("the exchange's sums hold more elements than the state's gradient")
    return out
