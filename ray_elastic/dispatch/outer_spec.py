"""What the driver tells a DiLoCo replica of the outer step, with each
call that needs it (worker/diloco.py): a message between processes, so
frozen and named. The flags are config.py's; the schedule of Streaming
DiLoCo (which fragment synchronizes after which step, and when its new
global params reach the replicas) is here, where the driver and the
workers both read it."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

__all__ = ["OuterSpec", "fragment_leaves"]


@dataclasses.dataclass(frozen=True)
class OuterSpec:
    """What the driver tells a replica of the outer step (config.py has the
    flags): `lr` (diloco_outer_lr), `momentum` (diloco_outer_momentum);
    Streaming DiLoCo's `fragments` (num_diloco_fragments; 0: plain DiLoCo,
    the whole params at every synchronization), `every` (steps between two
    fragments' synchronizations), `overlap`
    (num_communication_overlapping_steps) and `alpha`
    (communication_overlapping_alpha); `step_program`: how an inner step
    runs on the devices (one_slice_program)."""

    lr: float
    momentum: float
    fragments: int = 0
    every: int = 1
    overlap: int = 0
    alpha: float = 0.0
    step_program: str = "auto"

    @classmethod
    def of(cls, config: Any) -> "OuterSpec":
        """The spec of an ElasticConfig's DiLoCo flags."""
        if not config.enable_streaming_diloco:
            return cls(config.diloco_outer_lr, config.diloco_outer_momentum, step_program=config.one_slice_program)
        return cls(config.diloco_outer_lr, config.diloco_outer_momentum, config.num_diloco_fragments,
                   config.diloco_fragment_every, config.num_communication_overlapping_steps,
                   float(config.communication_overlapping_alpha), config.one_slice_program)

    @property
    def streaming(self) -> bool:
        return self.fragments > 0

    def optimizer(self) -> Any:
        import optax

        return optax.sgd(self.lr, momentum=self.momentum, nesterov=True)

    def synced_after(self, step: int) -> Optional[int]:
        """Streaming: the fragment synchronized once `step` steps are done
        (MaxText's order: fragment 1 after `every` steps, ..., fragment 0
        after fragments x every); None between two."""
        if not self.streaming or step <= 0 or step % self.every:
            return None
        return (step % (self.fragments * self.every)) // self.every

    def mixed_before(self, step: int) -> Optional[int]:
        """Streaming with an overlap: the fragment whose new global params
        the replicas take in before inner step `step` (synchronized
        `overlap` steps earlier); None where none is due. Without an
        overlap a fragment is taken in at its synchronization."""
        if not self.overlap:
            return None
        return self.synced_after(step - self.overlap)


def fragment_leaves(sizes: Sequence[int], fragments: int) -> tuple[tuple[int, ...], ...]:
    """The params' leaves (their sizes in bytes, in the tree's order) cut
    into `fragments` runs of whole, consecutive leaves of about equal
    bytes, none empty: each fragment's leaf indices."""
    n = len(sizes)
    if not 1 <= fragments <= n:
        raise ValueError(f"num_diloco_fragments={fragments}: the params have {n} leaves; a fragment is one or "
                         f"more whole leaves, so set num_diloco_fragments to at most {n}")
    total = sum(sizes)
    out, start, acc = [], 0, 0
    for f in range(fragments):
        end = start + 1  # at least one leaf each
        acc += sizes[start]
        target = total * (f + 1) / fragments
        # Take the next leaf while it brings the run nearer its share and
        # leaves one leaf at least for each fragment after this one.
        while end < n - (fragments - f - 1) and abs(acc + sizes[end] - target) <= abs(acc - target):
            acc += sizes[end]
            end += 1
        if f == fragments - 1:
            end = n
        out.append(tuple(range(start, end)))
        start = end
    return tuple(out)
