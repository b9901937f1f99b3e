"""Weights & Biases logging that can never stop or stall training.

One W&B run per job. Every call into wandb is guarded, and a failure never loses the figures:

- online init fails (no network, the server down, no API key): the run starts offline instead;
- a call fails mid-run (wandb's service died, say): the run goes on in a new offline run into
  which the history logged so far is replayed (the broken run's local directory is removed, so
  that one job keeps one run on disk);

either way one warning line on stderr names the error and the exact `wandb sync <dir>` command
that uploads the offline run later, and the record's warnings keep it. Only when the offline run
fails too (a full disk, wandb not importable) is W&B off for the rest of the run, said once; the
benchmark goes on and result.json stays the source of truth. `wandb.init` gets a bounded
`init_timeout` (logger.wandb_init_timeout_s), and with mode `disabled` wandb is not imported at
all (it costs about a second of start-up).

Mode: WANDB_MODE in the environment wins over logger.wandb_mode, so a site or a test can
force offline without touching configs. Group: logger.wandb_group, else the Hydra sweep's
name, so that one sweep's runs sit together.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from conf.schema import LoggerConfig
from train.metrics import is_secret_name

INIT_TIMEOUT_S = 30.0
"""Default of logger.wandb_init_timeout_s (seconds); offline init takes well under one."""


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _warn(text: str) -> None:
    # One line, on stderr as the other warnings of a run: the job's train.log and Slurm's file keep it.
    print(f"warning: {text}", file=sys.stderr, flush=True)


class WandbLogger:
    """W&B run wrapper: init / log / summary / finish; falls back to offline, and is a no-op once off."""

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
        """What went wrong with W&B, and where the figures went instead; None while all is well."""
        self.offline_dir: Path | None = None
        """The offline run a failure moved the run to (what `wandb sync` uploads); None otherwise."""
        # Every row logged: a run that moves to offline mid-way replays them. Benchmark runs log
        # one row of a dozen scalars per iteration, for tens to thousands of iterations.
        self._history: list[tuple[int, dict[str, Any]]] = []
        self._summary: dict[str, Any] = {}
        self._output_dir = output_dir
        self._init_args: dict[str, Any] = dict(
            project=logger.wandb_project,
            entity=logger.wandb_entity,
            group=logger.wandb_group or group or hydra_sweep_name(),
            name=name,
            config=dict(config),
            dir=str(output_dir),
        )
        self._init_timeout = float(getattr(logger, "wandb_init_timeout_s", INIT_TIMEOUT_S))
        if self.mode == "disabled":
            return
        before = self._local_runs()
        try:
            self.run = self._init(self.mode)
        except Exception as exc:
            if self.mode == "offline":
                # Offline again would fail the same way.
                self._off("init", exc)
                return
            # The failed attempt leaves a run directory with a stub log that readers would take for a run.
            for stub in self._local_runs() - before:
                shutil.rmtree(stub, ignore_errors=True)
            self._fall_back("init", exc)

    @property
    def enabled(self) -> bool:
        return self.run is not None

    def _local_runs(self) -> set[Path]:
        return {p for p in (self._output_dir / "wandb").glob("run-*") if p.is_dir()}

    def _init(self, mode: str, *, beside_another: bool = False) -> Any:
        import wandb

        return wandb.init(
            **self._init_args,
            mode=mode,  # type: ignore[arg-type]  # checked by wandb itself
            settings=wandb.Settings(
                init_timeout=self._init_timeout,
                console="off",  # W&B must not wrap stdout: the log lines go to Slurm's file as they are
                quiet=True,
                # A remote URL can embed a token, and the command line an override holding a
                # credential: W&B would store both. The record keeps the commit itself.
                disable_git=True,
                x_disable_meta=argv_has_secret(sys.argv),
                # By default wandb.init hands back the run still open, broken or not.
                reinit="create_new" if beside_another else "default",
            ),
        )

    def _off(self, what: str, exc: BaseException, *, also: BaseException | None = None) -> None:
        if self.error is None:
            after = f"; the offline run failed too: {_first_line(also)}" if also is not None else ""
            self.error = f"wandb {what} failed ({self.mode}): {_first_line(exc)}{after}"
            _warn(f"{self.error}; W&B logging is off for the rest of this run")
        self.run = None

    def _fall_back(self, what: str, exc: BaseException) -> bool:
        """Carry on in a new offline run holding the history so far; False (and W&B off) when even
        that fails, or when the run already fell back once."""
        failed, self.run = self.run, None
        if self.offline_dir is not None:
            self._off(what, exc)
            return False
        if failed is not None:
            self._abandon(failed)
        try:
            run = self._init("offline", beside_another=failed is not None)
            for step, metrics in self._history:
                run.log(metrics, step=step)
            if self._summary:
                run.log({}, commit=True)
                run.summary.update(self._summary)
        except Exception as again:
            self._off(what, exc, also=again)
            return False
        was, self.mode, self.run = self.mode, "offline", run
        self.offline_dir = Path(run.settings.sync_dir)
        self.error = (
            f"wandb {what} failed ({was}): {_first_line(exc)}; logging offline instead, to {self.offline_dir}; "
            f"upload it later with: wandb sync {shlex.quote(str(self.offline_dir))}"
        )
        _warn(self.error)
        return True

    def _abandon(self, run: Any) -> None:
        """Let go of a run that failed mid-way: stop wandb's service (a dead one fails every later
        call, a live one finishes the run), and remove the run's own directory, whose history
        the offline run replays."""
        import wandb

        try:
            local = Path(run.settings.sync_dir)
        except Exception:
            local = None
        # teardown raises SystemExit with the service's exit code when the service failed.
        with contextlib.suppress(Exception, SystemExit):
            wandb.teardown()
        if local is not None and local.parent == self._output_dir / "wandb":
            shutil.rmtree(local, ignore_errors=True)

    def _call(self, what: str, action: Callable[[Any], None], *, again: bool) -> None:
        """action(run), guarded; on failure, the offline fallback, where `again` repeats the action."""
        if self.run is None:
            return
        try:
            action(self.run)
        except Exception as exc:
            if self._fall_back(what, exc) and again:
                try:
                    action(self.run)
                except Exception as last:
                    self._off(what, last)

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        if self.run is None:
            return
        row = dict(metrics)
        self._history.append((step, row))
        # No second attempt: the fallback replays the history, this row included.
        self._call("log", lambda run: run.log(row, step=step), again=False)

    def summary(self, figures: Mapping[str, Any]) -> None:
        values = {k: v for k, v in figures.items() if v is not None}
        if self.run is not None:
            self._summary.update(values)

        def update(run: Any) -> None:
            # Commit the last history row first: W&B otherwise writes it at finish, after
            # this update, and the last iteration's figures would replace the medians.
            run.log({}, commit=True)
            run.summary.update(values)

        self._call("summary", update, again=True)

    def reconfigure(self, config: Mapping[str, Any], *, name: str) -> None:
        """The run's config and name as training settled them (micro_batch_size=auto: the size chosen
        once the workers measured it; W&B kept "auto", and the analysis of its runs no layout)."""
        self._init_args.update(config=dict(config), name=name)  # for a run moved to offline later

        def update(run: Any) -> None:
            run.config.update(dict(config), allow_val_change=True)
            run.name = name

        self._call("config", update, again=True)

    def finish(self, *, exit_code: int = 0) -> None:
        self._call("finish", lambda run: run.finish(exit_code=exit_code), again=True)
        if self.run is not None and self.mode == "offline" and self.offline_dir is None:
            # quiet=True keeps wandb's own closing lines off the console, its sync hint with them: an
            # offline run says once where it is and how to upload it (one fallen back to has said so in
            # its warning, which the record keeps).
            local = Path(self.run.settings.sync_dir)
            print(f"W&B: offline run in {local}; upload it with: wandb sync {shlex.quote(str(local))}", flush=True)
        self.run = None
