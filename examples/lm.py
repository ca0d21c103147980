"""A small character-level transformer language model: the job `ray-elastic demo` trains.

Everything here is self-contained so that any worker, on any host, rebuilds the
exact same job with no downloads and no data files:

* `generate_corpus` writes a few hundred KB of English-like text from a tiny
  seeded grammar (subjects, verbs, objects, places, times, questions, quotes).
  Its characters all come from a fixed alphabet, `VOCAB`, so `encode` and
  `decode` never depend on the seed.
* `LMModel` is a decoder-only transformer (pre-LayerNorm, learned positions,
  causal multi-head self-attention, GELU MLP), written with `flax.linen`.
* `make_program(config)` packs it into a `ray_elastic.program.TrainProgram`:
  `loss_fn` is the mean next-token cross-entropy, `optimizer` is AdamW with
  gradient clipping, and `make_batch(seed, step, shard, num_shards)` draws
  random windows of the encoded corpus from `np.random.default_rng((seed,
  step, shard))`. A shard's batch therefore does not depend on `num_shards`:
  shard s of step k is the same whatever the number of shards, so a resumed or
  resized run sees exactly the data a failure-free run would.

The encoded corpus is built once per process and cached (`encoded_corpus`).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Iterable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ray_elastic.layout import Layout
from ray_elastic.program import TrainProgram

__all__ = [
    "VOCAB",
    "LMConfig",
    "LMModel",
    "decode",
    "encode",
    "encoded_corpus",
    "generate_corpus",
    "init_params",
    "make_optimizer",
    "make_program",
    "param_logical_axes",
    "sharded_layout",
    "LARGE",
    "Layout",
    "MEDIUM",
    "PRESETS",
    "SHARDINGS",
]

# --------------------------------------------------------------------------
# Corpus: a tiny seeded grammar of English-like sentences.
# --------------------------------------------------------------------------

_NAMES = (
    "Ada", "Ben", "Clara", "Dmitri", "Elena", "Farid", "Grace", "Hugo", "Iris",
    "Jonas", "Kofi", "Lena", "Mateo", "Nadia", "Oscar", "Priya", "Quinn",
    "Rosa", "Sam", "Tomas", "Uma", "Victor", "Wren", "Yusuf", "Zoe",
)
_ADJECTIVES = (
    "quick", "lazy", "small", "old", "young", "quiet", "loud", "bright",
    "dark", "happy", "tired", "clever", "brave", "gentle", "strange", "green",
    "red", "blue", "heavy", "tiny", "curious", "hungry", "wooden", "silver",
)
_NOUNS = (
    ("fox", "foxes"), ("dog", "dogs"), ("cat", "cats"), ("bird", "birds"),
    ("child", "children"), ("farmer", "farmers"), ("teacher", "teachers"),
    ("robot", "robots"), ("horse", "horses"), ("sailor", "sailors"),
    ("baker", "bakers"), ("student", "students"), ("king", "kings"),
    ("queen", "queens"), ("wolf", "wolves"), ("mouse", "mice"),
    ("doctor", "doctors"), ("painter", "painters"), ("owl", "owls"),
)
_OBJECTS = (
    "the ball", "a letter", "the bread", "a map", "the lamp", "a song",
    "the old book", "a red apple", "the key", "a small boat", "the bridge",
    "a cup of tea", "the garden gate", "a wooden box", "the river stones",
    "a silver coin", "the last train", "a paper kite", "the clock", "a story",
)
# (present 3rd person singular, present plural, past)
_VERBS = (
    ("finds", "find", "found"), ("carries", "carry", "carried"),
    ("watches", "watch", "watched"), ("builds", "build", "built"),
    ("paints", "paint", "painted"), ("opens", "open", "opened"),
    ("loses", "lose", "lost"), ("sells", "sell", "sold"),
    ("reads", "read", "read"), ("hides", "hide", "hid"),
    ("follows", "follow", "followed"), ("fixes", "fix", "fixed"),
    ("throws", "throw", "threw"), ("brings", "bring", "brought"),
    ("chases", "chase", "chased"), ("remembers", "remember", "remembered"),
)
_INTRANSITIVE = (
    ("sleeps", "sleep", "slept"), ("runs", "run", "ran"),
    ("sings", "sing", "sang"), ("waits", "wait", "waited"),
    ("laughs", "laugh", "laughed"), ("dances", "dance", "danced"),
    ("works", "work", "worked"), ("listens", "listen", "listened"),
)
_PLACES = (
    "in the forest", "near the river", "on the hill", "at the market",
    "under the bridge", "by the sea", "in the old house", "behind the barn",
    "across the field", "inside the castle", "at the station", "in the city",
)
_TIMES = (
    "in the morning", "at night", "every day", "on Sunday", "after dinner",
    "before sunrise", "in winter", "last year", "at noon", "once again",
)
_ADVERBS = (
    "slowly", "quickly", "quietly", "happily", "carefully", "suddenly",
    "rarely", "often", "gladly", "always",
)
_CONJUNCTIONS = ("and", "but", "so", "because", "while", "although")
_SAY_VERBS = ("said", "asked", "whispered", "shouted", "replied")
_NUMBERS = (
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "twelve", "twenty",
)


def _subject(rng: random.Random) -> tuple[str, bool]:
    """A noun phrase and whether it is plural."""
    r = rng.random()
    if r < 0.3:
        return rng.choice(_NAMES), False
    singular, plural = rng.choice(_NOUNS)
    adjective = rng.choice(_ADJECTIVES) + " " if rng.random() < 0.5 else ""
    if r < 0.75:
        return f"{rng.choice(('the', 'a', 'the', 'my', 'our'))} {adjective}{singular}", False
    if r < 0.9:
        return f"the {adjective}{plural}", True
    return f"{rng.choice(_NUMBERS)} {adjective}{plural}", True


def _clause(rng: random.Random) -> str:
    subject, plural = _subject(rng)
    tense = 2 if rng.random() < 0.5 else (1 if plural else 0)
    if rng.random() < 0.7:
        verb = rng.choice(_VERBS)[tense]
        words = [subject, verb, rng.choice(_OBJECTS)]
    else:
        words = [subject, rng.choice(_INTRANSITIVE)[tense]]
        if rng.random() < 0.5:
            words.append(rng.choice(_ADVERBS))
    if rng.random() < 0.5:
        words.append(rng.choice(_PLACES))
    if rng.random() < 0.3:
        words.append(rng.choice(_TIMES))
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        body, end = _clause(rng), "."
    elif r < 0.8:
        body, end = f"{_clause(rng)}, {rng.choice(_CONJUNCTIONS)} {_clause(rng)}", "."
    elif r < 0.9:
        verb = rng.choice(_VERBS)[1]
        body = (
            f"{rng.choice(('did', 'will', 'can'))} {_subject(rng)[0]} {verb} "
            f"{rng.choice(_OBJECTS)}"
        )
        end = "?"
    else:
        quote = _clause(rng)
        quote = quote[0].upper() + quote[1:]
        speaker = rng.choice(_NAMES)
        body = f'"{quote}," {speaker} {rng.choice(_SAY_VERBS)}'
        end = "."
    return body[0].upper() + body[1:] + end


def generate_corpus(seed: int = 0, num_chars: int = 200_000) -> str:
    """Deterministic English-like text of exactly `num_chars` characters.

    Paragraphs of 3 to 7 sentences, separated by newlines. Every character is
    in `VOCAB`. The same (seed, num_chars) gives the same string everywhere.
    """
    if num_chars < 0:
        raise ValueError(f"num_chars must be >= 0, got {num_chars}")
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < num_chars:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) + "\n"
        parts.append(paragraph)
        total += len(paragraph)
    return "".join(parts)[:num_chars]


def _grammar_alphabet() -> str:
    words: list[str] = []
    for table in (_NAMES, _ADJECTIVES, _OBJECTS, _PLACES, _TIMES, _ADVERBS,
                  _CONJUNCTIONS, _SAY_VERBS, _NUMBERS, ("the a my our did will can",)):
        words.extend(table)
    for table in (_NOUNS, _VERBS, _INTRANSITIVE):
        for forms in table:
            words.extend(forms)
    chars = set("".join(words))
    chars |= {c.upper() for c in chars if c.isalpha()}
    chars |= set(" \n.,?\"")
    return "".join(sorted(chars))


# The character vocabulary: every character the grammar can emit, sorted.
VOCAB: str = _grammar_alphabet()
_CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB)}
_VOCAB_ARRAY = np.array(list(VOCAB))


def encode(text: str) -> np.ndarray:
    """Characters -> int32 ids in [0, len(VOCAB)). Raises KeyError on unknown chars."""
    return np.fromiter((_CHAR_TO_ID[c] for c in text), dtype=np.int32, count=len(text))


def decode(ids: Iterable[int]) -> str:
    """int ids -> text (inverse of `encode`)."""
    return "".join(_VOCAB_ARRAY[np.asarray(ids, dtype=np.int64).reshape(-1)])


@functools.lru_cache(maxsize=8)
def encoded_corpus(seed: int = 0, num_chars: int = 200_000) -> np.ndarray:
    """The encoded corpus, built once per process per (seed, num_chars); read-only."""
    ids = encode(generate_corpus(seed, num_chars))
    ids.setflags(write=False)
    return ids


# --------------------------------------------------------------------------
# Config and model.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Hyperparameters of the example LM. `vocab_size` comes from `VOCAB`."""

    seq_len: int = 64
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 256
    shard_batch_size: int = 8  # sequences per shard per step
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0  # <= 0 disables clipping
    corpus_seed: int = 0
    corpus_chars: int = 200_000
    # Constrain activations by logical names, as MaxText's layers do
    # (activation_batch, activation_length, activation_embed, activation_mlp);
    # the layout's rules map them to mesh axes (SHARDINGS).
    logical_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("seq_len", "d_model", "num_layers", "num_heads", "mlp_dim",
                     "shard_batch_size", "corpus_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})"
            )
        if isinstance(self.corpus_seed, bool) or not isinstance(self.corpus_seed, (int, np.integer)) \
                or self.corpus_seed < 0:
            raise ValueError(f"corpus_seed must be a non-negative int, got {self.corpus_seed!r}")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate!r}")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not isinstance(self.grad_clip_norm, (int, float)):
            raise ValueError(f"grad_clip_norm must be a number, got {self.grad_clip_norm!r}")
        if self.corpus_chars < self.seq_len + 1:
            raise ValueError(
                f"corpus_chars ({self.corpus_chars}) must be at least seq_len + 1 "
                f"({self.seq_len + 1})"
            )

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)


