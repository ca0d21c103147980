"""Where a failure is, and what kind it is: the one place where Ray's
errors become ray_elastic's failure kinds.

A call's error is sorted where it enters the controller (`classify`). An
`ActorUnavailableError` is *not* a death: the actor may be restarting its
connection. It is confirmed first (node state in the GCS, then a ping) and
only a confirmed loss becomes a failure. A call can also fail for a peer's
sake (a gradient it fetched lived on a node that died), so the slice blamed
is the one that lost a node (`blame`); a step that outlives its deadline is
pinned on the host that does not answer a ping (`hung`).

Ray sits behind `Probe` (is a node alive, does a worker answer) and time is
passed in, so the logic is tested without a cluster.
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol

import ray
from ray import exceptions as rex

from ray_elastic.errors import FAILURE_TYPES, FailureKind, SliceFailure
from ray_elastic.failures import process_state, ray_errors
from ray_elastic.failures.heartbeats import Heartbeats
from ray_elastic.failures.internal import InputsAborted, InputsLost

__all__ = ["FailureLocator", "Probe", "RayProbe", "TRANSIENT", "failure", "is_node_alive", "ping_ref", "refuses", "runtime_error",
           "short", "watched_wait"]

TRANSIENT = None  # classify's answer for "not a failure: re-issue the call"
# How long a raylet has to complete a handshake before its node counts as
# silent (frozen or cut off): a hung host's replacement then gets a new
# placement group, the one cost of a wrong guess.
HANDSHAKE_S = 0.2
# A host's heartbeat timeout in its first step (a new process importing,
# tracing and compiling beside its peers): see
# heartbeats.py. A process frozen then is found in this long.
FIRST_STEP_HEARTBEAT_S = 15.0
# Seconds a host found silent by its heartbeats is given to show it died
# instead (a death Ray has just told the driver of): a stopped process is
# named hung this much later. Kept short: 0.5 s took a stopped worker's
# detection past 2 s (`python -m bench detect`), and a death Ray reports
# later still (a SIGKILL on a host whose cores are saturated) is named
# hung, recovered the same way.
DEATH_NOTICE_S = 0.1
# How long a node's watcher has to say whether a silent worker is stopped
# or busy (it answers in milliseconds; a node that does not is silent).
WATCHER_S = 0.5
# How often a watched wait (watched_wait) looks at its hosts: as a step's
# wait does (dispatch/step_runner.py's NODE_PROBE_S).
WATCH_EVERY_S = 0.25


class Probe(Protocol):
    def node_alive(self, node_id: str) -> bool:
        """Ray's node table: True until its health checks give up."""

    def raylet_reachable(self, node_id: str) -> bool:
        """Whether the node's raylet accepts a connection now (False at once
        when its process is gone, long before the health checks say so)."""

    def raylet_refuses(self, node_id: str) -> bool:
        """The node's raylet is gone for sure: its port refuses connections.
        A timeout proves nothing (a slow network, a busy host), so it is
        not taken for a loss here."""

    def raylet_answers(self, node_id: str) -> bool:
        """Whether the node's raylet completes a handshake: a frozen node
        (stopped, or its traffic dropped) still looks reachable to a bare
        connect, but answers nothing."""

    def ping(self, worker: Any, timeout_s: float) -> None:
        """Raise a RayError if the worker does not answer within timeout_s."""

    def process_state(self, node_id: str, pid: int) -> Optional[str]:
        """The worker process's state as its node's kernel has it
        (process_state.py: BUSY, STOPPED, GONE), or None where it cannot be
        asked in time."""


def ping_ref(worker: Any):
    """A liveness ping's reply. On the workers' `control` group: their
    default group's threads may all be taken by reduce and apply calls
    waiting for inputs, and a busy worker is not a dead or frozen one."""
    return worker.ping.options(concurrency_group="control").remote()


def is_node_alive(node_id: str) -> bool:
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return bool(node["Alive"])
    return False


