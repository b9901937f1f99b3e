"""Agreement benchmark: the planner/trainer agreement test of tests/train/test_main.py, drawn wider.

    python -m tests.bench bench_agreement [DRAWS]

`make test` runs the draws of AGREEMENT_SEEDS; this runs DRAWS (default 200) random ones,
prints each verdict as it comes (planned rules, what `python -m train` did, seconds), and fails
at the first disagreement, with hypothesis's shrunk example. Nothing here asserts on time.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings

DEFAULT_DRAWS = 200


def main(argv: list[str] | None = None) -> None:
    from tests.train.test_main import Draw, check_agreement, layouts

    args = sys.argv[2:] if argv is None else argv
    draws = int(args[0]) if args and args[0].isdigit() else DEFAULT_DRAWS
    root = Path(tempfile.mkdtemp(prefix="bench_agreement-"))
    seen = {"n": 0, "seconds": 0.0}

    @settings(max_examples=draws, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(layouts())
    def run(draw: Draw) -> None:
        seen["n"] += 1
        tic = time.perf_counter()
        check_agreement(draw, root / f"draw{seen['n']}")
        took = time.perf_counter() - tic
        seen["seconds"] += took
        print(f"draw {seen['n']:4d}: world {draw.world}, agreed in {took:5.1f} s: {' '.join(draw.overrides[6:17])}",
              flush=True)

    run()
    print(f"{seen['n']} draws agreed in {seen['seconds']:.0f} s ({root})")


if __name__ == "__main__":
    main()
