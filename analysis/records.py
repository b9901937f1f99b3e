"""Load one or more sweeps into one pandas table: results, skipped configs and missing runs.

A sweep directory holds a result.json per finished run (anywhere below it; train.contract.RunRecord),
optionally the dry run's plan.csv (train.contract.PlanRow; its infeasible rows were never run) and the
launcher's manifest.jsonl (train.contract; which configs were submitted, which skipped). Every
config becomes one row whose `outcome` is one of OUTCOMES:

    ok, oom, nan, timeout, fail   a result.json (fail = the record's 'error'), or a job Slurm ended
                                  without writing one, or a local run killed before it (manifest)
    cancelled                     its Slurm job was cancelled (scancel): its record says so, or Slurm's
                                  CANCELLED does over a `timeout` record (scancel's SIGTERM reads as a
                                  time limit's to the trainer) or over a missing one; a job Slurm
                                  PREEMPTED is `timeout` (reason: preempted), as `status`'s preempted
    refused                       sbatch refused the config's job (manifest; reason: Slurm's message)
    interrupted                   a record that says so (Ctrl-C, SIGINT), or a local sweep's config
                                  Ctrl-C stopped before it started (manifest)
    skipped                       infeasible in plan.csv or skipped in the manifest (reason says why;
                                  a skipped or refused config plan.csv lacks is planned here, from
                                  the configs multirun.yaml names, for its layout)
    pending, running              submitted or exported (manifest), no result yet; an exported
                                  config's job id is the one its array task recorded
                                  (train.contract.resolve_exported)
    planned                       feasible in a dry run's plan.csv, never launched (no manifest
                                  entry, no result): planned, not run; it carries the plan's
                                  predictions (pred_sec_per_iter, pred_tflops, pred_mfu)

A launched config without a record (pending, running, ended by Slurm or killed before it wrote one)
has the layout its manifest entry keeps (train.contract.LaunchedLayout, what the launcher composed),
where no plan.csv row gives one: composing its overrides here would cost each analysis ~0.5 s.

A run stopped before its end (timeout: Slurm's time limit, a preemption, SIGTERM; cancelled: scancel;
interrupted: Ctrl-C) keeps the figures of the iterations it measured, as its record gives them:
`partial` says a row's figures are such (PARTIAL_OUTCOMES, at least MIN_PARTIAL_ITERATIONS measured), for the tables to
show them marked and for results.csv's readers to filter; what ranks or compares runs takes `ok` only.

A launched config's outcome is the state `python -m launchers status` gives it (launchers.states.judge:
a requeued job's old record is pending, a damaged record failed, a local launcher's config running or
queued), in the words above: its record's kind of failure where status says failed.

Every record field is kept (nested dicts flattened to dotted columns: config.model.hidden_size),
and CORE_COLUMNS are derived from them once, vectorised, so that the reports never look into
records again. The planner's predictions of each recorded config (memory, and seconds per iteration
from the dry run's time model, train.planner.plan.time_prediction) are computed here too, once per
distinct config. Torch-free.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import itertools
import json
import math
import operator
import os
import re
import shlex
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd

from conf.schema import (
    Engine,
    HardwareConfig,
    ModelConfig,
    ModelKind,
    Offload,
    OptimizerImpl,
    ParallelismConfig,
    Precision,
    Recompute,
    RunConfig,
)
from launchers.bulk import bulk_allocation
from launchers.queue import ended_outcome, read_states
from launchers.states import asks_slurm, judge, local_launchers
from train.contract import (
    EARLIER_MULTIRUN_FILE,
    MANIFEST_FILE,
    MEDIAN_FIELDS,
    MULTIRUN_FILE,
    PLAN_COLUMNS,
    PLAN_FILE,
    RESULT_FILE,
    SEARCH_FILE,
    LaunchedLayout,
    ManifestEntry,
    ManifestError,
    OomReport,
    PeakCalibration,
    PlanRow,
    RunRecord,
    join_overrides,
    normalize_dir,
    read_manifest,
    read_plan_csv,
    recorded_overrides,
    reruns_of,
    resolve_exported,
    split_overrides,
)
from train.planner.layout import Layout
from train.planner.memory import estimated_memory
from train.planner.plan import plan_run, time_prediction
from train.planner.rules import device_mismatch
from train.planner.sizes import total_params
from train.power import PowerSummary

GIB = 2**30
_OBJECT = np.dtype(object)

OUTCOMES = ("ok", "oom", "nan", "timeout", "cancelled", "fail", "interrupted", "refused", "skipped", "pending", "running",
            "planned")  # fmt: skip
FAILED = ("oom", "nan", "timeout", "cancelled", "fail", "interrupted", "refused", "skipped")
MISSING = ("pending", "running")
"""Launched, no result yet: Slurm may still give one."""
NOT_RUN = (*MISSING, "planned")
"""No result, and none is a failure: launched and not finished, or only planned."""

PARTIAL_OUTCOMES = ("timeout", "cancelled", "interrupted")
"""Outcomes of a run stopped from outside before its end (Slurm's time limit or a preemption, SIGTERM;
scancel; Ctrl-C, SIGINT). Its record keeps the medians of the iterations it measured after warm-up, taken as a
finished run's are (train.trainer._figures): what the config ran at until the stop, which the tables
show marked partial (`partial`). A run that ran out of memory, diverged or failed broke on its config
or a fault, and its figures are not shown."""
SPEED_COLUMNS = ("sec_per_iter", "sec_cv", "pred_error", "tflops", "mfu", "pflops", "samples_per_s")
"""CORE_COLUMNS that are a run's speed, measured (and pred_error, measured against the prediction): with
train.contract.MEDIAN_FIELDS, the figures results.csv leaves blank where the tables show none (a failed
run's: OOM, NaN, error; a stopped run's below MIN_PARTIAL_ITERATIONS), see write_results_csv."""
MIN_PARTIAL_ITERATIONS = 2
"""Measured iterations a stopped run needs for its partial figures to be shown: one iteration is a
lone sample with no spread (the record's CV needs two, train.metrics.spread), so nothing tells a
representative step from the one a stop, a checkpoint or a neighbour slowed; below it the row's
figures stay blank and its Notes say how many were measured."""

# The record's status -> outcome; anything unknown is a failure of some kind.
_STATUS_OUTCOME = {"ok": "ok", "oom": "oom", "nan": "nan", "timeout": "timeout", "cancelled": "cancelled", "error": "fail",
                   "interrupted": "interrupted"}  # fmt: skip

CORE_COLUMNS: tuple[str, ...] = (
    "sweep",  # the sweep directory's label (its name; its path when names clash)
    "source",  # result | plan | manifest: where the row comes from
    "run_dir",  # output directory relative to the sweep directory ('' when unknown)
    "outcome",  # one of OUTCOMES
    "partial",  # True: the figures are a stopped run's (PARTIAL_OUTCOMES), of the iterations it measured before the stop
    "resumed",  # True: the record's run went on from a checkpoint (resumed_from_step); its figures are its last attempt's
    "reason",  # why a config failed, was skipped or is missing (free text, may be empty)
    "config_key",  # sorted overrides joined by spaces: what a config is across sweeps
    "layout_key",  # model, hardware, batch and layout fields: matches configs whose overrides differ
    "model",
    "hardware",
    "nodes",
    "devices",
    "dp",
    "tp",
    "pp",
    "mbs",
    "gbs",
    "seq_length",
    "size_params",  # parameters of the model (the record's count, else train.planner.sizes)
    "sec_per_iter",
    "sec_cv",  # spread of the measured iterations' seconds: std / mean (fraction; NaN when unknown)
    "pred_sec_per_iter",  # the time model's seconds per iteration of the config, as the dry run predicts it (NaN: see pred_reason)
    "pred_error",  # pred_sec_per_iter / sec_per_iter - 1 (fraction; < 0: predicted too fast; NaN unless both known)
    "pred_reason",  # why a run's config has no pred_sec_per_iter, in one line ('' when predicted)
    "neighbour_jobs",  # other Slurm jobs seen on the run's nodes during training (count; NaN outside Slurm)
    "device_mismatch",  # why the run's device is not the one its hardware config describes ('' when it is, or unknown)
    "tflops",  # model TFLOP/s per device (per-GEMM count, no recompute; the MFU numerator)
    "mfu",
    "pflops",  # aggregate PetaFLOP/s = tflops x devices / 1024, as the BLOOM notes write it
    "samples_per_s",
    "mem_gib",  # measured peak per device, max over ranks and iterations (GiB)
    "mem_pred_gib",  # train.planner.memory: what must fit on the worst rank, overheads included (GiB)
    "mem_capacity_gib",  # usable memory per device: capacity less the reserve (GiB)
    "date",  # MM-DD the run started, as the seeds' Notes write it
    "job_id",
    "queue_state",  # Slurm's state of a missing run's job (squeue / sacct), '' when unknown
    "manifest_index",
    "rerun_as",  # the manifest index of the config that reruns this failed one with changed fields (NaN: none)
)

WHOLE_CORE_COLUMNS = ("nodes", "devices", "dp", "tp", "pp", "mbs", "gbs", "seq_length", "size_params",
                      "neighbour_jobs", "manifest_index", "rerun_as")  # fmt: skip
"""CORE_COLUMNS that count (nodes, degrees, samples, tokens, parameters, jobs): a row without one (a
skipped or pending config) makes the column float in the table, and results.csv writes them whole."""

QueueLookup = Callable[[Sequence[str]], Mapping[str, str]]
"""Job ids -> Slurm state (RUNNING, PENDING, FAILED, ...); ids it does not know are left out."""


class AnalysisError(Exception):
    """Input the analysis cannot work with; the message is one line for the user."""


@dataclass(frozen=True)
class Sweeps:
    """The loaded table and what the user should know about the loading."""

    table: pd.DataFrame
    sweep_dirs: tuple[Path, ...]
    labels: tuple[str, ...]
    warnings: tuple[str, ...]


# ---------------------------------------------------------------------------------------------
# Finding and parsing files


def _result_dirs(sweep_dir: Path, sweeps: list[str] | None = None) -> list[tuple[str, str]]:
    """(directory, its path relative to sweep_dir) of every result.json below sweep_dir, in the
    order of their paths' parts (as sorted Paths: tables are reproducible). `sweeps`, if given, gets
    the relative path of every directory below sweep_dir that holds a sweep's manifest or plan.

    Strings and os.scandir, not Paths and os.walk: a sweep of 10,000 runs would spend a good part
    of its loading in pathlib, and os.walk lists every directory twice over (names, then entries).
    What it finds is what os.walk(sweep_dir) would: symbolic links to directories are not followed,
    unreadable directories are passed over; a directory named result.json is listed, not entered.
    """
    top = os.fspath(sweep_dir)
    found = []
    stack = [(top, "")]
    while stack:
        root, rel = stack.pop()
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            name = entry.name
            try:
                if name == RESULT_FILE:
                    # A directory of that name too: reading it fails, and the warning says so,
                    # rather than its config reading as pending with no word why.
                    found.append((root, rel))
                elif sweeps is not None and rel and name in (MANIFEST_FILE, PLAN_FILE):
                    sweeps.append(rel)
                # Hidden directories are Hydra's (.hydra) and W&B's caches: never a run's output dir.
                elif not name.startswith(".") and entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, f"{rel}/{name}" if rel else name))
            except OSError:
                continue
    # rel has no empty part ('' only for sweep_dir itself, which sorts first either way).
    return sorted(found, key=lambda found: found[1].split("/"))


def _flatten(record: dict[str, Any]) -> dict[str, Any]:
    """A record as one flat row, exactly as pandas.json_normalize(records, sep=".") flattens it:
    the top level's plain values first, then nested dicts' values under dotted keys (an empty
    dict leaves no key), lists kept whole. Several times faster than pandas' recursion."""
    flat = {key: value for key, value in record.items() if not isinstance(value, dict)}
    for key, value in record.items():
        if isinstance(value, dict):
            _flatten_into(value, f"{key}.", flat)
    return flat


def _flatten_into(node: dict[str, Any], prefix: str, flat: dict[str, Any]) -> None:
    for key, value in node.items():
        if isinstance(value, dict):
            _flatten_into(value, f"{prefix}{key}.", flat)
        else:
            flat[f"{prefix}{key}"] = value


def _one(key: str, node: dict[str, Any]) -> tuple[Any]:
    return (node[key],)


@dataclass(frozen=True)
class _Shape:
    """How the records of one shape flatten: a shape is the keys of the record and of each dict
    nested in it (JSON gives plain dicts), and which of their values are dicts. Records whose keys
    come in another order share the shape: values are taken by key, and the columns' order is
    that of the first record (another order adds no column)."""

    nodes: tuple[tuple[int, str, int, Callable[[dict[str, Any]], tuple[Any, ...]] | None], ...]
    """Per dict, depth first from the record: (index of its parent in `nodes`, -1 for the record;
    its key in the parent; how many keys it has; what takes its plain values out, in `keys` order)."""
    keys: tuple[str, ...]
    """The flattened keys of the values `values` gives, in that order."""
    order: tuple[str, ...]
    """The same keys in _flatten's order (the top level's plain values first)."""

    @staticmethod
    def of(record: dict[str, Any]) -> _Shape | None:
        """The record's shape; None when a dotted key collides with a flattened one (a.b and a: {b})."""
        nodes: list[tuple[int, str, int, Callable[[dict[str, Any]], tuple[Any, ...]] | None]] = []
        keys: list[str] = []

        def visit(node: dict[str, Any], parent: int, key: str, prefix: str) -> None:
            plain = [name for name, value in node.items() if not isinstance(value, dict)]
            take: Callable[[dict[str, Any]], tuple[Any, ...]] | None = None
            if len(plain) == 1:  # itemgetter of one key gives the value, not a tuple of it
                take = functools.partial(_one, plain[0])
            elif plain:
                take = operator.itemgetter(*plain)
            me = len(nodes)
            nodes.append((parent, key, len(node), take))
            keys.extend(f"{prefix}{name}" for name in plain)
            for name, value in node.items():
                if isinstance(value, dict):
                    visit(value, me, name, f"{prefix}{name}.")

        visit(record, -1, "", "")
        if len(set(keys)) != len(keys):
            return None
        return _Shape(tuple(nodes), tuple(keys), tuple(_flatten(record)))

    def values(self, record: dict[str, Any]) -> list[Any] | None:
        """The record's flattened values in the order of `keys`; None when it has another shape.

        Only the dicts are checked: a value this shape holds plain may still be a dict in this
        record, which _records_table catches once per column."""
        out: list[Any] = []
        seen: list[dict[str, Any]] = []
        try:
            for parent, key, size, take in self.nodes:
                node = record if parent < 0 else seen[parent][key]
                # As many keys, and each of this shape's found (by `take`, or as a nested dict's
                # parent): the same keys.
                if type(node) is not dict or len(node) != size:
                    return None
                seen.append(node)
                if take is not None:
                    out.extend(take(node))
        except KeyError:
            return None
        return out


def _records_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    """The records as one table, exactly pd.DataFrame([_flatten(r) for r in records]): the same
    columns in the same order (as each first appears), dtypes and values (NaN where a record lacks
    a key).

    Built a column at a time: the values of records of one shape (a sweep's records mostly share
    one) are taken by key with one itemgetter per nested dict, without building a dict of ~160
    dotted keys per record, and the columns come out of one transposition of their rows.
    """
    n = len(records)
    shapes: list[_Shape] = []
    members: list[tuple[list[int], list[list[Any]]]] = []
    last = -1
    for i, record in enumerate(records):
        values = shapes[last].values(record) if last >= 0 else None
        if values is None:
            for index, shape in enumerate(shapes):
                values = shape.values(record)
                if values is not None:
                    last = index
                    break
            else:
                new = _Shape.of(record)
                if new is None:
                    return pd.DataFrame([_flatten(r) for r in records])
                shapes.append(new)
                members.append(([], []))
                last = len(shapes) - 1
                values = new.values(record)
                assert values is not None
        members[last][0].append(i)
        members[last][1].append(values)
    columns: dict[str, list[Any]] = {}
    for shape, (rows, values) in zip(shapes, members, strict=True):
        by_key = dict(zip(shape.keys, map(list, zip(*values, strict=True)), strict=True))
        for key in shape.order:
            if len(shapes) == 1:
                columns[key] = by_key[key]
                continue
            column = columns.get(key)
            if column is None:
                column = columns[key] = [np.nan] * n
            for row, value in zip(rows, by_key[key], strict=True):
                column[row] = value
    table = pd.DataFrame(columns)
    # A value that is a dict in some records and plain in the first of their shape: only a column
    # pandas left as objects can hold one.
    if any(dict in set(map(type, columns[name])) for name in table.columns[table.dtypes == _OBJECT]):
        return pd.DataFrame([_flatten(r) for r in records])
    return table


def _read_file(path: str) -> bytes:
    # os.read, not open(): a buffered file object per record costs more than the read itself.
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS = b"0" * 19
"""19 digits in a row: an integer orjson may read as a float (beyond 64 bits; json keeps it an int).
Searched for as 19 zeros in a copy whose digits are all zeros: 5 us a record against the 60 us of
the regular expression \\d{19}, which took longer than orjson's parse."""


def _parse_json(data: bytes) -> Any:
    """The JSON document in data, as json.loads parses it.

    orjson first: parsing is most of loading a sweep, and orjson builds the same objects in a
    third of the time (10,000 records: 0.23 s against 0.62 s). json takes what orjson reads
    otherwise (an integer beyond 64 bits becomes a float there: any run of 19 digits goes to json)
    and what it refuses (NaN, Infinity), and raises json's own errors.
    """
    if data.translate(_DIGITS_AS_ZERO).find(_LONG_DIGITS) < 0:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data.decode("utf-8"))


