"""Durable checkpoints: what to write and when (config), Orbax steps on disk
or GCS (store), checksums of every array and file and what happens to a
damaged step (integrity), the writer actor beside the driver (writer), the
driver's side of saves and their failures (coordinator), and the idle CPU
class periodic saves run in (cpu_priority)."""

from ray_elastic.checkpoint.config import CheckpointConfig
from ray_elastic.checkpoint.store import CheckpointStore, StepInfo, refresh_listings, unflatten
from ray_elastic.errors import CheckpointDamaged, CheckpointStorageFailed, StorageError

__all__ = [
    "CheckpointConfig",
    "CheckpointStore",
    "StepInfo",
    "refresh_listings",
    "unflatten",
    "StorageError",
    "CheckpointStorageFailed",
    "CheckpointDamaged",
]
