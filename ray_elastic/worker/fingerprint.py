"""Fingerprints of a host's arrays, for the driver to compare replicas by
(control/integrity.py), and the bit flips a `corrupt` fault makes.

A fingerprint is a 32-bit wrapping sum over the bit patterns of every
element (never a float sum: -0.0 and 0.0, or NaNs of different payloads,
differ), each array's sum weighted by an odd number, so that flipping any
one bit of any element always changes it (plus or minus 2**b, times an
odd number, is never 0 modulo 2**32). Several flips could cancel only by
summing to a multiple of 2**32; moved or swapped elements are not what
failing memory or arithmetic does, and are not looked for.

The state's fingerprint is one per local device, over the shards that
device holds, so a replicated layout's devices, which hold the same bits,
are compared with each other as well as with the same device of another
slice. On an accelerator it is one small jitted reduction per device (no
copy to the host); on a CPU device the shards already lie in host memory
and numpy reads them in place (XLA's CPU reductions take several times
longer: `python -m bench integrity` gives the cost).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["flip_bit", "flip_payload_bit", "host_fingerprint", "state_fingerprint"]

_MASK32 = 0xFFFFFFFF
# The bit a fault flips: bit 4 of the third byte, a mantissa bit of a
# little-endian float32 (the value stays finite, as most corruption does).
_BYTE, _BIT = 2, np.uint8(1 << 4)
_UNSIGNED = {8: "uint32", 4: "uint32", 2: "uint16", 1: "uint8"}


def _np_sum(a: np.ndarray) -> int:
    """One array's wrapping sum of its bits (an 8-byte element as two words)."""
    a = np.ascontiguousarray(a)
    words = a.reshape(-1).view(np.uint8 if a.dtype == np.bool_ else _UNSIGNED[a.dtype.itemsize])
    return int(np.sum(words, dtype=np.uint32))


def _combined(sums) -> int:
    return sum(s * (2 * i + 1) for i, s in enumerate(sums)) & _MASK32


def _jax_sum(xs):
    import jax
    import jax.numpy as jnp

    total = jnp.uint32(0)
    for i, x in enumerate(xs):
        if x.dtype == jnp.bool_:
            words = x.astype(jnp.uint8)
        else:
            words = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize])
        total = total + jnp.sum(words, dtype=jnp.uint32) * jnp.uint32(2 * i + 1)
    return total


_device_sum = None


def state_fingerprint(tree: Any) -> list[int]:
    """One fingerprint per local device (in device id order) of the shards
    of `tree`'s arrays it holds."""
    import jax

    global _device_sum
    by_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            by_device.setdefault(shard.device, []).append(shard.data)
    out = []
    for d in sorted(by_device, key=lambda d: d.id):
        if d.platform == "cpu":  # in host memory already: read in place
            out.append(_combined(_np_sum(np.asarray(x)) for x in by_device[d]))
        else:
            if _device_sum is None:
                _device_sum = jax.jit(_jax_sum)
            out.append(int(_device_sum(by_device[d])))
    return out


def host_fingerprint(tree: Any) -> int:
    """The fingerprint of a tree of host (numpy) arrays: a gradient payload."""
    import jax

    return _combined(_np_sum(np.asarray(a)) for a in jax.tree.leaves(tree))


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
    if out.dtype == np.bool_:  # any other bit of a bool's byte still reads True
        out.reshape(-1)[0] = not out.reshape(-1)[0]
        return out
    raw = out.reshape(-1).view(np.uint8)
    raw[min(_BYTE, raw.size - 1)] ^= _BIT
    return out
