"""Deterministic fault injection keyed by (slice, host, step).

Used alike by the tests, `ray-elastic demo --fail-at`, and the benchmarks.
Each fault fires once, while the step it names is in flight (at the phase
it names: the gradients, the reduction or the apply), and records
the wall-clock moment it fired so detection and recovery times are measured
from the fault itself, not from when the driver noticed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Callable, Optional

from ray_elastic.errors import ConfigError

__all__ = ["CORRUPT_TARGETS", "Fault", "FaultInjector", "FAULT_KINDS", "FAULT_PHASES", "check_faults"]

FAULT_KINDS = ("kill", "remove_node", "stop", "term", "freeze_node", "slow", "corrupt", "gil", "oom")
# What a `corrupt` fault flips a bit of: the state the apply makes (on one
# device), or a gradient the slice sends; "+": at every step from then on;
# "check": the slice's next cross-check computation only (a glitch in a
# gradient no step applies).
CORRUPT_TARGETS = ("state", "grads", "state+", "grads+", "check")
# The moments of a step a fault can hit: once its gradient calls are in
# flight; once every gradient is in, before the reduction tree is gathered;
# once the sum is made, as the applies are issued (StepRunner.run). With
# pipelined dispatch the tree and the applies were issued ahead, so the
# fault races them; with RAY_ELASTIC_PIPELINE=0 it hits each phase for sure.
# DiLoCo's (control/diloco.py): an inner step's one moment ("grads"), and
# "sync": a synchronization's, once its outer applies are issued (the
# deltas all in), at the boundary `step`.
FAULT_PHASES = ("grads", "reduce", "apply", "sync")


@dataclasses.dataclass(frozen=True)
class Fault:
    """kill: SIGKILL the worker process. remove_node: take its node out of the
    cluster (and its processes with it). stop: SIGSTOP the worker (a hang).
    term: SIGTERM the worker (a preemption notice to the process).
    freeze_node: stop the node's raylet and every process on it (alive but
    unreachable: a frozen machine, or one whose network dropped).
    slow: the worker takes `ms` milliseconds longer over each gradient call
    from then on (a straggler: alive and answering, only slow).
    corrupt: the worker flips one bit of its `target` (CORRUPT_TARGETS): the
    state its next apply makes, or the next gradient it sends; with "+",
    at every step from then on (silent data corruption: it answers, wrong);
    "check": its next gradient cross-check computation, once.
    gil: the worker holds Python's GIL for `ms` milliseconds in one C call
    (a long garbage collection, a C extension that keeps it): alive and
    busy, answering nothing meanwhile; not a failure.
    oom: the worker allocates `ms` megabytes of host memory (a leak), holds
    them 3 s and lets them go; where that takes its node past Ray's memory
    threshold, Ray's memory monitor kills it (a failure of kind `oom`).
    `phase`: the moment of the step it fires at (FAULT_PHASES).
    """

    kind: str
    slice_id: int
    step: int
    host: int = 0
    phase: str = "grads"
    ms: int = 0
    target: str = ""

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ConfigError("faults", f"fault kind {self.kind!r}: use one of {FAULT_KINDS}")
        if self.slice_id < 0 or self.step < 0 or self.host < 0:
            raise ConfigError("faults", "fault slice, step and host must be >= 0")
        if self.phase not in FAULT_PHASES:
            raise ConfigError("faults", f"fault phase {self.phase!r}: use one of {FAULT_PHASES}")
        if (self.kind in ("slow", "gil", "oom")) != (self.ms > 0):
            raise ConfigError("faults", f"fault {self.kind!r}: ms (milliseconds added per step for 'slow', the GIL "
                              f"held for 'gil', megabytes for 'oom') must be > 0 for those and is for them only, "
                              f"got {self.ms}")
        if (self.kind == "corrupt") != bool(self.target) or (self.target and self.target not in CORRUPT_TARGETS):
            raise ConfigError("faults", f"fault {self.kind!r}: target must be one of {CORRUPT_TARGETS} for "
                              f"'corrupt' and is for 'corrupt' only, got {self.target!r}")

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """'KIND:SLICE:STEP[:HOST[:PHASE[:MS|TARGET]]]', e.g. 'kill:1:20',
        'remove_node:1:20:0:apply', 'slow:1:20:0:grads:500' or
        'corrupt:1:20:0:grads:state+'."""
        parts = text.split(":")
        if len(parts) not in (3, 4, 5, 6):
            raise ConfigError("faults", f"fault {text!r}: expected KIND:SLICE:STEP[:HOST[:PHASE[:MS|TARGET]]]")
        kind, *nums = parts[:4]
        last = parts[5] if len(parts) == 6 else None
        try:
            values = [int(n) for n in nums]
            ms = int(last) if last is not None and kind != "corrupt" else 0
        except ValueError:
            raise ConfigError("faults", f"fault {text!r}: SLICE, STEP, HOST and MS must be integers") from None
        return cls(kind, *values, *parts[4:5], ms=ms, target=last if kind == "corrupt" and last else "")


def check_faults(faults, num_slices: int, hosts_per_slice: int) -> None:
    """Every fault names a slice and a host the run has: a ConfigError
    naming `faults` otherwise. Needs no cluster, so a command line checks
    its faults before it starts one."""
    for f in faults:
        if f.slice_id >= num_slices:
            raise ConfigError("faults", f"{f} names slice {f.slice_id}, but num_slices={num_slices} "
                              f"(slices 0 to {num_slices - 1})")
        if f.host >= hosts_per_slice:
            raise ConfigError("faults", f"{f} names host {f.host}, but a slice has {hosts_per_slice} "
                              f"host{'s' if hosts_per_slice != 1 else ''} (hosts 0 to {hosts_per_slice - 1})")


@dataclasses.dataclass
class Fired:
    fault: Fault
    at_wall: float
    at: float  # the controller's clock when it fired
    pid: int
    node_id: str


class FaultInjector:
    """Fires faults against live workers; `remove_node` needs a callback
    that takes a node out of the cluster (LocalCluster.remove_node)."""

    def __init__(
        self,
        faults: list[Fault],
        remove_node: Optional[Callable[[str], None]] = None,
        clock: Callable[[], float] = time.monotonic,
        freeze_node: Optional[Callable[[str], None]] = None,
    ):
        self.pending = list(faults)
        self._clock = clock
        self.fired: list[Fired] = []
        self._node_actions = {"remove_node": remove_node, "freeze_node": freeze_node}
        # (slice, host, ms) -> None: slows a worker down; (slice, host,
        # target, lasting) -> None: has it flip bits (the backend's, set once it exists).
        self.slow_down: Optional[Callable[[int, int, int], None]] = None
        self.corrupt: Optional[Callable[[int, int, str, bool], None]] = None
        self.hold_gil: Optional[Callable[[int, int, int], None]] = None  # (slice, host, ms)
        self.eat_memory: Optional[Callable[[int, int, int], None]] = None  # (slice, host, megabytes)
        for kind, action in self._node_actions.items():
            if action is None and any(f.kind == kind for f in faults):
                raise ConfigError("faults", f"a {kind} fault needs a cluster that can do it ({kind}=...)")

    def use(self, backend: object) -> None:
        """Take the worker-side faults' actions from the backend, where it has them."""
        self.slow_down = getattr(backend, "slow_down", None)
        self.corrupt = getattr(backend, "corrupt", None)
        self.hold_gil = getattr(backend, "hold_gil", None)
        self.eat_memory = getattr(backend, "eat_memory", None)

    def fire_due(self, step: int, hosts: dict, phase: str = "grads") -> list[Fired]:
        """Fire every fault due at `step`'s `phase` on a live slice. `hosts`
        maps a live slice's id to its hosts' infos (pid, node_id)."""
        out = []
        for f in list(self.pending):
            if f.step != step or f.phase != phase or f.slice_id not in hosts:
                continue
            infos = hosts[f.slice_id]
            if f.host >= len(infos):
                raise ConfigError("faults", f"fault {f}: slice has only {len(infos)} hosts")
            info = infos[f.host]
            fired = Fired(f, time.time(), self._clock(), info["pid"], info["node_id"])
            if f.kind == "kill":
                os.kill(info["pid"], signal.SIGKILL)
            elif f.kind == "stop":
                os.kill(info["pid"], signal.SIGSTOP)
            elif f.kind == "term":
                os.kill(info["pid"], signal.SIGTERM)
            elif f.kind == "slow":
                if self.slow_down is None:
                    raise ConfigError("faults", "a slow fault needs a backend that can slow a worker down")
                self.slow_down(f.slice_id, f.host, f.ms)
            elif f.kind == "gil":
                if self.hold_gil is None:
                    raise ConfigError("faults", "a gil fault needs a backend that can reach a worker")
                self.hold_gil(f.slice_id, f.host, f.ms)
            elif f.kind == "oom":
                if self.eat_memory is None:
                    raise ConfigError("faults", "an oom fault needs a backend that can reach a worker")
                self.eat_memory(f.slice_id, f.host, f.ms)
            elif f.kind == "corrupt":
                if self.corrupt is None:
                    raise ConfigError("faults", "a corrupt fault needs a backend that can corrupt a worker")
                self.corrupt(f.slice_id, f.host, f.target.rstrip("+"), f.target.endswith("+"))
            else:
                self._node_actions[f.kind](info["node_id"])
            self.pending.remove(f)  # only once it has really fired
            self.fired.append(fired)
            out.append(fired)
        return out

    def last_for(self, slice_id: int) -> Optional[Fired]:
        for f in reversed(self.fired):
            if f.fault.slice_id == slice_id:
                return f
        return None
