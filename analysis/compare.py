"""Compare two sweeps (before / after a change): per-config ratios of seconds per iteration and TFLOPs.

Configs are matched by their overrides (order-free); when no override set appears in both sweeps
(the 'after' sweep adds an override, say), by their layout instead: model, hardware, batch sizes,
DP/TP/PP and the ZeRO, recompute, precision and engine options.

A config (or layout) run more than once on a side is pooled as the recommendation pools a layout's
runs: median seconds per iteration and TFLOPs, noise the larger of the spread across the runs and
the largest within one. A change no larger than the two sides' combined noise,
sqrt(CV_before^2 + CV_after^2), is flagged as within the noise: a rerun could reverse it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.recommend import change_text, model_shapes, pooled_cv, rate_at_median_time
from analysis.records import NOT_RUN, shown_figures, value_texts
from analysis.tables import OUTCOME_TEXT, format_sec, format_size, format_tflops, markdown_table

MATCH_KEYS = {"overrides": "config_key", "layout": "layout_key"}
UNITS = {"overrides": "config", "layout": "layout"}
"""What one matched row is, as the summary counts it."""

_LAYOUT_LABEL = (
    ("gbs", "GBS"),
    ("dp", "DP"),
    ("tp", "TP"),
    ("pp", "PP"),
    ("mbs", "MBS"),
    ("config.parallelism.zero_stage", "ZeRO"),
    ("config.parallelism.offload", "offload"),
    ("config.parallelism.recompute", "recompute"),
    ("config.parallelism.precision", "precision"),
    ("config.parallelism.engine", "engine"),
)
"""The layout key's fields beside model and hardware, as a label names them (the batch and degrees
too: the configs only in one sweep have no table columns to give them)."""
LISTED = 5
"""Configs only in one sweep the summary names, at most."""


@dataclass(frozen=True)
class Comparison:
    """The matched configs and what could not be matched."""

    table: pd.DataFrame
    """One row per matched config: before/after figures and after/before ratios."""
    matched_on: str
    """'overrides' or 'layout'."""
    only_before: int
    only_after: int
    sec_ratio_geomean: float | None
    """Geometric mean of after/before seconds per iteration over configs ok in both (< 1: faster)."""
    tflops_ratio_geomean: float | None
    only_before_labels: tuple[str, ...] = ()
    """Labels of the configs only in before (all of them; the summary names the first LISTED)."""
    only_after_labels: tuple[str, ...] = ()
    pooled: int = 0
    """Matched rows whose figures pool more than one run on a side."""
    not_run_after_labels: tuple[str, ...] = ()
    """Configs that ran before and that the after sweep lists but has not run (pending, planned)."""
    not_run_before_labels: tuple[str, ...] = ()
    other_work_labels: tuple[str, ...] = ()
    """Configs of the same overrides that ran other work in the two sweeps (another layout, sequence
    length or model shape: a changed model file or --config-dir), not compared."""


def _not_run_keys(df: pd.DataFrame, key: str) -> pd.Index:
    return pd.Index(df.loc[df["outcome"].isin(NOT_RUN) & (df[key] != ""), key].unique())


def _other_work(b: pd.DataFrame, a: pd.DataFrame) -> pd.Index:
    """The configs (matched by overrides) whose known layouts differ between the two sides."""
    if "layout_key" not in b.columns or "layout_key" not in a.columns:
        return pd.Index([])
    kb, ka = b["layout_key"].astype(str), a["layout_key"].astype(str)
    return b.index[((kb != ka) & (kb != "") & (ka != "")).to_numpy()]


def _label(side: pd.DataFrame, how: str, *, sequence: bool = False, shape: bool = False) -> pd.Series:
    """Readable names of `side`'s rows: the overrides for 'overrides'; for 'layout', the key's fields
    by name (model on hardware, ZeRO=1 ...) rather than the raw key's '|'-joined values, and the
    sequence length (seq=) and the model's size (size=) when the sweeps compared differ in them."""
    if how == "overrides":
        return pd.Series(side.index.astype(str), index=side.index)
    fields = (*_LAYOUT_LABEL, ("seq_length", "seq")) if sequence else _LAYOUT_LABEL
    texts = [value_texts(side[c].astype(object)) if c in side.columns else [""] * len(side) for c, _ in fields]
    if shape and "size_params" in side.columns:
        fields = (*fields, ("size_params", "size"))
        texts.append(side["size_params"].map(format_size).tolist())
    model = value_texts(side["model"]) if "model" in side.columns else [""] * len(side)
    hardware = value_texts(side["hardware"]) if "hardware" in side.columns else [""] * len(side)
    labels = []
    for i, (m, hw) in enumerate(zip(model, hardware, strict=True)):
        named = " ".join(f"{name}={t[i]}" for (_, name), t in zip(fields, texts, strict=True) if t[i])
        labels.append(" ".join(p for p in (m, f"on {hw}," if hw else ",", named) if p).replace(" ,", ","))
    return pd.Series(labels, index=side.index)


