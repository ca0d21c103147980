"""A preemption notice to a worker process: SIGTERM.

The node's shutdown, a kubelet or a spot reclaim sends SIGTERM ahead of
the kill. The worker does not die mid-step: it finishes the step in hand
and reports when the notice came with that step's metrics
(`preempt_notice_at`), and the controller checkpoints and retires the
slice at the step boundary.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

__all__ = ["PreemptionNotice"]


class PreemptionNotice:
    """When this process was first sent SIGTERM (wall clock), or None."""

    def __init__(self) -> None:
        self.at: Optional[float] = None

    def install(self) -> None:
        """Take SIGTERM from its default (dying at once). Only the main
        thread may set a handler: elsewhere Ray's default is kept."""
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread
            pass

    def _on_sigterm(self, signum, frame) -> None:
        if self.at is None:
            self.at = time.time()
