"""Benchmarks (run as scripts or ``python -m tools.bench.<name>``)."""
