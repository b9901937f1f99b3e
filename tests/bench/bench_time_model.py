"""The time model against measurement on the local Slurm cluster (issue 12's check), end to end.

    python -m tests.bench bench_time_model

1. `python -m launchers calibrate` for a small GPT on 1 and 2 emulated nodes (2 tasks each);
2. for each node count, `hydra/sweeper=layouts` with that calibration hands the predicted fastest
   layouts (dp, tp, pp, micro-batch, recompute) to hydra/launcher=slurm, held (sbatch --hold); the
   jobs are then released one at a time, alternating node counts (run_alternately), so no two jobs
   ever share the host's cores and a slow stretch of the machine falls on both node counts;
3. every measured sec/it is compared with its prediction: mean absolute error, and whether the
   measured fastest is within the predicted top 3.

About 4 minutes on this 2-core machine; it needs the cluster (`make cluster-up`) and nothing else
running. It prints its figures, and fails when issue 12's target (MAE <= 15%, measured fastest in
the predicted top 3) is missed. `make test` runs the same check as a test, after every other test
(tests/launchers/test_search.py, marked `alone`); this entry point is the one whose output is kept
in tests/bench/results/.
"""

from __future__ import annotations

import csv
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launchers.queue import is_live, read_states
from train.contract import RESULT_FILE, SEARCH_FILE, manifest_path, read_manifest

REPO = Path(__file__).resolve().parents[2]
MODEL = ("model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=128",
         "model.vocab_size=4096", "parallelism.global_batch_size=8", "parallelism.precision=fp32",
         "hardware.devices_per_node=2", "logger=disabled", "training.train_iters=20", "training.warmup_iters=5")  # fmt: skip
# The model predicts the steady state. On this CPU the iterations just after two warm-up ones were
# the slowest of a run (measured, dp2 mbs1 on one node: iterations 3-5 at 0.30-0.31 s, the median
# of 6-20 at 0.28 s), so 8 iterations with 2 of warm-up timed mostly that phase; 5 of warm-up and
# 15 timed measure what the model predicts.
SEARCH = ("search.micro_batch_sizes=[1,2]", "search.recompute=[none,full]", "search.zero_stages=[0]")
NODE_COUNTS = (1, 2)
"""The node counts searched and measured, each a sweep directory nodes<N> of the run's."""
PER_NODE_COUNT = 6
"""Layouts measured per node count (12 in all)."""
TARGET_MAE = 0.15
"""Issue 12: mean absolute error of the predicted sec/it at most 15%."""


def _label(overrides: str) -> str:
    """`dp2 tp1 pp1 mbs2 none sp` from a search row's overrides (every layout field it sets)."""
    fields = dict(item.split("=", 1) for item in overrides.replace("parallelism.", "").split())
    label = f"dp{fields['dp']} tp{fields['tp']} pp{fields['pp']} mbs{fields['micro_batch_size']} {fields['recompute']}"
    if fields.get("sequence_parallel") == "true":
        label += " sp"
    if int(fields.get("virtual_stages", "1")) > 1:
        label += f" vpp{fields['virtual_stages']}"
    return label


Row = tuple[int, str, float, float, str]
"""(nodes, layout, predicted sec/it, measured sec/it, spread of the timed iterations)."""


def run(out: Path, cluster: tuple[str, ...] = (), min_seconds: float = 0.05) -> list[Row]:
    """Calibrate, search and measure into `out`: a Row per measured layout. `cluster`: overrides of
    the cluster group (a test's partition), given to the calibration and to both searches;
    `min_seconds`: the calibration's shortest timing of each figure (`--min-seconds`)."""
    cal = out / "calibration.json"
    subprocess.run([sys.executable, "-m", "launchers", "calibrate", *MODEL, *SEARCH, *cluster, "search.nodes=[1,2]",
                    "--min-seconds", str(min_seconds), "--out", str(cal)], cwd=REPO, check=True)  # fmt: skip
    try:
        for nodes in NODE_COUNTS:
            subprocess.run([sys.executable, "-m", "train", "-m", "hydra/sweeper=layouts", "hydra/launcher=slurm",
                            "+hydra.launcher.sbatch_args.hold=''", "cluster.array_parallelism=1", *MODEL, *SEARCH,
                            *cluster, f"search.nodes=[{nodes}]", f"search.top_k={PER_NODE_COUNT}",
                            f"hardware.calibration={cal}", f"hydra.sweep.dir={out / f'nodes{nodes}'}"],
                           cwd=REPO, check=True, capture_output=True)  # fmt: skip
        run_alternately(*(held_jobs(out / f"nodes{nodes}") for nodes in NODE_COUNTS))
    finally:
        cancel_held(out)
    rows = []
    for nodes in NODE_COUNTS:
        sweep = out / f"nodes{nodes}"
        with (sweep / SEARCH_FILE).open(newline="") as f:
            predicted = {r["overrides"]: float(r["pred_sec_per_iter"]) for r in csv.DictReader(f)}
        for path in sorted(sweep.glob(f"*/{RESULT_FILE}")):
            record = json.loads(path.read_text())
            if record.get("status") != "ok" or not record.get("sec_per_iter"):
                continue
            # A launched config's overrides are the search row's, after the fixed ones.
            launched = " ".join(record["overrides"])
            (key,) = [k for k in predicted if launched.endswith(k)]
            spread = (f"min {record['sec_per_iter_min']:.3f} max {record['sec_per_iter_max']:.3f} "
                      f"cv {record['sec_per_iter_cv']:.0%}")
            rows.append((nodes, _label(key), predicted[key], float(record["sec_per_iter"]), spread))
    return rows


