"""`python -m launchers status|rerun`: states from manifest + result.json + Slurm, and reruns of failures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from analysis.manifest import ManifestEntry, read_manifest, write_manifest
from launchers.status import ConfigStatus, classify, expand_job_ids, format_status, sweep_status
from tests.launchers.test_slurm_launcher import REPO, result, sweep, wait_for_results, wait_until

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


def test_expand_job_ids_spells_out_pending_array_ranges() -> None:
    assert expand_job_ids("12_[0-2,5%2]") == ["12_0", "12_1", "12_2", "12_5"]
    assert expand_job_ids("12_[4]") == ["12_4"]
    assert expand_job_ids("12_3") == ["12_3"]
    assert expand_job_ids("99") == ["99"]


def test_format_status_shows_varying_overrides_counts_and_bar() -> None:
    statuses = [
        ConfigStatus(0, ("m=x", "lr=1"), "done", "7_0", "COMPLETED", ""),
        ConfigStatus(1, ("m=x", "lr=2"), "failed", "7_1", "FAILED", "result.json status error: boom"),
        ConfigStatus(2, ("m=x", "lr=3"), "running", "7_2", "RUNNING", ""),
        ConfigStatus(3, ("m=x", "lr=4"), "skipped", None, None, "infeasible"),
    ]
    text = format_status(statuses, width=12)
    lines = text.splitlines()
    assert lines[0].split() == ["index", "state", "job", "overrides", "detail"]
    assert lines[2].split()[:4] == ["1", "failed", "7_1", "lr=2"] and "boom" in lines[2]
    assert "m=x" not in text  # the same in every config: not worth a column
    # 2 of the 3 submitted configs have finished: 8 of 12 characters.
    assert lines[-1] == "[########....] 2/3 finished: 0 pending, 1 running, 1 done, 1 failed, 1 skipped"


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


def status_table(sweep_dir: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "launchers", "status", str(sweep_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
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
