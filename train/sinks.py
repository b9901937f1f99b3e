"""Where a run's per-iteration figures go besides the console: W&B and TensorBoard.

Both get the log line's scalars under the same names (`iteration_metrics`), from rank 0 only:
loss, learning rate, gradient norm, loss scale, seconds per iteration, samples per second,
TFLOPs, MFU, memory, and the global batch (which a ramp-up changes). TensorBoard event files go
to <run dir>/tensorboard (train.contract.TENSORBOARD_DIR) when logger.tensorboard is true,
written with torch.utils.tensorboard (the `tensorboard` package). As with W&B, a sink that
fails warns once and is switched off: metrics are never worth a lost run.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.contract import TENSORBOARD_DIR
from train.metrics import IterationStats
from train.wandb_log import WandbLogger


def iteration_metrics(s: IterationStats) -> dict[str, float | int | None]:
    """The log line's figures of one iteration, by the names W&B and TensorBoard show."""
    return {
        "lm_loss": s.loss,
        "learning_rate": s.learning_rate,
        "grad_norm": s.grad_norm,
        "loss_scale": s.loss_scale,
        "elapsed_time_per_iteration_s": s.elapsed_s,
        "samples_per_s": s.samples_per_s,
        "tflops": s.tflops,
        "mfu": s.mfu,
        "max_mem_gib": s.max_mem_gib,
        "skipped_iterations": s.skipped_iters,
        "consumed_samples": s.consumed_samples,
        "global_batch_size": s.global_batch_size,
    }


class TensorBoardWriter:
    """Scalars to TensorBoard event files under `directory`, tagged train/<metric>."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.error: str | None = None
        self._writer: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(directory))
        except Exception as exc:  # the tensorboard package missing, an unwritable directory
            self._fail("start", exc)

    def _fail(self, what: str, exc: BaseException) -> None:
        if self.error is None:
            self.error = f"tensorboard {what} failed: {type(exc).__name__}: {exc}"
            warnings.warn(f"{self.error}; TensorBoard logging is off for the rest of this run", RuntimeWarning, stacklevel=3)
        self._writer = None

    def log(self, metrics: Mapping[str, float | int | None], *, step: int) -> None:
        if self._writer is None:
            return
        try:
            for name, value in metrics.items():
                if value is not None:
                    self._writer.add_scalar(f"train/{name}", value, global_step=step)
        except Exception as exc:
            self._fail("log", exc)

    def close(self) -> None:
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        try:
            writer.close()
        except Exception as exc:
            self._fail("close", exc)


class MetricSinks:
    """W&B (a WandbLogger, disabled on ranks other than 0) and, when asked, TensorBoard."""

    def __init__(self, wandb: WandbLogger, *, tensorboard_dir: Path | None) -> None:
        self.wandb = wandb
        self.tensorboard = TensorBoardWriter(tensorboard_dir) if tensorboard_dir is not None else None

    @classmethod
    def for_run(cls, wandb: WandbLogger, *, enabled: bool, run_dir: Path) -> MetricSinks:
        return cls(wandb, tensorboard_dir=run_dir / TENSORBOARD_DIR if enabled else None)

    def __call__(self, stats: IterationStats) -> None:
        metrics = iteration_metrics(stats)
        self.wandb.log(metrics, step=stats.iteration)
        if self.tensorboard is not None:
            self.tensorboard.log(metrics, step=stats.iteration)

    def errors(self) -> list[str]:
        """What failed, for the record's warnings."""
        found = [self.wandb.error, self.tensorboard.error if self.tensorboard is not None else None]
        return [e for e in found if e]

    def finish(self, *, summary: Mapping[str, Any], ok: bool) -> None:
        self.wandb.summary(summary)
        self.wandb.finish(exit_code=0 if ok else 1)
        if self.tensorboard is not None:
            self.tensorboard.close()
