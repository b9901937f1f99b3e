"""Benchmarks: `python -m tests.bench` runs every bench_*.py main() (pytest does not collect them)."""

import compileall
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def compile_packages(packages: tuple[str, ...]) -> None:
    """Byte-compile megasweep's packages before timing, as pip leaves an installed package (and as a
    second run finds a checkout): under PYTHONDONTWRITEBYTECODE, set on this machine, every timed
    run would otherwise compile every module it imports again."""
    for package in packages:
        compileall.compile_dir(REPO / package, quiet=1)
