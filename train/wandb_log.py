"""Weights & Biases logging that can never stop or stall training.

One W&B run per job. Every call into wandb is guarded: the first exception (no network,
bad credentials, a full disk, a wandb bug) is reported once as a warning and W&B is off
for the rest of the run; the benchmark goes on and result.json stays the source of truth.
`wandb.init` gets a bounded `init_timeout`, and with mode `disabled` wandb is not imported
at all (it costs about a second of start-up).

Mode: WANDB_MODE in the environment wins over logger.wandb_mode, so a site or a test can
force offline without touching configs. Group: logger.wandb_group, else the Hydra sweep's
name, so that one sweep's runs sit together.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conf.schema import LoggerConfig
from train.metrics import is_secret_name

INIT_TIMEOUT_S = 30.0
"""Longest wandb.init may wait for its service (seconds); offline init takes well under one."""


def resolve_mode(logger: LoggerConfig, environ: Mapping[str, str] | None = None) -> str:
    """offline | online | disabled: WANDB_MODE in the environment may switch W&B off or between
    online and offline, but never on where the config says `disabled` (the trainer disables it
    on every rank but 0, and one run per job must stay one run)."""
    configured = str(getattr(logger.wandb_mode, "value", logger.wandb_mode))
    if configured == "disabled":
        return "disabled"
    env = (environ if environ is not None else os.environ).get("WANDB_MODE", "").strip()
    mode = env or configured
    return "disabled" if mode in ("disabled", "off", "dryrun_disabled") else mode


def argv_has_secret(argv: list[str]) -> bool:
    """True when a command-line override sets a credential-named key (`+cluster.env.HF_TOKEN=...`)."""
    return any(is_secret_name(arg.partition("=")[0]) for arg in argv[1:] if "=" in arg)


def hydra_sweep_name() -> str | None:
    """Name of the Hydra multirun this job belongs to (the sweep directory's name), if any.

    Looked up here rather than passed down so the trainer's signature stays Hydra-free.
    """
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return None
        cfg = HydraConfig.get()
        return Path(cfg.sweep.dir).name if cfg.mode == RunMode.MULTIRUN else None
    except Exception:
        return None


class WandbLogger:
    """W&B run wrapper: init / log / summary / finish, each a no-op once W&B is off."""

    def __init__(
        self,
        logger: LoggerConfig,
        *,
        config: Mapping[str, Any],
        output_dir: Path,
        name: str | None = None,
        group: str | None = None,
    ) -> None:
        self.mode = resolve_mode(logger)
        self.run: Any = None
        self.error: str | None = None
        if self.mode == "disabled":
            return
        try:
            import wandb

            self.run = wandb.init(
                project=logger.wandb_project,
                entity=logger.wandb_entity,
                group=logger.wandb_group or group or hydra_sweep_name(),
                name=name,
                config=dict(config),
                dir=str(output_dir),
                mode=self.mode,  # type: ignore[arg-type]  # checked by wandb itself
                settings=wandb.Settings(
                    init_timeout=INIT_TIMEOUT_S,
                    console="off",  # W&B must not wrap stdout: the log lines go to Slurm's file as they are
                    quiet=True,
                    # A remote URL can embed a token, and the command line an override holding a
                    # credential: W&B would store both. The record keeps the commit itself.
                    disable_git=True,
                    x_disable_meta=argv_has_secret(sys.argv),
                ),
            )
        except Exception as exc:
            self._disable("init", exc)

    @property
    def enabled(self) -> bool:
        return self.run is not None

    def _disable(self, what: str, exc: BaseException) -> None:
        if self.error is None:
            self.error = f"wandb {what} failed: {type(exc).__name__}: {exc}"
            warnings.warn(
                f"{self.error}; W&B logging is off for the rest of this run", RuntimeWarning, stacklevel=3
            )
        self.run = None

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log(dict(metrics), step=step)
        except Exception as exc:
            self._disable("log", exc)

    def summary(self, figures: Mapping[str, Any]) -> None:
        if self.run is None:
            return
        try:
            # Commit the last history row first: W&B otherwise writes it at finish, after
            # this update, and the last iteration's figures would replace the medians.
            self.run.log({}, commit=True)
            self.run.summary.update({k: v for k, v in figures.items() if v is not None})
        except Exception as exc:
            self._disable("summary", exc)

    def finish(self, *, exit_code: int = 0) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:
            self._disable("finish", exc)
