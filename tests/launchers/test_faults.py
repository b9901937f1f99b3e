"""Faults of Slurm-launched runs against the real local cluster (no mocks).

- two jobs sharing a node start their process groups side by side (distinct rendezvous ports);
- a rank that hangs ends its job at training.collective_timeout_s, with a `timeout` record;
- killing the submitting process loses no result (the jobs and the manifest outlive it);
- a run stopped by Slurm's USR1 warning checkpoints, requeues itself (at most cluster.max_retries
  times) and resumes from its checkpoint without repeating a step: the warning sent by hand (as a
  preemption would) and sent by Slurm itself before a real one-minute time limit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.launchers.test_slurm_launcher import REPO, TINY, array_of, result, sacct, sweep, wait_until
from tests.launchers.test_status import status_table
from train.contract import ManifestEntry, manifest_path, read_manifest
from train.distributed import slurm_master_port
from train.preemption import SLOW_FIRST_ATTEMPT_ENV

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

# A one-layer model with a datasheet peak (no calibration per rank): a few seconds of work per rank.
QUICK = (
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=1.0",
    "parallelism.precision=fp32",
)
FAULT_TIMEOUT_S = 180


def wait_for_records(
    sweep_dir: Path, entries: list[ManifestEntry], *, ok: bool = False
) -> list[dict[str, Any]]:
    """Each entry's result.json (with ok=True: once every one says ok)."""

    def ready() -> bool:
        records = [result(sweep_dir, e) for e in entries]
        return all(r is not None and (not ok or r["status"] == "ok") for r in records)

    wait_until(f"result.json of configs {[e.index for e in entries]}", ready, timeout=FAULT_TIMEOUT_S)
    return [r for e in entries if (r := result(sweep_dir, e)) is not None]


def interval(record: dict[str, Any]) -> tuple[datetime, datetime]:
    start = datetime.fromisoformat(record["started_at"])
    return start, start + timedelta(seconds=float(record["wall_s"]))


