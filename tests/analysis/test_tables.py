"""results.md against the golden file, cell formats as the seeds write them, and seed-004 scaling and
ZeRO comparison tables."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from analysis.recommend import recommend, recommendation_text
from analysis.records import load_sweeps, write_results_csv
from analysis.tables import (
    SEED_COLUMNS,
    format_err,
    format_mem,
    format_sec,
    format_size,
    format_tflops,
    results_markdown,
    results_table,
    scaling_frame,
    scaling_markdown,
    sort_results,
    summary_line,
    varying_overrides,
    zero_frame,
    zero_markdown,
)
from tests.analysis.golden.build import (
    EXPECTED_MD,
    GOLDEN,
    build_sweep,
    fixture,
    predicted_sweep_data,
    stopped_sweep_data,
)
from train.contract import write_json_atomic


def _markdown(sweep: Path) -> str:
    loaded = load_sweeps([sweep], queue=None)
    df = loaded.table
    return results_markdown(
        df,
        labels=loaded.labels,
        recommendation=recommendation_text(df, recommend(df)),
        scaling=scaling_markdown(scaling_frame(df)),
        zero=zero_markdown(zero_frame(df)),
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
    assert format_err(0.1234) == "+12.3%" and format_err(-0.05) == "-5.0%" and format_err(-1e-9) == "+0.0%"
    assert format_err(float("nan")) == ""


def test_varying_overrides_go_to_notes(tmp_path: Path) -> None:
    data = copy.deepcopy(fixture())
    data["runs"] = data["runs"][:2]
    data["runs"][1]["extra_overrides"] = ["cluster.env.NCCL_ALGO=Tree"]
    table = results_table(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    assert table["Notes"].tolist() == ["02-20; cluster.env.NCCL_ALGO=Tree", "02-20"]


def test_an_override_with_its_own_column_shows_in_notes_where_that_column_is_blank() -> None:
    # The second config never composed (tp=abc): its TP cell is blank, so Notes keep parallelism.tp.
    df = pd.DataFrame({
        "overrides": [["parallelism.tp=2", "parallelism.pp=2"], ["parallelism.tp=abc", "parallelism.pp=2"]],
        "dp": [1.0, np.nan], "tp": [2.0, np.nan], "pp": [2.0, np.nan], "mbs": [1.0, np.nan], "gbs": [8.0, np.nan],
    })  # fmt: skip
    assert varying_overrides(df).tolist() == ["", "parallelism.tp=abc parallelism.pp=2"]


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


def test_runs_that_do_not_say_their_nodes_get_a_column_per_device_count(tmp_path: Path) -> None:
    # Records copied out of their sweep, without Slurm's node count or a whole layout: two scales of
    # one layout must stay two columns (they both read "*" as nodes*per node, and the table failed).
    df = _scaling_sweep(tmp_path)
    df.loc[df["nodes"].isin((4, 8)), "nodes"] = float("nan")
    frame = scaling_frame(df)
    assert frame["scale"].tolist() == ["1*8", "32 devices", "64 devices", "16*8", "32*8"]
    md = scaling_markdown(frame)
    assert md is not None
    header, _, row = md.splitlines()[:3]
    assert header.index("1*8") < header.index("32 devices") < header.index("64 devices") < header.index("16*8")
    assert "6558.31 samples/s" in row and "12442.73 samples/s" in row


def test_a_run_without_a_layout_is_no_row_of_the_scaling_table(tmp_path: Path) -> None:
    # A config that failed before its record in a sweep without a dry run's plan of it (a local run
    # refused by its device): no model, degrees or size. It made a row of blanks, and every variant's
    # label then named each field it seemed to vary.
    df = _scaling_sweep(tmp_path)
    blank = df.iloc[[-1]].copy()
    for name in ("model", "tp", "pp", "mbs", "dp", "devices", "nodes", "seq_length"):
        blank[name] = "" if name == "model" else float("nan")
    blank["outcome"], blank["run_dir"] = "fail", "killed"
    frame = scaling_frame(pd.concat([df, blank], ignore_index=True))
    assert frame.equals(scaling_frame(df)), frame


def test_no_scaling_table_for_one_scale(tmp_path: Path) -> None:
    df = _scaling_sweep(tmp_path)
    assert scaling_markdown(scaling_frame(df[df["nodes"] == 4])) is None


# ---------------------------------------------------------------------------------------------
# ZeRO comparison (seed 004's "Number of samples trained per second" tables)

GBS = 8192
ZERO_MD = GOLDEN / "zero.md"


def _zero_run(name: str, nodes: int, tp: int, engine: str = "native", zero: int = 0, offload: str = "none",
              sps: float | None = None, tflops: float | None = None, status: str = "ok",
              mbs: int = 4) -> dict[str, Any]:
    devices = 8 * nodes
    layout = {"dp": devices // tp, "tp": tp, "pp": 1, "mbs": mbs, "gbs": GBS,
              "engine": engine, "zero_stage": zero, "offload": offload}
    run = {"name": name, "nodes": nodes, "layout": layout, "params": 345_000_000, "status": status}
    if status == "ok":
        assert sps is not None
        run.update(sec_per_iter=GBS / sps, tflops=tflops, mem_gib=30.0)
    else:
        run["message"] = {"oom": "OutOfMemoryError", "nan": "loss became NaN", "timeout": "TrainingTimeout"}.get(
            status, "RuntimeError: boom")
    return run


def _zero_sweep(tmp_path: Path) -> pd.DataFrame:
    return load_sweeps([zero_sweep_dir(tmp_path / "zero")], queue=None).table


def zero_sweep_dir(root: Path) -> Path:
    """A sweep of seed 004's figures (megatron bert 345m on 1*8 and 4*8) plus the rows megasweep adds.

    Seed rows: (mp=1), (mp=2), (mp=1/2) with deepspeed zero3, (mp=1) with deepspeed zero3+offload.
    Added: native ZeRO-1 (megasweep's own), a params offload that timed out, failures of every kind,
    and a second run of one cell (a smaller micro-batch, slower) that the table must not show.
    """
    data = copy.deepcopy(fixture())
    data["model"] = {"name": "bert_345m", "kind": "bert", "num_layers": 24, "hidden_size": 1024,
                     "num_attention_heads": 16, "seq_length": 512, "vocab_size": 30522}
    data["runs"] = [
        _zero_run("ds3_mp1_n1", 1, 1, "deepspeed", 3, sps=349.86, tflops=0.72),
        _zero_run("ds3_mp1_n4", 4, 1, "deepspeed", 3, sps=1001.94, tflops=0.52),
        _zero_run("ds3_mp2_n1", 1, 2, "deepspeed", 3, sps=188.90, tflops=0.39),
        _zero_run("ds3_mp2_n4", 4, 2, "deepspeed", 3, sps=373.29, tflops=0.22),
        _zero_run("ds3off_mp1_n1", 1, 1, "deepspeed", 3, offload="optimizer", sps=318.70, tflops=0.59),
        _zero_run("ds3off_mp1_n4", 4, 1, "deepspeed", 3, offload="optimizer", status="oom"),
        _zero_run("ds3par_mp1_n1", 1, 1, "deepspeed", 3, offload="params", status="timeout"),
        _zero_run("ds1_mp1_n1", 1, 1, engine="deepspeed", zero=1, status="nan"),
        _zero_run("native_mp1_n1", 1, 1, sps=1658.93, tflops=2.94),
        _zero_run("native_mp1_n4", 4, 1, sps=6558.31, tflops=2.91),
        _zero_run("native_mp1_n4_mbs2", 4, 1, sps=6000.00, tflops=2.66, mbs=2),
        _zero_run("native_mp2_n1", 1, 2, sps=895.04, tflops=1.60),
        _zero_run("native_mp2_n4", 4, 2, status="error"),
        _zero_run("z1_mp1_n1", 1, 1, zero=1, sps=1702.55, tflops=3.02),
    ]
    return build_sweep(root, data)


def test_zero_table_against_the_golden_file(tmp_path: Path) -> None:
    md = zero_markdown(zero_frame(_zero_sweep(tmp_path)))
    assert md is not None
    assert md + "\n" == ZERO_MD.read_text()


def test_zero_rows_are_labelled_and_ordered_as_the_seed(tmp_path: Path) -> None:
    frame = zero_frame(_zero_sweep(tmp_path))
    # Baseline first, then native ZeRO-1, then DeepSpeed by stage and offload; mp within each.
    assert frame["variant"].drop_duplicates().tolist() == [
        "bert_345m (mp=1)",
        "bert_345m (mp=2)",
        "bert_345m (mp=1) with native zero1",
        "bert_345m (mp=1) with deepspeed zero1",
        "bert_345m (mp=1) with deepspeed zero3",
        "bert_345m (mp=2) with deepspeed zero3",
        "bert_345m (mp=1) with deepspeed zero3+offload(optimizer)",
        "bert_345m (mp=1) with deepspeed zero3+offload(params)",
    ]
    assert frame["scale"].unique().tolist() == ["1*8", "4*8"]
    # One row per (variant, scale) that ran: 14 runs, one cell held two of them.
    assert len(frame) == 13 and not frame.duplicated(["variant", "scale"]).any()


def test_zero_cell_keeps_the_fastest_run(tmp_path: Path) -> None:
    frame = zero_frame(_zero_sweep(tmp_path)).set_index(["variant", "scale"])
    cell = frame.loc[("bert_345m (mp=1)", "4*8")]
    assert cell["samples_per_s"] == pytest.approx(6558.31) and cell["tflops"] == pytest.approx(2.91)


def test_zero_failures_show_their_outcome(tmp_path: Path) -> None:
    md = zero_markdown(zero_frame(_zero_sweep(tmp_path)))
    assert md is not None
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.splitlines()[2:] if line.startswith("|")}
    assert rows["bert_345m (mp=1) with deepspeed zero3+offload(optimizer)"] == [
        "318.70 samples/sec  0.59 tflops/dev", "OOM"]
    assert rows["bert_345m (mp=1) with deepspeed zero3+offload(params)"] == ["timeout", ""]
    assert rows["bert_345m (mp=1) with deepspeed zero1"] == ["NaN", ""]
    assert rows["bert_345m (mp=2)"] == ["895.04 samples/sec  1.60 tflops/dev", "fail"]


def test_zero_table_renders_for_one_scale(tmp_path: Path) -> None:
    df = _zero_sweep(tmp_path)
    md = zero_markdown(zero_frame(df[df["nodes"] == 1]))
    assert md is not None
    header = md.splitlines()[0]
    assert "1*8" in header and "4*8" not in header
    # scaling_markdown, by contrast, has nothing to say about one scale.
    assert scaling_markdown(scaling_frame(df[df["nodes"] == 1])) is None


def test_no_zero_table_when_nothing_varies(tmp_path: Path) -> None:
    # The golden BLOOM sweep: every run native ZeRO-1, no offload.
    golden = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    assert zero_frame(golden).empty and zero_markdown(zero_frame(golden)) is None
    # (test_golden_results_md renders it as the CLI does: results.md has no ZeRO section.)
    # One DeepSpeed setting only (layouts and scales vary, the engine does not): nothing to compare.
    df = _zero_sweep(tmp_path)
    ds3 = df[(df["config.parallelism.engine"] == "deepspeed") & (df["config.parallelism.zero_stage"] == 3)
             & (df["config.parallelism.offload"] == "none")]
    assert len(ds3) == 4 and zero_frame(ds3).empty


def test_zero_table_when_only_offload_varies(tmp_path: Path) -> None:
    df = _zero_sweep(tmp_path)
    ds3_mp1 = df[(df["config.parallelism.engine"] == "deepspeed") & (df["config.parallelism.zero_stage"] == 3)
                 & (df["tp"] == 1)]
    assert zero_frame(ds3_mp1)["variant"].drop_duplicates().tolist() == [
        "bert_345m (mp=1) with deepspeed zero3",
        "bert_345m (mp=1) with deepspeed zero3+offload(optimizer)",
        "bert_345m (mp=1) with deepspeed zero3+offload(params)",
    ]


def test_zero_section_in_results_md(tmp_path: Path) -> None:
    df = _zero_sweep(tmp_path)
    zero = zero_markdown(zero_frame(df))
    md = results_markdown(df, labels=["zero"], recommendation="-", zero=zero)
    assert zero is not None and f"## ZeRO comparison\n\n{zero}\n\n## Missing" in md


def test_zero_cells_of_a_cpu_run_stay_numbers() -> None:
    # A tiny model on CPU: 2.8e-05 TFLOP/s per device would print as 0.00 with the seed's two decimals.
    frame = pd.DataFrame({
        "variant": ["tiny (mp=1)", "tiny (mp=1) with deepspeed zero1"], "scale": ["1*2", "1*2"],
        "nodes": [1, 1], "devices": [2, 2], "outcome": ["ok", "ok"],
        "samples_per_s": [2.107, 74.8154], "tflops": [2.8166e-05, 0.0010002],
    })
    md = zero_markdown(frame)
    assert md is not None
    assert "2.11 samples/sec  2.82e-05 tflops/dev" in md and "74.82 samples/sec  1.00e-03 tflops/dev" in md


def test_zero_setting_of_a_run_without_record_comes_from_its_overrides(tmp_path: Path) -> None:
    # A job Slurm ended before it wrote result.json: no config columns, its overrides name the engine.
    df = _zero_sweep(tmp_path)
    lost = df.iloc[[0]].copy()
    for c in ("config.parallelism.engine", "config.parallelism.zero_stage", "config.parallelism.offload"):
        lost[c] = float("nan")
    lost["overrides"] = [["parallelism.engine=deepspeed", "parallelism.zero_stage=2",
                          "parallelism.offload=optimizer"]]
    lost["outcome"], lost["samples_per_s"] = "oom", float("nan")
    frame = zero_frame(pd.concat([df, lost], ignore_index=True))
    row = frame[frame["variant"] == "bert_345m (mp=1) with deepspeed zero2+offload(optimizer)"]
    assert row["outcome"].tolist() == ["oom"]
    # Without any trace of its engine setting the run cannot be placed: it is left out.
    lost["overrides"] = [[]]
    assert len(zero_frame(pd.concat([df, lost], ignore_index=True))) == len(zero_frame(df))


def test_pred_and_err_columns_beside_the_measurement(tmp_path: Path) -> None:
    factors = [1.2, 0.9, 1.0, 1.5, 1.1]
    data, predicted = predicted_sweep_data(factors)
    df = load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table
    table = results_table(df)
    assert list(table.columns) == list(SEED_COLUMNS)
    measured = [run["sec_per_iter"] for run in data["runs"]]
    # Err is the prediction's error, predicted / measured - 1: a run measured at 1.2x its prediction
    # was predicted 16.7% too fast (-16.7%), as calibrate and the GPU report write it.
    expected = {format_sec(m): (format_sec(p), format_err(p / m - 1)) for m, p in zip(measured, predicted, strict=True)}
    assert {row["Sec/it"]: (row["Pred s/it"], row["Err"]) for _, row in table.iterrows()} == expected
    assert sorted(table["Err"]) == sorted(format_err(1 / f - 1) for f in factors)
    assert "-16.7%" in table["Err"].tolist() and "+11.1%" in table["Err"].tolist()
    # Every run predicted: no 'n/a' and no note saying why.
    assert "n/a" not in _markdown(tmp_path / "s")


def test_the_missing_table_says_why_an_exported_config_has_no_job(tmp_path: Path) -> None:
    # `pending` beside an empty Job cell, where status said "no job started yet (exported to ...)".
    from analysis.tables import missing_markdown
    from train.contract import ManifestEntry, write_manifest

    sweep = tmp_path / "s"
    sweep.mkdir()
    write_manifest([ManifestEntry(i, ("model=tiny", f"training.lr={lr}"), str(i), "exported",
                                  f"exported to /x/lr.sbatch, array task {i}") for i, lr in enumerate(("1e-4", "2e-4"))],
                   sweep / "manifest.jsonl")  # fmt: skip
    lines = missing_markdown(load_sweeps([sweep], queue=None).table).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")][-2:] == ["Overrides", "Why"], lines[0]
    for i in (0, 1):
        assert lines[2 + i].startswith("| pending |") and lines[2 + i].rstrip().endswith(
            f"| no job started yet (exported to /x/lr.sbatch, array task {i}) |"), lines[2 + i]
    # A Slurm job's pending row has its job and state, and no Why column (the golden sweep's).
    golden = missing_markdown(load_sweeps([build_sweep(tmp_path / "g")], queue=None).table)
    assert "Why" not in golden.splitlines()[0]


def test_console_listings_are_bounded_and_say_where_the_rest_is(tmp_path: Path) -> None:
    from analysis.tables import missing_markdown, planned_markdown

    sweep = build_sweep(tmp_path / "s", drop=("n48_pp6_mbs2", "n40_pp10_mbs2"))
    df = load_sweeps([sweep], queue=None).table
    pending = int((df["outcome"] == "pending").sum())
    assert pending == 3
    shown = missing_markdown(df, limit=1).splitlines()
    assert len(shown) == 2 + 1 + 1 and shown[-1] == f"... {pending - 1} more in results.md"
    assert "more in" not in missing_markdown(df)
    assert planned_markdown(df) == ""  # launched configs are never 'planned'
    (sweep / "manifest.jsonl").unlink()
    unlaunched = load_sweeps([sweep], queue=None).table
    planned = planned_markdown(unlaunched, limit=2).splitlines()
    assert planned[0].startswith("| Nodes |") and "Pred sec/it" in planned[0]
    assert len(planned) == 2 + 2 + 1 and planned[-1] == "... 1 more in results.csv"


def test_planned_configs_of_several_works_are_listed_work_by_work_each_fastest_in_turn(tmp_path: Path) -> None:
    # Ranked over all, the 350M model's ten fastest layouts took every place of a table of ten, and the
    # 13B model's fastest was not in it (the dry run's console shows each work's in turn).
    from analysis.tables import planned_markdown
    from tests.launchers.test_plan import run_train

    sweep = tmp_path / "plan"
    planned = run_train("-m", "model=gpt_350m,gpt_13b", "hardware=a100_80gb", "parallelism.tp=1,2,4,8",
                        "parallelism.pp=1,2,4", "parallelism.dp=8", "parallelism.micro_batch_size=1,2,4",
                        "parallelism.global_batch_size=512", "hydra/launcher=plan", "hydra.launcher.table=false",
                        f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    df = load_sweeps([sweep], queue=None).table
    every = planned_markdown(df, limit=None).splitlines()[2:]
    shown = planned_markdown(df, limit=4).splitlines()
    assert shown[-1].startswith("... ") and "each slower than its work's shown ones or unpredicted" in shown[-1]
    def model(line: str) -> str:
        return next(word for word in line.split() if word.startswith("model="))

    rows = shown[2:-1]
    models, preds = [model(line) for line in rows], [float(line.split("|")[9]) for line in rows]
    # Two of each, the smaller's first (its fastest is the faster), each work's fastest first.
    assert models == ["model=gpt_350m"] * 2 + ["model=gpt_13b"] * 2, models
    assert preds[0] <= preds[1] and preds[2] <= preds[3] and preds[0] < preds[2]
    # A limit below the works' count names the works it leaves without a row.
    one = planned_markdown(df, limit=1).splitlines()[-1]
    assert "(1 work(s) have no row here)" in one, one
    # They are each work's two fastest: its first rows in the whole listing.
    for name in set(models):
        assert [line for line in rows if model(line) == name] == [line for line in every if model(line) == name][:2]


def test_err_has_the_sign_of_calibrate_and_the_gpu_report() -> None:
    # The H100 record call4 gpt_1.3b mbs 8 none gbs 32: 1.278 s/it measured, 0.996 predicted. REPORT.md
    # and `python -m analysis calibrate` print -22.1% (predicted too fast); results.md printed +28.4%.
    from analysis.tables import prediction_error

    runs = pd.DataFrame({"sec_per_iter": [1.278, 2.0, float("nan"), 1.0], "pred_sec_per_iter": [0.996, 2.5, 1.0, 0.0]})
    err = prediction_error(runs)
    assert format_err(err.iloc[0]) == "-22.1%" and format_err(err.iloc[1]) == "+25.0%"
    assert err.iloc[2:].isna().all()


def test_footnote_states_the_mfu_peaks_and_their_source(tmp_path: Path) -> None:
    # The footnote said only "MFU = TFLOPs / peak": which peak, datasheet or measured, was not said.
    from analysis.tables import peak_summary

    md = _markdown(build_sweep(tmp_path / "s"))
    assert "MFU = TFLOPs / peak (a100_80gb bf16: 312 TFLOP/s, datasheet)." in md
    runs = pd.DataFrame({
        "outcome": ["ok", "ok", "ok", "oom"], "hardware": ["cpu", "cpu", "h100_sxm", "a100_80gb"],
        "precision": ["fp32", "fp32", "bf16", "bf16"], "peak_source": ["measured", "measured", "datasheet", None],
        "peak_tflops": [0.51, 0.73, 989.4, 312.0],
    })  # fmt: skip
    # Per hardware and precision; a measured peak as the range the runs measured; failed runs' peaks left out.
    assert peak_summary(runs) == "cpu fp32: 0.51-0.73 TFLOP/s, measured; h100_sxm bf16: 989.4 TFLOP/s, datasheet"
    assert peak_summary(runs[runs["outcome"] == "oom"]) == "no finished run recorded its peak"
    # An fp32 run on a tensor-core GPU divides by TF32's peak (hardware.tf32): said so; a CPU's fp32 is plain.
    tf32 = pd.DataFrame({
        "outcome": ["ok", "ok"], "hardware": ["a100_80gb", "cpu"], "precision": ["fp32", "fp32"],
        "peak_source": ["datasheet", "measured"], "peak_tflops": [156.0, 0.5], "config.hardware.tf32": [True, False],
    })  # fmt: skip
    assert peak_summary(tf32) == "a100_80gb fp32 (TF32 tensor cores): 156 TFLOP/s, datasheet; cpu fp32: 0.5 TFLOP/s, measured"


def test_a_fragmented_table_with_planned_configs_prints_no_performance_warning(tmp_path: Path) -> None:
    # A result sweep, the H100 records and a plan directory together made a table of ~200 columns in
    # more than 100 blocks; planned_markdown added columns to it, and pandas printed "DataFrame is
    # highly fragmented" on the console.
    import warnings

    from pandas.errors import PerformanceWarning

    from analysis.tables import planned_markdown

    sweep = build_sweep(tmp_path / "plan")
    (sweep / "manifest.jsonl").unlink()
    df = load_sweeps([sweep], queue=None).table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        for i in range(120):  # as many numeric blocks as records of many kinds give
            df[f"extra.{i}"] = float(i)
    assert sum(not block.is_extension for block in df._mgr.blocks) > 100
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        planned = planned_markdown(df)
        _ = results_markdown(df, labels=["plan"], recommendation="")
    assert planned.startswith("| Nodes |") and "Pred sec/it" in planned


def test_scaling_keeps_runs_of_two_global_batches_at_one_scale_apart(tmp_path: Path) -> None:
    # call4: gpt_1.3b mbs 8 at GBS 8 and GBS 32 on one device met in one cell, and the slower
    # (GBS 8) was dropped without a word. Seed 004's layout scaled out at GBS 8192, plus one GBS 2048 run.
    data = copy.deepcopy(fixture())
    runs = []
    for nodes, gbs, sps in ((1, 8192, 1658.93), (4, 8192, 6558.31), (1, 2048, 1500.0), (4, 2048, 5000.0)):
        runs.append({"name": f"n{nodes}_g{gbs}", "nodes": nodes, "params": 345_000_000, "mem_gib": 30.0,
                     "layout": {"dp": 8 * nodes, "tp": 1, "pp": 1, "mbs": 4, "gbs": gbs},
                     "sec_per_iter": gbs / sps, "tflops": 2.9})  # fmt: skip
    data["runs"] = runs
    df = load_sweeps([build_sweep(tmp_path / "gbs", data)], queue=None).table
    frame = scaling_frame(df)
    assert len(frame) == 4 and sorted(frame["gbs"].tolist()) == [2048, 2048, 8192, 8192]
    assert sorted(set(frame["variant"])) == [
        "bloom_200b_l80_h14400 (tp=1 pp=1 mbs=4) gbs=2048", "bloom_200b_l80_h14400 (tp=1 pp=1 mbs=4) gbs=8192",
    ]
    two_k = frame[frame["gbs"] == 2048]
    assert two_k["efficiency"].tolist() == pytest.approx([1.0, 5000.0 / 4 / 1500.0])
    # A GBS that only grows with the devices (weak scaling) stays one row, its scales compared.
    weak = df[((df["nodes"] == 1) & (df["gbs"] == 2048)) | ((df["nodes"] == 4) & (df["gbs"] == 8192))]
    frame = scaling_frame(weak)
    assert frame["variant"].nunique() == 1 and "gbs=" not in frame["variant"].iloc[0]


def test_scaling_keeps_two_scales_of_one_device_count_apart(tmp_path: Path) -> None:
    # 8 devices on one node and on two (4 each): one cell per device count kept the faster and
    # dropped the other, though its docstring promises a row per scale.
    data = copy.deepcopy(fixture())
    data["runs"] = [
        {"name": f"n{nodes}", "nodes": nodes, "params": 345_000_000, "mem_gib": 30.0,
         "layout": {"dp": 8, "tp": 1, "pp": 1, "mbs": 4, "gbs": 2048}, "sec_per_iter": sec, "tflops": 2.9}
        for nodes, sec in ((1, 1.0), (2, 1.25))
    ]  # fmt: skip
    frame = scaling_frame(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    assert sorted(frame["scale"].tolist()) == ["1*8", "2*4"], frame
    assert frame.set_index("scale")["samples_per_s"].to_dict() == {"1*8": 2048.0, "2*4": 2048.0 / 1.25}


def test_a_recorded_mfu_above_100_percent_is_marked_above_peak(tmp_path: Path) -> None:
    # A record whose mfu is above 1 (not this trainer's: it leaves such an MFU out, with a warning)
    # was published as "320.5%" in results.md and the recommendation, an MFU no run can reach.
    data = copy.deepcopy(fixture())
    fast = next(r for r in data["runs"] if r["name"] == "n48_pp12_mbs2")
    fast["tflops"] = 1000.0  # against a100_80gb's 312 TFLOP/s: MFU 320.5%
    md = _markdown(build_sweep(tmp_path / "s", data))
    row = next(line for line in md.splitlines() if line.startswith("|") and "| 161.96 |" in line)
    assert "| 321% (above peak) |" in row and "320.5%" not in md
    assert "1000.00 TFLOPs/device, MFU 321% (above peak) [s/runs/3]" in md
    # MFUs up to 100% read as before.
    assert [c.strip() for c in md.split("| 172.36 |")[1].split("|")][3:5] == ["98.43", "31.5%"]


def test_scaling_keeps_one_model_at_two_sequence_lengths_or_widths_apart(tmp_path: Path) -> None:
    # Two sweeps of one model name and layouts, the second at sequence 1024 (or half the width), 2x
    # faster: their runs met in one cell of the scaling table, which kept the faster as the
    # layout's figure (29.55 samples/s for the full model at 40*8) without a word.
    a = build_sweep(tmp_path / "a")
    for name, override, model in (
        ("short", "model.seq_length=1024", {"seq_length": 1024}),
        ("narrow", "model.hidden_size=7200", {"hidden_size": 7200, "num_attention_heads": 48}),
    ):
        data = copy.deepcopy(fixture())
        data["model"] = {**data["model"], **model}
        for run in data["runs"]:
            run["extra_overrides"] = [override]
            if run.get("sec_per_iter"):
                run["sec_per_iter"] /= 2
        df = load_sweeps([a, build_sweep(tmp_path / name, data)], queue=None).table
        frame = scaling_frame(df)
        cell = frame[frame["variant"].str.startswith("bloom_200b_l80_h14400 (tp=8 pp=10 mbs=2)") & (frame["devices"] == 320)]
        word = "seq=" if name == "short" else "hidden="
        assert len(cell) == 2 and cell["variant"].str.contains(word).all(), cell["variant"].tolist()
        full = cell[cell["variant"].str.contains("seq=2048" if name == "short" else "hidden=14400")]
        assert full["samples_per_s"].tolist() == pytest.approx([2048 / 207.92])


def test_a_config_cancelled_before_its_record_is_placed_in_its_layouts_row(tmp_path: Path) -> None:
    # Launched, then cancelled before it started: no record, only the layout its manifest entry keeps
    # (or a plan row's). It knows no model width: that varied the field and gave every row of the
    # table 'layers=80 hidden=14400', and its own row 'layers= hidden=', apart from its layout's.
    import dataclasses

    from launchers.submit import launched_layout
    from tests.analysis.golden.build import run_config
    from train.contract import read_manifest, write_manifest

    data = fixture()
    sweep = build_sweep(tmp_path / "s", drop=("n48_pp6_mbs2", "n44_pp11_mbs2"))
    (sweep / "plan.csv").unlink()
    entries = [
        dataclasses.replace(e, layout=launched_layout(run_config(data["model"], data["hardware"], spec["layout"])).to_json())
        if e.status == "submitted" else e
        for e, spec in zip(read_manifest(sweep), data["runs"], strict=True)
    ]  # fmt: skip
    write_manifest(entries, sweep / "manifest.jsonl")
    df = load_sweeps([sweep], queue=lambda ids: {i: "CANCELLED by 0" for i in ids}).table
    frame = scaling_frame(df)
    assert not frame["variant"].str.contains("layers=|hidden=|seq=").any(), frame["variant"].tolist()
    cancelled = frame[frame["outcome"] == "cancelled"].set_index("variant")
    assert cancelled.loc["bloom_200b_l80_h14400 (tp=8 pp=6 mbs=2)", "scale"] == "48*8"
    assert cancelled.loc["bloom_200b_l80_h14400 (tp=8 pp=11 mbs=2)", "scale"] == "44*8"


def test_scaling_keeps_sequence_parallel_and_interleaved_runs_of_one_layout_apart(tmp_path: Path) -> None:
    # The same model and degrees run again with sequence parallelism (or two virtual stages), 2x
    # faster: one row held both, its efficiency the ratio of one variant's run at one scale to the
    # other's at the next.
    a = build_sweep(tmp_path / "a")
    for name, field, value, word in (("sp", "sequence_parallel", True, "sp=True"), ("vpp", "virtual_stages", 2, "vpp=2")):
        data = copy.deepcopy(fixture())
        for run in data["runs"]:
            run["layout"] = {**run["layout"], field: value}
            run["extra_overrides"] = [f"parallelism.{field}={str(value).lower()}"]
            if run.get("sec_per_iter"):
                run["sec_per_iter"] /= 2
        frame = scaling_frame(load_sweeps([a, build_sweep(tmp_path / name, data)], queue=None).table)
        cell = frame[frame["variant"].str.startswith("bloom_200b_l80_h14400 (tp=8 pp=10 mbs=2)") & (frame["devices"] == 320)]
        assert len(cell) == 2 and cell["variant"].str.contains(word).sum() == 1, cell["variant"].tolist()
        plain = cell[~cell["variant"].str.contains(word)]
        assert plain["samples_per_s"].tolist() == pytest.approx([2048 / 207.92])


# ---------------------------------------------------------------------------------------------
# Runs stopped before their end (timeout, interrupted): what they measured, marked partial


def _stopped(tmp_path: Path) -> pd.DataFrame:
    return load_sweeps([build_sweep(tmp_path / "stopped", stopped_sweep_data())], queue=None).table


def test_a_stopped_run_shows_what_it_measured_marked_partial(tmp_path: Path) -> None:
    table = results_table(_stopped(tmp_path)).set_index("Mem")
    # Finished runs first, fastest first; the stopped ones keep their place among the failures, though
    # the timeout's 150 s/it is faster than both.
    assert table.index.tolist() == ["45GB", "43GB", "timeout (partial)", "timeout", "interrupted (partial)"]
    timeout = table.loc["timeout (partial)"]
    assert timeout[["Sec/it", "CV", "TFLOPs", "MFU"]].tolist() == ["150.00", "2.0%", "110.00", "35.3%"]
    # The time model is judged against finished runs only.
    assert timeout[["Pred s/it", "Err"]].tolist() == ["", ""]
    assert timeout["Notes"] == ("02-20; partial: 47 iterations measured, stopped after 48 of 100, peak 39GB so far; "
                                "received SIGTERM; stopped before the end of training")  # fmt: skip
    interrupted = table.loc["interrupted (partial)"]
    assert interrupted[["Sec/it", "TFLOPs"]].tolist() == ["180.00", "99.00"]
    assert "partial: 9 iterations measured, stopped after 10 of 100, peak 41GB so far; stopped by SIGINT" in (
        interrupted["Notes"])


def test_a_stopped_run_that_measured_too_few_iterations_stays_blank_and_says_why(tmp_path: Path) -> None:
    row = results_table(_stopped(tmp_path)).set_index("Mem").loc["timeout"]
    assert (row[["Sec/it", "CV", "Pred s/it", "Err", "TFLOPs", "MFU"]] == "").all()
    assert row["Notes"].startswith("02-20; no figures: 1 iteration measured (2 needed), stopped after 2 of 100; ")


def test_a_resumed_attempt_says_where_it_stopped_from_its_checkpoints_step(tmp_path: Path) -> None:
    df = _stopped(tmp_path)
    at = df["outcome"] == "interrupted"
    df.loc[at, "resumed_from_step"] = 60.0
    notes = results_table(df).set_index("Mem").loc["interrupted (partial)", "Notes"]
    assert "partial: 9 iterations measured, stopped after 70 of 100" in notes


def test_a_resumed_finished_run_says_so_and_how_many_iterations_its_figures_cover(tmp_path: Path) -> None:
    # A run that went on from its checkpoint at step 16 and finished: its record's figures are its last
    # attempt's 2 measured iterations. Its row read as any finished run's, its 2 iterations a whole run's.
    sweep = build_sweep(tmp_path / "resumed", stopped_sweep_data())
    path = sweep / "runs" / "0" / "result.json"
    record = json.loads(path.read_text())
    assert record["status"] == "ok" and record["measured_iterations"] == 2
    record["resumed_from_step"] = 16
    write_json_atomic(path, record)
    df = load_sweeps([sweep], queue=None).table
    assert df.set_index("run_dir")["resumed"].to_dict() == {f"runs/{i}": i == 0 for i in range(5)}
    row = results_table(df).set_index("Mem").loc[format_mem(record["max_mem_gib"])]
    assert row["Notes"] == "02-20; resumed at step 16: 2 iterations measured after it"
    # Its figures are shown as measured, never pooled with figures the record does not hold.
    assert row["Sec/it"] == format_sec(record["sec_per_iter"])
    md = results_markdown(df, labels=["resumed"], recommendation="-")
    (footnote,) = [line for line in md.splitlines() if line.startswith("* resumed at step N:")]
    assert "resumed=True" in footnote and "not of the whole run" in footnote
    csv = pd.read_csv(write_results_csv(df, tmp_path / "results.csv"))
    assert csv.set_index("run_dir")["resumed"].to_dict() == {f"runs/{i}": i == 0 for i in range(5)}
    # A run without a resume says nothing of one.
    assert "* resumed" not in results_markdown(_stopped(tmp_path), labels=["stopped"], recommendation="-")


def test_results_md_explains_partial_figures_once(tmp_path: Path) -> None:
    df = _stopped(tmp_path)
    assert summary_line(df) == "5 configs: 2 ok, 2 timeout, 1 interrupted; 2 stopped run(s) with partial figures, not ranked"
    md = results_markdown(df, labels=["stopped"], recommendation="-")
    (footnote,) = [line for line in md.splitlines() if line.startswith("* timeout (partial)")]
    assert footnote.startswith("* timeout (partial) and interrupted (partial): a run stopped before its end")
    assert "at least 2 iterations" in footnote and "partial=True" in footnote
    # A sweep without any says nothing of them.
    golden = load_sweeps([build_sweep(tmp_path / "golden")], queue=None).table
    assert "(partial)" not in results_markdown(golden, labels=["golden"], recommendation="-")


def test_scaling_cells_never_take_a_stopped_runs_figures(tmp_path: Path) -> None:
    # Seed 004's bert 345m scaled out, its 8-node run stopped by the time limit after 47 iterations: that
    # cell says timeout, in scaling.md and scaling.csv alike, and the efficiencies are the finished runs'.
    data = copy.deepcopy(fixture())
    gbs = 8192
    data["runs"] = [
        {"name": f"n{nodes}", "nodes": nodes, "layout": {"dp": 8 * nodes, "tp": 1, "pp": 1, "mbs": 4, "gbs": gbs},
         "params": 345_000_000, "mem_gib": 30.0, "sec_per_iter": gbs / sps, "tflops": tflops, **stop}
        for nodes, sps, tflops, stop in (
            (1, 1658.93, 2.94, {}), (4, 6558.31, 2.91, {}),
            (8, 20000.0, 4.0, {"status": "timeout", "message": "received SIGTERM", "iterations_run": 48,
                               "measured_iterations": 47}),
        )
    ]  # fmt: skip
    df = load_sweeps([build_sweep(tmp_path / "scale", data)], queue=None).table
    assert df["partial"].tolist() == [False, False, True]
    frame = scaling_frame(df).set_index("scale")
    assert frame.loc["8*8", "outcome"] == "timeout"
    assert frame.loc["8*8", ["samples_per_s", "tflops", "pflops", "mfu", "mem_gib", "efficiency"]].isna().all()
    assert frame.loc["4*8", "efficiency"] == pytest.approx(6558.31 / 4 / 1658.93)
    md = scaling_markdown(scaling_frame(df))
    assert md is not None and md.splitlines()[2].rstrip(" |").endswith("timeout") and "20000" not in md


def test_zero_cells_never_take_a_stopped_runs_figures(tmp_path: Path) -> None:
    stopped = _zero_run("ds3_mp1_n1", 1, 1, "deepspeed", 3, status="timeout")
    stopped.update(sec_per_iter=GBS / 900.0, tflops=1.9, mem_gib=20.0, iterations_run=20, measured_iterations=19)
    data = copy.deepcopy(fixture())
    data["runs"] = [_zero_run("native_mp1_n1", 1, 1, sps=1658.93, tflops=2.94), stopped]
    df = load_sweeps([build_sweep(tmp_path / "zero", data)], queue=None).table
    assert df["partial"].tolist() == [False, True]
    frame = zero_frame(df)
    (cell,) = (row for _, row in frame.iterrows() if row["engine"] == "deepspeed")
    assert cell["variant"].endswith("(mp=1) with deepspeed zero3") and cell["outcome"] == "timeout"
    assert cell[["samples_per_s", "tflops", "sec_per_iter", "mem_gib"]].isna().all()
    md = zero_markdown(zero_frame(df))
    assert md is not None and "900" not in md and md.splitlines()[3].rstrip(" |").endswith("timeout")
