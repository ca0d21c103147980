"""One JAX process of a 2-process "slice" (2 CPU devices each, gloo
collectives, as a worker's) that compiles two functions through
worker/host_cache.py and runs them: for tests/test_host_cache.py.

usage: host_cache_driver.py PROCESS_ID PORT CACHE_DIR
Prints one JSON line: the cache's folder (None where it does not apply),
its hits and misses, and the results' bytes (hex) as host 0 sees them.
"""

import json
import os
import sys

pid, port, cache_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from ray_elastic.worker.host_cache import HostCompileCache  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
mesh = Mesh(np.array(jax.devices()).reshape(4), ("fsdp",))
rows, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())


def update(w, g):  # a sharded update that donates its state, as the step's
    return w - 0.1 * jnp.tanh(g) * jnp.sum(w * w)


def loss(w, x):  # a cross-host reduction: a collective in the executable
    return jnp.mean(jnp.sin(w @ x.T))


spec = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=rows)
cache = HostCompileCache(cache_dir)
up = cache.compile(jax.jit(update, out_shardings=rows, donate_argnums=0).lower(spec, spec))
lo = cache.compile(jax.jit(loss, out_shardings=whole).lower(spec, spec))
full = np.arange(32, dtype=np.float32).reshape(8, 4) / 9
w = jax.make_array_from_callback((8, 4), rows, lambda idx: full[idx])
g = jax.make_array_from_callback((8, 4), rows, lambda idx: np.cos(full)[idx])
w2 = up(w, g)
value = lo(w2, g)
out = multihost_utils.process_allgather(w2, tiled=True)
print(json.dumps({"folder": cache.folder, "hits": cache.hits, "misses": cache.misses, "donated": w.is_deleted(),
                  "w": np.asarray(out).tobytes().hex(), "loss": np.asarray(value).tobytes().hex()}))
