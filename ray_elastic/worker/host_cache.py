"""A compile cache for the hosts JAX's own persistent cache leaves out.

JAX writes its persistent compilation cache from process 0 only, and on
CPU its key holds each process's own view of the devices (the key's
`accelerator_config` part), so hosts 1 and up of a multi-host CPU slice
never find an entry: they compiled every function of the step at every
start and every replacement (9.4 s against 0.4 s from the cache, the
example token LM on a 2-host slice). On GPU and TPU that part of the key
comes from the slice's topology, the same for every process, so host 0's
entries serve every host there and this cache stays off.

Such a host keeps its own executables instead, serialized with JAX's
public `jax.experimental.serialize_executable`, as files in a folder of
`compile_cache_dir`. The key is a hash of what the executable depends
on: the lowered program's text (its shardings and donations included),
the process's index and count, the global devices, JAX's and jaxlib's
versions, the XLA flags and the CPU collectives. An entry that does not
load (a torn file, another JAX) is compiled again and rewritten; a write
goes to a temporary file renamed into place, so two processes of the same
host index (two slices on one machine) never read half a file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import Any

__all__ = ["FOLDER", "HostCompileCache"]

log = logging.getLogger("ray_elastic")

FOLDER = "ray_elastic-hosts"  # inside compile_cache_dir


def _applies() -> bool:
    """Whether this process is one JAX's persistent cache cannot serve: a
    CPU process other than the first of a multi-process slice."""
    import jax

    return jax.process_count() > 1 and jax.process_index() != 0 and jax.devices()[0].platform == "cpu"


def _key(lowered: Any) -> str:
    import jax
    import jaxlib

    h = hashlib.sha256()
    for part in (
        lowered.as_text(),
        jax.__version__,
        jaxlib.__version__,
        os.environ.get("XLA_FLAGS", ""),
        str(getattr(jax.config, "jax_cpu_collectives_implementation", "")),
        f"{jax.process_index()}/{jax.process_count()}",
        repr([(d.id, d.process_index, d.platform, d.device_kind) for d in jax.devices()]),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class HostCompileCache:
    """`compile(lowered)`: the lowered function compiled, from this host's
    own cache where it applies (else JAX's `lowered.compile()`, through
    JAX's persistent cache). `hits` and `misses` count this cache's own
    lookups."""

    def __init__(self, cache_dir: str):
        self.folder = os.path.join(cache_dir, FOLDER) if cache_dir and _applies() else None
        self.hits = self.misses = 0

    def compile(self, lowered: Any) -> Any:
        if self.folder is None:
            return lowered.compile()
        from jax.experimental.serialize_executable import deserialize_and_load, serialize

        path = os.path.join(self.folder, _key(lowered))
        try:
            with open(path, "rb") as f:
                blob = f.read()
            compiled = deserialize_and_load(blob, lowered.in_tree, lowered.out_tree)
            self.hits += 1
            return compiled
        except FileNotFoundError:
            pass
        except Exception as e:  # torn, or from another build: compile it again
            log.warning("compile cache entry %s did not load (%s); compiling again", path, e)
        self.misses += 1
        compiled = lowered.compile()
        try:
            _write(path, serialize(compiled)[0])
        except Exception as e:  # a full disk, an executable JAX cannot serialize: train on, uncached
            log.warning("could not keep a compiled function in %s: %s", self.folder, e)
        return compiled


def _write(path: str, blob: bytes) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
