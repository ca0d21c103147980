"""What the driver tells a DiLoCo replica of the outer step, with each
call that needs it (worker/diloco.py): a message between processes, so
frozen and named. The flags are config.py's."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["OuterSpec"]


@dataclasses.dataclass(frozen=True)
class OuterSpec:
    """What the driver tells a replica of the outer step (config.py has the
    flags): `lr` (diloco_outer_lr), `momentum` (diloco_outer_momentum)."""

    lr: float
    momentum: float

    def optimizer(self) -> Any:
        import optax

        return optax.sgd(self.lr, momentum=self.momentum, nesterov=True)
