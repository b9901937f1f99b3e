"""W&B in and out of the analysis: log an analysis as a W&B run, rebuild a sweep's table from W&B runs.

Out: `log_analysis` writes one W&B run (job_type 'analysis') in the sweep's project and group, with
the results as a wandb.Table, the recommendation as text and the PNG plots as images. W&B is advice
here, never the result: any failure (no network, bad credentials, a wandb bug) is returned as one
warning and the local outputs stand.

In: the trainer (train.wandb_log) logs one W&B run per job, with the resolved RunConfig plus the
world in its config and the record's figures in its summary. `runs_to_sweeps` turns such runs back
into the table analysis.records builds from result.json files, through the very same code path
(the records are written as result.json files of a throw-away sweep directory and loaded by
load_sweeps), so that a sweep whose files are gone can still be analysed. The runs come from

    read_offline_runs   the offline run directories (`<run dir>/wandb/offline-run-*/run-*.wandb`),
                        read with wandb's own transaction-log reader (`wandb leet inspect --json`);
                        this is what the tests exercise, on runs the real trainer wrote;
    fetch_runs          the W&B server, through wandb's public API (a thin wrapper: there is no
                        server on the development machines, so it is not exercised by the tests).

What a W&B run cannot give back, because the trainer does not put it there (yet): the model's
counted parameters (the analysis then falls back to train.planner.sizes), the per-rank peak memory,
the Slurm environment (nodes then come from the layout, Layout.nodes). The overrides, the failure
message and the measured iterations' spread are in the summary (runs logged before they were have
an empty config_key and no CV). wandb is imported inside the functions: the analysis stays usable
(and fast to start) without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.records import CORE_COLUMNS, RESULT_FILE, AnalysisError, Sweeps, load_sweeps
from conf.schema import RunConfig
from train.contract import RunRecord

ANALYSIS_JOB_TYPE = "analysis"
"""job_type of the run log_analysis writes; such runs are never read back as training runs."""

DEFAULT_PROJECT = "megasweep"
INIT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 120.0
"""Longest one `wandb leet inspect` of a run's log may take (seconds); a 3-iteration run takes ~1.5 s."""

_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(RunRecord))
_CONFIG_SECTIONS = frozenset(f.name for f in dataclasses.fields(RunConfig))
_WORLD_KEYS = ("world_size", "dp", "tp", "pp")
# Run states in which a run without a result is still to finish, as the missing runs of a sweep are.
_LIVE_STATES = frozenset({"running", "pending"})


@dataclass(frozen=True)
class WandbRun:
    """What the conversion needs of one W&B run, wherever it was read from."""

    run_id: str
    config: Mapping[str, Any]
    summary: Mapping[str, Any]
    state: str
    """finished | failed | crashed | killed | running | pending (lower case)."""
    name: str | None = None
    group: str | None = None
    project: str | None = None
    entity: str | None = None
    job_type: str | None = None
    start_time: str | None = None
    """ISO 8601, UTC."""
    run_dir: str = ""
    """The run's output directory relative to the sweep ('' when unknown: the run id stands in)."""
    history: tuple[Mapping[str, Any], ...] = field(default=(), repr=False)


# ---------------------------------------------------------------------------------------------
# Runs -> records -> table


def run_to_record(run: WandbRun) -> dict[str, Any]:
    """The result.json record a W&B run of the trainer stands for (only the fields W&B holds).

    The config holds the RunConfig sections plus 'world'; the summary holds the record's figures
    under the record's own names. Any other record field found in either (the trainer may add
    overrides, env, message, params...) is taken as it is, so the conversion follows the trainer.
    """
    config = {k: v for k, v in run.config.items() if not str(k).startswith("_")}
    summary = {k: v for k, v in run.summary.items() if not str(k).startswith("_")}
    # 'hardware' is a config section (a dict) and a record field (its name): sections stay sections.
    extra = _RECORD_FIELDS - _CONFIG_SECTIONS - {"config"}
    record: dict[str, Any] = {k: v for k, v in config.items() if k in extra}
    record.update({k: v for k, v in summary.items() if k in _RECORD_FIELDS and k != "config"})
    record["config"] = {k: v for k, v in config.items() if k in _CONFIG_SECTIONS}
    world = config.get("world")
    # The trainer's world also has rank and local_rank: they are rank 0's, not the run's.
    record["world"] = {k: world.get(k) for k in _WORLD_KEYS} if isinstance(world, Mapping) else {}
    hardware = record["config"].get("hardware")
    if "hardware" not in record and isinstance(hardware, Mapping):
        record["hardware"] = hardware.get("name")
    parallelism = record["config"].get("parallelism")
    if "precision" not in record and isinstance(parallelism, Mapping):
        record["precision"] = parallelism.get("precision")
    record.setdefault("started_at", run.start_time)
    _fix_samples_per_s(record)
    has_result = isinstance(summary.get("status"), str)
    if not has_result:
        record["status"] = "error"
        record.setdefault("message", f"the W&B run has no result (W&B state: {run.state})")
    record["wandb_run_id"] = run.run_id
    record["wandb_name"] = run.name
    record["wandb_group"] = run.group
    record["wandb_state"] = run.state
    record["wandb_has_result"] = has_result
    return record


