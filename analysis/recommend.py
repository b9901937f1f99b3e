"""The recommendation: the layout that finishes the same work soonest.

Same work = same model, hardware, global batch size and sequence length: one iteration then trains
the same tokens whatever the layout, so seconds per iteration is time to train. Hardware is part of
it: a layout is chosen for the machine it will run on, and a CPU run is no rival of a GPU run. The fastest layout is the
one with the lowest seconds per iteration, not the highest TFLOPs per device: a layout on fewer
devices can run each one harder and still finish later (the BLOOM notes' 40-node vs 48-node tables).

A winner is called only when its margin is larger than the noise: the runs' iterations spread
(their coefficient of variation, RunRecord.sec_per_iter_cv), and a margin smaller than the two
runs' combined spread, sqrt(CV_best^2 + CV_runner_up^2), could go either way on a rerun. Then
the recommendation says so and names the configs to repeat (the top few within the noise), with
more measured iterations and whole nodes.

Runs of one layout (same fields of _LAYOUT_COUNTS and _DISTINCT; sweeps repeat a config, or run it
again under other overrides such as a profiler's) are one candidate, never each other's runner-up:
their median seconds per iteration ranks it (and gives its TFLOPs and MFU: one iteration's work
over that time), and its noise is the larger of the spread across the
runs (CV of their medians) and the largest spread within one: iterations of one run vary less than
runs do, which a within-run CV alone would hide. Runs that shared their nodes with other Slurm jobs are
pointed out: their timings include their neighbours' load.

When the time model predicted every compared run (records.py's pred_sec_per_iter, the dry run's
prediction), the recommendation also says whether the layout it predicted fastest measured fastest,
and if not, how much slower that layout ran and where the model ranked the measured fastest: what a
search that measures only its predicted top K would have missed.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from analysis.records import FAILED, MISSING, value_texts
from analysis.tables import (
    OUTCOME_TEXT,
    TIE_BREAK,
    above_peak_text,
    format_cv,
    format_err,
    format_sec,
    format_size,
    format_tflops,
    narrow,
)
from train.contract import split_overrides
from train.neighbours import isolation_note

RERUN_TOP = 3
"""Configs a recommendation inside the noise suggests repeating, at most (the best included)."""


@dataclass(frozen=True)
class Constraints:
    """Limits a recommended layout must satisfy besides finishing (None = no limit)."""

    max_nodes: int | None = None
    """At most this many nodes (the BLOOM notes' 'at most 48 nodes')."""
    max_mem_gib: float | None = None
    """Measured peak memory per device at most this (GiB): headroom against 'too close to OOM'."""
    dp_multiple_of: int | None = None
    """DP a multiple of this (batch ramp-up steps must divide evenly, the BLOOM notes' DP % 4 == 0)."""


@dataclass(frozen=True)
class Candidate:
    """One successful run, as the recommendation names it."""

    sweep: str
    run_dir: str
    nodes: int
    devices: int
    dp: int
    tp: int
    pp: int
    mbs: int
    gbs: int
    sec_per_iter: float
    tflops: float | None
    mfu: float | None
    mem_gib: float | None
    mem_capacity_gib: float | None
    overrides: str
    sec_cv: float | None = None
    """Spread of the run's measured iterations (std / mean, fraction); None when unknown."""
    neighbours: int = 0
    """Other Slurm jobs seen on the run's nodes during training."""
    pred_sec_per_iter: float | None = None
    """Seconds per iteration the time model predicts for the run's config; None when it cannot."""
    distinct: str = ""
    """The run's other layout fields that differ among the runs it is compared with (recompute=full
    ZeRO=1 ...), so that two runs of one DP x TP x PP x MBS are told apart."""
    runs: int = 1
    """Runs of this layout pooled into the candidate: with several, sec_per_iter, tflops and mfu are
    their medians, mem_gib and neighbours their maxima, sec_cv the pooled noise (see the module), and
    sweep, run_dir, overrides and the fields below those of the run nearest the median."""
    mem_device_gib: float | None = None
    """Memory of one device as the run's hardware config gives it (hardware.memory_gib, GiB); None when unknown."""
    device_mismatch: str = ""
    """Why the run's device is not the one its hardware config describes ('' when it is, or unknown)."""
    cluster: str = ""
    """The cluster config the run ran under (cluster.name; '' when its record does not say)."""
    exclusive: bool | None = None
    """Whether it asked for whole nodes (cluster.exclusive); None when its record does not say."""
    core_license: str | None = None
    """The Slurm license that kept it apart from other jobs' cores (cluster.core_license); None: none."""
    slurm: bool = True
    """Whether it ran as a Slurm job: its manifest names one, or its record looked at the job's nodes (a
    run sbatch started by hand has no manifest); False for a run of hydra/launcher=local, or of none."""

    @property
    def label(self) -> str:
        extra = f" {self.distinct}" if self.distinct else ""
        return (
            f"DP={self.dp} TP={self.tp} PP={self.pp} MBS={self.mbs}{extra} on {self.nodes} node(s) "
            f"({self.devices} devices)"
        )


@dataclass(frozen=True)
class Recommendation:
    """The fastest layout of one piece of work, with what it beat and why it qualifies."""

    model: str
    size: str
    global_batch_size: int
    seq_length: int | None
    best: Candidate
    runner_up: Candidate | None
    margin_pct: float | None
    """How much longer the runner-up takes per iteration than the best (%)."""
    highest_tflops: Candidate
    """What ranking by TFLOPs per device would have picked (the same run when they agree)."""
    satisfied: tuple[str, ...]
    per_nodes: tuple[Candidate, ...]
    """The fastest layout of each node count, fewest nodes first; empty when there is one node count."""
    candidates: int
    excluded: tuple[str, ...]
    noise_pct: float | None = None
    """Combined spread of the best and the runner-up, sqrt(CV_best^2 + CV_runner_up^2) (%); None when
    either is unknown."""
    close: tuple[Candidate, ...] = ()
    """Runs after the best whose seconds per iteration are within the noise of its own, fastest first."""
    predicted_best: Candidate | None = None
    """The compared run the time model predicted fastest (`best` when the model ranked it first); None
    unless the model predicted every compared run and there were at least two."""
    predicted_rank: int | None = None
    """Where the model ranked `best` among the compared runs by predicted time (1 = fastest; ties share
    the better place); None as for predicted_best."""
    hardware: str = ""
    """The hardware config every compared run ran on (part of the work)."""
    runs: int = 0
    """Qualifying runs behind the `candidates` layouts (more when a layout ran several times)."""
    unmet: tuple[str, ...] = ()
    """Constraints the best finished without meeting, in words: a measured peak memory above its
    hardware config's usable memory, or above its device's; empty when none."""

    @property
    def predicted_best_slower_pct(self) -> float | None:
        """How much longer per iteration the predicted fastest run measured than the measured fastest (%)."""
        if self.predicted_best is None:
            return None
        return 100.0 * (self.predicted_best.sec_per_iter / self.best.sec_per_iter - 1.0)

    @property
    def decided(self) -> bool:
        """Whether the best is ahead of every other run by more than their combined noise: of the
        runner-up's margin, and of a slower run whose wider spread reaches the best's time (`close`).
        Unknown noise (a run with fewer than two measured iterations, or a table imported without
        spreads) decides nothing."""
        if self.margin_pct is None:
            return True
        return self.noise_pct is not None and self.margin_pct > self.noise_pct and not self.close


def _opt_float(v: object) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)  # type: ignore[arg-type]


