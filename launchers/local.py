"""Local launcher: run each config of a sweep on this machine, one after another.

    python -m train -m parallelism.tp=1,2 hydra/launcher=local

Configs are composed and validated exactly as `hydra/launcher=slurm` does (infeasible ones
become `skipped` manifest entries), then each runs as `python -m train <overrides>
hydra.run.dir=<sweep dir>/<subdir>` in a subprocess (hydra.sweep.subdir resolved per config as
the Slurm launcher does: the index by default), with cluster.env exported; the trainer
starts the processes a multi-device layout needs itself. A run still going at its
cluster.time_limit_min gets SIGTERM, and SIGKILL 30 s later, as Slurm ends a job (it ran on).
The manifest (job_id null) and the result.json files are those of a Slurm sweep, so `python -m
launchers status` and the analysis read both alike. A failed config does not stop the sweep; the launcher reports
every failure to Hydra at the end, as Hydra's own launchers do. Ctrl-C stops the sweep: the
running config records itself `interrupted`, and the configs not yet started become
`interrupted` manifest entries (they would otherwise read as pending for ever), as does the running
one when it was stopped before it wrote its record (in its start-up). The launch
settings are saved as the Slurm launcher saves them, so `python -m launchers rerun --failed`
runs the failed and interrupted configs here again (run_here).

A sweep of any other Hydra app (a config not composed on megasweep's schema) runs as Hydra's
basic launcher runs it: each job's task function in this process, one after another.

Torch-free, like everything a launcher imports.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals

from launchers.compose import (
    HydraJob,
    SweepLauncher,
    is_megasweep_config,
    job_return,
    prepare_sweep_dir,
    sweep_composer,
    usage_exits,
)
from launchers.entry import check_entry
from launchers.states import process_start
from launchers.submit import (
    ConfigSpec,
    LaunchFailed,
    LaunchSettings,
    check_output_dirs,
    command_for,
    entry_args_for,
    entry_for,
    failed_configs_hint,
    infeasible_summary,
    launch_failure,
    merge_entries,
    plan_configs,
    refuse_empty_sweep,
    save_launch_file,
    subdir_namer,
)
from launchers.sweepdir import check_indices_free, sweep_lock
from train.contract import (
    RESULT_FILE,
    LocalRun,
    local_run_path,
    manifest_path,
    read_manifest,
    write_json_atomic,
    write_manifest,
)
from train.preemption import raise_if_interrupted

__all__ = ["INTERRUPTED_BEFORE_RECORD", "INTERRUPTED_BEFORE_START", "LocalLauncher", "LocalMarks", "run_here"]

INTERRUPTED_BEFORE_START = "the local sweep was interrupted (Ctrl-C) before this config started"
"""The reason of an `interrupted` manifest entry."""
INTERRUPTED_BEFORE_RECORD = (
    "the local sweep was interrupted (Ctrl-C) while this config started, before it wrote result.json"
)
"""The reason of the running config's `interrupted` entry when it was stopped before its record."""


