"""launchers.job, the wrapper inside each Slurm task (and each local run), against the real local cluster: what it says
and does when the trainer stopped for a requeue and cluster.max_retries are used up."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import launchers.job as job_module
from launchers.job import requeued_by_slurm
from launchers.queue import is_live, read_states
from launchers.status import sweep_status, unresolved_failures
from tests.launchers.test_slurm_launcher import REPO, result, sweep, wait_until
from tests.launchers.test_status import status_table
from train.contract import (
    EXIT_FAILED,
    EXIT_REQUEUE,
    LOG_FILE,
    RESULT_FILE,
    SUBMITIT_DIR,
    ManifestEntry,
    attempt_result_name,
    read_manifest,
)
from train.preemption import SLOW_FIRST_ATTEMPT_ENV

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo


def _squeue_state(job: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30, check=False
    ).stdout.strip()


def test_requeued_by_slurm_reads_the_jobs_restart_count(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    job = subprocess.run(
        ["sbatch", "--parsable", f"--partition={slurm_cluster.partition}", "--requeue", "--time=5",
         f"--output={tmp_path / 'out'}", "--wrap", "sleep 300"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.strip().split(";")[0]  # fmt: skip
    try:
        wait_until("the job to run", lambda: _squeue_state(job) == "RUNNING", timeout=120)
        assert not requeued_by_slurm(job, 0)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        # Counted at once: the attempt that Slurm stops for the requeue (SLURM_RESTART_COUNT 0) sees it.
        assert requeued_by_slurm(job, 0)
        assert not requeued_by_slurm(job, 1)
        # A trainer without a checkpoint that the requeue's SIGTERM stopped (143): its wrapper ends the
        # attempt without a result (submitit kept the failure as the job's, and a waiting launch exited
        # 1 while the next attempt finished the config), its record kept aside; not when not requeued.
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / RESULT_FILE).write_text('{"status": "timeout"}')
        stand_in = ("import sys; from launchers.job import TrainCommand; "
                    f"code = TrainCommand(argv=(sys.executable, '-c', 'raise SystemExit(143)'), cwd={str(tmp_path)!r}, "
                    f"output_dir={str(run_dir)!r}).run(); print('returned', code)")  # fmt: skip
        for restarts, ends in (("0", True), ("1", False)):
            env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": restarts, "SLURM_PROCID": "0"}
            proc = subprocess.run([sys.executable, "-c", stand_in], env=env, cwd=REPO, capture_output=True, text=True,
                                  timeout=120)  # fmt: skip
            if ends:
                assert proc.returncode == EXIT_REQUEUE and "returned" not in proc.stdout, proc.stdout + proc.stderr
                assert f"slurm: {job} was requeued by Slurm itself" in proc.stdout
                assert (run_dir / attempt_result_name(0)).exists() and not (run_dir / RESULT_FILE).exists()
            else:
                assert proc.returncode == 0 and "returned 143" in proc.stdout, proc.stdout + proc.stderr
    finally:
        subprocess.run(["scancel", job], check=False, timeout=30)
    # A job scontrol does not know: no requeue to speak of, the job ends as it would.
    assert not requeued_by_slurm("99999999", 0)


def test_slurms_own_requeue_past_max_retries_is_said_and_resumed(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """`scontrol requeue` (as a preemption requeues) of a checkpointing run whose cluster.max_retries=0
    are used up: the wrapper said "requeue(s) are used up: the job ends here" and failed the task,
    while Slurm ran the job again and status rightly showed it pending. It now says that Slurm requeued
    the job, keeps the stopped attempt's record aside, and the next attempt resumes."""
    sweep_dir = tmp_path / "sweep"
    # The first attempt sleeps 1 s per iteration (the requeued one runs at full speed); it checkpoints
    # only when Slurm stops it.
    sweep(sweep_dir, "training.train_iters=8", "training.save_interval=100", "cluster.max_retries=0",
          f"+cluster.env.{SLOW_FIRST_ATTEMPT_ENV}=1")  # fmt: skip
    (entry,) = read_manifest(sweep_dir)
    job = str(entry.job_id)
    log = sweep_dir / entry.output_dir / LOG_FILE
    try:
        # Other jobs may hold the cores a while: as long as the fault tests wait.
        wait_until("iteration 2", lambda: log.exists() and "iteration        2/" in log.read_text(errors="replace"), 300)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        kept = sweep_dir / entry.output_dir / attempt_result_name(0)
        wait_until("the stopped attempt's record, kept aside", kept.exists, timeout=60)
        assert not unresolved_failures(sweep_status(sweep_dir))
        wait_until("the requeued attempt's record", lambda: (result(sweep_dir, entry) or {}).get("status") == "ok")
        # Ended before the scancel below, which would stop it between its record and its exit.
        wait_until("the job to end", lambda: read_states([job]).get(job, "").startswith("COMPLETED"), timeout=60)
    finally:
        subprocess.run(["scancel", job], check=False, timeout=30)
    stopped = json.loads(kept.read_text())
    resumed = result(sweep_dir, entry) or {}
    assert stopped["status"] == "timeout" and resumed["resumed_from_step"] == stopped["iterations_run"] >= 2
    assert len(resumed["losses"]) == 8
    # Both attempts' output (and their stderr: submitit sends it to the same file).
    out = (sweep_dir / SUBMITIT_DIR / job / f"{job}_0_log.out").read_text(errors="replace")
    # The stopped attempt says so unless Slurm's SIGKILL (KillWait after the requeue's SIGTERM) ends its
    # wrapper first, as on a loaded node in CI (2026-11-26); the next attempt says so in any case.
    assert f"{job} runs again (requeue 1, beyond cluster.max_retries=0: Slurm requeued it itself)" in out, out
    assert "used up" not in out and "Traceback" not in out, out
    wait_until("status to show it done", lambda: "1 done, 0 failed" in status_table(sweep_dir), 30)