def _opt_text(v: object) -> str | None:
    return v if isinstance(v, str) and v else None


def _opt_bool(v: object) -> bool | None:
    return bool(v) if isinstance(v, bool | np.bool_) else None


_DISTINCT = (
    ("config.parallelism.recompute", "recompute"),
    ("config.parallelism.zero_stage", "ZeRO"),
    ("config.parallelism.sequence_parallel", "SP"),
    ("config.parallelism.virtual_stages", "VPP"),
    ("config.parallelism.offload", "offload"),
    ("config.parallelism.precision", "precision"),
    ("config.parallelism.engine", "engine"),
    ("config.parallelism.optimizer", "optimizer"),
)
"""Layout fields beside DP x TP x PP x MBS a label names when the compared runs differ in them. With
those, they make runs one layout to pool: a field outside them (training.lr, the seed, the logger) does
not change what an iteration computes or how, so its runs are repeats of the layout's speed."""


def _varying(runs: pd.DataFrame) -> tuple[tuple[str, str], ...]:
    """The (_DISTINCT) fields whose values differ among `runs`."""
    return tuple((col, name) for col, name in _DISTINCT if col in runs.columns and len(set(value_texts(runs[col]))) > 1)


def _candidate(row: pd.Series, varying: tuple[tuple[str, str], ...] = ()) -> Candidate:
    texts = value_texts(row[[col for col, _ in varying]]) if varying else []
    distinct = " ".join(f"{name}={text}" for (_, name), text in zip(varying, texts, strict=True))
    return Candidate(
        sweep=str(row["sweep"]),
        run_dir=str(row["run_dir"]),
        nodes=int(row["nodes"]),
        devices=int(row["devices"]),
        dp=int(row["dp"]),
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        mbs=int(row["mbs"]),
        gbs=int(row["gbs"]),
        sec_per_iter=float(row["sec_per_iter"]),
        tflops=_opt_float(row["tflops"]),
        mfu=_opt_float(row["mfu"]),
        mem_gib=_opt_float(row["mem_gib"]),
        mem_capacity_gib=_opt_float(row["mem_capacity_gib"]),
        overrides=str(row["config_key"]),
        sec_cv=_opt_float(row["sec_cv"]),
        neighbours=int(n) if (n := _opt_float(row["neighbour_jobs"])) is not None else 0,
        pred_sec_per_iter=_opt_float(row.get("pred_sec_per_iter")),
        distinct=distinct,
        runs=int(row.get("_runs", 1)),
        mem_device_gib=_opt_float(row.get("config.hardware.memory_gib")),
        device_mismatch=_opt_text(row.get("device_mismatch")) or "",
        cluster=_opt_text(row.get("config.cluster.name")) or "",
        exclusive=_opt_bool(row.get("config.cluster.exclusive")),
        core_license=_opt_text(row.get("config.cluster.core_license")),
        slurm=bool(_opt_text(row.get("job_id"))) or _opt_float(row.get("neighbour_jobs")) is not None,
    )


