"""TensorBoardCallback writes a run's step metrics as TensorBoard scalars,
read back here with TensorBoard's own reader (no Ray: the callback is
driven directly, as the controller would)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ray_elastic
from ray_elastic import ConfigError, TensorBoardCallback
from ray_elastic.observe import tensorboard as tb_module


def _scalars(logdir) -> tuple[set[str], dict[str, list[tuple[int, float]]]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    return tags, {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags}


def test_writes_every_numeric_metric_at_its_step(tmp_path):
    cb = TensorBoardCallback(str(tmp_path))
    assert not list(tmp_path.iterdir()), "nothing is written before the first step"
    for step in range(1, 6):
        metrics = {"loss": 4.0 - 0.5 * step, "slices": 2, "step_s": 0.1,
                   "accuracy": np.float32(0.1 * step), "note": "text", "flag": True}
        if step == 5:
            metrics["eval/loss"] = 1.25
        cb.on_step(step, metrics)
    cb.on_end(None)

    tags, got = _scalars(tmp_path)
    assert tags == {"train/loss", "train/slices", "train/step_s", "train/accuracy", "eval/loss"}
    assert got["train/loss"] == [(s, 4.0 - 0.5 * s) for s in range(1, 6)]
    assert got["train/slices"] == [(s, 2.0) for s in range(1, 6)]
    assert [s for s, _ in got["train/accuracy"]] == [1, 2, 3, 4, 5]
    for (s, v) in got["train/accuracy"]:
        assert v == pytest.approx(0.1 * s, rel=1e-6)  # stored as float32
    assert got["eval/loss"] == [(5, 1.25)]


def test_prefix_and_nonfinite_values(tmp_path):
    cb = TensorBoardCallback(str(tmp_path), prefix="lm")
    cb.on_step(1, {"loss": float("nan"), "slices": 1, "step_s": 0.2})
    cb.on_end(None)
    _, got = _scalars(tmp_path)
    assert set(got) == {"lm/loss", "lm/slices", "lm/step_s"}
    [(step, value)] = got["lm/loss"]
    assert step == 1 and math.isnan(value)


def test_flushes_at_most_once_a_second(tmp_path, monkeypatch):
    import tensorboardX

    now = [100.0]
    monkeypatch.setattr(tb_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    flushes = []
    monkeypatch.setattr(tensorboardX.SummaryWriter, "flush", lambda self: flushes.append(now[0]))
    cb = TensorBoardCallback(str(tmp_path))
    for step in range(1, 11):
        cb.on_step(step, {"loss": 1.0, "slices": 1, "step_s": 0.3})
        now[0] += 0.3
    # Steps end at 100.0, 100.3, ...: a flush once a second has passed since the last.
    assert flushes == pytest.approx([101.2, 102.4])
    monkeypatch.undo()
    cb.on_end(None)


@pytest.mark.parametrize("logdir", ["", "   ", None, 3])
def test_bad_logdir_is_a_config_error(logdir):
    with pytest.raises(ConfigError) as err:
        TensorBoardCallback(logdir)
    assert err.value.setting == "tensorboard.logdir"
    assert "tensorboard.logdir" in str(err.value)


def test_exported():
    assert "TensorBoardCallback" in ray_elastic.__all__
    assert isinstance(TensorBoardCallback("runs"), ray_elastic.Callback)
