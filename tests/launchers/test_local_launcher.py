"""`hydra/launcher=local`: each config of a sweep runs here, in order, with the Slurm launcher's files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from launchers.local import INTERRUPTED_BEFORE_RECORD, INTERRUPTED_BEFORE_START
from launchers.status import sweep_status
from tests.launchers.test_slurm_launcher import REPO, TINY, result
from tests.train.test_main import AS_FROM_A_TERMINAL, INTERRUPT_LOST_ON_ITS_WAY, TINY_RUN, interrupt
from train.contract import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, LOG_FILE, read_manifest
from train.preemption import FAULT_ENV, FAULT_EXIT_CODE


def rerun(sweep_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip


def stand_in(path: Path, script: str) -> Path:
    """An executable shell script at `path` that runs `script`: the launcher's python in a test."""
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


def test_local_launcher_runs_two_configs_and_skips_the_infeasible_one(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable, "-m", "train", "-m", *TINY,
            "training.lr=1e-4,2e-4", "+cluster.env.CUDA_LAUNCH_BLOCKING=1",
            # A measured peak keeps fp32 feasible on a CPU; without one validation refuses it.
            "hardware.peak_measured=true,false",
            "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 configs: 2 to run, 2 infeasible" in proc.stdout
    # The console names the rule the skipped configs break, with one of them, not only the manifest.
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("local: infeasible [")]
    assert line.startswith("local: infeasible [precision_supported] 2 config(s), e.g. config ") and "peak_measured" in line

    entries = read_manifest(sweep_dir)
    ran = [e for e in entries if e.status == "submitted"]
    skipped = [e for e in entries if e.status == "skipped"]
    assert len(ran) == 2 and len(skipped) == 2
    assert all(e.job_id is None for e in entries)
    assert all(e.reason and "peak_measured" in e.reason for e in skipped)
    records = [result(sweep_dir, e) for e in ran]
    assert [r["status"] if r else None for r in records] == ["ok", "ok"]
    assert all(r is not None and r["env"]["CUDA_LAUNCH_BLOCKING"] == "1" for r in records)
    assert sorted(r["config"]["training"]["lr"] for r in records if r) == [1e-4, 2e-4]
    # The files are a Slurm sweep's: status reads them alike, without asking Slurm.
    states = sweep_status(sweep_dir, slurm_states={})
    assert sorted(s.state for s in states) == ["done", "done", "skipped", "skipped"]
    # Each run keeps its own console output, iteration lines included, beside its result.json.
    for e in ran:
        log = (sweep_dir / e.output_dir / LOG_FILE).read_text()
        assert " iteration " in log and "result.json" in log, log[-2000:]


