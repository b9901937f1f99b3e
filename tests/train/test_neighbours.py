"""train.neighbours on the real local cluster: a run records the jobs that shared its node, and the
spread of its timed iterations, in result.json."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.launchers.test_slurm_launcher import TINY
from train.contract import RESULT_FILE, read_record
from train.neighbours import NeighbourWatch, own_job_ids, ran_on_nodes_between, running_on_nodes

from .test_distributed import REPO

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo


def test_outside_slurm_there_are_no_neighbours() -> None:
    assert running_on_nodes({}) is None
    assert ran_on_nodes_between({}, 0.0, time.time()) is None
    assert NeighbourWatch({"PATH": "/usr/bin"}).stop() == {}
    assert own_job_ids({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2"}) == {"12", "10_2"}


def sbatch_sleeper(node: str, seconds: int = 300) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", f"--nodelist={node}", "--time=5", "--job-name=neighbour", "--output=/dev/null",
         "--wrap", f"sleep {seconds}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    return out.strip().split(";")[0]


def state(job: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30
    ).stdout.strip()


def test_a_slurm_run_records_its_neighbours_and_its_spread(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    node = slurm_cluster.nodes[-1]
    sleeper = sbatch_sleeper(node)
    try:
        deadline = time.monotonic() + 60
        # Running, and known to accounting as running: slurmctld tells slurmdbd a job started
        # asynchronously, and the record's `during` comes from accounting.
        while state(sleeper) != "RUNNING" or sacct_state(sleeper) != "RUNNING":
            assert time.monotonic() < deadline, f"job {sleeper} did not start on {node}"
            time.sleep(0.5)
        out = tmp_path / "run"
        # A real Slurm job on the sleeper's node, as srun runs each task of a sweep.
        proc = subprocess.run(
            ["srun", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--time=5",
             sys.executable, "-m", "train", *TINY, "hardware.peak_measured=false",
             "hardware.peak_tflops_fp32=10.0", f"hydra.run.dir={out}"],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        subprocess.run(["scancel", sleeper], timeout=30, check=False)
    record = read_record(out / RESULT_FILE)
    assert record is not None and record["status"] == "ok"
    neighbours = record["neighbours"]
    assert neighbours["nodes"] == node
    assert sleeper in neighbours["at_start"] and sleeper in neighbours["at_end"] and sleeper in neighbours["during"]
    own = record["env"]["SLURM_JOB_ID"]
    assert own not in neighbours["at_start"] + neighbours["at_end"] + neighbours["during"]
    (warning,) = [w for w in record["warnings"] if sleeper in w and "other Slurm jobs ran on this job's nodes" in w]
    # cluster=local keeps jobs apart by its `cores` license, not by whole nodes (its emulated nodes share
    # one host): the warning says so, and does not advise cluster.exclusive=true, which isolates nothing there.
    assert record["config"]["cluster"]["core_license"] == "cores"
    assert "`cores` license (cluster.core_license)" in warning and "cluster.exclusive=true" not in warning
    # Two measured iterations (TINY: 3, one warm-up): their spread around the median.
    assert record["sec_per_iter_min"] <= record["sec_per_iter"] <= record["sec_per_iter_max"]
    assert record["sec_per_iter_min"] == pytest.approx(min(record["iteration_times_s"][1:]))
    assert record["sec_per_iter_cv"] is not None and record["sec_per_iter_cv"] >= 0


def sacct_state(job: str) -> str:
    return subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job, "--format=State"], capture_output=True, text=True, timeout=30
    ).stdout.strip()


def test_accounting_names_a_job_that_came_and_went_between_the_samples(slurm_cluster: SlurmClusterInfo) -> None:
    """A neighbour that started after a run's first squeue and ended before its last one is seen by
    neither sample; sacct's window still finds it, and a window before it does not."""
    node = slurm_cluster.nodes[-1]
    environ = {"SLURM_JOB_NODELIST": node, "SLURM_JOB_ID": "0"}  # the run asking: any job id but the sleeper's
    before = time.time()
    time.sleep(1.5)  # sacct's clock has one-second steps; the query widens its window by one each way
    opened = time.time()
    sleeper = sbatch_sleeper(node, seconds=2)
    deadline = time.monotonic() + 90
    while sacct_state(sleeper) != "COMPLETED":
        assert time.monotonic() < deadline, f"job {sleeper} did not complete on {node}: {sacct_state(sleeper)!r}"
        time.sleep(0.5)
    closed = time.time()
    assert sleeper not in (running_on_nodes(environ) or [])  # gone: an end-of-training squeue misses it
    # slurmdbd answers a --nodelist query for a job up to a few seconds after `sacct -j` already shows it
    # COMPLETED (measured on this cluster: 0.5-2.5 s), so the same window is asked again until it does.
    deadline = time.monotonic() + 30
    while sleeper not in (ran_on_nodes_between(environ, opened, closed) or []):
        assert time.monotonic() < deadline, f"accounting never listed {sleeper} on {node} between the samples"
        time.sleep(0.5)
    assert sleeper not in (ran_on_nodes_between(environ, before - 60, before - 2) or [])
