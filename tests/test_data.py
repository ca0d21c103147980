"""Unit tests for ray_elastic.dispatch.assignment: shard assignment and host row splits."""

from __future__ import annotations

import itertools

import pytest

from ray_elastic.dispatch.assignment import assign_shards, host_rows

NUM = 4


def nonempty_subsets(n):
    for r in range(1, n + 1):
        yield from itertools.combinations(range(n), r)


@pytest.mark.parametrize("live", list(nonempty_subsets(NUM)))
def test_accumulate_covers_every_shard_once(live):
    out = assign_shards(live, NUM, "accumulate")
    assert set(out) == set(live)
    shards = [s for v in out.values() for s in v]
    assert sorted(shards) == list(range(NUM))  # every shard exactly once
    # load is balanced to within one shard
    sizes = [len(v) for v in out.values()]
    assert max(sizes) - min(sizes) <= 1
    # each slice's shards are in ascending order
    for v in out.values():
        assert list(v) == sorted(v)


def test_accumulate_all_live_is_identity():
    assert assign_shards(range(NUM), NUM, "accumulate") == {i: (i,) for i in range(NUM)}


def test_accumulate_examples():
    assert assign_shards({0, 2}, 4, "accumulate") == {0: (0, 2), 2: (1, 3)}
    assert assign_shards([3], 4, "accumulate") == {3: (0, 1, 2, 3)}
    # order of input does not matter
    assert assign_shards([3, 1], 4, "accumulate") == assign_shards([1, 3], 4, "accumulate")


@pytest.mark.parametrize("live", list(nonempty_subsets(NUM)))
def test_shrink_gives_each_slice_its_own_shard(live):
    out = assign_shards(live, NUM, "shrink")
    assert out == {s: (s,) for s in live}


def test_accepts_any_iterable():
    assert assign_shards(iter([1, 0]), 2, "accumulate") == {0: (0,), 1: (1,)}
    assert assign_shards(frozenset({1}), 2, "shrink") == {1: (1,)}


@pytest.mark.parametrize("mode", ["accumulate", "shrink"])
@pytest.mark.parametrize("live", [[], set(), ()])
def test_empty_live_raises(live, mode):
    with pytest.raises(ValueError, match="no live slices"):
        assign_shards(live, NUM, mode)


@pytest.mark.parametrize("mode", ["grow", "", "Accumulate"])
def test_unknown_mode_raises(mode):
    with pytest.raises(ValueError, match="unknown batch mode"):
        assign_shards([0, 1], NUM, mode)


@pytest.mark.parametrize("rows,hosts", [(8, 1), (8, 2), (8, 4), (12, 3), (6, 6)])
def test_host_rows_split_evenly(rows, hosts):
    parts = [host_rows(rows, h, hosts) for h in range(hosts)]
    per = rows // hosts
    for h, p in enumerate(parts):
        assert p == slice(h * per, (h + 1) * per)
    covered = [i for p in parts for i in range(rows)[p]]
    assert covered == list(range(rows))


@pytest.mark.parametrize("rows,hosts", [(7, 2), (10, 4), (1, 2)])
def test_host_rows_rejects_uneven(rows, hosts):
    with pytest.raises(ValueError, match="does not split evenly"):
        host_rows(rows, 0, hosts)


def test_rows_fed_is_a_hosts_share_or_every_row():
    from ray_elastic.dispatch.assignment import rows_fed

    # The batch split over 2 hosts x 2 devices: host 1 holds rows 4..8.
    assert rows_fed([slice(4, 6), slice(6, 8)], 8) == slice(4, 8)
    # Batch axes that do not span the hosts (tensor parallel across them):
    # every device holds the whole batch, so the host feeds every row.
    assert rows_fed([slice(None, None)], 8) == slice(0, 8)
    assert rows_fed([slice(None, None), slice(None, None)], 8) == slice(0, 8)
    with pytest.raises(ValueError, match="not one range"):
        rows_fed([slice(0, 2), slice(4, 6)], 8)