def _prediction_check(
    runs: pd.DataFrame, best: Candidate, varying: tuple[tuple[str, str], ...] = ()
) -> tuple[Candidate | None, int | None]:
    """(the run predicted fastest, the measured best's predicted rank) among `runs` (sorted, measured
    fastest first); (None, None) unless there are two or more and the model predicted them all."""
    if len(runs) < 2 or "pred_sec_per_iter" not in runs.columns:
        return None, None
    pred = runs["pred_sec_per_iter"].astype(float)
    if not (pred > 0).all():
        return None, None
    rank = int((pred < pred.iloc[0]).sum()) + 1
    if rank == 1:
        return best, rank
    by_pred = runs.assign(_pred=pred).sort_values(["_pred", *TIE_BREAK], kind="mergesort")
    return _candidate(by_pred.iloc[0], varying), rank


def _noise_pct(a: Candidate, b: Candidate) -> float | None:
    """The combined spread of two runs (%): a difference of their medians smaller than it is noise."""
    if a.sec_cv is None or b.sec_cv is None:
        return None
    return 100.0 * math.hypot(a.sec_cv, b.sec_cv)


def _within_noise(
    best: Candidate, others: pd.DataFrame, varying: tuple[tuple[str, str], ...] = ()
) -> tuple[Candidate, ...]:
    """The runs of `others` (sorted, fastest first) within the noise of `best`; vectorised, since a
    group may hold thousands of runs and only a few are close."""
    if best.sec_cv is None or others.empty:
        return ()
    gap = others["sec_per_iter"] / best.sec_per_iter - 1.0
    noise = np.hypot(best.sec_cv, others["sec_cv"].astype(float))
    return tuple(_candidate(r, varying) for _, r in others[gap <= noise].iterrows())


_LAYOUT_COUNTS = ("nodes", "devices", "dp", "tp", "pp", "mbs")
_NO_LAYOUT = "whose record does not give its layout (nodes, devices, DP, TP, PP and micro-batch, each at least 1)"


def pooled_layout_key(runs: pd.DataFrame) -> pd.Series:
    """What makes runs one layout (their counts and the fields in _DISTINCT), as text, one per run: the
    runs the recommendation pools (records' layout_key, which matches configs across sweeps, leaves out
    fields such as virtual_stages and the optimizer that it tells apart)."""
    cols = [c for c in (*_LAYOUT_COUNTS, *(c for c, _ in _DISTINCT)) if c in runs.columns]
    return pd.Series(["|".join(t) for t in zip(*(value_texts(runs[c]) for c in cols), strict=True)], index=runs.index)


