"""Compare two sweeps (before / after a change): per-config ratios of seconds per iteration and TFLOPs.

Configs are matched by their overrides (order-free); when no override set appears in both sweeps
(the 'after' sweep adds an override, say), by their layout instead: model, hardware, batch sizes,
DP/TP/PP and the ZeRO, recompute, precision and engine options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.records import NOT_RUN
from analysis.tables import OUTCOME_TEXT, format_sec, format_tflops, markdown_table

MATCH_KEYS = {"overrides": "config_key", "layout": "layout_key"}


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


def _side(df: pd.DataFrame, key: str) -> pd.DataFrame:
    # A config run twice in one sweep keeps its fastest successful run.
    side = df[~df["outcome"].isin(NOT_RUN)].copy()
    side["_ok"] = side["outcome"] == "ok"
    side = side.sort_values([key, "_ok", "sec_per_iter"], ascending=[True, False, True], kind="mergesort")
    side = side.drop_duplicates(key, keep="first")
    return side[[key, "outcome", "sec_per_iter", "tflops", "nodes", "dp", "tp", "pp", "mbs", "gbs"]].set_index(key)


def _geomean(ratios: pd.Series) -> float | None:
    r = ratios[(ratios > 0) & np.isfinite(ratios)]
    return float(np.exp(np.log(r).mean())) if len(r) else None


def compare_sweeps(before: pd.DataFrame, after: pd.DataFrame, *, match: str = "auto") -> Comparison:
    """Ratios after / before per matched config; match is 'overrides', 'layout' or 'auto'."""
    if match not in ("auto", *MATCH_KEYS):
        raise ValueError(f"match must be auto, overrides or layout, got {match!r}")
    order = ["overrides", "layout"] if match == "auto" else [match]
    for how in order:
        key = MATCH_KEYS[how]
        b, a = _side(before[before[key] != ""], key), _side(after[after[key] != ""], key)
        common = b.index.intersection(a.index)
        if len(common) or how == order[-1]:
            break
    joined = b.loc[common].add_suffix("_before").join(a.loc[common].add_suffix("_after"))
    table = pd.DataFrame(
        {
            "config": joined.index.astype(str),
            "nodes": joined["nodes_after"],
            "dp": joined["dp_after"],
            "tp": joined["tp_after"],
            "pp": joined["pp_after"],
            "mbs": joined["mbs_after"],
            "gbs": joined["gbs_after"],
            "outcome_before": joined["outcome_before"],
            "outcome_after": joined["outcome_after"],
            "sec_before": joined["sec_per_iter_before"],
            "sec_after": joined["sec_per_iter_after"],
            "sec_ratio": joined["sec_per_iter_after"] / joined["sec_per_iter_before"],
            "tflops_before": joined["tflops_before"],
            "tflops_after": joined["tflops_after"],
            "tflops_ratio": joined["tflops_after"] / joined["tflops_before"],
        }
    )
    table = table.sort_values(["sec_ratio", "config"], kind="mergesort", na_position="last").reset_index(drop=True)
    return Comparison(
        table=table,
        matched_on=how,
        only_before=int(len(b.index.difference(a.index))),
        only_after=int(len(a.index.difference(b.index))),
        sec_ratio_geomean=_geomean(table["sec_ratio"]),
        tflops_ratio_geomean=_geomean(table["tflops_ratio"]),
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
    how = "faster" if sec_ratio < 1.0 else "slower"
    return f"{factor:.1f}x {how}" if factor >= 2.0 else f"{100.0 * (factor - 1.0):.1f}% {how}"


def format_comparison(c: Comparison, *, before: str, after: str) -> str:
    """Markdown: a summary line, then one row per matched config (ratios < 1 in Sec/it are speed-ups)."""
    t = c.table
    lines = [
        f"# Comparison: {before} -> {after}",
        "",
        f"{len(t)} config(s) matched by {c.matched_on}; {c.only_before} only in {before}, {c.only_after} only in {after}.",
    ]
    if c.sec_ratio_geomean is not None:
        lines.append(
            f"Geometric mean after/before: Sec/it x{c.sec_ratio_geomean:.3f} ({speed_change(c.sec_ratio_geomean)}); "
            f"TFLOPs x{_ratio(c.tflops_ratio_geomean or math.nan)}."
        )
    lines.append("")
    if t.empty:
        lines.append("No config appears in both sweeps.")
        return "\n".join(lines) + "\n"

    def ints(s: pd.Series) -> pd.Series:
        return s.map(lambda v: "" if pd.isna(v) else str(int(v)))

    def state(outcome: pd.Series, value: pd.Series, fmt: object) -> pd.Series:
        text = value.map(fmt)  # type: ignore[arg-type]
        return text.where(outcome == "ok", outcome.map(OUTCOME_TEXT))

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
            "TFLOPs before": state(t["outcome_before"], t["tflops_before"], format_tflops),
            "TFLOPs after": state(t["outcome_after"], t["tflops_after"], format_tflops),
            "TFLOPs ratio": t["tflops_ratio"].map(_ratio),
            "Config": t["config"].str.replace("|", "\\|", regex=False),
        }
    )
    lines.append(markdown_table(md, left=("Config",)))
    return "\n".join(lines) + "\n"


__all__ = ["MATCH_KEYS", "Comparison", "compare_sweeps", "format_comparison", "speed_change"]
