"""ray_elastic: keep multi-slice JAX training alive through hardware
failures, with the Ray driver as the single controller."""

from ray_elastic.callbacks import Callback, Phase, RunStatus
from ray_elastic.checkpoint import CheckpointConfig
from ray_elastic.errors import CheckpointSaveFailed, CheckpointStorageFailed, StorageError
from ray_elastic.config import CpuSlice, ElasticConfig, GpuSlice, TpuSlice
from ray_elastic.trainer import ElasticTrainer
from ray_elastic.cluster.kept_workers import release_workers
from ray_elastic.errors import (
    ConfigError,
    ElasticError,
    FailureKind,
    NodeDied,
    ReplacementTimeout,
    NonFiniteLoss,
    RetryBudgetExhausted,
    RunFailed,
    SliceFailure,
    SlicePreempted,
    WorkerOutOfMemory,
    WorkerHung,
    WorkerProcessDied,
)
from ray_elastic.observe.events import EventLog, read_events
from ray_elastic.failures.faults import Fault
from ray_elastic.observe.metrics import MetricsCallback
from ray_elastic.observe.progress import ProgressCallback
from ray_elastic.observe.tensorboard import TensorBoardCallback
from ray_elastic.retry import elastic_retry
from ray_elastic.layout import Layout
from ray_elastic.program import LossOutput, StepContext, TrainProgram, TrainState, skip_nonfinite
from ray_elastic.observe.report import FailureRecord, RunReport

__all__ = [
    "Callback",
    "Phase",
    "RunStatus",
    "CheckpointConfig",
    "CheckpointSaveFailed",
    "CheckpointStorageFailed",
    "StorageError",
    "CpuSlice",
    "GpuSlice",
    "TpuSlice",
    "ElasticConfig",
    "ElasticTrainer",
    "release_workers",
    "TrainProgram",
    "LossOutput",
    "StepContext",
    "TrainState",
    "skip_nonfinite",
    "Layout",
    "Fault",
    "EventLog",
    "read_events",
    "MetricsCallback",
    "ProgressCallback",
    "TensorBoardCallback",
    "elastic_retry",
    "RunReport",
    "FailureRecord",
    "ElasticError",
    "ConfigError",
    "FailureKind",
    "SliceFailure",
    "WorkerProcessDied",
    "NodeDied",
    "WorkerHung",
    "SlicePreempted",
    "WorkerOutOfMemory",
    "RunFailed",
    "NonFiniteLoss",
    "RetryBudgetExhausted",
    "ReplacementTimeout",
]
