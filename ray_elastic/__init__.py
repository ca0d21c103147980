"""ray_elastic: keep multi-slice JAX training alive through hardware
failures, with the Ray driver as the single controller.

The names below load on first use (PEP 562): a worker process imports
`ray_elastic.worker.actor` through this package, and the driver's side
(the controller, Orbax's checkpointing, the callbacks) is no part of a
worker's start; importing it eagerly cost every new worker ~0.3 s of CPU.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it
_WHERE = {
    "Callback": "ray_elastic.callbacks",
    "Phase": "ray_elastic.callbacks",
    "RunStatus": "ray_elastic.callbacks",
    "CheckpointConfig": "ray_elastic.checkpoint",
    "CheckpointSaveFailed": "ray_elastic.errors",
    "CheckpointStorageFailed": "ray_elastic.errors",
    "StorageError": "ray_elastic.errors",
    "CpuSlice": "ray_elastic.config",
    "GpuSlice": "ray_elastic.config",
    "TpuSlice": "ray_elastic.config",
    "ElasticConfig": "ray_elastic.config",
    "ElasticTrainer": "ray_elastic.trainer",
    "release_workers": "ray_elastic.cluster.kept_workers",
    "TrainProgram": "ray_elastic.program",
    "LossOutput": "ray_elastic.program",
    "StepContext": "ray_elastic.program",
    "TrainState": "ray_elastic.program",
    "skip_nonfinite": "ray_elastic.program",
    "Layout": "ray_elastic.layout",
    "Fault": "ray_elastic.failures.faults",
    "EventLog": "ray_elastic.observe.events",
    "read_events": "ray_elastic.observe.events",
    "MetricsCallback": "ray_elastic.observe.metrics",
    "ProgressCallback": "ray_elastic.observe.progress",
    "TensorBoardCallback": "ray_elastic.observe.tensorboard",
    "elastic_retry": "ray_elastic.retry",
    "RunReport": "ray_elastic.observe.report",
    "FailureRecord": "ray_elastic.observe.report",
    "ElasticError": "ray_elastic.errors",
    "ConfigError": "ray_elastic.errors",
    "FailureKind": "ray_elastic.errors",
    "SliceFailure": "ray_elastic.errors",
    "WorkerProcessDied": "ray_elastic.errors",
    "NodeDied": "ray_elastic.errors",
    "WorkerHung": "ray_elastic.errors",
    "SlicePreempted": "ray_elastic.errors",
    "WorkerOutOfMemory": "ray_elastic.errors",
    "RunFailed": "ray_elastic.errors",
    "NonFiniteLoss": "ray_elastic.errors",
    "RetryBudgetExhausted": "ray_elastic.errors",
    "ReplacementTimeout": "ray_elastic.errors",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # the same names, for type checkers and editors
    from ray_elastic.callbacks import Callback, Phase, RunStatus  # noqa: F401
    from ray_elastic.checkpoint import CheckpointConfig  # noqa: F401
    from ray_elastic.cluster.kept_workers import release_workers  # noqa: F401
    from ray_elastic.config import CpuSlice, ElasticConfig, GpuSlice, TpuSlice  # noqa: F401
    from ray_elastic.errors import (  # noqa: F401
        CheckpointSaveFailed, CheckpointStorageFailed, ConfigError, ElasticError, FailureKind, NodeDied,
        NonFiniteLoss, ReplacementTimeout, RetryBudgetExhausted, RunFailed, SliceFailure, SlicePreempted,
        StorageError, WorkerHung, WorkerOutOfMemory, WorkerProcessDied,
    )
    from ray_elastic.failures.faults import Fault  # noqa: F401
    from ray_elastic.layout import Layout  # noqa: F401
    from ray_elastic.observe.events import EventLog, read_events  # noqa: F401
    from ray_elastic.observe.metrics import MetricsCallback  # noqa: F401
    from ray_elastic.observe.progress import ProgressCallback  # noqa: F401
    from ray_elastic.observe.report import FailureRecord, RunReport  # noqa: F401
    from ray_elastic.observe.tensorboard import TensorBoardCallback  # noqa: F401
    from ray_elastic.program import LossOutput, StepContext, TrainProgram, TrainState, skip_nonfinite  # noqa: F401
    from ray_elastic.retry import elastic_retry  # noqa: F401
    from ray_elastic.trainer import ElasticTrainer  # noqa: F401