def _side(df: pd.DataFrame, key: str, how: str, *, sequence: bool = False, shape: bool = False) -> pd.DataFrame:
    """One row per config of `df` (per `key`): its runs that finished with a measured iteration
    pooled (see the module), else its first failure."""
    side = df[~df["outcome"].isin(NOT_RUN)].copy()
    if "sec_cv" not in side.columns:
        side["sec_cv"] = math.nan
    side["_ok"] = side["outcome"] == "ok"
    side["partial"] = side["partial"].fillna(False).astype(bool) if "partial" in side.columns else False
    # A failed run's figures (of the iterations before it broke) are no side's, as in results.csv.
    speed = ["sec_per_iter", "tflops", "sec_cv"]
    side[speed] = side[speed].where(shown_figures(side), np.nan)
    side = side.sort_values([key, "_ok", "sec_per_iter"], ascending=[True, False, True], kind="mergesort")
    first = side.drop_duplicates(key, keep="first").set_index(key)
    measured = side[side["_ok"] & (side["sec_per_iter"] > 0)]
    by = measured.groupby(key, sort=False)
    sec = by["sec_per_iter"]
    runs = sec.size()
    first["runs"] = side.groupby(key, sort=False).size()
    first["sec_cv"] = first["sec_cv"].astype(float)
    if len(runs):
        first.loc[runs.index, "sec_per_iter"] = sec.median()
        first.loc[runs.index, "tflops"] = rate_at_median_time(measured["tflops"], measured["sec_per_iter"], measured[key])
        first.loc[runs.index, "sec_cv"] = pooled_cv(sec.std() / sec.mean(), by["sec_cv"].max(), runs)
        first.loc[runs.index, "runs"] = runs
    if (seq := _sequence(df)) is not None:
        first["seq_length"] = seq.groupby(df[key]).first()
    first["label"] = _label(first, how, sequence=sequence, shape=shape)
    layout = ["layout_key"] if "layout_key" in first.columns else []
    return first[["outcome", "partial", "sec_per_iter", "tflops", "sec_cv", "runs", "label", "nodes", "dp", "tp", "pp", "mbs", "gbs", *layout]]


def _geomean(ratios: pd.Series) -> float | None:
    r = ratios[(ratios > 0) & np.isfinite(ratios)]
    return float(np.exp(np.log(r).mean())) if len(r) else None


_APART = ("config.parallelism.sequence_parallel", "config.parallelism.virtual_stages")
"""Layout fields records' layout_key leaves out that the recommendation's candidates keep apart: runs
with and without them are other layouts, never one pooled row (their gap read as noise)."""


