"""`elastic_retry`: for users who write their own loop in the driver.

MaxText's elastic manager offers a decorator that re-runs a training
function when a slice is lost, after waiting for the slices to come back.
This is the same on Ray: the decorated function is called again when it
raises a slice failure (ray_elastic's `SliceFailure`, or Ray's actor and
object-loss errors), at most `max_retries` times in all, each time after
`ready()` says the cluster can run it again (waiting at most `timeout_s`).
The function is expected to restore its own state on entry (from a
snapshot, a checkpoint, or its survivors).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Optional

from ray import exceptions as rex

from ray_elastic.errors import ReplacementTimeout, RetryBudgetExhausted, SliceFailure

__all__ = ["elastic_retry", "RETRYABLE"]

log = logging.getLogger("ray_elastic")

# What counts as "a slice went away" when it escapes a user's loop.
RETRYABLE = (SliceFailure, rex.RayActorError, rex.ObjectLostError, rex.NodeDiedError)


def elastic_retry(
    max_retries: int = 10,
    timeout_s: float = 300.0,
    ready: Optional[Callable[[], bool]] = None,
    on_retry: Optional[Callable[[BaseException, int], None]] = None,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
):
    """Decorator. max_retries and timeout_s mean what MaxText's
    elastic_max_retries and elastic_timeout_seconds mean."""
    if max_retries < 0 or timeout_s < 0:
        from ray_elastic.errors import ConfigError

        raise ConfigError("max_retries" if max_retries < 0 else "timeout_s", "must be >= 0")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            attempt = 0
            while True:
                try:
                    return fn(*args, **kwargs)
                except RETRYABLE as e:
                    attempt += 1
                    if attempt > max_retries:
                        raise RetryBudgetExhausted(
                            f"{fn.__name__} lost a slice {attempt} times; the retry budget of "
                            f"max_retries={max_retries} is spent. Raise max_retries "
                            "(MaxText: elastic_max_retries) to absorb more.",
                            setting="max_retries",
                        ) from e
                    log.warning("%s failed (%s); retry %d of %d", fn.__name__, type(e).__name__, attempt, max_retries)
                    _wait_until_ready(ready, timeout_s, poll_s, clock, sleep)
                    if on_retry is not None:
                        on_retry(e, attempt)

        return run

    return wrap


def _wait_until_ready(ready, timeout_s, poll_s, clock, sleep) -> None:
    if ready is None:
        return
    deadline = clock() + timeout_s
    while not ready():
        if clock() >= deadline:
            raise ReplacementTimeout(
                f"the cluster was not ready again within timeout_s={timeout_s:g} "
                "(MaxText: elastic_timeout_seconds). Raise it or add capacity.",
                setting="timeout_s",
            )
        sleep(poll_s)
