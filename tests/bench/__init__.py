"""Benchmarks: `python -m tests.bench` runs every bench_*.py main() (pytest does not collect them)."""