def _sequence(df: pd.DataFrame) -> pd.Series | None:
    """Each row's sequence length, as the recommendation reads it: a row without a record (a failure
    Slurm reported) takes its model's."""
    if "seq_length" not in df.columns:
        return None
    seq = pd.to_numeric(df["seq_length"], errors="coerce")
    if "model" in df.columns:
        seq = seq.fillna(seq.groupby(df["model"]).transform("first"))
    return seq


def _with_layouts(df: pd.DataFrame) -> pd.DataFrame:
    """layout_key with what it leaves out and the recommendation keeps apart: SP, interleaving, the
    sequence length and the model's shape (the same model name at another sequence length or width
    is other work, not a speed-up)."""
    # As texts (value_texts): a side whose skipped rows have no config holds virtual_stages as floats,
    # and str(1.0) never met the other side's str(1).
    parts = [value_texts(df[c]) for c in _APART if c in df.columns]
    if (seq := _sequence(df)) is not None:
        parts.append(value_texts(seq.astype(object)))
    if "model" in df.columns:
        parts.append(model_shapes(df).tolist())
    if not parts or "layout_key" not in df.columns:
        return df
    extra = pd.Series(["|".join(values) for values in zip(*parts, strict=True)], index=df.index, dtype=object)
    return df.assign(layout_key=df["layout_key"].where(df["layout_key"] == "", df["layout_key"] + "|" + extra))


def compare_sweeps(before: pd.DataFrame, after: pd.DataFrame, *, match: str = "auto") -> Comparison:
    """Ratios after / before per matched config; match is 'overrides', 'layout' or 'auto'."""
    if match not in ("auto", *MATCH_KEYS):
        raise ValueError(f"match must be auto, overrides or layout, got {match!r}")
    order = ["overrides", "layout"] if match == "auto" else [match]
    before, after = _with_layouts(before), _with_layouts(after)
    lengths = [seq.dropna() for seq in (_sequence(before), _sequence(after)) if seq is not None]
    sequence = bool(lengths) and pd.concat(lengths).nunique() > 1
    shapes = [model_shapes(df) for df in (before, after) if "model" in df.columns]
    shape = bool(shapes) and pd.concat(shapes).nunique() > 1
    for how in order:
        key = MATCH_KEYS[how]
        b = _side(before[before[key] != ""], key, how, sequence=sequence, shape=shape)
        a = _side(after[after[key] != ""], key, how, sequence=sequence, shape=shape)
        common = b.index.intersection(a.index)
        if len(common) or how == order[-1]:
            break
    other_work = _other_work(b.loc[common], a.loc[common]) if how == "overrides" else pd.Index([])
    common = common.difference(other_work)
    joined = b.loc[common].add_suffix("_before").join(a.loc[common].add_suffix("_after"))
    sec_ratio = joined["sec_per_iter_after"] / joined["sec_per_iter_before"]
    noise_pct = 100.0 * np.hypot(joined["sec_cv_before"].astype(float), joined["sec_cv_after"].astype(float))
    # The change as the recommendation's margin reads it: the slower time over the faster, less 1.
    change_pct = 100.0 * (np.fmax(sec_ratio, 1.0 / sec_ratio) - 1.0)
    both_ok = (joined["outcome_before"] == "ok") & (joined["outcome_after"] == "ok") & (sec_ratio > 0)
    # A side that failed without a record has no layout columns: the other side's name the config.
    either = {c: joined[f"{c}_after"].where(joined[f"{c}_after"].notna(), joined[f"{c}_before"])
              for c in ("nodes", "dp", "tp", "pp", "mbs", "gbs")}  # fmt: skip
    label = joined["label_after"].where(joined["label_after"].astype(str) != "", joined["label_before"])
    table = pd.DataFrame(
        {
            "config": joined.index.astype(str),
            "label": label,
            **{c: pd.to_numeric(v, errors="coerce").astype("Int64") for c, v in either.items()},
            "outcome_before": joined["outcome_before"],
            "outcome_after": joined["outcome_after"],
            # As results.csv's `partial`: a side's figures are a stopped run's, of the iterations it
            # measured before the stop (records.PARTIAL_OUTCOMES), not a finished run's.
            "partial_before": joined["partial_before"].astype(bool),
            "partial_after": joined["partial_after"].astype(bool),
            "sec_before": joined["sec_per_iter_before"],
            "sec_after": joined["sec_per_iter_after"],
            # Only where both sides finished: a timeout or an interrupted run keeps the medians of the
            # iterations it measured, which are no run's figures to compare (nor to average).
            "sec_ratio": sec_ratio.where(both_ok),
            "tflops_before": joined["tflops_before"],
            "tflops_after": joined["tflops_after"],
            "tflops_ratio": (joined["tflops_after"] / joined["tflops_before"]).where(both_ok),
            "runs_before": joined["runs_before"].astype(int),
            "runs_after": joined["runs_after"].astype(int),
            "noise_pct": noise_pct.where(both_ok),
            # NA: not both measured, or the noise unknown. No change at all reads "no change", not
            # "within noise (0.0%)" as every unchanged run without a spread would.
            "within_noise": ((change_pct <= noise_pct) & (change_pct > 0))
            .where(both_ok & noise_pct.notna())
            .astype("boolean"),
        }
    )
    table = table.sort_values(["sec_ratio", "config"], kind="mergesort", na_position="last").reset_index(drop=True)
    only_b, only_a = b.index.difference(a.index), a.index.difference(b.index)
    # A config the other sweep lists but has not run (pending, planned) is not missing from it.
    waiting_a = only_b.intersection(_not_run_keys(after, key))
    waiting_b = only_a.intersection(_not_run_keys(before, key))
    only_b, only_a = only_b.difference(waiting_a), only_a.difference(waiting_b)
    return Comparison(
        table=table,
        matched_on=how,
        only_before=len(only_b),
        only_after=len(only_a),
        only_before_labels=tuple(b.loc[only_b, "label"]),
        only_after_labels=tuple(a.loc[only_a, "label"]),
        not_run_after_labels=tuple(b.loc[waiting_a, "label"]),
        not_run_before_labels=tuple(a.loc[waiting_b, "label"]),
        other_work_labels=tuple(f"{o}: {b.loc[o, 'label']}" for o in other_work),
        sec_ratio_geomean=_geomean(table["sec_ratio"]),
        tflops_ratio_geomean=_geomean(table["tflops_ratio"]),
        pooled=int(((table["runs_before"] > 1) | (table["runs_after"] > 1)).sum()),
    )


