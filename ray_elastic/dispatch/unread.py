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

__all__ = ["Dropped", "Unread"]

# At most this many calls are kept: a run that keeps giving up on calls
# that never end (a frozen node's) does not grow without bound.
_KEPT = 4096


class Unread:
    def __init__(self, api: Any = ray) -> None:
        self._ray = api  # Ray's object API (`wait`, `get`): the module, or a test's stand-in
        self._calls: list[tuple[Any, tuple]] = []  # (reply ref, the call's other return refs)
        self._held: set = set()  # the reply refs in _calls

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, reply: Any, others: Sequence[Any] = ()) -> None:
        """Give up on a call: `reply` its small reply, `others` its other
        returns (a call given up on twice is kept once)."""
        if reply is not None and reply not in self._held:
            # An exchange's gradient call returns a tuple of chunks: each one's ref.
            flat = [r for o in others for r in (o if isinstance(o, (tuple, list)) else (o,))]
            self._calls.append((reply, tuple(o for o in flat if o is not None)))
            self._held.add(reply)
            for gone, _ in self._calls[:-_KEPT]:
                self._held.discard(gone)
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
        self._held = {reply for reply, _ in kept}
        return read


    def release(self) -> int:
        """The run is over: let go of every call still kept, read or not
        (held on, each would keep its returns, a gradient payload among
        them, in the object store for as long as the driver lives).
        Returns how many were let go."""
        n, self._calls, self._held = len(self._calls), [], set()
        return n


class Dropped:
    """Calls a runner issued and gave up on (a step issued ahead that will
    not run as issued): their results are never read. Their gradient calls
    may still run (after an apply that did succeed), so no new gradient
    call is issued on a slice before its dropped ones are over (`settle`):
    a worker never runs two gradient phases at once (on a multi-host slice
    their collectives would interleave). Every dropped call is read once
    done (`Unread`)."""

    def __init__(self, api: Any = ray, clock=None) -> None:
        self._ray, self._clock = api, clock
        self._grads: list = []  # (slice, status ref) of the dropped gradient calls
        self.unread = Unread(api)

    def drop(self, issued) -> None:
        """Give up on an `Issued` step (dispatch/calls.py)."""
        if issued is None:
            return
        self._grads += [(c.slice_id, c.ref) for c in issued.grads]
        for c in issued.grads:
            self.unread.add(c.ref, (issued.payloads.get(c.slice_id, {}).get(c.host),))
        for level in issued.levels:
            for c in level:
                self.unread.add(c.ref, c.others())

    def settle(self, timeout_s: float, live, only: bool = False) -> None:
        """Wait up to `timeout_s` for the dropped gradient calls of the
        `live` slices to end, whatever their outcome. A lost slice's are
        not waited for: its workers are gone or retired, and a call to a
        worker on a lost node answers only once Ray declares the node dead
        (tens of seconds on Ray's default health checks). `only`: `live`
        is some of the slices (a load's): the others' are kept for later."""
        refs = list(dict.fromkeys(ref for s, ref in self._grads if s in live))  # a step dropped twice: once each
        self._grads = [(s, ref) for s, ref in self._grads if s not in live] if only else []
        if refs:
            self._ray.wait(refs, num_returns=len(refs), timeout=max(0.0, timeout_s))
        self.unread.sweep()