def held_jobs(sweep: Path) -> list[str]:
    """The Slurm job ids a sweep directory's manifest names (none where it has no manifest)."""
    if not manifest_path(sweep).is_file():
        return []
    return [str(e.job_id) for e in read_manifest(sweep) if e.job_id is not None]


def cancel_held(out: Path) -> None:
    """Cancel every job of `out`'s searches that is still queued.

    A run stopped between submission and its last measurement (Ctrl-C, a failed second search, a
    timeout) would otherwise leave its held jobs in the cluster for ever, where the next test that
    waits for an empty queue finds them (a CI killed during this run made two Slurm tests of the
    next CI fail so; a kill no `finally` sees is the tests' cluster fixture's to mend). Ended jobs
    are left alone; scancel's refusal is said, not swallowed."""
    jobs = [job for nodes in NODE_COUNTS for job in held_jobs(out / f"nodes{nodes}")]
    states = read_states(jobs) if jobs else {}
    live = [job for job in jobs if is_live(states.get(job, "PENDING"))]
    if live:
        done = subprocess.run(["scancel", *live], check=False, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"bench_time_model: scancel {' '.join(live)} failed: {done.stderr.strip()}", file=sys.stderr)


def run_alternately(*queues: list[str], timeout_s: float = 600.0) -> None:
    """Release held jobs one at a time, taking the queues in turn (the first job of each, then the
    second, ...), each after the one before has left the queue.

    On this VM the speed drifts over minutes: measured node count after node count, the two-node
    layouts' sec/it came out from 0.84 to 1.43 times the one-node layouts' of the same work (seven
    runs on 2026-11-26), which no model of the layouts can predict; in turn, both sets meet the
    same stretches."""
    order = [job for turn in itertools.zip_longest(*queues) for job in turn if job is not None]
    for job in order:
        subprocess.run(["scontrol", "release", job], check=True, capture_output=True)
        deadline = time.monotonic() + timeout_s
        # launchers.queue, the project's one reader of squeue and sacct: a job neither answered for
        # counts as still queued, so a failed query never releases the next job early.
        while is_live(read_states([job]).get(job, "PENDING")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still queued or running after {timeout_s:.0f} s")
            time.sleep(0.5)


def report(rows: list[Row]) -> tuple[list[str], float, bool]:
    """(printed lines, mean absolute error, whether the measured fastest is in the predicted top 3)."""
    lines = [f"{nodes} node(s) {label:<24} predicted {pred:.4f} s  measured {meas:.4f} s ({spread})  "
             f"error {pred / meas - 1:+.1%}" for nodes, label, pred, meas, spread in rows]  # fmt: skip
    mae = statistics.mean(abs(p / m - 1) for *_, p, m, _ in rows) if rows else float("inf")
    top3 = sorted(rows, key=lambda r: r[2])[:3]
    in_top3 = bool(rows) and min(rows, key=lambda r: r[3]) in top3
    lines.append(f"{len(rows)} layouts measured; mean absolute error {mae:.1%} (target {TARGET_MAE:.0%}); measured "
                 f"fastest {'is' if in_top3 else 'is NOT'} within the predicted top 3")  # fmt: skip
    return lines, mae, in_top3


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp))
    lines, mae, in_top3 = report(rows)
    print("\n".join(lines))
    # Issue 12's Done-means: reported as this benchmark's failure when missed.
    assert len(rows) >= 2 * PER_NODE_COUNT, f"only {len(rows)} of {2 * PER_NODE_COUNT} layouts measured"
    assert mae <= TARGET_MAE and in_top3, "issue 12's target for the local cluster is missed"


if __name__ == "__main__":
    main()