def _fix_samples_per_s(record: dict[str, Any]) -> None:
    # The trainer logs each iteration's throughput as 'samples_per_s' too, and W&B's automatic
    # summary of the last history row can land after the record's median and replace it. The
    # record's tokens_per_s_per_device has no per-iteration namesake and is, by its definition in
    # train.metrics.summarize, samples_per_s x seq_length / devices: the median comes back exact.
    model = record["config"].get("model")
    tokens = _number(record.get("tokens_per_s_per_device"))
    devices = _number(record["world"].get("world_size"))
    seq = _number(model.get("seq_length") if isinstance(model, Mapping) else None)
    if tokens is not None and devices is not None and seq is not None and seq > 0:
        record["samples_per_s"] = tokens * devices / seq


def _number(v: Any) -> float | None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _safe_name(text: str, fallback: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._+=-]+", "_", text).strip("._")
    return name or fallback


def records_to_sweeps(records_by_sweep: Mapping[str, Sequence[Mapping[str, Any]]]) -> Sweeps:
    """The analysis table of records grouped by sweep label, built exactly as from result.json files.

    The records are written as result.json files of a temporary sweep directory per label, and
    load_sweeps reads them: every derived column comes from the one implementation. (A public
    records -> frame function in analysis.records would let this skip the files.)
    """
    if not records_by_sweep or not any(records_by_sweep.values()):
        raise AnalysisError("no W&B runs to analyse")
    labels = [label for label, recs in records_by_sweep.items() if recs]
    names = [_safe_name(label, f"sweep{i}") for i, label in enumerate(labels)]
    if len(set(names)) != len(names):
        names = [f"{i}-{n}" for i, n in enumerate(names)]
    with tempfile.TemporaryDirectory(prefix="megasweep-wandb-") as tmp:
        dirs = []
        for label, name in zip(labels, names, strict=True):
            sweep_dir = Path(tmp) / name
            used: set[str] = set()
            for i, rec in enumerate(records_by_sweep[label]):
                sub = _run_subdir(rec, i, used)
                (sweep_dir / sub).mkdir(parents=True, exist_ok=True)
                (sweep_dir / sub / RESULT_FILE).write_text(json.dumps(rec, default=str), encoding="utf-8")
            dirs.append(sweep_dir)
        loaded = load_sweeps(dirs, queue=None)
    table = loaded.table
    table["sweep"] = table["sweep"].map(dict(zip(names, labels, strict=True))).fillna(table["sweep"])
    if "wandb_has_result" in table.columns:
        live = ~table["wandb_has_result"].astype(bool) & table["wandb_state"].isin(_LIVE_STATES)
        table.loc[live, "outcome"] = "running"
        table.loc[live, "partial"] = False  # still running: its figures so far are no stopped run's
        table.loc[live, "reason"] = (
            "W&B run still " + table.loc[live, "wandb_state"].astype(str) + ", no result yet"
        )
    return Sweeps(table=table, sweep_dirs=(), labels=tuple(labels), warnings=loaded.warnings)