def _pool_layouts(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per layout of `runs` (one piece of work, sorted fastest first), fastest first, with
    `_runs` the runs pooled into it: see the module for the pooled figures."""
    key = pooled_layout_key(runs)
    counts = key.map(key.value_counts())
    if (counts == 1).all():  # the usual sweep: nothing to pool, and no groupby over thousands of runs
        return runs.assign(_runs=1)
    # Labels pick the pooled rows: tables of several sweeps may repeat an index label. The counts
    # too are then by position (assigned by their old labels, repeated ones gave NaN runs).
    runs, key, counts = runs.reset_index(drop=True), key.reset_index(drop=True), counts.reset_index(drop=True)
    by = runs.groupby(key, sort=False)
    sec = by["sec_per_iter"]
    median = sec.transform("median")
    # The run nearest its layout's median stands for it (the faster on a tie: runs are sorted).
    nearest = (runs["sec_per_iter"] - median).abs().groupby(key, sort=False).idxmin()
    noise = pooled_cv(sec.transform("std") / sec.transform("mean"), by["sec_cv"].transform("max"), counts)
    pooled = runs.assign(
        sec_per_iter=median,
        tflops=key.map(rate_at_median_time(runs["tflops"], runs["sec_per_iter"], key)),
        mfu=key.map(rate_at_median_time(runs["mfu"], runs["sec_per_iter"], key)),
        mem_gib=by["mem_gib"].transform("max"),
        neighbour_jobs=by["neighbour_jobs"].transform("max"),
        sec_cv=noise,
        _runs=counts,
    ).loc[nearest.to_numpy()]
    return pooled.sort_values(["sec_per_iter", *TIE_BREAK], kind="mergesort")


def rate_at_median_time(rate: pd.Series, sec: pd.Series, key: pd.Series) -> pd.Series:
    """A rate of runs (TFLOPs, MFU) pooled per layout (`key`) at the layout's median seconds per
    iteration, by layout: rate x s/it is one iteration's work per device, the layout's whatever its
    run's speed (MFU's over the run's peak). The median of the runs' own rates disagreed with the
    median time for an even number of runs (2.09 s/it shown beside the TFLOPs of 1.9 s/it)."""
    return (rate * sec).groupby(key, sort=False).median() / sec.groupby(key, sort=False).median()


def pooled_cv(across: pd.Series, within: pd.Series, runs: pd.Series) -> np.ndarray:
    """The noise of layouts run `runs` times: the larger of the CV of their runs' medians (`across`,
    std / mean; only from two runs on) and the largest within-run CV (`within`), NaN where neither is
    known. Unknown within-run spreads (one measured iteration) leave the across-run spread."""
    across_known = across.where(runs > 1).to_numpy(dtype=float)
    return np.fmax(across_known, within.to_numpy(dtype=float))


def _excluded(group: pd.DataFrame, masks: dict[str, pd.Series]) -> tuple[str, ...]:
    notes = []
    failed = group[group["outcome"].isin(FAILED)]
    if not failed.empty:
        counts = failed["outcome"].value_counts()
        kinds = ", ".join(f"{int(counts[o])} {OUTCOME_TEXT[o]}" for o in FAILED if o in counts.index)
        rerun = int(failed["rerun_as"].notna().sum()) if "rerun_as" in failed.columns else 0
        kinds += f"; {rerun} of them rerun with changed fields" if rerun else ""
        notes.append(f"{len(failed)} did not finish ({kinds})")
    missing = int(group["outcome"].isin(MISSING).sum())
    if missing:
        notes.append(f"{missing} still pending or running")
    planned = int((group["outcome"] == "planned").sum())
    if planned:
        notes.append(f"{planned} planned, not run")
    unmeasured = int(((group["outcome"] == "ok") & ~(group["sec_per_iter"] > 0)).sum())
    if unmeasured:
        notes.append(f"{unmeasured} finished without a measured iteration")
    for text, mask in masks.items():
        n = int((~mask & (group["outcome"] == "ok") & (group["sec_per_iter"] > 0)).sum())
        if n:
            notes.append(f"{n} {text}")
    return tuple(notes)


_SHAPE = (
    "config.model.kind", "config.model.num_layers", "config.model.hidden_size", "config.model.num_attention_heads",
    "config.model.ffn_hidden_size", "config.model.vocab_size",
)  # fmt: skip
"""A model's shape: runs of one model name with another shape (model.hidden_size=... overridden) or
architecture (model.kind=bert beside gpt) are other work, as another sequence length is."""
_READ = (
    "outcome", "model", "hardware", "gbs", "seq_length", "sec_per_iter", *TIE_BREAK, "devices", "tflops", "mfu", "mem_gib",
    "mem_capacity_gib", "sec_cv", "neighbour_jobs", "pred_sec_per_iter", "size_params", *(c for c, _ in _DISTINCT),
    "sweep", *_SHAPE, "config.hardware.memory_gib", "device_mismatch", "config.cluster.name",
    "config.cluster.exclusive", "config.cluster.core_license", "rerun_as", "job_id",
)  # fmt: skip
"""The columns recommend reads."""


def model_shapes(df: pd.DataFrame) -> pd.Series:
    """Each row's model shape as one text; rows without a record (plan.csv, the manifest) take
    the first of their model in their sweep, else of their model."""
    present = [c for c in _SHAPE if c in df.columns]
    if not present:
        return pd.Series("", index=df.index, dtype=object)
    texts = pd.Series(
        ["|".join(t) for t in zip(*(value_texts(df[c].astype(object)) for c in present), strict=True)],
        index=df.index, dtype=object,
    )  # fmt: skip
    known = texts.where(df[present].notna().any(axis=1))
    if "sweep" in df.columns:
        known = known.fillna(known.groupby([df["sweep"], df["model"]]).transform("first"))
    return known.fillna(known.groupby(df["model"]).transform("first")).fillna("")


def _work_groups(df: pd.DataFrame) -> tuple[Any, bool]:
    """The rows grouped by work (model, hardware, global batch, sequence length, model shape), and
    whether they ran on several hardware configs (the work then names its hardware)."""
    df = narrow(df, _READ)
    # Rows from the manifest, or from a plan.csv written before its seq_length column, carry no sequence
    # length: they take their model's.
    df = df.assign(seq_length=df["seq_length"].fillna(df.groupby("model")["seq_length"].transform("first")))
    if "hardware" not in df.columns:
        df = df.assign(hardware="")
    df = df.assign(_shape=model_shapes(df))
    groups = df[df["gbs"].notna()].groupby(["model", "hardware", "gbs", "seq_length", "_shape"], dropna=False, sort=True)
    return groups, df.loc[df["gbs"].notna(), "hardware"].nunique(dropna=False) > 1


def work_ids(df: pd.DataFrame) -> pd.Series:
    """Each row's work as the recommendation groups it (model, hardware, global batch, sequence length,
    model shape), numbered; NaN for a row that gives no global batch. For the tables that list rows
    of several works, whose times are not comparable (planned_markdown)."""
    groups, _ = _work_groups(df)
    return groups.ngroup().reindex(df.index)


def _qualifying(group: pd.DataFrame, masks: dict[str, pd.Series]) -> pd.Series:
    ok = (group["outcome"] == "ok") & (group["sec_per_iter"] > 0)
    for mask in masks.values():
        ok &= mask
    return ok


def recommend(df: pd.DataFrame, constraints: Constraints | None = None) -> list[Recommendation]:
    """The fastest layout per (model, hardware, global batch, sequence length) among runs meeting the
    constraints (the work without such a run: unqualified)."""
    c = constraints or Constraints()
    groups, several_hardware = _work_groups(df)
    recs = []
    for (model, hardware, gbs, seq, _), group in groups:
        masks = _constraint_masks(group, c)
        qualifying = group[_qualifying(group, masks)].sort_values(["sec_per_iter", *TIE_BREAK], kind="mergesort")
        if qualifying.empty:
            continue
        runs = _pool_layouts(qualifying)
        varying = _varying(runs)
        best = _candidate(runs.iloc[0], varying)
        runner_up = _candidate(runs.iloc[1], varying) if len(runs) > 1 else None
        margin = None if runner_up is None else 100.0 * (runner_up.sec_per_iter / best.sec_per_iter - 1.0)
        by_tflops = runs.sort_values("tflops", ascending=False, kind="mergesort", na_position="last")
        per_nodes: tuple[Candidate, ...] = ()
        if runs["nodes"].nunique() > 1:
            firsts = runs.drop_duplicates("nodes", keep="first").sort_values("nodes", kind="mergesort")
            per_nodes = tuple(_candidate(r, varying) for _, r in firsts.iterrows())
        predicted_best, predicted_rank = _prediction_check(runs, best, varying)
        recs.append(
            Recommendation(
                model=str(model),
                hardware="" if pd.isna(hardware) else str(hardware),
                size=format_size(runs.iloc[0]["size_params"]),
                global_batch_size=int(gbs),
                seq_length=None if pd.isna(seq) else int(seq),
                best=best,
                runner_up=runner_up,
                margin_pct=margin,
                highest_tflops=_candidate(by_tflops.iloc[0], varying),
                satisfied=_satisfied(best, c, len(group), str(hardware) if several_hardware else ""),
                unmet=tuple(u for u in (_memory_unmet(best), _device_unmet(best)) if u),
                per_nodes=per_nodes,
                candidates=len(runs),
                excluded=_excluded(group, masks),
                noise_pct=None if runner_up is None else _noise_pct(best, runner_up),
                close=_within_noise(best, runs.iloc[1:], varying),
                predicted_best=predicted_best,
                predicted_rank=predicted_rank,
                runs=len(qualifying),
            )
        )
    return recs


def unqualified(df: pd.DataFrame, constraints: Constraints | None = None) -> list[str]:
    """'No recommendation for <work>: ...' for each piece of work with configs but no run that
    qualifies (each failed, is pending or planned, or is outside the constraints), which recommend
    leaves out: a GBS whose every run ran out of memory vanished without a word."""
    c = constraints or Constraints()
    groups, several_hardware = _work_groups(df)
    out = []
    for (model, hardware, gbs, seq, _), group in groups:
        masks = _constraint_masks(group, c)
        if _qualifying(group, masks).any():
            continue
        sizes = group["size_params"].dropna()
        work = _work_text(str(model), format_size(sizes.iloc[0]) if not sizes.empty else "",
                          "" if pd.isna(hardware) else str(hardware), int(gbs), None if pd.isna(seq) else int(seq),
                          several_hardware)  # fmt: skip
        why = "; ".join(_excluded(group, masks)) or "none finished with a measured iteration"
        out.append(f"No recommendation for {work}: none of its {len(group)} config(s) qualifies ({why}).")
    return out


def _work_text(model: str, size: str, hardware: str, gbs: int, seq: int | None, name_hardware: bool) -> str:
    """The work a recommendation is for, in its words: model (size)[ on hardware], GBS[, sequence]."""
    hw = f" on {hardware or 'unknown hardware'}" if name_hardware else ""
    return f"{model}{f' ({size})' if size else ''}{hw}, GBS {gbs}{'' if seq is None else f', sequence {seq}'}"


def _constraint_masks(group: pd.DataFrame, c: Constraints) -> dict[str, pd.Series]:
    """Per constraint, in the words that count the runs left out by it, which runs of `group` meet it."""
    # A record that does not say where it ran (a hand-written or damaged result.json, or one
    # copied out of its sweep) cannot be placed beside the others: left out and counted, not a crash.
    masks: dict[str, pd.Series] = {_NO_LAYOUT: (group[list(_LAYOUT_COUNTS)] > 0).all(axis=1)}
    if c.max_nodes is not None:
        # A run without its layout is counted once, under _NO_LAYOUT, not also as over the limit.
        masks[f"over the {c.max_nodes}-node limit"] = ~(group["nodes"] > c.max_nodes)
    if c.max_mem_gib is not None:
        # A run that measured no memory is not above the limit: it is unknown, and said so. Judged by
        # its layout's highest peak, as the layout's runs are pooled: a run below the limit kept a
        # layout whose other run was above it, and the layout stood on its faster run alone.
        highest = group["mem_gib"].groupby(pooled_layout_key(group).to_numpy()).transform("max")
        masks[f"above {c.max_mem_gib:g} GiB per device"] = ~(highest > c.max_mem_gib)
        masks["with no measured peak memory to check against --max-mem-gib"] = group["mem_gib"].notna()
    if c.dp_multiple_of is not None:
        masks[f"with DP not a multiple of {c.dp_multiple_of}"] = ~(group["dp"] % c.dp_multiple_of != 0) | group["dp"].isna()
    return masks


def _satisfied(best: Candidate, c: Constraints, configs: int, hardware: str = "") -> tuple[str, ...]:
    out = ["finished: status ok with measured iterations (no OOM, NaN, timeout or error)"]
    hw = f", hardware {hardware}" if hardware else ""
    # Every config of the work, whatever became of it: the next line says how many qualified and why the rest did not.
    out.append(f"same work as each of the {configs} config(s) of it in the sweep(s): model{hw}, GBS {best.gbs} and "
               "sequence length")  # fmt: skip
    if best.mem_gib is not None and _memory_unmet(best) is None:
        cap = f" of {_gib(best.mem_capacity_gib)} GiB usable" if best.mem_capacity_gib is not None else ""
        out.append(f"peak memory {_gib(best.mem_gib)} GiB per device{cap}")
    if c.max_nodes is not None:
        out.append(f"{best.nodes} node(s) <= {c.max_nodes} (--max-nodes)")
    if c.max_mem_gib is not None and best.mem_gib is not None:
        out.append(f"peak memory {_gib(best.mem_gib)} GiB <= {c.max_mem_gib:g} GiB (--max-mem-gib)")
    if c.dp_multiple_of is not None:
        out.append(f"DP={best.dp} is a multiple of {c.dp_multiple_of} (--dp-multiple)")
    return tuple(out)


def _gib(value: float) -> str:
    """GiB with the digits a comparison needs: 38.6 of a GPU, but 0.53 of a small CPU run, where one
    decimal printed "0.5 GiB <= 0.55 GiB" beside another line's "0.53 GiB"."""
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _memory_unmet(c: Candidate) -> str | None:
    """Why c's measured peak memory does not fit its hardware config's memory; None when it does or
    is unknown. A peak above the device's memory is no measurement of that device: the record is
    wrong, or the run had a larger device than its config says, and the layout may not fit the one
    the config describes."""
    if c.mem_gib is None:
        return None
    if c.mem_device_gib is not None and c.mem_gib > c.mem_device_gib:
        why = c.device_mismatch or "a device with more memory than hardware.memory_gib says, or a wrong record"
        return (
            f"peak memory {c.mem_gib:.2f} GiB per device is above the {c.mem_device_gib:.2f} GiB of the device its "
            f"hardware config describes (hardware.memory_gib), which no run on that device can measure ({why}): "
            "the layout may not fit that device"
        )
    if c.mem_capacity_gib is not None and c.mem_gib > c.mem_capacity_gib:
        return (
            f"peak memory {c.mem_gib:.2f} GiB per device is above the {c.mem_capacity_gib:.2f} GiB usable "
            "(hardware.memory_gib less memory_reserve_gib): it left less free than the reserve the planner keeps"
        )
    return None


