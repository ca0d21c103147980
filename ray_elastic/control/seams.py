"""What tests and benchmarks put in place of the real thing, in one
frozen dataclass the controller takes."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

from ray_elastic.cluster.backend import SliceBackend

__all__ = ["Seams"]


@dataclasses.dataclass(frozen=True)
class Seams:
    """What tests and benchmarks put in place of the real thing.

    clock: the controller's time (a fake one steps through timeouts).
    backend: the whole cluster side (a SliceBackend); tests pass a fake.
    provisioner: the class that provisions slices on Ray (default
        RaySlices); the scale benchmark passes simulated slices.
    """

    clock: Callable[[], float] = time.monotonic
    backend: Optional[SliceBackend] = None
    provisioner: Optional[type] = None
