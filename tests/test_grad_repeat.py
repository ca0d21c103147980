"""The cross-checks compare fingerprints of one shard's gradient computed
by different calls: they can only tell corruption from noise if computing
a gradient again at the same state gives the same bits. Real JAX slices
of each layout, no Ray (tests/drivers/grad_repeat_driver.py): one host of
1, 2 or 4 CPU devices, and two hosts of a jax.distributed slice over
gloo; each computes the same shard's gradient by the cross-check's call
twice, by the step's own call, and for the next step beside a snapshot in
the making and alone. Every one of a step's prints must be equal, on
every host (docs/integrity.md, "Determinism")."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

DRIVER = os.path.join(os.path.dirname(__file__), "drivers", "grad_repeat_driver.py")

# (layout, devices per host, hosts): the shape whose checks once misfired
# (2 hosts x 2 devices, FSDP x tensor parallel), which holds every path of
# the others: several devices' collectives within a process and gloo's
# across processes, both ordered by the runner. A replicated slice's
# gradient computed again is compared in every cross-checked run
# (tests/test_integrity_e2e.py, whose runs would then misfire).
SHAPES = [("fsdp_tp", 2, 2)]


_run_cache: dict = {}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(layout: str, devices: int, hosts: int) -> list[dict]:
    port = str(_port())
    procs = [subprocess.Popen([sys.executable, DRIVER, layout, str(devices), str(hosts), str(h), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in range(hosts)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("layout,devices,hosts", [
    pytest.param(*shape, id=f"{shape[2]}x{shape[1]}-{shape[0]}") for shape in SHAPES])
def test_a_gradient_computed_again_has_the_same_bits(layout, devices, hosts):
    _run_cache[(layout, devices, hosts)] = runs = _run(layout, devices, hosts)
    for facts in runs:
        for p in facts["prints"]:
            same_step = {*p["recomputed"], p["sent"]}
            next_step = {p["next_beside_snapshot"], p["next_alone"]}
            assert len(same_step) == 1 and None not in same_step, (facts["host"], p)
            assert len(next_step) == 1 and None not in next_step, (facts["host"], p)
        # A bit flipped once in one of them is seen.
        assert facts["glitched"] != facts["clean"] and None not in (facts["glitched"], facts["clean"])
    if hosts > 1:
        # Hosts running the check and the step in opposite orders pair the
        # two programs' collectives: what each computes is wrong, silently
        # (why the runner makes every host run the check first).
        for facts in _run_cache[(layout, devices, hosts)]:
            sw = facts["swapped"]
            assert sw["check"] != sw["check_in_order"] and sw["step"] != sw["step_in_order"], sw
