"""Failure statuses through the real entry point (`python -m train` subprocesses): oom, nan, timeout.

Each end-to-end test tags its processes with a unique marker (an environment variable and the
hydra.run.dir on the command line) and checks afterwards, by scanning /proc, that none is left.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from train.contract import EXIT_TERMINATED, RESULT_FILE
from train.failures import classify
from train.preemption import HANG_ENV, hang_hook
from train.trainer import TrainingTimeout

from .test_distributed import REPO, worker_env
from .test_main import interrupt

MARKER_ENV = "MEGASWEEP_TEST_MARKER"
SMALL = (
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "model.vocab_size=256",
    "parallelism.precision=fp32",
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=1.0",
    "logger=disabled",
)
ADDRESS_SPACE_LIMIT = 2 * 2**30
"""Enough for Python, torch and a small run here (a 64-wide model peaked at 0.3 GiB resident)."""


def processes_with(marker: str) -> list[int]:
    """PIDs whose command line or environment holds `marker` (our own processes are readable)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for name in ("cmdline", "environ"):
            try:
                if marker.encode() in (entry / name).read_bytes():
                    found.append(int(entry.name))
                    break
            except OSError:  # gone meanwhile, or another user's
                continue
    return found


def run_cli(
    out: Path,
    *overrides: str,
    limit_as: int | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], float]:
    marker = uuid.uuid4().hex
    out = out / f"run-{marker}"

    def limit() -> None:
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "train", *SMALL, *overrides, f"hydra.run.dir={out}"],
        cwd=REPO,
        env=worker_env(**{MARKER_ENV: marker, **(env or {})}),
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    elapsed = time.monotonic() - start
    # Every worker is gone once the entry point returns: nothing may outlive the run.
    assert processes_with(marker) == [], f"processes left behind: {processes_with(marker)}"
    record: dict[str, Any] = json.loads((out / "result.json").read_text())
    return proc, record, elapsed


def test_classify() -> None:
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert classify(cpu) == "oom"
    assert (
        classify(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"))
        == "oom"
    )
    assert classify(MemoryError()) == "oom"
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "oom"
    gloo = RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation"
    )
    assert classify(gloo) == "timeout"
    assert classify(TimeoutError()) == "timeout"
    # The cause counts when a wrapper re-raises.
    try:
        try:
            raise cpu
        except RuntimeError as inner:
            raise ValueError("step failed") from inner
    except ValueError as outer:
        assert classify(outer) == "oom"
    assert classify(ValueError("boom")) == classify(KeyError("memory")) == "error"
    assert classify(RuntimeError("shape mismatch")) == "error"


def test_hang_hook_only_for_its_rank_and_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    hang_hook(0, 2, {HANG_ENV: "1:2"})
    hang_hook(1, 1, {HANG_ENV: "1:2"})
    hang_hook(1, 2, {})
    assert slept == []
    hang_hook(1, 2, {HANG_ENV: "1:2"})
    assert len(slept) == 1 and slept[0] > 60


@pytest.mark.slow
def test_cpu_allocator_failure_is_oom(tmp_path: Path) -> None:
    # One micro-batch's logits alone are 32 x 256 x 65536 fp32 = 2 GiB: beyond the address space.
    proc, record, _ = run_cli(
        tmp_path,
        "model.seq_length=256",
        "model.vocab_size=65536",
        "parallelism.micro_batch_size=32",
        "parallelism.global_batch_size=32",
        "training.train_iters=2",
        "training.warmup_iters=1",
        limit_as=ADDRESS_SPACE_LIMIT,
    )
    assert proc.returncode != 0
    assert record["status"] == "oom", record["message"]
    assert "can't allocate memory" in record["message"] or "MemoryError" in record["message"]
    assert record["iterations_run"] == 0


@pytest.mark.slow
def test_oom_on_one_pipeline_stage_is_the_records_status_and_names_that_rank(tmp_path: Path) -> None:
    # pp2: only the last stage computes the logits (32 x 256 x 65536 fp32 = 2 GiB), beyond each
    # worker's address space; the first stage fits and sees only its peer vanish. The record says
    # oom all the same, naming rank 1, its stage, what it held and what the planner predicted.
    proc, record, _ = run_cli(
        tmp_path,
        "model.num_layers=2",
        "model.seq_length=256",
        "model.vocab_size=65536",
        "parallelism.pp=2",
        "parallelism.micro_batch_size=32",
        "parallelism.global_batch_size=64",
        "training.train_iters=2",
        "training.warmup_iters=1",
        "training.collective_timeout_s=20",
        limit_as=ADDRESS_SPACE_LIMIT,
    )
    assert proc.returncode != 0
    assert record["status"] == "oom", record["message"]
    oom = record["oom"]
    assert (oom["rank"], oom["stage"], oom["role"], oom["iteration"]) == (1, 1, "last", 0)
    assert "can't allocate memory" in oom["message"] or "MemoryError" in oom["message"]
    # The planner saw it coming: the logits alone exceed the limit the rank ran under.
    assert oom["predicted"] > ADDRESS_SPACE_LIMIT
    assert record["message"].startswith("rank 1 (pipeline stage 1, last) ran out of memory after 0 iterations")
    assert "predicted" in record["message"]