def _run_subdir(record: Mapping[str, Any], index: int, used: set[str]) -> str:
    # The run's own directory when known (it is the run_dir column), else its W&B id; never '..'.
    wanted = str(record.get("wandb_run_dir") or "").strip("/")
    parts = [p for p in wanted.split("/") if p not in ("", ".", "..")]
    sub = "/".join(_safe_name(p, "_") for p in parts) or _safe_name(str(record.get("wandb_run_id") or ""), "")
    sub = sub or f"run{index}"
    if sub in used:
        sub = f"{sub}/{_safe_name(str(record.get('wandb_run_id') or index), str(index))}"
    used.add(sub)
    return sub


def runs_to_sweeps(runs: Iterable[WandbRun], *, group: str | None = None, label: str | None = None) -> Sweeps:
    """The analysis table of the trainer's W&B runs (analysis runs and other groups left out).

    One sweep per W&B group, labelled by the group (the trainer's default group is the sweep
    directory's name, so the labels match those of the files); runs without a group become the
    sweep `label`, or 'wandb'.
    """
    by_sweep: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if run.job_type == ANALYSIS_JOB_TYPE or (group is not None and run.group != group):
            continue
        record = run_to_record(run)
        record["wandb_run_dir"] = run.run_dir
        by_sweep.setdefault(run.group or label or "wandb", []).append(record)
    if not by_sweep:
        where = f" in group {group!r}" if group is not None else ""
        raise AnalysisError(f"no training runs{where} among the W&B runs")
    sweeps = records_to_sweeps(by_sweep)
    table = sweeps.table
    # run_dir comes out as the temporary sub-directory: put the run's real one back.
    table["run_dir"] = table["wandb_run_dir"].fillna("").astype(str)
    return sweeps


# ---------------------------------------------------------------------------------------------
# Reading offline runs


def find_offline_run_files(paths: Sequence[str | Path]) -> list[tuple[Path, Path]]:
    """(.wandb file, the directory it was found from) for every offline run under the paths.

    A path may be a .wandb file, an offline run directory, or any directory above them (a sweep).
    """
    found: list[tuple[Path, Path]] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise AnalysisError(f"{path} does not exist")
        if path.is_file():
            if path.suffix != ".wandb":
                raise AnalysisError(f"{path} is not a W&B run log (.wandb)")
            found.append((path, path.parent))
            continue
        files = sorted(path.rglob("run-*.wandb"))
        if not files:
            raise AnalysisError(f"{path} holds no W&B run log (run-*.wandb)")
        found.extend((f, path) for f in files)
    # wandb/latest-run is a link to one of the runs: read each log once.
    seen: set[Path] = set()
    unique = []
    for f, root in found:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append((f, root))
    return unique


def _fold_log(lines: Iterable[str], run_file: Path, root: Path) -> WandbRun:
    """A run from the JSON records of its transaction log, as W&B itself would fold them."""
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: list[Mapping[str, Any]] = []
    meta: dict[str, Any] = {}
    exit_code: int | None = None
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        kind = rec.get("type")
        body = rec.get(kind) or {}
        if kind == "run":
            meta = body
            config.update((body.get("config") or {}).get("update") or {})
        elif kind == "config":
            config.update(body.get("update") or {})
            for key in body.get("remove") or {}:
                config.pop(key, None)
        elif kind == "summary":
            summary.update(body.get("update") or {})
            for key in body.get("remove") or {}:
                summary.pop(key, None)
        elif kind == "history":
            history.append(body.get("item") or {})
        elif kind == "exit":
            exit_code = int(body.get("exit_code") or 0)
    # No exit record: the process is still running, or was killed before wandb could finish;
    # an offline log cannot tell them apart (W&B's server calls the latter 'crashed' later).
    state = "running" if exit_code is None else ("finished" if exit_code == 0 else "failed")
    run_id = str(meta.get("run_id") or run_file.stem.removeprefix("run-"))
    return WandbRun(
        run_id=run_id,
        config=config,
        summary=summary,
        state=state,
        name=meta.get("display_name"),
        group=meta.get("run_group") or None,
        project=meta.get("project") or None,
        entity=meta.get("entity") or None,
        job_type=meta.get("job_type") or None,
        start_time=meta.get("start_time"),
        run_dir=_offline_run_dir(run_file, root),
        history=tuple(history),
    )