def _device_unmet(c: Candidate) -> str | None:
    """Why c's time is not its hardware config's: it ran on a device the config does not describe
    (a job placed on other nodes than the sweep meant); None when it did not, or when _memory_unmet
    already gives that reason."""
    memory = _memory_unmet(c) or ""
    if not c.device_mismatch or c.device_mismatch in memory:
        return None
    return (
        f"it ran on a device its hardware config does not describe ({c.device_mismatch}): its seconds per "
        "iteration are that device's, so it may not be the fastest on the device the config names"
    )


def change_text(pct: float, how: str) -> str:
    """A gap between two times, the slower over the faster less 1 (`pct`, %), as the margin and
    `compare` write it: '25.0% faster', and from 2x on a factor, '18.7x faster' (a run at 10.33 s/it
    read '1772.6% faster' beside one at 0.552)."""
    return f"{1.0 + pct / 100.0:.1f}x {how}" if pct >= 100.0 else f"{pct:.1f}% {how}"


def _figures(c: Candidate) -> str:
    # The results table's digits: two decimals alone read 0.00 s/it and 0.00 TFLOPs for a small run.
    tflops = "" if c.tflops is None else f", {format_tflops(c.tflops)} TFLOPs/device"
    mfu = "" if c.mfu is None else f", MFU {above_peak_text(c.mfu) if c.mfu > 1.0 else f'{100 * c.mfu:.1f}%'}"
    pooled = f" (median of {c.runs} runs)" if c.runs > 1 else ""
    return f"{format_sec(c.sec_per_iter)} s/it{pooled}{tflops}{mfu}"


