"""A slice whose workers are still starting when a node of its placement
group goes: it starts again at once on a new group kept off that node,
instead of waiting for Ray's health checks to fail its workers (pure
bookkeeping with a stand-in provisioner and probe; the real run is
tests/test_node_loss_e2e.py, on Ray's defaults)."""

from __future__ import annotations

from ray import exceptions as rex

from ray_elastic.cluster.ray_backend import RayBackend
from ray_elastic.cluster.slice_group import Provisioning
from ray_elastic.config import CpuSlice


class Provisioner:
    """Records what the backend asks; every group is placed on `nodes`."""

    made: list["Provisioner"] = []

    def __init__(self, *args, **kwargs):
        Provisioner.made.append(self)
        self.nodes: dict[int, tuple] = {}
        self.starts: list[int] = []
        self.abandoned: list[tuple] = []
        self.error: BaseException | None = None

    def start(self, slice_id):
        self.starts.append(slice_id)
        return Provisioning(slice_id, [], [], [], 0.0)

    def poll(self, p):
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return None

    def kill(self, workers, infos=()):
        pass

    def abandon_group(self, slice_id, evict=()):
        self.abandoned.append((slice_id, tuple(evict)))

    def reap_abandoned(self):
        pass

    def group_nodes(self, slice_id):
        return self.nodes.get(slice_id, ())

    def placement_group_state(self, slice_id):
        return "CREATED"

    def shutdown(self, keep=()):
        pass


class Probe:
    def __init__(self, gone=()):
        self.gone = set(gone)
        self.asked: list[str] = []

    def node_alive(self, node_id):
        return True  # as Ray's node table says for seconds after a removal

    def raylet_reachable(self, node_id):
        return node_id not in self.gone

    def raylet_refuses(self, node_id):
        self.asked.append(node_id)
        return node_id in self.gone


def _backend(gone=(), now=None):
    clock = now or [0.0]
    backend = RayBackend(CpuSlice(hosts=2), lambda: None, 0, 1, run_name="t", provisioner=Provisioner,
                         clock=lambda: clock[0])
    backend.locator.probe = Probe(gone)
    return backend, Provisioner.made[-1], clock


def test_a_starting_slice_whose_node_went_starts_again_away_from_it():
    backend, slices, _ = _backend(gone={"b"})
    backend.start(1)
    slices.nodes[1] = ("a", "b")
    assert backend.poll() == []
    assert slices.starts == [1, 1]
    assert slices.abandoned == [(1, ("b",))]  # a new group, never on "b"


def test_starting_slices_on_live_nodes_are_left_alone_and_checked_once_a_second():
    backend, slices, clock = _backend(gone=())
    backend.start(0)
    slices.nodes[0] = ("a", "b")
    backend.poll()
    assert slices.starts == [0] and slices.abandoned == []
    assert backend.locator.probe.asked == ["a", "b"]
    clock[0] = 0.5
    backend.poll()
    assert backend.locator.probe.asked == ["a", "b"]  # not again within the second
    backend.locator.probe.gone.add("a")
    clock[0] = 1.2
    backend.poll()
    assert slices.starts == [0, 0] and slices.abandoned == [(0, ("a",))]


def test_a_group_not_placed_yet_is_not_checked():
    backend, slices, _ = _backend(gone={"a"})
    backend.start(0)  # no nodes: the group waits for room
    backend.poll()
    assert slices.starts == [0] and slices.abandoned == []


def test_a_worker_that_died_starting_keeps_its_group_unless_its_node_is_gone():
    backend, slices, clock = _backend(gone=())
    backend.start(0)
    slices.nodes[0] = ("a", "b")
    slices.error = rex.WorkerCrashedError()  # its node is fine (Ray's memory monitor, say)
    backend.poll()
    assert slices.starts == [0, 0] and slices.abandoned == []  # same group
    backend.locator.probe.gone.add("b")
    slices.error = rex.NodeDiedError("gone")
    clock[0] = 0.1  # within the second: the error path asks on its own
    backend.poll()
    assert slices.starts == [0, 0, 0] and slices.abandoned == [(0, ("b",))]


def test_only_a_refused_connection_is_a_gone_node():
    """Real sockets: a port nobody listens on refuses; a listening one
    does not; an address that cannot be reached in time is not a refusal
    (a healthy node taken for lost would be kept out of the run)."""
    import socket

    from ray_elastic.failures.location import refuses

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()
    assert refuses(closed, 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not refuses(s.getsockname(), 0.5)
    assert not refuses(("192.0.2.123", 9), 0.05)  # TEST-NET-1: no answer, or no route
