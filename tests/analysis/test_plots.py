"""The PNG plots: real images of the right size, with legends, labelled axes with units and the device
capacity; plots with nothing measured are not drawn."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from numpy.typing import ArrayLike
from PIL import Image

from analysis.plots import (
    DPI,
    FIGSIZE,
    PLOT_FILES,
    NothingToPlot,
    memory_figure,
    sec_vs_nodes_figure,
    tflops_mfu_figure,
    write_plots,
)
from analysis.records import load_sweeps
from tests.analysis.golden.build import build_sweep, fixture, hardware_conf, stopped_sweep_data

SIZE = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def _colours(path: Path) -> int:
    with Image.open(path) as im:
        assert im.size == SIZE
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None
    return len(colours)


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    root = tmp_path_factory.mktemp("plots")
    return load_sweeps([build_sweep(root / "s")], queue=None).table


@pytest.fixture(scope="module")
def plots(table: pd.DataFrame, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    written = write_plots(table, tmp_path_factory.mktemp("out"))
    assert written.skipped == ()
    return list(written.written)


@pytest.fixture()
def close_figures() -> Iterator[None]:
    yield
    plt.close("all")


def _legend(fig: Figure) -> list[str]:
    texts: list[str] = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            texts += [t.get_text() for t in legend.get_texts()]
    assert texts, "no legend"
    return texts


def _data(values: ArrayLike) -> list[float]:
    # A line's data is what was plotted (a list or an array), hence typed ArrayLike.
    return [float(v) for v in np.ravel(values)]


def test_all_plots_written(plots: list[Path]) -> None:
    assert [p.name for p in plots] == list(PLOT_FILES)
    assert all(p.stat().st_size > 10_000 for p in plots)


@pytest.mark.parametrize("name", PLOT_FILES)
def test_plot_is_a_drawn_image(plots: list[Path], name: str) -> None:
    path = next(p for p in plots if p.name == name)
    # Text, axes, bars and markers antialiased over white: far more than a handful of colours.
    assert _colours(path) > 50


@pytest.mark.usefixtures("close_figures")
def test_tflops_and_mfu_per_layout_share_one_scale_when_the_runs_share_a_peak(table: pd.DataFrame) -> None:
    fig = tflops_mfu_figure(table)
    ax, ax2 = fig.axes
    assert _legend(fig) == ["TFLOPs per device (left axis)", "MFU (right axis)"]
    assert "TFLOP/s" in ax.get_ylabel() and "layout" in ax.get_xlabel()
    ok = table[(table["outcome"] == "ok") & table["tflops"].notna()]
    # One bar per successful layout, labelled with its layout.
    assert len(ax.patches) == len(ok)
    assert all(t.get_text().startswith("n") and " tp" in t.get_text() for t in ax.get_xticklabels())
    # The golden runs are all A100 bf16: one peak, so the MFU axis is the TFLOPs axis over it and a
    # point sits on its bar's top.
    peak = float((ok["tflops"] / ok["mfu"]).median())
    assert f"{peak:.4g} TFLOP/s peak" in ax2.get_ylabel() and "%" in ax2.get_ylabel()
    assert ax.get_ylim()[0] == ax2.get_ylim()[0] == 0
    assert ax2.get_ylim()[1] == pytest.approx(100 * ax.get_ylim()[1] / peak, rel=1e-3)
    (points,) = ax2.lines
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(bars) == len(ax.patches)  # every patch is a bar
    heights = sorted(p.get_height() for p in bars)
    assert sorted(_data(points.get_ydata())) == pytest.approx([100 * h / peak for h in heights], rel=0.01)


@pytest.mark.usefixtures("close_figures")
def test_mfu_gets_its_own_scale_when_peaks_differ(table: pd.DataFrame) -> None:
    # One run measured against half the peak (another precision, another device): no common scale.
    first = table.index[(table["outcome"] == "ok") & table["mfu"].notna()][0]
    mixed = table.copy()
    mixed.loc[first, "mfu"] = 2 * mixed.loc[first, "mfu"]
    _, ax2 = tflops_mfu_figure(mixed).axes
    assert ax2.get_ylabel() == "MFU (% of each run's peak)"
    assert ax2.get_ylim()[1] >= 100 * mixed["mfu"].max()


@pytest.mark.usefixtures("close_figures")
def test_memory_plot_marks_the_usable_capacity(table: pd.DataFrame) -> None:
    fig = memory_figure(table)
    (ax,) = fig.axes
    assert "(GiB)" in ax.get_xlabel() and "(GiB)" in ax.get_ylabel()
    legend = _legend(fig)
    capacity = float(table["mem_capacity_gib"].dropna().iloc[0])
    label = f"usable capacity of a100_80gb: {capacity:.1f} GiB"
    assert label in legend and "prediction = measurement" in legend and "run ok" in legend
    (line,) = [ln for ln in ax.lines if ln.get_label() == label]
    assert _data(line.get_ydata()) == [capacity, capacity]
    # The capacity is inside the drawn range, the runs' measurements too.
    assert ax.get_ylim()[1] > capacity >= table["mem_gib"].max()


@pytest.mark.usefixtures("close_figures")
def test_memory_plot_gives_each_hardware_its_colour_and_capacity(tmp_path: Path) -> None:
    # The golden sweep on its A100s beside the same layouts recorded on H100s: every point was
    # tab:blue whatever its hardware, and the capacity lines' colours matched no point.
    h100 = copy.deepcopy(fixture())
    h100["hardware"] = hardware_conf("h100_sxm")
    table = load_sweeps([build_sweep(tmp_path / "a100"), build_sweep(tmp_path / "h100", h100)], queue=None).table
    fig = memory_figure(table)
    (ax,) = fig.axes
    legend = _legend(fig)
    colours = {}
    for hw in ("a100_80gb", "h100_sxm"):
        runs = table[(table["hardware"] == hw) & table["mem_pred_gib"].notna()]
        drawn = runs[runs["mem_gib"].notna() | (runs["outcome"] == "oom")]
        assert f"{hw} ({len(drawn)} run(s))" in legend
        capacity = float(runs["mem_capacity_gib"].iloc[0])
        (line,) = [ln for ln in ax.lines if ln.get_label() == f"usable capacity of {hw}: {capacity:.1f} GiB"]
        assert _data(line.get_ydata()) == [capacity, capacity] and line.get_linestyle() == ":"
        colours[hw] = to_rgba(line.get_color())
        # This hardware's runs, and only they, are drawn in its capacity line's colour.
        mine = [c for c in ax.collections if tuple(np.asarray(c.get_facecolor(), dtype=float)[0]) == colours[hw]]
        xs = sorted(float(x) for c in mine for x in np.asarray(c.get_offsets(), dtype=float)[:, 0])
        assert xs == pytest.approx(sorted(drawn["mem_pred_gib"]))
    assert colours["a100_80gb"] != colours["h100_sxm"]
    # How a run ended is the marker, named once in neutral grey, whatever the hardware.
    assert {"run ok", "run failed (not OOM)", "OOM (drawn at its hardware's usable capacity)"} <= set(legend)
    assert ax.get_ylim()[1] > max(float(table["mem_capacity_gib"].max()), float(table["mem_gib"].max()))


@pytest.mark.usefixtures("close_figures")
def test_memory_plot_draws_each_run_once_every_capacity_and_a_range_that_shows_them() -> None:
    # CPU runs of ~0.6 GiB, one with hardware.memory_gib giving 0.5 GiB usable, and an OOM run whose
    # record kept the 1.66 GiB it reached: it was drawn twice (a square and a cross) and counted twice,
    # only the 14 GiB capacity was drawn, and the range ran to 14 GiB with every point on the axis.
    runs = pd.DataFrame({
        "hardware": ["cpu"] * 4, "outcome": ["ok", "ok", "ok", "oom"], "mem_gib": [0.6, 0.65, 0.55, 1.66],
        "mem_pred_gib": [0.5, 0.5, 0.4, 1.2], "mem_capacity_gib": [14.0, 0.5, 14.0, 14.0],
    })  # fmt: skip
    fig = memory_figure(runs)
    (ax,) = fig.axes
    legend = _legend(fig)
    assert "cpu (4 run(s))" in legend
    assert sum(np.asarray(c.get_offsets()).shape[0] for c in ax.collections) == 4
    for label in ("usable capacity of cpu: 0.50 GiB", "usable capacity of cpu: 14.0 GiB"):
        (line,) = [ln for ln in ax.lines if ln.get_label() == label]  # the OOM cross sits on 14 GiB
    # Without the OOM run, 14 GiB is far above every run: named, not drawn, and the range fits the runs.
    fig = memory_figure(runs[runs["outcome"] == "ok"])
    (ax,) = fig.axes
    assert "usable capacity of cpu: 14.0 GiB (above this range)" in _legend(fig)
    assert [ln.get_label() for ln in ax.lines if str(ln.get_label()).startswith("usable")] == [
        "usable capacity of cpu: 0.50 GiB"]
    assert 0.65 < ax.get_ylim()[1] < 1.0


@pytest.mark.usefixtures("close_figures")
def test_seconds_against_nodes_has_a_legend_and_units(table: pd.DataFrame) -> None:
    fig = sec_vs_nodes_figure(table)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "nodes" and "(s" in ax.get_ylabel()
    (entry,) = _legend(fig)
    assert entry.startswith("bloom_200b_l80_h14400 GBS 2048")
    assert ax.get_ylim()[0] == 0


@pytest.mark.usefixtures("close_figures")
def test_the_slowest_run_has_room_above_it(table: pd.DataFrame) -> None:
    # Two runs at 0.776 and 0.939 s/it: the axis ended at 0.947, the slower point half cut off at the
    # top edge, under the legend.
    ok = table[table["outcome"] == "ok"].head(2).assign(sec_per_iter=[0.776, 0.939])
    (ax,) = sec_vs_nodes_figure(ok).axes
    assert ax.get_ylim()[0] == 0
    assert ax.get_ylim()[1] >= 0.939 * 1.1


@pytest.mark.usefixtures("close_figures")
def test_the_fastest_per_node_count_is_a_layouts_median_as_the_recommendation_ranks_it(table: pd.DataFrame) -> None:
    # A layout run twice (1.0 and 3.0 s/it) drew its luckier run as the node count's fastest (1.0),
    # where the recommendation ranks it at its median (2.0), behind a layout of 1.5 s/it.
    first = table[table["outcome"] == "ok"].head(1)
    ok = pd.concat([first] * 3, ignore_index=True)
    ok.loc[2, "mbs"] = 4  # another layout
    ok["sec_per_iter"] = [1.0, 3.0, 1.5]

    def fastest(runs: pd.DataFrame) -> list[float]:
        (ax,) = sec_vs_nodes_figure(runs).axes
        (line,) = [ln for ln in ax.lines if str(ln.get_label()).endswith("(dots: every run)")]
        return np.asarray(line.get_ydata()).tolist()

    assert fastest(ok) == [1.5]
    assert fastest(ok.assign(sec_per_iter=[1.0, 2.0, 1.8])) == [1.5]  # its median is now the fastest
    # Runs that differ in a field the recommendation tells layouts apart by (virtual_stages here, which
    # records' layout_key leaves out) are two layouts in the plot too: its 1.0 s/it, not the median 2.0.
    vpp = ok.head(2).assign(**{"config.parallelism.virtual_stages": [1, 2]})
    assert fastest(vpp) == [1.0]


def test_nothing_measured_draws_nothing_and_says_why(table: pd.DataFrame, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # A stale plot from an earlier analysis of the same directory must not survive as this one's.
    write_plots(table, out)
    unmeasured = table[table["outcome"] != "ok"].assign(mem_gib=float("nan"))
    unmeasured = unmeasured[unmeasured["outcome"] != "oom"]
    result = write_plots(unmeasured, out)
    assert result.written == ()
    assert [name for name, _ in result.skipped] == list(PLOT_FILES)
    assert not any((out / name).exists() for name in PLOT_FILES)
    line = result.skipped_line()
    assert line.startswith("plots not drawn: tflops_mfu.png (no successful run")
    for figure in (tflops_mfu_figure, sec_vs_nodes_figure, memory_figure):
        with pytest.raises(NothingToPlot):
            figure(unmeasured)


@pytest.mark.usefixtures("close_figures")
def test_bars_of_runs_alike_but_for_recompute_and_gbs_are_told_apart(table: pd.DataFrame) -> None:
    # call4 on an H100: four gpt_1.3b runs at n1 dp1 tp1 pp1 mbs8, differing in recompute and GBS,
    # were four bars all labelled "n1 dp1 tp1 pp1 mbs8".
    ok = table[(table["outcome"] == "ok") & table["tflops"].notna()].head(4).copy()
    ok[["nodes", "dp", "tp", "pp", "mbs"]] = [1, 1, 1, 1, 8]
    ok["gbs"] = [8, 8, 32, 32]
    ok["config.parallelism.recompute"] = ["none", "selective", "none", "selective"]
    labels = [t.get_text() for t in tflops_mfu_figure(ok).axes[0].get_xticklabels()]
    assert len(set(labels)) == 4
    assert all(label.startswith("n1 dp1 tp1 pp1 mbs8 gbs") and " recompute=" in label for label in labels)
    assert "n1 dp1 tp1 pp1 mbs8 gbs32 recompute=selective" in labels
    # A repeated config (nothing differs) is told apart by its run directory.
    twice = ok.assign(gbs=8, **{"config.parallelism.recompute": "none"})
    repeated = [t.get_text() for t in tflops_mfu_figure(twice).axes[0].get_xticklabels()]
    assert len(set(repeated)) == 4 and all(f"[{d}]" in " ".join(repeated) for d in twice["run_dir"])


@pytest.mark.usefixtures("close_figures")
def test_one_node_count_is_drawn_as_points_on_a_whole_node_axis(table: pd.DataFrame) -> None:
    # call4 ran on one node: the axis read 0.945..1.050 and the legend showed lines drawn nowhere.
    one = table[table["nodes"] == 48]
    assert one["outcome"].eq("ok").sum() >= 2
    fig = sec_vs_nodes_figure(one)
    (ax,) = fig.axes
    assert ax.get_xlim() == (47.5, 48.5) and list(ax.get_xticks()) == [48]
    assert "48 node(s)" in ax.get_title()
    (fastest,) = ax.lines
    assert fastest.get_marker() == "D" and _data(fastest.get_xdata()) == [48]
    assert _legend(fig)[0].startswith("bloom_200b_l80_h14400 GBS 2048")


@pytest.mark.usefixtures("close_figures")
def test_runs_on_other_hardware_or_sequence_lengths_are_other_series(table: pd.DataFrame) -> None:
    # Two sweeps of one model and GBS, one at sequence 64 and one at 256 (or one on A100s and one
    # on H100s), were one series: its "fastest per node count" line joined the short sequence's
    # times, as if the two were the same work (the recommendation keeps them apart).
    ok = table[table["outcome"] == "ok"]
    short = ok.assign(seq_length=64, sec_per_iter=ok["sec_per_iter"] / 4)
    legend = _legend(sec_vs_nodes_figure(pd.concat([ok, short], ignore_index=True)))
    assert sorted(legend) == [
        "bloom_200b_l80_h14400 GBS 2048 seq 2048: fastest layout per node count, median of its runs (dots: every run)",
        "bloom_200b_l80_h14400 GBS 2048 seq 64: fastest layout per node count, median of its runs (dots: every run)",
    ]
    h100 = ok.assign(hardware="h100_sxm", sec_per_iter=ok["sec_per_iter"] / 3)
    fig = sec_vs_nodes_figure(pd.concat([ok, h100], ignore_index=True))
    assert sorted(entry.split(":")[0] for entry in _legend(fig)) == [
        "bloom_200b_l80_h14400 on a100_80gb GBS 2048",
        "bloom_200b_l80_h14400 on h100_sxm GBS 2048",
    ]
    fastest = {str(line.get_label()).split(" GBS")[0]: min(_data(line.get_ydata())) for line in fig.axes[0].lines}
    assert fastest["bloom_200b_l80_h14400 on a100_80gb"] == pytest.approx(ok["sec_per_iter"].min())


@pytest.mark.usefixtures("close_figures")
def test_one_model_name_of_two_sizes_is_two_series(table: pd.DataFrame) -> None:
    # The same model name at half the width (model.hidden_size overridden): other work, not a
    # faster point of the same series.
    ok = table[table["outcome"] == "ok"]
    narrow = ok.assign(**{"config.model.hidden_size": 7200, "size_params": 51.6e9,
                          "sec_per_iter": ok["sec_per_iter"] / 3})  # fmt: skip
    legend = _legend(sec_vs_nodes_figure(pd.concat([ok, narrow], ignore_index=True)))
    assert sorted(entry.split(":")[0] for entry in legend) == [
        "bloom_200b_l80_h14400 GBS 2048 (203B)",
        "bloom_200b_l80_h14400 GBS 2048 (51.6B)",
    ]


@pytest.mark.usefixtures("close_figures")
def test_a_stopped_runs_partial_figures_are_no_bar_or_point_of_speed_and_its_peak_is_marked(tmp_path: Path) -> None:
    # Two finished runs and three stopped ones (two with partial figures, one faster than both).
    table = load_sweeps([build_sweep(tmp_path / "s", stopped_sweep_data())], queue=None).table
    (ax, _) = tflops_mfu_figure(table).axes
    assert sorted(p.get_height() for p in ax.patches if isinstance(p, Rectangle)) == pytest.approx([98.43, 100.43])
    (ax,) = sec_vs_nodes_figure(table).axes
    drawn = sorted(float(y) for c in ax.collections for y in np.asarray(c.get_offsets(), dtype=float)[:, 1])
    assert drawn == pytest.approx([172.36, 207.92])
    # Their peaks so far are drawn, each with the marker of a run stopped before its end.
    fig = memory_figure(table)
    legend = _legend(fig)
    assert "run stopped before its end (timeout, scancel, Ctrl-C): its peak so far" in legend
    assert "run failed (not OOM)" not in legend
    (ax,) = fig.axes
    offsets = [np.asarray(c.get_offsets(), dtype=float) for c in ax.collections]
    # One hardware: one scatter per kind, the finished runs' two points and the stopped runs' three.
    assert sorted(len(o) for o in offsets) == [2, 3]
    (stopped,) = (o for o in offsets if len(o) == 3)
    assert sorted(float(y) for y in stopped[:, 1]) == [38.6, 41.0, 55.0]
