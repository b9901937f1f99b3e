"""`python -m launchers sbatch <sweep overrides>`: array scripts to submit with sbatch by hand.

    python -m launchers sbatch --name lr_scan training.lr=1e-4,3e-4,1e-3 parallelism.tp=1,2
    sbatch slurm/sweeps/lr_scan-1.sbatch; sbatch slurm/sweeps/lr_scan-2.sbatch

For sites (or people) that want to see and own what goes to Slurm. The sweep is expanded as
Hydra's basic sweeper expands it, and each config composed and validated as
`hydra/launcher=slurm` does (launchers.submit.plan_configs), so the same configs are left out
for the same reasons; they are printed and listed in <name>.skipped.tsv. The others are
grouped by allocation (launchers/allocation.py), and each group becomes one array script
<name>.sbatch (or <name>-<k>.sbatch, one per allocation or per MaxArraySize-sized piece) with:

- a header saying how it was generated, and the #SBATCH lines of the allocation and of the
  cluster config (partition, account, qos, gres, time, %N throttle, ...), plus --requeue and
  --signal=USR1@<lead> as the launcher submits its arrays (launchers.submit.signal_lead_s), and
  --open-mode=append as submitit does, so that a requeued task's Slurm log keeps its earlier
  attempts (Slurm truncates it otherwise); a --sbatch-arg requeue/signal/open-mode replaces them;
- a few lines of bash that read the task's row of <name>.tasks.tsv beside it (tab-separated:
  array task id, config index, output dir (relative to the sweep dir), cluster.max_retries,
  count of env entries, KEY=VALUE env entries of this config alone, overrides) and record the
  task's job id in <sweep dir>/.megasweep/jobs/<config index>, first, so that a task whose
  setup fails is its config's failed job;
- the cluster's setup lines, and `export` lines for the environment all its tasks share:
  cluster.env, and WANDB_RUN_GROUP=<sweep dir name> for configs whose logger.wandb_group is
  unset, so that W&B groups the runs under the sweep's name as for a launcher-run sweep
  (launchers.submit.run_env);
- the config's own environment, and
  `srun --kill-on-bad-exit=1 python -m launchers.job --output-dir <sweep dir>/<index>
  --max-retries N -- python -m train <overrides> hydra.run.dir=<sweep dir>/<index>`.
  launchers.job is the launcher's own in-job wrapper (TrainCommand): a trainer
  that checkpointed on USR1 exits with EXIT_REQUEUE, and the task requeues itself
  (`scontrol requeue <array job>_<task>`) while SLURM_RESTART_COUNT < max_retries.

So a script needs nothing but bash, awk and the installed megasweep on the nodes. Results land
where a launcher-run sweep puts them (<sweep dir>/<config index>/result.json).

Export also writes what `python -m launchers status|rerun` and `python -m analysis` read:
<sweep dir>/manifest.jsonl, with every feasible config `exported` (no job id: nothing is
queued yet; the reason names its script and array task) and every infeasible one `skipped`,
and <sweep dir>/.megasweep/launch.json (what `rerun --failed` needs to resubmit a config
through the launcher). The job ids come from the array tasks themselves: each records its id
when it starts, and status and the analysis read it (train.contract.resolve_exported). That
needs no lookup by job name (names are not unique, and sacct forgets scripts): until a task
starts, its config reads `pending`, which is all this side can know about a job submitted by
hand.

A sweep directory holds one sweep (launchers.sweepdir): exporting into one whose manifest lists
a sweep (not only infeasible configs) is refused unless --append, which adds the configs under new indices (after the last
one) and needs a --name whose scripts do not exist yet (pending tasks of the earlier scripts
read their task tables when they start). Without --append, a --name whose script in --out-dir belongs
to another sweep (whose manifest still lists configs exported to it) is refused for the same reason. The script and sweep directories are proved writable
before any file is written.

Torch-free, like everything the launchers import.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_loader import ConfigLoader
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from conf import CONFIG_DIR
from conf.schema import register_configs, unknown_override
from launchers.allocation import ArrayKey, chunk, group_by, job_licenses, slurm_mem
from launchers.compose import FastComposer, parse_override
from launchers.entry import check_entry
from launchers.site import check_own_options, check_sbatch_scripts, check_site, license_totals
from launchers.submit import (
    ConfigSpec,
    LaunchSettings,
    check_array_options,
    entry_for,
    job_words,
    merge_entries,
    plan_configs,
    read_max_array_size,
    refuse_empty_sweep,
    run_dir_override,
    run_env,
    save_launch_file,
    setup_lines,
    signal_lead_s,
)
from launchers.sweepdir import (
    SweepDirError,
    SweepOptions,
    first_index,
    removed_if_refused,
    sweep_lock,
    writable_dir,
)
from train.contract import (
    EXPORTED_JOBS_DIR,
    LOG_FILE,
    SLURM_LOG_DIR,
    ManifestEntry,
    manifest_path,
    read_manifest,
    write_manifest,
)

__all__ = [
    "DEFAULT_OUT_DIR",
    "Export",
    "ExportedScript",
    "SkippedConfig",
    "expand_sweep",
    "export_sweep",
    "format_export",
    "render_script",
    "task_row",
]

DEFAULT_OUT_DIR = Path("slurm/sweeps")
SHOWN_SKIPPED = 10
"""Skipped configs printed in full; the rest are only in <name>.skipped.tsv."""
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
CLI_OPTIONS = SweepOptions(directory="--sweep-dir", append="--append")


@dataclass(frozen=True)
class ExportedScript:
    """One array script and its task table."""

    script: Path
    tasks: Path
    key: ArrayKey
    configs: tuple[int, ...]
    """Sweep indices of the configs, in array task order (task i runs configs[i])."""


@dataclass(frozen=True)
class SkippedConfig:
    """A config left out, with the rules' reason."""

    index: int
    overrides: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Export:
    """What export_sweep wrote."""

    scripts: list[ExportedScript]
    skipped: list[SkippedConfig]
    skipped_file: Path | None
    sweep_dir: Path
    manifest: Path
    """<sweep dir>/manifest.jsonl: the exported and the skipped configs."""