def refuses(address: tuple[str, int], timeout_s: float) -> bool:
    """Nothing listens at the address: the connection is refused. A
    timeout or an unreachable network is not a refusal."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class RayProbe:
    def __init__(self, connect_timeout_s: float = 0.5):
        self._connect_timeout_s = connect_timeout_s
        self._raylets: dict[str, tuple[str, int]] = {}  # node -> its raylet's address
        self._watchers: dict[str, Any] = {}  # node -> its NodeWatcher

    def node_alive(self, node_id: str) -> bool:
        return is_node_alive(node_id)

    def _address(self, node_id: str) -> Optional[tuple[str, int]]:
        if node_id not in self._raylets:
            for node in ray.nodes():
                self._raylets[node["NodeID"]] = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
        return self._raylets.get(node_id)

    def raylet_reachable(self, node_id: str) -> bool:
        address = self._address(node_id)
        if address is None:
            return False  # not a node of this cluster (any more)
        try:
            socket.create_connection(address, timeout=self._connect_timeout_s).close()
            return True
        except OSError:  # refused (the raylet is gone) or no route / timeout
            return False

    def raylet_refuses(self, node_id: str, timeout_s: float = 0.1) -> bool:
        address = self._address(node_id)
        return address is not None and refuses(address, timeout_s)

    def raylet_answers(self, node_id: str) -> bool:
        import grpc

        address = self._address(node_id)
        if address is None:
            return False
        channel = grpc.insecure_channel(f"{address[0]}:{address[1]}")
        try:  # the HTTP/2 handshake needs the raylet process itself (milliseconds when it runs)
            grpc.channel_ready_future(channel).result(timeout=HANDSHAKE_S)
            return True
        except grpc.FutureTimeoutError:
            return False
        finally:
            channel.close()

    def ping(self, worker: Any, timeout_s: float) -> None:
        ray.get(ping_ref(worker), timeout=timeout_s)

    def watch(self, node_ids: Iterable[str]) -> None:
        """Make sure the nodes have their watchers (process_state.py), so a
        silence on them can be told busy from stopped at once."""
        for node_id in node_ids:
            if node_id not in self._watchers:
                watcher = process_state.watcher_for(node_id)
                # Its first answer says it is up: until then it is not asked
                # (a question would wait for its process to start).
                self._watchers[node_id] = [watcher, watcher.state.remote(0)]

    def process_state(self, node_id: str, pid: Optional[int]) -> Optional[str]:
        if pid is None or node_id not in self._watchers:  # a simulated worker (the scale bench's), or no watcher
            return None
        watcher, up = self._watchers[node_id]
        if up is not None:
            if not ray.wait([up], timeout=0)[0]:
                return None  # still starting: the silence is judged as without it
            self._watchers[node_id][1] = None
            try:
                ray.get(up, timeout=0)  # read (an error too), so that Ray reports nothing of it
            except rex.RayError:
                pass
        state = process_state.ask(watcher, pid, WATCHER_S)
        if state is None:
            # Not answering: its node silent, or it died (Ray's memory
            # monitor may pick it): made anew for the next silence.
            self._watchers.pop(node_id)
            self.watch([node_id])
        return state

    def heartbeats(self, clock: Callable[[], float], timeout_s: float) -> Heartbeats:
        """Heartbeats over Ray's calls: a ping sent, the refs answered."""
        def answered(refs: list) -> list:
            return ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]

        return Heartbeats(ping_ref, answered, clock, timeout_s=timeout_s, first_timeout_s=FIRST_STEP_HEARTBEAT_S)


def runtime_error(exc: BaseException) -> bool:
    """A worker call that raised JAX's runtime error (an XLA computation,
    collectives included, failed), not a Python error of the program."""
    cause = getattr(exc, "cause", None) if isinstance(exc, rex.RayTaskError) else None
    return cause is not None and type(cause).__name__ in ("JaxRuntimeError", "XlaRuntimeError")