def test_a_requeued_attempt_keeps_the_record_its_killed_predecessor_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slurm's SIGKILL can end a stopped attempt's wrapper before it keeps the trainer's record aside
    (CI, 2026-11-26: 7 s after `scontrol requeue` on a loaded node); the next attempt's task 0 keeps it
    before its trainer starts, instead of the next record overwriting it. Slurm's side is what it sets
    in the task's environment (SLURM_RESTART_COUNT, SLURM_PROCID); the trainer here is a stand-in."""

    from launchers.job import TrainCommand

    left = {"status": "timeout", "iterations_run": 3}
    (tmp_path / RESULT_FILE).write_text(json.dumps(left))
    write_ok = f"import json; json.dump({{'status': 'ok'}}, open({str(tmp_path / RESULT_FILE)!r}, 'w'))"
    command = TrainCommand(argv=(sys.executable, "-c", write_ok), cwd=str(tmp_path), output_dir=str(tmp_path))

    def attempt(restarts: str, procid: str = "0") -> int:
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
        monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
        monkeypatch.setenv("SLURM_PROCID", procid)
        return command.run()

    assert attempt("1", procid="1") == 0  # not task 0: leaves it to task 0
    assert not (tmp_path / attempt_result_name(0)).exists()
    assert "runs again" not in capsys.readouterr().out
    (tmp_path / RESULT_FILE).write_text(json.dumps(left))
    assert attempt("1") == 0
    # max_retries=0, so no wrapper requeued it: said by the attempt that runs, whatever its predecessor said.
    said = capsys.readouterr().out
    assert "slurm: 77 runs again (requeue 1, beyond cluster.max_retries=0: Slurm requeued it itself)" in said
    assert f"kept the record attempt 0 left as {attempt_result_name(0)}" in said
    assert json.loads((tmp_path / attempt_result_name(0)).read_text()) == left
    assert json.loads((tmp_path / RESULT_FILE).read_text()) == {"status": "ok"}
    # A record its own wrapper kept already stays, and a first attempt has nothing to keep.
    assert attempt("1") == 0 and json.loads((tmp_path / attempt_result_name(0)).read_text()) == left
    assert attempt("0") == 0 and not (tmp_path / attempt_result_name(-1)).exists()



