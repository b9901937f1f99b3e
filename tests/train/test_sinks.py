"""train.sinks: the log line's scalars reach TensorBoard event files that tensorboard reads back."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from train.contract import TENSORBOARD_DIR
from train.sinks import TensorBoardWriter, iteration_metrics
from train.trainer import run_training

from .test_trainer import compose_run

SCALARS = (
    "lm_loss",
    "learning_rate",
    "grad_norm",
    "loss_scale",
    "elapsed_time_per_iteration_s",
    "samples_per_s",
    "tflops",
    "mfu",
    "max_mem_gib",
    "global_batch_size",
)


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_run_writes_the_log_lines_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    # A datasheet peak, so that MFU has a value to write.
    run = compose_run("logger.tensorboard=true", "hardware.peak_tflops_fp32=10.0", "hardware.peak_tflops_bf16=20.0")
    record = run_training(run, output_dir=tmp_path, overrides=["logger.tensorboard=true"])
    assert record["status"] == "ok" and record["tensorboard_dir"] == str(tmp_path / TENSORBOARD_DIR)
    scalars = _scalars(tmp_path / TENSORBOARD_DIR)
    assert {f"train/{name}" for name in SCALARS} <= set(scalars)
    losses = scalars["train/lm_loss"]
    assert [step for step, _ in losses] == [1, 2, 3]
    assert [v for _, v in losses] == pytest.approx(record["losses"], rel=1e-6)  # float32 in the event file
    assert [v for _, v in scalars["train/elapsed_time_per_iteration_s"]] == pytest.approx(
        record["iteration_times_s"], rel=1e-6
    )
    assert all(0 < v < 1 for _, v in scalars["train/mfu"])


def test_without_the_switch_no_event_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    record = run_training(compose_run(), output_dir=tmp_path, overrides=[])
    assert "tensorboard_dir" not in record and not (tmp_path / TENSORBOARD_DIR).exists()


def test_an_unwritable_directory_warns_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="TensorBoard logging is off"):
        writer = TensorBoardWriter(blocker / TENSORBOARD_DIR)
    writer.log({"lm_loss": 1.0}, step=1)  # a no-op now, never an exception
    writer.close()
    assert writer.error is not None and "tensorboard start failed" in writer.error


def test_metric_names_are_the_log_lines() -> None:
    from train.metrics import IterationStats

    stats = IterationStats(
        iteration=3, train_iters=5, consumed_samples=24, consumed_tokens=768, elapsed_s=0.5, learning_rate=1e-4,
        global_batch_size=8, loss=2.0, loss_scale=1.0, grad_norm=0.3, skipped_iters=0, nan_iters=0,
        samples_per_s=16.0, tflops=0.1, mfu=0.2, max_mem_gib=1.5,
    )
    metrics = iteration_metrics(stats)
    assert set(SCALARS) <= set(metrics)
    assert metrics["lm_loss"] == 2.0 and metrics["global_batch_size"] == 8 and metrics["mfu"] == 0.2