@pytest.mark.slow
def test_small_run_fits_the_same_limit(tmp_path: Path) -> None:
    # The control: the limit itself does not break a run that needs little memory.
    proc, record, _ = run_cli(
        tmp_path, "training.train_iters=2", "training.warmup_iters=1", limit_as=ADDRESS_SPACE_LIMIT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert record["status"] == "ok"


@pytest.mark.slow
def test_nan_loss_is_nan(tmp_path: Path) -> None:
    proc, record, _ = run_cli(
        tmp_path, "training.lr=1e30", "training.train_iters=6", "parallelism.optimizer=torch"
    )
    assert proc.returncode != 0
    assert record["status"] == "nan" and record["iterations_run"] < 6


@pytest.mark.slow
def test_an_earlier_runs_oom_report_in_the_directory_is_not_this_runs(tmp_path: Path) -> None:
    # The directory held an OOM report of an earlier run (a reused hydra.run.dir; a rerun of the config):
    # the diverged run below was recorded `oom`, quoting it, and exited 0.
    from train.contract import OomReport, oom_report_name

    out = tmp_path / "run"
    out.mkdir()
    stale = out / oom_report_name(0)
    old = OomReport(rank=0, stage=0, role="only", iteration=0, allocated=None, peak=2.0**31, reserved=None,
                    predicted=None, capacity=2.0**31, message="an earlier run's OOM")  # fmt: skip
    stale.write_text(json.dumps(old.to_dict()))
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    proc = subprocess.run(
        [sys.executable, "-m", "train", *SMALL, "training.lr=1e30", "training.train_iters=6",
         "parallelism.optimizer=torch", f"hydra.run.dir={out}"],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    record = json.loads((out / RESULT_FILE).read_text())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert record["status"] == "nan" and "earlier run" not in str(record["message"]), record["message"]


@pytest.mark.slow
def test_a_diverged_run_of_two_workers_is_nan_whichever_exits_first(tmp_path: Path) -> None:
    # Rank 1 stops on the NaN while rank 0 writes the record; when rank 1 exited first, the parent
    # rewrote the record as `error` (3 of 5 runs): rank 0's `nan` is kept now.
    for attempt in range(3):
        proc, record, _ = run_cli(
            tmp_path / str(attempt), "parallelism.dp=2", "parallelism.micro_batch_size=2",
            "parallelism.global_batch_size=4", "training.lr=1e30", "training.train_iters=6", "parallelism.optimizer=torch",
        )  # fmt: skip
        assert proc.returncode == 1 and record["status"] == "nan", (attempt, record["status"], record["message"])


@pytest.mark.slow
def test_rank_hanging_in_a_collective_is_timeout(tmp_path: Path) -> None:
    # Rank 1 sleeps an hour before iteration 2's first collective; rank 0 waits at most 10 s in it,
    # writes the record, and the local spawner ends rank 1 (SIGTERM, then SIGKILL after its grace).
    # run_cli's subprocess timeout (240 s, far below the hour) is the bound on all of it.
    proc, record, _ = run_cli(
        tmp_path,
        "parallelism.dp=2",
        "parallelism.micro_batch_size=2",
        "parallelism.global_batch_size=4",
        "training.train_iters=3",
        "training.warmup_iters=1",
        "training.collective_timeout_s=10",
        env={HANG_ENV: "1:2"},
    )
    assert proc.returncode != 0
    assert record["status"] == "timeout", record["message"]
    assert "Timed out" in record["message"]
    assert record["iterations_run"] == 1  # iteration 1 finished, iteration 2 never did
    assert "rank 1 hangs now" in proc.stderr


def test_trainer_uses_the_classifier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from train import trainer

    from .test_trainer import compose_run

    def allocator_failure(*args: object, **kwargs: object) -> str:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(trainer, "train", allocator_failure)
    with pytest.raises(RuntimeError):
        trainer.run_training(compose_run(), output_dir=tmp_path, overrides=[])
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "oom"
    assert classify(TrainingTimeout("received SIGTERM")) == "error"  # handled by the trainer itself


@pytest.mark.parametrize("layout", [(), ("parallelism.tp=2", "parallelism.sequence_parallel=true")])
def test_sigterm_without_checkpoints_is_timeout_one_line_and_143(tmp_path: Path, layout: tuple[str, ...]) -> None:
    """`kill PID` (or `timeout`) of a run that does not checkpoint: the record says `timeout` (every
    rank's, not the consequence a peer saw), one line says so, the status is the signal's."""
    code, stderr = interrupt(
        ["-m", "train", *SMALL, *layout, "training.train_iters=100000", f"hydra.run.dir={tmp_path}"],
        whole_group=False, sig=signal.SIGTERM,
    )  # fmt: skip
    assert code == EXIT_TERMINATED, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.strip() == (
        f"timeout: received SIGTERM; stopped before the end of training (record: {tmp_path / 'result.json'})"
    ), stderr[-3000:]
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["status"] == "timeout" and "SIGTERM" in record["message"]