def expand_sweep(overrides: Sequence[str], config_loader: ConfigLoader | None = None) -> list[list[str]]:
    """The jobs of a sweep, in the order Hydra's basic sweeper (and so hydra/launcher=slurm) gives them.

    Hydra's own overrides (`hydra.*`, `hydra/...`) are refused: a script has no Hydra sweep
    to apply them to (use --sweep-dir for where results go). `config_loader` lists a group's
    options for glob(), as Hydra's sweeper gives its parser its own.
    """
    parsed = [parse_override(text) for text in overrides]
    for override in parsed:
        if override.is_hydra_override():
            raise HydraException(
                f"'{override.input_line}': Hydra's own settings have no effect on an exported script"
            )
    if config_loader is not None and any(o.is_sweep_override() for o in parsed):
        # parse_override's parser (cached, shared) has no loader, and glob() needs one.
        parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(list(overrides))
    (jobs,) = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return jobs


def task_row(task_id: int, spec: ConfigSpec, shared_env: Mapping[str, str], sweep_dir: Path) -> str:
    """One line of the task table (see the module docstring for its columns)."""
    own_env = [f"{k}={v}" for k, v in run_env(spec, sweep_dir) if shared_env.get(k) != v]
    fields = [
        str(task_id),
        str(spec.index),
        spec.output_dir,
        str(spec.max_retries),
        str(len(own_env)),
        *own_env,
        *spec.overrides,
        run_dir_override(sweep_dir / spec.output_dir),
    ]
    for text in fields:
        # The script splits rows on tabs and reads one line per task.
        if "\t" in text or "\n" in text or not text:
            raise ValueError(f"{text!r} of config {spec.index} is empty or has a tab or newline")
    return "\t".join(fields)


def _sbatch_line(option: str, value: object | None = None) -> str:
    return f"#SBATCH --{option}" if value is None else f"#SBATCH --{option}={shlex.quote(str(value))}"