def _constrained(x: jax.Array, names: tuple, on: bool) -> jax.Array:
    return nn.with_logical_constraint(x, names) if on else x


class _Block(nn.Module):
    d_model: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    logical_activations: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, deterministic: bool = True) -> jax.Array:
        h = nn.LayerNorm(name="ln_attn")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, qkv_features=self.d_model,
            out_features=self.d_model, deterministic=True, name="attn",
        )(h, h, mask=mask)
        # Residual dropout, as in lm1b and MaxText (a no-op at rate 0).
        x = x + nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.Dense(self.mlp_dim, name="mlp_in")(h)
        h = _constrained(h, ("activation_batch", "activation_length", "activation_mlp"), self.logical_activations)
        h = nn.gelu(h)
        h = nn.Dense(self.d_model, name="mlp_out")(h)
        return x + nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)


class LMModel(nn.Module):
    """Decoder-only transformer: ids [B, T] -> next-token logits [B, T, vocab]."""

    vocab_size: int
    seq_len: int
    d_model: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    logical_activations: bool = False

    @nn.compact
    def __call__(self, ids: jax.Array, deterministic: bool = True, segment_ids: Optional[jax.Array] = None,
                 positions: Optional[jax.Array] = None) -> jax.Array:
        """Packed rows (several documents per row, as MaxText packs them)
        pass `segment_ids` (1, 2, ... per document, 0 for padding) and
        `positions` (each token's place in its document): a token then
        attends only to earlier tokens of its own document."""
        length = ids.shape[-1]
        tok = nn.Embed(self.vocab_size, self.d_model, name="tok_embed")(ids)
        pos = self.param(
            "pos_embed", nn.initializers.normal(stddev=0.02), (self.seq_len, self.d_model)
        )
        x = tok + (pos[:length] if positions is None else pos[positions])
        mask = nn.make_causal_mask(ids)
        if segment_ids is not None:
            mask = nn.combine_masks(mask, nn.make_attention_mask(segment_ids, segment_ids, jnp.equal))
        embed_names = ("activation_batch", "activation_length", "activation_embed")
        x = _constrained(x, embed_names, self.logical_activations)
        for i in range(self.num_layers):
            x = _Block(self.d_model, self.num_heads, self.mlp_dim, self.dropout_rate, self.logical_activations,
                       name=f"block_{i}")(x, mask, deterministic)
            x = _constrained(x, embed_names, self.logical_activations)
        x = nn.LayerNorm(name="ln_final")(x)
        # A small head init keeps the initial loss near log(vocab_size).
        return nn.Dense(
            self.vocab_size, kernel_init=nn.initializers.normal(stddev=0.02), name="head"
        )(x)


