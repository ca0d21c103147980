"""One JAX process of a 2-process "slice" (2 CPU devices each) that saves
a sharded state with checkpoint/host_writes.py, or (mode restore1) one
process with 4 devices that reads it back: for tests/test_host_writes.py.

usage: host_writes_driver.py MODE PROCESS_ID PORT PATH
MODE: save (write step 1), die (process 1 exits after the checksum
rendezvous, before writing), restore1 (1 process x 4 devices reads step 1).
"""

import json
import os
import sys

mode, pid, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
devices = 4 if mode == "restore1" else 2
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from ray_elastic.checkpoint import host_writes  # noqa: E402

FULL = {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 7, "b": np.arange(8, dtype=np.int32),
        "count": np.array(5, np.int32)}

if mode == "restore1":
    hosts = 1
else:
    hosts = 2
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
mesh = Mesh(np.array(jax.devices()).reshape(4), ("fsdp",))
specs = {"w": P("fsdp"), "b": P(), "count": P()}
ck = host_writes.HostCheckpoints(path, keep=2, host=pid, hosts=hosts)

if mode in ("save", "die"):
    state = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda idx, v=v: v[idx])
             for k, v in FULL.items()}
    if mode == "die" and pid == 1:
        real = ck._totals

        def totals_then_die(key, parts):
            out = real(key, parts)
            os._exit(3)  # died after the rendezvous, before writing its shards
            return out

        ck._totals = totals_then_die
    info = ck.save(1, {"params": state}, {"step": 1}, save_id="t")
    print(json.dumps(info), flush=True)
else:
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P(None, "fsdp") if k == "w" else P()))
                         for k, v in FULL.items()}}
    state, meta = ck.restore(1, target, nonce="r")
    w = state["params"]["w"]
    ok = all(np.array_equal(np.asarray(s.data), FULL["w"][s.index]) for s in w.addressable_shards)
    print(json.dumps({"ok": ok and int(state["params"]["count"]) == 5, "meta": meta,
                      "blocks": [str(s.index) for s in w.addressable_shards]}), flush=True)
ck.close()