def watched_wait(slice_of: Mapping[Any, int], watch: Callable[[set], Optional[SliceFailure]],
                 clock: Callable[[], float], timeout_s: float) -> Optional[SliceFailure]:
    """Wait up to timeout_s for the calls `slice_of` maps to their slices,
    asking `watch(slices with a call still out)` every WATCH_EVERY_S (a
    step's heartbeats and node checks: FailureLocator.watch): the
    SliceFailure it gives as soon as it gives one (a worker stopped while
    the run recovered was found only when the recovery's call timed out,
    60 s later, where one stopped in a step is found in about a second);
    None once every call is done, or at the timeout (the caller's get then
    fails as it would have). Bounded by polls as well as by `clock`, so a
    clock that stands still (a test's) cannot make it wait forever."""
    pending, end = list(slice_of), clock() + timeout_s
    for _ in range(max(1, int(timeout_s / WATCH_EVERY_S) + 1)):
        remaining = end - clock()
        if not pending or remaining <= 0:
            break
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(remaining, WATCH_EVERY_S))
        if pending and (lost := watch({slice_of[r] for r in pending})) is not None:
            return lost
    return None


def failure(kind: FailureKind, slice_id: int, host: int, step: int, cause: str, partial: Any = None,
            node_silent: bool = False) -> SliceFailure:
    """The SliceFailure of this kind (SliceFailure has what the other
    fields mean)."""
    return FAILURE_TYPES[kind](slice_id, host, step, cause, partial=partial, node_silent=node_silent)


def short(e: BaseException) -> str:
    """The first line of an error, for reports and logs (for running out
    of memory: what the worker used and the node had)."""
    if ray_errors.answer(e) is FailureKind.OOM:
        return ray_errors.memory_summary(e)
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


