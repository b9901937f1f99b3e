"""Comparing two sweeps: per-config ratios of seconds per iteration and TFLOPs."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.compare import compare_sweeps, format_comparison, speed_change
from analysis.records import NOT_RUN, load_sweeps
from tests.analysis.golden.build import build_sweep, fixture

REPO = Path(__file__).resolve().parents[2]


def _after(speedup: float, extra: list[str] | None = None) -> dict:
    data = copy.deepcopy(fixture())
    for run in data["runs"]:
        if run.get("sec_per_iter") and not run.get("pending"):
            run["sec_per_iter"] = round(run["sec_per_iter"] / speedup, 2)
            run["tflops"] = round(run["tflops"] * speedup, 2)
        if extra:
            run["extra_overrides"] = extra
    # The OOM config fits after the change.
    oom = next(r for r in data["runs"] if r["name"] == "n48_dp32_tp2_oom")
    oom.update(status="ok", message=None, sec_per_iter=150.0, tflops=100.0, mem_gib=70.0)
    return data


@pytest.fixture()
def sweeps(tmp_path: Path) -> tuple[Path, Path]:
    return build_sweep(tmp_path / "before"), build_sweep(tmp_path / "after", _after(1.25))


def test_ratios_per_config(sweeps: tuple[Path, Path]) -> None:
    before, after = (load_sweeps([s], queue=None).table for s in sweeps)
    c = compare_sweeps(before, after)
    assert c.matched_on == "overrides" and c.only_before == c.only_after == 0
    ok = c.table[(c.table["outcome_before"] == "ok") & (c.table["outcome_after"] == "ok")]
    assert len(ok) == 5
    # 207.92 s -> round(207.92 / 1.25, 2) = 166.34 s: ratio 0.800 (+- rounding of the fixture).
    assert ok["sec_ratio"].tolist() == pytest.approx([0.8] * 5, abs=1e-4)
    assert ok["tflops_ratio"].tolist() == pytest.approx([1.25] * 5, abs=1e-3)
    assert c.sec_ratio_geomean == pytest.approx(0.8, abs=1e-4)
    fixed = c.table[c.table["outcome_before"] == "oom"].iloc[0]
    assert fixed["outcome_after"] == "ok" and fixed["sec_after"] == 150.0
    text = format_comparison(c, before="before", after="after")
    # 1.25x the speed: 25% faster, as the recommendation's margin reads (not 1 - 0.8 = 20%).
    assert "Sec/it x0.800 (25.0% faster)" in text
    assert re.search(r"\|\s+OOM \|", text), text


def test_a_run_that_did_not_finish_gets_no_ratio_and_stays_out_of_the_mean(tmp_path: Path) -> None:
    # After the change, DP=4 PP=12 timed out: its record keeps the medians of the iterations it
    # measured (400 s/it), as the trainer writes them. That is no finished run's figure: no ratio
    # beside "timeout", and the geometric mean stays that of the configs ok on both sides.
    data = _after(1.25)
    late = next(r for r in data["runs"] if r["name"] == "n48_pp12_mbs2")
    late.update(status="timeout", message="TrainingTimeout: a collective did not finish", sec_per_iter=400.0)
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    after = load_sweeps([build_sweep(tmp_path / "a", data)], queue=None).table
    # The table shows that run's figures marked partial (the golden sweep's own timeout measured none):
    # compare does not use them.
    assert after.loc[after["sec_per_iter"] == 400.0, ["outcome", "partial"]].values.tolist() == [["timeout", True]]
    c = compare_sweeps(before, after)
    row = c.table[c.table["outcome_after"] == "timeout"].iloc[0]
    assert row["dp"] == 4 and row["pp"] == 12 and row["sec_after"] == 400.0
    # compare.csv carried 400 s/it with nothing to say it was partial (results.csv had `partial`).
    assert (row["partial_before"], row["partial_after"]) == (False, True)
    assert not c.table.loc[c.table["outcome_after"] == "ok", ["partial_before", "partial_after"]].to_numpy().any()
    assert pd.isna(row["sec_ratio"]) and pd.isna(row["tflops_ratio"])
    assert c.sec_ratio_geomean == pytest.approx(0.8, abs=1e-4)
    assert c.tflops_ratio_geomean == pytest.approx(1.25, abs=1e-3)
    line = next(ln for ln in format_comparison(c, before="b", after="a").splitlines() if "parallelism.pp=12 " in ln)
    cells = [cell.strip() for cell in line.split("|")]
    assert cells[8:11] == ["timeout", "", ""], cells  # Sec/it after, ratio, change


@pytest.mark.parametrize(
    ("ratio", "text"),
    [
        (0.122, "8.2x faster"),  # the tester's CPU -> GPU comparison: 1 - 0.122 read "+87.8% faster"
        (0.8, "25.0% faster"),
        (1.25, "25.0% slower"),
        (3.0, "3.0x slower"),
        (0.5, "2.0x faster"),
        (1.0, "no change"),
    ],
)
def test_speed_change_is_the_slower_over_the_faster(ratio: float, text: str) -> None:
    assert speed_change(ratio) == text


def test_a_large_speed_up_reads_as_a_factor(tmp_path: Path) -> None:
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    after = load_sweeps([build_sweep(tmp_path / "a", _after(8.2))], queue=None).table
    text = format_comparison(compare_sweeps(before, after), before="b", after="a")
    assert "Sec/it x0.122 (8.2x faster)" in text and "% faster" not in text


def test_falls_back_to_layout_when_overrides_differ(tmp_path: Path) -> None:
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    after = load_sweeps([build_sweep(tmp_path / "a", _after(2.0, ["cluster.env.NCCL_ALGO=Tree"]))], queue=None).table
    c = compare_sweeps(before, after)
    assert c.matched_on == "layout" and len(c.table) == 10
    assert compare_sweeps(before, after, match="overrides").table.empty


def test_runs_of_one_config_are_pooled_and_a_change_inside_the_noise_is_flagged(tmp_path: Path) -> None:
    # Before, DP=4 PP=12 ran twice (161.96 and 170.00 s/it: median 165.98, 3.4% CV across the runs);
    # after, once at 163.00. The 1.8% gain is inside that noise; the fastest duplicate alone
    # (161.96) would have read as a slow-down with no noise at all.
    data = copy.deepcopy(fixture())
    first = next(r for r in data["runs"] if r["name"] == "n48_pp12_mbs2")
    again = copy.deepcopy(first)
    again.update(name="again", sec_per_iter=170.0, tflops=first["tflops"] * 161.96 / 170.0)  # the same work
    data["runs"].append(again)
    after = copy.deepcopy(fixture())
    next(r for r in after["runs"] if r["name"] == "n48_pp12_mbs2")["sec_per_iter"] = 163.0
    c = compare_sweeps(
        load_sweeps([build_sweep(tmp_path / "b", data)], queue=None).table,
        load_sweeps([build_sweep(tmp_path / "a", after)], queue=None).table,
    )
    row = c.table[c.table["pp"] == 12].iloc[0]
    assert (row["runs_before"], row["runs_after"], row["sec_before"]) == (2, 1, pytest.approx(165.98))
    # Its TFLOPs are one iteration's work over that median time, not the median of the runs' own.
    assert row["tflops_before"] == pytest.approx(first["tflops"] * 161.96 / 165.98)
    across = 100 * float(np.std([161.96, 170.0], ddof=1) / 165.98)
    assert row["noise_pct"] == pytest.approx(across) and bool(row["within_noise"])
    unchanged = c.table[(c.table["pp"] == 6) & (c.table["outcome_before"] == "ok")].iloc[0]
    assert unchanged["runs_before"] == 1 and not unchanged["within_noise"]  # no change, no noise: not flagged
    assert c.pooled == 1
    text = format_comparison(c, before="b", after="a")
    assert "1 config(s) ran more than once on a side: their runs are pooled" in text
    assert "1.8% faster, within noise (3.4%)" in text and re.search(r"\|\s+2 / 1 \|", text), text
    assert "1 of 5 change(s) are within the noise" in text


def test_layout_matches_read_as_layouts_with_readable_labels(tmp_path: Path) -> None:
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    data = _after(2.0, ["cluster.env.NCCL_ALGO=Tree"])
    data["runs"] = [r for r in data["runs"] if r["name"] != "n40_pp10_mbs2"]
    after = load_sweeps([build_sweep(tmp_path / "a", data)], queue=None).table
    c = compare_sweeps(before, after)
    assert c.matched_on == "layout" and c.only_before == 1 and c.only_after == 0
    text = format_comparison(c, before="b", after="a")
    assert "9 layout(s) matched by layout; 1 layout(s) only in b, 0 layout(s) only in a." in text
    label = (
        "bloom_200b_l80_h14400 on a100_80gb, GBS=2048 DP=4 TP=8 PP=10 MBS=2 ZeRO=1 offload=none "
        "recompute=full precision=bf16 engine=native"
    )
    assert f"Only in b (1 layout(s)):\n- {label}\n" in text
    assert "a100_80gb|" not in text and "\\|" not in text
    assert "| bloom_200b_l80_h14400 on a100_80gb, GBS=2048 DP=4 TP=8 PP=11 MBS=2 ZeRO=1" in text


def test_the_same_layouts_at_another_sequence_length_are_not_matched(tmp_path: Path) -> None:
    # The after sweep trains the same model at half the sequence (model.seq_length=1024): its
    # overrides differ, so layouts were matched, and the shorter sequence's shorter iterations read
    # as "2.0x faster" (the recommendation keeps sequence lengths apart as other work).
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    data = _after(2.0, ["model.seq_length=1024"])
    data["model"] = {**data["model"], "seq_length": 1024}
    after = load_sweeps([build_sweep(tmp_path / "a", data)], queue=None).table
    c = compare_sweeps(before, after)
    assert c.matched_on == "layout" and c.table.empty and c.sec_ratio_geomean is None
    text = format_comparison(c, before="b", after="a")
    assert "0 layout(s) matched by layout" in text and "No layout appears in both sweeps." in text
    assert "Only in a (10 layout(s), the first 5):\n- bloom_200b_l80_h14400 on a100_80gb, GBS=" in text
    assert "engine=native seq=1024" in text
    assert "engine=native seq=2048" in text
    # At one sequence length the same layouts still match, their labels as before (no seq=).
    same = compare_sweeps(before, load_sweeps([build_sweep(tmp_path / "c", _after(2.0, ["x=1"]))], queue=None).table)
    assert same.matched_on == "layout" and len(same.table) == 10 and not same.table["label"].str.contains("seq=").any()


def test_the_same_layouts_of_a_narrower_model_of_one_name_are_not_matched(tmp_path: Path) -> None:
    # The after sweep overrides model.hidden_size=7200 (a quarter of the parameters, 3x faster per
    # iteration): layouts were matched across the two shapes and read as "Sec/it x0.333 (3.0x faster)".
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    data = _after(3.0, ["model.hidden_size=7200", "model.num_attention_heads=48"])
    data["model"] = {**data["model"], "hidden_size": 7200, "num_attention_heads": 48}
    for run in data["runs"]:
        run["params"] = None
    after = load_sweeps([build_sweep(tmp_path / "a", data)], queue=None).table
    c = compare_sweeps(before, after)
    assert c.matched_on == "layout" and c.table.empty and c.sec_ratio_geomean is None
    text = format_comparison(c, before="b", after="a")
    assert "engine=native size=203B" in text and "engine=native size=51.6B" in text


def test_compare_cli(sweeps: tuple[Path, Path], tmp_path: Path) -> None:
    before, after = sweeps
    proc = subprocess.run(
        [sys.executable, "-m", "analysis", "compare", str(before), str(after), "-o", str(tmp_path / "cmp"), "--no-queue"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "10 config(s) matched by overrides" in proc.stdout
    assert (tmp_path / "cmp" / "compare.md").is_file() and (tmp_path / "cmp" / "compare.csv").is_file()


def test_runs_with_and_without_sequence_parallelism_are_other_layouts() -> None:
    # records' layout_key leaves SP and interleaving out; pooled together, an SP run and one without
    # would read as one layout whose gap is noise (the recommendation keeps them apart too).
    from analysis.compare import _with_layouts

    df = pd.DataFrame({"layout_key": ["k", "k", "k", ""],
                       "config.parallelism.sequence_parallel": [True, False, False, False],
                       "config.parallelism.virtual_stages": [1, 1, 2, 1]})  # fmt: skip
    keys = list(_with_layouts(df)["layout_key"])
    assert len(set(keys[:3])) == 3 and keys[3] == ""


def test_layouts_match_when_only_one_side_has_configs_without_a_record(tmp_path: Path) -> None:
    # The fixture's skipped and pending configs have no record, so their sweep holds
    # virtual_stages as floats (1.0); a sweep whose every config ran holds ints (1). Keyed as
    # str(1.0) against str(1), `compare` found no layout in both (a real slurm sweep with a skipped
    # config against a local sweep of the same layouts).
    data = _after(2.0, ["cluster.env.NCCL_ALGO=Tree"])
    data["runs"] = [r for r in data["runs"] if r.get("status") != "skipped" and not r.get("pending")]
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    after = load_sweeps([build_sweep(tmp_path / "a", data)], queue=None).table
    c = compare_sweeps(before, after)
    assert c.matched_on == "layout" and c.only_after == 0 and len(c.table) == len(data["runs"])


def test_the_same_overrides_that_ran_other_work_are_not_compared(tmp_path: Path) -> None:
    # The after sweep has the same overrides, but its model file trains at half the sequence (a changed
    # conf/model yaml, another --config-dir): matched by overrides, every config read "2.0x faster".
    data = _after(2.0)
    data["model"] = {**data["model"], "seq_length": 1024}
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    after = load_sweeps([build_sweep(tmp_path / "a", data)], queue=None).table
    c = compare_sweeps(before, after)
    assert c.matched_on == "overrides" and c.sec_ratio_geomean is None, c.table
    ran = int((~before["outcome"].isin(NOT_RUN)).sum())  # the skipped config too: planned at the other length
    assert len(c.other_work_labels) == ran and c.table.empty
    text = format_comparison(c, before="b", after="a")
    assert f"Not compared: the same overrides ran other work in the two sweeps (another layout, sequence length or model shape) ({ran} config(s)" in text


def test_a_config_not_run_yet_on_one_side_is_not_called_missing_from_it(tmp_path: Path) -> None:
    # Two configs of the after sweep still wait in the queue: "2 config(s) only in before" said they
    # were not in the after sweep at all.
    data = _after(1.25)
    waiting = [r for r in data["runs"] if r.get("status", "ok") == "ok" and not r.get("pending")][:2]
    for run in waiting:
        run["pending"] = True
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    after = load_sweeps([build_sweep(tmp_path / "a", data)], queue=None).table
    c = compare_sweeps(before, after)
    assert c.only_before == c.only_after == 0 and len(c.not_run_after_labels) == 2
    assert "Ran in b, not run yet in a (pending or planned there) (2 config(s)):" in format_comparison(c, before="b", after="a")


def test_configs_without_a_known_layout_are_not_one_pooled_layout(tmp_path: Path) -> None:
    # Killed before their records (no result.json, no plan row): their empty layout fields made one
    # key, "|||...", so layout matching pooled three different configs into one row labelled ",".
    killed = ("n48_pp12_mbs2", "n48_dp32_tp2_oom", "n48_pp10_mbs4")
    data = _after(1.25, ["cluster.env.NCCL_ALGO=Tree"])
    before = load_sweeps([_without_plan(build_sweep(tmp_path / "b", drop=killed))], queue=FAILED).table
    after = load_sweeps([_without_plan(build_sweep(tmp_path / "a", data, drop=killed))], queue=FAILED).table
    assert (before["layout_key"] == "").sum() == 3  # ended, no record, no plan row
    c = compare_sweeps(before, after)
    assert c.matched_on == "layout" and c.pooled == 0 and (c.table["label"] != ",").all(), c.table


def FAILED(job_ids: Sequence[str]) -> dict[str, str]:  # noqa: N802 - a queue lookup, as records takes one
    """Slurm's word for every job: each run without a record ended FAILED."""
    return {j: "FAILED" for j in job_ids}


