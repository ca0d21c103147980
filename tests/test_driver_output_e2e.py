"""What a user's own driver script shows in its terminal through a
recovered failure: ray_elastic's one line for it, and none of Ray's
"Unhandled error" tracebacks for the calls the recovery gave up on (they
are read once done: dispatch/unread.py). A real driver process on the
shared local cluster, a real SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster

DRIVER = os.path.join(os.path.dirname(__file__), "drivers", "user_driver.py")


# Under resize; pause recovers a kill through the same failure path and
# prints through the same code (test_elastic_e2e's pause kill).
@pytest.mark.parametrize("policy", ["resize"])
def test_a_recovered_kill_prints_one_line_and_no_ray_traceback(cluster, nodes, policy):
    nodes(3)
    out = subprocess.run([sys.executable, DRIVER, cluster.address, policy], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"steps": 10, "failures": [["process_died", 1, 4]]}, result
    err = out.stderr
    assert "Unhandled error" not in err and "Traceback" not in err, err[-4000:]
    assert err.count("slice 1 host 0 failed at step 4 (process_died)") == 1, err[-4000:]