def test_a_local_run_is_ended_at_its_time_limit_as_slurm_ends_a_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # hydra/launcher=local ran a config of cluster.time_limit_min=1 on for 200 s: no Slurm ends it there.
    monkeypatch.setattr(job_module, "LOCAL_KILL_WAIT_S", 1.0)
    log = tmp_path / LOG_FILE
    polite = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); time.sleep(60)"
    code = job_module.run_logged([sys.executable, "-c", polite], cwd=str(tmp_path), env=os.environ, log=log,
                                 time_limit_s=0.5)  # fmt: skip
    assert code == 143
    assert "megasweep: cluster.time_limit_min reached (0.00833333 min): SIGTERM" in log.read_text()
    # One that outlives its SIGTERM is killed after the kill wait, as Slurm's KillWait does.
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    code = job_module.run_logged([sys.executable, "-c", stubborn], cwd=str(tmp_path), env=os.environ, log=log,
                                 time_limit_s=0.5)  # fmt: skip
    assert code == -9
    # Where Slurm enforces it (no time_limit_s), nothing is sent.
    quick = job_module.run_logged([sys.executable, "-c", "pass"], cwd=str(tmp_path), env=os.environ, log=log)
    assert quick == 0


def test_a_local_launchs_command_carries_its_time_limit_and_a_slurm_ones_does_not(tmp_path: Path) -> None:
    from launchers.compose import FastComposer
    from launchers.submit import LaunchSettings, command_for, plan_configs

    composer = FastComposer.from_config_dir(REPO / "conf")
    (spec,), _ = plan_configs(composer, [["model=tiny", "cluster.time_limit_min=3"]], 0)
    settings = LaunchSettings(python=sys.executable, module="train", cwd=str(REPO), job_name="t", max_array_size=10)
    assert command_for(spec, dataclasses.replace(settings, local=True), tmp_path).time_limit_s == 180.0
    assert command_for(spec, settings, tmp_path).time_limit_s is None


def _scancel_after_iteration_3(sweep_dir: Path, *overrides: str) -> tuple[ManifestEntry, dict[str, Any]]:
    """A one-config sweep that runs 0.5 s iterations (200 of them: far from its end), cancelled with
    scancel once it logged iteration 3; its manifest entry and record once the job has ended."""
    sweep(sweep_dir, *overrides, "training.train_iters=200", f"+cluster.env.{SLOW_FIRST_ATTEMPT_ENV}=0.5")
    (entry,) = read_manifest(sweep_dir)
    job = str(entry.job_id)
    log = sweep_dir / entry.output_dir / LOG_FILE
    try:
        # Other jobs may hold the cores a while: as long as the fault tests wait.
        wait_until("iteration 3", lambda: log.exists() and "iteration        3/" in log.read_text(errors="replace"), 300)
        subprocess.run(["scancel", job], check=True, timeout=30)
        wait_until("the record", lambda: (result(sweep_dir, entry) or {}).get("status") in ("timeout", "cancelled"), 60)
        wait_until("the job to end", lambda: not is_live(read_states([job]).get(job, "RUNNING")), 60)
    finally:
        subprocess.run(["scancel", job], check=False, timeout=30)
    return entry, result(sweep_dir, entry) or {}


def test_a_local_run_stopped_with_a_checkpoint_is_not_requeued_through_slurm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its time limit's SIGTERM stops a checkpointing trainer for a requeue (EXIT_REQUEUE): the Slurm path
    # ran `scontrol requeue` on an empty job id, and inside an salloc requeued the user's allocation.
    monkeypatch.setenv("SLURM_JOB_ID", "999999999")  # a local sweep launched inside an allocation
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    record = tmp_path / RESULT_FILE
    stopped = {"status": "timeout", "message": "received SIGTERM; stopped after step 4 of 8 with a checkpoint in /c: "
               "requeue to resume"}  # fmt: skip
    stop = [sys.executable, "-c", f"import json, sys; json.dump({stopped!r}, open({str(record)!r}, 'w')); sys.exit({EXIT_REQUEUE})"]
    command = job_module.TrainCommand(argv=tuple(stop), cwd=str(tmp_path), output_dir=str(tmp_path), max_retries=2,
                                      time_limit_s=600.0)  # fmt: skip
    assert command.run() == EXIT_REQUEUE
    out = capsys.readouterr()
    assert "scontrol" not in out.out + out.err
    said = "this job was not requeued (a run of this machine: no Slurm job of its own to requeue)"
    assert said in json.loads(record.read_text())["message"]
    assert said in (tmp_path / LOG_FILE).read_text().splitlines()[-1]


