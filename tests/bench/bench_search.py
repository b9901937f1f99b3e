"""Layout search benchmark: `hydra/sweeper=layouts` over 10,000+ candidates, end to end and in-process.

    python -m tests.bench bench_search

End to end is `python -m train -m hydra/sweeper=layouts hydra/launcher=plan search.top_k=0` in a
subprocess (start-up, one composition, every candidate planned and predicted, search.csv written).
The anchor, timed in the same run, is `python -m train --cfg job`: Python, Hydra and one
composition. The ratio is what this bench reports; nothing here asserts on time.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEARCH = (
    "model=gpt_13b", "hardware=a100_80gb", "parallelism.precision=bf16", "parallelism.global_batch_size=2048",
    "search.nodes=[1,2,4,8,16,32,64,128,256,512,1024]", "search.micro_batch_sizes=[1,2,4,8,16]",
    "search.zero_stages=[0,1]", "search.top_k=0", "search.show=5",
)  # fmt: skip


def timed(args: list[str]) -> tuple[float, str]:
    tic = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - tic
    if proc.returncode != 0:
        raise RuntimeError(f"python -m train {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def main() -> None:
    from conf.schema import SearchConfig
    from tests.train.planner.test_plan import compose_run
    from train.planner.search import search_layouts

    anchor, _ = timed(["--cfg", "job"])
    with tempfile.TemporaryDirectory() as tmp:
        wall, out = timed(["-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *SEARCH, f"hydra.sweep.dir={tmp}"])
    summary = next(line for line in out.splitlines() if line.startswith("search: ") and "layouts in" in line)
    run = compose_run(*SEARCH[:4])
    search = SearchConfig(nodes=[2**i for i in range(11)], micro_batch_sizes=[1, 2, 4, 8, 16], zero_stages=[0, 1])
    result = search_layouts(run, search)
    print(summary)
    print(f"in-process: {result.candidates:,} candidates in {result.seconds:.2f} s "
          f"({result.candidates / result.seconds:,.0f} candidates/s)")
    print(f"end to end {wall:.2f} s; anchor `python -m train --cfg job` {anchor:.2f} s; ratio {wall / anchor:.2f}")


if __name__ == "__main__":
    main()