def read_records(
    sweep_dir: Path, warnings: list[str], unreadable: dict[str, str] | None = None, sweeps: list[str] | None = None
) -> list[dict[str, Any]]:
    """Every readable result record below sweep_dir, as parsed, with its `run_dir`; a result.json
    that is not one is left out with one line in warnings, and why by its run_dir in `unreadable`;
    the sweeps found below sweep_dir in `sweeps` (_result_dirs)."""
    records = []
    for root, rel in _result_dirs(sweep_dir, sweeps):
        path = os.path.join(root, RESULT_FILE)
        try:
            record = _parse_json(_read_file(path))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            warnings.append(f"{Path(root) / RESULT_FILE}: not a readable result record ({exc}); ignored")
            if unreadable is not None and not isinstance(exc, OSError):  # its content, as status reads it
                unreadable[normalize_dir(rel or ".")] = f"{type(exc).__name__}: {exc}"
            continue
        if not isinstance(record, dict) or "status" not in record:
            warnings.append(f"{Path(root) / RESULT_FILE}: not a result record (no 'status'); ignored")
            if unreadable is not None:
                unreadable[normalize_dir(rel or ".")] = "no 'status'"
            continue
        record["run_dir"] = normalize_dir(rel or ".")
        if bad := [key for key in MEASURED_FIGURES if not _figure(record.get(key))]:
            # Read as missing, as before, but said: an `ok` row with a blank sec/it and no word why.
            warnings.append(
                f"{Path(root) / RESULT_FILE}: " + ", ".join(f"{key}={record[key]!r}" for key in bad)
                + f" {'is' if len(bad) == 1 else 'are'} not a number >= 0; read as missing"
            )
            for key in bad:
                record[key] = None
        records.append(record)
    return records