def _ratio(v: float) -> str:
    return "" if v is None or math.isnan(v) else f"{v:.3f}"


def speed_change(sec_ratio: float) -> str:
    """How much faster or slower after/before seconds per iteration `sec_ratio` is, as the
    recommendation's margin reads: the slower time over the faster one, less 1 ('25.0% faster' for
    x0.800, not the 20.0% that 1 - ratio gives); from 2x on as a factor ('8.2x faster' for x0.122)."""
    if sec_ratio == 1.0:
        return "no change"
    factor = 1.0 / sec_ratio if sec_ratio < 1.0 else sec_ratio
    return change_text(100.0 * (factor - 1.0), "faster" if sec_ratio < 1.0 else "slower")


def format_comparison(c: Comparison, *, before: str, after: str) -> str:
    """Markdown: a summary line, then one row per matched config (ratios < 1 in Sec/it are speed-ups)."""
    t = c.table
    unit = UNITS[c.matched_on]
    lines = [
        f"# Comparison: {before} -> {after}",
        "",
        f"{len(t)} {unit}(s) matched by {c.matched_on}; {c.only_before} {unit}(s) only in {before}, "
        f"{c.only_after} {unit}(s) only in {after}.",
    ]
    groups = (
        (f"Only in {before}", c.only_before_labels),
        (f"Only in {after}", c.only_after_labels),
        (f"Ran in {before}, not run yet in {after} (pending or planned there)", c.not_run_after_labels),
        (f"Ran in {after}, not run yet in {before} (pending or planned there)", c.not_run_before_labels),
        ("Not compared: the same overrides ran other work in the two sweeps (another layout, sequence length "
         "or model shape)", c.other_work_labels),
    )
    for what, labels in groups:
        if labels:
            first = f", the first {LISTED}" if len(labels) > LISTED else ""
            lines.append(f"{what} ({len(labels)} {unit}(s){first}):")
            lines += [f"- {label}" for label in labels[:LISTED]]
    if c.pooled:
        lines.append(
            f"{c.pooled} {unit}(s) ran more than once on a side: their runs are pooled (median Sec/it and TFLOPs; "
            "noise the larger of the spread across the runs and within one), Runs says how many."
        )
    flagged = t["within_noise"].fillna(False).astype(bool)
    if flagged.any():
        lines.append(
            f"{int(flagged.sum())} of {int(t['within_noise'].notna().sum())} change(s) are within the noise "
            "(no larger than the two sides' combined CV): a rerun could reverse them."
        )
    if c.sec_ratio_geomean is not None:
        lines.append(
            f"Geometric mean after/before: Sec/it x{c.sec_ratio_geomean:.3f} ({speed_change(c.sec_ratio_geomean)}); "
            f"TFLOPs x{_ratio(c.tflops_ratio_geomean or math.nan)}."
        )
    lines.append("")
    if t.empty:
        lines.append(f"No {unit} appears in both sweeps.")
        return "\n".join(lines) + "\n"

    def ints(s: pd.Series) -> pd.Series:
        return s.map(lambda v: "" if pd.isna(v) else str(int(v)))

    def state(outcome: pd.Series, value: pd.Series, fmt: object) -> pd.Series:
        text = value.map(fmt)  # type: ignore[arg-type]
        return text.where(outcome == "ok", outcome.map(OUTCOME_TEXT))

    def change(row: pd.Series) -> str:
        ratio = row["sec_ratio"]
        if pd.isna(ratio) or not ratio > 0 or row["outcome_before"] != "ok" or row["outcome_after"] != "ok":
            return ""
        if pd.isna(row["within_noise"]):
            return f"{speed_change(ratio)} (noise unknown)"
        noise = f"{row['noise_pct']:.1f}%"
        return f"{speed_change(ratio)}, within noise ({noise})" if row["within_noise"] else speed_change(ratio)

    md = pd.DataFrame(
        {
            "Nodes": ints(t["nodes"]),
            "DP": ints(t["dp"]),
            "TP": ints(t["tp"]),
            "PP": ints(t["pp"]),
            "MBS": ints(t["mbs"]),
            "GBS": ints(t["gbs"]),
            "Sec/it before": state(t["outcome_before"], t["sec_before"], format_sec),
            "Sec/it after": state(t["outcome_after"], t["sec_after"], format_sec),
            "Sec/it ratio": t["sec_ratio"].map(_ratio),
            "Change": [change(row) for _, row in t.iterrows()],
            "TFLOPs before": state(t["outcome_before"], t["tflops_before"], format_tflops),
            "TFLOPs after": state(t["outcome_after"], t["tflops_after"], format_tflops),
            "TFLOPs ratio": t["tflops_ratio"].map(_ratio),
            "Config": t["label"].str.replace("|", "\\|", regex=False),
        }
    )
    if c.pooled:
        md.insert(6, "Runs", t["runs_before"].astype(str) + " / " + t["runs_after"].astype(str))
    lines.append(markdown_table(md, left=("Config",)))
    return "\n".join(lines) + "\n"


__all__ = ["LISTED", "MATCH_KEYS", "UNITS", "Comparison", "compare_sweeps", "format_comparison", "speed_change"]
