"""PNG plots of a sweep (matplotlib, Agg backend: no display on login nodes).

- tflops_mfu.png: TFLOPs per device and MFU of each successful layout (the fastest MAX_BARS).
- sec_per_iter_vs_nodes.png: seconds per iteration against node count, one series per piece of work.
- memory_measured_vs_predicted.png: measured peak memory per device against train.planner.memory's
  estimate of the same config, with the y = x line: whether the planner's memory model can be trusted.

Every figure has the same fixed size (FIGSIZE at DPI), so that tests and reports can rely on it.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.tables import sort_results  # noqa: E402

FIGSIZE = (10.0, 6.0)
DPI = 100
MAX_BARS = 40
PLOT_FILES = ("tflops_mfu.png", "sec_per_iter_vs_nodes.png", "memory_measured_vs_predicted.png")


def _layout_labels(runs: pd.DataFrame) -> list[str]:
    def i(s: pd.Series) -> pd.Series:
        return s.map(lambda v: "?" if pd.isna(v) else str(int(v)))

    text = "n" + i(runs["nodes"]) + " dp" + i(runs["dp"]) + " tp" + i(runs["tp"]) + " pp" + i(runs["pp"])
    text = text + " mbs" + i(runs["mbs"])
    if runs["sweep"].nunique() > 1:
        text = runs["sweep"].astype(str) + ": " + text
    return text.tolist()


def _finish(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)  # no bbox_inches='tight': the pixel size stays FIGSIZE x DPI
    plt.close(fig)
    return path


def _empty(ax: plt.Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def plot_tflops_mfu(df: pd.DataFrame, path: Path) -> Path:
    """Bars of TFLOPs per device per layout (fastest first), MFU as points on a second axis."""
    runs = sort_results(df[(df["outcome"] == "ok") & df["tflops"].notna()]).head(MAX_BARS)
    fig, ax = plt.subplots(figsize=FIGSIZE)
    if runs.empty:
        _empty(ax, "no successful run with TFLOPs")
    else:
        x = np.arange(len(runs))
        ax.bar(x, runs["tflops"], color="tab:blue", label="TFLOPs per device")
        ax.set_ylabel("model TFLOP/s per device")
        ax.set_xticks(x, _layout_labels(runs), rotation=60, ha="right", fontsize=7)
        if runs["mfu"].notna().any():
            ax2 = ax.twinx()
            ax2.plot(x, 100 * runs["mfu"], "o-", color="tab:orange", label="MFU")
            ax2.set_ylabel("MFU (%)")
            ax2.set_ylim(0, max(100.0, float(100 * runs["mfu"].max()) * 1.1))
        ax.set_title(f"TFLOPs and MFU per layout (fastest {len(runs)}, by seconds per iteration)")
    fig.tight_layout()
    return _finish(fig, path)


def plot_sec_vs_nodes(df: pd.DataFrame, path: Path) -> Path:
    """Seconds per iteration against nodes: every run as a point, the fastest per node count joined."""
    runs = df[(df["outcome"] == "ok") & df["sec_per_iter"].notna() & df["nodes"].notna()]
    fig, ax = plt.subplots(figsize=FIGSIZE)
    if runs.empty:
        _empty(ax, "no successful run with seconds per iteration")
    else:
        work = runs["model"].astype(str) + " GBS " + runs["gbs"].map(lambda v: str(int(v)))
        for i, (name, group) in enumerate(runs.groupby(work, sort=True)):
            color = f"C{i % 10}"
            ax.scatter(group["nodes"], group["sec_per_iter"], color=color, alpha=0.6, s=25)
            best = group.groupby("nodes")["sec_per_iter"].min()
            ax.plot(best.index, best.to_numpy(), "-", color=color, label=f"{name} (fastest per node count)")
        ax.set_xlabel("nodes")
        ax.set_ylabel("seconds per iteration (lower is better)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Seconds per iteration against node count")
    fig.tight_layout()
    return _finish(fig, path)


def plot_memory(df: pd.DataFrame, path: Path) -> Path:
    """Measured peak memory per device against the planner's prediction, y = x and capacity marked.

    OOM runs have no measurement: they are drawn as crosses at the usable capacity, so that a
    prediction below the capacity for a run that ran out of memory stands out.
    """
    fig, ax = plt.subplots(figsize=FIGSIZE)
    measured = df[df["mem_gib"].notna() & df["mem_pred_gib"].notna()]
    oom = df[(df["outcome"] == "oom") & df["mem_pred_gib"].notna() & df["mem_capacity_gib"].notna()]
    if measured.empty and oom.empty:
        _empty(ax, "no run with both a measured and a predicted peak memory")
    else:
        ok = measured["outcome"] == "ok"
        ax.scatter(measured.loc[ok, "mem_pred_gib"], measured.loc[ok, "mem_gib"], color="tab:blue", label="ok")
        ax.scatter(measured.loc[~ok, "mem_pred_gib"], measured.loc[~ok, "mem_gib"], color="tab:red",
                   marker="s", label="failed (not OOM)")
        if not oom.empty:
            ax.scatter(oom["mem_pred_gib"], oom["mem_capacity_gib"], color="black", marker="x", s=60,
                       label="OOM (at usable capacity)")
        values = pd.concat([measured["mem_pred_gib"], measured["mem_gib"], oom["mem_pred_gib"]])
        top = float(values.max()) * 1.1 if len(values) else 1.0
        ax.plot([0, top], [0, top], "--", color="gray", label="prediction = measurement")
        caps = df["mem_capacity_gib"].dropna().unique()
        for cap in caps[:3]:
            ax.axhline(cap, color="tab:green", alpha=0.4, linestyle=":")
        ax.set_xlim(0, top)
        ax.set_ylim(0, max(top, float(caps.max()) * 1.05 if len(caps) else top))
        ax.set_xlabel("predicted peak per device, train.planner.memory (GiB)")
        ax.set_ylabel("measured peak per device (GiB)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Measured against predicted peak memory (dotted: usable capacity)")
    fig.tight_layout()
    return _finish(fig, path)


def write_plots(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """All plots into out_dir (PLOT_FILES); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = dict(zip(("tflops", "sec", "mem"), PLOT_FILES, strict=True))
    return [
        plot_tflops_mfu(df, out_dir / names["tflops"]),
        plot_sec_vs_nodes(df, out_dir / names["sec"]),
        plot_memory(df, out_dir / names["mem"]),
    ]


__all__ = ["DPI", "FIGSIZE", "PLOT_FILES", "plot_memory", "plot_sec_vs_nodes", "plot_tflops_mfu", "write_plots"]
