"""Submission: a sweep's configs checked by the rules, grouped by allocation, queued as job arrays.

Every config is composed with the shared FastComposer (one Hydra compose per distinct group
choice) and judged by train.planner.rules on the login node. Infeasible configs become `skipped`
manifest entries with the rules' paragraph as their reason; nothing is queued for them. The
others are grouped by ArrayKey (launchers.allocation: nodes, tasks and GPUs per node, time
limit, sbatch options) and each group is submitted as one job array through submitit, split at
the cluster's MaxArraySize and throttled with %N. Each array task runs launchers.job's
TrainCommand: `python -m train <overrides> hydra.run.dir=<its output dir>` under srun, one srun
task per device, with cluster.env exported (env is per config, so sweeping it never splits an
array). srun runs with --kill-on-bad-exit: a rank that fails ends its peers at once instead of
leaving them stuck in a collective until the time limit.

W&B group: each run of a sweep whose config leaves logger.wandb_group unset gets the sweep
directory's name through W&B's own WANDB_RUN_GROUP (a run is a plain `python -m train`, not a
Hydra multirun job, so it cannot find the sweep's name itself). Not as an override: the record
keeps its overrides, which identify the config across sweeps (analysis compare), and a group
named after each sweep would make every sweep's configs look different.

Requeue: jobs are submitted with --requeue and --signal=USR1@<lead> (lead: REQUEUE_SIGNAL_LEAD_S,
at most a quarter of the time limit; sbatch_args `signal` wins); launchers.job does the rest.

Output directories: config i goes to <sweep dir>/<hydra.sweep.subdir>, resolved per config as
Hydra would (default ${hydra.job.num}: the config's index). A subdir other than the default is
resolved by composing each config in full (tens of milliseconds each) with hydra.job.num and
hydra.job.override_dirname set, so it may use those and the config's own values; hydra.job.id
is refused (it is only known once the job runs). The resolved directories must be relative,
distinct, and not hidden (the analysis skips hidden directories).

The manifest is rewritten (atomically) after each array is queued, so a launcher killed
between two arrays leaves one that lists exactly what was queued (and the infeasible configs).
SIGINT, SIGTERM and SIGHUP wait while an array is queued and recorded; then the configs not yet
submitted are recorded `interrupted` (`rerun --failed` submits them) and the signal takes effect.
SIGKILL cannot wait: killed so, a launcher may leave the array of its last sbatch unlisted.
An sbatch that Slurm refuses (unknown partition, bad gres) marks that group's configs
`refused` with Slurm's own message; the other groups still go ahead.

What a rerun needs to resubmit a config without Hydra (its command, environment and array
key) is kept in <sweep dir>/.megasweep/launch.json.

Torch-free, like everything a launcher imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.config_loader_impl import get_overrides_dirname
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from conf.schema import RunConfig, requested_micro_batch
from launchers.allocation import (
    Allocation,
    ArrayKey,
    SbatchOptions,
    array_key,
    chunk,
    group_by,
    job_licenses,
    slurm_mem,
)
from launchers.compose import CHECKPOINT_FIX, CheckpointPlaces, FastComposer, parse_override
from launchers.job import TrainCommand
from launchers.site import check_sbatch_scripts, license_totals
from launchers.sweepdir import RunsFailed, UsageError
from train.contract import (
    LAUNCH_FILE,
    REFUSED_PREFIX,
    SLURM_LOG_DIR,
    STATE_DIR,
    SUBMITIT_DIR,
    LaunchedLayout,
    ManifestEntry,
    ManifestError,
    manifest_path,
    normalize_dir,
)
from train.paths import PathWarnings
from train.planner.plan import count_by_rule, rule_example
from train.planner.rules import RULES, InfeasibleConfig, rule_problem, validate
from train.planner.sizes import total_params
from train.signals import TERMINAL_STOP_SIGNALS, signals_blocked, signals_held

REQUEUE_SIGNAL_LEAD_S = 120
"""How long before the time limit Slurm sends USR1 (seconds): time for a step and a checkpoint."""
WANDB_GROUP_ENV = "WANDB_RUN_GROUP"
# Slurm's own default when scontrol cannot be asked.
DEFAULT_MAX_ARRAY_SIZE = 1001
DEFAULT_SUBDIR = "${hydra.job.num}"
"""Hydra's hydra.sweep.subdir: the config's index, which needs no composition to name."""


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
    layout: LaunchedLayout | None = None
    """What the config runs, for its manifest entry (launched_layout); None for a spec read back from a
    launch record, which keeps none: a rerun takes it from the config's manifest entry (with_layouts)."""


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
    local: bool = False
    """The configs ran on this machine (hydra/launcher=local), so a rerun runs them here too."""
    test_only: bool = True
    """sbatch --test-only judged the jobs before they were queued; a rerun asks it again only if so
    (a site whose --test-only refuses what sbatch queues was launched without it)."""


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