def _cv_text(c: Candidate) -> str:
    # pooled_cv: the larger of two spreads; "over its 3 runs" read as the spread across them alone
    # where one run's own iterations spread wider (149.9% of one run against ~100% across the three).
    pooled = f" (the wider of the spread across its {c.runs} runs and within its widest run)" if c.runs > 1 else ""
    return f"{format_cv(c.sec_cv)}{pooled}"


def _noise_text(r: Recommendation) -> str:
    assert r.runner_up is not None
    if r.noise_pct is None:
        return "noise unknown (a run has fewer than two measured iterations, or no spread was recorded), so the margin cannot be told from it"
    spreads = f"CV {_cv_text(r.best)} and {_cv_text(r.runner_up)}, combined {r.noise_pct:.1f}%"
    if r.decided:
        return f"outside the noise ({spreads})"
    if r.margin_pct is not None and r.margin_pct > r.noise_pct:
        # The runner-up is clear of the best, a slower run with a wider spread is not.
        wide = "; ".join(f"{c.label}: {_figures(c)}, CV {_cv_text(c)}" for c in r.close[:RERUN_TOP])
        return (f"outside the noise ({spreads}); but slower runs' iterations spread wide enough to reach the "
                f"best's time ({wide}), so a rerun could put one of them first")  # fmt: skip
    return f"inside the noise: their iterations spread by more ({spreads}), so a rerun could swap them"


def _licensed(cands: Sequence[Candidate]) -> str | None:
    """The core license every one of `cands` ran under ('cluster local's `cores` license'); None
    when one ran without (or its record does not say): whole nodes are then what isolates a run."""
    licenses = {(c.cluster, c.core_license) for c in cands}
    if len(licenses) != 1 or None in next(iter(licenses)):
        return None
    cluster, license_ = next(iter(licenses))
    return f"cluster {cluster or '(unnamed)'}'s `{license_}` license (cluster.core_license)"