def render_script(
    *,
    name: str,
    key: ArrayKey,
    script: Path,
    tasks: Path,
    count: int,
    sweep_dir: Path,
    cwd: Path,
    python: str,
    module: str,
    entry_args: Sequence[str],
    shared_env: Mapping[str, str],
    sbatch_args: Mapping[str, str],
    srun_args: Sequence[str],
    command: str,
    configs: Sequence[int],
    licenses: Mapping[str, int] | None = None,
) -> str:
    """The text of one array script of `count` tasks (their rows are in `tasks`); `licenses`: the
    cluster's license totals, which cap the cluster.core_license request (as the launcher's)."""
    alloc, opt = key.allocation, key.options
    throttle = max(1, min(count, opt.array_parallelism))
    shown = ", ".join(map(str, configs[:8])) + (", ..." if len(configs) > 8 else "")
    lines = [
        "#!/bin/bash",
        f"# Generated by megasweep on {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC by the command below;",
        "# again, it is refused where its sweep directory holds this sweep (move that, or give --sweep-dir):",
        f"#   cd {shlex.quote(str(cwd))} && {command}",
        f"# Job array of {count} configs of one allocation: {alloc.nodes} node(s) x "
        f"{alloc.tasks_per_node} task(s), {alloc.gpus_per_node} GPU(s) per node, {alloc.time_limit_min} min.",
        f"# Configs (sweep indices) {shown}; array task i runs row i of {tasks.name}:",
        "#   task id, config index, output dir, max retries, count of env entries, KEY=VALUE env entries,",
        "#   overrides (tab-separated).",
        f"# Submit with: sbatch {shlex.quote(str(script))}",
        f"# Results: {sweep_dir}/<config index>/result.json; Slurm logs: {sweep_dir / SLURM_LOG_DIR}/; "
        f"each run's own log: <config index>/{LOG_FILE}",
        f"# Progress: python -m launchers status {shlex.quote(str(sweep_dir))}",
        "# A run that checkpoints (training.save_interval > 0) and is stopped by Slurm's USR1 warning saves",
        "# and its task requeues itself, up to the config's cluster.max_retries times, as in a launcher-run",
        "# sweep; a run that does not checkpoint ends there, recorded `timeout`.",
        _sbatch_line("job-name", name),
        _sbatch_line("array", f"0-{count - 1}%{throttle}"),
        _sbatch_line("nodes", alloc.nodes),
        _sbatch_line("ntasks-per-node", alloc.tasks_per_node),
        _sbatch_line("cpus-per-task", opt.cpus_per_task),
        _sbatch_line("time", alloc.time_limit_min),
    ]
    optional = {
        "partition": opt.partition,
        "account": opt.account,
        "qos": opt.qos,
        "constraint": opt.constraint,
        "mem": slurm_mem(opt.mem_per_node_gb),
    }
    lines += [_sbatch_line(k, v) for k, v in optional.items() if v is not None]
    if opt.exclusive:
        lines.append(_sbatch_line("exclusive"))
    cores = job_licenses(key, licenses)
    if cores:
        lines.append(_sbatch_line("licenses", cores))
    # A site's gres string (e.g. 'gpu:a100:8') wins, as in the launcher.
    if opt.gres:
        lines.append(_sbatch_line("gres", opt.gres))
    elif alloc.gpus_per_node:
        lines.append(_sbatch_line("gpus-per-node", alloc.gpus_per_node))
    lines += [
        _sbatch_line("output", sweep_dir / SLURM_LOG_DIR / "%A_%a.out"),
        _sbatch_line("chdir", cwd),
    ]
    # As the launcher submits (launchers.submit.executor_parameters, and submitit's open-mode); the
    # user's own options win. Slurm truncates a requeued job's output unless it is opened to append.
    robust = {"requeue": "", "signal": f"USR1@{signal_lead_s(alloc.time_limit_min)}", "open-mode": "append"}
    lines += [_sbatch_line(k, v or None) for k, v in robust.items() if k not in sbatch_args]
    lines += [_sbatch_line(k, v if v != "" else None) for k, v in sbatch_args.items()]
    lines += ["", "set -euo pipefail"]
    # The task's row, read before cluster.setup (to record its job id) and again after it: a sourced
    # site profile may set names such as `task`, `out` or `config` in this shell.
    row = [
        f"TASKS={shlex.quote(str(tasks))}",
        f"SWEEP_DIR={shlex.quote(str(sweep_dir))}",
        'task="${SLURM_ARRAY_TASK_ID:?submit this script with sbatch: it is a job array}"',
        "line=$(awk -F'\\t' -v id=\"$task\" '$1 == id { print; exit }' \"$TASKS\")",
        'if [[ -z "$line" ]]; then echo "megasweep: no row for array task $task in $TASKS" >&2; exit 1; fi',
        "IFS=$'\\t' read -r -a fields <<< \"$line\"",
    ]
    lines += [
        "",
        *row,
        # First, before cluster.setup: a task whose setup line fails is then a failed job of its config
        # for status and `rerun --failed`, where it was a config no job had started, pending for ever.
        "# This task's job id, for `python -m launchers status` and the analysis (see the manifest).",
        f'jobs="$SWEEP_DIR/{EXPORTED_JOBS_DIR}"',
        'mkdir -p "$jobs"',
        'printf \'%s_%s\\n\' "$SLURM_ARRAY_JOB_ID" "$task" > "$jobs/.${fields[1]}.$$"',
        'mv -f "$jobs/.${fields[1]}.$$" "$jobs/${fields[1]}"',
    ]
    if opt.setup:
        lines += ["", "# cluster.setup", *setup_lines(opt.setup)]
    if shared_env:
        lines += ["", "# Environment of every config in this array (cluster.env, W&B group of the sweep)"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in shared_env.items()]
    # A rank that fails ends its peers at once, as in the launcher's jobs; srun_args given later win.
    srun = shlex.join(["srun", "--unbuffered", "--kill-on-bad-exit=1", *srun_args])
    entry = shlex.join(["-m", module, *entry_args])
    if opt.setup:  # read again: a sourced site profile may have set `task`, `line` or `fields` here
        lines += ["", "# The task's row again, as cluster.setup may have left the names above otherwise", *row]
    lines += [
        "",
        'config="${fields[1]}" out="${fields[2]}" retries="${fields[3]}" n_env="${fields[4]}"',
        'for kv in "${fields[@]:5:n_env}"; do export "$kv"; done',
        'args=("${fields[@]:5+n_env}")',
        f'PYTHON="${{MEGASWEEP_PYTHON:-{python}}}"',
        # Slurm's log of the task holds every attempt (--open-mode=append): say where each begins.
        'echo "megasweep: array task $task runs config $config (attempt ${SLURM_RESTART_COUNT:-0}): ${args[*]}"',
        f'{srun} "$PYTHON" -m launchers.job --output-dir "$SWEEP_DIR/$out" --max-retries "$retries" -- \\',
        f'    "$PYTHON" {entry} "${{args[@]}}"',
        "",
    ]
    return "\n".join(lines)


