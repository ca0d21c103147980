"""A small CNN with batch norm on generated images: `ray-elastic demo
--example cnn` trains it. Its point is the model state: Flax's
`batch_stats` are carried beside the params (`init_model_state`), updated
by every shard's forward pass and combined as their mean over the global
batch (`model_state_reduction="mean"`, a synchronized batch norm as in
Flax's ImageNet example), then saved, snapshotted and restored with the
params.

The images are 16x16 grey squares: class c draws stripes of one of four
orientations, plus noise, so a shard's batch is a pure function of (seed,
step, shard) and needs no download.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ray_elastic.layout import Layout
from ray_elastic.program import LossOutput, StepContext, TrainProgram

__all__ = ["CNN", "CNNConfig", "make_batch", "make_program"]

CLASSES = 4
SIZE = 16


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    shard_batch_size: int = 16
    features: int = 16
    learning_rate: float = 1e-2
    noise: float = 1.5


class CNN(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x: Any, train: bool) -> Any:
        for i, width in enumerate((self.features, 2 * self.features)):
            x = nn.Conv(width, (3, 3), name=f"conv{i}")(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name=f"bn{i}")(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(CLASSES, name="head")(x.mean(axis=(1, 2)))


def make_batch(config: CNNConfig, seed: int, step: int, shard: int, num_shards: int) -> dict:
    rng = np.random.default_rng((int(seed), int(step), int(shard)))
    labels = rng.integers(0, CLASSES, size=config.shard_batch_size)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    # Stripes: horizontal, vertical and the two diagonals.
    phase = np.stack([yy, xx, yy + xx, yy - xx])[labels]
    images = np.sin(phase * (np.pi / 2)) + config.noise * rng.standard_normal((len(labels), SIZE, SIZE))
    return {"images": images[..., None].astype(np.float32), "labels": labels.astype(np.int32)}


def _variables(config: CNNConfig, rng: Any) -> Any:
    return CNN(config.features).init(rng, jnp.zeros((1, SIZE, SIZE, 1), jnp.float32), train=False)


def _init_params(config: CNNConfig, rng: Any) -> Any:
    return _variables(config, rng)["params"]


def _init_stats(config: CNNConfig, rng: Any) -> Any:
    return _variables(config, rng)["batch_stats"]


def _loss_fn(config: CNNConfig, params: Any, batch: Any, ctx: StepContext) -> LossOutput:
    logits, updates = CNN(config.features).apply(
        {"params": params, "batch_stats": ctx.model_state}, batch["images"], train=True, mutable=["batch_stats"])
    labels = batch["labels"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    rows = jnp.float32(labels.shape[0])
    accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
    return LossOutput(total=jnp.sum(losses), weight=rows, aux={"accuracy": accuracy},
                      model_state=updates["batch_stats"])


def make_program(config: CNNConfig = CNNConfig(), layout: Layout = Layout()) -> TrainProgram:
    return TrainProgram(
        init_params=functools.partial(_init_params, config),
        loss_fn=functools.partial(_loss_fn, config),
        optimizer=optax.sgd(config.learning_rate, momentum=0.9),
        make_batch=functools.partial(make_batch, config),
        layout=layout,
        aux={"accuracy": "weighted_mean"},
        init_model_state=functools.partial(_init_stats, config),
        model_state_reduction="mean",
    )