def run_here(
    runs: Sequence[tuple[ConfigSpec, LaunchSettings]], sweep_dir: Path, *, marks: LocalMarks | None = None
) -> dict[int, tuple[JobStatus, Any]]:
    """Run each config as a subprocess on this machine, in order, the way its settings say (a rerun
    may mix launches): (status, value) by index.

    A failed config does not stop the others. On Ctrl-C the configs not yet started are marked
    `interrupted` in the manifest, and the interrupt goes on (the running one, which got the same
    SIGINT, records itself). `marks`: the LocalRun file of these configs, when the caller wrote it
    already (a rerun, while it held the sweep's lock); written here otherwise.
    """
    outcomes: dict[int, tuple[JobStatus, Any]] = {}
    started: set[int] = set()
    specs = [spec for spec, _ in runs]
    marks = marks or LocalMarks(sweep_dir, [s.index for s in specs])
    try:
        for n, (spec, settings) in enumerate(runs, start=1):
            started.add(spec.index)
            print(f"local: [{n}/{len(specs)}] config {spec.index}: {' '.join(spec.overrides)}", flush=True)
            try:
                marks.start(spec.index)
                command = command_for(spec, settings, sweep_dir)
                record = command()
                if not (sweep_dir / spec.output_dir / RESULT_FILE).exists():
                    # An entry module that is not megasweep's trainer (hydra.launcher.module): Slurm's
                    # COMPLETED says so of a job; here the config read pending for ever.
                    raise RuntimeError(f"`{' '.join(command.argv)}` exited with status 0 without writing {RESULT_FILE}")
                outcomes[spec.index] = (JobStatus.COMPLETED, record)
            except Exception as exc:  # reported to Hydra below, after the other configs have run
                # A Ctrl-C whose KeyboardInterrupt another error replaced on its way out (a cleanup
                # that raised, e.g. an echo into a closed stdout) stops the sweep all the same.
                raise_if_interrupted(exc)
                print(f"local: config {spec.index} failed: {exc}", file=sys.stderr, flush=True)
                outcomes[spec.index] = (JobStatus.FAILED, exc)
                if not (sweep_dir / spec.output_dir / RESULT_FILE).exists():
                    # Killed before its record (SIGKILL, the OOM killer): only this process saw it end.
                    _mark(sweep_dir, {spec.index: str(exc)}, "failed")
            finally:
                marks.end(spec.index)
    except KeyboardInterrupt:
        never = {s.index for s in specs} - started
        reasons = dict.fromkeys(never, INTERRUPTED_BEFORE_START)
        # The running config (its trainer got the same SIGINT and has exited) records itself, unless
        # the interrupt came before it could (imports, W&B start-up): it would read pending for ever.
        running = [s for s in specs if s.index in started and s.index not in outcomes]
        for spec in running:
            if not (sweep_dir / spec.output_dir / RESULT_FILE).exists():
                reasons[spec.index] = INTERRUPTED_BEFORE_RECORD
        _mark(sweep_dir, reasons, "interrupted")
        raise
    finally:
        marks.clear()
    return outcomes


class LocalMarks:
    """This launch and the configs it has yet to end, in its LocalRun file (train.contract): all queued
    at the start, one running from start(), each dropped by end(), the file removed by clear(). A local
    sweep's manifest names no Slurm job to ask, so `status` would call the running config pending, and
    every config of a launcher that was killed pending for ever. The file outlives the launch only
    when this process is killed, which `status` then sees (launchers.states.local_run_state)."""

    def __init__(self, sweep_dir: Path, indices: Sequence[int]) -> None:
        pid = os.getpid()
        self.run = LocalRun(socket.gethostname(), pid, process_start(pid), tuple(indices))
        self.path = local_run_path(sweep_dir, self.run.host, pid)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._save(self.run)

    def start(self, index: int) -> None:
        self._save(dataclasses.replace(self.run, running=index))

    def end(self, index: int) -> None:
        self._save(dataclasses.replace(self.run, queued=tuple(i for i in self.run.queued if i != index), running=None))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def _save(self, run: LocalRun) -> None:
        self.run = run
        write_json_atomic(self.path, dataclasses.asdict(run))


def _mark(sweep_dir: Path, reasons: dict[int, str], status: str) -> None:
    """The manifest entries of `reasons`' configs given `status`, each with its reason."""
    path = manifest_path(sweep_dir)
    with sweep_lock(sweep_dir):  # configs added to the sweep meanwhile stay listed
        write_manifest(
            [dataclasses.replace(e, status=status, reason=reasons[e.index]) if e.index in reasons else e
             for e in read_manifest(path)],
            path,
        )  # fmt: skip


