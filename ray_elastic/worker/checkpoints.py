"""A host's side of sharded checkpoints (checkpoint/host_writes.py).

Under a sharded layout no process holds the whole state, so the hosts of
one slice write a checkpoint together, each its own shards, and read it
back the same way onto this slice's layout. The driver hands each host the
snapshot blocks of its host index (from any slice). A replicated state is
checkpointed by the writer actor instead (checkpoint/writer.py).
"""

from __future__ import annotations

from ray_elastic.checkpoint.state_forms import HostBlocks
from ray_elastic.worker.setup import StateLayout
from ray_elastic.worker.state import HeldState
from ray_elastic.worker.transfer import StateTransfer

__all__ = ["HostCheckpointing"]


class HostCheckpointing:
    """Saves and restores of sharded checkpoints by host `host` of `hosts`."""

    def __init__(self, layout: StateLayout, transfer: StateTransfer, held: HeldState, host: int, hosts: int):
        self._layout, self._transfer, self._held = layout, transfer, held
        self._host, self._hosts = host, hosts
        self._ckpts = None  # the HostCheckpoints of the last path, made on first use

    def save(self, path: str, keep: int, meta: dict, save_id: str, part: HostBlocks) -> dict:
        """Write `part` (snapshot blocks of this host index) as step
        meta["step"], with the other hosts of this slice."""
        if int(part.step) != int(meta["step"]):
            raise ValueError(f"asked to save step {meta['step']}, handed a snapshot of step {part.step}")
        state = self._transfer.from_blocks(part.blocks)
        return self._checkpoints(path, keep).save(int(meta["step"]), state, meta, save_id)

    def restore(self, path: str, keep: int, step: int, nonce: str) -> int:
        """Load committed `step` with the other hosts of this slice, and
        hold it."""
        target = {"params": self._layout.params_spec(), "opt_state": self._layout.opt_spec()}
        state, _ = self._checkpoints(path, keep).restore(step, target, nonce)
        return self._held.hold(state["params"], state["opt_state"], step)

    def _checkpoints(self, path: str, keep: int):
        from ray_elastic.checkpoint.host_writes import HostCheckpoints

        if self._ckpts is None or self._ckpts.path != path:
            self._ckpts = HostCheckpoints(path, keep, self._host, self._hosts)
        return self._ckpts