def test_a_run_cancelled_while_it_trains_says_cancelled_in_its_record_log_status_and_analysis(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """scancel's SIGTERM comes as a time limit's does, so the trainer (no checkpoint) recorded `timeout`,
    "received SIGTERM", and its train.log ended on it, while status and the analysis, reading sacct, said
    cancelled or failed. The wrapper asks sacct once the trainer has exited and writes `cancelled` over
    the record; the log's last line says why; status and the analysis say cancelled too."""
    sweep_dir = tmp_path / "sweep"
    entry, record = _scancel_after_iteration_3(sweep_dir)
    job = str(entry.job_id)
    log = sweep_dir / entry.output_dir / LOG_FILE
    assert record["status"] == "cancelled", record.get("message")
    assert record["message"].startswith(f"job {job} was cancelled (scancel), not stopped by a time limit: received SIGTERM")
    assert record["measured_iterations"] >= 2  # its figures so far stay, as a time limit's do
    said = f"job {job} was cancelled (scancel): it stopped on scancel's SIGTERM, not at a time limit"
    assert log.read_text().splitlines()[-1].startswith(f"megasweep: {said}")
    status = subprocess.run([sys.executable, "-m", "launchers", "status", str(sweep_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert status.returncode == EXIT_FAILED, status.stdout + status.stderr
    assert re.search(rf"^0\s+cancelled\s+{job}\s", status.stdout, flags=re.MULTILINE), status.stdout
    assert f"log of cancelled config 0: {log}" in status.stdout
    assert status.stdout.splitlines()[-1].endswith("1/1 finished: 0 pending, 0 running, 0 done, 0 failed, 1 cancelled, "
                                                   "0 refused, 0 skipped"), status.stdout  # fmt: skip
    assert "status: 1 configs cancelled (scancel)" in status.stderr and "--skip-cancelled" in status.stderr
    out = tmp_path / "analysis"
    analysis = subprocess.run([sys.executable, "-m", "analysis", str(sweep_dir), "--no-plots", "-o", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert analysis.returncode == EXIT_FAILED, analysis.stdout + analysis.stderr  # ended, nothing to recommend
    assert "1 configs: 1 cancelled; 1 stopped run(s) with partial figures" in analysis.stdout, analysis.stdout
    assert "cancelled (partial)" in (out / "results.md").read_text()


def test_a_run_cancelled_while_it_logs_offline_to_wandb_says_cancelled_there_too(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """The wrapper wrote `cancelled` over the record once the trainer had exited, but W&B's run had
    finished by then with the trainer's `timeout` in its summary (and with logger=offline, scancel's
    SIGTERM reaches wandb's service too: the run moved offline again and the wrapper was SIGKILLed, so the
    record kept `timeout` as well). The trainer asks Slurm before it writes either: both say cancelled."""
    from analysis.wandb_io import read_offline_runs

    sweep_dir = tmp_path / "sweep"
    entry, record = _scancel_after_iteration_3(sweep_dir, "logger=offline")
    assert record["status"] == "cancelled", record.get("message")
    (run,) = read_offline_runs([sweep_dir / entry.output_dir])
    assert (run.summary["status"], run.summary["message"]) == ("cancelled", record["message"]), run.summary
    assert run.summary["measured_iterations"] == record["measured_iterations"] >= 2
    assert run.state == "failed"  # W&B's exit code: not a finished run
