"""results.md against the golden file, cell formats as the seeds write them, and seed-004 scaling tables."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest

from analysis.recommend import format_recommendations, recommend
from analysis.records import load_sweeps
from analysis.tables import (
    format_mem,
    format_sec,
    format_size,
    format_tflops,
    results_markdown,
    results_table,
    scaling_frame,
    scaling_markdown,
    sort_results,
)
from tests.analysis.golden.build import EXPECTED_MD, build_sweep, fixture


def _markdown(sweep: Path) -> str:
    loaded = load_sweeps([sweep], queue=None)
    df = loaded.table
    return results_markdown(
        df,
        labels=loaded.labels,
        recommendation=format_recommendations(recommend(df)),
        scaling=scaling_markdown(scaling_frame(df)),
    )


def test_golden_results_md(tmp_path: Path) -> None:
    # Real result.json files (RunRecord), plan.csv and manifest.jsonl built from golden/sweep.json.
    sweep = build_sweep(tmp_path / "bloom_sweep")
    assert _markdown(sweep) == EXPECTED_MD.read_text()


def test_cli_writes_the_golden_file(tmp_path: Path) -> None:
    from analysis.__main__ import main

    sweep = build_sweep(tmp_path / "bloom_sweep")
    assert main([str(sweep), "--no-queue", "--no-plots"]) == 0
    assert (sweep / "analysis" / "results.md").read_text() == EXPECTED_MD.read_text()


def test_failures_render_as_the_seeds_render_them(tmp_path: Path) -> None:
    # Seed 001: "|    48 | 181B | 48 |  8 |  1 |   1 | 2016 | OOM  |        |        | 02-25 |"
    # and "| 48 | 181B | 8 | 1 | 48 | 1 | 2048 | fail | | | 02-25 |": the outcome in Mem, no figures.
    table = results_table(load_sweeps([build_sweep(tmp_path / "s")], queue=None).table)
    failed = table[table["Sec/it"] == ""]
    assert failed["Mem"].tolist() == ["OOM", "NaN", "timeout", "fail", "skipped"]
    assert (failed[["TFLOPs", "MFU"]] == "").all().all()
    oom = failed.iloc[0]
    assert oom[["Nodes", "DP", "TP", "PP", "MBS", "GBS"]].tolist() == ["48", "32", "2", "6", "2", "2048"]
    assert oom["Notes"].startswith("02-25; OutOfMemoryError")
    assert failed.iloc[4]["Notes"].startswith("predicted peak memory")
    # Pipes in messages must not break the markdown table.
    assert "NCCL error \\| unhandled" in failed.iloc[3]["Notes"]


def test_rows_sorted_by_seconds_per_iteration_failures_after(tmp_path: Path) -> None:
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    ordered = sort_results(df.sample(frac=1.0, random_state=3))
    ok = ordered[ordered["outcome"] == "ok"]["sec_per_iter"].tolist()
    assert ok == sorted(ok) and ok[0] == pytest.approx(161.96)
    assert ordered["outcome"].tolist()[len(ok):] == ["oom", "nan", "timeout", "fail", "skipped", "pending"]
    # Stable: the same rows in any input order give the same table.
    assert results_table(df).equals(results_table(df.sample(frac=1.0, random_state=7)))


@pytest.mark.parametrize(
    ("gib", "text"), [(47.4, "47GB"), (46.6, "47GB"), (10.0, "10GB"), (0.43, "0.4GB"), (float("nan"), "")]
)
def test_mem_is_whole_gib_like_the_seeds(gib: float, text: str) -> None:
    assert format_mem(gib) == text


def test_size_sec_tflops_formats() -> None:
    assert format_size(1.3e9) == "1.3B" and format_size(181e9) == "181B" and format_size(float("nan")) == ""
    assert format_sec(189.064) == "189.06" and format_sec(0.0456) == "0.046"
    assert format_tflops(91.666) == "91.67" and format_tflops(0.01234) == "0.0123"


def test_varying_overrides_go_to_notes(tmp_path: Path) -> None:
    data = copy.deepcopy(fixture())
    data["runs"] = data["runs"][:2]
    data["runs"][1]["extra_overrides"] = ["cluster.env.NCCL_ALGO=Tree"]
    table = results_table(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    assert table["Notes"].tolist() == ["02-20; cluster.env.NCCL_ALGO=Tree", "02-20"]


def _scaling_sweep(tmp_path: Path) -> pd.DataFrame:
    # Seed 004, "megatron bert 345m (mp=1)" row: 1658.93 samples/s on 1*8, 6558.31 on 4*8, 12442.73 on 8*8,
    # 26125.74 on 16*8 (2.94, 2.91, 2.88, 2.89 tflops/gpu); one data-parallel layout scaled out.
    data = copy.deepcopy(fixture())
    gbs = 8192
    runs = []
    for nodes, sps, tflops in ((1, 1658.93, 2.94), (4, 6558.31, 2.91), (8, 12442.73, 2.88), (16, 26125.74, 2.89)):
        runs.append({"name": f"n{nodes}", "nodes": nodes, "layout": {"dp": 8 * nodes, "tp": 1, "pp": 1, "mbs": 4, "gbs": gbs},
                     "params": 345_000_000, "mem_gib": 30.0, "sec_per_iter": gbs / sps, "tflops": tflops})
    runs.append({"name": "n32", "nodes": 32, "layout": {"dp": 256, "tp": 1, "pp": 1, "mbs": 4, "gbs": gbs},
                 "status": "oom", "message": "OutOfMemoryError"})
    data["runs"] = runs
    return load_sweeps([build_sweep(tmp_path / "scale", data)], queue=None).table


def test_scaling_efficiency_against_smallest_run(tmp_path: Path) -> None:
    frame = scaling_frame(_scaling_sweep(tmp_path))
    assert frame["scale"].tolist() == ["1*8", "4*8", "8*8", "16*8", "32*8"]
    assert frame["samples_per_s"].iloc[:4].tolist() == pytest.approx([1658.93, 6558.31, 12442.73, 26125.74])
    # Efficiency = per-GPU throughput against 1*8: 6558.31 / 4 / 1658.93 = 0.988 (seed 004's figures).
    assert frame["efficiency"].iloc[:4].tolist() == pytest.approx(
        [1.0, 6558.31 / 4 / 1658.93, 12442.73 / 8 / 1658.93, 26125.74 / 16 / 1658.93]
    )
    assert frame["pflops"].iloc[0] == pytest.approx(2.94 * 8 / 1024)
    md = scaling_markdown(frame)
    assert md is not None
    header, _, row = md.splitlines()[:3]
    assert header.index("1*8") < header.index("4*8") < header.index("32*8")
    assert "1658.93 samples/s<br>2.94 TFLOPs/dev" in row and "99%" in row and row.rstrip(" |").endswith("OOM")


def test_no_scaling_table_for_one_scale(tmp_path: Path) -> None:
    df = _scaling_sweep(tmp_path)
    assert scaling_markdown(scaling_frame(df[df["nodes"] == 4])) is None
