"""The exchange's arithmetic (worker/chunks.py), as pure numpy: cut and
laid back, summed in the plan's order whatever the slices, the owners and
the chunk count, the same bits as the direct hand-off at one shard per
slice, bytes at the ring bound. The end-to-end tests
(tests/test_exchange_e2e.py) run it on real workers through failures."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ray_elastic.dispatch.assignment import assign_shards, spread_shards
from ray_elastic.dispatch.exchange_plan import ExchangePlan
from ray_elastic.errors import ConfigError
from ray_elastic.worker.chunks import assemble, chunk_bytes, cut, in_plan_order, pieces, sum_chunk, wire
from ray_elastic.worker.reduction import reduce_pieces

SHAPES = [(5, 3), (0,), (1,), (), (7,), (2, 2, 3)]  # () : a scalar parameter, a 0-d leaf


def _grad(shard: int) -> list:
    rng = np.random.default_rng(1000 + shard)
    return [np.asarray(rng.standard_normal(s).astype(np.float32) * (1 + shard)) for s in SHAPES]


def _specs():
    return [jax.ShapeDtypeStruct(s, np.float32) for s in SHAPES]


def _sources(plan: ExchangePlan, held: dict, dtype=None) -> list:
    """What each slice's gradient call sends: {slice: [chunk payloads]}
    (`held`: slice -> the shards it computed), as steps.py cuts them."""
    out = {}
    for s, shards in held.items():
        got = pieces(plan, {sh: _grad(sh) for sh in shards})
        cuts = {k: cut(wire(v, dtype), plan.chunks) for k, v in got.items()}
        chunks = [{"chunk": c, "from_slice": s, "plan": plan, "pieces": {k: segs[c] for k, segs in cuts.items()}}
                  for c in range(plan.chunks)]
        chunks[0]["meta"] = {"loss": {sh: float(sh) for sh in shards}, "weight": {sh: 1.0 for sh in shards},
                             "aux": {}, "model_state": {sh: {"m": np.full(2, sh, np.float32)} for sh in shards}}
        out[s] = chunks
    return out


def _exchange(plan: ExchangePlan, held: dict, dtype=None, state_op="sum") -> tuple[list, dict]:
    """Reduce-scatter then all-gather over `held`'s sources: the leaves and chunk 0's sum."""
    sources = _sources(plan, held, dtype)
    sums = [sum_chunk(plan, c, tuple(chunks[c] for chunks in sources.values()), jax.tree.map, state_op)
            for c in range(plan.chunks)]
    return assemble(sums[::-1], _specs()), sums[0]  # any order: assemble sorts by chunk


@pytest.mark.parametrize("chunks", [1, 2, 3, 7, 40])
def test_cut_then_assemble_gives_the_leaves_back(chunks):
    leaves = _grad(3)
    cuts = cut(leaves, chunks)
    assert len(cuts) == chunks
    sizes = [sum(a.size for a in c) for c in cuts]
    total = sum(a.size for a in leaves)
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1  # even to an element
    assert all(np.shares_memory(seg, leaves[0]) for seg in cuts[0][:1])  # views: no copy
    back = assemble([{"chunk": c, "sum": segs} for c, segs in enumerate(cuts)], _specs())
    for a, b in zip(back, leaves):
        np.testing.assert_array_equal(a, b)
        assert not np.shares_memory(a, b)  # views are copied (the apply divides in place)


@pytest.mark.parametrize("blocks,shards", [(2, 2), (4, 4), (2, 8), (3, 9), (4, 16), (12, 12)])
def test_the_sum_is_bitwise_the_same_whichever_slices_hold_the_shards(blocks, shards):
    """The full membership, every smaller one (resize), a step finished
    after a loss (the lost slice's shards spread over the survivors: a
    survivor sends two sources) and every chunk count give the same bits."""
    plan = ExchangePlan(chunks=blocks, blocks=blocks, shards=tuple(range(shards)), fan_in=2)
    want, want0 = _exchange(plan, assign_shards(range(blocks), shards, "accumulate"))
    ways = [assign_shards(range(n), shards, "accumulate") for n in range(1, blocks)]
    full = assign_shards(range(blocks), shards, "accumulate")
    spread = spread_shards(list(full[blocks - 1]), range(blocks - 1))
    ways.append({**{s: full[s] for s in range(blocks - 1)}, **{100 + s: v for s, v in spread.items()}})
    for held in ways:
        for chunks in (1, 2, max(1, len(held) - 1), 5):
            got, got0 = _exchange(ExchangePlan(chunks, blocks, plan.shards, 2), held)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(got0["model_state"]["m"], want0["model_state"]["m"])
            assert got0["loss"] == want0["loss"] and got0["count"] == shards


def test_a_block_of_several_shards_sums_every_leaf_scalars_too():
    """A block of 3 shards folded by the slice that holds it: every leaf,
    a 0-d one included, is the in-order sum of the 3."""
    plan = ExchangePlan(chunks=1, blocks=1, shards=(0, 1, 2), fan_in=8)
    got = pieces(plan, {s: _grad(s) for s in range(3)})[("block", 0)]
    for i, a in enumerate(got):
        want = np.asarray(_grad(0)[i] + _grad(1)[i]) + _grad(2)[i]
        np.testing.assert_array_equal(a, want)
        assert a.shape == SHAPES[i]


def test_with_the_full_membership_one_gradient_leaves_each_slice():
    plan = ExchangePlan(chunks=4, blocks=4, shards=tuple(range(16)), fan_in=8)
    for s, shards in assign_shards(range(4), 16, "accumulate").items():
        assert list(pieces(plan, {sh: _grad(sh) for sh in shards})) == [("block", s)]
    # Three survivors of four: a lost block's shards travel one by one.
    held = assign_shards(range(3), 16, "accumulate")[0]
    keys = pieces(plan, {sh: _grad(sh) for sh in held})
    assert any(k[0] == "shard" for k in keys)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 20])
def test_one_shard_per_slice_gives_the_direct_hand_offs_bits(n):
    """With one shard per block the order is the direct hand-off's: an
    in-order fold up to the fan-in, its tree of fan-in 8 above."""
    plan = ExchangePlan(chunks=n, blocks=n, shards=tuple(range(n)), fan_in=8)
    got, _ = _exchange(plan, {s: (s,) for s in range(n)})
    parts = [{"grads": {s: dict(enumerate(_grad(s)))}, "loss": {s: 0.0}} for s in range(n)]
    nodes = [(s, [p]) for s, p in enumerate(parts)]
    while len(nodes) > 1:  # the direct hand-off's tree, as the driver builds it
        nodes = [(g[0][0], [reduce_pieces(jax.tree.map, tuple(k for k, _ in g), tuple(p for _, ps in g for p in ps))])
                 for g in (nodes[j:j + 8] for j in range(0, len(nodes), 8))]
    want = reduce_pieces(jax.tree.map, None, tuple(nodes[0][1]))["sum"]
    for i, a in enumerate(got):
        np.testing.assert_array_equal(a, want[i])


def test_bytes_a_host_takes_in_are_at_the_ring_bound():
    """Owner of one chunk of n: it takes n-1 chunks in and n-1 sums back."""
    grad_bytes = sum(a.nbytes for a in _grad(0))
    for n in (2, 3, 4, 8):
        plan = ExchangePlan(chunks=n, blocks=n, shards=tuple(range(4 * n)), fan_in=8)
        sources = _sources(plan, assign_shards(range(n), 4 * n, "accumulate"))
        sums = [sum_chunk(plan, c, tuple(ch[c] for ch in sources.values()), jax.tree.map) for c in range(n)]
        for owner in range(n):
            taken = sum(chunk_bytes(sources[s][owner]) for s in sources if s != owner)
            taken += sum(chunk_bytes(sums[c]) for c in range(n) if c != owner)
            assert taken <= 1.05 * 2 * (n - 1) / n * grad_bytes + 8 * len(SHAPES) * n, (n, owner, taken)


def test_bfloat16_on_the_wire_halves_the_bytes_and_sums_in_float32():
    plan = ExchangePlan(chunks=2, blocks=2, shards=(0, 1, 2, 3), fan_in=8, wire_dtype="bfloat16")
    full = ExchangePlan(chunks=2, blocks=2, shards=(0, 1, 2, 3), fan_in=8)
    held = assign_shards(range(2), 4, "accumulate")
    narrow = _sources(plan, held, np.dtype(jax.numpy.bfloat16))
    wide = _sources(full, held)
    assert chunk_bytes(narrow[0][0]) * 2 == chunk_bytes(wide[0][0])
    got, _ = _exchange(plan, held, np.dtype(jax.numpy.bfloat16))
    want, _ = _exchange(full, held)
    assert all(a.dtype == np.float32 for a in got)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)
    with pytest.raises(ConfigError) as e:
        ExchangePlan(chunks=2, blocks=2, shards=(0,), fan_in=8, wire_dtype="float16")
    assert e.value.setting == "exchange_dtype"


def test_a_missing_or_doubled_shard_is_refused():
    plan = ExchangePlan(chunks=1, blocks=2, shards=(0, 1, 2, 3), fan_in=8)
    with pytest.raises(RuntimeError, match=r"missing the gradients of shards \[3\]"):
        in_plan_order(plan, {("block", 0): 1.0, ("shard", 1): 1.0}, sum)
    with pytest.raises(RuntimeError, match="twice"):  # a block's sum and one of its shards again
        in_plan_order(plan, {("block", 0): 1.0, ("block", 1): 1.0, ("shard", 2): 1.0}, sum)
    sources = _sources(plan, {0: (0, 2), 1: (1, 3)})
    with pytest.raises(RuntimeError, match="twice"):
        sum_chunk(plan, 0, (sources[0][0], sources[0][0], sources[1][0]), jax.tree.map)


def test_model_states_combine_by_maximum_in_the_plans_order():
    plan = ExchangePlan(chunks=2, blocks=2, shards=(0, 1, 2, 3), fan_in=8)
    _, first = _exchange(plan, assign_shards(range(2), 4, "accumulate"), state_op="max")
    np.testing.assert_array_equal(first["model_state"]["m"], np.full(2, 3, np.float32))
    _, first = _exchange(plan, assign_shards(range(2), 4, "accumulate"))
    np.testing.assert_array_equal(first["model_state"]["m"], np.full(2, 6, np.float32))


def test_at_most_max_chunks_owners_whatever_the_slice_count():
    """Past MAX_CHUNKS slices the driver's refs would grow as slices x chunks."""
    from ray_elastic.dispatch.exchange import MAX_CHUNKS, ExchangeSpec

    spec = ExchangeSpec(blocks=64)
    assignment = assign_shards(range(64), 64, "accumulate")
    assert spec.plan(assignment, 64, 8).chunks == MAX_CHUNKS
    assert spec.plan(assignment, 3, 8).chunks == 3
    assert spec.plan(assignment, 2, 8).chunks == 1  # two slices: no owner, the applies sum
    plan = spec.plan(assignment, 64, 8)
    got, _ = _exchange(plan, {s: (s,) for s in range(64)})
    want, _ = _exchange(ExchangePlan(1, 64, plan.shards, 8), {s: (s,) for s in range(64)})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_sums_are_fresh_aligned_arrays_that_assemble_takes_without_a_copy():
    """A fold's sums start on a 64-byte boundary (XLA's CPU client then
    takes them without a copy), and assemble keeps a whole-leaf sum as it
    is, but copies what is not wholly its own (a read-only view)."""
    from ray_elastic.worker.chunks import ALIGN, aligned_empty, fold

    def stored(x):  # as the object store gives arrays: read-only views of its buffer
        x = np.asarray(x)
        return np.frombuffer(x.tobytes(), x.dtype).reshape(x.shape)

    a = [stored(np.arange(1000, dtype=np.float32)), stored(np.float32(1))]
    b = [stored(np.ones(1000, np.float32)), stored(np.float32(2))]
    summed = fold([a, b])
    assert all(s.ctypes.data % ALIGN == 0 and s.flags.writeable for s in summed)
    assert float(summed[1]) == 3.0 and summed[1].shape == ()
    leaves = assemble([{"chunk": 0, "sum": summed}], [summed[0], summed[1]])
    assert np.shares_memory(leaves[0], summed[0])  # taken as it is
    assert leaves[0].ctypes.data % ALIGN == 0
    # A read-only view (a sum from another slice, through the object store) is copied, aligned.
    copied = assemble([{"chunk": 0, "sum": a}], [a[0], a[1]])
    assert not np.shares_memory(copied[0], a[0]) and copied[0].flags.writeable and copied[0].ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(copied[0], a[0])
    # Part of a fresh array is not all of it: copied too.
    part = aligned_empty((8,), np.float32)[:4]
    assert not np.shares_memory(assemble([{"chunk": 0, "sum": [part]}], [part])[0], part)