class FailureLocator:
    """`live` arguments map slice id to an object with `.workers` (handles,
    host order) and `.infos` (pid, node_id per host)."""

    def __init__(
        self,
        probe: Probe,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        confirm_s: float = 5.0,
        heartbeats: Optional[Heartbeats] = None,
    ):
        self.probe = probe
        self._clock = clock
        self._sleep = sleep
        self._confirm_s = confirm_s
        self.heartbeats = heartbeats  # None: hangs are found at the step's deadline only
        self.busy_silences = 0  # silent hosts found running (GIL held), not hung

    def node_lost(self, node_id: str) -> bool:
        """The node is gone: Ray says so, or its raylet no longer takes
        connections (Ray's default health checks take several seconds more
        to mark it dead)."""
        return not self.probe.node_alive(node_id) or not self.probe.raylet_reachable(node_id)

    def _kind_of_death(self, exc: BaseException, node_id: str) -> FailureKind:
        if ray_errors.answer(exc) is FailureKind.OOM:
            return FailureKind.OOM
        if getattr(exc, "preempted", False):
            return FailureKind.PREEMPTED
        if self.node_lost(node_id):
            return FailureKind.NODE_DIED
        return FailureKind.PROCESS_DIED

    def classify(self, exc: BaseException, worker: Any, node_id: str) -> Optional[FailureKind]:
        """Sort a worker call's error into a FailureKind, or TRANSIENT, by
        the table of Ray's errors (ray_errors.py).

        Errors that are not about the worker's life (a bug in the user's
        loss function, say) are re-raised: retrying them would only fail
        again."""
        if isinstance(exc, rex.RayTaskError) and isinstance(exc.cause, (InputsLost, InputsAborted)):
            # A gradient or snapshot held on a lost node: the node is gone.
            return FailureKind.NODE_DIED
        kind = ray_errors.answer(exc)
        if kind is None:
            raise exc
        if kind == ray_errors.DEATH:
            return self._kind_of_death(exc, node_id)
        if kind == ray_errors.CONFIRM:
            return self._confirm(worker, node_id)
        return kind

    def _confirm(self, worker: Any, node_id: str) -> Optional[FailureKind]:
        """Ray lost touch with the worker: dead, its node gone, or back."""
        end = self._clock() + self._confirm_s
        while self._clock() < end:
            if self.node_lost(node_id):
                return FailureKind.NODE_DIED
            try:
                self.probe.ping(worker, 0.5)
                return TRANSIENT
            except rex.ActorDiedError as died:
                return self._kind_of_death(died, node_id)
            except (rex.ActorUnavailableError, rex.GetTimeoutError):
                self._sleep(0.1)
        return FailureKind.NODE_DIED if self.node_lost(node_id) else FailureKind.HUNG

    def classify_call(self, exc: BaseException, live: Mapping, s: int, h: int) -> Optional[FailureKind]:
        sl = live[s]
        return self.classify(exc, sl.workers[h], sl.infos[h]["node_id"])

    def peer_failure(self, exc: BaseException, live: Mapping, s: int, h: int, step: int) -> Optional[SliceFailure]:
        """Host h's call died inside a JAX collective (`runtime_error`): in a
        multi-host slice that is how a peer's loss first shows on the
        survivors of its slice (gloo, NCCL or ICI reporting the broken
        connection), often before the peer's own call fails. The failure is
        the peer's: the one on a lost node, or that does not answer. None if
        every peer answers within the confirmation time (the error is then
        the program's own)."""
        sl = live[s]
        if len(sl.workers) < 2 or not runtime_error(exc):
            return None
        end = self._clock() + self._confirm_s
        while True:
            for p, (worker, info) in enumerate(zip(sl.workers, sl.infos)):
                if p == h:
                    continue
                if self.node_lost(info["node_id"]):
                    return failure(FailureKind.NODE_DIED, s, p, step, f"host {h}'s collective broke: {short(exc)}")
                try:
                    self.probe.ping(worker, 0.5)
                except rex.RayError as pe:
                    kind = self.classify(pe, worker, info["node_id"])
                    if kind is not TRANSIENT:
                        return failure(kind, s, p, step, short(pe))
            if self._clock() >= end:
                return None
            self._sleep(0.1)

    def lost_host(self, live: Mapping) -> Optional[tuple[int, int]]:
        """(slice, host) on a node whose raylet refuses connections, if
        any: probed while a step runs, this finds a lost node before the
        calls to it fail (one connect per node, not per host)."""
        seen: dict[str, tuple[int, int]] = {}
        for s in sorted(live):
            for h, info in enumerate(live[s].infos):
                seen.setdefault(info["node_id"], (s, h))
        for node_id, where in seen.items():
            if not self.probe.raylet_reachable(node_id):
                return where
        return None

    def started(self, live: Mapping, step: int) -> None:
        """Step `step` starts on `live` (the heartbeats learn which hosts
        are new processes, in their first step)."""
        if self.heartbeats is not None:
            self.heartbeats.started(live, step)

    def watch(self, live: Mapping, waiting: Iterable[int], step: int) -> Optional[SliceFailure]:
        """While a step's calls are out: a host on a node whose raylet
        refuses connections (`lost_host`), else one of the `waiting`
        slices that stopped answering its heartbeats (heartbeats.py)."""
        lost = self.lost_host(live)
        if lost is not None:
            s, h = lost
            return failure(FailureKind.NODE_DIED, s, h, step, "the node's raylet stopped taking connections")
        quiet = self.heartbeats.quiet(live, waiting, step) if self.heartbeats is not None else None
        if quiet is None:
            return None
        s, h, silent_s = quiet
        self.heartbeats.forget(s)
        # A process that died is silent too, until Ray tells the driver of
        # its death (on a loaded host that took over a second after a
        # SIGKILL): one more ping, given DEATH_NOTICE_S, says which.
        try:
            self.probe.ping(live[s].workers[h], DEATH_NOTICE_S)
            return None  # it answers after all: busy, not hung
        except rex.GetTimeoutError:
            pass
        except rex.RayError as e:
            kind = self.classify_call(e, live, s, h)
            if kind is not TRANSIENT:
                return failure(kind, s, h, step, short(e))
        info = live[s].infos[h]
        state = self.probe.process_state(info["node_id"], info["pid"])
        if state == process_state.GONE:
            return failure(FailureKind.PROCESS_DIED, s, h, step, f"no heartbeat for {silent_s:.1f} s; its process exited")
        if state == process_state.BUSY:
            # Running, its GIL held elsewhere (a long collection, a C call):
            # it will answer again; the step's deadline still bounds it.
            self.busy_silences += 1
            return None
        why = f"no heartbeat for {silent_s:.1f} s" + (f"; its process is {state}" if state else "")
        return self._quiet_failure(s, h, live, step, why)

    def known(self, live: Mapping) -> set:
        """The slices of `live` whose hosts have all run a step (watching
        one that has not, its processes maybe still starting, could take a
        slow start for a hang)."""
        if self.heartbeats is None:
            return set(live)
        return {s for s in live if self.heartbeats.knows(live, s)}

    def blame(self, s: int, kind: FailureKind, live: Mapping) -> int:
        """The slice to blame for a failed call: one that lost a node, if
        any (its peers' calls fail too when they fetch from it)."""
        if kind != FailureKind.NODE_DIED:
            return s
        for t in [s] + sorted(live):
            if any(self.node_lost(i["node_id"]) for i in live[t].infos):
                return t
        return s

    def hung(self, candidates: list[tuple[int, int]], live: Mapping, step: int, deadline_s: float) -> SliceFailure:
        """A step outlived its deadline: find the host that is dead, else
        the one that does not answer a ping (the others of its slice are
        only blocked on it). Every host of a waiting call's slice is asked,
        not only the waiting ones: a host that finished its part and then
        died leaves its peers blocked in a collective with it, and nothing
        of its own still waiting. Workers answer pings on a thread of their
        own, beside a step (slice_group: the `control` group)."""
        suspects = sorted({(s, h) for s, _ in candidates for h in range(len(live[s].workers))})
        quiet = None
        for s, h in suspects:
            try:
                self.probe.ping(live[s].workers[h], 0.5)
            except rex.GetTimeoutError:
                quiet = quiet or (s, h)
            except rex.RayError as e:
                kind = self.classify_call(e, live, s, h)
                if kind is not TRANSIENT:
                    return failure(kind, s, h, step, short(e))
        if quiet is not None:
            return self._quiet_failure(*quiet, live, step, f"no answer within the step deadline ({deadline_s:.1f} s)")
        s, h = min(candidates)
        return failure(FailureKind.HUNG, s, h, step, f"step did not finish within {deadline_s:.1f} s")

    def _quiet_failure(self, s: int, h: int, live: Mapping, step: int, why: str) -> SliceFailure:
        node = live[s].infos[h]["node_id"]
        silent = self._node_silent(node)
        # The slice's placement group holds a bundle on that node until
        # Ray declares it dead (minutes on Ray's defaults): its
        # replacement needs a new group (controller).
        return failure(
            FailureKind.HUNG, s, h, step,
            f"{why}; node {node[:8]} " + ("does not answer either (frozen or cut off)" if silent else "answers"),
            node_silent=silent,
        )

    def _node_silent(self, node_id: str) -> bool:
        return self.node_lost(node_id) or not self.probe.raylet_answers(node_id)

    def first_dead(self, exc: BaseException, live: Mapping, step: int) -> SliceFailure:
        """A call to several slices failed: the first host that does not
        answer is the failure."""
        for s in sorted(live):
            for h in range(len(live[s].infos)):
                try:
                    self.probe.ping(live[s].workers[h], 2.0)
                except rex.RayError as pe:
                    kind = self.classify_call(pe, live, s, h) or FailureKind.HUNG
                    return failure(kind, s, h, step, short(pe))
        return failure(FailureKind.HUNG, min(live), 0, step, short(exc))
