"""Calls whose replies the run gives up on, read once they are done.

Ray prints "Unhandled error ... <traceback>" in the driver's terminal for
every call that failed and whose reply was let go without being read
(`ray.get`). After a failure the controller gives up on calls on purpose:
those issued ahead for a step that will not run as issued, an apply
cancelled or aborted because a slice was lost, the calls of a step that
failed. Their errors are expected and already sorted into the one failure
the run reports and recovers from; printed as unhandled, a recovered run
would look like a crash. So the runner hands such calls here, and they are
read once done (an error read is handled; Ray then prints nothing), then
let go. The failure itself stays in the run's events and in Ray's own log
files.

Only a call's small reply (a status, an apply's metrics) is read; its
other returns (a gradient payload, a partial sum: large when they are not
errors) are read only when the reply was an error, when they are errors
too (the same task failed), and so small.
"""

from __future__ import annotations

from typing import Any, Sequence

import ray

__all__ = ["Unread"]

# At most this many calls are kept: a run that keeps giving up on calls
# that never end (a frozen node's) does not grow without bound.
_KEPT = 4096


class Unread:
    def __init__(self, api: Any = ray) -> None:
        self._ray = api  # Ray's object API (`wait`, `get`): the module, or a test's stand-in
        self._calls: list[tuple[Any, tuple]] = []  # (reply ref, the call's other return refs)

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, reply: Any, others: Sequence[Any] = ()) -> None:
        """Give up on a call: `reply` its small reply, `others` its other returns."""
        if reply is not None:
            self._calls.append((reply, tuple(o for o in others if o is not None)))
            del self._calls[:-_KEPT]

    def sweep(self, timeout_s: float = 0.0) -> int:
        """Read the calls done by now (waiting up to `timeout_s` for them
        all); the others are kept. Returns how many were read."""
        if not self._calls:
            return 0
        replies = [reply for reply, _ in self._calls]
        done, _ = self._ray.wait(replies, num_returns=len(replies), timeout=timeout_s)
        if not done:
            return 0
        done = set(done)
        kept, read = [], 0
        for reply, others in self._calls:
            if reply not in done:
                kept.append((reply, others))
                continue
            read += 1
            try:
                self._ray.get(reply)
            except Exception:  # the error is read: handled
                for ref in others:
                    try:
                        self._ray.get(ref)
                    except Exception:
                        pass
        self._calls = kept
        return read
