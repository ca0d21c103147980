"""Observability: the run's events and report, progress for a person, metrics
for the Ray dashboard, and the drawn timeline."""
