"""A user's own driver script (not the demo, which hides Ray's output):
connects to a running cluster, trains the example LM on 2 slices through
a SIGKILLed worker, and prints the outcome as JSON on its last line.
tests/test_driver_output_e2e.py reads its stderr.

Usage: driver.py ADDRESS POLICY
"""

import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import ray  # noqa: E402

from examples import lm  # noqa: E402
from ray_elastic import ElasticConfig, ElasticTrainer, Fault  # noqa: E402

ray.init(address=sys.argv[1], log_to_driver=False, runtime_env={"py_modules": [os.path.join(ROOT, "examples")]})
report = ElasticTrainer(functools.partial(lm.make_program, lm.LMConfig()),
                        ElasticConfig(num_slices=2, policy=sys.argv[2], timeout_s=120.0), 10,
                        faults=(Fault("kill", 1, 4),)).fit()
print(json.dumps({"steps": report.steps_completed, "failures": [(f.kind, f.slice, f.step) for f in report.failures]}))