def test_local_launcher_runs_every_config_and_then_reports_the_failure(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable, "-m", "train", "-m", *TINY,
            # Config 0's run dies at its first iteration (train.preemption's test hook), which no check
            # before the launch can see: config 1's hook names an iteration it never reaches.
            f"+cluster.env.{FAULT_ENV}=0:1,0:1000",
            "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_FAILED
    assert "config 0 failed" in proc.stderr
    # One paragraph at the end, without Hydra's hint of a crash (set HYDRA_FULL_ERROR for a traceback).
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("1 of 2 configs failed (0); every other config ran. python -m launchers status "), proc.stderr
    assert "HYDRA_FULL_ERROR" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    first, second = read_manifest(sweep_dir)
    bad, good = result(sweep_dir, first), result(sweep_dir, second)
    assert bad is None and first.status == "failed" and f"exited with status {FAULT_EXIT_CODE}" in (first.reason or "")
    # The failure of config 0 did not stop config 1.
    assert good is not None and good["status"] == "ok"
    # `rerun --failed` runs a local sweep's failure here again (it fails the same way: exit 1,
    # the earlier record kept beside), and with a changed field as a new config, which succeeds.
    again = rerun(sweep_dir)
    assert again.returncode == EXIT_FAILED and "rerun: config 0: ran here" in again.stdout, again.stderr
    assert "1 configs failed again" in again.stderr
    fixed = rerun(sweep_dir, f"cluster.env.{FAULT_ENV}=0:1000")
    assert fixed.returncode == 0 and "rerun: config 2 (rerun of config 0): ran here" in fixed.stdout, fixed.stderr
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["failed", "done", "done"]
    # Asked again (another rerun got there first, say), it says which rerun stands for the failure.
    again = rerun(sweep_dir, "training.lr=1e-3")  # its change is made to nothing: bad input, on stderr
    assert again.returncode == EXIT_USAGE and again.stderr.strip() == (
        "rerun: no failed configs to rerun: each failed one is rerun already (config 0 as config 2); "
        "training.lr=1e-3 not applied: rerun those configs' failures to change them"
    ), again.stdout + again.stderr
    # The same command again (a script's retry): its changes are the rerun's already, so it exits 0.
    same = rerun(sweep_dir, f"cluster.env.{FAULT_ENV}=0:1000")
    assert same.returncode == 0 and same.stdout.strip() == (
        f"rerun: no failed configs to rerun: each failed one is rerun already with cluster.env.{FAULT_ENV}=0:1000 "
        "(config 0 as config 2)"
    ), same.stdout + same.stderr


def test_ctrl_c_of_a_local_sweep_leaves_the_run_interrupted(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    code, stderr = interrupt(
        ["-m", "train", "-m", "training.train_iters=100000", "training.lr=1e-4,2e-4", *TINY_RUN,
         "hydra/launcher=local",
         f"hydra.sweep.dir={sweep_dir}"],
    )  # fmt: skip
    assert code == EXIT_INTERRUPTED and "Traceback" not in stderr, stderr
    running, never = read_manifest(sweep_dir)
    record = result(sweep_dir, running)
    assert record is not None and record["status"] == "interrupted"
    # The config that had not started is not left pending for ever: the manifest says why it never ran.
    assert (never.status, never.reason) == ("interrupted", INTERRUPTED_BEFORE_START)
    # The sweep's status says so, as configs to rerun (status exits non-zero on them).
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["interrupted", "interrupted"]
    # status names them interrupted, not failed, in its exit line as in its table.
    table = subprocess.run([sys.executable, "-m", "launchers", "status", str(sweep_dir)],
                           cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert table.returncode == EXIT_FAILED and "status: 2 configs interrupted (" in table.stderr, table.stderr
    again = rerun(sweep_dir, "training.train_iters=3", "training.warmup_iters=1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["interrupted"] * 2 + ["done"] * 2


def test_a_run_killed_before_its_record_is_failed_not_pending(tmp_path: Path) -> None:
    # A process that ends without writing result.json (here an interpreter that exits at once; in
    # life SIGKILL or the OOM killer): the manifest says failed and how, as no Slurm state would.
    from analysis.records import load_sweeps

    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, "training.lr=1e-4,2e-4", "hydra/launcher=local",
         "hydra.launcher.python=/bin/false", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_FAILED and "2 of 2 configs failed" in proc.stderr, proc.stderr
    entries = read_manifest(sweep_dir)
    assert [e.status for e in entries] == ["failed", "failed"]
    assert all("exited with status 1 before writing result.json" in (e.reason or "") for e in entries)
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["failed", "failed"]
    table = load_sweeps([sweep_dir], queue=None).table
    assert list(table["outcome"]) == ["fail", "fail"]
    # Its layout is the one the launch composed (its manifest entry's): no record says it.
    assert all(e.layout["model"] == "tiny" for e in entries)
    assert table[["dp", "tp", "pp", "mbs", "gbs", "seq_length"]].values.tolist() == [[1, 1, 1, 1, 2, 32]] * 2


def test_ctrl_c_before_the_running_config_wrote_its_record_leaves_it_interrupted_not_pending(tmp_path: Path) -> None:
    # The config's process is still starting (in life: importing torch, starting W&B) when Ctrl-C comes,
    # and ends without a record: here a stand-in interpreter that only waits.
    starting = stand_in(tmp_path / "starting", "exec sleep 60")
    sweep_dir = tmp_path / "sweep"
    run = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, "-m", "train", "-m", *TINY, "training.lr=1e-4,2e-4",
         "hydra/launcher=local", f"hydra.launcher.python={starting}", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert run.stdout is not None
        for line in run.stdout:
            if line.startswith("local: [1/2] config 0"):
                break
        os.killpg(run.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
        _, stderr = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == EXIT_INTERRUPTED and "Traceback" not in stderr, stderr
    running, never = read_manifest(sweep_dir)
    assert not (sweep_dir / running.output_dir / "result.json").exists()
    assert (running.status, running.reason) == ("interrupted", INTERRUPTED_BEFORE_RECORD)
    assert (never.status, never.reason) == ("interrupted", INTERRUPTED_BEFORE_START)
    assert [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["interrupted", "interrupted"]


def test_status_tells_the_running_config_and_one_whose_launcher_was_killed(tmp_path: Path) -> None:
    # A local sweep's manifest names no Slurm job: status called the config being trained `pending`,
    # and, once the launcher was killed, every config of it `pending` for ever.
    sweep_dir = tmp_path / "sweep"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "train", "-m", "training.train_iters=100000", "training.lr=1e-4,2e-4", *TINY_RUN,
         "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # the first config's trainer is under way
            if line.startswith(" iteration "):
                break
        states = sweep_status(sweep_dir, slurm_states={})
        assert [s.state for s in states] == ["running", "pending"], states
        assert states[0].detail.startswith("by this machine's local launcher, pid ")
        assert states[1].detail.startswith("queued by this machine's local launcher, pid ")
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # no record, no manifest update: as SIGKILL or the OOM killer
        launcher.wait(timeout=60)
    states = sweep_status(sweep_dir, slurm_states={})
    assert [s.state for s in states] == ["failed", "interrupted"], states
    assert "ended without the config's result.json (killed?)" in states[0].detail
    assert "ended before it started the config (killed?)" in states[1].detail


def test_a_config_that_fails_after_ctrl_c_stops_the_sweep_as_interrupted(tmp_path: Path) -> None:
    # The first config's process signals the launcher, as Ctrl-C would, and fails: the launcher must not
    # record it failed and go on to the next config.
    failing = stand_in(tmp_path / "failing", "kill -INT $PPID; exit 1")
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPT_LOST_ON_ITS_WAY, "-m", *TINY, "training.lr=1e-4,2e-4",
         "hydra/launcher=local", f"hydra.launcher.python={failing}", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr.splitlines()[-1:]) == (EXIT_INTERRUPTED, ["interrupted"]), proc.stderr
    assert "local: [2/2]" not in proc.stdout and "failed" not in proc.stderr, proc.stdout + proc.stderr
    ran, never = read_manifest(sweep_dir)
    assert (ran.status, ran.reason) == ("interrupted", INTERRUPTED_BEFORE_RECORD)
    assert (never.status, never.reason) == ("interrupted", INTERRUPTED_BEFORE_START)


def test_a_local_sweep_whose_runs_would_refuse_a_path_is_refused_before_any_runs(tmp_path: Path) -> None:
    # Its runs are this machine's: a token file missing here is missing for them (it was a warning
    # about nodes that may see other file systems, then each config failed on it in turn).
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, f"training.data_path={tmp_path / 'nosuch.bin'},null",
         "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_USAGE and not (sweep_dir / "manifest.jsonl").exists(), proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: training.data_path='{tmp_path / 'nosuch.bin'}' cannot be read as a token file")
    assert line.endswith("[1 config(s) name it]. The runs of this machine would refuse it at their start: "
                         "nothing was run.") and "may not see" not in line  # fmt: skip


def test_a_local_sweep_in_batches_warns_of_each_path_once(tmp_path: Path) -> None:
    # hydra.sweeper.max_batch_size=1 checked the short file again and warned of it once per batch.
    import numpy as np

    tokens, sweep_dir = tmp_path / "tokens.bin", tmp_path / "sweep"
    (np.arange(100) % 512).astype(np.uint16).tofile(tokens)  # 3 samples of 32 (+1); each run reads 6
    proc = subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, "training.lr=1e-4,2e-4", f"training.data_path={tokens}",
         "hydra.sweeper.max_batch_size=1", "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [result(sweep_dir, e)["status"] for e in read_manifest(sweep_dir)] == ["ok", "ok"]  # type: ignore[index]
    (warning,) = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert warning.startswith(f"warning: training.data_path={str(tokens)!r} holds 100 tokens"), warning
    assert "it wraps around" in warning and warning.endswith("[1 config(s) name it]"), warning


def test_a_plain_rerun_checks_the_paths_as_a_launch_does(tmp_path: Path) -> None:
    # `rerun --failed` without changes composed nothing, so it checked no path: a token file gone since
    # the launch made each rerun config fail again on it.
    import numpy as np

    tokens, sweep_dir = tmp_path / "tokens.bin", tmp_path / "sweep"
    (np.arange(8000) % 512).astype(np.uint16).tofile(tokens)  # TINY's vocabulary: 512
    launched = subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, f"training.data_path={tokens}", f"+cluster.env.{FAULT_ENV}=0:1",
         "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert launched.returncode == EXIT_FAILED, launched.stdout + launched.stderr
    tokens.unlink()
    again = rerun(sweep_dir)
    assert again.returncode == EXIT_USAGE and "ran here" not in again.stdout, again.stdout + again.stderr
    assert again.stderr.startswith(f"error: training.data_path='{tokens}' cannot be read as a token file")
    assert again.stderr.strip().endswith("The runs of this machine would refuse it at their start: nothing was rerun.")