def _offline_run_dir(run_file: Path, root: Path) -> str:
    # <output dir>/wandb/offline-run-*/run-*.wandb: the trainer's output directory is the run's.
    run_folder = run_file.parent
    out = run_folder.parent.parent if run_folder.parent.name == "wandb" else run_folder
    try:
        rel = out.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return ""
    return "" if rel == "." else rel


def read_offline_run(
    run_file: Path, *, root: Path | None = None, timeout_s: float = READ_TIMEOUT_S
) -> WandbRun:
    """One offline run, read with wandb's own reader of the transaction log (`wandb leet inspect`).

    wandb 0.31 keeps no summary file for offline runs; the .wandb log (records of type run, config,
    summary, history, exit) is the data, and wandb's Go core is what reads it.
    """
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)]
    env = {**os.environ, "WANDB_SILENT": "true"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        raise AnalysisError(f"{run_file}: wandb could not read it ({exc})") from None
    if proc.returncode != 0:
        err = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise AnalysisError(f"{run_file}: wandb could not read it ({err})")
    try:
        return _fold_log(proc.stdout.splitlines(), run_file, root or run_file.parent)
    except (ValueError, TypeError, AttributeError) as exc:
        raise AnalysisError(f"{run_file}: unexpected output of wandb's reader ({exc})") from None


def read_offline_runs(paths: Sequence[str | Path], *, workers: int = 4) -> list[WandbRun]:
    """Every offline run under the paths (see find_offline_run_files), in path order."""
    files = find_offline_run_files(paths)
    # Each read is a wandb process (about a second of start-up): overlap them.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda fr: read_offline_run(fr[0], root=fr[1]), files))


def offline_sweeps(paths: Sequence[str | Path], *, group: str | None = None) -> Sweeps:
    """`python -m analysis --wandb-offline DIR...`: the table of the offline runs under the paths."""
    return runs_to_sweeps(read_offline_runs(paths), group=group, label=Path(paths[0]).resolve().name)


# ---------------------------------------------------------------------------------------------
# Reading from a W&B server (thin: not exercised without a server)


def api_run_to_wandb_run(run: Any) -> WandbRun:
    """A wandb.apis.public.Run as a WandbRun (attributes only; no further requests but config/summary)."""
    created = getattr(run, "created_at", None)
    return WandbRun(
        run_id=str(run.id),
        config=dict(run.config or {}),
        summary=dict(getattr(run, "summary_metrics", None) or {}),
        state=str(getattr(run, "state", "") or "").lower(),
        name=getattr(run, "name", None),
        group=getattr(run, "group", None),
        project=getattr(run, "project", None),
        entity=getattr(run, "entity", None),
        job_type=getattr(run, "job_type", None),
        start_time=str(created) if created else None,
    )


def fetch_runs(path: str, group: str, *, timeout_s: int = 60) -> list[WandbRun]:
    """The runs of one group of ENTITY/PROJECT from the W&B server (wandb.Api; needs network and a key).

    A thin wrapper on purpose: the conversion it feeds (runs_to_sweeps) is tested on real offline
    runs; this call itself cannot be tested without a server.
    """
    import wandb

    api = wandb.Api(timeout=timeout_s)
    return [api_run_to_wandb_run(r) for r in api.runs(path, filters={"group": group}, lazy=False)]


def server_sweeps(path: str, group: str) -> Sweeps:
    """`python -m analysis --wandb ENTITY/PROJECT --group SWEEP`."""
    if path.count("/") != 1 or not all(path.split("/")):
        raise AnalysisError(f"--wandb wants ENTITY/PROJECT, got {path!r}")
    try:
        runs = fetch_runs(path, group)
    except AnalysisError:
        raise
    except Exception as exc:  # network, credentials, unknown project: the user's to fix
        raise AnalysisError(
            f"W&B runs of {path} group {group!r} not read: {type(exc).__name__}: {exc}"
        ) from None
    return runs_to_sweeps(runs, group=group)


# ---------------------------------------------------------------------------------------------
# Logging an analysis


@dataclass(frozen=True)
class Destination:
    """Where the analysis run goes."""

    project: str
    entity: str | None
    group: str | None
    mode: str
    """offline | online (WANDB_MODE wins)."""


def _first(df: pd.DataFrame, column: str) -> str | None:
    if column not in df.columns:
        return None
    values = [v for v in df[column] if isinstance(v, str) and v]
    return values[0] if values else None


def resolve_destination(
    df: pd.DataFrame,
    *,
    labels: Sequence[str],
    project: str | None = None,
    entity: str | None = None,
    group: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Destination:
    """Project, entity and group from the flags, else from the records' config.logger, as the trainer chose.

    The trainer's group is logger.wandb_group, else the sweep directory's name: the sweep label.
    Mode: WANDB_MODE wins, else the records' logger.wandb_mode, else offline (never the network
    unless someone asked for it); a sweep logged with W&B disabled gets an offline analysis run.
    """
    env = os.environ if environ is None else environ
    mode = env.get("WANDB_MODE", "").strip() or _first(df, "config.logger.wandb_mode") or "offline"
    if mode in ("disabled", "off", "dryrun_disabled"):
        mode = "disabled" if env.get("WANDB_MODE", "").strip() else "offline"
    return Destination(
        project=project or _first(df, "config.logger.wandb_project") or DEFAULT_PROJECT,
        entity=entity or _first(df, "config.logger.wandb_entity"),
        group=group or _first(df, "config.logger.wandb_group") or (labels[0] if labels else None),
        mode="offline" if mode == "dryrun" else mode,
    )


def results_for_wandb(df: pd.DataFrame) -> pd.DataFrame:
    """The core columns, with NaN as None and lists as JSON text (what a wandb.Table takes)."""
    out = df[[c for c in CORE_COLUMNS if c in df.columns]].copy()
    out = out.astype(object).where(out.notna(), None)
    for name in out.columns:
        out[name] = out[name].map(lambda v: json.dumps(v) if isinstance(v, list | dict) else v)
    return out


def log_analysis(
    df: pd.DataFrame,
    *,
    dest: Destination,
    out_dir: Path,
    recommendation: str,
    results_markdown: str,
    plots: Sequence[Path] = (),
    name: str | None = None,
) -> tuple[str | None, str | None]:
    """Log the analysis as one W&B run; (W&B run directory or None, warning or None). Never raises.

    The offline run lands in out_dir/wandb; `wandb sync` uploads it later.
    """
    if dest.mode == "disabled":
        return None, "W&B logging skipped: WANDB_MODE is disabled"
    try:
        import wandb

        run = wandb.init(
            project=dest.project,
            entity=dest.entity,
            group=dest.group,
            job_type=ANALYSIS_JOB_TYPE,
            name=name or (f"analysis-{dest.group}" if dest.group else "analysis"),
            dir=str(out_dir),
            mode=dest.mode,  # type: ignore[arg-type]  # checked by wandb itself
            config={"sweeps": sorted({str(s) for s in df["sweep"]}), "rows": int(len(df))},
            settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S, console="off", quiet=True, disable_git=True),
        )
    except Exception as exc:
        return None, f"W&B logging skipped: wandb init failed: {type(exc).__name__}: {exc}"
    warning = None
    try:
        logged: dict[str, Any] = {"results": wandb.Table(dataframe=results_for_wandb(df))}
        for path in plots:
            logged[f"plots/{path.stem}"] = wandb.Image(str(path))
        run.log(logged)
        counts = df["outcome"].value_counts()
        run.summary.update(
            {
                "recommendation": recommendation,
                "results_markdown": results_markdown,
                **{f"outcomes/{k}": int(v) for k, v in counts.items()},
            }
        )
    except Exception as exc:
        warning = f"W&B logging incomplete: {type(exc).__name__}: {exc}"
    run_dir = None
    try:
        run_dir = str(Path(run.dir).parent)
        run.finish(exit_code=0 if warning is None else 1)
    except Exception as exc:
        warning = warning or f"W&B logging incomplete: finish failed: {type(exc).__name__}: {exc}"
    return run_dir, warning


__all__ = [
    "ANALYSIS_JOB_TYPE",
    "Destination",
    "WandbRun",
    "api_run_to_wandb_run",
    "fetch_runs",
    "find_offline_run_files",
    "log_analysis",
    "offline_sweeps",
    "read_offline_run",
    "read_offline_runs",
    "records_to_sweeps",
    "resolve_destination",
    "results_for_wandb",
    "run_to_record",
    "runs_to_sweeps",
    "server_sweeps",
]
