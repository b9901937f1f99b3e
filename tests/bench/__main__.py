"""`python -m tests.bench` (`make bench`): run every tests/bench/bench_*.py module's main().

Benchmarks print figures and assert nothing about time; a benchmark that raises is
reported and makes the exit status non-zero, and the others still run.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import traceback
from pathlib import Path


def bench_modules() -> list[str]:
    """Names of the bench_*.py modules beside this file, sorted."""
    here = Path(__file__).resolve().parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks named in argv (default: all); returns the number that failed."""
    names = argv if argv else bench_modules()
    failed = 0
    for name in names:
        print(f"== {name}", flush=True)
        tic = time.perf_counter()
        try:
            module = importlib.import_module(f"{__package__ or 'tests.bench'}.{name}")
            module.main()
        except Exception:
            failed += 1
            traceback.print_exc()
            print(f"== {name}: FAILED after {time.perf_counter() - tic:.1f} s", flush=True)
        else:
            print(f"== {name}: done in {time.perf_counter() - tic:.1f} s", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
