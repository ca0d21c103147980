"""Fingerprints of a host's arrays, for the driver to compare replicas by
(control/integrity.py), and the bit flips a `corrupt` fault makes.

A fingerprint is a 32-bit sum over the bit patterns of every element
(never a float sum: -0.0 and 0.0, or NaNs of different payloads, differ),
each weighted by an odd number that depends on its position, so that
flipping any one bit of any element always changes it (an odd weight
times plus or minus 2**b is never 0 modulo 2**32), and so does swapping
two different elements.

The state's fingerprint is made on each local device over the shards it
holds (one small jitted reduction per device, no copy to the host), so a
replicated layout's devices, which hold the same bits, can be compared
with each other as well as with the same device of another slice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["flip_bit", "flip_payload_bit", "host_fingerprint", "state_fingerprint"]

_GOLDEN = 0x9E3779B1  # the weights' multiplier: spreads nearby positions over the word
# The bit a fault flips: bit 4 of the third byte, a mantissa bit of a
# little-endian float32 (the value stays finite, as most corruption does).
_BYTE, _MASK = 2, np.uint8(1 << 4)


def _as_words(xp, x):
    """`x`'s bits as uint32 words (xp: numpy or jax.numpy); an 8-byte
    element is two words, a 1- or 2-byte one is widened."""
    if x.dtype == xp.bool_:
        return x.astype(xp.uint32).ravel()
    size = x.dtype.itemsize
    unsigned = {8: "uint32", 4: "uint32", 2: "uint16", 1: "uint8"}[size]
    words = xp.ravel(x).view(unsigned) if xp is np else _jax_bitcast(x, unsigned).ravel()
    return words.astype(xp.uint32)


def _jax_bitcast(x, dtype: str):
    import jax

    return jax.lax.bitcast_convert_type(x, dtype)


def _sum_of(xp, leaves) -> Any:
    total = xp.uint32(0)
    for i, leaf in enumerate(leaves):
        words = _as_words(xp, leaf)
        weights = xp.arange(words.size, dtype=xp.uint32) * xp.uint32(_GOLDEN) * xp.uint32(2) + xp.uint32(1)
        total = total + xp.sum(words * weights, dtype=xp.uint32) * xp.uint32(2 * i + 1)
    return total


_device_sum = None


def state_fingerprint(tree: Any) -> list[int]:
    """One fingerprint per local device (in device id order) of the shards
    of `tree`'s arrays it holds."""
    import jax
    import jax.numpy as jnp

    global _device_sum
    if _device_sum is None:
        _device_sum = jax.jit(lambda xs: _sum_of(jnp, xs))
    by_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            by_device.setdefault(shard.device, []).append(shard.data)
    sums = [_device_sum(by_device[d]) for d in sorted(by_device, key=lambda d: d.id)]
    return [int(s) for s in sums]


def host_fingerprint(tree: Any) -> int:
    """The fingerprint of a tree of host (numpy) arrays: a gradient payload."""
    import jax

    with np.errstate(over="ignore"):
        return int(_sum_of(np, [np.asarray(a) for a in jax.tree.leaves(tree)]))


def flip_bit(tree: Any) -> Any:
    """`tree` with one bit flipped in the first element of the first shard
    this host holds of its first array (on that one device only, as a
    faulty chip would), built without a collective: other hosts of the
    slice need not take part."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    first = leaves[0]
    shards = first.addressable_shards
    arrays = [s.data for s in shards]
    flipped = _flipped(np.array(arrays[0]))
    arrays[0] = jax.device_put(flipped, shards[0].device)
    leaves[0] = jax.make_array_from_single_device_arrays(first.shape, first.sharding, arrays)
    return jax.tree.unflatten(treedef, leaves)


def flip_payload_bit(tree: Any) -> Any:
    """A gradient payload (numpy arrays) with one bit flipped in its first
    array's first element."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    leaves[0] = _flipped(np.array(leaves[0]))
    return jax.tree.unflatten(treedef, leaves)


def _flipped(a: np.ndarray) -> np.ndarray:
    out = np.ascontiguousarray(a).copy()
    raw = out.reshape(-1).view(np.uint8)
    raw[min(_BYTE, raw.size - 1)] ^= _MASK
    return out
