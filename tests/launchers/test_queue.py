"""launchers.queue: the one reader of Slurm's queue (squeue + sacct), parsed and against the real cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launchers.queue import (
    GONE,
    SlurmAnswer,
    ask_states,
    base_state,
    ended_outcome,
    expand_job_ids,
    is_cancelled,
    is_live,
    is_preempted,
    is_running,
    parse_states,
    read_states,
    stuck_reason,
    unanswered_words,
)
from tests.conftest import SlurmClusterInfo
from tests.launchers.test_slurm_launcher import REPO
from train.contract import EXIT_UNFINISHED, ManifestEntry, write_manifest


def test_expand_job_ids_spells_out_pending_array_ranges() -> None:
    assert expand_job_ids("12_[0-2,5%2]") == ["12_0", "12_1", "12_2", "12_5"]
    assert expand_job_ids("12_[4]") == ["12_4"]
    assert expand_job_ids("12_3") == ["12_3"]
    assert expand_job_ids("99") == ["99"]


def test_parse_states_expands_ranges_drops_suffixes_and_keeps_the_last_run() -> None:
    # sacct lists a requeued job once per run, oldest first.
    text = "7_0|TIMEOUT\n7_0|COMPLETED\n7_[1-2]|PENDING\n8|CANCELLED by 0\nbad line\n9|\n"
    assert parse_states(text) == {"7_0": "COMPLETED", "7_1": "PENDING", "7_2": "PENDING", "8": "CANCELLED"}
    # squeue's third column: the reason a pending job waits ('None' for a running one).
    assert parse_states("5_1|PENDING|Licenses\n6|RUNNING|None\n") == {"5_1": "PENDING (Licenses)", "6": "RUNNING"}


def test_what_a_state_means_for_a_run_without_a_record() -> None:
    assert is_running("RUNNING") and is_running("COMPLETING") and not is_running("PENDING")
    assert is_live("PENDING") and is_live("REQUEUED") and is_live("RUNNING")
    assert not is_live("COMPLETED") and not is_live("CANCELLED by 12")
    assert base_state("CANCELLED by 12") == "CANCELLED" and base_state("") == ""
    assert ended_outcome("OUT_OF_MEMORY") == "oom"
    assert ended_outcome("TIMEOUT") == ended_outcome("DEADLINE") == "timeout"
    assert ended_outcome("NODE_FAIL") == ended_outcome("COMPLETED") == "fail"
    assert ended_outcome("CANCELLED by 12") == "cancelled" and is_cancelled("CANCELLED by 12")
    # A preemption (PreemptMode=CANCEL) stops a run as its time limit would: no failure of its config.
    assert ended_outcome("PREEMPTED") == "timeout" and is_preempted("PREEMPTED") and not is_preempted("REQUEUED")
    assert not is_cancelled("PREEMPTED") and not is_cancelled(GONE)


def test_absent_slurm_tools_mean_unknown_not_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert read_states(["1234_5"]) == {}
    assert read_states([]) == {}


def _sbatch(*args: str) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", "--output=/dev/null", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    return out.split(";")[0]


def test_states_of_live_array_tasks_and_ended_jobs(slurm_cluster: SlurmClusterInfo) -> None:
    # A held array: squeue knows its tasks only as a range, which must come back task by task.
    held = _sbatch("--hold", "--array=0-2", "--wrap=true")
    done = _sbatch("--wrap=true")
    try:
        deadline = time.monotonic() + 60
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = read_states([f"{held}_0", f"{held}_2", done, "999999"])
            if states.get(done) == "COMPLETED":
                break
            time.sleep(1)
        # squeue says why they wait, as status then shows it.
        assert states[f"{held}_0"] == states[f"{held}_2"] == "PENDING (JobHeldUser)"
        assert states[done] == "COMPLETED"  # from sacct, once the job has left the queue
        # An id neither squeue nor sacct knows, both answering, will never run (a cancelled pending task).
        assert states["999999"] == GONE
        assert ask_states([done]).unanswered == ()  # both answered
    finally:
        subprocess.run(["scancel", held], check=False, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if base_state(read_states([f"{held}_1"]).get(f"{held}_1", "")) == "CANCELLED":
            break
        time.sleep(1)
    assert read_states([f"{held}_1"])[f"{held}_1"] == "CANCELLED"


def test_a_reason_no_wait_clears_is_told_from_one_that_does() -> None:
    assert stuck_reason("PENDING (JobHeldUser)") == "held; `scontrol release <job>` lets it start"
    assert stuck_reason("PENDING (BadConstraints)") is not None
    # Waits that end by themselves, and a running job, are not stuck.
    for state in ("PENDING (Priority)", "PENDING (Licenses)", "PENDING (Resources)", "PENDING", "RUNNING"):
        assert stuck_reason(state) is None, state


def test_a_slurm_that_cannot_be_asked_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy of a sweep on a machine without Slurm's tools (or with accounting off): its jobs that ended
    # without a record read pending, and `status --wait` waited for them in silence.
    monkeypatch.setenv("PATH", str(tmp_path))
    answer = ask_states(["1234_0"])
    assert answer == SlurmAnswer({}, ("sacct is not on this machine's PATH", "squeue is not on this machine's PATH"))
    entry = ManifestEntry(index=0, overrides=("training.lr=0.1",), output_dir="0", status="submitted", job_id="1234_0")
    write_manifest([entry], tmp_path / "manifest.jsonl")
    proc = subprocess.run([sys.executable, "-m", "launchers", "status", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": str(tmp_path)})  # fmt: skip
    assert proc.returncode == EXIT_UNFINISHED and "0/1 finished: 1 pending" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.startswith(
        "warning: Slurm could not be asked (sacct is not on this machine's PATH; squeue is not on this machine's "
        "PATH): a config whose job ended without a record reads pending until it answers\n"
    ), proc.stderr
    assert unanswered_words(["x"]).startswith("Slurm could not be asked (x): ")
