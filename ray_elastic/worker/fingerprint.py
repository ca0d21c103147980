"""Fingerprints of a host's arrays, for the driver to compare replicas by
(control/integrity.py), and the bit flips a `corrupt` fault makes.

A fingerprint is a 32-bit wrapping sum of the bit patterns of every
element, as 32-bit words (never a float sum: -0.0 and 0.0, or NaNs of
different payloads, differ), so that flipping any one bit of any element
always changes it (plus or minus 2**b is never 0 modulo 2**32). Several
flips could cancel only by summing to a multiple of 2**32; moved or
swapped elements are not what failing memory or arithmetic does, and are
not looked for.

The state's fingerprint is one per local device, over the shards that
device holds, so a replicated layout's devices, which hold the same bits,
are compared with each other as well as with the same device of another
slice. On an accelerator it is one small jitted reduction per device (no
copy to the host); on a CPU device the shards already lie in host memory
and numpy reads them in place (XLA's CPU reductions take several times
longer), the small arrays copied into one buffer first so that a state of
many small arrays costs one sum, not one call each (`python -m bench
integrity` gives the cost).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["flip_bit", "flip_payload_bit", "host_fingerprint", "state_fingerprint"]

_MASK32 = 0xFFFFFFFF
# The bit a fault flips: bit 4 of the third byte, a mantissa bit of a
# little-endian float32 (the value stays finite, as most corruption does).
_BYTE, _BIT = 2, np.uint8(1 << 4)
_UNSIGNED = {2: "uint16", 1: "uint8"}


_SMALL = 1 << 16  # bytes: arrays below this are summed together, in one buffer


def _bytes(a: np.ndarray) -> np.ndarray:
    """`a`'s bytes, padded to whole 32-bit words (a view when it needs no padding)."""
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return raw if raw.size % 4 == 0 else np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])


def _np_print(arrays) -> int:
    """The wrapping 32-bit sum of the words of `arrays` (host memory)."""
    small, total = [], 0
    for a in arrays:
        raw = _bytes(np.asarray(a))
        if raw.size < _SMALL:
            small.append(raw)
        else:
            total += int(np.sum(raw.view(np.uint32), dtype=np.uint32))
    if small:
        total += int(np.sum(np.concatenate(small).view(np.uint32), dtype=np.uint32))
    return total & _MASK32


def _jax_sum(xs):
    import jax
    import jax.numpy as jnp

    total = jnp.uint32(0)
    for x in xs:
        if x.dtype == jnp.bool_:
            words = x.astype(jnp.uint32)
        elif x.dtype.itemsize >= 4:
            words = jax.lax.bitcast_convert_type(x, "uint32")
        else:  # 1- and 2-byte elements widened: a flip still moves the sum by 2**b
            words = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
        total = total + jnp.sum(words, dtype=jnp.uint32)
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
            out.append(_np_print(by_device[d]))
        else:
            if _device_sum is None:
                _device_sum = jax.jit(_jax_sum)
            out.append(int(_device_sum(by_device[d])))
    return out


def host_fingerprint(tree: Any) -> int:
    """The fingerprint of a tree of host (numpy) arrays: a gradient payload."""
    import jax

    return _np_print(jax.tree.leaves(tree))


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
