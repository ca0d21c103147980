"""worker/host_cache.py in real JAX processes: two processes of one CPU
"slice" (jax.distributed, gloo) compile a sharded, donating update and a
function with a cross-host reduction. Host 0 is left to JAX's own
persistent cache; host 1 keeps its executables in the folder, loads them
in the next processes, compiles again an entry that was torn, and every
run computes the same bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ray_elastic.worker.setup import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "drivers", "host_cache_driver.py")


def _slice(cache_dir: str) -> list[dict]:
    """Both processes of a slice, run to the end; their JSON lines."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, DRIVER, str(h), str(port), cache_dir], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in (0, 1)]
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()  # SIGKILL: jax.distributed catches SIGTERM
            p.communicate()
            raise
        assert p.returncode == 0, e[-3000:]
        out.append(json.loads(o.strip().splitlines()[-1]))
    return out


def test_host_1_keeps_its_own_executables_and_loads_them_bitwise(tmp_path):
    cache = str(tmp_path / "cache")
    first = _slice(cache)
    assert first[0]["folder"] is None  # host 0: JAX's own cache
    folder = first[1]["folder"]
    assert folder == os.path.join(cache, "ray_elastic-hosts")
    assert (first[1]["hits"], first[1]["misses"]) == (0, 2)
    entries = sorted(os.listdir(folder))
    assert len(entries) == 2 and not [e for e in entries if e.startswith(".tmp")]
    assert first[0]["donated"] and first[1]["donated"]
    inodes = {e: os.stat(os.path.join(folder, e)).st_ino for e in entries}

    second = _slice(cache)
    assert (second[1]["hits"], second[1]["misses"]) == (2, 0)
    assert {e: os.stat(os.path.join(folder, e)).st_ino for e in entries} == inodes  # read, not rewritten
    assert second[1]["donated"]  # the loaded update still donates its input
    for host in (0, 1):
        assert (second[host]["w"], second[host]["loss"]) == (first[host]["w"], first[host]["loss"])

    # A torn entry (a host killed mid-write on a filesystem without atomic
    # renames, a disk gone bad): compiled again, rewritten, the same bits.
    torn = os.path.join(folder, entries[0])
    with open(torn, "r+b") as f:
        f.truncate(100)
    third = _slice(cache)
    assert (third[1]["hits"], third[1]["misses"]) == (1, 1)
    assert os.path.getsize(torn) > 100
    for host in (0, 1):
        assert (third[host]["w"], third[host]["loss"]) == (first[host]["w"], first[host]["loss"])


def test_an_empty_cache_dir_turns_it_off(tmp_path):
    got = _slice("")
    assert got[1]["folder"] is None and (got[1]["hits"], got[1]["misses"]) == (0, 0)
    assert got[0]["w"] == got[1]["w"]