MEASURED_FIGURES = ("sec_per_iter", "sec_per_iter_cv", "tflops_per_device", "mfu", "max_mem_gib")
"""The record's measured figures the tables rank and compare by: each a number >= 0, or null."""


def _figure(value: Any) -> bool:
    """Whether `value` reads as a measured figure: null (or NaN, Python's json's null), or a finite
    number >= 0 (not a bool)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


# ---------------------------------------------------------------------------------------------
# Derived columns


def _col(df: pd.DataFrame, name: str, default: Any = np.nan) -> pd.Series:
    return df[name] if name in df.columns else pd.Series(default, index=df.index, dtype=object)


def _num(df: pd.DataFrame, name: str) -> pd.Series:
    return pd.to_numeric(_col(df, name), errors="coerce").astype(float)


def _is_list(value: Any) -> bool:
    return isinstance(value, list)


def overrides_key(overrides: Iterable[str]) -> str:
    """A config's identity across sweeps: its overrides, order-free."""
    return " ".join(sorted(str(o) for o in overrides))


_LAYOUT_FIELDS = (
    "model",
    "hardware",
    "gbs",
    "mbs",
    "dp",
    "tp",
    "pp",
    "config.parallelism.zero_stage",
    "config.parallelism.offload",
    "config.parallelism.recompute",
    "config.parallelism.precision",
    "config.parallelism.engine",
)


def _join_str(df: pd.DataFrame, names: Sequence[str]) -> pd.Series:
    # Integral floats (columns that held a NaN somewhere) print as ints, so that keys match across sweeps.
    columns = [value_texts(_col(df, name, "")) for name in names]
    return pd.Series(["|".join(parts) for parts in zip(*columns, strict=True)], index=df.index, dtype=object)


def value_texts(values: pd.Series) -> list[str]:
    """_key_text of each value, computed once per distinct value (a sweep's columns repeat a few)."""
    dtype = values.dtype
    if dtype == _OBJECT:
        types = set(map(type, values.tolist())) - {type(None)}
        same_type = len(types) <= 1 and types <= {str, int, float, bool}
    else:
        same_type = isinstance(dtype, pd.StringDtype) or (isinstance(dtype, np.dtype) and dtype.kind in "fiub")
    if same_type:
        # One type throughout (True and 1 never meet): pandas finds the distinct values in one pass
        # (None and NaN: code -1, the last text, '').
        if isinstance(dtype, pd.StringDtype):  # its objects: pandas' own path for strings is slower
            values = pd.Series(values.to_numpy(dtype=object, na_value=None), dtype=object)
        codes, uniques = pd.factorize(values, use_na_sentinel=True)
        texts = np.array([*(_key_text(v) for v in uniques.tolist()), ""], dtype=object)
        return texts[codes].tolist()
    known: dict[tuple[type, Any], str] = {}
    out = []
    for v in values.astype(object):
        try:
            # By type too: True, 1 and 1.0 are one dict key but print differently.
            key = (type(v), v)
            text = known.get(key)
            if text is None:
                text = known[key] = _key_text(v)
        except TypeError:  # unhashable (a list)
            text = _key_text(v)
        out.append(text)
    return out


