"""`python -m launchers status|rerun`: states from manifest + result.json + Slurm, and reruns of failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from launchers.status import ConfigStatus, classify, format_status, sweep_status
from tests.launchers.test_slurm_launcher import REPO, result, sweep, wait_for_results, wait_until
from train.contract import (
    EXPORTED_JOBS_DIR,
    LOG_FILE,
    SUBMITIT_DIR,
    ManifestEntry,
    read_manifest,
    write_manifest,
)

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

SUBMITTED = ManifestEntry(index=0, overrides=("a=1",), output_dir="0", status="submitted", job_id="7_0")


def test_classify_prefers_result_json_and_falls_back_on_slurm() -> None:
    assert classify(SUBMITTED, {"status": "ok"}, "FAILED") == ("done", "")
    state, detail = classify(SUBMITTED, {"status": "oom", "message": "CUDA out of memory"}, "COMPLETED")
    assert state == "failed" and "oom" in detail and "CUDA out of memory" in detail
    assert classify(SUBMITTED, None, "TIMEOUT")[0] == "failed"
    assert classify(SUBMITTED, None, "CANCELLED by 0") == ("failed", "Slurm state CANCELLED, no result.json")
    assert classify(SUBMITTED, None, "COMPLETED")[0] == "failed"
    assert classify(SUBMITTED, None, "RUNNING") == ("running", "")
    assert classify(SUBMITTED, None, "PENDING") == ("pending", "PENDING")
    assert classify(SUBMITTED, None, None) == ("pending", "")
    skipped = ManifestEntry(
        index=1, overrides=(), output_dir="1", status="skipped", reason="tp=3 does not divide"
    )
    assert classify(skipped, None, None) == ("skipped", "tp=3 does not divide")
    refused = ManifestEntry(
        index=2, overrides=(), output_dir="2", status="refused", reason="sbatch refused: invalid partition"
    )
    assert classify(refused, None, None) == ("refused", "sbatch refused: invalid partition")
    exported = ManifestEntry(
        index=3, overrides=(), output_dir="3", status="exported", reason="exported to a.sbatch, array task 3"
    )
    # No job has recorded itself: queued or never submitted, this side cannot tell.
    state, detail = classify(exported, None, None)
    assert state == "pending" and "no job started yet" in detail and "a.sbatch, array task 3" in detail
    assert classify(exported, {"status": "ok"}, None) == ("done", "")


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


def status_table(sweep_dir: Path) -> str:
    """`python -m launchers status <sweep_dir>`'s output (it must exit 0)."""
    proc = subprocess.run(
        [sys.executable, "-m", "launchers", "status", str(sweep_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
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


def test_rerun_failed_resubmits_refused_configs(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    # Held, so that nothing runs: only what is queued (and refused) matters here.
    sweep(sweep_dir, "cluster.partition=nosuch", "+hydra.launcher.sbatch_args.hold=''")
    (first,) = read_manifest(sweep_dir)
    assert first.status == "refused" and first.reason is not None and "nosuch" in first.reason
    table = status_table(sweep_dir)
    assert "1/1 finished: 0 pending, 0 running, 0 done, 0 failed, 1 refused" in table, table

    # The cause goes away (here: the launch record names a partition that exists, as if the
    # site had created it); the config was never run, so `rerun --failed` submits it.
    launch = sweep_dir / ".megasweep" / "launch.json"
    data = json.loads(launch.read_text())
    data["configs"]["0"]["options"]["partition"] = slurm_cluster.partition
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