class LocalLauncher(SweepLauncher):
    """Hydra launcher running each config as a local subprocess, in order (`hydra/launcher=local`).

    Options (hydra.launcher.*): python (null: this interpreter), module (entry module of each run),
    append (add the configs to the sweep already in hydra.sweep.dir, with new indices; without it
    such a directory is refused: launchers.sweepdir). A launch with nothing to run (every config
    infeasible) fails; so does one whose python or module cannot start here (launchers.entry).
    """

    def __init__(self, python: str | None = None, module: str = "train", append: bool = False) -> None:
        super().__init__(append)
        self.python = python
        self.module = module

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # Under any sweeper (Hydra's basic one too), a refusal of the input exits as bad input.
        with self.keeping_earlier_config(), usage_exits():
            return self._launch(job_overrides, initial_job_idx)

    def _launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        if not is_megasweep_config(self.config):
            return self._launch_hydra_jobs(job_overrides, initial_job_idx)
        if self._first_index is None:  # a sweep's first batch; a later one is never empty
            refuse_empty_sweep(job_overrides)
            entry = (self.python or sys.executable, self.module, str(self.config.hydra.runtime.cwd))
            # Every config runs here: what cannot start one cannot start any (it failed each in turn).
            check_entry(*entry, options=("hydra.launcher.python", "hydra.launcher.module"), here=True)
        composer = sweep_composer(self.hydra_context.config_loader, self.config)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        settings = LaunchSettings(
            python=self.python or sys.executable,
            module=self.module,
            cwd=str(self.config.hydra.runtime.cwd),
            job_name=self.module,
            max_array_size=1,  # unused: nothing is submitted
            entry_args=entry_args_for(self.config),
            local=True,
        )
        path = manifest_path(sweep_dir)
        # Locked from the claim of the batch's indices until the manifest lists them (sweep_lock).
        with self.claimed(sweep_dir) as first:
            # here: the runs are this machine's, so a path they would refuse is refused before any runs.
            specs, skipped = plan_configs(composer, job_overrides, first + initial_job_idx,
                                          subdir=subdir_namer(self.config, composer), undone="nothing was run",
                                          here=True, paths=self.paths)  # fmt: skip
            queued = [entry_for(s, "submitted") for s in specs]
            entries = sorted([*skipped, *queued], key=lambda e: e.index)
            # Earlier batches of this sweep, or the sweep it is appended to.
            old = read_manifest(path) if path.exists() else []
            check_indices_free(old, entries, sweep_dir)
            merged = merge_entries(old, entries)
            check_output_dirs(merged)
            save_launch_file(sweep_dir, settings, specs)
            # Written before the first run, so that `status` follows the sweep while it runs.
            write_manifest(merged, path)
        print(
            f"local: {len(entries)} configs: {len(specs)} to run, {len(skipped)} infeasible -> {path}",
            flush=True,
        )
        for line in infeasible_summary(entries):
            print(f"local: {line}", file=sys.stderr, flush=True)
        failure = launch_failure(entries, sweep_dir)
        if failure is not None:
            raise failure

        outcomes = run_here([(spec, settings) for spec in specs], sweep_dir)
        failed = [i for i, (status, _) in sorted(outcomes.items()) if status == JobStatus.FAILED]
        if failed:
            # One paragraph, as Hydra prints a CompactHydraException, instead of the traceback Hydra's
            # sweeper prints for a failed JobReturn (each failure's own words are above, and in its log).
            raise LaunchFailed(
                f"{len(failed)} of {len(specs)} configs failed ({', '.join(map(str, failed[:10]))}"
                f"{', ...' if len(failed) > 10 else ''}){'; every other config ran' if len(specs) > len(failed) else ''}. "
                f"{failed_configs_hint(sweep_dir)}"
            )
        task_name = str(self.config.hydra.job.name)
        returns = []
        for e in entries:
            status, value = outcomes.get(e.index, (JobStatus.COMPLETED, e.to_json()))
            returns.append(job_return(e, sweep_dir=sweep_dir, task_name=task_name, status=status, value=value))
        return returns

    def _launch_hydra_jobs(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> list[JobReturn]:
        """A sweep of any other Hydra app: each job in this process, in order, as Hydra's basic launcher."""
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        prepare_sweep_dir(self.config)
        # In-process: Hydra's singletons are already those of the sweep, nothing to ship.
        job = HydraJob(self.hydra_context, self.config, self.task_function)
        return [
            job(overrides, job_num=num, job_id=f"job_id_for_{num}")
            for num, overrides in enumerate(job_overrides, start=initial_job_idx)
        ]