def _key_text(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _plain(v: Any) -> Any:
    """A value back from pandas as JSON had it (NaN -> None, 8.0 -> 8, numpy scalars -> Python)."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float):
        if math.isnan(v):
            return None
        return int(v) if v.is_integer() else v
    return v


_ENUMS: dict[str, type] = {
    "kind": ModelKind,
    "offload": Offload,
    "recompute": Recompute,
    "precision": Precision,
    "engine": Engine,
    "optimizer": OptimizerImpl,
}


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values and values[f.name] is not None:
            v = values[f.name]
            kwargs[f.name] = _ENUMS[f.name](v) if f.name in _ENUMS else v
    return cls(**kwargs)


@functools.lru_cache(maxsize=1 << 14)
def _predict(
    model_items: tuple[tuple[str, Any], ...],
    par_items: tuple[tuple[str, Any], ...],
    hw_items: tuple[tuple[str, Any], ...],
    dp: int,
) -> float:
    try:
        model = _build(ModelConfig, dict(model_items))
        par = _build(ParallelismConfig, dict(par_items))
        hw = _build(HardwareConfig, dict(hw_items)) if hw_items else None
        return estimated_memory(model, par, dp, hw).needed / GIB
    except (TypeError, ValueError, ZeroDivisionError):
        return math.nan


@functools.lru_cache(maxsize=1 << 14)
def _predict_time(
    model_items: tuple[tuple[str, Any], ...],
    par_items: tuple[tuple[str, Any], ...],
    hw_items: tuple[tuple[str, Any], ...],
    dp: int,
) -> tuple[float, str]:
    """(seconds per iteration, '') the dry run's time model predicts for a recorded config, or
    (NaN, why not). The recorded hardware config carries hardware.calibration when the sweep was
    planned with one, so the prediction reads the same measurements the plan did."""
    if not hw_items:
        return math.nan, "the record holds no hardware config"
    try:
        model = _build(ModelConfig, dict(model_items))
        par = _build(ParallelismConfig, dict(par_items))
        hw = _build(HardwareConfig, dict(hw_items))
    except (TypeError, ValueError) as exc:
        return math.nan, f"the record's config cannot be read ({exc})"
    prediction = time_prediction(model, par, hw, dp)
    if isinstance(prediction, str):
        return math.nan, prediction
    return prediction.sec_per_iter, ""


@functools.lru_cache(maxsize=1 << 14)
def _params(model_items: tuple[tuple[str, Any], ...], tp: int) -> float:
    try:
        return float(total_params(_build(ModelConfig, dict(model_items)), tp))
    except (TypeError, ValueError, ZeroDivisionError):
        return math.nan


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


@dataclass(frozen=True)
class _Predicted:
    """What the planner predicts of each record's config."""

    mem_gib: pd.Series
    params: pd.Series
    sec_per_iter: pd.Series
    reason: pd.Series
    """Why sec_per_iter is NaN ('' where it is known)."""


def _per_config(df: pd.DataFrame) -> _Predicted:
    """Predicted memory, model size and seconds per iteration, computed once per distinct
    (model, parallelism, hardware, dp) config."""
    mcols = [c for c in df.columns if c.startswith("config.model.")]
    pcols = [c for c in df.columns if c.startswith("config.parallelism.")]
    hcols = [c for c in df.columns if c.startswith("config.hardware.")]
    if not mcols or df.empty:
        nan = pd.Series(np.nan, index=df.index)
        why = pd.Series("the record holds no model config", index=df.index, dtype=object)
        return _Predicted(nan, nan.copy(), nan.copy(), why)
    names = [*mcols, *pcols, *hcols, "dp", "tp"]
    key = _join_str(df, names).tolist()
    firsts = ~pd.Series(key).duplicated().to_numpy()
    first = df.loc[firsts, names]
    pred_by_key, params_by_key, time_by_key = {}, {}, {}
    split = (len(mcols), len(mcols) + len(pcols), len(mcols) + len(pcols) + len(hcols))
    mnames, pnames, hnames = ([c.rsplit(".", 1)[1] for c in cols] for cols in (mcols, pcols, hcols))
    # One Python step per distinct config (sweeps repeat models and layouts), not per record.
    first_keys = [key[i] for i in np.flatnonzero(firsts).tolist()]
    for k, row in zip(first_keys, first.itertuples(index=False, name=None), strict=True):
        m_items = tuple((n, _hashable(_plain(v))) for n, v in zip(mnames, row[: split[0]], strict=True))
        p_items = tuple((n, _plain(v)) for n, v in zip(pnames, row[split[0] : split[1]], strict=True))
        p_items = tuple((n, list(v) if isinstance(v, list | tuple) else v) for n, v in p_items)
        h_items = tuple((n, _plain(v)) for n, v in zip(hnames, row[split[1] : split[2]], strict=True))
        dp, tp = _plain(row[-2]), _plain(row[-1])
        ok = isinstance(dp, int) and dp > 0 and isinstance(tp, int) and tp > 0
        pred_by_key[k] = _predict(m_items, _freeze(p_items), h_items, dp) if ok else math.nan
        params_by_key[k] = _params(m_items, tp) if ok else math.nan
        time_by_key[k] = (
            _predict_time(m_items, _freeze(p_items), h_items, dp) if ok
            else (math.nan, "the record holds no positive world.dp and world.tp")
        )
    times = [time_by_key[k] for k in key]
    return _Predicted(
        mem_gib=pd.Series([pred_by_key[k] for k in key], index=df.index, dtype=float),
        params=pd.Series([params_by_key[k] for k in key], index=df.index, dtype=float),
        sec_per_iter=pd.Series([t[0] for t in times], index=df.index, dtype=float),
        reason=pd.Series([t[1] for t in times], index=df.index, dtype=object),
    )


def _freeze(items: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    # lru_cache needs hashable arguments; _build turns the ramp-up tuple back into a list.
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in items)


def _layout_nodes(df: pd.DataFrame) -> pd.Series:
    """Nodes each record's layout occupies (train.planner.layout.Layout.nodes); NaN where the record
    has no whole degrees."""

    def nodes(dp: Any, tp: Any, pp: Any, per_node: Any) -> float:
        degrees, dpn = [_plain(d) for d in (dp, tp, pp)], _plain(per_node)
        if not all(isinstance(d, int) and d > 0 for d in degrees):
            return math.nan
        return float(Layout(*degrees).nodes(dpn if isinstance(dpn, int) else 1))

    per_node = _num(df, "config.hardware.devices_per_node")
    known: dict[tuple[float, ...], float] = {}  # a sweep repeats a few layouts
    values = []
    for row in zip(df["dp"].tolist(), df["tp"].tolist(), df["pp"].tolist(), per_node.tolist(), strict=True):
        n = known.get(row)
        if n is None:
            n = known[row] = nodes(*row)
        values.append(n)
    return pd.Series(values, index=df.index, dtype=float)


def _records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    if not records:
        return pd.DataFrame()
    df = _records_table(records)
    status = _col(df, "status", "error").astype(str)
    df["source"] = "result"
    df["outcome"] = status.map(_STATUS_OUTCOME).fillna("fail")
    df["reason"] = _col(df, "message", "").fillna("").astype(str).str.split("\n").str[0]
    # A status the contract does not know ('OK', None, a tool's own) counts as a failure: the row
    # says why, or it reads as a failure nobody explained.
    unknown = ~status.isin(list(_STATUS_OUTCOME)) & (df["reason"] == "")
    if unknown.any():
        raw = _col(df, "status", None)
        known = ", ".join(_STATUS_OUTCOME)
        df.loc[unknown, "reason"] = raw[unknown].map(
            lambda v: f"the record's status {v!r} is not one of {known}"
            if isinstance(v, str) else f"the record gives no status (one of {known})"
        )
    df["config_key"] = _col(df, "overrides", None).map(lambda o: overrides_key(o) if isinstance(o, list) else "")
    df["model"] = _col(df, "config.model.name", "")
    df["devices"] = _num(df, "world.world_size")
    for name in ("dp", "tp", "pp"):
        df[name] = _num(df, f"world.{name}")
    df["mbs"] = _num(df, "config.parallelism.micro_batch_size")
    df["gbs"] = _num(df, "config.parallelism.global_batch_size")
    df["seq_length"] = _num(df, "config.model.seq_length")
    # SLURM_NNODES is what the job had; the layout's nodes are what it needed (a CPU run has no Slurm).
    df["nodes"] = _num(df, "env.SLURM_NNODES").fillna(_layout_nodes(df))
    # A median that is no time (negative, zero, inf: a hand-written or damaged record) is no
    # measurement: read as none, never a run that ranks first (negative) or last (inf, "inf% faster").
    sec = _num(df, "sec_per_iter")
    df["sec_per_iter"] = sec.where(~(sec.notna() & ~(np.isfinite(sec) & (sec > 0))))
    df["sec_cv"] = _num(df, "sec_per_iter_cv")
    df["neighbour_jobs"] = _neighbour_counts(df)
    df["device_mismatch"] = _device_mismatches(df)
    df["tflops"] = _num(df, "tflops_per_device")
    df["mfu"] = _num(df, "mfu")
    df["pflops"] = df["tflops"] * df["devices"] / 1024
    df["samples_per_s"] = _num(df, "samples_per_s")
    per_rank = _col(df, "max_mem_gib_per_rank", None).map(
        lambda v: max((x for x in v if x is not None), default=np.nan) if isinstance(v, list) else np.nan
    )
    df["mem_gib"] = np.fmax(_num(df, "max_mem_gib"), pd.to_numeric(per_rank, errors="coerce").astype(float))
    df["mem_capacity_gib"] = _num(df, "config.hardware.memory_gib") - _num(
        df, "config.hardware.memory_reserve_gib"
    ).fillna(0.0)
    started = _col(df, "started_at", "").fillna("").astype(str)
    df["date"] = started.str.slice(5, 10)
    predicted = _per_config(df)
    df["mem_pred_gib"] = predicted.mem_gib
    df["size_params"] = _num(df, "params").fillna(predicted.params)
    df["pred_sec_per_iter"] = predicted.sec_per_iter
    df["pred_reason"] = predicted.reason
    df["pred_error"] = prediction_error(df).where(df["outcome"] == "ok")
    return df


def prediction_error(runs: pd.DataFrame) -> pd.Series:
    """Predicted over measured seconds per iteration - 1 (fraction; negative: the model predicted the
    run faster than it ran); NaN unless both are known and positive (results.md's Err, results.csv's
    pred_error): `python -m analysis calibrate`, the GPU report and the planner's
    tests all state the error of the prediction so (results.md once read it the other way round,
    +28.4% where they showed -22.1% for the same run)."""
    measured, predicted = _num(runs, "sec_per_iter"), _num(runs, "pred_sec_per_iter")
    return (predicted / measured - 1.0).where((measured > 0) & (predicted > 0))


def _device_mismatches(df: pd.DataFrame) -> pd.Series:
    """train.planner.rules.device_mismatch of each record, from the device it recorded and its
    hardware config: the trainer's warning, found again for records that carry the figures, so that
    a run whose MFU and memory checks read another device's figures is said so in the table."""
    columns = [_col(df, name, None) for name in ("config.hardware.name", "config.hardware.device_type",
               "config.hardware.device_pattern", "config.hardware.memory_gib", "device", "device_memory_gib")]  # fmt: skip
    known: dict[tuple[Any, ...], str] = {}  # a sweep runs on one or two kinds of device
    out = []
    for row in zip(*(c.tolist() for c in columns), strict=True):
        text = known.get(row)
        if text is None:
            name, device_type, pattern, capacity, device, memory = (_plain(v) for v in row)
            text = ""
            if isinstance(capacity, int | float) and isinstance(device, str):
                hw = HardwareConfig(name=str(name), device_type=str(device_type), memory_gib=float(capacity),
                                    device_pattern=pattern if isinstance(pattern, str) else None)  # fmt: skip
                mem = float(memory) if isinstance(memory, int | float) and math.isfinite(memory) else None
                text = device_mismatch(hw, device_name=device, memory_gib=mem) or ""
            known[row] = text
        out.append(text)
    return pd.Series(out, index=df.index, dtype=object)


def _neighbour_counts(df: pd.DataFrame) -> pd.Series:
    """Distinct jobs a record saw on its nodes: at the start or the end of training, or in accounting
    in between (NaN: not sampled)."""
    columns = [_col(df, f"neighbours.{k}", None) for k in ("at_start", "at_end", "during")]
    counts = [
        float(len({j for v in values if isinstance(v, list) for j in v}))
        if any(isinstance(v, list) for v in values) else np.nan
        for values in zip(*columns, strict=True)
    ]
    return pd.Series(counts, index=df.index, dtype=float)


def _plan_frame(path: Path, warnings: list[str]) -> pd.DataFrame:
    bad: list[str] = []
    try:
        rows = read_plan_csv(path, bad=bad)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        warnings.append(f"{path}: not a readable plan ({exc}); ignored")
        return pd.DataFrame()
    if bad:
        shown = "; ".join(bad[:3]) + ("; ..." if len(bad) > 3 else "")
        warnings.append(f"{path}: {len(bad)} row(s) are not plan rows ({shown}); left out, the other {len(rows)} read")
    return _plan_rows_frame(rows, written=_plan_header(path))


def _plan_header(path: Path) -> frozenset[str]:
    """The columns plan.csv's header names: a plan written before a column reads it with PlanRow's
    default, which says nothing of what that config was."""
    with path.open(newline="", encoding="utf-8") as f:
        return frozenset(next(csv.reader(f), ()))


_PLAN_LAYOUT_COLUMNS = (
    ("config.parallelism.zero_stage", "zero_stage"), ("config.parallelism.offload", "offload"),
    ("config.parallelism.recompute", "recompute"), ("config.parallelism.precision", "precision"),
    ("config.parallelism.engine", "engine"), ("config.parallelism.virtual_stages", "virtual_stages"),
    ("config.parallelism.sequence_parallel", "sequence_parallel"),
)  # fmt: skip
"""Column of the table <- field of train.contract.PlanRow beside the counts: a plan row's (a skipped or
planned config's) in the columns a record fills, so that its layout_key and recommend.pooled_layout_key
are those of a finished run of the same layout."""


def _plan_rows_frame(rows: Sequence[PlanRow], *, written: Collection[str] = PLAN_COLUMNS) -> pd.DataFrame:
    """The table's rows of plan rows; `written`: the PlanRow fields the plan holds (a plan.csv written
    before a layout field left its column blank, not its default)."""
    if not rows:
        return pd.DataFrame()
    plan = pd.DataFrame([dataclasses.asdict(r) for r in rows])
    # Counts as floats, as the counts beside them (and _with_launched_layouts'); words and flags as they are.
    layout = {column: plan[name].astype(float if name in ("zero_stage", "virtual_stages") else object)
              for column, name in _PLAN_LAYOUT_COLUMNS if name in written}  # fmt: skip
    overrides = plan["overrides"].fillna("").astype(str).map(split_overrides)
    out = pd.DataFrame(
        {
            "source": "plan",
            "outcome": np.where(plan["feasible"], "planned", "skipped"),
            "reason": plan["reasons"].map("; ".join),
            "config_key": overrides.map(overrides_key),
            "overrides": overrides,
            "model": plan["model"],
            "hardware": plan["hardware"],
            "nodes": plan["nodes"].astype(float),
            "devices": plan["devices"].astype(float),
            "dp": plan["dp"].astype(float),
            "tp": plan["tp"].astype(float),
            "pp": plan["pp"].astype(float),
            "mbs": plan["micro_batch_size"].astype(float),
            "gbs": plan["global_batch_size"].astype(float),
            # 0: a plan written before the column (its model's sequence length is taken, recommend._work_groups).
            "seq_length": plan["seq_length"].astype(float).where(plan["seq_length"] > 0),
            "size_params": plan["params"].astype(float).where(plan["params"] > 0),
            "mem_pred_gib": plan["mem_gib"].astype(float),
            "mem_capacity_gib": plan["mem_capacity_gib"].astype(float),
            # The dry run's own predictions: all a config not run yet has until it runs.
            "pred_sec_per_iter": plan["pred_sec_per_iter"].astype(float),
            "pred_tflops": plan["pred_tflops"].astype(float),
            "pred_mfu": plan["pred_mfu"].astype(float),
            **layout,
        }
    )
    return out


def _sweep_config(sweep_dir: Path) -> tuple[Path, str]:
    """The config directory and primary config the sweep's jobs were composed from: what Hydra's
    multirun.yaml records (a --config-dir before the main one, as Hydra searches), else conf/. A
    launch into the directory that has yet to keep the sweep's multirun.yaml (or was killed before
    it could) holds it in EARLIER_MULTIRUN_FILE: that copy is the sweep's."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from conf import CONFIG_DIR

    try:
        copy = sweep_dir / EARLIER_MULTIRUN_FILE
        hydra = OmegaConf.load(copy if copy.is_file() else sweep_dir / MULTIRUN_FILE).hydra
        name = str(hydra.job.config_name)
        sources = [s for s in hydra.runtime.config_sources if s.schema == "file"]
        dirs = [Path(s.path) for s in sources if s.provider == "command-line"]
        dirs += [Path(s.path) for s in sources if s.provider == "main"]
    except (OSError, yaml.YAMLError, OmegaConfBaseException, AttributeError, TypeError):
        # No multirun.yaml, or not Hydra's: the sweep was launched from this project's configs.
        return CONFIG_DIR, "config"
    return next((d for d in dirs if d.is_dir()), CONFIG_DIR), name


def _manifest_plan(
    sweep_dir: Path, entries: Sequence[ManifestEntry], plan: pd.DataFrame, warnings: list[str]
) -> pd.DataFrame:
    """plan.csv's rows and a plan row of each skipped or refused config that it lacks: such a config
    never ran, so nothing but a plan says its layout. Planned as the dry run plans (the config
    composed from the sweep's configs with the entry's overrides, then plan_run), so that a launched
    sweep's rows read as a plan directory's."""
    known = set(plan["config_key"]) if not plan.empty else set()
    todo = {
        key: e.overrides
        for e in entries
        if e.status in ("skipped", "refused") and (key := overrides_key(e.overrides)) not in known
    }
    if not todo:
        return plan
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from launchers.compose import FastComposer

    config_dir, config_name = _sweep_config(sweep_dir)
    rows, failed = [], []
    composer = FastComposer.from_config_dir(config_dir, config_name)
    for overrides in todo.values():
        try:
            rows.append(plan_run(composer.run_config(overrides), overrides=join_overrides(overrides)))
        except (HydraException, OmegaConfBaseException, OSError, ValueError, TypeError, KeyError) as exc:
            failed.append(str(exc).partition("\n")[0])
    if failed:
        warnings.append(
            f"{sweep_dir / MANIFEST_FILE}: {len(failed)} skipped or refused config(s) do not compose from "
            f"{config_dir / config_name}.yaml ({failed[0]}); their layout is left blank"
        )
    if not rows:
        return plan
    return _plan_rows_frame(rows) if plan.empty else pd.concat([plan, _plan_rows_frame(rows)], ignore_index=True)


def _latest_plan_rows(plan: pd.DataFrame) -> pd.DataFrame:
    """One row per config of plan.csv's: dry runs appended to one directory may plan a config twice;
    its last planning stands (plan.csv keeps the rows in the order they were planned)."""
    return plan.drop_duplicates("config_key", keep="last") if not plan.empty else plan


def _manifest_frame(entries: Sequence[ManifestEntry]) -> pd.DataFrame:
    keys = [overrides_key(e.overrides) for e in entries]
    rerun_as = reruns_of(entries)
    return pd.DataFrame(
        {
            "manifest_index": [e.index for e in entries],
            "m_overrides": [list(e.overrides) for e in entries],
            "m_key": keys,
            # What the config's own result.json records (train.contract.record_matches).
            "m_record_key": _recorded_keys(entries, keys),
            "m_dir": [e.output_dir for e in entries],
            "m_status": [e.status for e in entries],
            "m_reason": [e.reason or "" for e in entries],
            "job_id": [e.job_id or "" for e in entries],
            "m_nodes": [float(e.nodes) if e.nodes is not None else np.nan for e in entries],
            "m_layout": [e.layout for e in entries],
            "rerun_as": [float(rerun_as.get(e.index, np.nan)) for e in entries],
        }
    )


def _recorded_keys(entries: Sequence[ManifestEntry], keys: Sequence[str]) -> list[str]:
    """overrides_key(recorded_overrides(e.overrides)) of each entry, `keys` being their overrides_key:
    recorded_overrides keeps, drops or scrubs each override alone, so it is asked once per distinct
    override (a sweep repeats a few), and an entry whose overrides it keeps all has its own key."""
    recorded_of: dict[str, list[str]] = {}
    out = []
    for entry, key in zip(entries, keys, strict=True):
        recorded: list[str] = []
        for item in entry.overrides:
            kept = recorded_of.get(item)
            if kept is None:
                kept = recorded_of[item] = recorded_overrides([item])
            recorded += kept
        out.append(key if recorded == list(entry.overrides) else overrides_key(recorded))
    return out


def _merge_manifest(
    results: pd.DataFrame, plan: pd.DataFrame, entries: Sequence[ManifestEntry], warnings: list[str]
) -> pd.DataFrame:
    """Results, skipped and pending rows of one sweep, with the manifest's job ids and shapes.

    A result counts for a config when it lies in the config's directory and records the config's
    overrides (a record without overrides is taken at its directory's word); any other result.json
    below the sweep directory is an older run's, left out with a warning.
    """
    man = _manifest_frame(entries)
    parts = []
    if not results.empty:
        results = results.merge(
            man.drop(columns=["m_overrides", "m_key", "m_status", "m_reason", "m_layout"]),
            how="left", left_on="run_dir", right_on="m_dir",
        )
        ours = results["m_dir"].notna() & (
            (results["config_key"] == results["m_record_key"]) | ~_col(results, "overrides", None).map(_is_list)
        )
        # A directory two entries name (a rerun's, say) merges its record with both: stale only when
        # it is neither's.
        stale = sorted(set(results.loc[~ours, "run_dir"]) - set(results.loc[ours, "run_dir"]))
        if stale:
            shown = ", ".join(stale[:5]) + (", ..." if len(stale) > 5 else "")
            warnings.append(
                f"{len(stale)} {RESULT_FILE} file(s) belong to no config of the manifest (another sweep's "
                f"runs, or another config's in the same directory): {shown}; left out"
            )
        results = results[ours].drop(columns=["m_dir", "m_record_key"]).reset_index(drop=True)
    if not results.empty:
        # The job's real shape beats anything derived from the record.
        results["nodes"] = results["m_nodes"].fillna(results["nodes"])
        parts.append(results.drop(columns=["m_nodes"]))
    # By config, not directory: an entry whose directory holds another config's record has none.
    done = set(results["manifest_index"]) if not results.empty else set()
    plan_by_key = _latest_plan_rows(plan).set_index("config_key") if not plan.empty else None

    def _plan_values(keys: pd.Series) -> pd.DataFrame:
        if plan_by_key is None:
            return pd.DataFrame(index=keys.index)
        found = plan_by_key.reindex(keys.to_numpy())
        found.index = keys.index
        return found.drop(columns=["source", "outcome", "reason", "overrides"])

    skipped = man[man["m_status"] == "skipped"]
    # A result.json in a refused config's directory is an older run's: that row already stands.
    unrecorded = ~man["manifest_index"].isin(done)
    refused = man[(man["m_status"] == "refused") & unrecorded]
    # Stopped by Ctrl-C before it started (a local sweep): it never ran, and will not unless rerun.
    interrupted = man[(man["m_status"] == "interrupted") & unrecorded]
    # Killed on this machine before its record (the local launcher saw its process end).
    killed = man[(man["m_status"] == "failed") & unrecorded]
    pending = man[man["m_status"].isin(("submitted", "exported")) & unrecorded]
    for rows, outcome in ((skipped, "skipped"), (refused, "refused"), (interrupted, "interrupted"), (killed, "fail"),
                          (pending, "pending")):  # fmt: skip
        if rows.empty:
            continue
        frame = pd.concat([rows.reset_index(drop=True), _plan_values(rows["m_key"]).reset_index(drop=True)], axis=1)
        frame = _with_launched_layouts(frame, warnings)
        frame["source"] = "manifest"
        frame["outcome"] = outcome
        frame["reason"] = frame["m_reason"]
        frame["config_key"] = frame["m_key"]
        frame["overrides"] = frame["m_overrides"]
        frame["run_dir"] = frame["m_dir"]
        frame["nodes"] = pd.to_numeric(frame["m_nodes"], errors="coerce").astype(float).fillna(_num(frame, "nodes"))
        parts.append(frame.drop(columns=[c for c in frame.columns if c.startswith("m_")]))
    if not plan.empty:
        # A dry run added to the sweep (hydra/launcher=plan, append): its configs the manifest does not
        # list were planned and never launched, as in a dry run's own directory; one it lists is that
        # config's row above, with the plan's layout.
        unlisted = _latest_plan_rows(plan[~plan["config_key"].isin(set(man["m_key"]))])
        if not unlisted.empty:
            parts.append(unlisted)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


_LAUNCHED_COLUMNS = (
    ("model", "model"), ("hardware", "hardware"), ("dp", "dp"), ("tp", "tp"), ("pp", "pp"),
    ("mbs", "micro_batch_size"), ("gbs", "global_batch_size"), ("seq_length", "seq_length"),
    ("size_params", "params"), ("config.parallelism.zero_stage", "zero_stage"),
    ("config.parallelism.offload", "offload"), ("config.parallelism.recompute", "recompute"),
    ("config.parallelism.precision", "precision"), ("config.parallelism.engine", "engine"),
    ("config.parallelism.virtual_stages", "virtual_stages"),
    ("config.parallelism.sequence_parallel", "sequence_parallel"),
)  # fmt: skip
"""Column of the table <- field of train.contract.LaunchedLayout: what a launched config without a
record shows of its layout, in the columns its record would fill (the layout key's among them)."""
_LAUNCHED_TEXT = frozenset(("model", "hardware", "config.parallelism.offload", "config.parallelism.recompute",
                            "config.parallelism.precision", "config.parallelism.engine"))  # fmt: skip


def _with_launched_layouts(frame: pd.DataFrame, warnings: list[str]) -> pd.DataFrame:
    """`frame`'s manifest rows (no record) with the layout columns that no plan row filled taken from
    their entries' LaunchedLayout (`m_layout`): what the launcher composed, read here without composing
    anything. A row whose entry keeps none (a skipped config, a manifest written before layouts) is left
    as it was; a damaged one too, with a warning."""
    layouts: list[LaunchedLayout | None] = []
    bad: list[str] = []
    for raw in frame["m_layout"].tolist():
        layout = None
        if raw:
            try:
                layout = LaunchedLayout.from_json(raw)
            except ManifestError as exc:
                bad.append(str(exc))
        layouts.append(layout)
    if bad:
        warnings.append(
            f"{MANIFEST_FILE}: {len(bad)} launched config(s) keep a layout that cannot be read ({bad[0]}); "
            "their layout is left blank until they have a record"
        )
    if not any(layout is not None for layout in layouts):
        return frame
    known = np.array([layout is not None for layout in layouts])
    filled = {}
    for column, name in _LAUNCHED_COLUMNS:
        values = [getattr(layout, name) if layout is not None else None for layout in layouts]
        if column in _LAUNCHED_TEXT or name == "sequence_parallel":
            new = pd.Series(values, index=frame.index, dtype=object)
            old = frame[column].astype(object) if column in frame.columns else pd.Series(None, frame.index, dtype=object)
            blank = old.isna() | (old == "")
        else:
            # micro_batch_size 'auto' is the run's to choose: no size until its record says one.
            new = pd.Series([v if isinstance(v, int) else None for v in values], index=frame.index, dtype=float)
            old = _num(frame, column)
            blank = old.isna()
        filled[column] = old.where(~(blank.to_numpy() & known), new)
    degrees = filled["dp"] * filled["tp"] * filled["pp"]
    filled["devices"] = _num(frame, "devices").fillna(degrees)
    return frame.assign(**filled)


def _judge_launched(
    sweep_dir: Path,
    df: pd.DataFrame,
    entries: Sequence[ManifestEntry],
    queue: QueueLookup | None,
    warnings: list[str],
    unreadable: Mapping[str, str],
) -> pd.DataFrame:
    """Each launched config without an ok record, judged as `status` judges it (launchers.states.judge:
    its manifest entry, its record, Slurm's state of its job, its local launcher, a damaged record).
    Where status says failed, a record keeps the kind of failure it names (oom, nan, timeout), and a
    job Slurm ended without one fails as its state says (ended_outcome: OUT_OF_MEMORY is oom). A cancelled
    one (scancel) is `cancelled`, with a `timeout` record or none, as status says it; a preempted one
    `timeout` (status: preempted), its figures partial as a time limit's."""
    launched = df["manifest_index"].notna() & (df["outcome"] != "ok") if "manifest_index" in df.columns else None
    if launched is None or not launched.any():
        return df
    by_index = {e.index: e for e in entries}
    status = _col(df, "status", None)
    judged = []  # (row, entry, the record as judge reads it: its status and message)
    for i in df.index[launched]:
        entry = by_index[int(df.at[i, "manifest_index"])]
        record = {"status": status.at[i], "message": df.at[i, "reason"]} if df.at[i, "source"] == "result" else None
        judged.append((i, entry, record))
    # Slurm is asked only about jobs whose state can change the verdict (judge reads no other).
    asked = sorted({str(e.job_id) for _, e, r in judged if asks_slurm(e, r)})
    states: Mapping[str, str] = {}
    if queue is not None and asked:
        try:
            states = queue(asked)
        except Exception as exc:  # the queue is advice: never lose the analysis over it
            warnings.append(f"Slurm queue not read ({exc}); pending runs' states unknown")
    local = local_launchers(sweep_dir) if any(e.job_id is None for _, e, _ in judged) else {}
    rows, outcomes, reasons, queue_states = [], [], [], []
    for i, entry, record in judged:
        slurm = states.get(entry.job_id) if entry.job_id else None
        why = unreadable.get(str(df.at[i, "run_dir"])) if record is None else None
        state, detail, cause = judge(entry, record, slurm, local_run=local.get(entry.index), unreadable=why)
        if record is not None and cause in ("record", "manifest"):
            continue  # the record's own outcome and message say more than `failed`
        rows.append(i)
        outcomes.append(ended_outcome(slurm) if cause == "slurm" and state == "failed" and slurm else _OUTCOME_OF.get(state, state))
        # A job's queue state has a column of its own; the reason says what else decided.
        reasons.append("" if cause == "slurm" and state in ("pending", "running") else detail)
        queue_states.append(slurm if slurm and cause in ("requeued", "stopped", "slurm") else df.at[i, "queue_state"])
    if rows:
        df.loc[rows, "outcome"], df.loc[rows, "reason"], df.loc[rows, "queue_state"] = outcomes, reasons, queue_states
    return df


_OUTCOME_OF = {"failed": "fail", "preempted": "timeout"}
"""An outcome (OUTCOMES) of a state of launchers.states.judge; every other state is its own outcome. A
preempted run is `timeout`, as a run its time limit stopped: its record keeps the figures it measured
until the stop (PARTIAL_OUTCOMES), and its reason says it was preempted, not timed out."""


# ---------------------------------------------------------------------------------------------
# Loading


def sweep_labels(sweep_dirs: Sequence[Path]) -> tuple[str, ...]:
    """Names of the sweeps for tables: the directory names, or the paths when two names clash."""
    names = [Path(d).resolve().name or str(d) for d in sweep_dirs]
    if len(set(names)) == len(names):
        return tuple(names)
    return tuple(str(d) for d in sweep_dirs)


def load_sweep_dir(
    sweep_dir: Path, *, label: str, queue: QueueLookup | None, warnings: list[str]
) -> pd.DataFrame:
    """The rows of one sweep directory (empty frame when it holds nothing the analysis reads)."""
    unreadable: dict[str, str] = {}
    nested: list[str] = []
    results = _records_frame(read_records(sweep_dir, warnings, unreadable, nested))
    plan_path = sweep_dir / PLAN_FILE
    if nested and not plan_path.is_file() and not (sweep_dir / MANIFEST_FILE).is_file():
        _refuse_sweeps_within(sweep_dir, nested)
    plan = _plan_frame(plan_path, warnings) if plan_path.is_file() else pd.DataFrame()
    man_path = sweep_dir / MANIFEST_FILE
    entries: Sequence[ManifestEntry] = ()
    if man_path.is_file():
        try:
            entries = resolve_exported(read_manifest(man_path), sweep_dir)
        except (OSError, ManifestError) as exc:
            raise AnalysisError(f"bad manifest: {exc}") from None
        plan = _manifest_plan(sweep_dir, entries, plan, warnings)
        df = _merge_manifest(results, plan, entries, warnings)
    else:
        parts = [results]
        if not plan.empty:
            # Without a manifest nothing says a feasible planned config was ever launched: without a
            # result it is planned, not run (a dry run's directory holds only these and the skips).
            done = set(results["config_key"]) if not results.empty else set()
            parts.append(_latest_plan_rows(plan[(plan["outcome"] == "skipped") | ~plan["config_key"].isin(done)]))
        parts = [p for p in parts if not p.empty]
        df = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if df.empty:
        return df
    df["sweep"] = label
    for name in CORE_COLUMNS:
        if name not in df.columns:
            df[name] = "" if name in ("run_dir", "reason", "date", "job_id", "queue_state", "model") else np.nan
    for name in ("run_dir", "reason", "date", "job_id", "queue_state", "config_key", "model", "hardware", "pred_reason",
                 "device_mismatch"):
        # An all-missing column reads as float64, which refuses a "" fill: go through object.
        df[name] = df[name].astype(object).where(df[name].notna(), "").astype(str)
    key = _join_str(df, _LAYOUT_FIELDS)
    # No degree known (a run killed before its record, with no plan row): no layout to match on, or every
    # such row of a sweep would be one layout, its runs pooled.
    unknown = (_join_str(df, ("dp", "tp", "pp")) == "||").to_numpy()
    df["layout_key"] = key.where(~unknown, "")
    df = _judge_launched(sweep_dir, df, entries, queue, warnings, unreadable) if entries else df
    # After the judging: a stopped run's record whose job Slurm requeued is pending, not partial.
    df["partial"] = partial_rows(df)
    df["resumed"] = resumed_rows(df)
    return df


def resumed_rows(df: pd.DataFrame) -> pd.Series:
    """Whether each row's record is of a run that went on from its checkpoint (the record's resumed_from_step:
    a Slurm requeue, or the same command run again). Its figures are those of the iterations its last
    attempt measured after its own warm-up: the checkpoint keeps the earlier attempts' losses, not their
    times, so a resumed `ok` row's few iterations would read as a whole run's without this. A record
    whose job Slurm runs again (pending, running) is an earlier attempt's, not this config's outcome."""
    resumed = (_col(df, "source", "") == "result") & _num(df, "resumed_from_step").notna()
    return (resumed & ~df["outcome"].isin(MISSING)).astype(bool)


def partial_rows(df: pd.DataFrame) -> pd.Series:
    """Whether each row's figures are a stopped run's partial ones: its record's outcome is one of
    PARTIAL_OUTCOMES and it measured at least MIN_PARTIAL_ITERATIONS iterations after warm-up, with a
    time per iteration. The tables show them marked; the recommendation, scaling, ZeRO and compare
    tables, calibrate and the plots of speed take finished (`ok`) runs only, so never these."""
    stopped = df["outcome"].isin(PARTIAL_OUTCOMES) & (_col(df, "source", "") == "result")
    measured = _num(df, "measured_iterations") >= MIN_PARTIAL_ITERATIONS
    return (stopped & measured & (_num(df, "sec_per_iter") > 0)).astype(bool)


def _refuse_sweeps_within(sweep_dir: Path, nested: Sequence[str]) -> None:
    """AnalysisError for a directory that is no sweep but holds some (Hydra's multirun/<date>): read as
    one, their records were pooled without their manifests (a config interrupted before it started,
    a changed rerun's link, lost), and sweeps of other works counted as one."""
    tops = sorted({rel for rel in nested if not any(rel.startswith(f"{other}/") for other in nested)},
                  key=lambda rel: rel.split("/"))  # fmt: skip
    paths = [shlex.quote(str(sweep_dir / rel)) for rel in tops]
    shown = " ".join(paths[:8]) + (" ..." if len(paths) > 8 else "")
    raise AnalysisError(
        f"{sweep_dir} is not a sweep directory but holds {len(tops)} sweep(s) ({', '.join(tops[:8])}"
        f"{', ...' if len(tops) > 8 else ''}), each with its own {MANIFEST_FILE} or {PLAN_FILE}: give them "
        f"one by one, or together for one table (python -m analysis {shown})"
    )


def load_sweeps(sweep_dirs: Sequence[str | Path], *, queue: QueueLookup | None = read_states) -> Sweeps:
    """One table of every config of the given sweeps; AnalysisError for a missing or empty sweep."""
    if not sweep_dirs:
        raise AnalysisError("no sweep directory given")
    dirs = tuple(Path(d) for d in sweep_dirs)
    for d in dirs:
        if not d.exists():
            raise AnalysisError(f"sweep directory {d} does not exist")
        if not d.is_dir():
            raise AnalysisError(f"{d} is not a directory")
    resolved = [d.resolve() for d in dirs]
    for i, d in enumerate(resolved):
        for j, other in enumerate(resolved[:i]):
            if d == other or other in d.parents or d in other.parents:
                # Read twice, every run would count twice: false repeats, a noise that is not there.
                how = "are the same directory" if d == other else "hold the same runs (one is inside the other)"
                raise AnalysisError(f"sweep directories {dirs[j]} and {dirs[i]} {how}: give each sweep once")
    labels = sweep_labels(dirs)
    warnings: list[str] = []
    frames = []
    # Loading 10,000 records creates some 300,000 dicts, lists and floats and frees none until the
    # table is built: collections would walk them again and again (half the parsing time).
    with bulk_allocation():
        for d, label in zip(dirs, labels, strict=True):
            seen = len(warnings)
            frame = load_sweep_dir(d, label=label, queue=queue, warnings=warnings)
            if frame.empty:
                # The warnings are printed after loading, which this stops: what was found and could
                # not be read goes into the error, or it would read as if there were nothing there.
                unread = [w.removesuffix("; ignored") for w in warnings[seen:]]
                why = f"; {len(unread)} file(s) could not be read: " + "; ".join(unread[:3]) if unread else ""
                more = f"; and {len(unread) - 3} more" if len(unread) > 3 else ""
                searched = ""
                if (d / SEARCH_FILE).exists():
                    # A layout search that launched nothing (search.top_k=0): the ranking is all there is.
                    searched = (f"; its {SEARCH_FILE} is a layout search's ranking of its feasible layouts, "
                            "none launched (search.top_k=0): read it as it is, or search again with search.top_k=N "
                            "and a launcher (hydra/launcher=plan plans them, slurm measures them)")  # fmt: skip
                raise AnalysisError(
                    f"sweep directory {d} holds no readable {RESULT_FILE}, {PLAN_FILE} or {MANIFEST_FILE}: "
                    f"nothing to analyse{why}{more}{searched}"
                )
            frames.append(frame)
        table = pd.concat(frames, ignore_index=True)
    if len(frames) > 1:
        table = _drop_planned_that_ran(table)
    rest = [c for c in table.columns if c not in CORE_COLUMNS]
    return Sweeps(table=table[list(CORE_COLUMNS) + rest], sweep_dirs=dirs, labels=labels, warnings=tuple(warnings))


def _drop_planned_that_ran(table: pd.DataFrame) -> pd.DataFrame:
    """A dry run's directory analysed beside the sweep that launched its configs: a config the other
    sweep lists (run, running or skipped) is not "planned, not run"; its rows there are its record."""
    planned = table["outcome"] == "planned"
    if not planned.any():
        return table
    launched = set(table.loc[~planned, "config_key"])
    return table[~(planned & table["config_key"].isin(launched))].reset_index(drop=True)


def outcome_counts(df: pd.DataFrame) -> dict[str, int]:
    """Rows per outcome, in OUTCOMES order, zeros left out."""
    counts = df["outcome"].value_counts()
    return {o: int(counts[o]) for o in OUTCOMES if o in counts.index}


def _whole_hints(cls: type, prefix: str) -> Iterable[str]:
    """Names of `cls`'s int fields (int, int | None, int | str), and 'name.' of its dict[str, int]
    fields, each after `prefix`; a dataclass field's own fields, below its name."""
    for name, hint in typing.get_type_hints(cls).items():
        origin = typing.get_origin(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _whole_hints(hint, f"{prefix}{name}.")
        elif origin is dict and typing.get_args(hint)[1:] == (int,):
            yield f"{prefix}{name}."
        elif int in (typing.get_args(hint) if origin in (types.UnionType, typing.Union) else (hint,)):
            yield f"{prefix}{name}"  # not list[int]: a list is a JSON cell


_RECORD_DICTS: dict[str, type] = {"peak_calibration": PeakCalibration, "power": PowerSummary, "oom": OomReport}
"""RunRecord fields typed dict[str, Any] that hold one of these dataclasses (their docstrings say which):
their counts (power.samples, peak_calibration.cores, oom.iteration) are whole numbers too."""


@functools.cache
def _whole_fields() -> tuple[frozenset[str], tuple[str, ...]]:
    """(columns, column prefixes) that hold whole numbers, from where the names are defined: the
    record's fields (train.contract.RunRecord; its config, conf.schema.RunConfig, flattened into
    config.<group>.<field>) by their types, the dataclasses its dict fields hold (_RECORD_DICTS), and
    WHOLE_CORE_COLUMNS."""
    names = [*_whole_hints(RunRecord, ""), *(f"config.{n}" for n in _whole_hints(RunConfig, ""))]
    names += [n for field, cls in _RECORD_DICTS.items() for n in _whole_hints(cls, f"{field}.")]
    return frozenset(WHOLE_CORE_COLUMNS).union(n for n in names if not n.endswith(".")), tuple(
        n for n in names if n.endswith(".")
    )


def whole_number_columns(df: pd.DataFrame) -> list[str]:
    """The float columns of df that are counts (_whole_fields) and hold whole numbers only: NaN (a
    row without the field) made them floats; a 2.5 (a hand-edited record) keeps its column float."""
    names, prefixes = _whole_fields()
    out = []
    for name, column in df.items():
        if not (name in names or str(name).startswith(prefixes)) or column.dtype.kind != "f":
            continue
        values = column.to_numpy()
        known = values[~np.isnan(values)]
        # Beyond 2^53 a float is no exact integer, and an infinity none at all.
        if ((known == np.round(known)) & (np.abs(known) < 2.0**53)).all():
            out.append(str(name))
    return out


def write_results_csv(df: pd.DataFrame, path: Path) -> Path:
    """results.csv: every column; list-valued cells (losses, overrides) as JSON text, and counts
    (whole_number_columns) as integers, '2' and not '2.0', missing ones empty.

    A row's speed (SPEED_COLUMNS, and the record's own train.contract.MEDIAN_FIELDS) is given where the
    tables show it, a finished run's (`ok`) or a stopped run's (`partial`), and blank elsewhere: a run that
    ran out of memory, diverged or failed measured its iterations before it broke, and results.csv gave
    them as a finished run's (partial=False), for a filter or a sort on sec_per_iter or mfu to pick. Its
    result.json (run_dir) keeps them; memory (mem_gib, the peak so far) stays, as the memory plot draws it.

    The text is DataFrame.to_csv's of the table with those counts as Int64 (index left out, missing
    values empty, floats as repr writes them, minimal quoting). Built a column at a time, each
    distinct value's text made once (a sweep's columns repeat a few values), and the lines joined
    from those texts: to_csv converts and writes 10,000 rows of ~170 columns in slices, and even the
    csv module, fed every cell, took 0.68 s of CPU for them here against 0.40 s.
    """
    df = _speed_where_shown(df)
    whole = set(whole_number_columns(df))
    texts = [_csv_texts(df.iloc[:, i], whole=df.columns[i] in whole) for i in range(df.shape[1])]
    columns = [c for c in texts if c is not None]
    if len(columns) < len(texts):  # a dtype the loaded table never has: pandas' own writer
        out = df.astype({name: "Int64" for name in whole})
        for name in out.columns:
            if out[name].dtype == _OBJECT:
                out[name] = pd.Series(_json_cells(out[name].tolist()), index=out.index, dtype=object)
        out.to_csv(path, index=False)
        return path
    if len(columns) == 1:  # the csv module quotes the one empty field of a row, or it reads as no row
        columns = [['""' if text == "" else text for text in columns[0]]]
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f, lineterminator="\n").writerow(list(df.columns))
        if len(df) and columns:
            f.write("\n".join(map(",".join, zip(*columns, strict=True))))
            f.write("\n")
    return path


def shown_figures(df: pd.DataFrame) -> pd.Series:
    """Whether each row's measured figures are ones the tables show: a finished run's, or a stopped
    run's partial ones (partial_rows)."""
    partial = df["partial"].fillna(False).astype(bool) if "partial" in df.columns else False
    return (df["outcome"] == "ok") | partial


def _speed_where_shown(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with its speed columns blank in the rows whose figures no table shows (write_results_csv)."""
    if "outcome" not in df.columns:
        return df
    shown = shown_figures(df)
    if shown.all():
        return df
    names = [n for n in dict.fromkeys((*SPEED_COLUMNS, *MEDIAN_FIELDS)) if n in df.columns]
    return df.assign(**{n: df[n].where(shown) for n in names})


def _csv_texts(column: pd.Series, *, whole: bool = False) -> list[str] | None:
    """Each cell's field in results.csv, as the csv module writes it (str() of what is not a string,
    repr() of a float, '' for a missing value, quoted where it must be); a float column of whole
    numbers (`whole`) as integers; None for a dtype this does not know."""
    dtype = column.dtype
    if isinstance(dtype, np.dtype) and dtype.kind in "iubf":
        values = column.to_numpy()
        # Distinct by their bits, not their values: -0.0 == 0.0, yet repr tells them apart.
        codes, uniques = pd.factorize(values.view(f"i{values.itemsize}") if dtype.kind == "f" else values)
        if dtype.kind != "f":
            texts = [str(v) for v in uniques.tolist()]
        else:
            floats = uniques.view(dtype).tolist()
            texts = ["" if math.isnan(v) else str(int(v)) if whole else repr(v) for v in floats]
        return np.array(texts, dtype=object)[codes].tolist()  # no quoting: no number holds a comma
    if dtype == _OBJECT:
        cells = _json_cells(column.tolist())
    elif isinstance(dtype, pd.StringDtype):
        cells = column.astype(object).tolist()
    else:
        return None
    for i in np.flatnonzero(column.isna().to_numpy()).tolist():
        cells[i] = ""
    if dtype == _OBJECT:
        cells = [v if type(v) is str else repr(v) if isinstance(v, float) else str(v) for v in cells]
    return _quoted(cells)


_NEEDS_QUOTES = re.compile(r'[,"\r\n]')
"""What may make the csv module quote a field: the delimiter, the quote, a line break."""


def _quoted(texts: list[str]) -> list[str]:
    """The texts as csv fields, each distinct one quoted once where the csv module quotes it."""
    if not _NEEDS_QUOTES.search("".join(texts)):
        return texts
    known: dict[str, str] = {}
    out = []
    for text in texts:
        field = known.get(text)
        if field is None:
            field = known[text] = _csv_field(text) if _NEEDS_QUOTES.search(text) else text
        out.append(field)
    return out


def _csv_field(text: str) -> str:
    """text quoted as the csv module quotes a field (minimal quoting, quotes doubled)."""
    if "\r" not in text:
        return '"' + text.replace('"', '""') + '"'
    # A lone carriage return: whether it is quoted depends on the Python version; csv itself decides.
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow([text, ""])  # a lone empty field would be quoted
    return buffer.getvalue()[:-2]


def _json_cells(values: list[Any]) -> list[Any]:
    """Lists and dicts as JSON text (json.dumps); the other values as they are."""
    at = [i for i, v in enumerate(values) if isinstance(v, list | dict)]
    if not at:
        return values
    nested = [values[i] for i in at]
    texts = _one_list_texts(nested)
    if texts is None and set(map(type, nested)) == {list}:
        # One json.dumps of all the lists, cut between them, instead of a call per cell: each
        # boundary is one "], [", so as many as there are boundaries means no text holds one.
        inner = json.dumps(nested)[2:-2]
        if inner.count("], [") == len(nested) - 1:
            texts = list(map("[{}]".format, inner.split("], [")))
    if texts is None:
        texts = [json.dumps(v) for v in nested]
    if len(at) == len(values):
        return texts
    out = list(values)
    for i, text in zip(at, texts, strict=True):
        out[i] = text
    return out


def _one_list_texts(nested: list[Any]) -> list[str] | None:
    """The JSON text of each value when they are all one list (a sweep's search space, in every
    record), dumped once; None otherwise. One list: equal lists whose items are all of one type, str,
    int or float, none a float zero (True == 1 == 1.0 and -0.0 == 0.0, which JSON writes apart)."""
    first = nested[0]
    if type(first) is not list or nested.count(first) != len(nested):
        return None
    kinds = set(map(type, itertools.chain.from_iterable(nested)))
    if len(kinds) > 1 or not kinds <= {str, int, float} or (float in kinds and 0.0 in first):
        return None
    return [json.dumps(first)] * len(nested)


__all__ = [
    "CORE_COLUMNS",
    "FAILED",
    "MIN_PARTIAL_ITERATIONS",
    "MISSING",
    "NOT_RUN",
    "OUTCOMES",
    "PARTIAL_OUTCOMES",
    "SPEED_COLUMNS",
    "AnalysisError",
    "QueueLookup",
    "Sweeps",
    "WHOLE_CORE_COLUMNS",
    "load_sweep_dir",
    "load_sweeps",
    "outcome_counts",
    "overrides_key",
    "partial_rows",
    "resumed_rows",
    "shown_figures",
    "prediction_error",
    "read_records",
    "sweep_labels",
    "value_texts",
    "whole_number_columns",
    "write_results_csv",
]
