"""StepRunner's re-issue of a call whose error is transient (the worker
answers a ping right after), with Ray's object API faked: a real
`ActorUnavailableError` cannot be made to order on a local cluster. The
errors are Ray's own classes; the failure classification (failures/location.py)
is the real one, over a probe whose workers all answer."""

from __future__ import annotations

import types

import pytest
from ray import exceptions as rex

import ray_elastic.dispatch.step_runner as step_runner
from ray_elastic.errors import SliceFailure
from ray_elastic.failures.location import FailureLocator
from ray_elastic.cluster.slice_group import LiveSlice
from ray_elastic.dispatch.step_runner import StepRunner


class Ref:
    """Stands for an ObjectRef: a value, or the error a get raises."""

    def __init__(self, value=None, error: Exception = None):
        self.value, self.error = value, error


def _get(x):
    if isinstance(x, list):
        return [_get(r) for r in x]
    if x.error is not None:
        raise x.error
    return x.value


def _fake_ray(clock):
    def wait(refs, num_returns=1, timeout=None):
        clock.t += 0.01  # every wait takes a little time: a loop meets its deadline
        return list(refs[:num_returns]), list(refs[num_returns:])

    return types.SimpleNamespace(wait=wait, get=_get, cancel=lambda ref: None)


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class _Method:
    def __init__(self, fn, num_returns: int = 1):
        self._fn, self._num_returns = fn, num_returns

    def options(self, num_returns: int = 1, **_):
        return _Method(self._fn, num_returns)

    def remote(self, *args):
        # As in Ray: a call whose argument (a ref, not one inside a list)
        # failed never runs, and its returns hold that error.
        failed = [a.error for a in args if isinstance(a, Ref) and a.error is not None]
        if failed:
            refs = [Ref(error=failed[0]) for _ in range(self._num_returns)]
            return refs[0] if self._num_returns == 1 else refs
        return self._fn(*args)


def _unavailable() -> Exception:
    return rex.ActorUnavailableError("the actor is temporarily unreachable", None)


class _Worker:
    """A slice's one host: sums its inputs; `flaky` names the calls whose
    first try fails with ActorUnavailableError, as a brief network fault would."""

    def __init__(self, s: int, flaky: set, calls: list, h: int = 0):
        self.s, self.h, self._flaky, self._calls = s, h, flaky, calls
        self.compute_grads = _Method(self._grads)
        self.reduce = _Method(self._reduce)
        self.apply = _Method(self._apply)
        self.take_inputs = _Method(self._take)
        self._taken = None  # the inputs take_inputs fetched
        self.snapshot = _Method(self._snapshot)
        self._begun = None  # the snapshot the last apply began
        self.ping = _Method(lambda: Ref(True))
        self.abort_waits = _Method(lambda epoch, from_step: calls.append(("abort_waits", s, h, epoch, from_step)))

    def _fails(self, name: str) -> bool:
        self._calls.append((name, self.s))
        if (name, self.s) in self._flaky:
            self._flaky.discard((name, self.s))
            return True
        return False

    def _grads(self, k, shards, *after):
        self._calls.append(("grads ran", self.s, self.h, k))
        if self._fails("grads"):
            return Ref(error=_unavailable()), Ref(error=_unavailable())
        if self.h > 0:  # host 0 sends the slice's gradients
            return Ref({"loss": 1.0}), Ref({})
        return Ref({"loss": 1.0}), Ref({shard: float(shard + 1) for shard in shards})

    @staticmethod
    def _inputs(parts):
        failed = [p.error for p in parts if p.error is not None]
        return failed[0] if failed else None

    def _reduce(self, k, keys, parts, epoch):
        # A real worker's fetch of an errored input raises it again, and
        # the call's error is that input's (RayTaskError.as_instanceof_cause).
        error = self._inputs(parts)
        if error is not None or self._fails("reduce"):
            error = error or _unavailable()
            return Ref(error=error), Ref(error=error)
        total = sum(v for p in parts for v in p.value.values())
        return Ref({"count": len(keys)}), Ref({keys[0]: total})

    def _take(self, k, parts, epoch):
        error = self._inputs(parts)
        if error is not None:
            return Ref(error=error)
        self._taken = parts
        return Ref(k)

    def _apply(self, k, take, parts, epoch, *taken):
        if ("apply dies", self.s, self.h) in self._flaky:
            return Ref(error=rex.ActorDiedError())
        parts = self._taken if taken else parts
        error = self._inputs(parts)
        if error is not None or self._fails("apply"):
            return Ref(error=error or _unavailable())
        self._calls.append(("applied", self.s, self.h, k))
        total = sum(v for p in parts for v in p.value.values())
        if take:
            self._begun = {"step": k + 1, "sum": total}
        return Ref({"step": k + 1, "loss": total})

    def _snapshot(self, k, after):  # run by the fake Ray only once `after` (the apply) succeeded
        return Ref({"step": k + 1, "bytes": 8}), Ref(self._begun)