def check_array_options(*, array_parallelism: int | None, max_array_size: int | None, names: tuple[str, str]) -> None:
    """UsageError naming the option (`names`: the tool's words for the two) when the %N throttle or the
    largest array is below 1; None leaves each to cluster.array_parallelism and Slurm's MaxArraySize.
    The rules judge cluster.array_parallelism, but this option replaces it: 0 became %1 in an
    exported script, and a max_array_size of 0 silently meant MaxArraySize."""
    meant = (("number of tasks of one array that run at once (%N)", "cluster.array_parallelism"),
             ("largest number of tasks in one array before the sweep is split", "Slurm's MaxArraySize"))  # fmt: skip
    for name, value, (what, default) in zip(names, (array_parallelism, max_array_size), meant, strict=True):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(
                f"{name}={value}: the {what} is a whole number of at least 1; leave it out for {default}. "
                "Nothing was launched or written."
            )


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
    """(array key, None) for a feasible run; (None, the rules' paragraph) for one that must not be
    submitted. The rules also guarantee that an accepted run has an allocation (`whole_nodes`)."""
    violations = validate(run, world_size=None)
    if violations:
        return None, str(InfeasibleConfig(violations))
    return array_key(run, array_parallelism=array_parallelism), None


def plan_configs(
    composer: FastComposer,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    *,
    array_parallelism: int | None = None,
    subdir: SubdirNamer | None = None,
    undone: str = "nothing was submitted",
    name: Callable[[int], str] = "config {}".format,
    fix: str = CHECKPOINT_FIX,
    here: bool = False,
    paths: PathWarnings | None = None,
) -> tuple[list[ConfigSpec], list[ManifestEntry]]:
    """Compose and validate each job: specs of the feasible ones, skipped entries for the rest; the
    feasible ones' token files and checkpoint directories are checked here, each distinct path once, and
    what a run would refuse at its start said on stderr as a warning (train.paths.PathWarnings), or
    refused (UsageError) when the runs are this machine's (`here`: the local launcher); `paths`: the
    sweep's, for a sweeper's batches to say each path once (a new one per call without it).
    Two feasible ones that would checkpoint into one directory refuse them all (UsageError ending in
    `undone`: what the refusal leaves undone, each named by `name` of its index, `fix` the way out;
    CheckpointPlaces).

    Config i's output directory is `subdir(initial_job_idx + i, overrides)` (see subdir_namer);
    without `subdir`, `<initial_job_idx + i>`, as Hydra's default hydra.sweep.subdir
    (${hydra.job.num}) names it.
    """
    specs: list[ConfigSpec] = []
    skipped: list[ManifestEntry] = []
    checkpoints = CheckpointPlaces()
    paths = PathWarnings() if paths is None else paths
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
        checkpoints.add(name(index), overrides, run, key.allocation.tasks)
        paths.note(run)
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
                layout=launched_layout(run),
            )
        )
    # A sweep's own check found these before (FastValidation); an export's or a changed rerun's configs
    # are planned here alone.
    checkpoints.refuse_clashes(outcome=undone, fix=fix)
    if subdir is not None:
        check_output_dirs([*specs, *skipped])
    say_path_warnings(paths, here=here, undone=undone)
    return specs, skipped


