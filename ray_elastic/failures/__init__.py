"""Failures: where a failure is and what kind it is (location), the faults
tests and benchmarks inject (faults), and the control-flow errors that never
reach a user (internal). The public errors are ray_elastic.errors."""
