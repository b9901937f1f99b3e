"""The PNG plots are written and are real images: the right size, not blank."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from analysis.plots import DPI, FIGSIZE, PLOT_FILES, write_plots
from analysis.records import load_sweeps
from tests.analysis.golden.build import build_sweep

SIZE = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def _colours(path: Path) -> int:
    with Image.open(path) as im:
        assert im.size == SIZE
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None
    return len(colours)


@pytest.fixture(scope="module")
def plots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("plots")
    df = load_sweeps([build_sweep(root / "s")], queue=None).table
    return write_plots(df, root / "out")


def test_all_plots_written(plots: list[Path]) -> None:
    assert [p.name for p in plots] == list(PLOT_FILES)
    assert all(p.stat().st_size > 10_000 for p in plots)


@pytest.mark.parametrize("name", PLOT_FILES)
def test_plot_is_a_drawn_image(plots: list[Path], name: str) -> None:
    path = next(p for p in plots if p.name == name)
    # Text, axes, bars and markers antialiased over white: far more than a handful of colours.
    assert _colours(path) > 50


def test_empty_selection_still_gives_an_image(tmp_path: Path) -> None:
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    paths = write_plots(df[df["outcome"] != "ok"].assign(mem_gib=float("nan")), tmp_path / "out")
    assert all(_colours(p) > 5 for p in paths)