def _model(config: LMConfig) -> LMModel:
    return LMModel(
        vocab_size=config.vocab_size, seq_len=config.seq_len, d_model=config.d_model,
        num_layers=config.num_layers, num_heads=config.num_heads, mlp_dim=config.mlp_dim,
        logical_activations=config.logical_activations,
    )


# --------------------------------------------------------------------------
# The TrainProgram pieces (module-level functions + partial, so they pickle).
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _jitted_init(config: LMConfig) -> Any:
    model = _model(config)

    def init(rng: Any) -> Any:
        # Made inside: a closed-over array would become a constant input
        # of every function that traces this one.
        dummy = jnp.zeros((1, config.seq_len), dtype=jnp.int32)
        params = model.init(rng, dummy)["params"]
        return jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)

    # Jitted: about twice as fast as eager init on CPU (one compile, no per-op dispatch).
    return jax.jit(init)


def _init_params(config: LMConfig, rng: Any) -> dict:
    return _unfreeze(_jitted_init(config)(rng))


def init_params(config: LMConfig, rng: Any) -> dict:
    """The LM's step-0 params from `rng` (what make_program's init_params runs)."""
    return _init_params(config, rng)


def _unfreeze(tree: Any) -> Any:
    """FrozenDict/Mapping -> nested plain dicts (flax may hand back either)."""
    if hasattr(tree, "items"):
        return {k: _unfreeze(v) for k, v in tree.items()}
    return tree


