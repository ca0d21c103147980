"""Benchmarks: `python -m bench --help`."""