def _repeat_advice(r: Recommendation) -> list[str]:
    """Which configs to repeat, and how, to tell the runs inside the noise apart: on whole nodes,
    unless the runs' cluster keeps jobs apart by a core license (the local cluster, whose emulated
    nodes share one host: a whole one isolates nothing there)."""
    if r.noise_pct is None:
        top = [c for c in (r.best, r.runner_up) if c is not None]
        why = "at least two measured iterations each, so that their spread is known"
    else:
        top = [r.best, *r.close][:RERUN_TOP]
        why = "within the noise of each other"
    if not any(c.slurm for c in top):
        # Run on this machine (hydra/launcher=local, or no sweep): no Slurm to queue them on, no nodes
        # to have whole; the local launcher runs a sweep's configs one after another.
        lines = [
            f"- to decide: repeat {_these(top, r.runner_up)} ({why}) with more measured iterations "
            "(training.train_iters), as a sweep of their own on this machine, whose launcher runs them one "
            "at a time, e.g. `python -m train -m hydra/launcher=local <its overrides> training.train_iters=<more>` "
            "(this last: Hydra keeps the last value given for a key, and a run's overrides may set it):"
        ]
    elif (licensed := _licensed(top)) is not None:
        lines = [
            f"- to decide: repeat {_these(top, r.runner_up)} ({why}) with more measured iterations (training.train_iters), "
            f"as a sweep of their own on the same cluster, where {licensed} keeps the jobs running together "
            "to the host's cores (whole nodes, cluster.exclusive, would isolate nothing there), e.g. `python -m train -m "
            "hydra/launcher=slurm <its overrides> training.train_iters=<more>` (this last: Hydra keeps the last "
            "value given for a key, and a run's overrides may set it):"
        ]
    else:
        lines = [
            f"- to decide: repeat {_these(top, r.runner_up)} ({why}) with more measured iterations (training.train_iters) "
            "on whole nodes (cluster.exclusive=true), as a sweep of their own, e.g. `python -m train -m "
            "hydra/launcher=slurm <its overrides> training.train_iters=<more> cluster.exclusive=true` (these two "
            "last: Hydra keeps the last value given for a key, and a run's overrides may set them):"
        ]
    lines += [f"  - {c.label}: {_repeatable(c.overrides) or '(no overrides)'} [{c.sweep}/{c.run_dir}]" for c in top]
    return lines


def _these(top: Sequence[Candidate], runner_up: Candidate | None) -> str:
    """How the repeat line names its configs: the best and those within its noise need not be the
    fastest few (a slow layout whose iterations spread to the best's time is one; the runner-up,
    outside the noise, not), and "the top 2" named a pair the margin line had not."""
    return "the top 2" if len(top) == 2 and top[1] == runner_up else f"these {len(top)}"


def _repeatable(overrides: str) -> str:
    """A run's overrides as the repeat command takes them: a layout search's own options (search.*),
    which its runs record, are refused by a sweep without hydra/sweeper=layouts."""
    # Quoted for the shell where it needs it: a value with a space, a list, an interpolation.
    return " ".join(shlex.quote(o) for o in split_overrides(overrides) if not o.lstrip("+~").startswith("search."))


def _neighbour_notes(r: Recommendation) -> list[str]:
    shared = [(what, c) for what, c in (("best", r.best), ("runner-up", r.runner_up)) if c is not None and c.neighbours]
    return [f"- the {what} shared its nodes with {c.neighbours} other Slurm job(s) while it trained: {_isolation(c)}"
            for what, c in shared]  # fmt: skip


def _isolation(c: Candidate) -> str:
    """What the neighbours of c's run mean for its timing, as its record's cluster config says how it
    was isolated (the trainer's record warning says the same)."""
    return isolation_note(exclusive=c.exclusive, cluster=c.cluster, core_license=c.core_license)


def _prediction_text(r: Recommendation) -> list[str]:
    """Whether the predicted fastest was the measured fastest; nothing unless every compared run was predicted."""
    pb, best = r.predicted_best, r.best
    if pb is None or r.predicted_rank is None or pb.pred_sec_per_iter is None or best.pred_sec_per_iter is None:
        return []

    def predicted(c: Candidate) -> str:
        assert c.pred_sec_per_iter is not None
        err = format_err(c.pred_sec_per_iter / c.sec_per_iter - 1.0)  # as results.md's Err
        return f"predicted {format_sec(c.pred_sec_per_iter)} s/it, Err {err}"

    if r.predicted_rank == 1:
        return [
            f"- prediction: the time model also predicted it fastest of the {r.candidates} "
            f"({predicted(best)}): the predicted best was the measured best"
        ]
    slower = r.predicted_best_slower_pct
    assert slower is not None
    noise = " (inside the noise of the measured fastest: a rerun could swap them)" if any(
        (c.sweep, c.run_dir) == (pb.sweep, pb.run_dir) for c in r.close
    ) else ""
    return [
        f"- prediction: the predicted best was not the measured best: the time model predicted {pb.label} "
        f"fastest ({predicted(pb)}), which measured {format_sec(pb.sec_per_iter)} s/it, {change_text(slower, 'slower')} "
        f"per iteration than the measured fastest{noise}; the model ranked the measured fastest "
        f"{r.predicted_rank} of {r.candidates} ({predicted(best)})"
    ]


def left_out(df: pd.DataFrame, constraints: Constraints) -> str:
    """Why no run qualified although some finished with a measured iteration (how many each limit
    left out, in the recommendation's words); '' when none did."""
    measured = df[(df["outcome"] == "ok") & (pd.to_numeric(df["sec_per_iter"], errors="coerce") > 0)]
    if measured.empty:
        return ""
    counts = [f"{int((~mask).sum())} {why}" for why, mask in _constraint_masks(measured, constraints).items() if (~mask).any()]
    return f"{len(measured)} run(s) finished with a measured iteration, but none met the limits: {'; '.join(counts)}"


