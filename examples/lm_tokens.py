"""The example LM written like a real train step (Flax's lm1b, MaxText):
`ray-elastic demo --example lm-tokens` trains it.

What `examples/lm.py`'s plain mean loss leaves out, this one has:

* **Padding with token weights.** Each row is a document of random length,
  padded to `seq_len + 1`; a `weights` column marks the real target
  tokens. Odd shards hold short documents, so shards differ a lot in real
  tokens: the loss is the sum over real tokens divided by the real tokens
  of the *global* batch (`LossOutput(total, weight)`), not a mean of shard
  means.
* **Dropout** with the step's key (`ctx.rng`, from (seed, step, shard)
  only: the same whichever slice computes the shard).
* **z-loss** (MaxText's `z_loss_multiplier`: `1e-4 * logsumexp(logits)^2`)
  added to the loss, and reported with the **accuracy** and the real
  **tokens** as aux metrics.
* **An eval** of a fixed held-out set every `eval_every` steps (no dropout),
  reported as `eval/loss` and `eval/accuracy`.
* **Skipping a step whose loss or gradient is not finite**
  (`post_update=skip_nonfinite`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ray_elastic.layout import Layout
from ray_elastic.program import LossOutput, StepContext, TrainProgram, skip_nonfinite

try:  # the installed package (ray_elastic.examples), or this folder run as `examples`
    from ray_elastic.examples import lm
except ImportError:  # pragma: no cover
    from examples import lm

__all__ = ["TokenLMConfig", "cross_entropy", "make_program", "make_batch", "make_eval_batch", "plain_loss"]

PAD = 0  # padding id (its targets have weight 0)
# The held-out set's rows come from this stream, apart from any training seed.
EVAL_SEED = 1_000_003


@dataclasses.dataclass(frozen=True)
class TokenLMConfig:
    """The LM's sizes (lm.LMConfig) and the train step's own settings."""

    lm: lm.LMConfig = lm.LMConfig()
    dropout_rate: float = 0.1
    z_loss: float = 1e-4  # MaxText's z_loss_multiplier
    min_doc_len: int = 2  # real tokens per row at least (targets: one fewer)
    eval_every: int = 10  # 0: no eval
    eval_rows: int = 8  # held-out rows per shard

    def __post_init__(self):
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
        if not 2 <= self.min_doc_len <= self.lm.seq_len + 1:
            raise ValueError(f"min_doc_len must be in [2, seq_len + 1], got {self.min_doc_len!r}")


def _model(config: TokenLMConfig) -> lm.LMModel:
    c = config.lm
    return lm.LMModel(vocab_size=c.vocab_size, seq_len=c.seq_len, d_model=c.d_model, num_layers=c.num_layers,
                      num_heads=c.num_heads, mlp_dim=c.mlp_dim, dropout_rate=config.dropout_rate)


def _rows(config: TokenLMConfig, rng: np.random.Generator, rows: int, max_len: int) -> dict:
    """`rows` documents of random length in [min_doc_len, max_len], padded."""
    corpus = lm.encoded_corpus(config.lm.corpus_seed, config.lm.corpus_chars)
    window = config.lm.seq_len + 1
    lengths = rng.integers(config.min_doc_len, max_len + 1, size=rows)
    starts = rng.integers(0, corpus.shape[0] - window + 1, size=rows)
    tokens = corpus[starts[:, None] + np.arange(window)[None, :]].astype(np.int32)
    real = np.arange(window)[None, :] < lengths[:, None]
    tokens = np.where(real, tokens, PAD).astype(np.int32)
    # weights[i, t] = 1 when target t (token t + 1) is real.
    return {"tokens": tokens, "weights": real[:, 1:].astype(np.float32)}


def make_batch(config: TokenLMConfig, seed: int, step: int, shard: int, num_shards: int) -> dict:
    """Shard `shard` of step `step`: a pure function of (seed, step, shard).
    Odd shards hold short documents (padding-heavy)."""
    rng = np.random.default_rng((int(seed), int(step), int(shard)))
    window = config.lm.seq_len + 1
    max_len = window if shard % 2 == 0 else max(config.min_doc_len, window // 4)
    return _rows(config, rng, config.lm.shard_batch_size, max_len)


def make_eval_batch(config: TokenLMConfig, seed: int, shard: int, num_shards: int) -> dict:
    """Shard `shard` of the fixed held-out set (the same at every step)."""
    rng = np.random.default_rng((EVAL_SEED, int(seed), int(shard)))
    return _rows(config, rng, config.eval_rows, config.lm.seq_len + 1)


def cross_entropy(logits: Any, targets: Any, z_loss: float) -> tuple:
    """Per-token (cross-entropy + z-loss, z-loss), as MaxText computes them."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    xent = log_z - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    z = z_loss * jnp.square(log_z)
    return xent + z, z


def _shard_sums(config: TokenLMConfig, params: Any, batch: Any, rng: Any, train: bool) -> tuple:
    """(summed loss, real tokens, summed z-loss, correct tokens) of a shard."""
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    weights = jnp.asarray(batch["weights"], jnp.float32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = _model(config).apply({"params": params}, inputs, deterministic=not train,
                                  rngs={"dropout": rng} if train else None)
    loss, z = cross_entropy(logits, targets, config.z_loss)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(loss * weights), jnp.sum(weights), jnp.sum(z * weights), jnp.sum(correct * weights)


def _loss_fn(config: TokenLMConfig, params: Any, batch: Any, ctx: StepContext) -> LossOutput:
    total, tokens, z, correct = _shard_sums(config, params, batch, ctx.rng, train=True)
    per_token = lambda x: x / jnp.maximum(tokens, 1.0)  # noqa: E731 (a shard with no real token weighs 0)
    return LossOutput(total=total, weight=tokens,
                      aux={"accuracy": per_token(correct), "z_loss": per_token(z), "tokens": tokens})


def _eval_fn(config: TokenLMConfig, params: Any, batch: Any, ctx: StepContext) -> LossOutput:
    total, tokens, _, correct = _shard_sums(config, params, batch, ctx.rng, train=False)
    return LossOutput(total=total, weight=tokens, aux={"accuracy": correct / jnp.maximum(tokens, 1.0)})


AUX = {"accuracy": "weighted_mean", "z_loss": "weighted_mean", "tokens": "sum"}


def make_program(config: TokenLMConfig = TokenLMConfig(), layout: Layout = Layout()) -> TrainProgram:
    """The token-weighted LM as a TrainProgram."""
    return TrainProgram(
        init_params=functools.partial(lm.init_params, config.lm),
        loss_fn=functools.partial(_loss_fn, config),
        optimizer=lm.make_optimizer(config.lm),
        make_batch=functools.partial(make_batch, config),
        layout=layout,
        aux=AUX,
        post_update=skip_nonfinite,
        eval_fn=functools.partial(_eval_fn, config),
        make_eval_batch=functools.partial(make_eval_batch, config),
        eval_every=config.eval_every,
        eval_aux={"accuracy": "weighted_mean"},
    )


def plain_loss(config: TokenLMConfig, params: Any, batches: list, rngs: list) -> Any:
    """The loss a plain JAX job computes over a global batch made of
    `batches` (one per shard, with its dropout key): the summed loss over
    the real tokens of the whole batch. The reference of the tests."""
    sums = [_shard_sums(config, params, b, r, train=True) for b, r in zip(batches, rngs)]
    return sum(s[0] for s in sums) / sum(s[1] for s in sums)