def _check_primary_config(config_dir: Path, config_name: str, *, custom_dir: bool) -> None:
    """ValueError, one line naming the option, its value, the rule and what there is, for a --config-dir that
    is no directory or a --config-name it does not hold: Hydra's words for them ran over several lines
    ("Primary config directory not found. / Check that ...", its search path) and named neither option."""
    where = f"--config-dir {config_dir}" if custom_dir else f"megasweep's config directory ({config_dir})"
    if not config_dir.is_dir():
        what = "is a file" if config_dir.exists() else "does not exist"
        raise ValueError(
            f"--config-dir {config_dir}: {what}; name the directory that holds the sweep's primary config "
            f"(<--config-name>.yaml, here {config_name}), or leave --config-dir out for megasweep's ({CONFIG_DIR})"
        )
    name = config_name.removesuffix(".yaml")
    if (config_dir / f"{name}.yaml").is_file():
        return
    from hydra.core.config_store import ConfigStore

    register_configs()  # a primary config may be a structured one, as Hydra looks for it there too
    if f"{name}.yaml" in ConfigStore.instance().repo:
        return
    held = sorted(p.stem for p in config_dir.glob("*.yaml") if p.is_file())
    there = f"the configs there: {', '.join(held)}" if held else "it holds no .yaml file"
    raise ValueError(
        f"--config-name {config_name}: no primary config {name}.yaml in {where}; name one of the .yaml files at "
        f"its top, without .yaml ({there})"
    )


