"""Pretrained weights as the step-0 params: from a params tree or a
checkpoint (a ray_elastic checkpoint folder, or a plain Orbax checkpoint
of a params tree; local or gs://), put onto the slice's layout.

The weights enter as arguments of the compiled step, never as constants
of a compiled program: the program's `init_params` is only traced for the
params' shapes, and the optimizer state is made from the loaded params.
Each host reads the whole tree and keeps its devices' blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ray_elastic.errors import ConfigError

__all__ = ["load_pretrained", "read_params"]


def read_params(source: Any) -> Any:
    """The params tree of `source`: the tree itself, or read from a path:
    the newest intact step of a ray_elastic checkpoint folder, else a plain
    Orbax checkpoint of a params tree (e.g. written by
    `orbax.checkpoint.StandardCheckpointer().save(path, params)`)."""
    if not isinstance(source, str):
        return source
    from ray_elastic.checkpoint.store import CheckpointStore, orbax_checkpoint

    store = CheckpointStore(source)
    missing = store.missing()
    if missing:
        raise ConfigError("program.pretrained", f"cannot read {source}: {missing}")
    if store.committed_steps():
        state, _, _, _ = store.restore_intact()
        return state["params"]
    try:
        return orbax_checkpoint().StandardCheckpointer().restore(source)
    except Exception as e:
        raise ConfigError("program.pretrained", f"{source} is neither a ray_elastic checkpoint folder nor an "
                          f"Orbax checkpoint of a params tree ({type(e).__name__}: {str(e)[:200]})") from None


def load_pretrained(source: Any, specs: Any) -> Any:
    """`source`'s params laid out as `specs` (a tree of
    jax.ShapeDtypeStruct with shardings, the params' own): checked leaf by
    leaf, cast to the params' dtypes."""
    import jax

    tree = read_params(source)
    if hasattr(tree, "items"):
        tree = _plain(tree)
    got, want = jax.tree.structure(tree), jax.tree.structure(specs)
    if got != want:
        raise ConfigError("program.pretrained", f"the pretrained params' tree does not match the model's: "
                          f"got {_paths(tree)[:6]}..., the model has {_paths(specs)[:6]}...")
    out = []
    for path, (value, spec) in zip(_paths(specs), zip(jax.tree.leaves(tree), jax.tree.leaves(specs))):
        value = np.asarray(value)
        if value.shape != spec.shape:
            raise ConfigError("program.pretrained", f"{path} has shape {value.shape}; the model's is {spec.shape}")
        value = value.astype(spec.dtype, copy=False)
        out.append(jax.make_array_from_callback(spec.shape, spec.sharding, lambda idx, v=value: v[idx]))
    return jax.tree.unflatten(want, out)


def _plain(tree: Any) -> Any:
    """Mappings (FrozenDict, Orbax's restored dicts) -> plain dicts."""
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _paths(tree: Any) -> list[str]:
    import jax

    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
