"""What a run keeps in each host's memory, estimated in the driver before
any slice is reserved, against what the cluster's machines have: a run
that cannot fit is refused with the setting to change, instead of having
Ray's memory monitor kill its workers mid-step.

The estimate is a floor, from the program's shapes alone (`jax.eval_shape`
of its init and its optimizer's, nothing computed): the state a host
holds (its share under a sharded layout), one gradient of that state,
and, in the node's object store, one snapshot copy of the state and the
step's shard gradients on their way to the applies. Activations and XLA's
own buffers come on top, so a run refused here could never run, and one
let through may still need more (Ray's memory monitor then ends a
worker, a failure of kind `oom` whose cause gives this estimate).

Machines, not Ray nodes, are what run out: several nodes of a local
cluster (or several raylets on one host) share one machine's memory, so
nodes are grouped by address and a machine has what its largest node
said it had at start (Ray's `memory` plus `object_store_memory`
resources).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from ray_elastic.cluster.node_memory import Machine
from ray_elastic.errors import ConfigError

__all__ = ["GB", "HostNeeds", "Machine", "check_fits", "host_needs", "size", "tree_bytes"]

GB = 1e9


@dataclasses.dataclass(frozen=True)
class HostNeeds:
    """Bytes one host of the run needs at least (see the module doc)."""

    state: int  # the training state it holds (params, optimizer and model state)
    grads: int  # one gradient of the params it holds
    store: int  # in its node's object store: a snapshot copy and the step's shard gradients
    on_host: bool  # the device memory is the host's (CPU slices): state and gradient count there too

    @property
    def host(self) -> int:
        """Host memory: the object store, plus state and gradient where the devices are the host's."""
        return self.store + (self.state + self.grads if self.on_host else 0)

    def text(self) -> str:
        where = "host memory" if self.on_host else "device memory"
        return (f"at least {size(self.host)} of host memory per host (state {size(self.state)} and "
                f"gradient {size(self.grads)} in {where}; {size(self.store)} in the object store "
                "for a snapshot copy and the step's gradients)")


def size(n: float) -> str:
    """Bytes as a reader takes them in: MB below a GB, else GB."""
    return f"{n / 1e6:.1f} MB" if n < GB else f"{n / GB:.2f} GB"


def tree_bytes(tree: Any) -> int:
    """Bytes of a pytree of arrays or shape-dtype structs."""
    import jax
    import numpy as np

    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                   if hasattr(x, "shape") and hasattr(x, "dtype")))


def host_needs(params: int, state: int, hosts: int, sharded: bool, shards: int, num_slices: int,
               snapshots: bool, on_host: bool, exchange: str = "reduce_scatter") -> HostNeeds:
    """One host's needs for a state of `state` bytes (of which `params`
    are the params): shared out over the slice's `hosts` when the layout
    is sharded, whole on each host otherwise. In the object store: under
    the reduce-scatter, the host's own gradient (its slice's shards summed),
    the chunks it sums and the sums it gathers (under 3 gradients; 2 at
    two slices, where each apply takes the other slice's gradient whole);
    under the direct hand-off, a step's `shards` gradients pass through the
    store of every host that applies them (up to the apply's fan-in of 8; a
    tree above it sums them first), and those the host's slice computes
    stay there until applied."""
    share = hosts if sharded else 1
    grads = params // share
    if exchange == "reduce_scatter":
        in_flight = 2 if num_slices <= 2 else 3
    else:
        in_flight = max(min(shards, 8), math.ceil(shards / num_slices))
    store = (state // share if snapshots else 0) + grads * in_flight
    return HostNeeds(state=state // share, grads=grads, store=store, on_host=on_host)


def check_fits(needs: HostNeeds, hosts: int, machines: Sequence[Machine]) -> None:
    """Raise ConfigError when `hosts` hosts of `needs` cannot fit on the
    machines: one host more than the largest machine has, or all of them
    more than all the machines have together. Nothing is refused when the
    cluster tells nothing of its memory (no machine known)."""
    if not machines:
        return
    largest = max(m.memory for m in machines)
    total = sum(m.memory for m in machines)
    if needs.host > largest:
        raise ConfigError(
            "slice", f"the run needs {needs.text()}, and the largest machine in the cluster has "
            f"{largest / GB:.2f} GB: split the state over more hosts (a sharded program.layout and more "
            "slice.hosts), shrink the model or its optimizer state, or add machines with more memory")
    if needs.host * hosts > total:
        fit = max(1, int(total // max(needs.host, 1)))
        raise ConfigError(
            "num_slices", f"the run's {hosts} hosts need {needs.host * hosts / GB:.2f} GB of host memory "
            f"together ({needs.text()}), and the cluster's {len(machines)} machine(s) have {total / GB:.2f} GB: "
            f"about {fit} such hosts fit; use fewer slices or spares (num_slices, spare_slices), a sharded "
            "layout over more hosts, or add machines")
