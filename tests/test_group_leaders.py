"""Group leaders' pure parts: the shard ranges, the groups and the
assignment (dispatch/assignment.py), and the tree they build, which must be the tree the
driver alone builds (the same additions in the same order: bitwise the
same sums). On a real cluster: tests/test_group_leaders_e2e.py."""

from __future__ import annotations

import itertools

import pytest

from ray_elastic import ConfigError, ElasticConfig
from ray_elastic.dispatch.assignment import assign_shards, leader_groups, leader_ranges
from ray_elastic.dispatch.tree import deeper, refs_of


def _levels(nodes: list, built: int, fan: int, stop=None) -> tuple[list, int]:
    """Reduce `nodes` (trees) level by level as StepRunner does, until
    `stop` levels are built (None: as deep as the driver alone goes, by
    the runner's own `deeper`)."""
    while (built < stop) if stop is not None else deeper(len(nodes), built, fan):
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


class _Call:
    """A fake actor method: `.options(...).remote(...)` returns plain
    values standing in for refs, so the real tree-building code runs."""

    def __init__(self, fn):
        self._fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        return self._fn(*args)


class _Worker:
    def __init__(self, s: int):
        self.compute_grads = _Call(lambda k, shards, *after: (("status", s), ("payload", tuple(shards))))
        self.reduce = _Call(lambda k, keys, parts, epoch=0: (("status", keys), ("sum", tuple(keys), tuple(parts))))


class _Slice:
    def __init__(self, s: int):
        self.workers, self.infos, self.per_host = [_Worker(s)], [{"node_id": "n"}], False


def _structure(part, key):
    """The additions a reduce node makes, as nested keys: what decides
    its sum's bits (reduction.reduce_pieces picks each piece by key)."""
    if part[0] == "payload":
        return key
    return tuple(_structure(_holding(part[2], k), k) for k in part[1])


def _holding(parts, key):
    for p in parts:
        if (p[0] == "payload" and key in p[1]) or (p[0] == "sum" and p[1][0] == key):
            return p
    raise AssertionError(f"no part holds {key}")


@pytest.mark.parametrize("fan, shards, per_leader, lost", [
    (2, 16, 4, ()), (2, 64, 16, ()), (2, 64, 16, (3, 17, 40)), (2, 100, 24, (0,)), (2, 40, 16, (5, 6, 7)),
    (2, 24, 8, tuple(range(2, 24))), (8, 100, 24, ()), (8, 300, 64, (1, 99, 250)), (8, 1024, 64, (7,)),
    (8, 1000, 32, ()),
])
def test_the_leaders_code_builds_the_drivers_tree(fan, shards, per_leader, lost):
    """The real code, on fake workers: the driver alone (StepRunner.issue_step
    over every live slice) against the leaders (assignment.assign_shards and
    leader_groups, leader.issue_subtrees per group, then
    GroupedRunner.issue_top), after losing the slices `lost`: the same
    additions in the same order."""
    from ray_elastic.dispatch.leader import issue_subtrees
    from ray_elastic.dispatch.grouped_runner import GroupedRunner
    from ray_elastic.dispatch.step_runner import StepRunner
    from ray_elastic.dispatch.tree import tops_of

    live = {s: _Slice(s) for s in range(shards) if s not in lost}
    flat = StepRunner(None, lambda: 0.0, fan_in=fan, pipeline=True)
    issued = flat.issue_step(0, live, assign_shards(live, shards, "accumulate"))
    (flat_top,) = refs_of(issued.tops[0])
    ranges, depth = leader_ranges(shards, shards, per_leader, fan)
    assert len(ranges) >= 2
    assignment = assign_shards(live, shards, "accumulate", ranges)
    tops = []
    for slices, held in leader_groups(live, ranges):
        runner = StepRunner(None, lambda: 0.0, fan_in=fan, pipeline=True)
        part = issue_subtrees(runner, 0, {s: live[s] for s in slices}, {s: assignment[s] for s in slices}, held, depth)
        tops += tops_of(part.tops[0])
    grouped = GroupedRunner(None, lambda: 0.0, ranges, depth, fan_in=fan)
    [top], _ = grouped.issue_top(0, live, sorted(tops, key=lambda t: t.key))
    assert top.key == 0 and _structure(top.ref, 0) == _structure(flat_top, 0)


def test_leader_replies_cross_a_process_with_their_failure():
    """A leader's answers are named dataclasses told apart by class, and a
    failure keeps its fields on the way (no side channel): the driver
    ranks it by phase and learns whether the group kept its gradients."""
    from ray import cloudpickle

    from ray_elastic.dispatch.replies import Applied, Failed, LeaderPhase, Ready
    from ray_elastic.dispatch.tree import Top
    from ray_elastic.errors import WorkerHung

    failed = Failed(WorkerHung(4, 0, 9, "no answer", node_silent=True, leader_partial=True), LeaderPhase.GRADS)
    back = cloudpickle.loads(cloudpickle.dumps(failed))
    assert isinstance(back, Failed) and back.phase is LeaderPhase.GRADS
    assert back.failure.node_silent and back.failure.leader_partial and back.failure.partial is None
    assert cloudpickle.loads(cloudpickle.dumps(Ready((Top(0, "ref"),), 2))) == Ready((Top(0, "ref"),), 2)
    assert cloudpickle.loads(cloudpickle.dumps(Applied({(0, 0): {"loss": 1.0}}, None))).next_tops is None


def test_a_single_leader_range_is_refused_before_any_resource():
    """4 slices in leaders of 2 would be 2 leaders, but the reduction tree's
    fan-in (8 shards) makes the 4 shards one range: the trainer's
    constructor says so, before Ray is even started."""
    import ray

    from ray_elastic import ElasticTrainer

    was_up = ray.is_initialized()
    with pytest.raises(ConfigError) as e:
        ElasticTrainer(lambda: None, ElasticConfig(num_slices=4, slices_per_leader=2), 10)
    assert e.value.setting == "slices_per_leader" and "fan-in" in str(e.value)
    assert ray.is_initialized() == was_up