def export_sweep(
    overrides: Sequence[str],
    *,
    name: str,
    out_dir: Path = DEFAULT_OUT_DIR,
    sweep_dir: Path | None = None,
    config_dir: Path | None = None,
    config_name: str = "config",
    python: str | None = None,
    module: str = "train",
    max_array_size: int | None = None,
    array_parallelism: int | None = None,
    sbatch_args: Mapping[str, str] | None = None,
    srun_args: Sequence[str] = (),
    command: str = "python -m launchers sbatch ...",
    append: bool = False,
    test_only: bool = True,
) -> Export:
    """Write the array scripts, task tables and the skipped list of a sweep; see the module docstring.
    `test_only`: each script is judged by this machine's Slurm (sbatch --test-only) before any is written."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"--name {name!r}: use letters, digits, '_', '.', '-' (it names files and the job)")
    check_array_options(
        array_parallelism=array_parallelism,
        max_array_size=max_array_size,
        names=("--array-parallelism", "--max-array-size"),
    )
    cwd = Path.cwd()
    # The nodes run the scripts, and MEGASWEEP_PYTHON given to sbatch replaces --python there.
    check_entry(python or sys.executable, module, str(cwd), options=("--python", "--module"), here=False)
    out_dir = (cwd / out_dir).resolve()
    sweep_dir = (cwd / (sweep_dir or Path("multirun") / "sbatch" / name)).resolve()
    custom_dir = config_dir is not None
    config_dir = (config_dir or CONFIG_DIR).resolve()
    entry_args = [f"--config-name={config_name}", *([f"--config-dir={config_dir}"] if custom_dir else [])]

    _check_keys(overrides)
    _check_primary_config(config_dir, config_name, custom_dir=custom_dir)
    composer = FastComposer.from_config_dir(config_dir, config_name)
    jobs = expand_sweep(overrides, composer.config_loader)
    refuse_empty_sweep(jobs)
    # Locked from the claim of the indices until the manifest lists them: an export added to the sweep
    # at the same time takes the indices after these (launchers.sweepdir.sweep_lock).
    with sweep_lock(sweep_dir):
        first = first_index(sweep_dir, append=append, options=CLI_OPTIONS, replace_skipped=True)
        old = read_manifest(manifest_path(sweep_dir)) if manifest_path(sweep_dir).exists() else []
        specs, skipped_entries = plan_configs(
            composer, jobs, first, array_parallelism=array_parallelism, undone="nothing was exported or written"
        )
        skipped = [SkippedConfig(e.index, e.overrides, e.reason or "") for e in skipped_entries]
        # Where this machine's Slurm answers (the cluster the scripts are for, on its login node), what
        # it could never run is refused now, not when the scripts are submitted by hand.
        check_own_options(sbatch_args, option="--sbatch-arg {name}")
        check_site((s.key for s in specs), sbatch_args)
        size = max_array_size or read_max_array_size()
        totals = license_totals() if any(s.key.options.core_license for s in specs) else None
        pieces = [
            (key, piece)
            for key, members in group_by((s.key, s) for s in specs).items()
            for piece in chunk(members, size)
        ]
        stems = [name if len(pieces) == 1 else f"{name}-{number}" for number in range(1, len(pieces) + 1)]
        if append:
            _check_new_scripts(out_dir, stems, name)
        else:
            _check_other_sweeps_scripts(out_dir, stems, name, sweep_dir)
        common: dict[str, Any] = dict(
            name=name, sweep_dir=sweep_dir, cwd=cwd, python=python or sys.executable, module=module,
            entry_args=entry_args, sbatch_args=dict(sbatch_args or {}), srun_args=srun_args, command=command,
            licenses=totals,
        )  # fmt: skip
        # Every file's text is made before any directory is: a row refused (a tab in an override) must
        # not leave the scripts before it behind.
        texts = [_render(out_dir / stem, key, piece, **common) for stem, (key, piece) in zip(stems, pieces, strict=True)]
        if test_only:  # each script as it will be submitted, judged by this machine's Slurm as check_site's are
            check_sbatch_scripts(
                ((job_words(piece, key), text[3]) for (key, piece), text in zip(pieces, texts, strict=True)),
                fix="the cluster.* fields or the sbatch options (--sbatch-arg)",
                skip="--no-test-only",
                outcome="Nothing was exported or written",
                again="export again",
            )
        # Both directories are proved writable before any file is written, and those this export made
        # go again when it is refused: nothing is half-exported, and no empty directory is left.
        with removed_if_refused(out_dir, sweep_dir):
            writable_dir(out_dir, option="--out-dir")
            writable_dir(sweep_dir, option=CLI_OPTIONS.directory)
        # Slurm opens --output itself and does not create its directory.
        (sweep_dir / SLURM_LOG_DIR).mkdir(parents=True, exist_ok=True)
        scripts, exported = _write_scripts(pieces, texts)
        skipped_file = out_dir / f"{name}.skipped.tsv"
        if skipped:
            _write_skipped(skipped_file, skipped)
        else:  # an earlier export under this name (all of it skipped, say) listed others
            skipped_file.unlink(missing_ok=True)
        entries = sorted([*exported, *skipped_entries], key=lambda e: e.index)
        for e in entries:
            # A job id an earlier export's task recorded would pass for this config's.
            (sweep_dir / EXPORTED_JOBS_DIR / str(e.index)).unlink(missing_ok=True)
        settings = LaunchSettings(
            python=python or sys.executable,
            module=module,
            cwd=str(cwd),
            job_name=name,
            max_array_size=size,
            entry_args=tuple(entry_args),
            sbatch_args=dict(sbatch_args or {}),
            srun_args=tuple(srun_args),
            test_only=test_only,
        )
        save_launch_file(sweep_dir, settings, specs)
        manifest = write_manifest(merge_entries(old, entries), manifest_path(sweep_dir))
    return Export(
        scripts=scripts, skipped=skipped, skipped_file=skipped_file if skipped else None, sweep_dir=sweep_dir,
        manifest=manifest,
    )


def _check_keys(overrides: Sequence[str]) -> None:
    for text in overrides:
        # An unknown key is named as typed (`parallelism.tpp=1,2`), not as one expanded job's value.
        named = parse_override(text).key_or_group
        if "/" not in named and named.split(".", 1)[0] != "hydra" and (problem := unknown_override(named, text)):
            raise HydraException(problem)


def _write_scripts(
    pieces: Sequence[tuple[ArrayKey, Sequence[ConfigSpec]]], texts: Sequence[tuple[Path, str, Path, str]]
) -> tuple[list[ExportedScript], list[ManifestEntry]]:
    """Write each piece's task table and script (made by _render); their scripts and manifest entries."""
    scripts = []
    exported: list[ManifestEntry] = []
    for (key, piece), (tasks, tasks_text, script, script_text) in zip(pieces, texts, strict=True):
        tasks.write_text(tasks_text)
        script.write_text(script_text)
        script.chmod(0o755)
        configs = tuple(s.index for s in piece)
        scripts.append(ExportedScript(script=script, tasks=tasks, key=key, configs=configs))
        exported += [
            entry_for(s, "exported", reason=f"exported to {script}, array task {task}") for task, s in enumerate(piece)
        ]
    return scripts, exported