def test_two_jobs_on_one_node_start_their_process_groups(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "shared"
    node = slurm_cluster.nodes[0]
    # Two 2-rank jobs of one array, both pinned to the same node: two gloo rendezvous on one host.
    # Twenty iterations (seconds of training) make the two runs' process groups live at the same time.
    # Plumbing, not a measurement: the jobs ask to share the node's two CPUs and for no core license
    # (which would run them one after the other).
    sweep(
        sweep_dir,
        *QUICK,
        "parallelism.dp=2",
        "training.train_iters=20",
        "training.lr=1e-4,2e-4",
        f"+hydra.launcher.sbatch_args.nodelist={node}",
        "+hydra.launcher.sbatch_args.oversubscribe=''",
        "cluster.core_license=null",
    )
    entries = read_manifest(sweep_dir)
    assert len(entries) == 2 and len({array_of(e.job_id) for e in entries}) == 1
    records = wait_for_records(sweep_dir, entries)
    assert [r["status"] for r in records] == ["ok", "ok"], [r.get("message") for r in records]
    assert all(r["world"]["world_size"] == 2 for r in records)
    assert [r["env"]["SLURM_JOB_NODELIST"] for r in records] == [node, node]
    # They trained at the same time (else the node was never shared), on different ports.
    (a_start, a_end), (b_start, b_end) = interval(records[0]), interval(records[1])
    assert a_start < b_end and b_start < a_end, (records[0]["started_at"], records[1]["started_at"])
    ports = {slurm_master_port(r["env"]["SLURM_JOB_ID"]) for r in records}
    assert len(ports) == 2, ports


def test_a_hanging_rank_ends_its_job_at_the_collective_timeout(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "hang"
    # Rank 1 sleeps an hour before its collectives of iteration 2; rank 0 waits 10 s in the
    # all-reduce, records `timeout`, and its failure ends rank 1's task (srun --kill-on-bad-exit).
    sweep(
        sweep_dir,
        *QUICK,
        "parallelism.dp=2",
        "training.collective_timeout_s=10",
        "+cluster.env.MEGASWEEP_FAULT_HANG='1:2'",
    )
    (entry,) = read_manifest(sweep_dir)
    (record,) = wait_for_records(sweep_dir, [entry])
    assert record["status"] == "timeout", record["message"]
    assert record["iterations_run"] == 1
    # The job itself ended too: nothing of it is left holding the node until the 20-minute limit.
    job = str(entry.job_id)
    wait_until(
        "the hung job to end in Slurm",
        lambda: [r[1] for r in sacct("-X", "-j", job, "--format=JobID,State") if r[0] == job] == ["FAILED"],
        timeout=60,
    )
    steps = sacct("-j", job, "--format=JobID,State")
    assert not any(state.startswith("RUNNING") for _, state in steps), steps


def test_killing_the_submitting_process_loses_no_result(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "orphaned"
    args = [
        sys.executable,
        "-m",
        "train",
        "-m",
        *TINY,
        *QUICK,
        "training.lr=1e-4,2e-4,3e-4",
        # The launcher would wait for the jobs: it is killed while it does.
        "hydra.launcher.wait=true",
        f"hydra.sweep.dir={sweep_dir}",
        "hydra/launcher=slurm",
    ]
    launcher = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until("the manifest", lambda: manifest_path(sweep_dir).exists(), timeout=120)
        assert launcher.poll() is None, "the launcher ended before it could be killed"
        os.kill(launcher.pid, signal.SIGKILL)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(timeout=30)
    assert launcher.returncode == -signal.SIGKILL

    entries = read_manifest(sweep_dir)
    assert [e.status for e in entries] == ["submitted"] * 3
    records = wait_for_records(sweep_dir, entries)
    assert [r["status"] for r in records] == ["ok"] * 3
    # `status` reads what outlived the launcher: the manifest, the records and sacct.
    wait_until("launchers status to report 3 done", lambda: "3 done, 0 failed" in status_table(sweep_dir), 60)


def test_requeue_constant_matches_the_trainer() -> None:
    # One definition (train.contract) for the trainer that exits with it and the wrapper that requeues on it.
    from launchers import job
    from train import contract

    assert job.EXIT_REQUEUE is contract.EXIT_REQUEUE == 75


# A real time limit: Slurm's shortest (one minute). Its USR1 comes 15 s ahead as asked, give or take
# slurmctld's 30 s check period; the first attempt sleeps 2 s per iteration, so 40 iterations cannot
# end before the warning, and the requeued attempt runs at full speed (train.preemption hook).
TIME_LIMIT_ITERS = 40
SLOW_FIRST_ATTEMPT_S = 2


def test_stopped_run_requeues_and_resumes_from_its_checkpoint(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """Slurm's USR1 warning sent by hand (as a preemption would), and by Slurm before a real time
    limit; both sweeps run at once, the time-limited one submitted first since it takes a minute."""
    limit_dir = tmp_path / "time-limit"
    sweep(
        limit_dir,
        *QUICK,
        f"training.train_iters={TIME_LIMIT_ITERS}",
        f"training.save_interval={10 * TIME_LIMIT_ITERS}",
        "cluster.time_limit_min=1",
        "cluster.max_retries=1",
        f"+cluster.env.{SLOW_FIRST_ATTEMPT_ENV}={SLOW_FIRST_ATTEMPT_S}",
    )
    (limited,) = read_manifest(limit_dir)
    try:
        _signal_sent_by_hand_requeues_once(tmp_path / "requeue")
        _time_limit_requeues_and_completes(limit_dir, limited)
    finally:
        subprocess.run(["scancel", str(limited.job_id)], check=False, timeout=30)


def _time_limit_requeues_and_completes(sweep_dir: Path, entry: ManifestEntry) -> None:
    submission = next((sweep_dir / ".submitit").rglob("*_submission.sh")).read_text()
    assert "#SBATCH --time=1" in submission and "#SBATCH --signal=USR1@15" in submission
    done = wait_for_records(sweep_dir, [entry], ok=True)[0]
    first = json.loads((sweep_dir / entry.output_dir / "result.attempt0.json").read_text())
    assert first["status"] == "timeout" and "requeue" in first["message"]
    stopped_at = first["iterations_run"]
    # Stopped by the warning, well before the end it could not reach in one minute.
    assert 1 <= stopped_at < TIME_LIMIT_ITERS
    assert done["resumed_from_step"] == stopped_at
    assert done["iterations_run"] == TIME_LIMIT_ITERS - stopped_at
    assert len(done["losses"]) == TIME_LIMIT_ITERS and done["losses"][:stopped_at] == first["losses"]
    job = str(entry.job_id)
    wait_until(
        "sacct to show the time-limited job requeued once, then completed",
        lambda: _states([job]) == {job: ["REQUEUED", "COMPLETED"]},
        timeout=60,
    )


def _signal_sent_by_hand_requeues_once(sweep_dir: Path) -> None:
    iters = 100
    # One array of two configs: one requeue allowed, none allowed. Each checkpoints only when
    # told to stop (save_interval beyond the end). The first attempts take 0.5 s per iteration,
    # so that the signal (sent after iteration 2) finds them running: at full speed this model
    # does 100 iterations in about a second. Two ranks each: a task that left with the requeue's
    # status ended the step (srun --kill-on-bad-exit) while task 0 still asked Slurm to requeue it.
    # No core license, so that the two 2-CPU jobs run at once (on two emulated nodes; they mostly sleep).
    sweep(
        sweep_dir,
        *QUICK,
        "parallelism.dp=2",
        "cluster.core_license=null",
        f"training.train_iters={iters}",
        f"training.save_interval={10 * iters}",
        "cluster.max_retries=1,0",
        f"+cluster.env.{SLOW_FIRST_ATTEMPT_ENV}=0.5",
    )
    retried, given_up = entries = read_manifest(sweep_dir)
    jobs = [str(e.job_id) for e in entries]
    assert len({array_of(j) for j in jobs}) == 1
    submission = next((sweep_dir / ".submitit").rglob("*_submission.sh")).read_text()
    assert "#SBATCH --requeue" in submission and re.search(r"#SBATCH --signal=USR1@\d+", submission)
    # Slurm's warning before the time limit, sent the way --signal sends it (to every process of
    # the job's steps) once both runs are past their first iterations.
    logs = [sweep_dir / ".submitit" / j / f"{j}_0_log.out" for j in jobs]
    wait_until(
        "both runs to pass iteration 2",
        lambda: all(p.exists() and re.search(r"iteration\s+2/", p.read_text(errors="replace")) for p in logs),
        timeout=FAULT_TIMEOUT_S,
    )
    for job in jobs:
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    try:
        # Slurm holds a requeued job for its credential lifetime (AuthInfo cred_expire: 15 s on the
        # local cluster, 120 s by default). Release it at once to another node, which also shows
        # that the checkpoint does not depend on the node.
        wait_until("the requeued job to be pending", lambda: _pending(jobs[0]), timeout=FAULT_TIMEOUT_S)
        first_node = json.loads((sweep_dir / retried.output_dir / "result.attempt0.json").read_text())["env"][
            "SLURM_JOB_NODELIST"
        ]
        subprocess.run(
            ["scontrol", "update", f"JobId={jobs[0]}", f"ExcNodeList={first_node}", "StartTime=now"],
            check=True,
            timeout=30,
        )
        done = wait_for_records(sweep_dir, [retried], ok=True)[0]
    except BaseException:
        # A failure here may leave the requeued job held: it must not outlive the test.
        subprocess.run(["scancel", *jobs], check=False, timeout=30)
        raise

    # Task 1 left the stopped attempt with 0, so srun did not cancel the step under task 0 (whose
    # wrapper still asked Slurm to requeue, and outlived srun's SIGTERM only for KillWait seconds).
    said = logs[0].read_text(errors="replace")
    assert "slurm: requeued" in said, said[-3000:]
    before = said.split("slurm: requeued", 1)[0]
    assert "Exited with exit code" not in before and "Terminating StepId" not in before, said[-3000:]
    # The first attempt's record is kept beside; the second resumed where the first stopped.
    first = json.loads((sweep_dir / retried.output_dir / "result.attempt0.json").read_text())
    assert first["status"] == "timeout" and "requeue" in first["message"]
    stopped_at = first["iterations_run"]
    assert 2 <= stopped_at < iters
    assert done["env"]["SLURM_JOB_NODELIST"] != first["env"]["SLURM_JOB_NODELIST"]
    assert done["resumed_from_step"] == stopped_at
    assert done["iterations_run"] == iters - stopped_at
    assert len(done["losses"]) == iters and done["losses"][:stopped_at] == first["losses"]

    # No retry allowed: the `timeout` record stands and the job failed with the trainer's status.
    (stopped,) = wait_for_records(sweep_dir, [given_up])
    assert stopped["status"] == "timeout"
    assert not (sweep_dir / given_up.output_dir / "result.attempt0.json").exists()
    wait_until(
        "sacct to show one requeue of the first job and the second failed",
        lambda: _states(jobs) == {jobs[0]: ["REQUEUED", "COMPLETED"], jobs[1]: ["FAILED"]},
        timeout=60,
    )
    table = status_table(sweep_dir)
    assert "1 done, 1 failed" in table, table


def _pending(job: str) -> bool:
    out = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return out.strip() == "PENDING"


def _states(jobs: list[str]) -> dict[str, list[str]]:
    """Each job's states, one per run (sacct -D lists a requeued job once per attempt)."""
    rows = sacct("-X", "-D", "-j", ",".join(sorted({array_of(j) for j in jobs})), "--format=JobID,State")
    states: dict[str, list[str]] = {j: [] for j in jobs}
    for job_id, state in rows:
        if job_id in states:
            states[job_id].append(state.split()[0])
    return states


@pytest.fixture(autouse=True)
def _no_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweeps here log nothing to W&B (test_slurm_launcher.TINY sets logger=disabled); a
    # WANDB_MODE in the environment would turn it back on.
    monkeypatch.delenv("WANDB_MODE", raising=False)
