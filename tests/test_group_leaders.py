"""Group leaders' pure parts: the shard ranges, the groups and the
assignment (data.py), and the tree they build, which must be the tree the
driver alone builds (the same additions in the same order: bitwise the
same sums). On a real cluster: tests/test_group_leaders_e2e.py."""

from __future__ import annotations

import itertools

import pytest

from ray_elastic import ConfigError, ElasticConfig
from ray_elastic.data import assign_shards, leader_groups, leader_ranges


def _deeper(n: int, built: int, fan: int) -> bool:  # StepRunner._deeper
    return n > fan or (built > 0 and n > 1)


def _levels(nodes: list, built: int, fan: int, stop=None) -> tuple[list, int]:
    """Reduce `nodes` (trees) level by level as StepRunner does, until
    `stop` levels are built (None: as deep as the driver alone goes)."""
    while (built < stop) if stop is not None else _deeper(len(nodes), built, fan):
        nodes = [tuple(nodes[j:j + fan]) for j in range(0, len(nodes), fan)]
        built += 1
    return nodes, built


def _flat(shards: int, fan: int):
    return _levels(list(range(shards)), 0, fan)[0]


def _grouped(shards: int, slices: int, per_leader: int, fan: int):
    ranges, depth = leader_ranges(shards, slices, per_leader, fan)
    tops = []
    for lo, hi in ranges:
        tops += _levels(list(range(lo, hi)), 0, fan, stop=depth)[0]
    return _levels(tops, depth, fan)[0]


@pytest.mark.parametrize("fan", [2, 8])
def test_the_leaders_tree_is_the_drivers_tree(fan):
    """Every leader reduces whole subtrees of the driver's tree, and the
    driver's top continues it: the nested grouping of every addition is
    the same, for any shard count, slice count and group size."""
    for shards, per_leader in itertools.product(range(fan + 1, 300, 7), (2, 3, 8, 32, 64)):
        slices = shards
        if per_leader >= slices:
            continue
        assert _grouped(shards, slices, per_leader, fan) == _flat(shards, fan), (shards, per_leader, fan)


def test_ranges_at_1024_slices():
    ranges, depth = leader_ranges(1024, 1024, 32, 8)
    assert len(ranges) == 32 and ranges[0] == (0, 32) and ranges[-1] == (992, 1024) and depth == 1
    ranges, depth = leader_ranges(1024, 1024, 64, 8)
    assert len(ranges) == 16 and depth == 2  # 64 shards: two whole levels each


def test_each_group_computes_its_own_range():
    ranges = [(0, 4), (4, 8)]
    full = assign_shards(range(8), 8, "accumulate", ranges)
    assert full == {s: (s,) for s in range(8)}
    # Slice 1 lost: its group's survivors share its range, and no shard
    # leaves its range's group.
    after = assign_shards([0, 2, 3, 4, 5, 6, 7], 8, "accumulate", ranges)
    groups = leader_groups([0, 2, 3, 4, 5, 6, 7], ranges)
    for slices, held in groups:
        mine = {sh for s in slices for sh in after[s]}
        assert mine == {sh for lo, hi in held for sh in range(lo, hi)}
    assert sorted(sh for v in after.values() for sh in v) == list(range(8))


def test_fewer_slices_than_ranges():
    """Down to fewer live slices than leaders: one slice per group, and
    each takes whole ranges."""
    ranges = [(0, 2), (2, 4), (4, 6)]
    assert leader_groups([3, 5], ranges) == [([3], [(0, 2), (2, 4)]), ([5], [(4, 6)])]
    assert assign_shards([3, 5], 6, "accumulate", ranges) == {3: (0, 1, 2, 3), 5: (4, 5)}


@pytest.mark.parametrize("kw, words", [
    ({"slices_per_leader": 1}, "at least 2"),
    ({"slices_per_leader": -2}, "at least 2"),
    ({"slices_per_leader": 4}, "one leader"),
    ({"slices_per_leader": 2, "policy": "resize", "batch_on_resize": "shrink"}, "accumulate"),
])
def test_bad_group_settings_are_named(kw, words):
    with pytest.raises(ConfigError) as e:
        ElasticConfig(num_slices=4, **kw)
    assert e.value.setting == "slices_per_leader" and words in str(e.value)