def launched_layout(run: RunConfig) -> LaunchedLayout:
    """The layout a feasible config's manifest entry keeps (train.contract.LaunchedLayout), read off its
    composed config: nothing planned (the size is the planner's arithmetic count of the model's
    parameters, a microsecond), so that a launch of thousands of configs does not slow for it."""
    par, model = run.parallelism, run.model
    return LaunchedLayout(
        model=model.name,
        hardware=run.hardware.name,
        dp=par.dp or 1,  # as the allocation counts a null dp (launchers.allocation.allocation_of)
        tp=par.tp,
        pp=par.pp,
        micro_batch_size=requested_micro_batch(par),
        global_batch_size=par.global_batch_size,
        seq_length=model.seq_length,
        params=total_params(model, par.tp),
        zero_stage=par.zero_stage,
        offload=par.offload.value,
        recompute=par.recompute.value,
        precision=par.precision.value,
        engine=par.engine.value,
        virtual_stages=par.virtual_stages,
        sequence_parallel=par.sequence_parallel,
    )


def with_layouts(specs: Sequence[ConfigSpec], entries: Sequence[ManifestEntry]) -> list[ConfigSpec]:
    """`specs` read back from the launch record, each with the layout its config's manifest entry keeps
    (a rerun of the same config runs the same layout); one whose entry has none (a manifest written
    before layouts were) stays without."""
    wanted = {spec.index for spec in specs if spec.layout is None}
    layouts = {}
    for e in entries:
        # A damaged layout: the rerun's entry is written without one, as an old launch's is.
        with contextlib.suppress(ManifestError):
            if e.index in wanted and e.layout:
                layouts[e.index] = LaunchedLayout.from_json(e.layout)
    return [
        dataclasses.replace(spec, layout=layouts[spec.index]) if spec.index in layouts else spec for spec in specs
    ]


