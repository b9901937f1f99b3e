"""Slurm launcher: one job array per resource shape, infeasible configs pruned before sbatch.

    python -m train -m parallelism.tp=1,2,4 training.lr=1e-4,3e-4 hydra/launcher=slurm

Every config of the sweep is composed with the shared FastComposer (one Hydra compose per
distinct group choice) and checked with train.validation on the login node. Infeasible
configs become `skipped` manifest entries with the validator's paragraph as their reason;
nothing is queued for them. The others are grouped by ArrayKey (launchers/shapes.py: nodes,
tasks and GPUs per node, time limit, sbatch options) and each group is submitted as one job
array through submitit, split at the cluster's MaxArraySize and throttled with %N. Each array
task runs `python -m train <overrides> hydra.run.dir=<its output dir>` under srun, one srun
task per device, with cluster.env exported (env is per config, so sweeping it never splits
an array). srun runs with --kill-on-bad-exit: a rank that fails ends its peers at once instead
of leaving them stuck in a collective until the time limit.

W&B group: each run of a sweep whose config leaves logger.wandb_group unset gets the sweep
directory's name through W&B's own WANDB_RUN_GROUP (a run is a plain `python -m train`, not a
Hydra multirun job, so it cannot find the sweep's name itself). Not as an override: the record
keeps its overrides, which identify the config across sweeps (analysis compare), and a group
named after each sweep would make every sweep's configs look different.

Requeue (time limit, preemption): jobs are submitted with --requeue and --signal=USR1@<lead>
(lead: REQUEUE_SIGNAL_LEAD_S, at most a quarter of the time limit; sbatch_args `signal` wins).
A checkpointing trainer (training.save_interval > 0) saves at the next step boundary on USR1
and exits with REQUEUE_EXIT_CODE; the array task then requeues itself (`scontrol requeue`)
while SLURM_RESTART_COUNT < cluster.max_retries, keeping the stopped attempt's record as
result.attempt<N>.json, and the next attempt resumes from the checkpoint. Past max_retries the
`timeout` record stands and the job fails. TrainCommand is that in-job wrapper; the array
scripts of `python -m launchers sbatch` run the same one as `python -m launchers.slurm
--output-dir DIR --max-retries N -- <trainer command>` (see main()).

Output directories: config i goes to <sweep dir>/<hydra.sweep.subdir>, resolved per config as
Hydra would (default ${hydra.job.num}: the config's index). A subdir other than the default is
resolved by composing each config in full (tens of milliseconds each) with hydra.job.num and
hydra.job.override_dirname set, so it may use those and the config's own values; hydra.job.id
is refused (it is only known once the job runs). The resolved directories must be relative,
distinct, and not hidden (the analysis skips hidden directories).

By default the launcher returns once the arrays are queued: <sweep dir>/manifest.jsonl says
what went where, `python -m launchers status <sweep dir>` follows progress (also after this
process has gone), and `python -m launchers rerun <sweep dir> --failed` resubmits failures.
The manifest is rewritten (atomically) after each array is queued, so a launcher killed
between two arrays leaves one that lists exactly what was queued (and the infeasible configs).
An sbatch that Slurm refuses (unknown partition, bad gres) marks that group's configs
`refused` with Slurm's own message; the other groups still go ahead.

A sweep of any other Hydra app (a config not composed on megasweep's schema) is run the way
hydra-submitit-launcher runs it: one job array, one task per job, each task composing its
config on the node and calling the app's task function (pickled by submitit); the launcher
waits for the array and returns each job's JobReturn, as Hydra's launcher contract wants.

What a rerun needs to resubmit a config without Hydra (its command, environment and array
key) is kept in <sweep dir>/.megasweep/launch.json.

Torch-free, like everything a launcher imports; torch is imported only inside the jobs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.config_loader_impl import get_overrides_dirname
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.errors import CompactHydraException, HydraException
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from analysis.manifest import (
    REFUSED_PREFIX,
    ManifestEntry,
    manifest_path,
    normalize_dir,
    read_manifest,
    write_manifest,
)
from conf.schema import RunConfig
from launchers.compose import FastComposer, SweepLauncher, is_megasweep_config, parse_override, sweep_composer
from launchers.shapes import ArrayKey, SbatchOptions, Shape, array_key, chunk, group_by
from train.validation import InfeasibleConfig, validate

__all__ = [
    "DEFAULT_MAX_ARRAY_SIZE",
    "LAUNCH_FILE",
    "REFUSED_PREFIX",
    "REQUEUE_EXIT_CODE",
    "ConfigSpec",
    "HydraJob",
    "LaunchSettings",
    "SlurmLauncher",
    "Submission",
    "SubdirNamer",
    "TrainCommand",
    "check_output_dirs",
    "load_launch_file",
    "main",
    "merge_entries",
    "entry_args_for",
    "plan_config",
    "plan_configs",
    "read_max_array_size",
    "run_env",
    "save_launch_file",
    "signal_lead_s",
    "subdir_namer",
    "submit_configs",
    "submit_hydra_jobs",
]

LAUNCH_FILE = ".megasweep/launch.json"
RESULT_FILE = "result.json"  # written by train.trainer.run_training (not imported: it needs torch)
REQUEUE_EXIT_CODE = 75
"""The trainer's 'checkpointed on Slurm's signal, requeue me' status (train.checkpoint.REQUEUE_EXIT_CODE;
repeated here because that module imports torch)."""
REQUEUE_SIGNAL_LEAD_S = 120
"""How long before the time limit Slurm sends USR1 (seconds): time for a step and a checkpoint."""
WANDB_GROUP_ENV = "WANDB_RUN_GROUP"
# Slurm's own default when scontrol cannot be asked.
DEFAULT_MAX_ARRAY_SIZE = 1001
DEFAULT_SUBDIR = "${hydra.job.num}"
"""Hydra's hydra.sweep.subdir: the config's index, which needs no composition to name."""


@dataclass(frozen=True)
class TrainCommand:
    """What one array task runs: picklable (submitit ships it to the node), no torch inside.

    Runs the trainer as a subprocess so that each srun task is a fresh interpreter whose
    torch.distributed start-up reads SLURM_PROCID / SLURM_NTASKS; returns the run's
    result.json (the value Hydra's JobReturn carries with hydra.launcher.wait=true).
    """

    argv: tuple[str, ...]
    cwd: str
    output_dir: str
    env: tuple[tuple[str, str], ...] = ()
    max_retries: int = 0
    """Requeues allowed after the trainer stopped on Slurm's signal with a checkpoint."""

    def __call__(self) -> dict[str, Any]:
        code = self.run()
        result = Path(self.output_dir) / RESULT_FILE
        if code != 0:
            raise RuntimeError(self.failure(code))
        record: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
        return record

    def run(self) -> int:
        """Run the trainer and return its exit status; on REQUEUE_EXIT_CODE, requeue this job while
        retries remain (and then never return)."""
        env = {**os.environ, **dict(self.env)}
        # Slurm's USR1 warning reaches every process of the step; its default action would kill
        # this one (the task's wrapper process) while the trainer is still saving its checkpoint.
        _ignore_in_this_process(signal.SIGUSR1)
        # Inherited stdout/stderr: the trainer's log lines land in the task's Slurm log as they come.
        proc = subprocess.run(list(self.argv), cwd=self.cwd, env=env, check=False)
        if proc.returncode == REQUEUE_EXIT_CODE:
            self._requeue_or_give_up(os.environ, Path(self.output_dir) / RESULT_FILE)
        return proc.returncode

    def failure(self, code: int) -> str:
        """The message of a trainer that exited with status `code`."""
        result = Path(self.output_dir) / RESULT_FILE
        where = f"; record: {result}" if result.exists() else " before writing result.json"
        return f"`{' '.join(self.argv)}` exited with status {code}{where}"

    def _requeue_or_give_up(self, environ: Mapping[str, str], result: Path) -> None:
        """Requeue this job while retries remain (never returns then); return to fail it otherwise."""
        restarts = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
        if restarts >= self.max_retries:
            print(
                f"slurm: trainer stopped for a requeue, but cluster.max_retries={self.max_retries} "
                f"requeue(s) are used up ({restarts} done): the job ends here",
                file=sys.stderr,
                flush=True,
            )
            return
        job = slurm_job_id(environ)
        if int(environ.get("SLURM_PROCID", "0")) == 0:
            # The stopped attempt's record stays beside the next one's: `status` must not read
            # its `timeout` as the config's outcome while the job waits to run again.
            kept = result.with_name(f"result.attempt{restarts}.json")
            if result.exists():
                os.replace(result, kept)
            try:
                subprocess.run(
                    ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=True
                )
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", None) or exc
                print(f"slurm: scontrol requeue {job} failed: {detail}", file=sys.stderr, flush=True)
                if kept.exists():
                    os.replace(kept, result)
                return
            print(f"slurm: requeued {job} (retry {restarts + 1} of {self.max_retries})", flush=True)
        # No return value, no exception: submitit would pickle either as this job's result, and a
        # waiting launcher would take the stopped attempt's outcome for the job's.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(REQUEUE_EXIT_CODE)


def _ignore_in_this_process(signum: signal.Signals) -> None:
    # A Python handler, not SIG_IGN: an ignored signal stays ignored across exec, and the trainer
    # child must get the signal's default meaning until it installs its own handler.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, lambda *_: None)


def slurm_job_id(environ: Mapping[str, str]) -> str:
    """This job's id as scontrol knows it: '<array>_<task>' for an array task."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else environ.get("SLURM_JOB_ID", "")


def signal_lead_s(time_limit_min: int) -> int:
    """Seconds between Slurm's USR1 warning and the time limit: REQUEUE_SIGNAL_LEAD_S, but at most
    a quarter of the limit, so a short job is not warned at its start."""
    return max(min(REQUEUE_SIGNAL_LEAD_S, time_limit_min * 60 // 4), 1)


@dataclass(frozen=True)
class ConfigSpec:
    """One feasible config, ready to submit (everything needed, nothing Hydra)."""

    index: int
    overrides: tuple[str, ...]
    output_dir: str
    """Relative to the sweep directory."""
    key: ArrayKey
    env: tuple[tuple[str, str], ...]
    max_retries: int = 0
    """cluster.max_retries of the config."""
    wandb_group: str | None = None
    """logger.wandb_group of the config; None: the sweep's name is the group."""


@dataclass(frozen=True)
class LaunchSettings:
    """Launcher-wide settings, stored with the sweep so that a rerun submits the same way."""

    python: str
    """Interpreter of the jobs (submitit's and the trainer's)."""
    module: str
    """Entry module run per config (`python -m <module> <overrides>`)."""
    cwd: str
    """Working directory of the jobs (the submitting process's, so `-m train` resolves)."""
    job_name: str
    max_array_size: int
    """Largest array Slurm accepts (tasks); bigger groups are split."""
    entry_args: tuple[str, ...] = ()
    """Arguments before the overrides (--config-name, --config-dir)."""
    sbatch_args: Mapping[str, str] = field(default_factory=dict)
    """Extra sbatch options, without the leading dashes ({'exclusive': ''} gives --exclusive)."""
    srun_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Submission:
    """Outcome of submitting a set of configs: manifest entries, and submitit jobs by index."""

    entries: list[ManifestEntry]
    jobs: dict[int, Any]
    arrays: list[str]
    """Slurm job ids of the arrays (or single jobs) queued, one per group chunk."""


def read_max_array_size(default: int = DEFAULT_MAX_ARRAY_SIZE) -> int:
    """MaxArraySize from `scontrol show config`, or `default` when scontrol does not answer."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return default
    match = re.search(r"^\s*MaxArraySize\s*=\s*(\d+)", out, flags=re.MULTILINE)
    return int(match.group(1)) if match else default


def run_dir_override(path: Path) -> str:
    """`hydra.run.dir=<path>`, quoted when Hydra's override grammar needs it."""
    text = str(path)
    if re.fullmatch(r"[\w/.\-+@%]+", text):
        return f"hydra.run.dir={text}"
    if "'" in text or "\\" in text:
        raise HydraException(
            f"sweep directory {text!r} has a quote or backslash: pick another hydra.sweep.dir"
        )
    return f"hydra.run.dir='{text}'"


def plan_config(
    run: RunConfig, *, array_parallelism: int | None = None
) -> tuple[ArrayKey | None, str | None]:
    """(array key, None) for a feasible run; (None, reason) for one that must not be submitted."""
    violations = validate(run, world_size=None)
    if violations:
        return None, str(InfeasibleConfig(violations))
    try:
        return array_key(run, array_parallelism=array_parallelism), None
    except ValueError as exc:
        return None, f"infeasible config: {exc}"


def plan_configs(
    composer: FastComposer,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    *,
    array_parallelism: int | None = None,
    subdir: SubdirNamer | None = None,
) -> tuple[list[ConfigSpec], list[ManifestEntry]]:
    """Compose and validate each job: specs of the feasible ones, skipped entries for the rest.

    Config i's output directory is `subdir(initial_job_idx + i, overrides)` (see subdir_namer);
    without `subdir`, `<initial_job_idx + i>`, as Hydra's default hydra.sweep.subdir
    (${hydra.job.num}) names it.
    """
    specs: list[ConfigSpec] = []
    skipped: list[ManifestEntry] = []
    for offset, overrides in enumerate(job_overrides):
        index = initial_job_idx + offset
        run = composer.run_config(overrides)
        output_dir = str(index) if subdir is None else subdir(index, overrides)
        key, reason = plan_config(run, array_parallelism=array_parallelism)
        if key is None:
            skipped.append(
                ManifestEntry(
                    index=index,
                    overrides=tuple(overrides),
                    output_dir=output_dir,
                    status="skipped",
                    reason=reason,
                )
            )
            continue
        env = tuple(sorted((str(k), str(v)) for k, v in run.cluster.env.items()))
        specs.append(
            ConfigSpec(
                index,
                tuple(overrides),
                output_dir,
                key,
                env,
                max_retries=run.cluster.max_retries,
                wandb_group=run.logger.wandb_group,
            )
        )
    if subdir is not None:
        check_output_dirs([*specs, *skipped])
    return specs, skipped


SubdirNamer = Callable[[int, Sequence[str]], str]
"""(config index, overrides) -> the config's output directory, relative to the sweep directory."""


def subdir_namer(config: DictConfig, composer: FastComposer) -> SubdirNamer | None:
    """hydra.sweep.subdir of a sweep as a function of each config; None for Hydra's default (the index).

    Resolved as Hydra resolves it in a job (see the module docstring); an error names the field,
    its value, the config and what it may use.
    """
    sweep = OmegaConf.to_container(config.hydra.sweep, resolve=False)
    template = sweep.get("subdir") if isinstance(sweep, dict) else None
    if template is None or str(template) == DEFAULT_SUBDIR:
        return None
    template = str(template)

    def name(index: int, overrides: Sequence[str]) -> str:
        cfg = composer.compose(overrides)
        naming = cfg.hydra.job.config.override_dirname
        task = [o for o in (parse_override(text) for text in overrides) if not o.is_hydra_override()]
        try:
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.job.num = index
                cfg.hydra.job.override_dirname = get_overrides_dirname(
                    overrides=task,
                    exclude_keys=list(naming.exclude_keys),
                    item_sep=naming.item_sep,
                    kv_sep=naming.kv_sep,
                )
                cfg.hydra.sweep.subdir = template
            value = str(cfg.hydra.sweep.subdir)
        except OmegaConfBaseException as exc:
            # Compact: Hydra prints the message alone, as for a composition error, not a traceback.
            raise CompactHydraException(
                f"hydra.sweep.subdir={template!r} does not resolve for config {index} "
                f"({' '.join(overrides) or 'no overrides'}): {str(exc).splitlines()[0]}. "
                "The launcher names each output directory before the job is queued, from "
                "hydra.job.num, hydra.job.override_dirname and "
                "the config's own values (hydra.job.id is only known once the job runs); or leave "
                f"hydra.sweep.subdir at its default {DEFAULT_SUBDIR}."
            ) from None
        return _checked_subdir(template, index, value)

    return name


def _checked_subdir(template: str, index: int, value: str) -> str:
    where = f"hydra.sweep.subdir={template!r} gives {value!r} for config {index}"
    path = normalize_dir(value)
    parts = path.split("/")
    if not value.strip() or path == "." or Path(value).is_absolute() or ".." in parts:
        raise CompactHydraException(
            f"{where}: an output directory must be a relative path below hydra.sweep.dir "
            "(not empty, not absolute, no '..')"
        )
    if any(p.startswith(".") for p in parts):
        raise CompactHydraException(
            f"{where}: a directory starting with '.' is hidden from the analysis (and .megasweep, "
            ".submitit, .slurm are the launcher's own); name it without a leading dot"
        )
    return path


def check_output_dirs(configs: Sequence[ConfigSpec | ManifestEntry]) -> None:
    """Raise HydraException when two configs would write the same output directory."""
    seen: dict[str, int] = {}
    for c in configs:
        other = seen.setdefault(c.output_dir, c.index)
        if other != c.index:
            raise CompactHydraException(
                f"hydra.sweep.subdir gives configs {other} and {c.index} the same output directory "
                f"{c.output_dir!r}: their results would overwrite each other. Put something that "
                "differs between them in it, e.g. ${hydra.job.num} or ${hydra.job.override_dirname}"
            )


def entry_args_for(config: DictConfig) -> tuple[str, ...]:
    """Arguments that make `python -m <module>` compose each run as the sweep composed it."""
    hydra = config.hydra
    args = [f"--config-name={hydra.job.config_name}"]
    # A --config-dir given to the sweep must reach each run too.
    for source in hydra.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            args.append(f"--config-dir={source.path}")
    return tuple(args)


def command_for(spec: ConfigSpec, settings: LaunchSettings, sweep_dir: Path) -> TrainCommand:
    out = sweep_dir / spec.output_dir
    argv = (
        settings.python,
        "-m",
        settings.module,
        *settings.entry_args,
        *spec.overrides,
        run_dir_override(out),
    )
    return TrainCommand(
        argv=argv,
        cwd=settings.cwd,
        output_dir=str(out),
        env=run_env(spec, sweep_dir),
        max_retries=spec.max_retries,
    )


def run_env(spec: ConfigSpec, sweep_dir: Path) -> tuple[tuple[str, str], ...]:
    """What a config's run gets in its environment: cluster.env, and the sweep's W&B group."""
    env = spec.env
    # cluster.env may set the group itself; the config's own logger.wandb_group wins inside W&B anyway.
    if spec.wandb_group is None and WANDB_GROUP_ENV not in dict(env):
        env = (*env, (WANDB_GROUP_ENV, sweep_dir.name))
    return env


def executor_parameters(key: ArrayKey, settings: LaunchSettings) -> dict[str, Any]:
    """submitit SlurmExecutor parameters of one group."""
    shape, opt = key.shape, key.options
    params: dict[str, Any] = {
        "job_name": settings.job_name,
        "time": shape.time_limit_min,
        "nodes": shape.nodes,
        "ntasks_per_node": shape.tasks_per_node,
        "cpus_per_task": opt.cpus_per_task,
        "array_parallelism": opt.array_parallelism,
        "stderr_to_stdout": True,
        # Jobs start where the sweep was launched from, whatever the cwd of a later rerun.
        # USR1 (not submitit's USR2) is the trainer's checkpoint-and-stop signal; --requeue lets a
        # task requeue itself after it (see the module docstring).
        # An empty value is a flag (`hold: ''` gives `--hold`): submitit writes True that way.
        "additional_parameters": {
            "chdir": settings.cwd,
            "requeue": True,
            "signal": f"USR1@{signal_lead_s(shape.time_limit_min)}",
            **{k: (v if v != "" else True) for k, v in settings.sbatch_args.items()},
        },
        # A rank that fails (or times out in a collective) ends its peers instead of leaving one
        # that hangs to hold the nodes until the time limit; srun_args given later win.
        "srun_args": ["--kill-on-bad-exit=1", *settings.srun_args],
    }
    optional = {
        "partition": opt.partition,
        "account": opt.account,
        "qos": opt.qos,
        "constraint": opt.constraint,
        "mem": opt.mem_per_node_gb,
        "setup": list(opt.setup) or None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    # A site's gres string (e.g. 'gpu:a100:8') wins; otherwise ask for the shape's GPUs.
    if opt.gres:
        params["gres"] = opt.gres
    elif shape.gpus_per_node:
        params["gpus_per_node"] = shape.gpus_per_node
    return params


def submit_configs(
    sweep_dir: Path,
    specs: Sequence[ConfigSpec],
    settings: LaunchSettings,
    *,
    on_queued: Callable[[list[ManifestEntry]], object] | None = None,
) -> Submission:
    """Queue one array per ArrayKey (split at max_array_size); refused groups become `refused` entries.

    `on_queued(entries so far)` is called after each sbatch (queued or refused): the caller
    writes the manifest there, so that it never lags what Slurm holds by more than one array.
    """
    import submitit  # not at module level: Hydra's plugin scan imports this module
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    entries: list[ManifestEntry] = []
    jobs: dict[int, Any] = {}
    arrays: list[str] = []
    groups = group_by((spec.key, spec) for spec in specs)
    for key, members in groups.items():
        for piece in chunk(members, settings.max_array_size):
            executor = submitit.SlurmExecutor(folder=sweep_dir / ".submitit" / "%j", python=settings.python)
            executor.update_parameters(**executor_parameters(key, settings))
            try:
                queued = executor.submit_array([command_for(s, settings, sweep_dir) for s in piece])
            except (FailedJobError, FailedSubmissionError) as exc:
                reason = REFUSED_PREFIX + _slurm_message(str(exc))
                entries.extend(_entry(s, "refused", reason=reason) for s in piece)
            else:
                arrays.append(str(queued[0].job_id).split("_")[0])
                for spec, job in zip(piece, queued, strict=True):
                    jobs[spec.index] = job
                    entries.append(_entry(spec, "submitted", job_id=str(job.job_id)))
            if on_queued is not None:
                on_queued(sorted(entries, key=lambda e: e.index))
    entries.sort(key=lambda e: e.index)
    return Submission(entries=entries, jobs=jobs, arrays=arrays)


def _slurm_message(stderr: str) -> str:
    # sbatch prints 'sbatch: error: ...' lines; keep them all, on one line, for the manifest.
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines
    return " | ".join(errors) or "sbatch failed without a message"


def _entry(
    spec: ConfigSpec, status: str, *, reason: str | None = None, job_id: str | None = None
) -> ManifestEntry:
    return ManifestEntry(
        index=spec.index,
        overrides=spec.overrides,
        output_dir=spec.output_dir,
        status=status,
        reason=reason,
        job_id=job_id,
        shape=spec.key.shape.as_dict(),
    )


def merge_entries(old: Sequence[ManifestEntry], new: Sequence[ManifestEntry]) -> list[ManifestEntry]:
    """Entries of both, the new one winning for an index; in index order."""
    merged = {e.index: e for e in old}
    merged.update({e.index: e for e in new})
    return [merged[i] for i in sorted(merged)]


# ---------------------------------------------------------------------------------------------
# What a rerun needs, kept in the sweep directory.


def save_launch_file(sweep_dir: Path, settings: LaunchSettings, specs: Sequence[ConfigSpec]) -> Path:
    """Add specs (by index) and the settings to <sweep dir>/.megasweep/launch.json."""
    path = sweep_dir / LAUNCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    known: dict[str, Any] = {}
    if path.exists():
        known = json.loads(path.read_text()).get("configs", {})
    for spec in specs:
        known[str(spec.index)] = {
            "overrides": list(spec.overrides),
            "output_dir": spec.output_dir,
            "env": [list(kv) for kv in spec.env],
            "max_retries": spec.max_retries,
            "wandb_group": spec.wandb_group,
            "shape": dataclasses.asdict(spec.key.shape),
            "options": {**dataclasses.asdict(spec.key.options), "setup": list(spec.key.options.setup)},
        }
    data = {
        "settings": {
            **dataclasses.asdict(settings),
            "entry_args": list(settings.entry_args),
            "srun_args": list(settings.srun_args),
            "sbatch_args": dict(settings.sbatch_args),
        },
        "configs": known,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def load_launch_file(sweep_dir: Path) -> tuple[LaunchSettings, dict[int, ConfigSpec]]:
    """Settings and specs saved by save_launch_file."""
    data = json.loads((sweep_dir / LAUNCH_FILE).read_text())
    raw = data["settings"]
    settings = LaunchSettings(
        python=raw["python"],
        module=raw["module"],
        cwd=raw["cwd"],
        job_name=raw["job_name"],
        max_array_size=int(raw["max_array_size"]),
        entry_args=tuple(raw.get("entry_args", ())),
        sbatch_args=dict(raw.get("sbatch_args", {})),
        srun_args=tuple(raw.get("srun_args", ())),
    )
    specs = {}
    for index, c in data["configs"].items():
        options = {**c["options"], "setup": tuple(c["options"]["setup"])}
        specs[int(index)] = ConfigSpec(
            index=int(index),
            overrides=tuple(c["overrides"]),
            output_dir=c["output_dir"],
            key=ArrayKey(shape=Shape(**c["shape"]), options=SbatchOptions(**options)),
            env=tuple((k, v) for k, v in c["env"]),
            max_retries=int(c.get("max_retries", 0)),
            wandb_group=c.get("wandb_group"),
        )
    return settings, specs


# ---------------------------------------------------------------------------------------------
# Sweeps of configs that are not megasweep's (any Hydra app): jobs run as Hydra runs a job.

GENERIC_TIME_LIMIT_MIN = 60
"""Slurm time limit of a generic job unless sbatch_args sets `time` (submitit's own default is 5)."""


@dataclass(frozen=True, eq=False)
class HydraJob:
    """The task function of a Hydra app, run on one job's overrides as Hydra's launchers run it.

    Picklable: submitit ships it to the node with cloudpickle, which carries a task function
    defined in __main__ or in a closure by value. `singletons` is Hydra's global state at
    submission (ConfigStore, registered resolvers), which a fresh interpreter lacks.
    """

    hydra_context: HydraContext
    config: DictConfig
    """The sweep's master config (each job's config is composed from it on the node)."""
    task_function: TaskFunction
    singletons: Any = None

    def __call__(self, overrides: Sequence[str], job_num: int, job_id: str | None = None) -> JobReturn:
        if self.singletons is not None:
            Singleton.set_state(self.singletons)
        setup_globals()
        if job_id is None:
            import submitit

            job_id = str(submitit.JobEnvironment().job_id)
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config.hydra.job):
            config.hydra.job.id = job_id
            config.hydra.job.num = job_num
        return run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )


def prepare_sweep_dir(config: DictConfig) -> Path:
    """hydra.sweep.dir, created (with hydra.sweep.mode when the config sets one)."""
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if OmegaConf.select(config, "hydra.sweep.mode", default=None) is not None:
        os.chmod(sweep_dir, mode=int(str(config.hydra.sweep.mode), 8))
    return sweep_dir


def generic_executor_parameters(settings: LaunchSettings, array_parallelism: int | None) -> dict[str, Any]:
    """submitit parameters of a generic sweep: one task per job, one node, sbatch_args on top."""
    return {
        "job_name": settings.job_name,
        "time": GENERIC_TIME_LIMIT_MIN,
        "nodes": 1,
        "ntasks_per_node": 1,
        "array_parallelism": array_parallelism or 256,
        "stderr_to_stdout": True,
        "additional_parameters": {
            "chdir": settings.cwd,
            **{k: (v if v != "" else True) for k, v in settings.sbatch_args.items()},
        },
        **({"srun_args": list(settings.srun_args)} if settings.srun_args else {}),
    }


def submit_hydra_jobs(
    job: HydraJob,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    settings: LaunchSettings,
    *,
    array_parallelism: int | None = None,
) -> list[JobReturn]:
    """Run a generic sweep as one job array (split at max_array_size); block until it ends.

    Hydra's own contract for a launcher: one JobReturn per job, in order, carrying the task's
    value or its failure. A job that died outside the task (killed, unpicklable) is FAILED too.
    """
    import submitit

    sweep_dir = prepare_sweep_dir(job.config).resolve()
    nums = [initial_job_idx + i for i in range(len(job_overrides))]
    queued: list[Any] = []
    for piece in chunk(list(zip(job_overrides, nums, strict=True)), settings.max_array_size):
        executor = submitit.SlurmExecutor(folder=sweep_dir / ".submitit" / "%j", python=settings.python)
        executor.update_parameters(**generic_executor_parameters(settings, array_parallelism))
        queued.extend(executor.map_array(job, [list(o) for o, _ in piece], [n for _, n in piece]))
    returns = []
    for overrides, slurm_job in zip(job_overrides, queued, strict=True):
        try:
            value = slurm_job.result()
        except Exception as exc:  # the job's failure, reported to Hydra as its own launchers do
            value = JobReturn(
                overrides=list(overrides),
                task_name=str(job.config.hydra.job.name),
                status=JobStatus.FAILED,
                _return_value=exc,
            )
        returns.append(value)
    return returns


# ---------------------------------------------------------------------------------------------
# The Hydra launcher.


def job_return(
    entry: ManifestEntry, *, sweep_dir: Path, task_name: str, status: JobStatus, value: Any
) -> JobReturn:
    """Hydra's record of one config's outcome, as the slurm and local launchers hand it back."""
    return JobReturn(
        overrides=list(entry.overrides),
        working_dir=str(sweep_dir / entry.output_dir),
        task_name=task_name,
        status=status,
        _return_value=value,
    )


class SlurmLauncher(SweepLauncher):
    """Hydra launcher submitting one Slurm job array per resource shape (`hydra/launcher=slurm`).

    Options (hydra.launcher.*): wait (block until every job ends and return their results),
    array_parallelism (the %N throttle; null: cluster.array_parallelism), max_array_size
    (null: MaxArraySize from scontrol), sbatch_args (extra sbatch options), srun_args,
    python (null: this interpreter), module (entry module of each run), job_name
    (null: hydra.job.name).

    Configs that are not megasweep's run as generic Hydra jobs (see submit_hydra_jobs), always
    waited for; of the options only array_parallelism, max_array_size, sbatch_args, srun_args,
    python and job_name apply to them.
    """

    def __init__(
        self,
        wait: bool = False,
        array_parallelism: int | None = None,
        max_array_size: int | None = None,
        sbatch_args: Mapping[str, str] | None = None,
        srun_args: Sequence[str] | None = None,
        python: str | None = None,
        module: str = "train",
        job_name: str | None = None,
    ) -> None:
        super().__init__()
        self.wait = wait
        self.array_parallelism = array_parallelism
        self.max_array_size = max_array_size
        self.sbatch_args = dict(sbatch_args or {})
        self.srun_args = list(srun_args or [])
        self.python = python
        self.module = module
        self.job_name = job_name

    def settings(self) -> LaunchSettings:
        assert self.config is not None
        hydra = self.config.hydra
        return LaunchSettings(
            python=self.python or sys.executable,
            module=self.module,
            cwd=str(hydra.runtime.cwd),
            # `python -m train` names the job `__main__`: useless in squeue.
            job_name=self.job_name or (name if (name := str(hydra.job.name)) != "__main__" else self.module),
            max_array_size=self.max_array_size or read_max_array_size(),
            entry_args=entry_args_for(self.config),
            sbatch_args={str(k): str(v) for k, v in self.sbatch_args.items()},
            srun_args=tuple(str(a) for a in self.srun_args),
        )

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        if not is_megasweep_config(self.config):
            # Any other Hydra app: no validation or shapes to group by, and Hydra's launcher
            # contract (each job's JobReturn) means waiting for the array to end.
            assert self.task_function is not None
            job = HydraJob(self.hydra_context, self.config, self.task_function, Singleton.get_state())
            return submit_hydra_jobs(
                job, job_overrides, initial_job_idx, self.settings(), array_parallelism=self.array_parallelism
            )
        composer = sweep_composer(self.hydra_context.config_loader, self.config)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        settings = self.settings()

        specs, skipped = plan_configs(
            composer,
            job_overrides,
            initial_job_idx,
            array_parallelism=self.array_parallelism,
            subdir=subdir_namer(self.config, composer),
        )
        path = manifest_path(sweep_dir)
        old = read_manifest(path) if initial_job_idx and path.exists() else []
        # Hydra's sweeper may launch a sweep in batches: a later batch must not reuse a directory.
        check_output_dirs(merge_entries(old, [*skipped, *(_entry(s, "submitted") for s in specs)]))
        save_launch_file(sweep_dir, settings, specs)
        known = merge_entries(old, skipped)
        submission = submit_configs(
            sweep_dir,
            specs,
            settings,
            on_queued=lambda queued: write_manifest(merge_entries(known, queued), path),
        )
        entries = sorted([*skipped, *submission.entries], key=lambda e: e.index)
        # Also when nothing was submitted (every config infeasible): the manifest says so.
        write_manifest(merge_entries(old, entries), path)
        self._report(entries, submission, path)
        return self._returns(entries, submission, sweep_dir)

    def _report(self, entries: Sequence[ManifestEntry], submission: Submission, path: Path) -> None:
        submitted = sum(1 for e in entries if e.status == "submitted")
        refused = [e for e in entries if e.status == "refused"]
        infeasible = len(entries) - submitted - len(refused)
        arrays = ", ".join(submission.arrays) or "none"
        print(
            f"slurm: {len(entries)} configs: {submitted} submitted in {len(submission.arrays)} "
            f"array(s) ({arrays}), {infeasible} infeasible, {len(refused)} refused by sbatch -> {path}",
            flush=True,
        )
        for e in refused:
            print(f"slurm: config {e.index} {' '.join(e.overrides)}: {e.reason}", file=sys.stderr)

    def _returns(
        self, entries: Sequence[ManifestEntry], submission: Submission, sweep_dir: Path
    ) -> list[JobReturn]:
        assert self.config is not None
        task_name = str(self.config.hydra.job.name)
        returns = []
        for e in entries:
            status = JobStatus.COMPLETED
            value: Any = e.to_json()
            job = submission.jobs.get(e.index)
            if self.wait and job is not None:
                try:
                    # results(): one value per task (a multi-device job has several; submitit's
                    # result() refuses those). Task 0 is rank 0, which writes the record.
                    value = job.results()[0]
                except Exception as exc:  # the job's failure, as Hydra launchers report it
                    status, value = JobStatus.FAILED, exc
            returns.append(job_return(e, sweep_dir=sweep_dir, task_name=task_name, status=status, value=value))
        return returns


# ---------------------------------------------------------------------------------------------
# The in-job wrapper as a command, for the array scripts of `python -m launchers sbatch`.


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m launchers.slurm --output-dir DIR --max-retries N -- <trainer command>`.

    Runs one srun task of an exported array script exactly as TrainCommand runs one of the
    launcher's: the trainer as a child, USR1 left to it, and on REQUEUE_EXIT_CODE the job
    requeued while SLURM_RESTART_COUNT < N (the stopped attempt's record kept aside). Exits
    with the trainer's status (after printing why, when it is not 0).
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m launchers.slurm",
        description="Run one array task's trainer; requeue the job when it stops on Slurm's signal.",
    )
    parser.add_argument("--output-dir", required=True, help="the run's directory (where result.json goes)")
    parser.add_argument("--max-retries", type=int, required=True, help="cluster.max_retries (requeues)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the trainer's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no trainer command: give it after `--`")
    if args.max_retries < 0:
        parser.error(f"--max-retries={args.max_retries}: must be 0 or more (requeues allowed)")
    task = TrainCommand(
        argv=tuple(command), cwd=os.getcwd(), output_dir=args.output_dir, max_retries=args.max_retries
    )
    code = task.run()
    if code != 0:
        print(f"slurm: {task.failure(code)}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