def recommendation_text(df: pd.DataFrame, recs: Sequence[Recommendation], constraints: Constraints | None = None) -> str:
    """What results.md and the console say of `recs` (recommend(df, constraints)): each work's
    recommendation and, after them, the work without one; or why nothing qualified."""
    c = constraints or Constraints()
    if not recs:
        text = format_recommendations([], left_out=left_out(df, c))
    else:
        text = format_recommendations(recs, others=unqualified(df, c))
    unplaced = unknown_work(df)
    return f"{text}\n\n{unplaced}" if unplaced else text


def unknown_work(df: pd.DataFrame) -> str:
    """A line for the configs no work group holds: launched and not finished (or ended without a
    record) in a sweep without plan.csv, nothing says their model and global batch yet. Left out
    without a word, a sweep's one finished run read as "the only run that qualifies" while the rest
    of its configs still ran."""
    if "gbs" not in df.columns or "outcome" not in df.columns:
        return ""
    unplaced = df[df["gbs"].isna()]
    counts = unplaced["outcome"].value_counts()
    waiting = sum(int(counts.get(o, 0)) for o in MISSING)
    ended = sum(int(counts.get(o, 0)) for o in FAILED)
    if not waiting and not ended:
        return ""
    listed = ", ".join(f"{int(counts[o])} {OUTCOME_TEXT[o]}" for o in (*MISSING, *FAILED) if o in counts.index)
    parts = [f"Not compared: {waiting + ended} config(s) whose work (model, global batch) nothing read here says, "
             f"with no record and no plan row ({listed})."]  # fmt: skip
    if waiting:
        parts.append(
            "The pending and running ones are compared once they write their records; a dry run of the sweep's "
            "configs into its directory (hydra/launcher=plan, hydra.launcher.append=true) places them now."
        )
    if ended:
        those = "The others" if waiting else ("It" if ended == 1 else "They")
        parts.append(f"{those} ended, or never ran, without a record: {'it counts' if those == 'It' else 'they count'} for no work.")
    return " ".join(parts)


def format_recommendations(recs: Sequence[Recommendation], *, left_out: str = "", others: Sequence[str] = ()) -> str:
    """Plain text (also valid markdown) for the console and results.md; `left_out`: why nothing
    qualified (see left_out) when recs is empty; `others`: the work that has no recommendation
    beside recs' (unqualified), one line each after them."""
    if not recs:
        # "no run finished" was said of runs that finished and were only outside --max-mem-gib, say.
        return f"No recommendation: {left_out}." if left_out else (
            "No recommendation: no run finished with a measured iteration."
        )
    several_hardware = len({r.hardware for r in recs}) > 1
    blocks = []
    for r in recs:
        work = _work_text(r.model, r.size, r.hardware, r.global_batch_size, r.seq_length, several_hardware)
        where = f"{_figures(r.best)} [{r.best.sweep}/{r.best.run_dir}]"
        lines = [
            f"Fastest for {work}: {r.best.label}: {where}" if r.decided
            else f"No clear winner for {work} (noise unknown): {r.best.label} measured fastest: {where}"
            if r.noise_pct is None
            else f"No clear winner for {work}: {r.best.label} measured fastest: {where}"
        ]
        if r.runner_up is not None and r.margin_pct is not None:
            lines.append(
                f"- margin: {change_text(r.margin_pct, 'faster')} per iteration than the runner-up, "
                f"{r.runner_up.label}: {_figures(r.runner_up)}; {_noise_text(r)}"
            )
        else:
            # Its runs may be several, pooled: what stands alone is the layout.
            alone = "run" if r.best.runs <= 1 else f"layout (its {r.best.runs} runs pooled)"
            lines.append(f"- margin: none; it is the only {alone} that qualifies")
        if not r.decided:
            lines += _repeat_advice(r)
        lines += _neighbour_notes(r)
        lines += _prediction_text(r)
        if r.highest_tflops.run_dir != r.best.run_dir or r.highest_tflops.sweep != r.best.sweep:
            slower = 100.0 * (r.highest_tflops.sec_per_iter / r.best.sec_per_iter - 1.0)
            lines.append(
                f"- highest TFLOPs is {r.highest_tflops.label}: {_figures(r.highest_tflops)}, "
                f"yet {change_text(slower, 'slower')} per iteration: ranked by seconds per iteration, not TFLOPs"
            )
        lines += [f"- constraint not met: {text}" for text in r.unmet]
        lines.append(f"- constraints satisfied: {'; '.join(r.satisfied)}")
        compared = (
            f"- compared {r.candidates} qualifying layout(s) from {r.runs} runs (runs of one layout pooled)"
            if r.runs > r.candidates
            else f"- compared {r.candidates} qualifying run(s)"
        )
        lines.append(compared + (f"; excluded: {'; '.join(r.excluded)}" if r.excluded else ""))
        if r.per_nodes:
            lines.append("- fastest per node count:")
            lines += [f"  - {c.nodes} node(s): {c.label}: {_figures(c)}" for c in r.per_nodes]
        blocks.append("\n".join(lines))
    return "\n\n".join([*blocks, *others])


__all__ = [
    "Candidate", "Constraints", "Recommendation", "change_text", "format_recommendations", "model_shapes", "pooled_cv",
    "pooled_layout_key", "recommend",
    "recommendation_text", "unknown_work", "unqualified",
]  # fmt: skip