def _loss_fn(config: LMConfig, params: Any, batch: Any) -> jax.Array:
    tokens = jnp.asarray(batch["tokens"], dtype=jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = _model(config).apply({"params": params}, inputs)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    )
    return jnp.mean(losses)


def _make_batch(config: LMConfig, seed: int, step: int, shard: int, num_shards: int) -> dict:
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, num_shards={num_shards}), got {shard}")
    corpus = encoded_corpus(config.corpus_seed, config.corpus_chars)
    window = config.seq_len + 1
    # num_shards deliberately does not enter the stream: shard s of step k is the
    # same whatever the shard count.
    rng = np.random.default_rng((int(seed), int(step), int(shard)))
    starts = rng.integers(0, corpus.shape[0] - window + 1, size=config.shard_batch_size)
    tokens = corpus[starts[:, None] + np.arange(window)[None, :]]
    return {"tokens": np.ascontiguousarray(tokens, dtype=np.int32)}


def make_optimizer(config: LMConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    if config.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw)
    return adamw


# --------------------------------------------------------------------------
# Sharded layouts: Flax logical axis names per parameter, and MaxText-style
# rules mapping them onto an in-slice mesh.
# --------------------------------------------------------------------------

# Larger presets, what the sharded layouts are for: medium about 3.2M
# parameters (38 MB of params + Adam state), large about 25M (300 MB).
MEDIUM = LMConfig(seq_len=64, d_model=256, num_layers=4, num_heads=8, mlp_dim=1024)
LARGE = LMConfig(seq_len=128, d_model=512, num_layers=8, num_heads=8, mlp_dim=2048)
PRESETS = {"small": LMConfig(), "medium": MEDIUM, "large": LARGE}