def _write_skipped(path: Path, skipped: Sequence[SkippedConfig]) -> Path:
    rows = ["index\treason\toverrides"]
    rows += [f"{s.index}\t{' '.join(s.reason.split())}\t{' '.join(s.overrides)}" for s in skipped]
    path.write_text("\n".join(rows) + "\n")
    return path


def _render(
    stem: Path, key: ArrayKey, piece: Sequence[ConfigSpec], *, sweep_dir: Path, **common: Any
) -> tuple[Path, str, Path, str]:
    """(task table, its text, script, its text) of one array script; nothing is written."""
    envs = [dict(run_env(s, sweep_dir)) for s in piece]
    shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
    tasks, script = stem.with_name(f"{stem.name}.tasks.tsv"), stem.with_name(f"{stem.name}.sbatch")
    tasks_text = "".join(task_row(i, s, shared, sweep_dir) + "\n" for i, s in enumerate(piece))
    script_text = render_script(
        key=key, script=script, tasks=tasks, count=len(piece), sweep_dir=sweep_dir, shared_env=shared,
        configs=tuple(s.index for s in piece), **common,
    )  # fmt: skip
    return tasks, tasks_text, script, script_text


def _check_new_scripts(out_dir: Path, stems: Sequence[str], name: str) -> None:
    taken = [p for stem in stems for p in (out_dir / f"{stem}.sbatch", out_dir / f"{stem}.tasks.tsv") if p.exists()]
    if taken:
        raise SweepDirError(
            f"--append --name {name}: {taken[0]} exists, and a task of that earlier script still to "
            "start would read the new task table. Nothing was written. Give the added configs a "
            "--name of their own."
        )


