"""Calls given up on are read once done (dispatch/unread.py), with Ray's
object API faked: which replies are read, which other returns, and that a
call given up on twice is waited for and read once (Ray's wait refuses a
list that names a ref twice)."""

from __future__ import annotations

import types

import pytest

from ray_elastic.dispatch.unread import Dropped, Unread


class Ref:
    def __init__(self, name, done=True, error=False):
        self.name, self.done, self.error = name, done, error


def _api(read: list):
    def wait(refs, num_returns=1, timeout=None):
        assert len(set(map(id, refs))) == len(refs), "Ray's wait refuses a ref named twice"
        done = [r for r in refs if r.done]
        return done, [r for r in refs if not r.done]

    def get(ref):
        read.append(ref.name)
        if ref.error:
            raise RuntimeError(ref.name)
        return ref.name

    return types.SimpleNamespace(wait=wait, get=get)


def test_done_calls_are_read_once_and_a_failed_calls_other_returns_too():
    read: list = []
    u = Unread(_api(read))
    ok, failed, running = Ref("ok"), Ref("failed", error=True), Ref("running", done=False)
    u.add(ok, (Ref("big payload"),))  # a good reply: its payload is never fetched
    u.add(failed, (Ref("its payload", error=True),))
    u.add(failed)  # given up on twice
    u.add(running)
    assert u.sweep() == 2 and len(u) == 1
    assert read == ["ok", "failed", "its payload"]
    running.done = True
    assert u.sweep() == 1 and len(u) == 0 and read[-1] == "running"
    assert u.sweep() == 0


def test_released_calls_are_let_go_read_or_not():
    read: list = []
    u = Unread(_api(read))
    ended = Ref("ended")
    u.add(ended, (Ref("payload"),))
    u.add(Ref("still running", done=False), (Ref("its payload"),))
    assert u.release() == 2 and len(u) == 0 and u.sweep() == 0
    assert read == []  # nothing fetched: a payload is let go, not read
    u.add(ended)  # a call let go is forgotten: given up on again, it is kept again
    assert len(u) == 1


def test_a_step_dropped_twice_is_waited_for_once():
    read: list = []
    d = Dropped(_api(read))
    call = types.SimpleNamespace(slice_id=0, host=0, ref=Ref("grads", error=True))
    issued = types.SimpleNamespace(grads=[call], payloads={0: {0: Ref("payload", error=True)}}, levels=[])
    d.drop(issued)
    d.drop(issued)
    d.settle(1.0, {0: object()})
    assert read == ["grads", "payload"]


@pytest.mark.parametrize("n", [5000])
def test_at_most_a_bounded_number_of_calls_are_kept(n):
    u = Unread(_api([]))
    for i in range(n):
        u.add(Ref(i, done=False))
    assert len(u) == 4096