# The logical names of each parameter's dimensions, by its path's last
# names (Flax's Dense, MultiHeadDotProductAttention, Embed, LayerNorm).
_LOGICAL = {
    ("embedding",): ("vocab", "embed"),
    ("pos_embed",): ("position", "embed"),
    ("query", "kernel"): ("embed", "heads", "kv"), ("key", "kernel"): ("embed", "heads", "kv"),
    ("value", "kernel"): ("embed", "heads", "kv"), ("out", "kernel"): ("heads", "kv", "embed"),
    ("query", "bias"): ("heads", "kv"), ("key", "bias"): ("heads", "kv"),
    ("value", "bias"): ("heads", "kv"), ("out", "bias"): ("embed",),
    ("mlp_in", "kernel"): ("embed", "mlp"), ("mlp_in", "bias"): ("mlp",),
    ("mlp_out", "kernel"): ("mlp", "embed"), ("mlp_out", "bias"): ("embed",),
    ("head", "kernel"): ("embed", "vocab"), ("head", "bias"): ("vocab",),
    ("scale",): ("norm",), ("bias",): ("norm",),  # LayerNorm: kept whole
}

# Logical name -> mesh axis. FSDP splits every weight along the model
# dimension over the `fsdp` axis; with tensor parallelism the MLP and the
# attention heads are also split over `tensor`. Names not listed (vocab,
# position, kv, norm) stay whole.
# Activations (with LMConfig.logical_activations) split their batch over
# data and fsdp, as MaxText's activation_batch rule does, and the MLP's
# hidden units over tensor; the embedding dimension stays whole.
SHARDINGS = {
    "fsdp": (("embed", "fsdp"), ("activation_batch", ("data", "fsdp"))),
    "fsdp_tp": (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("activation_batch", ("data", "fsdp")),
                ("activation_mlp", "tensor")),
}


def param_logical_axes(abstract_params: Any) -> Any:
    """A PartitionSpec of Flax logical axis names for every parameter."""
    from jax.sharding import PartitionSpec

    def spec(path, leaf):
        names = tuple(getattr(k, "key", str(k)) for k in path)
        for n in (2, 1):
            if names[-n:] in _LOGICAL:
                return PartitionSpec(*_LOGICAL[names[-n:]])
        raise ValueError(f"no logical axes for parameter {'/'.join(names)} {leaf.shape}")

    return jax.tree_util.tree_map_with_path(spec, abstract_params)


def sharded_layout(sharding: str, tensor_parallelism: int = 2) -> Layout:
    """The example's layout for `sharding` ("fsdp" or "fsdp_tp"), in
    MaxText's flags: fsdp over the devices left after tensor parallelism."""
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; use one of {sorted(SHARDINGS)}")
    tp = tensor_parallelism if sharding == "fsdp_tp" else 1
    return Layout.from_maxtext(ici_fsdp_parallelism=-1, ici_tensor_parallelism=tp,
                               params=param_logical_axes, rules=SHARDINGS[sharding])


def make_program(config: LMConfig = LMConfig(), layout: Layout = Layout(), pretrained: Any = None,
                 microbatches: int = 1) -> TrainProgram:
    """The example LM as a TrainProgram (what `ray-elastic demo` trains);
    `layout`: how its state is laid out in a slice (default replicated);
    `pretrained`: weights to start from (TrainProgram.pretrained);
    `microbatches`: pieces each shard's batch is scanned in on the device."""
    return TrainProgram(
        pretrained=pretrained,
        microbatches=microbatches,
        init_params=functools.partial(_init_params, config),
        loss_fn=functools.partial(_loss_fn, config),
        optimizer=make_optimizer(config),
        make_batch=functools.partial(_make_batch, config),
        layout=layout,
    )