def _check_other_sweeps_scripts(out_dir: Path, stems: Sequence[str], name: str, sweep_dir: Path) -> None:
    """Refuse to overwrite a script (and its task table) that another sweep's manifest still lists its
    configs under: that sweep's tasks, submitted or not, would run this sweep's configs instead, and its
    status would wait on them for ever. A script whose sweep directory is gone may be written again."""
    for stem in stems:
        script = out_dir / f"{stem}.sbatch"
        if not script.is_file():
            continue
        owner = _script_sweep_dir(script)
        if owner is None or owner == sweep_dir or not manifest_path(owner).exists():
            continue
        try:
            entries = read_manifest(manifest_path(owner))
        except (OSError, ValueError):
            continue
        if any((e.reason or "").startswith(f"exported to {script},") for e in entries):
            raise SweepDirError(
                f"--name {name}: {script} is the script of the sweep in {owner} (its {manifest_path(owner).name} "
                "lists configs exported to it); writing this sweep's there would run these configs in its place. "
                "Nothing was written. Give this sweep a --name of its own (or another --out-dir)."
            )


def _script_sweep_dir(script: Path) -> Path | None:
    """The sweep directory an exported script writes its results to (its SWEEP_DIR line)."""
    try:
        lines = script.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("SWEEP_DIR="):
            words = shlex.split(line.removeprefix("SWEEP_DIR="))
            return Path(words[0]) if len(words) == 1 else None
    return None


def format_export(export: Export) -> str:
    """What `python -m launchers sbatch` prints: one line per script, then the skipped configs."""
    total = sum(len(s.configs) for s in export.scripts)
    lines = [
        f"sbatch: {total + len(export.skipped)} configs: {total} in {len(export.scripts)} script(s), "
        f"{len(export.skipped)} infeasible; results will go to {export.sweep_dir}"
    ]
    for s in export.scripts:
        lines.append(f"  {s.script}  ({len(s.configs)} tasks; {s.key.allocation.words()})  submit: sbatch {s.script}")
    for k in export.skipped[:SHOWN_SKIPPED]:
        lines.append(f"  skipped config {k.index} ({' '.join(k.overrides)}): {k.reason}")
    if len(export.skipped) > SHOWN_SKIPPED:
        lines.append(f"  ... and {len(export.skipped) - SHOWN_SKIPPED} more skipped")
    if export.skipped_file is not None:
        lines.append(f"  skipped configs listed in {export.skipped_file}")
    lines.append(f"  manifest: {export.manifest}; progress: python -m launchers status {export.sweep_dir}")
    return "\n".join(lines)
