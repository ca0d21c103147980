"""Fast unit tests for examples/lm.py, the model `ray-elastic demo` trains."""

from __future__ import annotations

import math
import os
import pickle
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import examples.lm as lm  # noqa: E402
from ray_elastic.program import TrainProgram  # noqa: E402

# Smaller than the default so compiles stay quick; the default is checked by
# test_default_config_program_runs.
SMALL = lm.LMConfig(seq_len=16, d_model=32, num_layers=1, num_heads=2, mlp_dim=64,
                    shard_batch_size=4, corpus_chars=20_000)


@pytest.fixture(scope="module")
def small_program() -> TrainProgram:
    return lm.make_program(SMALL)


@pytest.fixture(scope="module")
def small_params(small_program):
    return small_program.init_params(jax.random.PRNGKey(0))


# ---------------------------------------------------------------- corpus


def test_corpus_deterministic_and_in_vocab():
    a = lm.generate_corpus(0, 5_000)
    assert a == lm.generate_corpus(0, 5_000)
    assert len(a) == 5_000
    assert a != lm.generate_corpus(1, 5_000)
    assert set(a) <= set(lm.VOCAB)
    assert lm.generate_corpus(0, 1_000) == a[:1_000]


def test_encode_decode_roundtrip():
    text = lm.generate_corpus(3, 2_000)
    ids = lm.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (2_000,)
    assert ids.min() >= 0 and ids.max() < len(lm.VOCAB)
    assert lm.decode(ids) == text
    assert lm.decode([]) == ""


def test_encoded_corpus_cached():
    a = lm.encoded_corpus(0, 20_000)
    assert lm.encoded_corpus(0, 20_000) is a
    assert not a.flags.writeable


# ---------------------------------------------------------------- make_batch


def test_make_batch_shapes_and_dtype(small_program):
    batch = small_program.make_batch(0, 0, 0, 1)
    assert set(batch) == {"tokens"}
    tokens = batch["tokens"]
    assert isinstance(tokens, np.ndarray)
    assert tokens.dtype == np.int32
    assert tokens.shape == (SMALL.shard_batch_size, SMALL.seq_len + 1)
    assert tokens.min() >= 0 and tokens.max() < SMALL.vocab_size


def test_make_batch_default_config_shape():
    tokens = lm.make_program().make_batch(0, 0, 0, 1)["tokens"]
    assert tokens.shape == (8, 65) and tokens.dtype == np.int32


def test_make_batch_is_pure(small_program):
    mb = small_program.make_batch
    np.testing.assert_array_equal(mb(7, 3, 1, 4)["tokens"], mb(7, 3, 1, 4)["tokens"])
    # A fresh program (as a worker would rebuild it) gives the same data.
    np.testing.assert_array_equal(
        mb(7, 3, 1, 4)["tokens"], lm.make_program(SMALL).make_batch(7, 3, 1, 4)["tokens"]
    )
    # Step, shard and seed each change the data.
    base = mb(7, 3, 1, 4)["tokens"]
    assert not np.array_equal(base, mb(7, 4, 1, 4)["tokens"])
    assert not np.array_equal(base, mb(7, 3, 2, 4)["tokens"])
    assert not np.array_equal(base, mb(8, 3, 1, 4)["tokens"])


def test_make_batch_independent_of_num_shards(small_program):
    mb = small_program.make_batch
    np.testing.assert_array_equal(mb(0, 5, 1, 2)["tokens"], mb(0, 5, 1, 8)["tokens"])


def test_make_batch_windows_are_corpus_slices(small_program):
    corpus = lm.encoded_corpus(SMALL.corpus_seed, SMALL.corpus_chars)
    text = lm.decode(corpus)
    for row in small_program.make_batch(1, 2, 0, 1)["tokens"]:
        assert lm.decode(row) in text


def test_make_batch_rejects_bad_shard(small_program):
    with pytest.raises(ValueError):
        small_program.make_batch(0, 0, 4, 4)


# ---------------------------------------------------------------- model / loss


def test_params_are_float32_dict(small_params):
    assert isinstance(small_params, dict)
    leaves = jax.tree_util.tree_leaves(small_params)
    assert leaves and all(leaf.dtype == jnp.float32 for leaf in leaves)


def test_init_deterministic(small_program, small_params):
    again = small_program.init_params(jax.random.PRNGKey(0))
    for a, b in zip(jax.tree_util.tree_leaves(small_params), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_initial_loss_near_log_vocab(small_program, small_params):
    loss = jax.jit(small_program.loss_fn)(small_params, small_program.make_batch(0, 0, 0, 1))
    assert loss.shape == ()
    assert np.isfinite(float(loss))
    assert abs(float(loss) - math.log(SMALL.vocab_size)) < 0.5


def test_model_is_causal(small_params):
    model = lm._model(SMALL)
    ids = jnp.asarray(lm.encode(lm.generate_corpus(0, SMALL.seq_len))[None, :])
    changed = ids.at[0, -1].set((ids[0, -1] + 1) % SMALL.vocab_size)
    apply = jax.jit(lambda ids: model.apply({"params": small_params}, ids))
    a, b = apply(ids), apply(changed)
    np.testing.assert_allclose(np.asarray(a[0, :-1]), np.asarray(b[0, :-1]), atol=1e-5)
    assert not np.allclose(np.asarray(a[0, -1]), np.asarray(b[0, -1]))


def test_optax_steps_lower_loss(small_program, small_params):
    opt = small_program.optimizer
    batch = small_program.make_batch(0, 0, 0, 1)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(small_program.loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    params, state = small_params, opt.init(small_params)
    first = None
    for _ in range(15):
        params, state, loss = step(params, state)
        first = float(loss) if first is None else first
    final = float(small_program.loss_fn(params, batch))
    assert np.isfinite(final)
    assert final < first - 0.5


def test_default_config_program_runs():
    program = lm.make_program()
    params = program.init_params(jax.random.PRNGKey(1))
    loss = jax.jit(program.loss_fn)(params, program.make_batch(0, 0, 0, 1))
    assert np.isfinite(float(loss))


def test_program_pieces_pickle(small_program):
    # The batch and model functions travel to workers; they must pickle.
    for fn in (small_program.init_params, small_program.loss_fn, small_program.make_batch):
        clone = pickle.loads(pickle.dumps(fn))
        assert clone.args == fn.args
    clone = pickle.loads(pickle.dumps(small_program.make_batch))
    np.testing.assert_array_equal(clone(0, 1, 2, 3)["tokens"],
                                  small_program.make_batch(0, 1, 2, 3)["tokens"])


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seq_len": 0}, "seq_len"),
        ({"d_model": -4}, "d_model"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_heads": 0}, "num_heads"),
        ({"mlp_dim": 0}, "mlp_dim"),
        ({"shard_batch_size": 0}, "shard_batch_size"),
        ({"seq_len": 2.5}, "seq_len"),
        ({"d_model": 64, "num_heads": 5}, "d_model"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"corpus_seed": -1}, "corpus_seed"),
        ({"corpus_chars": 10}, "corpus_chars"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        lm.LMConfig(**kwargs)


def test_config_defaults():
    cfg = lm.LMConfig()
    assert (cfg.seq_len, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.mlp_dim,
            cfg.shard_batch_size) == (64, 64, 2, 4, 256, 8)
    assert cfg.vocab_size == len(lm.VOCAB)
    with pytest.raises(Exception):
        cfg.seq_len = 3  # frozen