class _Probe:
    def __init__(self):
        self.lost: set = set()  # the nodes gone

    def node_alive(self, node_id):
        return node_id not in self.lost

    def raylet_reachable(self, node_id):
        return node_id not in self.lost

    def ping(self, worker, timeout_s):
        return True


@pytest.fixture
def runner(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(step_runner, "ray", _fake_ray(clock))
    locator = FailureLocator(_Probe(), clock, lambda s: setattr(clock, "t", clock.t + s), confirm_s=1.0)
    return StepRunner(locator, clock, fan_in=2, pipeline=True)


def _slices(flaky: set, calls: list, n: int = 3) -> dict:
    return {s: LiveSlice(s, [_Worker(s, flaky, calls)], [{"node_id": f"node-{s}", "pid": 100 + s, "ip": ""}])
            for s in range(n)}


def test_a_gradient_call_reissued_under_a_tree_still_completes_the_step(runner):
    """3 slices, fan-in 2: the tree's reduce calls took slice 1's first
    payload. Once its gradient call is re-issued they can only fail on that
    input, and re-issuing them would fail the same way until the step's
    deadline, blaming a healthy slice; the step is handed off again on the
    new payloads instead."""
    calls: list = []
    live = _slices({("grads", 1)}, calls)
    assignment = {s: (s,) for s in live}
    result = runner.run(0, live, assignment, frozenset({0}), deadline_s=5.0)
    assert set(result.metrics) == {(0, 0), (1, 0), (2, 0)}
    assert all(m["loss"] == 6.0 for m in result.metrics.values())  # 1 + 2 + 3: every shard, once
    assert calls.count(("grads", 1)) == 2  # re-issued once, no more
    assert result.snapshots[0].value == {"step": 1, "sum": 6.0}


def test_a_reissued_apply_hands_back_its_own_snapshot(runner):
    calls: list = []
    live = _slices({("apply", 0)}, calls)
    result = runner.run(0, live, {s: (s,) for s in live}, frozenset({0}), deadline_s=5.0)
    assert calls.count(("apply", 0)) == 2
    snap = result.snapshots[0]
    assert snap.error is None and snap.value == {"step": 1, "sum": 6.0}


def test_a_call_that_keeps_failing_is_still_a_failure(runner):
    """The guard is not a blanket retry: a worker that does not answer its
    ping is the slice's failure."""
    calls: list = []
    live = _slices(set(), calls)

    def grads(k, shards, *after):
        return Ref(error=_unavailable()), Ref(error=_unavailable())

    live[2].workers[0].compute_grads = _Method(grads)
    live[2].workers[0].ping = _Method(lambda: Ref(error=_unavailable()))
    runner.locator.probe.ping = lambda worker, timeout_s: _get(worker.ping.remote())
    with pytest.raises(SliceFailure) as e:
        runner.run(0, live, {s: (s,) for s in live}, frozenset(), deadline_s=5.0)
    assert e.value.slice_id == 2


def test_no_host_computes_the_next_step_unless_its_whole_slice_applied(runner):
    """Two hosts a slice, the next step issued ahead: host 1 of slice 1
    dies in its apply. Host 0's next gradient call must not run (alone, it
    would enter collectives its peer never joins, and hold its one gradient
    thread): it waits for every apply of its slice, and one failed."""
    calls: list = []
    flaky = {("apply dies", 1, 1)}
    live = {s: LiveSlice(s, [_Worker(s, flaky, calls, h) for h in range(2)],
                         [{"node_id": f"node-{s}-{h}", "pid": 100 + 2 * s + h, "ip": ""} for h in range(2)])
            for s in range(3)}
    assignment = {s: (s,) for s in live}
    with pytest.raises(SliceFailure) as e:
        runner.run(0, live, assignment, frozenset(), deadline_s=5.0, ahead=assignment)
    assert e.value.slice_id == 1
    ran = {(s, h) for name, s, h, k in (c for c in calls if c[0] == "grads ran") if k == 1}
    assert (1, 0) not in ran and (1, 1) not in ran
    assert {(0, 0), (0, 1), (2, 0), (2, 1)} <= ran  # the other slices' went ahead as issued


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_slice_applies_a_step_on_all_its_hosts_or_none(runner, pipeline):
    """Two slices of two hosts, each host holding its own blocks (a
    sharded layout). Slice 1 host 1's node goes once its gradients are
    computed: they are lost, and slice 0's host 1, whose apply sums them,
    cannot have its inputs. Slice 0's host 0 has its own, but its apply is
    one program with host 1 (a global norm's all-reduce): alone, it would
    wait in that for good and leave the slice a step apart from itself,
    with no one step to resume from. Neither host of slice 0 applies, and
    the failure is slice 1's."""
    runner.pipeline = pipeline
    calls: list = []
    runner.locator.probe.lost = {"node-1-1"}
    live = {s: LiveSlice(s, [_Worker(s, set(), calls, h) for h in range(2)],
                         [{"node_id": f"node-{s}-{h}", "pid": 10 * s + h, "ip": ""} for h in range(2)], per_host=True)
            for s in range(2)}
    lost = rex.ObjectLostError("ab" * 14, None, "")
    live[1].workers[1].compute_grads = _Method(lambda k, shards, *after: (Ref({"loss": 1.0}), Ref(error=lost)))
    with pytest.raises(SliceFailure) as e:
        runner.run(0, live, {0: (0,), 1: (1,)}, frozenset(), deadline_s=5.0)
    assert (e.value.slice_id, e.value.kind.value) == (1, "node_died")
    runner.settle_applies(timeout_s=1.0, slices={0}, abort_waits=True)
    assert not [c for c in calls if c[0] == "applied" and c[1] == 0], calls


def test_after_a_failure_the_calls_issued_ahead_give_up_whatever_was_lost(runner):
    """Step 0 fails (slice 1 dies in its apply) with step 1 issued ahead.
    After a process death the survivors' own step-0 applies still complete
    (no abort for them), but the reductions issued ahead for step 1 wait
    for gradients nobody will read, on the threads the survivors' status
    calls need: they are told to give up. A node loss gives up on all."""
    from ray_elastic.worker.inputs import Aborts

    calls: list = []
    live = _slices({("apply dies", 1, 0)}, calls)
    assignment = {s: (s,) for s in live}
    with pytest.raises(SliceFailure):
        runner.run(0, live, assignment, frozenset(), deadline_s=5.0, ahead=assignment)
    runner.settle_applies(timeout_s=1.0, slices={0, 2}, abort_waits=False)
    sent = [c[1:] for c in calls if c[0] == "abort_waits"]
    assert sent == [(0, 0, 0, 1), (2, 0, 0, 1)]  # (slice, host, epoch, from step 1): survivors only
    runner.settle_applies(timeout_s=1.0, slices={0, 2}, abort_waits=True)
    assert [c[1:] for c in calls if c[0] == "abort_waits"][2:] == [(0, 0, 1, 0), (2, 0, 1, 0)]

    aborts = Aborts()  # what a worker makes of the first
    aborts.abort(0, 1)
    assert aborts.covers(0, 1) and aborts.covers(0, 2)  # issued ahead, in the failed epoch
    assert not aborts.covers(0, 0)  # the failed step's own calls go on
    assert not aborts.covers(1, 1)  # calls issued after the failure
    aborts.abort(1, 0)  # the node loss
    assert aborts.covers(0, 0) and aborts.covers(1, 5) and not aborts.covers(2, 0)


def test_after_a_failure_the_reissued_apply_is_the_one_waited_for(runner):
    """Slice 0's apply was re-issued (a transient error on its first try).
    A failure later in the step settles the applies before the survivors
    say which step they hold: the one to wait for is the re-issue (the
    first try is over, as a failure), else a survivor could be read before
    its apply lands and be rewound under a state that then moves on."""
    calls: list = []
    live = _slices({("apply", 0)}, calls)
    runner.run(0, live, {s: (s,) for s in live}, frozenset(), deadline_s=5.0)
    waited: list = []
    fake_wait = step_runner.ray.wait
    step_runner.ray.wait = lambda refs, **kw: (waited.extend(refs), fake_wait(refs, **kw))[1]
    runner.settle_applies(timeout_s=1.0, slices={0, 1, 2})
    assert len(waited) == 3
    assert all(r.error is None for r in waited)  # the first try (its error) is not among them


def test_a_slices_gradient_calls_wait_for_its_check_on_every_host(runner):
    """A cross-check's recomputations on a slice (run_first) are
    arguments of each of that slice's gradient calls of the step, on every
    host: Ray then runs the check first everywhere, and the hosts' programs
    pair their collectives in one order. Other slices and steps take none."""
    calls: list = []
    live = {s: LiveSlice(s, [_Worker(s, set(), calls, h) for h in range(2)],
                         [{"node_id": f"node-{s}-{h}", "pid": 10 * s + h, "ip": ""} for h in range(2)])
            for s in range(2)}
    seen: dict = {}
    for s in live:
        for h, w in enumerate(live[s].workers):
            real = w._grads

            def grads(k, shards, *after, s=s, h=h, real=real):
                seen[(k, s, h)] = after
                return real(k, shards)

            w.compute_grads = _Method(grads)
    checks = [Ref(111), Ref(222)]  # slice 1's hosts' recompute calls
    runner.run_first(4, 1, checks)
    runner.run_first(2, 0, [Ref(9)])  # an older step's: forgotten
    runner.run(4, live, {0: (0,), 1: (1,)}, frozenset(), deadline_s=5.0)
    assert seen[(4, 1, 0)] == tuple(checks) and seen[(4, 1, 1)] == tuple(checks)
    assert seen[(4, 0, 0)] == () and seen[(4, 0, 1)] == ()
    runner.run(5, live, {0: (0,), 1: (1,)}, frozenset(), deadline_s=5.0)
    assert all(seen[(5, s, h)] == () for s in live for h in range(2))