def _without_plan(sweep: Path) -> Path:
    (sweep / "plan.csv").unlink()
    return sweep


def test_the_layout_columns_come_from_whichever_side_ran(tmp_path: Path) -> None:
    # A config ok before and killed without a record after showed empty DP/TP/PP/MBS/GBS.
    before = load_sweeps([build_sweep(tmp_path / "b")], queue=None).table
    after = load_sweeps([_without_plan(build_sweep(tmp_path / "a", _after(1.25), drop=("n48_pp12_mbs2",)))], queue=FAILED).table
    c = compare_sweeps(before, after)
    row = c.table[c.table["config"].str.contains("parallelism.pp=12")].iloc[0]
    assert row["outcome_after"] == "fail"
    assert (row["dp"], row["tp"], row["pp"], row["gbs"]) == (4, 8, 12, 2048), row


def test_compare_cli_errors_and_integer_counts(sweeps: tuple[Path, Path], tmp_path: Path) -> None:
    before, after = sweeps

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "analysis", "compare", *args, "--no-queue"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip

    # Every compare error ended "; did you mean python -m analysis compare?" (its own first argument).
    missing = cli(str(tmp_path / "nowhere"), str(after))
    assert missing.returncode == 2 and "did you mean" not in missing.stderr, missing.stderr
    assert cli(str(before), str(after), "-o", str(tmp_path / "cmp")).returncode == 0
    rows = pd.read_csv(tmp_path / "cmp" / "compare.csv", dtype=str)
    assert rows.columns[rows.columns.get_loc("outcome_after") + 1:][:2].tolist() == ["partial_before", "partial_after"]
    # Counts are whole numbers in every CSV file (README), not "8.0".
    assert rows["dp"].dropna().str.fullmatch(r"\d+").all() and rows["gbs"].dropna().str.fullmatch(r"\d+").all()
