"""PNG plots of a sweep (matplotlib, Agg backend: no display on login nodes).

- tflops_mfu.png: TFLOPs per device (bars, left axis) and MFU (points, right axis) of each successful
  layout, the fastest MAX_BARS by seconds per iteration, each bar labelled with its layout and the
  fields that differ among the runs plotted (GBS, recompute, ...). When every run shares one peak the
  two axes are one scale (MFU = TFLOPs / peak), so that a point sits on its bar's top.
- sec_per_iter_vs_nodes.png: seconds per iteration against node count, one series per piece of work
  (model and GBS, and the hardware, sequence length and model size when the runs differ in them);
  runs on one node count only are drawn as points over that one whole-node tick.
- memory_measured_vs_predicted.png: measured peak memory per device against train.planner.memory's
  estimate of the same config, with the y = x line and a line at each hardware's usable capacity,
  each hardware's runs and capacity in its own colour (the marker says how a run ended; a run stopped
  before its end, timeout, cancelled or interrupted, has a marker of its own: its peak is the peak so far):
  whether the planner's memory model can be trusted, and how close the runs came to running out.

The plots of speed (the first two) draw finished runs only: a stopped run's partial figures, which
results.md shows marked, are left out of them as of the recommendation.

A plot with nothing measured to draw (a dry run's directory, a sweep still running) is not written:
write_plots says which and why, and removes a stale file of that name from an earlier analysis.
Every figure has the same fixed size (FIGSIZE at DPI), so that tests and reports can rely on it.
The *_figure functions return the open figure (the caller closes it); write_plots saves them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from analysis.recommend import _DISTINCT, _SHAPE, _varying, model_shapes, pooled_layout_key
from analysis.records import PARTIAL_OUTCOMES, value_texts
from analysis.tables import TIE_BREAK, format_size, sort_results

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGSIZE = (10.0, 6.0)
DPI = 100
MAX_BARS = 40
PLOT_FILES = ("tflops_mfu.png", "sec_per_iter_vs_nodes.png", "memory_measured_vs_predicted.png")
PLOT_COLUMNS = (
    "outcome", "model", "hardware", "sweep", "nodes", "dp", "tp", "pp", "mbs", "gbs", "seq_length", "sec_per_iter",
    "tflops", "mfu", "size_params", *_SHAPE,
    "mem_gib", "mem_pred_gib", "mem_capacity_gib", *TIE_BREAK, *(col for col, _ in _DISTINCT),
)  # fmt: skip
"""The columns of the table the plots read (sort_results' tie-breaks included): the plots of the table
narrowed to them are those of the whole table."""
# Runs whose peaks (TFLOPs / MFU) differ by less than this share one peak: one scale for both axes.
_SAME_PEAK = 0.01


@functools.cache
def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend, imported by the first figure rather than with this module:
    it takes ~0.4 s, which a process that only reads a Plots or PLOT_COLUMNS does not need (the
    analysis CLI, which unpickles the Plots its plotting process sends back)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class NothingToPlot(Exception):
    """The table holds nothing measured for this plot; str() says what is missing."""


@dataclass(frozen=True)
class Plots:
    """What write_plots did: the files written, and the plots left out with the reason."""

    written: tuple[Path, ...]
    skipped: tuple[tuple[str, str], ...]
    """(file name, why it was not drawn)."""

    def skipped_line(self) -> str:
        """'plots not drawn: name (why); ...', '' when every plot was drawn."""
        if not self.skipped:
            return ""
        return "plots not drawn: " + "; ".join(f"{name} ({why})" for name, why in self.skipped)


def _layout_labels(runs: pd.DataFrame) -> list[str]:
    """Per run, what tells its bar from the others: nodes, DP, TP, PP and MBS always; model, sweep,
    hardware and GBS, and the recommendation's distinguishing fields (recompute, ZeRO, ...), when
    they differ among `runs`; the run's directory where runs still read alike (a repeated config).
    Without them four gpt_1.3b runs of one layout, differing in recompute and GBS, read the same."""

    def i(s: pd.Series) -> pd.Series:
        return s.map(lambda v: "?" if pd.isna(v) else str(int(v)))

    def varies(name: str) -> bool:
        return name in runs.columns and len(set(value_texts(runs[name]))) > 1

    text = "n" + i(runs["nodes"]) + " dp" + i(runs["dp"]) + " tp" + i(runs["tp"]) + " pp" + i(runs["pp"])
    text = text + " mbs" + i(runs["mbs"])
    if varies("gbs"):
        text = text + " gbs" + i(runs["gbs"])
    # The same fields, named the same way, as the recommendation's labels of the runs it compares.
    for col, name in _varying(runs):
        text = text + f" {name}=" + pd.Series(value_texts(runs[col]), index=runs.index)
    if varies("hardware"):
        text = runs["hardware"].astype(str) + " " + text
    if varies("model"):
        text = runs["model"].astype(str) + " " + text
    if varies("sweep"):
        text = runs["sweep"].astype(str) + ": " + text
    alike = text.duplicated(keep=False)
    if alike.any():
        text = text.where(~alike, text + " [" + runs["run_dir"].astype(str) + "]")
    return text.tolist()


def _shared_peak(runs: pd.DataFrame) -> float | None:
    """The peak (TFLOP/s) every run's MFU is measured against, when they all share one; else None."""
    peaks = (runs["tflops"] / runs["mfu"]).replace([np.inf, -np.inf], np.nan).dropna()
    peaks = peaks[peaks > 0]
    if peaks.empty or len(peaks) != len(runs):
        return None
    low, high = float(peaks.min()), float(peaks.max())
    return high if (high - low) <= _SAME_PEAK * high else None


def tflops_mfu_figure(df: pd.DataFrame) -> Figure:
    """Bars of TFLOPs per device per layout (fastest first), MFU as points on a second axis."""
    runs = sort_results(df[(df["outcome"] == "ok") & df["tflops"].notna()]).head(MAX_BARS)
    if runs.empty:
        raise NothingToPlot("no successful run with a measured TFLOPs")
    fig, ax = pyplot().subplots(figsize=FIGSIZE)
    x = np.arange(len(runs))
    tflops = runs["tflops"].astype(float).to_numpy()
    bars = ax.bar(x, tflops, color="tab:blue", label="TFLOPs per device (left axis)")
    top = float(np.nanmax(tflops)) * 1.15 or 1.0
    ax.set_ylim(0, top)
    ax.set_ylabel("model TFLOP/s per device")
    ax.set_xlabel("layout: nodes, DP, TP, PP, micro-batch and what else differs (fastest first, by seconds per iteration)")
    ax.set_xticks(x, _layout_labels(runs), rotation=60, ha="right", fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    handles: list = [bars]
    mfu = 100 * runs["mfu"].astype(float)
    if mfu.notna().any():
        ax2 = ax.twinx()
        peak = _shared_peak(runs)
        if peak is not None:
            # One scale: the right axis is the left one divided by the peak.
            ax2.set_ylim(0, 100 * top / peak)
            ax2.set_ylabel(f"MFU (% of the {peak:.4g} TFLOP/s peak)")
        else:
            ax2.set_ylim(0, float(mfu.max()) * 1.15 or 1.0)
            ax2.set_ylabel("MFU (% of each run's peak)")
        (points,) = ax2.plot(x, mfu.to_numpy(), "o", color="tab:orange", markeredgecolor="black",
                            label="MFU (right axis)")
        handles.append(points)
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.set_title(f"TFLOPs per device and MFU per layout (fastest {len(runs)} successful runs)")
    fig.tight_layout()
    return fig


def _whole(v: object) -> str:
    return "?" if pd.isna(v) else str(int(v))  # type: ignore[call-overload]


def _work_label(runs: pd.DataFrame) -> pd.Series:
    """One series per piece of work, as the recommendation groups it: model, GBS, and the hardware
    and sequence length where the runs drawn differ in them (their times are not one series)."""
    work = runs["model"].astype(str)
    if "hardware" in runs.columns and runs["hardware"].nunique(dropna=False) > 1:
        work = work + " on " + runs["hardware"].astype(str)
    work = work + " GBS " + runs["gbs"].map(_whole)
    if "seq_length" in runs.columns and runs["seq_length"].nunique(dropna=False) > 1:
        work = work + " seq " + runs["seq_length"].map(_whole)
    if "size_params" in runs.columns and model_shapes(runs).nunique() > 1:
        work = work + " (" + runs["size_params"].map(format_size) + ")"
    return work


def _layout_medians(runs: pd.DataFrame) -> pd.Series:
    """Each run's layout's median seconds per iteration, its layout as the recommendation pools runs
    (recommend.pooled_layout_key: two runs that differ in virtual_stages or the optimizer are two)."""
    return runs.groupby(pooled_layout_key(runs))["sec_per_iter"].transform("median")


def sec_vs_nodes_figure(df: pd.DataFrame) -> Figure:
    """Seconds per iteration against nodes: every run as a point, the fastest layout per node count
    joined, at the median of its runs as the recommendation ranks it (a layout run twice, 1.0 and 3.0
    s/it, is 2.0 there: its luckier run alone made a node count look faster than any layout is)."""
    from matplotlib.ticker import MaxNLocator

    runs = df[(df["outcome"] == "ok") & df["sec_per_iter"].notna() & df["nodes"].notna()]
    if runs.empty:
        raise NothingToPlot("no successful run with a measured seconds per iteration")
    fig, ax = pyplot().subplots(figsize=FIGSIZE)
    work = _work_label(runs)
    for i, (name, group) in enumerate(runs.groupby(work, sort=True)):
        color = f"C{i % 10}"
        group = group.reset_index(drop=True)  # tables of several sweeps may repeat an index label
        ax.scatter(group["nodes"], group["sec_per_iter"], color=color, alpha=0.6, s=25)
        best = _layout_medians(group).groupby(group["nodes"]).min()
        # A marker on the fastest too: a series with one node count has no line to draw, and its
        # legend entry would be a line that appears nowhere in the plot.
        ax.plot(best.index, best.to_numpy(), "-D", color=color, markersize=7, markeredgecolor="black",
                label=f"{name}: fastest layout per node count, median of its runs (dots: every run)")
    ax.set_xlabel("nodes")
    nodes = sorted(runs["nodes"].unique().tolist())
    if len(nodes) == 1:
        # One node count: matplotlib would span it by +-5% (0.945..1.050 for one node), ticks of
        # fractional nodes; a window of one node around it, with its one tick, reads as what it is.
        ax.set_xlim(nodes[0] - 0.5, nodes[0] + 0.5)
        ax.set_xticks(nodes)
        ax.set_title(f"Seconds per iteration, all runs on {nodes[0]:g} node(s): no scaling to show")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title("Seconds per iteration against node count")
    # Room above the slowest run: matplotlib's 5% margin is of the runs' spread, so from 0 its point
    # sat on the top edge, half clipped, under the legend.
    ax.set_ylim(0, float(runs["sec_per_iter"].max()) * 1.15)
    ax.set_ylabel("seconds per iteration (s, lower is better)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


_HW_COLOURS = tuple(f"C{i}" for i in range(10) if i != 7)
"""One colour per hardware, C7 (gray) left out: it is the y = x line's."""
_MEM_KINDS = (
    ("ok", "o", "run ok"),
    ("stopped", "^", "run stopped before its end (timeout, scancel, Ctrl-C): its peak so far"),
    ("failed", "s", "run failed (not OOM)"),
    ("oom", "x", "OOM (drawn at its hardware's usable capacity)"),
)
"""How a run ended (marker), as the memory plot's legend names it; the colour says the hardware."""


def _memory_points(df: pd.DataFrame) -> pd.DataFrame:
    """(hardware, kind, predicted, measured) of each run the memory plot draws: measured runs at their
    peak, OOM runs (no measurement) at their hardware's usable capacity."""
    oom = df[(df["outcome"] == "oom") & df["mem_pred_gib"].notna() & df["mem_capacity_gib"].notna()]
    # An OOM run's record may keep the peak it reached before it ran out: drawn there too, it was one
    # run twice (a "failed" square and a cross) and counted twice.
    measured = df[df["mem_gib"].notna() & df["mem_pred_gib"].notna() & ~df.index.isin(oom.index)]
    # A stopped run's peak is the highest until the stop: marked apart from a finished run's peak.
    kinds = np.select([measured["outcome"] == "ok", measured["outcome"].isin(PARTIAL_OUTCOMES)], ["ok", "stopped"],
                      "failed")  # fmt: skip
    points = pd.concat([
        pd.DataFrame({"kind": kinds, "y": measured["mem_gib"], "cap": measured["mem_capacity_gib"]}).assign(
            hardware=measured["hardware"], x=measured["mem_pred_gib"]),
        pd.DataFrame({"kind": "oom", "y": oom["mem_capacity_gib"], "cap": oom["mem_capacity_gib"]}).assign(
            hardware=oom["hardware"], x=oom["mem_pred_gib"]),
    ], ignore_index=True)  # fmt: skip
    points["hardware"] = points["hardware"].astype(object).where(points["hardware"].notna(), "")
    return points.astype({"x": float, "y": float, "cap": float})


def memory_figure(df: pd.DataFrame) -> Figure:
    """Measured peak memory per device against the planner's prediction, y = x and capacities marked.

    Each hardware has its colour, its runs' points and its usable capacity's dotted line; the marker
    says how the run ended. OOM runs have no measurement: they are drawn as crosses at the usable
    capacity, so that a prediction below the capacity for a run that ran out of memory stands out.
    """
    from matplotlib.lines import Line2D

    points = _memory_points(df)
    if points.empty:
        raise NothingToPlot("no run with both a measured and a predicted peak memory")
    fig, ax = pyplot().subplots(figsize=FIGSIZE)
    data_top = float(pd.concat([points["x"], points.loc[points["kind"] != "oom", "y"]]).max()) * 1.1
    # The range shows the comparison: a capacity far above every run (a CPU's 14 GiB over runs of 0.7)
    # squeezed the points onto the axis and y = x flat. One within reach is drawn, and an OOM cross's
    # (it sits on it); a farther one is named in the legend only.
    shown = points.loc[(points["cap"] <= 2 * data_top) | (points["kind"] == "oom"), "cap"]
    top = max(data_top, float(shown.max()) * 1.05 if shown.notna().any() else 0.0)
    ax.plot([0, top], [0, top], "--", color="gray", label="prediction = measurement")
    handles: list = [ax.lines[-1]]
    caps = points.groupby("hardware", sort=False)["cap"].max()
    # Every capacity runs of a hardware had (hardware.memory_gib set per run): the highest alone hid a
    # run over its own smaller one.
    levels = points.groupby("hardware", sort=False)["cap"].agg(lambda c: sorted(set(c.dropna()), reverse=True))
    # By capacity, then name: the legend's capacity entries read top-down as their lines do bottom-up.
    order = sorted(caps.index, key=lambda hw: (-caps[hw] if pd.notna(caps[hw]) else 0.0, str(hw)))
    for i, hw in enumerate(order):
        colour, name = _HW_COLOURS[i % len(_HW_COLOURS)], hw or "unknown hardware"
        mine = points[points["hardware"] == hw]
        for kind, marker, _ in _MEM_KINDS:
            these = mine[mine["kind"] == kind]
            if not these.empty:
                oom = kind == "oom"  # a cross has no face to edge: its own strokes, thicker
                ax.scatter(these["x"], these["y"], color=colour, marker=marker, s=70 if oom else 36,
                           edgecolors=None if oom else "black", linewidths=2 if oom else 0.5)
        handles.append(Line2D([], [], color=colour, marker="o", linestyle="", label=f"{name} ({len(mine)} run(s))"))
        for cap in levels[hw]:
            label = f"usable capacity of {hw or 'the device'}: {_gib(cap)} GiB"
            if cap > top:
                handles.append(Line2D([], [], color=colour, linestyle=":", linewidth=2, alpha=0.8,
                                      label=f"{label} (above this range)"))
                continue
            # Dotted and lighter than the points: a capacity is a limit, not a run.
            handles.append(ax.axhline(cap, color=colour, linestyle=":", linewidth=2, alpha=0.8, label=label))
    present = set(points["kind"])
    handles += [Line2D([], [], color="dimgray", marker=m, linestyle="", label=text)
                for kind, m, text in _MEM_KINDS if kind in present]
    ax.set_xlim(0, data_top)
    ax.set_ylim(0, top)
    ax.set_xlabel("predicted peak per device, train.planner.memory (GiB)")
    ax.set_ylabel("measured peak per device (GiB)")
    ax.grid(True, alpha=0.3)
    # Where it covers no point: an OOM cross sits at the top of the range, as the upper left corner.
    ax.legend(handles=handles, fontsize=8, loc="best")
    ax.set_title("Measured against predicted peak memory per device, and the usable capacity")
    fig.tight_layout()
    return fig


def _gib(value: float) -> str:
    """A capacity's GiB as the tables write memory: one decimal, two below 1 GiB (0.5 and 0.75 apart)."""
    return f"{value:.1f}" if value >= 1 else f"{value:.2f}"


_FIGURES = dict(zip(PLOT_FILES, (tflops_mfu_figure, sec_vs_nodes_figure, memory_figure), strict=True))


def write_plot(name: str, df: pd.DataFrame, out_dir: Path) -> str | None:
    """The plot PLOT_FILES names `name` drawn into out_dir (which exists): None when written, else why
    there was nothing measured to draw (and no file of that name is left)."""
    path = out_dir / name
    try:
        fig = _FIGURES[name](df)
    except NothingToPlot as why:
        # An earlier analysis's plot of this name would now be read as this one's.
        path.unlink(missing_ok=True)
        return str(why)
    fig.savefig(path, dpi=DPI)  # no bbox_inches='tight': the pixel size stays FIGSIZE x DPI
    pyplot().close(fig)
    return None


def plots_written(out_dir: Path, why_not: Sequence[str | None]) -> Plots:
    """The Plots of write_plot's answers for PLOT_FILES, in that order."""
    return Plots(
        written=tuple(out_dir / name for name, why in zip(PLOT_FILES, why_not, strict=True) if why is None),
        skipped=tuple((name, why) for name, why in zip(PLOT_FILES, why_not, strict=True) if why is not None),
    )


def write_plots(df: pd.DataFrame, out_dir: Path) -> Plots:
    """The plots with something measured to draw into out_dir (PLOT_FILES); the others named with why."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return plots_written(out_dir, [write_plot(name, df, out_dir) for name in PLOT_FILES])


__all__ = [
    "DPI",
    "FIGSIZE",
    "PLOT_FILES",
    "PLOT_COLUMNS",
    "NothingToPlot",
    "Plots",
    "memory_figure",
    "sec_vs_nodes_figure",
    "tflops_mfu_figure",
    "plots_written",
    "write_plot",
    "write_plots",
]
