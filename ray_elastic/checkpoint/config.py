"""CheckpointConfig: where and how often durable checkpoints are written."""

from __future__ import annotations

import dataclasses

from ray_elastic.errors import ConfigError, StorageError
from ray_elastic.paths import work_path

__all__ = ["CheckpointConfig"]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """path: local folder or gs://bucket/prefix.
    save_every: steps between checkpoints (0: only at preemption and end).
    keep: committed steps kept; older ones are deleted.
    continuous: start the next save as soon as the previous one commits
        (save_every is then a floor, not a cadence).
    save_at_end: checkpoint the final step. Either way, a save still in
        flight when the run ends is waited for (up to save_timeout_s).
    storage_retries / retry_backoff_s: a failing write is retried this many
        times, doubling the wait each time, before the save counts as failed.
    max_failed_saves: consecutive failed saves before the run stops, after
        rescuing the state to `rescue_dir`.
    save_timeout_s: a save still running after this long (a storage that
        stopped answering) is abandoned and its writer replaced.
    """

    path: str
    save_every: int = 100
    keep: int = 3
    continuous: bool = False
    save_at_end: bool = True
    storage_retries: int = 4
    retry_backoff_s: float = 0.5
    max_failed_saves: int = 3
    save_timeout_s: float = 600.0
    rescue_dir: str = work_path("rescue")

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path.strip():
            raise ConfigError("checkpoint.path", "must be a folder or gs://bucket/prefix")
        scheme = self.path.split("://", 1)[0] if "://" in self.path else ""
        if scheme not in ("", "file", "gs"):
            raise ConfigError("checkpoint.path", f"scheme {scheme!r} is not supported; use a folder or gs://")
        if scheme == "gs" and not self.path[len("gs://"):].split("/")[0]:
            raise ConfigError("checkpoint.path", f"{self.path!r} names no bucket")
        for name in ("save_every", "storage_retries"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"checkpoint.{name}", f"must be an integer >= 0, got {v!r}")
        for name in ("keep", "max_failed_saves"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"checkpoint.{name}", f"must be an integer >= 1, got {v!r}")
        if not isinstance(self.save_timeout_s, (int, float)) or self.save_timeout_s <= 0:
            raise ConfigError("checkpoint.save_timeout_s", f"must be > 0, got {self.save_timeout_s!r}")
        if not isinstance(self.retry_backoff_s, (int, float)) or self.retry_backoff_s < 0:
            raise ConfigError("checkpoint.retry_backoff_s", f"must be >= 0, got {self.retry_backoff_s!r}")

    def check_storage(self, timeout_s: float = 30.0) -> None:
        """Prove `path` writable (on GCS: its bucket exists and answers)
        without a cluster, the first thing a run's own preflight does: a
        ConfigError naming checkpoint.path otherwise, after at most
        `timeout_s`. A command line that starts a cluster calls it first."""
        from ray_elastic.checkpoint.store import CheckpointStore

        try:
            CheckpointStore(self.path).preflight(timeout_s)
        except StorageError as e:
            raise ConfigError("checkpoint.path", str(e).removeprefix("checkpoint.path: ")) from None

    def due(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0