def say_path_warnings(paths: PathWarnings, *, here: bool = False, undone: str = "nothing was run") -> None:
    """Each distinct path's warning (train.paths) that no earlier call said, one line on stderr: warnings,
    not refusals, since the runs' nodes may see file systems this machine does not. `here` (the runs are
    this machine's): what a run would refuse is refused now (UsageError), before any config runs into it."""
    if here and (refused := paths.refusals()):
        raise UsageError("; ".join(refused) + f". The runs of this machine would refuse it at their start: {undone}.")
    for line in paths.warnings(here=here, once=True):
        print(f"warning: {line}", file=sys.stderr, flush=True)


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
            # One paragraph and exit 2 (launchers.compose.usage_exits), as for any input refused.
            raise UsageError(
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
        raise UsageError(
            f"{where}: an output directory must be a relative path below hydra.sweep.dir "
            "(not empty, not absolute, no '..')"
        )
    if any(p.startswith(".") for p in parts):
        raise UsageError(
            f"{where}: a directory starting with '.' is hidden from the analysis (and {STATE_DIR}, "
            f"{SUBMITIT_DIR}, {SLURM_LOG_DIR} are the launcher's own); name it without a leading dot"
        )
    return path


def check_output_dirs(configs: Sequence[ConfigSpec | ManifestEntry]) -> None:
    """Raise UsageError (bad input: exit 2, nothing written) when two configs would write the same
    output directory."""
    seen: dict[str, int] = {}
    for c in configs:
        other = seen.setdefault(c.output_dir, c.index)
        if other != c.index:
            raise UsageError(
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
        # On this machine no Slurm ends the run at cluster.time_limit_min: the command does (it ran on).
        time_limit_s=60.0 * spec.key.allocation.time_limit_min if settings.local else None,
    )


def run_env(spec: ConfigSpec, sweep_dir: Path) -> tuple[tuple[str, str], ...]:
    """What a config's run gets in its environment: cluster.env, and the sweep's W&B group."""
    env = spec.env
    # cluster.env may set the group itself; the config's own logger.wandb_group wins inside W&B anyway.
    if spec.wandb_group is None and WANDB_GROUP_ENV not in dict(env):
        env = (*env, (WANDB_GROUP_ENV, sweep_dir.name))
    return env


def setup_lines(setup: Sequence[str]) -> list[str]:
    """cluster.setup as lines of a job script, each of which stops the job when it exits non-zero,
    naming itself on stderr (the Slurm log): a `module load` or `source` that failed would otherwise
    go on to train under the wrong toolchain, or fail later for a reason that hides this one. Each
    line is judged by its own exit status, as written; what a sourced file runs inside is not (`set
    -e` would stop on any command a site's profile lets fail). Blank and comment lines pass as they are."""
    out = []
    for line in setup:
        if not line.strip() or line.lstrip().startswith("#"):
            out.append(line)
            continue
        said = '"error: cluster.setup line failed (exit $?): "' + shlex.quote(line)
        # Braces, not a subshell: a line that sets variables or sources a file does so for the job.
        out.append(f"{{ {line}\n}} || {{ echo {said} >&2; exit 1; }}")
    return out


def executor_parameters(
    key: ArrayKey, settings: LaunchSettings, *, licenses: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """submitit SlurmExecutor parameters of one group; `licenses`: the cluster's license totals
    (launchers.site.license_totals), which cap a job's cluster.core_license request."""
    alloc, opt = key.allocation, key.options
    cores = job_licenses(key, licenses)
    params: dict[str, Any] = {
        "job_name": settings.job_name,
        "time": alloc.time_limit_min,
        "nodes": alloc.nodes,
        "ntasks_per_node": alloc.tasks_per_node,
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
            "signal": f"USR1@{signal_lead_s(alloc.time_limit_min)}",
            **({"licenses": cores} if cores else {}),
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
        "mem": slurm_mem(opt.mem_per_node_gb),
        "setup": setup_lines(opt.setup) or None,
        "exclusive": True if opt.exclusive else None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    # A site's gres string (e.g. 'gpu:a100:8') wins; otherwise ask for the allocation's GPUs.
    if opt.gres:
        params["gres"] = opt.gres
    elif alloc.gpus_per_node:
        params["gpus_per_node"] = alloc.gpus_per_node
    return params


def submit_released(executor: Any, submit: Callable[..., Any], *args: Any) -> Any:
    """`submit(*args)`, one of `executor`'s submitit calls (a job, or a list of them), queued held and
    then released with `scontrol release`.

    submitit makes each job's folder, where Slurm opens the job's output file, only once sbatch has
    returned: a job that an idle cluster starts at once fails before it runs, with no log (slurmd:
    "Could not open stdout file ... No such file or directory", the task killed by signal 53; seen on
    the local cluster, whose backfill started an array task a millisecond after sbatch). A hold the
    user asked for (sbatch_args `hold`) is theirs to release."""
    # A terminal's Ctrl-C reaches sbatch and scontrol too (one process group): blocked here, it waits
    # until the jobs are queued and released, then reaches this process (train.signals). sbatch takes
    # well under a second, unless it cannot reach the controller and retries before failing; Ctrl-\
    # (SIGQUIT) still ends it all at once.
    with signals_blocked(TERMINAL_STOP_SIGNALS):
        return _submit_and_release(executor, submit, *args)


def _submit_and_release(executor: Any, submit: Callable[..., Any], *args: Any) -> Any:
    extra = dict(executor.parameters.get("additional_parameters") or {})
    if "hold" in extra:
        return submit(*args)
    executor.update_parameters(additional_parameters={**extra, "hold": True})
    queued = submit(*args)
    ids = sorted({str(job.job_id).split("_")[0] for job in (queued if isinstance(queued, list) else [queued])})
    try:
        released = subprocess.run(["scontrol", "release", *ids], capture_output=True, text=True, timeout=60)
        said = released.stderr.strip() or released.stdout.strip() or f"exit status {released.returncode}"
        why = said if released.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    if why:
        print(f"slurm: scontrol release {' '.join(ids)} failed ({why}): the jobs stay held until released "
              f"with `scontrol release {' '.join(ids)}`", file=sys.stderr, flush=True)  # fmt: skip
    return queued


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
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    entries: list[ManifestEntry] = []
    jobs: dict[int, Any] = {}
    arrays: list[str] = []
    pieces, totals = _arrays(specs, settings)
    for done, (key, piece) in enumerate(pieces, start=1):
        # An sbatch that has queued an array must not be cut off from the manifest line that lists
        # it: a stop signal waits until both are done (train.signals.signals_held).
        with signals_held(TERMINAL_STOP_SIGNALS) as held:
            executor = _executor(sweep_dir, key, settings, totals)
            try:
                commands = [command_for(s, settings, sweep_dir) for s in piece]
                queued = submit_released(executor, executor.submit_array, commands)
            except (FailedJobError, FailedSubmissionError) as exc:
                reason = REFUSED_PREFIX + _slurm_message(str(exc))
                entries.extend(entry_for(s, "refused", reason=reason) for s in piece)
            else:
                arrays.append(str(queued[0].job_id).split("_")[0])
                for spec, job in zip(piece, queued, strict=True):
                    jobs[spec.index] = job
                    entries.append(entry_for(spec, "submitted", job_id=str(job.job_id)))
            if on_queued is not None:
                on_queued(sorted(entries, key=lambda e: e.index))
        if held:
            name = signal.Signals(held[0]).name
            if done < len(pieces):
                # The configs not submitted stay in the sweep, as a local sweep's Ctrl-C leaves them.
                reason = f"not submitted: the launcher was stopped ({name}) before this config's array"
                entries.extend(entry_for(s, "interrupted", reason=reason) for _, rest in pieces[done:] for s in rest)
                if on_queued is not None:
                    with signals_held(TERMINAL_STOP_SIGNALS):
                        on_queued(sorted(entries, key=lambda e: e.index))
            # Stopped during the last sbatch, every array was queued: nothing is left to rerun.
            rest = (f"the manifest lists what was queued, the rest as interrupted (python -m launchers rerun "
                    f"{sweep_dir} --failed submits them)" if done < len(pieces) else
                    f"every array was queued; they run without the launcher (python -m launchers status {sweep_dir})")  # fmt: skip
            print(f"slurm: stopped ({name}) after {done} of {len(pieces)} arrays; {rest}", file=sys.stderr, flush=True)
            signal.raise_signal(held[0])  # its own handler again: the end (or KeyboardInterrupt) it means
    entries.sort(key=lambda e: e.index)
    return Submission(entries=entries, jobs=jobs, arrays=arrays)


def _arrays(
    specs: Sequence[ConfigSpec], settings: LaunchSettings
) -> tuple[list[tuple[ArrayKey, list[ConfigSpec]]], dict[str, int] | None]:
    """The arrays submit_configs queues, one per ArrayKey split at max_array_size, and the cluster's
    license totals when a job asks for cluster.core_license (else None)."""
    groups = group_by((spec.key, spec) for spec in specs)
    totals = license_totals() if any(key.options.core_license for key in groups) else None
    pieces = [(key, piece) for key, members in groups.items() for piece in chunk(members, settings.max_array_size)]
    return pieces, totals


def _executor(sweep_dir: Path, key: ArrayKey, settings: LaunchSettings, totals: Mapping[str, int] | None) -> Any:
    """The submitit executor that queues the array of `key`."""
    import submitit  # not at module level: Hydra's plugin scan imports this module

    executor = submitit.SlurmExecutor(folder=sweep_dir / SUBMITIT_DIR / "%j", python=settings.python)
    executor.update_parameters(**executor_parameters(key, settings, licenses=totals))
    return executor


def index_ranges(indices: Sequence[int]) -> str:
    """Config indices in few words: [0, 1, 2, 5] gives '0-2, 5'."""
    spans: list[list[int]] = []
    for i in sorted(indices):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def job_words(piece: Sequence[ConfigSpec], key: ArrayKey) -> str:
    """One array's configs and shape, in words, for a message; with the memory asked for per node, when
    the cluster config asks for some (a refusal for memory no node has named everything but it)."""
    mem = key.options.mem_per_node_gb
    asked = f", cluster.mem_per_node_gb={mem}" if mem is not None else ""
    return f"config(s) {index_ranges([s.index for s in piece])} ({key.allocation.words()}{asked})"


def submitit_script(executor: Any, *, array: int = 1) -> str | None:
    """The batch script `executor` (a submitit SlurmExecutor) gives sbatch for a job, or for an array of
    `array` tasks; None from a submitit without SlurmExecutor._make_submission_file_text, the method its
    own submission calls (with the array size its array submission sets as map_count)."""
    make = getattr(executor, "_make_submission_file_text", None)
    command = getattr(executor, "_submitit_command_str", None)
    if make is None or command is None:
        return None
    parameters = dict(executor.parameters)
    try:
        if array > 1:  # submitit queues a single config as a job, not an array
            executor.parameters["map_count"] = array
        return str(make(command, "test-only"))
    finally:
        executor.parameters.clear()
        executor.parameters.update(parameters)


def check_sbatch_accepts(
    sweep_dir: Path,
    specs: Sequence[ConfigSpec],
    settings: LaunchSettings,
    *,
    option: str,
    skip: str,
    again: str = "launch again",
) -> None:
    """launchers.site.check_sbatch_scripts for the arrays submit_configs would queue, each array's script
    as submitit writes it; `option` names how the user gives sbatch options (their name as `{name}`),
    `skip` the option that leaves the check out, `again` what to do once the cause is fixed.

    The script comes from submitit's own SlurmExecutor._make_submission_file_text, with the array size
    its array submission sets (map_count): what sbatch would be given, less the hold submit_released
    adds. A submitit without it is not checked here (sbatch has the last word, as before)."""
    jobs = []
    pieces, totals = _arrays(specs, settings)
    for key, piece in pieces:
        script = submitit_script(_executor(sweep_dir, key, settings, totals), array=len(piece))
        if script is None:
            return
        jobs.append((job_words(piece, key), script))
    check_sbatch_scripts(
        jobs, fix=f"the cluster.* fields or the sbatch options ({option.format(name='<name>')})", skip=skip, again=again
    )


_RULE = re.compile(r"\[([a-z0-9_]+)\]")
"""A rule as InfeasibleConfig's paragraph names it, '[rule]', anywhere in a skipped entry's reason."""


def infeasible_summary(entries: Sequence[ManifestEntry]) -> list[str]:
    """Console lines for the skipped configs of a launch: per rule broken, how many configs and the
    first one's overrides and its problem with that rule (counted as the dry run counts them,
    train.planner.plan.count_by_rule), so that the fix can be read without opening the manifest."""
    broken = (
        (e, [r for r in _RULE.findall(e.reason or "") if r in RULES] or ["other"])
        for e in entries
        if e.status == "skipped"
    )
    return [
        "infeasible "
        + rule_example(rule, n, first.index, first.overrides, rule_problem(first.reason or "", rule) or first.reason or "")
        for rule, n, first in count_by_rule(broken)
    ]


class LaunchFailed(RunsFailed):
    """A launch whose sbatch Slurm refused for some configs, or whose configs failed: the command
    exits EXIT_FAILED with this paragraph after the manifest says what happened."""


class NothingSubmitted(LaunchFailed, UsageError):
    """A launch every config of which is infeasible: nothing ran, so it exits as bad input does (2)."""


def refuse_empty_sweep(job_overrides: Sequence[Sequence[str]]) -> None:
    """UsageError for a sweep of no configs (an override swept over an empty range): it would leave a
    manifest of nothing that claims the directory, and call its no configs all infeasible."""
    if not job_overrides:
        raise UsageError(
            "The sweep has no configs: a swept override expands to no values (e.g. range(5,5)). "
            "Nothing was submitted or written; give each swept override at least one value."
        )


def failed_configs_hint(sweep_dir: Path) -> str:
    """What a launch whose configs failed ends with: where their logs are named, and how to rerun them."""
    return (
        f"python -m launchers status {sweep_dir} names each one's log; python -m launchers rerun {sweep_dir} "
        "--failed runs them again (followed by field=value overrides to change them)."
    )


def launch_failure(entries: Sequence[ManifestEntry], sweep_dir: Path) -> LaunchFailed | None:
    """Why this batch of a launch failed as a whole, or None: some config was refused by sbatch,
    or none was submitted (every one infeasible)."""
    refused = [e.index for e in entries if e.status == "refused"]
    where = f"{manifest_path(sweep_dir)}; progress: python -m launchers status {sweep_dir}"
    if refused:
        return LaunchFailed(
            f"{len(refused)} of {len(entries)} configs ({', '.join(map(str, refused[:10]))}"
            f"{', ...' if len(refused) > 10 else ''}) were refused by sbatch, in Slurm's words above "
            f"and in {where}. Fix the cause, then resubmit them with python -m launchers rerun "
            f"{sweep_dir} --failed (followed by field=value overrides to change them)."
        )
    if not any(e.status == "submitted" for e in entries):
        return NothingSubmitted(
            f"Nothing was submitted: all {len(entries)} configs are infeasible; the rules' reasons are "
            f"in {manifest_path(sweep_dir)} (hydra/launcher=plan prints them as a table). It lists nothing "
            "that ran, so a launch into the same directory replaces it."
        )
    return None


def _slurm_message(stderr: str) -> str:
    # sbatch prints 'sbatch: error: ...' lines; keep them all, on one line, for the manifest.
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines
    return " | ".join(errors) or "sbatch failed without a message"


def entry_for(
    spec: ConfigSpec, status: str, *, reason: str | None = None, job_id: str | None = None
) -> ManifestEntry:
    return ManifestEntry(
        index=spec.index,
        overrides=spec.overrides,
        output_dir=spec.output_dir,
        status=status,
        reason=reason,
        job_id=job_id,
        shape=spec.key.allocation.as_dict(),
        layout=spec.layout.to_json() if spec.layout is not None else {},
    )


def merge_entries(old: Sequence[ManifestEntry], new: Sequence[ManifestEntry]) -> list[ManifestEntry]:
    """Entries of both, the new one winning for an index; in index order."""
    merged = {e.index: e for e in old}
    merged.update({e.index: e for e in new})
    return [merged[i] for i in sorted(merged)]


# ---------------------------------------------------------------------------------------------
# What a rerun needs, kept in the sweep directory.


def save_launch_file(sweep_dir: Path, settings: LaunchSettings, specs: Sequence[ConfigSpec]) -> Path:
    """Add specs (by index) to <sweep dir>/.megasweep/launch.json under `settings`.

    Each launch into the directory (the first, every `append`, a rerun) may bring its own settings
    (interpreter, --config-dir, sbatch options, local or Slurm): the file keeps each distinct one under
    "launches", and each config the position of its own, so that a rerun submits every config the way
    it was launched. "settings" is the latest launch's (files written before "launches" had only it)."""
    path = sweep_dir / LAUNCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    known: dict[str, Any] = raw.get("configs", {})
    launches: list[dict[str, Any]] = raw.get("launches") or ([raw["settings"]] if "settings" in raw else [])
    current = {
        **dataclasses.asdict(settings),
        "entry_args": list(settings.entry_args),
        "srun_args": list(settings.srun_args),
        "sbatch_args": dict(settings.sbatch_args),
    }
    if current not in launches:
        launches.append(current)
    launch = launches.index(current)
    for spec in specs:
        known[str(spec.index)] = {
            "overrides": list(spec.overrides),
            "output_dir": spec.output_dir,
            "env": [list(kv) for kv in spec.env],
            "max_retries": spec.max_retries,
            "wandb_group": spec.wandb_group,
            "shape": dataclasses.asdict(spec.key.allocation),
            "options": {**dataclasses.asdict(spec.key.options), "setup": list(spec.key.options.setup)},
            # Where the config's job writes (absolute, as its command line says): `status` compares
            # it with where the sweep directory is now, to tell a moved directory from a failed job.
            "sweep_dir": str(sweep_dir.absolute()),
            "launch": launch,
        }
    data = {"settings": current, "launches": launches, "configs": known}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def launched_sweep_dirs(sweep_dir: Path) -> dict[int, Path]:
    """The sweep directory each config's job was given at its last submission or export (by index),
    as save_launch_file recorded it; empty without a readable launch record (or one written before
    it recorded them)."""
    try:
        configs = json.loads((sweep_dir / LAUNCH_FILE).read_text())["configs"]
        return {int(i): Path(c["sweep_dir"]) for i, c in configs.items() if isinstance(c.get("sweep_dir"), str)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def load_launch_file(sweep_dir: Path) -> tuple[LaunchSettings, dict[int, ConfigSpec]]:
    """The latest launch's settings and every config's spec, as save_launch_file saved them."""
    launches = load_launches(sweep_dir)
    return launches[-1][0], {i: spec for _, specs in launches for i, spec in specs.items()}


def load_launches(sweep_dir: Path) -> list[tuple[LaunchSettings, dict[int, ConfigSpec]]]:
    """Each launch's settings with the specs of the configs it launched (by index), in the order the
    launches came; a file written before it kept "launches" has one, its "settings"."""
    data = json.loads((sweep_dir / LAUNCH_FILE).read_text())
    if not isinstance(data, dict) or "configs" not in data or not (data.get("launches") or "settings" in data):
        raise ValueError(f"{sweep_dir / LAUNCH_FILE} is not a launch record megasweep wrote (no configs or settings)")
    launches: list[tuple[LaunchSettings, dict[int, ConfigSpec]]] = [
        (_settings(raw), {}) for raw in data.get("launches") or [data["settings"]]
    ]
    for index, c in data["configs"].items():
        options = {**c["options"], "setup": tuple(c["options"]["setup"])}
        launches[int(c.get("launch", 0))][1][int(index)] = ConfigSpec(
            index=int(index),
            overrides=tuple(c["overrides"]),
            output_dir=c["output_dir"],
            key=ArrayKey(allocation=Allocation(**c["shape"]), options=SbatchOptions(**options)),
            env=tuple((k, v) for k, v in c["env"]),
            max_retries=int(c.get("max_retries", 0)),
            wandb_group=c.get("wandb_group"),
        )
    return launches


def _settings(raw: dict[str, Any]) -> LaunchSettings:
    return LaunchSettings(
        python=raw["python"],
        module=raw["module"],
        cwd=raw["cwd"],
        job_name=raw["job_name"],
        max_array_size=int(raw["max_array_size"]),
        entry_args=tuple(raw.get("entry_args", ())),
        sbatch_args=dict(raw.get("sbatch_args", {})),
        srun_args=tuple(raw.get("srun_args", ())),
        local=bool(raw.get("local", False)),
        test_only=bool(raw.get("test_only", True)),
    )
