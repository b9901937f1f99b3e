"""`python -m launchers status|rerun`: states from manifest + result.json + Slurm, and reruns of failures."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from analysis.records import load_sweeps
from launchers.queue import FORGOTTEN, GONE, is_cancelled, read_states
from launchers.sbatch import export_sweep
from launchers.states import classify
from launchers.status import ConfigStatus, format_status, sweep_status, unresolved_failures
from tests.launchers.test_slurm_launcher import REPO, TINY, result, sweep, wait_for_results, wait_until
from train.contract import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_UNFINISHED,
    EXIT_USAGE,
    EXPORTED_JOBS_DIR,
    LAUNCH_FILE,
    LOCK_FILE,
    LOG_FILE,
    RESULT_FILE,
    SUBMITIT_DIR,
    LocalRun,
    ManifestEntry,
    local_run_path,
    read_manifest,
    write_manifest,
)

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

SUBMITTED = ManifestEntry(index=0, overrides=("a=1",), output_dir="0", status="submitted", job_id="7_0")


def test_classify_prefers_result_json_and_falls_back_on_slurm() -> None:
    assert classify(SUBMITTED, {"status": "ok"}, "FAILED") == ("done", "", "record")
    state, detail, _ = classify(SUBMITTED, {"status": "oom", "message": "CUDA out of memory"}, "COMPLETED")
    assert state == "failed" and "oom" in detail and "CUDA out of memory" in detail
    assert classify(SUBMITTED, None, "TIMEOUT")[0] == "failed"
    assert classify(SUBMITTED, None, "CANCELLED by 0") == (
        "cancelled", "Slurm state CANCELLED (scancel), no result.json", "slurm")  # fmt: skip
    assert classify(SUBMITTED, None, "COMPLETED")[0] == "failed"
    assert classify(SUBMITTED, None, "RUNNING") == ("running", "", "slurm")
    assert classify(SUBMITTED, None, "PENDING") == ("pending", "PENDING", "slurm")
    assert classify(SUBMITTED, None, "PENDING (Licenses)") == ("pending", "PENDING (Licenses)", "slurm")
    # Requeued after a failure (a node failure, by hand): waiting to run, this attempt wrote nothing, so
    # any record is an earlier attempt's. Failed, rerun --failed queued a second run into its directory.
    for record in ({"status": "error", "message": "m"}, {"status": "nan"}, {"status": "oom"}):
        for slurm in ("PENDING (Priority)", "REQUEUED", "REQUEUE_HOLD", "SPECIAL_EXIT"):
            state, detail, cause = classify(SUBMITTED, record, slurm)
            assert state == "pending" and detail.startswith(f"requeued ({slurm}); the last attempt's"), (record, slurm)
            assert cause == "requeued"
    # Running, the record is this attempt's, written just before its end.
    assert classify(SUBMITTED, {"status": "error", "message": "m"}, "RUNNING")[0] == "failed"
    assert classify(SUBMITTED, None, "STOPPED") == ("running", "", "slurm")  # SIGSTOPped, still Slurm's
    # Preempted without a requeue: the stopped run recorded `timeout`, which read as a time limit, then as
    # failed; it is preempted (its figures partial to the analysis), with its record or without one.
    preempted = classify(SUBMITTED, {"status": "timeout", "message": "received SIGTERM"}, "PREEMPTED")
    assert preempted[0] == "preempted" and preempted.cause == "stopped" and preempted[1].startswith("preempted (Slurm state PREEMPTED), not a time limit")
    assert classify(SUBMITTED, None, "PREEMPTED")[:2] == (
        "preempted", "Slurm state PREEMPTED (the cluster took its nodes), no result.json")
    # scancel's SIGTERM reads as a time limit to the trainer; Slurm's state tells them apart.
    cancelled = classify(SUBMITTED, {"status": "timeout", "message": "received SIGTERM"}, "CANCELLED")
    assert cancelled[0] == "cancelled" and cancelled[1].startswith("cancelled (Slurm state CANCELLED), not a time limit")
    # ... and the in-job wrapper writes `cancelled` over that record when it outlives the SIGTERM.
    marked = {"status": "cancelled", "message": "job 7_0 was cancelled (scancel), not stopped by a time limit: m"}
    assert classify(SUBMITTED, marked, "CANCELLED by 0") == (
        "cancelled", "result.json status cancelled: job 7_0 was cancelled (scancel), not stopped by a time limit: m",
        "record")  # fmt: skip
    # A cancelled job requeued by hand (scontrol requeue) runs again: its record is the last attempt's.
    assert classify(SUBMITTED, marked, "RUNNING")[0] == "running"
    assert classify(SUBMITTED, marked, "PENDING")[0] == "pending"
    assert classify(SUBMITTED, {"status": "timeout", "message": "received SIGTERM"}, "TIMEOUT")[1].startswith(
        "result.json status timeout"
    )
    assert classify(SUBMITTED, None, None) == ("pending", "", "unknown")
    # Requeued (scontrol requeue, a preemption): the record is the last attempt's, the job runs again.
    requeued = classify(SUBMITTED, {"status": "timeout", "message": "received SIGTERM"}, "PENDING (BeginTime)")
    assert requeued[0] == "pending" and requeued[1].startswith("requeued (PENDING (BeginTime))")
    assert classify(SUBMITTED, {"status": "timeout", "message": "received SIGTERM"}, "RUNNING")[0] == "running"
    assert classify(SUBMITTED, {"status": "ok"}, "RUNNING") == ("done", "", "record")
    # A failure's record while its job is still ending (no requeue follows an error) is failed at once.
    assert classify(SUBMITTED, {"status": "error", "message": "DataFileError: x"}, "RUNNING")[0] == "failed"
    skipped = ManifestEntry(
        index=1, overrides=(), output_dir="1", status="skipped", reason="tp=3 does not divide"
    )
    assert classify(skipped, None, None) == ("skipped", "tp=3 does not divide", "manifest")
    refused = ManifestEntry(
        index=2, overrides=(), output_dir="2", status="refused", reason="sbatch refused: invalid partition"
    )
    assert classify(refused, None, None) == ("refused", "sbatch refused: invalid partition", "manifest")
    exported = ManifestEntry(
        index=3, overrides=(), output_dir="3", status="exported", reason="exported to a.sbatch, array task 3"
    )
    # No job has recorded itself: queued or never submitted, this side cannot tell.
    state, detail, _ = classify(exported, None, None)
    assert state == "pending" and "no job started yet" in detail and "a.sbatch, array task 3" in detail
    assert classify(exported, {"status": "ok"}, None) == ("done", "", "record")


def test_format_status_shows_varying_overrides_counts_and_bar() -> None:
    statuses = [
        ConfigStatus(0, ("m=x", "lr=1"), "done", "7_0", "COMPLETED", ""),
        ConfigStatus(1, ("m=x", "lr=2"), "failed", "7_1", "FAILED", "result.json status error: boom"),
        ConfigStatus(2, ("m=x", "lr=3"), "running", "7_2", "RUNNING", ""),
        ConfigStatus(3, ("m=x", "lr=4"), "skipped", None, None, "infeasible"),
        ConfigStatus(4, ("m=x", "lr=5"), "refused", None, None, "sbatch refused: invalid partition"),
    ]
    text = format_status(statuses, width=12)
    lines = text.splitlines()
    assert lines[0].split() == ["index", "state", "job", "overrides", "detail"]
    assert lines[2].split()[:4] == ["1", "failed", "7_1", "lr=2"] and "boom" in lines[2]
    assert "m=x" not in text  # the same in every config: not worth a column
    assert lines[5].split()[:3] == ["4", "refused", "-"] and "invalid partition" in lines[5]
    # 3 of the 4 configs that were not skipped have finished (refused ones will not run): 9 of 12.
    assert lines[-1] == (
        "[#########...] 3/4 finished: 0 pending, 1 running, 1 done, 1 failed, 1 refused, 1 skipped"
    )


def test_status_reads_result_files_without_slurm(tmp_path: Path) -> None:
    entries = [
        ManifestEntry(index=0, overrides=("a=1",), output_dir="0", status="submitted", job_id="5_0"),
        ManifestEntry(index=1, overrides=("a=2",), output_dir="1", status="submitted", job_id="5_1"),
    ]
    write_manifest(entries, tmp_path / "manifest.jsonl")
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "result.json").write_text('{"status": "ok"}')
    states = sweep_status(tmp_path, slurm_states={"5_1": "OUT_OF_MEMORY"})
    assert [(s.index, s.state) for s in states] == [(0, "done"), (1, "failed")]


def test_a_damaged_record_of_a_finished_run_is_failed_not_pending_forever(tmp_path: Path) -> None:
    # A config run here (no job id, its launcher gone) whose result.json no longer parses read `pending`
    # for ever, as one not started yet; a Slurm job's read "completed without writing result.json".
    entries = [
        ManifestEntry(index=0, overrides=("a=1",), output_dir="0", status="submitted"),
        ManifestEntry(index=1, overrides=("a=2",), output_dir="1", status="submitted", job_id="5_1"),
        ManifestEntry(index=2, overrides=("a=3",), output_dir="2", status="submitted", job_id="5_2"),
    ]
    write_manifest(entries, tmp_path / "manifest.jsonl")
    for e in entries:
        (tmp_path / e.output_dir).mkdir()
        (tmp_path / e.output_dir / "result.json").write_text('{"status": "ok", "sec_per')
    states = sweep_status(tmp_path, slurm_states={"5_1": "COMPLETED", "5_2": "PENDING"})
    assert [(s.state, s.detail.split(" (")[0]) for s in states[:2]] == [
        ("failed", "0/result.json cannot be read"), ("failed", "1/result.json cannot be read")
    ]  # fmt: skip
    assert "JSONDecodeError" in states[0].detail
    # A job waiting to run again (requeued) writes a new one: pending still.
    assert states[2].state == "pending"


def test_status_of_exported_configs_uses_the_job_ids_their_tasks_recorded(tmp_path: Path) -> None:
    entries = [
        ManifestEntry(index=i, overrides=(f"a={i}",), output_dir=str(i), status="exported", reason="exported")
        for i in range(3)
    ]
    write_manifest(entries, tmp_path / "manifest.jsonl")
    jobs = tmp_path / EXPORTED_JOBS_DIR
    jobs.mkdir(parents=True)
    (jobs / "1").write_text("8_1\n")
    (jobs / "2").write_text("8_2\n")
    states = sweep_status(tmp_path, slurm_states={"8_1": "RUNNING", "8_2": "TIMEOUT"})
    assert [(s.state, s.job_id) for s in states] == [("pending", None), ("running", "8_1"), ("failed", "8_2")]


def test_a_live_local_launcher_outranks_the_file_a_killed_one_left(tmp_path: Path) -> None:
    # A SIGKILLed local launcher leaves its LocalRun file; `rerun --failed` runs the config again under a
    # new launcher with its own. Status read the file that sorts last, the dead one's: "failed (killed?)".
    from launchers.states import process_start

    entry = ManifestEntry(index=0, overrides=("a=1",), output_dir="0", status="submitted")  # no job id: local
    write_manifest([entry], tmp_path / "manifest.jsonl")
    host = socket.gethostname()
    live = LocalRun(host, os.getpid(), process_start(os.getpid()), queued=(0,), running=0)
    dead = LocalRun(host, 99999999, "1", queued=(0,), running=0)  # above any pid_max
    for run in (live, dead):
        path = local_run_path(tmp_path, run.host, run.pid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(run)))
    assert local_run_path(tmp_path, host, dead.pid).name > local_run_path(tmp_path, host, live.pid).name
    [status] = sweep_status(tmp_path, slurm_states={})
    assert status.state == "running" and status.detail.endswith(f"local launcher, pid {os.getpid()}"), status
    # The analysis says what status says (it read "pending" for either: it asked Slurm only).
    from analysis.records import load_sweeps

    def analysed() -> tuple[str, str]:
        (row,) = load_sweeps([tmp_path], queue=None).table.itertuples()
        return row.outcome, row.reason

    assert analysed() == ("running", status.detail)
    local_run_path(tmp_path, host, live.pid).unlink()
    assert [s.state for s in sweep_status(tmp_path, slurm_states={})] == ["failed"]  # the dead one alone
    assert analysed() == ("fail", "its local launcher, pid 99999999, ended without the config's result.json (killed?)")


def test_a_local_config_queued_behind_another_is_pending_whatever_lies_in_its_directory(tmp_path: Path) -> None:
    # An unreadable result.json left in config 1's directory (an older sweep's): status and the analysis
    # called it failed, and `rerun --failed` would run it while the live launcher is yet to.
    from analysis.records import load_sweeps
    from launchers.states import process_start

    entries = [ManifestEntry(index=i, overrides=(f"a={i}",), output_dir=str(i), status="submitted") for i in (0, 1)]
    write_manifest(entries, tmp_path / "manifest.jsonl")
    host = socket.gethostname()
    live = LocalRun(host, os.getpid(), process_start(os.getpid()), queued=(0, 1), running=0)
    path = local_run_path(tmp_path, host, live.pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(live)))
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / RESULT_FILE).write_text("{not json")
    assert [s.state for s in sweep_status(tmp_path, slurm_states={})] == ["running", "pending"]
    table = load_sweeps([tmp_path], queue=None).table.sort_values("manifest_index")
    assert list(table["outcome"]) == ["running", "pending"]


def unfinished_exit(table: str) -> int:
    """The exit status `status` owes the table it printed, failures aside: EXIT_UNFINISHED while its last
    line counts configs pending or running, 0 otherwise."""
    counts = dict((state, int(n)) for n, state in re.findall(r"(\d+) (pending|running)\b", table.splitlines()[-1]))
    return EXIT_UNFINISHED if counts["pending"] or counts["running"] else 0


def status_table(sweep_dir: Path) -> str:
    """`python -m launchers status --ok-if-failed <sweep_dir>`'s output (it must exit 0, or EXIT_UNFINISHED
    while configs are pending or running)."""
    proc = subprocess.run(
        [sys.executable, "-m", "launchers", "status", "--ok-if-failed", str(sweep_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == unfinished_exit(proc.stdout), proc.stdout + proc.stderr
    return proc.stdout


def test_status_and_rerun_failed_against_slurm(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.bin"
    sweep_dir = tmp_path / "sweep"
    # Config 0 reads a token file that does not exist yet: the trainer fails it honestly.
    sweep(sweep_dir, f"training.data_path={tokens},null")
    first = read_manifest(sweep_dir)
    records = wait_for_results(sweep_dir, first)
    assert [r["status"] for r in records] == ["error", "ok"]

    wait_until(
        "status to show one done, one failed", lambda: "1 done, 1 failed" in status_table(sweep_dir), 30
    )
    rows = {line.split()[0]: line.split() for line in status_table(sweep_dir).splitlines()[1:-1]}
    assert rows["0"][1] == "failed" and rows["1"][1] == "done"
    done_before = (sweep_dir / "1" / "result.json").read_bytes()

    # Now the data exists: the rerun of config 0 alone succeeds.
    np.arange(1000, dtype=np.uint16).__mod__(500).astype(np.uint16).tofile(tokens)
    proc = subprocess.run(
        [sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed"],
        # Elsewhere than the repository (as an installed package would be): the jobs still start there.
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert proc.stdout.startswith("rerun: config 0: job ") and "config 1" not in proc.stdout
    second = read_manifest(sweep_dir)
    assert second[1] == first[1]
    assert second[0].job_id != first[0].job_id and second[0].overrides == first[0].overrides
    # The failed record is kept aside under its old job id.
    assert (sweep_dir / "0" / f"result.{first[0].job_id}.json").exists()

    (record,) = wait_for_results(sweep_dir, second[:1])
    assert record["status"] == "ok"
    assert (sweep_dir / "1" / "result.json").read_bytes() == done_before
    wait_until("status to show both done", lambda: "2 done, 0 failed" in status_table(sweep_dir), 30)
    assert result(sweep_dir, second[0]) is not None


def _rerun(sweep_dir: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """`python -m launchers rerun <sweep_dir> --failed <options>`, which must exit 0."""
    proc = subprocess.run([sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed", *options],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_rerun_failed_skip_cancelled_leaves_the_cancelled_configs_out(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """A user may scancel a config to drop it; `rerun --failed` resubmitted it with the failed ones.
    --skip-cancelled leaves it out and says so; without it, it goes again as before."""
    tokens = tmp_path / "tokens.bin"
    sweep_dir = tmp_path / "sweep"
    # Config 0 reads a token file that does not exist yet: it fails. Config 1 trains slowly (0.5 s per
    # iteration of its first attempt) until it is cancelled.
    sweep(sweep_dir, f"training.data_path={tokens},null", "training.train_iters=200",
          "+cluster.env.MEGASWEEP_FAULT_SLOW_FIRST_ATTEMPT=0.5")  # fmt: skip
    failed, cancelled = read_manifest(sweep_dir)
    log = sweep_dir / cancelled.output_dir / LOG_FILE
    try:
        wait_until("config 1's iteration 2", lambda: log.exists() and "iteration        2/" in log.read_text(errors="replace"),
                   300)  # fmt: skip
        subprocess.run(["scancel", str(cancelled.job_id)], check=True, timeout=30)
        wait_until("status to show one failed, one cancelled",
                   lambda: "0 done, 1 failed, 1 cancelled" in status_table(sweep_dir), 120)  # fmt: skip
        rows = {line.split()[0]: line.split() for line in status_table(sweep_dir).splitlines() if line[:1].isdigit()}
        assert rows["0"][1] == "failed" and rows["1"][1] == "cancelled"
        # The data now exists: config 0's rerun trains, and is not failed while the reruns below run.
        np.arange(1000, dtype=np.uint16).__mod__(500).astype(np.uint16).tofile(tokens)
        lines = _rerun(sweep_dir, "--skip-cancelled").stdout.splitlines()
        assert len(lines) == 2 and lines[0].startswith("rerun: config 0: job "), lines
        assert lines[1] == (f"rerun: left out 1 cancelled config(s) (--skip-cancelled): 1; they stay cancelled (python -m "
                            f"launchers rerun --failed {sweep_dir} without --skip-cancelled resubmits them; python -m launchers "
                            f"status --skip-cancelled {sweep_dir} does not count them as failed)")  # fmt: skip
        second = read_manifest(sweep_dir)
        assert second[0].job_id != failed.job_id and second[1] == cancelled
        # Nothing but the cancelled config is left to rerun: said, nothing resubmitted.
        again = _rerun(sweep_dir, "--skip-cancelled").stdout
        assert again.startswith("rerun: no failed configs; left out 1 cancelled config(s) (--skip-cancelled): 1;"), again
        assert read_manifest(sweep_dir) == second
        # Without the option, the cancelled config goes again (and it alone: config 0 runs or is done).
        assert _rerun(sweep_dir).stdout.startswith("rerun: config 1: job "), "config 1 not resubmitted"
        third = read_manifest(sweep_dir)
        assert third[0] == second[0] and third[1].job_id != cancelled.job_id
    finally:
        jobs = {str(e.job_id).split("_")[0] for e in read_manifest(sweep_dir) if e.job_id}
        subprocess.run(["scancel", *jobs, str(failed.job_id).split("_")[0]], check=False, timeout=30)


def _counting(bin_dir: Path, log: Path) -> dict[str, str]:
    """An environment whose squeue and sacct are the real ones, each call first noted in `log`: how often
    Slurm was asked (it still answers; nothing is made up)."""
    bin_dir.mkdir()
    for name in ("squeue", "sacct"):
        real = shutil.which(name)
        assert real is not None, name
        (bin_dir / name).write_text(f'#!/bin/sh\necho {name} >> "{log}"\nexec "{real}" "$@"\n')
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_status_skip_cancelled_counts_what_rerun_skip_cancelled_left_out_as_no_failure(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """After `rerun --failed --skip-cancelled`, `status` still exited 1 for the cancelled config left out,
    and the rerun asked Slurm a second (and third) time to name what it left out."""
    sweep_dir, asked = tmp_path / "sweep", tmp_path / "asked"
    # Config 0 held, then cancelled: nothing runs. Config 1 is infeasible (1 layer in 2 stages): skipped.
    sweep(sweep_dir, "parallelism.pp=1,2", "+hydra.launcher.sbatch_args.hold=''")
    held, skipped = read_manifest(sweep_dir)
    assert skipped.status == "skipped" and held.job_id is not None
    subprocess.run(["scancel", held.job_id], check=False, timeout=30)  # (another session may have cancelled it)
    wait_until("status to show config 0 cancelled", lambda: " 1 cancelled," in status_table(sweep_dir), 60)
    rerun = subprocess.run([sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed", "--skip-cancelled"],
                           cwd=REPO, capture_output=True, text=True, timeout=120, env=_counting(tmp_path / "bin", asked))  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert rerun.stdout.startswith("rerun: no failed configs; left out 1 cancelled config(s) (--skip-cancelled): 0;")
    assert f"python -m launchers status --skip-cancelled {sweep_dir} does not count them as failed" in rerun.stdout
    assert sorted(asked.read_text().split()) == ["sacct", "squeue"]  # once
    plain = status_cli(str(sweep_dir))
    assert plain.returncode == EXIT_FAILED and "status --skip-cancelled does not count them" in plain.stderr
    skipping = status_cli(str(sweep_dir), "--skip-cancelled")
    assert skipping.returncode == 0, skipping.stdout + skipping.stderr
    assert re.search(r"^0 +cancelled ", skipping.stdout, re.MULTILINE), skipping.stdout  # still shown as it is
    assert skipping.stderr == "status: 1 configs cancelled (scancel), not counted as failed (--skip-cancelled)\n"


def test_rerun_failed_resubmits_refused_configs(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    # Held, so that nothing runs: only what is queued (and refused) matters here. A gres the
    # cluster lacks is refused by sbatch itself as it is queued, the launch not asking sbatch
    # --test-only first (a partition is checked before anything is queued).
    proc = sweep(sweep_dir, "cluster.gres=nosuch:1", "+hydra.launcher.sbatch_args.hold=''",
                 "hydra.launcher.test_only=false", check=False)  # fmt: skip
    assert proc.returncode != 0 and "were refused by sbatch" in proc.stderr
    (first,) = read_manifest(sweep_dir)
    assert first.status == "refused" and first.reason is not None and "generic resource" in first.reason
    table = status_table(sweep_dir)
    assert "1/1 finished: 0 pending, 0 running, 0 done, 0 failed, 1 refused" in table, table

    # Refused again: the launch left sbatch --test-only out (launch.json keeps that), so its rerun does
    # too, and sbatch refuses the config as it is queued. Nothing was resubmitted, which a script must
    # not read as success (it exited 0).
    assert json.loads((sweep_dir / ".megasweep" / "launch.json").read_text())["settings"]["test_only"] is False
    again = subprocess.run([sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == EXIT_FAILED, again.stdout + again.stderr
    assert "asked with sbatch --test-only" not in again.stderr and "Traceback" not in again.stderr
    assert "config 0: refused: sbatch refused: sbatch: error: Invalid generic resource" in again.stdout + again.stderr
    assert "nothing was resubmitted: sbatch refused 1 config(s)" in again.stderr, again.stderr
    (refused,) = read_manifest(sweep_dir)
    assert refused.status == "refused" and refused.index == 0
    # The cause goes away (here: the launch record asks for no gres, as if the site had added
    # it); the config was never run, so `rerun --failed` submits it.
    launch = sweep_dir / ".megasweep" / "launch.json"
    data = json.loads(launch.read_text())
    data["configs"]["0"]["options"]["gres"] = None
    launch.write_text(json.dumps(data))
    proc = subprocess.run(
        [sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (second,) = read_manifest(sweep_dir)
    try:
        assert proc.stdout.startswith("rerun: config 0: job "), proc.stdout
        assert second.status == "submitted" and second.job_id is not None
        assert second.overrides == first.overrides and second.output_dir == first.output_dir
    finally:
        if second.job_id is not None:
            subprocess.run(["scancel", second.job_id.split("_")[0]], timeout=30, check=False)


def status_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launchers", "status", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_status_exits_non_zero_for_failures_and_for_what_is_not_a_sweep(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "plan.csv").write_text("feasible\n")
    for name, words in (("nosuch", "does not exist"), ("empty", "is not a sweep directory"), ("plan", "dry run")):
        proc = status_cli(str(tmp_path / name))
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr and not proc.stdout
    # Hydra's multirun/<date>, which holds sweeps: each is named.
    for time_dir in ("10-00-00", "11-30-00"):
        (tmp_path / "day" / time_dir).mkdir(parents=True)
        write_manifest([], tmp_path / "day" / time_dir / "manifest.jsonl")
    proc = status_cli(str(tmp_path / "day"))
    assert proc.returncode == EXIT_USAGE and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.strip().endswith(f"it holds 2 sweep(s): {tmp_path / 'day' / '10-00-00'}, "
                                        f"{tmp_path / 'day' / '11-30-00'}")  # fmt: skip

    # A local sweep's manifest (no job ids: Slurm is not asked): one done, one failed.
    sweep_dir = tmp_path / "sweep"
    entries = [
        ManifestEntry(index=i, overrides=(f"training.lr={lr}",), output_dir=str(i), status="submitted")
        for i, lr in enumerate((0.1, 0.2))
    ]
    sweep_dir.mkdir()
    write_manifest(entries, sweep_dir / "manifest.jsonl")
    for entry, status in zip(entries, ("ok", "error"), strict=True):
        (sweep_dir / entry.output_dir).mkdir()
        record = {"status": status, "overrides": list(entry.overrides), "message": "boom"}
        (sweep_dir / entry.output_dir / "result.json").write_text(json.dumps(record))
    failed = status_cli(str(sweep_dir))
    assert failed.returncode == EXIT_FAILED and "1 done, 1 failed" in failed.stdout
    assert "1 configs failed" in failed.stderr and "--ok-if-failed" in failed.stderr
    assert status_cli("--ok-if-failed", str(sweep_dir)).returncode == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["statis", "x"], "invalid choice: 'statis' (choose from 'status', 'rerun', 'sbatch', 'calibrate'); did you mean status?"),
        (["status", "x", "--ok-if-faild"], "unrecognized arguments: --ok-if-faild; did you mean --ok-if-failed?"),
        (["status"], "the following arguments are required: sweep_dir (see python -m launchers status --help)"),
        (["sbatch", "--nme", "x", "model=tiny"], "did you mean --name?"),
    ],
)
def test_a_misspelt_command_or_option_is_one_line_with_the_close_one(args: list[str], words: str, tmp_path: Path) -> None:
    # argparse printed its usage block, then the error without a suggestion.
    proc = subprocess.run([sys.executable, "-m", "launchers", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.startswith("error: ") and words in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["status", "rerun"])
def test_status_and_rerun_help_name_every_state_that_fails_status_and_that_rerun_resubmits(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A preempted config exits `status` 1 and `rerun --failed` resubmits it, yet both --help texts left it
    # out of their lists (failed, cancelled, interrupted, refused).
    from launchers.__main__ import main
    from launchers.status import RERUN_STATES

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert [s for s in sorted(RERUN_STATES) if s not in text] == [], text
    if command == "status":
        (exit_1,) = re.findall(r"; 1 when ([^;]*);", text)
        assert [s for s in sorted(RERUN_STATES - {"failed"}) if s not in exit_1] == [], exit_1


def test_a_result_of_another_config_in_a_configs_directory_is_not_its_result(tmp_path: Path) -> None:
    entry = ManifestEntry(index=0, overrides=("training.lr=0.2",), output_dir="0", status="submitted", job_id="9_0")
    write_manifest([entry], tmp_path / "manifest.jsonl")
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "result.json").write_text('{"status": "ok", "overrides": ["training.lr=0.1"]}')
    (status,) = sweep_status(tmp_path, slurm_states={"9_0": "PENDING"})
    assert status.state == "pending" and "0/result.json is another config's (training.lr=0.1)" in status.detail
    # Hydra's own overrides are not recorded by the run, and credentials are recorded scrubbed.
    (tmp_path / "0" / "result.json").write_text('{"status": "ok", "overrides": ["training.lr=0.2"]}')
    assert sweep_status(tmp_path, slurm_states={})[0].state == "done"
    launched = dataclasses.replace(entry, overrides=("training.lr=0.2", "hydra.sweep.subdir=x", "+a.API_KEY=s"))
    write_manifest([launched], tmp_path / "manifest.jsonl")
    (tmp_path / "0" / "result.json").write_text('{"status": "ok", "overrides": ["+a.API_KEY=***", "training.lr=0.2"]}')
    assert sweep_status(tmp_path, slurm_states={})[0].state == "done"


def test_rerun_refuses_hydras_own_keys_as_changes(tmp_path: Path) -> None:
    # Hydra's words for `hydra.launcher.job_name=x` suggested `+hydra.launcher.job_name=x`, which then
    # reran the failed configs as new ones, unchanged, under the old job name.
    for change in ("hydra.launcher.job_name=x", "+hydra.launcher.job_name=x"):
        proc = subprocess.run([sys.executable, "-m", "launchers", "rerun", str(tmp_path), "--failed", change],
                              cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == EXIT_USAGE and proc.stderr.startswith(f"error: {change}: rerun --failed takes"), proc.stderr


def test_rerun_failed_with_overrides_adds_the_changed_configs(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    # Config 0 is refused by sbatch as it is queued (a gres the cluster lacks; no sbatch --test-only
    # first), config 1 is queued; held: nothing runs.
    proc = sweep(sweep_dir, "cluster.gres=nosuch:1,null", "+hydra.launcher.sbatch_args.hold=''",
                 "hydra.launcher.test_only=false", check=False)  # fmt: skip
    assert proc.returncode != 0
    first = read_manifest(sweep_dir)
    assert [e.status for e in first] == ["refused", "submitted"]

    def rerun(*changes: str, readme_order: bool = False) -> subprocess.CompletedProcess[str]:
        # The README writes `rerun DIR --failed field=value`, where argparse alone leaves the overrides
        # after the option unparsed ("unrecognized arguments"); both orders must work.
        where = [str(sweep_dir), "--failed"] if readme_order else ["--failed", str(sweep_dir)]
        return subprocess.run(
            [sys.executable, "-m", "launchers", "rerun", *where, *changes],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    bad = rerun("parallelism.tpp=2")
    assert bad.returncode == EXIT_USAGE and "did you mean parallelism.tp" in bad.stderr, bad.stderr
    assert read_manifest(sweep_dir) == first

    done = rerun("cluster.gres=null", "training.train_iters=5", readme_order=True)
    entries = read_manifest(sweep_dir)
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("rerun: config 2 (rerun of config 0): job "), done.stdout
        assert entries[:2] == first  # the failed config stays as it was; nothing is renamed
        added = entries[2]
        assert (added.index, added.output_dir, added.status, added.rerun_of) == (2, "2", "submitted", 0)
        assert added.overrides[-2:] == ("cluster.gres=null", "training.train_iters=5")
        assert "cluster.gres=nosuch:1" not in added.overrides and "training.train_iters=3" not in added.overrides
        # Its rerun stands for the refused config: status no longer fails, and no second rerun.
        table = status_cli(str(sweep_dir))
        assert table.returncode == unfinished_exit(table.stdout), table.stdout + table.stderr
        assert "rerun as config 2: " in table.stdout
        unapplied = rerun("training.train_iters=7")
        assert unapplied.returncode == EXIT_USAGE and unapplied.stderr.strip() == (
            "rerun: no failed configs to rerun: each failed one is rerun already (config 0 as config 2); "
            "training.train_iters=7 not applied: rerun those configs' failures to change them"
        )
    finally:
        subprocess.run(["scancel", *sorted({e.job_id.split("_")[0] for e in entries if e.job_id})], timeout=30)


def test_a_changed_rerun_spells_its_changes_as_a_sweep_does() -> None:
    # A rerun's `training.lr=1e-4` was kept as typed, where a sweep or a dry run of the same config lists
    # `training.lr=0.0001`: the analysis then showed the dry run's row as a second config, never launched.
    from conf import CONFIG_DIR
    from launchers.compose import FastComposer
    from launchers.status import changed_overrides

    old = ("training.lr=0.0003", "model=tiny", "cluster.gres=nosuch:1")
    assert changed_overrides(old, ["training.lr=1e-4", "cluster.gres=null", "~logger.tensorboard"]) == (
        "model=tiny", "training.lr=0.0001", "cluster.gres=null", "~logger.tensorboard")  # fmt: skip
    swept = run_train_expand("training.lr=1e-4")
    assert changed_overrides((), ["training.lr=1e-4"]) == (swept,)
    # A key the sweep added (`+cluster.env.X`, as cluster.env's variables are given) stays added when changed,
    # and goes with its addition when deleted: both were refused, the `+` dropped with the old override.
    added = ("model=tiny", "+cluster.env.MEGASWEEP_FAULT_EXIT=0:2")
    assert changed_overrides(added, ["cluster.env.MEGASWEEP_FAULT_EXIT=none"]) == (
        "model=tiny", "+cluster.env.MEGASWEEP_FAULT_EXIT=none")  # fmt: skip
    assert changed_overrides(added, ["~cluster.env.MEGASWEEP_FAULT_EXIT"]) == ("model=tiny",)
    assert changed_overrides(added, ["++cluster.env.MEGASWEEP_FAULT_EXIT=1"]) == (
        "model=tiny", "++cluster.env.MEGASWEEP_FAULT_EXIT=1")  # fmt: skip
    # `++` (a key the base may hold already): a change keeps its `++`, a deletion deletes.
    forced = ("model=tiny", "cluster=generic_gpu", "++cluster.env.NCCL_DEBUG=INFO")
    assert changed_overrides(forced, ["cluster.env.NCCL_DEBUG=WARN"])[-1] == "++cluster.env.NCCL_DEBUG=WARN"
    assert changed_overrides(forced, ["~cluster.env.NCCL_DEBUG"])[-1] == "~cluster.env.NCCL_DEBUG"
    for overrides in (changed_overrides(added, ["cluster.env.MEGASWEEP_FAULT_EXIT=none"]),
                      changed_overrides(added, ["~cluster.env.MEGASWEEP_FAULT_EXIT"]),
                      changed_overrides(forced, ["cluster.env.NCCL_DEBUG=WARN"]),
                      changed_overrides(forced, ["~cluster.env.NCCL_DEBUG"])):  # fmt: skip
        assert FastComposer.from_config_dir(CONFIG_DIR).run_config(list(overrides)).model.name == "tiny"


def run_train_expand(text: str) -> str:
    """The override of the one job Hydra's basic sweeper makes of `text` (hydra.BasicSweeper.split_arguments)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    from launchers.compose import parse_override

    ((job,),) = BasicSweeper.split_arguments([parse_override(text)], None)
    (override,) = job
    return str(override)


