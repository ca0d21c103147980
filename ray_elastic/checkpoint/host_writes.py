"""Sharded checkpoints written and read by the hosts of a slice, each its
own shards, as Orbax does for multi-host JAX arrays.

Under a sharded layout no process may hold the whole state, so the writer
actor (writer.py) is not used: the driver hands the hosts of one slice
their own snapshot blocks (host i gets host i's), each host rebuilds its
part of the global arrays and all of them call Orbax's save together. Each
host writes its own shards (its `ocdbt.process_<i>` files); the slice's
host 0 writes the small JSON items and commits the step only after every
host has finished (Orbax's barrier), so a step is committed once every
host is done, or never. A cold start reads the step the same way onto the
new layout: every host restores its shards with Orbax's restore with
target shardings, whatever the old host count.

The hosts of a slice synchronise through the slice's `jax.distributed`
key-value store, never through XLA collectives: a save runs on its own
actor thread while training runs its collectives on another.

Array checksums of a sharded step are `integrity.sum32`, a sum over
elements: each host adds up its own shards and the parts add up to the
whole array's checksum on any layout, so a restored array is checked
without any process holding it whole.

This module runs inside the workers; it imports JAX and Orbax on use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Optional

import numpy as np

from ray_elastic.checkpoint import integrity
from ray_elastic.checkpoint.store import orbax_checkpoint, tree_size
from ray_elastic.errors import CheckpointDamaged

__all__ = ["HostCheckpoints", "HostRestore", "shard_sums"]

log = logging.getLogger("ray_elastic")

# How long a host waits for the other hosts of its slice at a save's or a
# restore's rendezvous (a host that died makes the others fail after this).
RENDEZVOUS_TIMEOUT_S = 300


def shard_sums(tree) -> dict:
    """{leaf name: this process's part of its sum32}, over the shards this
    process holds as replica 0 (so every block counts once per slice)."""
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        total = 0
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                total += integrity.sum32(np.asarray(shard.data), shard.index, leaf.shape)
        out[integrity.leaf_name(path)] = {"sum32": total % (1 << 32), "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
    return out


class HostCheckpoints:
    """One host's side of its slice's sharded checkpoints (host 0 of a
    slice is Orbax's primary host)."""

    def __init__(self, path: str, keep: int, host: int, hosts: int):
        self.path, self.keep, self.host, self.hosts = path, keep, host, hosts
        self._mgr = None

    def _manager(self):
        from etils import epath

        ocp = orbax_checkpoint()
        if self._mgr is not None:
            self._mgr.reload()  # another slice may have saved since
            return self._mgr
        options = dict(max_to_keep=self.keep, enable_async_checkpointing=False, create=self.hosts == 1)
        if self.hosts > 1:
            # Barriers over the distributed key-value store (not an XLA
            # collective, which would interleave with training's); Orbax
            # then wants the folder made by us.
            epath.Path(self.path).mkdir(parents=True, exist_ok=True)
            options["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=0, active_processes=set(range(self.hosts)))
        self._mgr = ocp.CheckpointManager(self.path, options=ocp.CheckpointManagerOptions(**options))
        return self._mgr

    def _totals(self, key: str, parts: dict) -> dict:
        """Every host's parts of the checksums, added up (every host of the
        slice calls this with the same key)."""
        if self.hosts == 1:
            return {k: dict(v, sum32=f"{v['sum32']:08x}") for k, v in parts.items()}
        ocp = orbax_checkpoint()
        client = ocp.multihost.get_jax_distributed_client()
        client.key_value_set(f"{key}/{self.host}", json.dumps(parts))
        totals = {k: dict(v) for k, v in parts.items()}
        for h in range(self.hosts):
            if h == self.host:
                continue
            other = json.loads(client.blocking_key_value_get(f"{key}/{h}", RENDEZVOUS_TIMEOUT_S * 1000))
            for k, v in other.items():
                totals[k]["sum32"] = (totals[k]["sum32"] + v["sum32"]) % (1 << 32)
        return {k: dict(v, sum32=f"{v['sum32']:08x}") for k, v in totals.items()}

    def save(self, step: int, state: dict, meta: dict, save_id: str) -> dict:
        """Write this host's shards of `state` (global arrays) as `step`,
        with every other host of the slice; returns when the step is
        committed (host 0) or this host's part is written (the others)."""
        ocp = orbax_checkpoint()
        t0 = time.perf_counter()
        checksums = {"version": 2, "arrays": self._totals(f"ray_elastic/save/{save_id}", shard_sums(state))}
        mgr = self._manager()
        if step not in mgr.all_steps():  # else written before a rewind; training is deterministic
            mgr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                **{integrity.ITEM: ocp.args.JsonSave(checksums)}))
            mgr.wait_until_finished()
            if self.host == 0:
                try:
                    integrity.write_manifest(self.path, str(step))
                except Exception as e:  # committed but unverified, as for the writer (store.py)
                    log.warning("checkpoint: step %d committed, but its %s could not be written (%s)",
                                step, integrity.MANIFEST, e)
        import jax

        own = sum(int(s.data.nbytes) for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards
                  if s.replica_id == 0)
        out = {"step": step, "seconds": time.perf_counter() - t0, "host": self.host, "bytes_written": own}
        if self.host == 0:
            from etils import epath

            out["bytes"] = tree_size(epath.Path(self.path) / str(step))[0]
        return out

    def restore(self, step: int, target: dict, nonce: str) -> tuple[dict, dict]:
        """(state, meta) of committed `step`, each array laid out by the
        sharding of its `target` leaf (jax.ShapeDtypeStruct), its sum32
        checked. Raises CheckpointDamaged if the arrays are not what was
        saved."""
        from etils import epath

        ocp = orbax_checkpoint()
        recorded = integrity.recorded_arrays(epath.Path(self.path), step)
        restored = self._manager().restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        if recorded:
            got = self._totals(f"ray_elastic/restore/{nonce}", shard_sums(restored.state))
            for name, want in sorted(recorded.items()):
                have = got.get(name)
                if have is not None and have != want:
                    diff = ", ".join(f"{k} {have.get(k)} read, {want.get(k)} written"
                                     for k in want if have.get(k) != want.get(k))
                    raise CheckpointDamaged(step, "state", f"array {name}: {diff}")
        return restored.state, dict(restored.meta)

    def close(self) -> None:
        if self._mgr is not None:
            self._mgr.close()
            self._mgr = None


@dataclasses.dataclass(frozen=True)
class HostRestore:
    """What the driver hands the backend instead of a state: every host of
    every slice reads its own shards of committed `step` under `path`."""

    path: str
    keep: int
    step: int