def test_a_changed_rerun_of_several_launches_is_judged_whole_before_any_is_queued(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    # Two launches of one sweep (the second keeps off every node but the first), both cancelled; rerun
    # on two nodes each: the first launch's config was queued, then the second's refused, "Nothing was
    # submitted", and naming a config index never given.
    sweep_dir = tmp_path / "sweep"
    others = ",".join(slurm_cluster.nodes[1:])
    try:
        sweep(sweep_dir, "training.lr=1e-4", "+hydra.launcher.sbatch_args.hold=''", "hydra.launcher.job_name=judged")
        sweep(sweep_dir, "training.lr=2e-4", "+hydra.launcher.sbatch_args.hold=''", "hydra.launcher.job_name=judged",
              f"+hydra.launcher.sbatch_args.exclude='{others}'", "hydra.launcher.append=true")  # fmt: skip
        subprocess.run(["scancel", "--name=judged"], timeout=30, check=True)
        wait_until("both configs to be cancelled", lambda: "2 cancelled" in status_table(sweep_dir), 120)
        before = read_manifest(sweep_dir)
        proc = subprocess.run(
            [sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed", "hardware.devices_per_node=1",
             "parallelism.dp=2", "parallelism.global_batch_size=2"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        queued = subprocess.run(["squeue", "-h", "-n", "judged"], capture_output=True, text=True, timeout=30).stdout
    finally:
        subprocess.run(["scancel", "--name=judged"], timeout=30, check=False)
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: Slurm refuses 1 job(s) (asked with sbatch --test-only, which queues "
                                  "nothing): config(s) 1 (2 node(s) x 1 task(s)"), proc.stderr  # fmt: skip
    assert "Nothing was submitted" in proc.stderr and queued.strip() == ""
    # A site whose --test-only misjudges its own sbatch has a way past the check.
    assert "--no-test-only leaves this check out" in proc.stderr
    assert read_manifest(sweep_dir) == before


def test_each_run_keeps_its_log_and_status_names_the_failed_ones(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "sweep"
    # Config 0 trains; config 1's trainer fails on a missing token file, with its traceback in its log.
    sweep(sweep_dir, "training.data_path=null,/nonexistent/tokens.bin", "hydra.launcher.wait=true", check=False)
    entries = read_manifest(sweep_dir)
    ok_log, failed_log = (sweep_dir / e.output_dir / LOG_FILE for e in entries)
    text = ok_log.read_text()
    assert "iteration        3/       3 |" in text and "result: " in text
    assert not list(sweep_dir.glob("*/__main__.log"))  # Hydra's empty file is gone
    assert "nonexistent" in failed_log.read_text()
    table = status_table(sweep_dir)
    assert f"log of failed config 1: {failed_log}" in table.splitlines()
    assert "log of failed config 0" not in table

    # A job that fails before the trainer starts (srun refuses an option): Slurm's own log is the one.
    early = tmp_path / "early"
    sweep(early, "hydra.launcher.srun_args=[--no-such-srun-option]", check=False)
    (entry,) = read_manifest(early)
    wait_until("status to show the job failed", lambda: "1 failed" in status_table(early), 60)
    line = next(x for x in status_table(early).splitlines() if x.startswith("log of failed config 0: "))
    slurm_log = Path(line.split(": ", 1)[1])
    assert slurm_log.parent == early / SUBMITIT_DIR / str(entry.job_id)
    assert "no-such-srun-option" in slurm_log.read_text()


def test_a_record_set_aside_never_replaces_an_earlier_one(tmp_path: Path) -> None:
    # A local config has no job id: its reruns' earlier records are numbered, not overwritten.
    from launchers.status import _aside

    first = tmp_path / "result.previous.json"
    assert _aside(first) == first
    first.write_text("{}")
    assert _aside(first) == tmp_path / "result.previous.2.json"


def test_an_infeasible_changed_rerun_does_not_stand_for_the_failed_config(tmp_path: Path) -> None:
    # A local sweep whose one config fails before writing a record (an interpreter that exits at once).
    sweep_dir = tmp_path / "sweep"
    subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=local", "hydra.launcher.python=/bin/false",
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["failed"]

    def rerun(*changes: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "launchers", "rerun", "--failed", str(sweep_dir), *changes],
                              cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip

    # tp=3 divides none of the model's widths: the changed config is refused by the rules, nothing runs,
    # and nothing is written (each such try added the refused config to the manifest again).
    manifest = (sweep_dir / "manifest.jsonl").read_bytes()
    for _ in range(2):
        refused = rerun("parallelism.tp=3")
        assert refused.returncode == EXIT_USAGE, refused.stdout + refused.stderr
        assert refused.stderr.startswith("error: every changed config is infeasible, so nothing was resubmitted or "
                                         "written, and the failed configs stay failed: config 0 with parallelism.tp=3: "
                                         "infeasible"), refused.stderr  # fmt: skip
        assert "[heads_divisible_by_tp]" in refused.stderr and "Traceback" not in refused.stderr
        assert (sweep_dir / "manifest.jsonl").read_bytes() == manifest
    statuses = sweep_status(sweep_dir, slurm_states={})
    assert [s.state for s in statuses] == ["failed"]
    # The failure still stands: status exits non-zero on it, and the next rerun takes it again.
    assert [s.index for s in unresolved_failures(statuses)] == [0]
    table = status_cli(str(sweep_dir))
    assert table.returncode == EXIT_FAILED and "1 configs failed" in table.stderr, table.stdout + table.stderr
    again = rerun("training.lr=1e-3")
    assert "rerun: config 1 (rerun of config 0): ran here" in again.stdout, again.stdout + again.stderr


def test_a_rerun_keeps_each_configs_layout_in_its_manifest_entry(tmp_path: Path) -> None:
    # The launch record keeps no layout: a plain rerun takes its config's from its manifest entry, a
    # changed one composes its own; a config launched before entries kept layouts reruns without one.
    sweep_dir = tmp_path / "sweep"
    subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, "training.lr=1e-4,2e-4", "hydra/launcher=local",
         "hydra.launcher.python=/bin/false", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    launched = read_manifest(sweep_dir)
    assert [(e.status, e.layout["tp"], e.layout["micro_batch_size"]) for e in launched] == [("failed", 1, 1)] * 2
    # Config 1 as a manifest written before layouts has it.
    write_manifest([launched[0], dataclasses.replace(launched[1], layout={})], sweep_dir / "manifest.jsonl")

    def rerun(*changes: str) -> None:
        proc = subprocess.run([sys.executable, "-m", "launchers", "rerun", "--failed", str(sweep_dir), *changes],
                              cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert "Traceback" not in proc.stderr and "ran here" in proc.stdout, proc.stdout + proc.stderr

    rerun()
    again = read_manifest(sweep_dir)
    assert [(e.status, e.layout) for e in again] == [("failed", launched[0].layout), ("failed", {})]
    rerun("parallelism.micro_batch_size=2")
    changed = read_manifest(sweep_dir)[2:]
    assert [(e.rerun_of, e.layout["micro_batch_size"]) for e in changed] == [(0, 2), (1, 2)]
    assert {k: v for k, v in changed[0].layout.items() if k != "micro_batch_size"} == {
        k: v for k, v in launched[0].layout.items() if k != "micro_batch_size"
    }


def test_a_changed_rerun_never_writes_into_another_configs_directory(tmp_path: Path) -> None:
    # The sweep's own subdir names config 0's directory "2", the index the changed rerun's new config
    # gets: its job wrote over config 0's result.json, and status then called config 0 pending for ever.
    # Both configs' runs end at once (an interpreter that exits), and both are rerun: something lies in
    # config 0's directory "2" (a record from before, put there by hand).
    sweep_dir = tmp_path / "sweep"
    launched = subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=local", "hydra.launcher.python=/bin/false",
         "parallelism.micro_batch_size=2,1", "hydra.sweep.subdir=${parallelism.micro_batch_size}",
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launched.returncode == EXIT_FAILED, launched.stdout + launched.stderr
    config0, _ = read_manifest(sweep_dir)
    assert [e.output_dir for e in read_manifest(sweep_dir)] == ["2", "1"]
    (sweep_dir / "2").mkdir(exist_ok=True)
    (sweep_dir / "2" / RESULT_FILE).write_text(json.dumps({"status": "ok", "overrides": list(config0.overrides)}))
    rerun = subprocess.run([sys.executable, "-m", "launchers", "rerun", "--failed", str(sweep_dir), "training.lr=2e-4"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "rerun: config 2 (rerun of config 0): ran here" in rerun.stdout, rerun.stdout + rerun.stderr
    # Config 2's index names a directory taken; config 3's is free.
    assert [e.output_dir for e in read_manifest(sweep_dir)] == ["2", "1", "rerun2", "3"]


def test_a_changed_rerun_plans_each_launchs_configs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two launches into one sweep, each of two configs whose runs end at once (an interpreter that exits).
    # A changed rerun planned every launch's configs three times (to refuse an all-infeasible rerun, to
    # judge them with sbatch, and to queue them), each a composition and a run of the rules.
    sweep_dir = tmp_path / "sweep"
    # Two interpreters' paths, so that the launches' settings differ (launch.json keeps one per launch).
    for lrs, python, more in (("1e-4,2e-4", "/bin/false", ()), ("3e-4,4e-4", "/usr/bin/false", ("hydra.launcher.append=true",))):
        subprocess.run([sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=local", f"hydra.launcher.python={python}",
                        f"training.lr={lrs}", *more, f"hydra.sweep.dir={sweep_dir}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["failed"] * 4
    import launchers.status

    planned: list[int] = []
    real = launchers.status.plan_configs

    def counted(composer: object, job_overrides: list[list[str]], *args: object, **kwargs: object) -> object:
        planned.append(len(job_overrides))
        return real(composer, job_overrides, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(launchers.status, "plan_configs", counted)
    entries = launchers.status.rerun_failed(sweep_dir, ["parallelism.micro_batch_size=1"])
    assert planned == [2, 2]
    assert [(e.index, e.rerun_of, e.output_dir) for e in entries] == [(4, 0, "4"), (5, 1, "5"), (6, 2, "6"), (7, 3, "7")]
    assert all("parallelism.micro_batch_size=1" in e.overrides for e in entries)


def test_a_rerun_goes_the_way_each_config_was_launched_when_a_sweep_was_appended_to(tmp_path: Path) -> None:
    """launch.json kept one `settings`, the last launch's: a config of the first launch reran with the
    interpreter (or --config-dir, sbatch options, Slurm or this machine) of the one appended after it."""
    sweep_dir, calls = tmp_path / "sweep", tmp_path / "calls"
    # The first launch's interpreter: it fails its first call, then runs Python; it logs every call.
    first = tmp_path / "first-python"
    first.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n[ "$(wc -l < {calls})" -gt 1 ] || exit 1\nexec {sys.executable} "$@"\n')
    first.chmod(0o755)

    def launch(*overrides: str) -> None:
        subprocess.run([sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=local", *overrides,
                        f"hydra.sweep.dir={sweep_dir}"], cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip

    launch("training.lr=1e-4", f"hydra.launcher.python={first}")
    launch("training.lr=2e-4", "hydra.launcher.append=true")  # this interpreter
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["failed", "done"]
    rerun = subprocess.run([sys.executable, "-m", "launchers", "rerun", "--failed", str(sweep_dir)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert rerun.returncode == 0 and "rerun: config 0: ran here" in rerun.stdout, rerun.stdout + rerun.stderr
    assert len(calls.read_text().splitlines()) == 2  # config 0 ran again through its own launch's interpreter
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["done", "done"]
    launches = json.loads((sweep_dir / LAUNCH_FILE).read_text())
    assert [launch["python"] for launch in launches["launches"]] == [str(first), sys.executable]
    assert {i: c["launch"] for i, c in launches["configs"].items()} == {"0": 0, "1": 1}


def test_a_requeued_job_is_pending_not_failed_and_its_resumed_run_is_the_record(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """`scontrol requeue` of running jobs (as a preemption with PreemptMode=REQUEUE does).

    Without checkpoints (config 0) the stopped attempt's `timeout` record stays while the job waits to
    run again: status called the config failed then, and `rerun --failed` would have queued a second
    run into the directory the requeued one uses. With checkpoints (config 1) the in-job wrapper's own
    `scontrol requeue` finds the job requeued already: it failed with a traceback and put the stopped
    attempt's record back as result.json; it keeps it as result.attempt0.json, as for its own requeue."""
    sweep_dir = tmp_path / "sweep"
    # The first attempts sleep 1 s per iteration (the requeued ones run at full speed); config 1
    # checkpoints only when Slurm stops it.
    sweep(sweep_dir, "training.train_iters=8", "training.save_interval=0,100",
          "+cluster.env.MEGASWEEP_FAULT_SLOW_FIRST_ATTEMPT=1")  # fmt: skip
    entries = read_manifest(sweep_dir)
    jobs = [str(e.job_id) for e in entries]
    logs = [sweep_dir / e.output_dir / LOG_FILE for e in entries]
    try:
        wait_until(
            "iteration 2 of both",
            lambda: all(p.exists() and "iteration        2/" in p.read_text(errors="replace") for p in logs),
        )
        subprocess.run(["scontrol", "requeue", *jobs], check=True, timeout=30)
        wait_until(
            "config 0's stopped attempt's record",
            lambda: (result(sweep_dir, entries[0]) or {}).get("status") == "timeout",
            timeout=60,
        )
        waiting = sweep_status(sweep_dir)[0]
        if waiting.slurm_state and waiting.slurm_state.startswith("PENDING"):
            assert waiting.state == "pending" and waiting.detail.startswith("requeued (PENDING"), waiting
        assert waiting.state in ("pending", "running"), waiting
        assert not unresolved_failures([waiting])
        wait_until("the requeued attempts' records",
                   lambda: all((result(sweep_dir, e) or {}).get("status") == "ok" for e in entries))  # fmt: skip
    finally:
        subprocess.run(["scancel", *jobs], check=False, timeout=30)
    from_scratch, resumed = (result(sweep_dir, e) or {} for e in entries)
    assert "resumed_from_step" not in from_scratch and from_scratch["iterations_run"] == 8
    assert resumed["resumed_from_step"] >= 2 and len(resumed["losses"]) == 8
    stopped = json.loads((sweep_dir / entries[1].output_dir / "result.attempt0.json").read_text())
    assert stopped["status"] == "timeout" and stopped["iterations_run"] == resumed["resumed_from_step"]
    slurm_log = (sweep_dir / SUBMITIT_DIR / jobs[1] / f"{jobs[1]}_0_log.out").read_text(errors="replace")
    assert f"{jobs[1]} runs again (requeue 1" in slurm_log and "Traceback" not in slurm_log, slurm_log
    wait_until("status to show both done", lambda: "2 done, 0 failed" in status_table(sweep_dir), 30)

def test_a_pending_array_task_cancelled_is_cancelled_not_pending_forever_nor_failed(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """scancel of one pending task of an array leaves no trace in squeue or sacct: status called the
    config pending for ever (and `rerun --failed` never resubmitted it), then `failed` ("cancelled while
    pending?"), though Slurm still knew its array: it was cancelled, as its siblings are once scancel
    takes the whole array."""
    sweep_dir = tmp_path / "sweep"
    # Slurm forgets only a task cancelled while the whole array is still pending: it is then split off
    # the array's record and never accounted. Cancelled after the first task has started, the pending
    # rest is the array's own record, and squeue and sacct show it CANCELLED for good (Slurm 22.05,
    # checked here). The array is submitted held, so that no task can start before the scancel: a
    # plain submission raced the scheduler (CI, 2026-11-26: the first task started before the scancel).
    sweep(sweep_dir, "training.lr=1e-4,2e-4", "hydra.launcher.array_parallelism=1",
          "+hydra.launcher.sbatch_args.hold=")  # fmt: skip
    first, second = read_manifest(sweep_dir)
    array = str(first.job_id).split("_")[0]
    try:
        subprocess.run(["scancel", str(second.job_id)], check=True, timeout=30)
        job = str(second.job_id)
        wait_until("Slurm to forget the cancelled task", lambda: read_states([job]).get(job) == FORGOTTEN, 30)
        statuses = sweep_status(sweep_dir)
        assert statuses[1].state == "cancelled", statuses[1]
        assert statuses[1].detail.startswith("cancelled while pending: Slurm forgot the task"), statuses[1]
        assert statuses[0].state == "pending", statuses[0]
        # Cancelled, it is `rerun --failed`'s to queue again, and `--skip-cancelled`'s to leave out.
        assert [s.index for s in unresolved_failures(statuses)] == [1]
        subprocess.run(["scancel", array], check=True, timeout=30)
        wait_until("the array's other task to end",
                   lambda: is_cancelled(read_states([str(first.job_id)]).get(str(first.job_id), "")), 30)  # fmt: skip
        assert [(s.state, s.index) for s in sweep_status(sweep_dir)] == [("cancelled", 0), ("cancelled", 1)]
        table = status_table(sweep_dir)
        assert "2 cancelled" in table and "cancelled while pending: Slurm forgot the task" in table, table
        # The analysis says what status says, in its own words.
        df = load_sweeps([sweep_dir]).table.set_index("manifest_index")
        assert df["outcome"].tolist() == ["cancelled", "cancelled"] and df.loc[1, "queue_state"] == FORGOTTEN
    finally:
        subprocess.run(["scancel", array], check=False, timeout=30)
    # A job id a cluster never had is as unknown, and so is a task of an array it never had; Slurm not
    # answering (no sacct, no squeue) is not.
    assert read_states(["99999999", "99999999_1"]) == {"99999999": GONE, "99999999_1": GONE}


def test_a_moved_sweep_directory_is_named_as_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An exported sweep's launch record says where its tasks write (--sweep-dir); moved before they
    # start, its configs waited (or failed) here without a word of why.
    monkeypatch.chdir(tmp_path)
    export_sweep([*TINY, "training.lr=1e-4,2e-4"], name="m", out_dir=Path("scripts"), sweep_dir=Path("sweep"))
    assert [s.detail for s in sweep_status(tmp_path / "sweep", slurm_states={})] == [
        "no job started yet (exported to " + str(tmp_path / "scripts" / "m.sbatch") + f", array task {i})"
        for i in (0, 1)
    ]
    # Read through a symbolic link, it is the same directory.
    (tmp_path / "link").symlink_to(tmp_path / "sweep")
    assert all(s.launched_in is None for s in sweep_status(tmp_path / "link", slurm_states={}))

    (tmp_path / "sweep").rename(tmp_path / "moved")
    statuses = sweep_status(tmp_path / "moved", slurm_states={})
    old = str(tmp_path / "sweep")
    assert [(s.state, s.launched_in) for s in statuses] == [("pending", old), ("pending", old)]
    assert statuses[0].detail.startswith(f"sweep directory moved: its job was given {old}, which no longer exists")
    table = format_status(statuses)
    assert f"sweep directory moved: the jobs of 2 config(s) (0, 1) were launched into {old} and write" in table
    assert f"move this directory back to {old}" in table

    # A job that failed (a job id recorded as a task records it, and Slurm's state) with no record
    # here: its detail and its log line say where its record and log were to go.
    (tmp_path / "moved" / EXPORTED_JOBS_DIR).mkdir(parents=True)
    (tmp_path / "moved" / EXPORTED_JOBS_DIR / "0").write_text("9_0\n")
    failed = sweep_status(tmp_path / "moved", slurm_states={"9_0": "FAILED"})[0]
    assert failed.state == "failed" and failed.detail.endswith("; Slurm state FAILED, no result.json"), failed
    table = format_status([failed])
    assert f"log of failed config 0: none found here (its job was to write it under {old}: see above)" in table

    # A copy: the jobs write into the original, which is there.
    shutil.copytree(tmp_path / "moved", tmp_path / "sweep")
    copied = sweep_status(tmp_path / "moved", slurm_states={})
    assert copied[0].detail.startswith(f"sweep directory copied or moved: its job writes under {old}, not here")
    assert f"Their results land in {old}" in format_status(copied)
    assert all(s.launched_in is None for s in sweep_status(tmp_path / "sweep", slurm_states={}))


def test_jobs_of_a_sweep_moved_while_queued_fail_and_status_says_why(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    # Slurm cannot open a moved sweep's job output (<sweep dir>/.submitit/...): each job fails before
    # anything of it runs (FAILED 0:53), so no record and no log: status said only that.
    sweep_dir, moved = tmp_path / "sweep", tmp_path / "moved"
    sweep(sweep_dir, "training.lr=1e-4,2e-4", "+hydra.launcher.sbatch_args.hold=''")
    jobs = [str(e.job_id) for e in read_manifest(sweep_dir)]
    sweep_dir.rename(moved)
    try:
        subprocess.run(["scontrol", "release", *jobs], check=True, timeout=30)
        wait_until("both jobs to fail", lambda: [s.state for s in sweep_status(moved)] == ["failed", "failed"], 120)
    finally:
        subprocess.run(["scancel", *jobs], check=False, timeout=30)
    proc = status_cli(str(moved))
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    assert f"sweep directory moved: the jobs of 2 config(s) (0, 1) were launched into {sweep_dir} and write" in proc.stdout
    assert f"move this directory back to {sweep_dir}" in proc.stdout, proc.stdout
    for index in (0, 1):
        assert f"log of failed config {index}: none found here (its job was to write it under {sweep_dir}" in proc.stdout
    statuses = sweep_status(moved)
    assert all(s.detail.startswith(f"sweep directory moved: its job was given {sweep_dir}") for s in statuses)
    assert all(s.detail.endswith("Slurm state FAILED, no result.json") for s in statuses), statuses
    assert not sweep_dir.exists()


def test_status_names_the_log_of_the_job_that_failed_not_an_earlier_ones(tmp_path: Path) -> None:
    # A rerun's job 200_0 died before its trainer wrote to the run's log: status named 0/train.log,
    # which holds job 100_0's attempt only, not the Slurm output that says why 200_0 failed.
    from launchers.status import run_log

    entry = ManifestEntry(index=0, overrides=(), output_dir="0", status="submitted", job_id="200_0")
    (tmp_path / "0").mkdir()
    own = tmp_path / "0" / LOG_FILE
    own.write_text("megasweep: 2026-11-27T00:00:00+00:00 (100_0): python -m train\niteration 1\n")
    slurm = tmp_path / SUBMITIT_DIR / "200_0" / "200_0_0_log.out"
    slurm.parent.mkdir(parents=True)
    slurm.write_text("srun: error: exec failed\n")
    assert run_log(tmp_path, entry) == slurm
    own.write_text(own.read_text() + "megasweep: 2026-11-27T01:00:00+00:00 (200_0): python -m train\n")
    assert run_log(tmp_path, entry) == own  # its own attempt is there now
    own.write_text("iteration 1\n")  # a log from before the header: the run's own
    assert run_log(tmp_path, entry) == own


def test_a_plain_rerun_puts_the_earlier_jobs_oom_reports_and_attempt_records_aside(tmp_path: Path) -> None:
    # Left in place, the new run read the old OOM report as its own (any failure became `oom`), and its
    # own stopped attempt found result.attempt0.json taken (launchers.job kept nothing).
    sweep_dir = tmp_path / "sweep"
    subprocess.run([sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=local", "hydra.launcher.python=/bin/false",
                    f"hydra.sweep.dir={sweep_dir}"], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    run_dir = sweep_dir / "0"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "oom.rank0.json").write_text("{}")
    (run_dir / "result.attempt0.json").write_text("{}")
    subprocess.run([sys.executable, "-m", "launchers", "rerun", "--failed", str(sweep_dir)],
                   cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert not (run_dir / "oom.rank0.json").exists() and not (run_dir / "result.attempt0.json").exists()
    assert (run_dir / "previous.oom.rank0.json").exists() and (run_dir / "previous.result.attempt0.json").exists()


def test_an_unreadable_manifest_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    # Another user's sweep (mode 600): a PermissionError traceback, exit 1 (the code for failed configs).
    sweep_dir = Path("/tmp") / f"megasweep-unreadable-{os.getpid()}"
    shutil.rmtree(sweep_dir, ignore_errors=True)
    sweep_dir.mkdir(mode=0o755)
    try:
        (sweep_dir / "manifest.jsonl").write_text("{}\n")
        (sweep_dir / "manifest.jsonl").chmod(0o600)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        for command in (["status", str(sweep_dir)], ["rerun", str(sweep_dir), "--failed"]):
            proc = subprocess.run([*nobody, sys.executable, "-m", "launchers", *command],
                                  cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
            assert proc.returncode == EXIT_USAGE, proc.stderr
            assert "manifest.jsonl: cannot be read (Permission denied)" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        shutil.rmtree(sweep_dir, ignore_errors=True)


def test_the_commands_help_gives_exit_statuses_as_numbers() -> None:
    # `python -m launchers --help` named them EXIT_FAILED, EXIT_USAGE...: a script's author needs the numbers.
    import launchers.__main__ as cli
    from train.contract import EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE

    doc = cli.__doc__ or ""
    for code, name in ((EXIT_FAILED, "EXIT_FAILED"), (EXIT_INTERRUPTED, "EXIT_INTERRUPTED"), (EXIT_USAGE, "EXIT_USAGE"),
                       (EXIT_BROKEN_PIPE, "EXIT_BROKEN_PIPE")):  # fmt: skip
        assert f"{code} ({name})" in doc, name


def test_a_rerun_given_a_sweep_value_says_to_launch_a_sweep(tmp_path: Path) -> None:
    # It said "one config takes one value (sweep with -m)", a flag rerun does not take.
    proc = subprocess.run([sys.executable, "-m", "launchers", "rerun", str(tmp_path), "--failed", "training.seed=3,4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE and proc.stderr.startswith(
        "error: training.seed=3,4: rerun --failed gives each failed config one value per field changed"
    ), proc.stderr


def test_a_changed_rerun_naming_an_option_no_group_has_is_one_line(tmp_path: Path) -> None:
    # A launch may have its own config directory, so only composing finds it: Hydra's thirty lines.
    sweep_dir = tmp_path / "sweep"
    subprocess.run([sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=local", "hydra.launcher.python=/bin/false",
                    f"hydra.sweep.dir={sweep_dir}"], cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed", "model=gpt_13bb"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: model=gpt_13bb is not a model config; did you mean gpt_13b"), proc.stderr
    assert proc.stderr.count("\n") == 1
    assert [e.status for e in read_manifest(sweep_dir)] == ["failed"]  # nothing queued


def test_status_says_which_pending_configs_no_wait_will_start(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    # A held job read "pending  PENDING (JobHeldUser)", as a wait that ends by itself.
    sweep_dir = tmp_path / "sweep"
    sweep(sweep_dir, "training.lr=1e-3,2e-3", "+hydra.launcher.sbatch_args.hold=''")
    jobs = [e.job_id for e in read_manifest(sweep_dir)]
    try:
        text = status_table(sweep_dir)
        assert f"2 pending config(s) will not start as things stand: 0 (job {jobs[0]}), 1 (job {jobs[1]}); " \
               "squeue says JobHeldUser: held; `scontrol release <job>` lets it start. Otherwise scancel them, " \
               f"then `python -m launchers rerun --failed {sweep_dir}`" in text, text
        assert text.splitlines()[-1].startswith("[....")  # the bar stays the last line
    finally:
        subprocess.run(["scancel", *{str(j).split("_")[0] for j in jobs}], timeout=60, check=False)


def test_a_changed_rerun_whose_configs_would_share_a_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    # Two failed configs (two lrs) rerun into one training.checkpoint_dir: the second resumed from the first.
    sweep_dir = tmp_path / "sweep"
    subprocess.run([sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=local", "hydra.launcher.python=/bin/false",
                    "training.lr=1e-4,3e-4", f"hydra.sweep.dir={sweep_dir}"],
                   cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    before = (sweep_dir / "manifest.jsonl").read_text()
    proc = subprocess.run([sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed",
                           f"training.checkpoint_dir={tmp_path / 'ckpt'}", "training.save_interval=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: the rerun of config 0 (") and ") and the rerun of config 1 (" in proc.stderr
    assert "; nothing was rerun. Leave training.checkpoint_dir out of the changes" in proc.stderr
    assert (sweep_dir / "manifest.jsonl").read_text() == before


def test_status_exits_unfinished_while_configs_are_pending_and_wait_waits_them_out(tmp_path: Path) -> None:
    # `status` exited 0 for a sweep still under way, as for one that was over: a script could not tell.
    import signal
    import time

    entries = [ManifestEntry(index=i, overrides=(f"training.lr={lr}",), output_dir=str(i), status="exported")
               for i, lr in enumerate((0.1, 0.2))]  # fmt: skip
    write_manifest(entries, tmp_path / "manifest.jsonl")

    def finish(entry: ManifestEntry) -> None:
        (tmp_path / entry.output_dir).mkdir(exist_ok=True)
        record = {"status": "ok", "overrides": list(entry.overrides), "message": None}
        (tmp_path / entry.output_dir / RESULT_FILE).write_text(json.dumps(record))

    finish(entries[0])
    proc = status_cli(str(tmp_path))
    assert proc.returncode == EXIT_UNFINISHED, proc.stdout + proc.stderr
    assert "1/2 finished: 1 pending" in proc.stdout
    assert proc.stderr == ("status: 1 configs still pending or running (--wait waits for them); 1 of them exported "
                           "and never started: submit their script with sbatch (their detail names it)\n")  # fmt: skip
    # --ok-if-failed is about failures: a sweep under way is still unfinished.
    assert status_cli("--ok-if-failed", str(tmp_path)).returncode == EXIT_UNFINISHED

    def wait() -> subprocess.Popen[str]:
        # SIGINT as a terminal delivers it: a pytest-xdist worker's children inherit it ignored.
        return subprocess.Popen([sys.executable, "-m", "launchers", "status", "--wait", "--poll", "1", str(tmp_path)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip

    # Ctrl-C stops the waiting, not the sweep: exit 130, one line, no table, no traceback.
    waiting = wait()
    assert waiting.stderr is not None
    first = waiting.stderr.readline()
    assert first.startswith("status: waiting for 1 of 2 configs (0 running, 1 pending, 1 of them exported and not "
                            "started); asking every 1 s [0:00:00 waited]"), first  # fmt: skip
    waiting.send_signal(signal.SIGINT)
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == EXIT_INTERRUPTED and not out, out + err
    assert err == f"status: stopped waiting (python -m launchers status {tmp_path} shows where it is)\n"

    # The config ends while status waits: the wait ends with the table and exit 0, having said its
    # waiting line once (the counts did not change meanwhile).
    waiting = wait()
    time.sleep(2.5)  # several polls
    assert waiting.poll() is None
    finish(entries[1])
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, out + err
    assert out.splitlines()[-1].endswith("2/2 finished: 0 pending, 0 running, 2 done, 0 failed, 0 refused, 0 skipped")
    assert err.count("status: waiting for 1 of 2 configs") == 1 and len(err.splitlines()) == 1, err


_LAUNCHING = """
import sys, time
from launchers.sweepdir import sweep_lock
from train.contract import ManifestEntry, write_manifest
with sweep_lock(sys.argv[1]):  # as a launch holds it from planning its configs until the manifest lists them
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    write_manifest([ManifestEntry(0, ("a=1",), "0", "skipped", reason="infeasible")], sys.argv[1] + "/manifest.jsonl")
"""


def test_status_wait_waits_for_a_launch_that_holds_the_sweep_to_list_its_configs(tmp_path: Path) -> None:
    # A script polling a launch it has just started exited 2 at once: the launch lists its configs only
    # after planning them and queueing the first array, holding the sweep's lock meanwhile.
    for name, manifest in (("none", False), ("empty", True)):
        sweep_dir = tmp_path / name
        sweep_dir.mkdir()
        if manifest:
            write_manifest([], sweep_dir / "manifest.jsonl")
        launch = subprocess.Popen([sys.executable, "-c", _LAUNCHING, str(sweep_dir), "3"], cwd=REPO,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert launch.stdout is not None and launch.stdout.readline() == "locked\n"
        proc = status_cli("--wait", "--poll", "1", str(sweep_dir))
        assert launch.wait(timeout=30) == 0
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout + proc.stderr
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"status: waiting for a launch to list its configs in {sweep_dir} (") and \
            f"pid {launch.pid}: " in line and line.endswith("asking every 1 s [0:00:00 waited]"), line
    # A launch killed before it listed any: its line stays in the lock file, its lock went with it. The
    # wait ends at once, as where no launch ever was (nothing would list configs there).
    sweep_dir = tmp_path / "killed"
    sweep_dir.mkdir()
    write_manifest([], sweep_dir / "manifest.jsonl")
    launch = subprocess.Popen([sys.executable, "-c", _LAUNCHING, str(sweep_dir), "60"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert launch.stdout is not None and launch.stdout.readline() == "locked\n"
    launch.kill()
    launch.wait(timeout=30)
    assert (sweep_dir / LOCK_FILE).read_text().strip(), "the killed launch's line"
    for where in (sweep_dir, tmp_path / "never"):
        (where / "manifest.jsonl").parent.mkdir(exist_ok=True)
        proc = status_cli("--wait", "--poll", "1", str(where))
        assert proc.returncode == EXIT_USAGE and "waiting" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith(f"error: {where}"), proc.stderr


def test_status_refuses_an_empty_manifest(tmp_path: Path) -> None:
    # It was "0/0 finished", exit 0, as if every config had run; the analysis refused it.
    write_manifest([], tmp_path / "manifest.jsonl")
    proc = status_cli(str(tmp_path))
    assert proc.returncode == EXIT_USAGE and not proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == (f"error: {tmp_path / 'manifest.jsonl'} lists no config: nothing was launched into "
                           f"{tmp_path} yet (a launch still starting, or one that stopped before its first config)\n")  # fmt: skip
    bad = status_cli("--wait", "--poll", "0.5", str(tmp_path))
    assert bad.returncode == EXIT_USAGE and "--poll: 0.5 is not a number of seconds >= 1" in bad.stderr, bad.stderr
    alone = status_cli("--poll", "5", str(tmp_path))  # it paces --wait only: alone it was ignored
    assert alone.returncode == EXIT_USAGE and "error: --poll 5 paces --wait, which was not given" in alone.stderr
