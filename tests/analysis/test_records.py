"""Loading sweeps: result records, plan.csv skips, the manifest, pending runs, the CLI end to end."""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pytest

from analysis.compare import compare_sweeps
from analysis.recommend import format_recommendations, recommend
from analysis.records import (
    CORE_COLUMNS,
    WHOLE_CORE_COLUMNS,
    AnalysisError,
    _flatten,
    _join_str,
    _parse_json,
    _records_table,
    load_sweeps,
    outcome_counts,
    overrides_key,
    write_results_csv,
)
from analysis.tables import format_size, prediction_notes, results_markdown, results_table, summary_line
from conf import CONFIG_DIR
from conf.schema import Precision, RunConfig
from launchers.compose import FastComposer
from tests.analysis.golden.build import (
    build_sweep,
    fixture,
    hardware_conf,
    make_record,
    overrides_of,
    predicted_sweep_data,
    run_config,
    stopped_sweep_data,
)
from tests.train.planner.test_calibration import MODEL as CAL_MODEL
from tests.train.planner.test_calibration import calibration
from train.contract import (
    EARLIER_MULTIRUN_FILE,
    EXPORTED_JOBS_DIR,
    MULTIRUN_FILE,
    RESULT_FILE,
    SEARCH_FILE,
    ManifestEntry,
    join_overrides,
    read_manifest,
    write_json_atomic,
    write_manifest,
    write_plan_csv,
)
from train.planner.layout import Layout
from train.planner.plan import plan_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    return build_sweep(tmp_path / "bloom_sweep")


def test_every_config_is_one_row_with_its_outcome(sweep: Path) -> None:
    df = load_sweeps([sweep], queue=None).table
    assert len(df) == len(fixture()["runs"]) == 11
    assert outcome_counts(df) == {"ok": 5, "oom": 1, "nan": 1, "timeout": 1, "fail": 1, "skipped": 1, "pending": 1}
    # The record's 'error' reads 'fail', as the seeds write it; only the first line of a message is kept.
    row = df.set_index("run_dir").loc["runs/5"]
    assert row["outcome"] == "oom" and row["reason"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.53 GiB"
    assert df.set_index("run_dir").loc["runs/6", "outcome"] == "fail"


def test_record_fields_are_flattened_and_core_columns_derived(sweep: Path) -> None:
    df = load_sweeps([sweep], queue=None).table.set_index("run_dir")
    r = df.loc["runs/2"]
    assert r["config.model.hidden_size"] == 14400 and r["config.parallelism.tp"] == 8
    assert r["world.world_size"] == 384 and r["flops_per_iteration.model"] > 0
    assert (r["nodes"], r["devices"], r["dp"], r["tp"], r["pp"], r["mbs"], r["gbs"]) == (48, 384, 8, 8, 6, 2, 2048)
    # Mem is the max over ranks: the fixture writes [mem - 3, mem].
    assert r["mem_gib"] == pytest.approx(45.2)
    # Aggregate PFLOPs as the BLOOM notes compute it: TFLOPs x GPUs / 1024.
    assert r["pflops"] == pytest.approx(98.43 * 384 / 1024)
    assert r["mem_pred_gib"] > 0 and r["mem_capacity_gib"] == pytest.approx(78.15)
    assert r["job_id"] == "1000_2" and r["date"] == "02-20"


def test_a_run_on_another_device_than_its_hardware_config_says_is_noted(sweep: Path) -> None:
    # runs/2 ran on an H100 under hardware=a100_80gb: its MFU reads 312 TFLOP/s where 989 was the peak.
    path = sweep / "runs/2" / RESULT_FILE
    record = json.loads(path.read_text())
    record["config"]["hardware"]["device_pattern"] = "A100"
    record["device"], record["device_memory_gib"] = "NVIDIA H100 80GB HBM3", 79.18
    write_json_atomic(path, record)
    df = load_sweeps([sweep], queue=None).table.set_index("run_dir")
    mismatch = df.loc["runs/2", "device_mismatch"]
    assert mismatch.startswith(f"hardware={record['hardware']} does not describe this device: the device is 'NVIDIA H100")
    # The others recorded no pattern and no memory (records of before): nothing to tell by.
    assert set(df.drop(index="runs/2")["device_mismatch"]) == {""}
    # results.md's Notes give its first sentence: which config, which device.
    notes = results_table(df.reset_index())["Notes"].tolist()
    assert sum("does not describe this device: the device is 'NVIDIA H100 80GB HBM3'" in n for n in notes) == 1
    assert not any("MFU, the memory checks" in n for n in notes)


def test_skipped_row_comes_from_plan_and_manifest_with_reason(sweep: Path) -> None:
    df = load_sweeps([sweep], queue=None).table
    skipped = df[df["outcome"] == "skipped"].iloc[0]
    assert "exceeds the usable" in skipped["reason"]
    assert (skipped["dp"], skipped["tp"], skipped["pp"], skipped["gbs"]) == (48, 8, 1, 2016)


def test_a_dry_run_beside_the_sweep_that_ran_it_lists_only_what_never_ran(sweep: Path, tmp_path: Path) -> None:
    # The dry run's directory (plan.csv alone) and the launched sweep, analysed together: every config
    # that ran was also listed as "planned, not run" (ten rows twice).
    dry = tmp_path / "dry"
    dry.mkdir()
    shutil.copy(sweep / "plan.csv", dry / "plan.csv")
    alone = load_sweeps([dry], queue=None).table
    assert outcome_counts(alone)["planned"] == 10
    df = load_sweeps([dry, sweep], queue=None).table
    counts = outcome_counts(df)
    # The sweep's own pending config was launched too: nothing is left planned.
    assert "planned" not in counts and counts["pending"] == 1
    assert len(df[df["sweep"] == df["sweep"].iloc[-1]]) == 11 and len(df) == 11 + 1  # the dry run's skip stays
    assert summary_line(df).count("planned") == 0


def test_a_planned_override_whose_value_holds_spaces_is_one_override(tmp_path: Path) -> None:
    # plan.csv keeps a config's overrides in one cell, space-separated: cut at every space, a quoted
    # value was two overrides, and a config that ran was counted again as "planned, not run".
    overrides = ["model=tiny", "logger.wandb_group='my group'", "search.nodes=[1, 2]", "parallelism.tp=1"]
    composer = FastComposer.from_config_dir(CONFIG_DIR)
    row = plan_run(composer.run_config(["model=tiny"]), overrides=join_overrides(overrides))
    (tmp_path / "dry").mkdir()
    write_plan_csv([row], tmp_path / "dry" / "plan.csv")
    (planned,) = load_sweeps([tmp_path / "dry"], queue=None).table.itertuples()
    assert planned.overrides == overrides
    assert planned.config_key == overrides_key(overrides)


def test_plan_csv_without_manifest_gives_skips_and_unrun_configs(sweep: Path) -> None:
    (sweep / "manifest.jsonl").unlink()
    df = load_sweeps([sweep], queue=None).table
    # Without a manifest nothing says the fixture's pending config was launched: planned, not run.
    assert outcome_counts(df)["skipped"] == 1 and outcome_counts(df)["planned"] == 1
    assert "pending" not in outcome_counts(df)
    assert len(df) == 11
    planned = df[df["outcome"] == "planned"].iloc[0]
    # It keeps the plan's layout and the planner's predictions (NaN where the plan predicted nothing).
    assert (planned["tp"], planned["pp"], planned["mbs"]) == (8, 11, 4)
    assert "pred_sec_per_iter" in df.columns
    assert summary_line(df).endswith(", 1 planned, not run")


def test_nodes_without_slurm_come_from_the_layout(sweep: Path) -> None:
    # No manifest and no SLURM_NNODES (a run outside Slurm): the layout says how many nodes it needs,
    # a partial node counting as one.
    (sweep / "manifest.jsonl").unlink()
    path = sweep / "runs/2/result.json"
    record = json.loads(path.read_text())
    record["env"] = {}
    record["config"]["hardware"]["devices_per_node"] = 5
    path.write_text(json.dumps(record))
    r = load_sweeps([sweep], queue=None).table.set_index("run_dir").loc["runs/2"]
    layout = Layout(dp=8, tp=8, pp=6)
    assert (r["dp"], r["tp"], r["pp"], r["devices"]) == (8, 8, 6, layout.world_size)
    assert r["nodes"] == layout.nodes(5) > layout.world_size / 5


def test_in_progress_sweep_reports_pending_runs(tmp_path: Path) -> None:
    sweep = build_sweep(tmp_path / "s", drop=("n48_pp6_mbs2", "n40_pp10_mbs2"))
    df = load_sweeps([sweep], queue=None).table
    pending = df[df["outcome"] == "pending"].sort_values("manifest_index")
    assert pending["run_dir"].tolist() == ["runs/0", "runs/2", "runs/10"]
    assert pending["job_id"].tolist() == ["1000_0", "1000_2", "1000_10"]


def test_queue_states_mark_running_and_ended_jobs(sweep: Path) -> None:
    build_sweep(sweep, drop=("n48_pp6_mbs2", "n40_pp10_mbs2"))
    for d in ("runs/0", "runs/2"):
        (sweep / d / "result.json").unlink()
    asked: list[list[str]] = []

    def queue(ids: Sequence[str]) -> dict[str, str]:
        asked.append(list(ids))
        return {"1000_0": "RUNNING", "1000_2": "OUT_OF_MEMORY"}

    df = load_sweeps([sweep], queue=queue).table.set_index("run_dir")
    # The missing runs' jobs, and those whose record says they failed (requeued, maybe: then the record
    # is an earlier attempt's) or timed out (cancelled or preempted, maybe).
    assert asked == [["1000_0", "1000_10", "1000_2", "1000_5", "1000_6", "1000_7", "1000_8"]]
    assert df.loc["runs/0", "outcome"] == "running"
    # A job Slurm ended without result.json is a failure of the kind Slurm names, not 'pending' forever.
    assert df.loc["runs/2", "outcome"] == "oom" and "OUT_OF_MEMORY" in df.loc["runs/2", "reason"]
    assert df.loc["runs/10", "outcome"] == "pending" and df.loc["runs/10", "queue_state"] == ""


def test_a_timeout_record_of_a_cancelled_or_requeued_job_is_not_a_time_limit(sweep: Path) -> None:
    # scancel and a preemption send the SIGTERM a time limit sends: the record says `timeout`, Slurm's
    # state says which (as `status` reads it); a requeued job runs again.
    data = fixture()
    for run in data["runs"][:4]:
        run.update(status="timeout", message="received SIGTERM")
    data["runs"][6].update(status="timeout", message="received SIGTERM", sec_per_iter=300.0, tflops=100.0)
    # Any record of a job waiting to run again is an earlier attempt's (status says pending: it read fail);
    # a running job's failed record other than a stop is this attempt's, written just before its end.
    data["runs"][4].update(status="error", message="NCCL communicator aborted")
    data["runs"][5].update(status="oom", message="CUDA out of memory")
    build_sweep(sweep, data)
    states = {"1000_0": "CANCELLED by 0", "1000_1": "TIMEOUT", "1000_2": "RUNNING", "1000_3": "PENDING",
              "1000_4": "PENDING (BeginTime)", "1000_5": "RUNNING", "1000_6": "PREEMPTED"}  # fmt: skip
    df = load_sweeps([sweep], queue=lambda ids: {i: states[i] for i in ids if i in states}).table.set_index("run_dir")
    assert (df.loc["runs/4", "outcome"], df.loc["runs/4", "queue_state"]) == ("pending", "PENDING (BeginTime)")
    assert df.loc["runs/4", "reason"] == "requeued (PENDING (BeginTime)); the last attempt's result.json status error: NCCL communicator aborted"
    assert df.loc["runs/5", "outcome"] == "oom"
    assert (df.loc["runs/0", "outcome"], df.loc["runs/0", "reason"]) == (
        "cancelled", "cancelled (Slurm state CANCELLED), not a time limit; result.json status timeout: received SIGTERM"
    )
    assert df.loc["runs/1", "outcome"] == "timeout"
    assert [df.loc[d, "outcome"] for d in ("runs/2", "runs/3")] == ["running", "pending"]
    assert df.loc["runs/3", "reason"] == "requeued (PENDING); the last attempt's result.json status timeout: received SIGTERM"
    # Each record kept its two measured iterations: partial figures where the stop stands (a time limit, a
    # cancel), not where the job runs again.
    assert [bool(df.loc[f"runs/{i}", "partial"]) for i in range(4)] == [True, True, False, False]
    # Preempted (PreemptMode=CANCEL): stopped as by a time limit, its figures partial; it read fail, blank.
    assert (df.loc["runs/6", "outcome"], df.loc["runs/6", "reason"]) == (
        "timeout", "preempted (Slurm state PREEMPTED), not a time limit; result.json status timeout: received SIGTERM"
    )
    assert df.loc["runs/6", "partial"] and df.loc["runs/6", "sec_per_iter"] > 0


def test_a_config_whose_directory_holds_another_configs_record_is_still_listed(sweep: Path) -> None:
    # A rerun given another config's directory (before 441da53): the config whose directory it was lost
    # its row, neither ok nor pending, and the record that was counted was called "belonging to no config".
    entries = read_manifest(sweep)
    other = dataclasses.replace(entries[0], index=99, overrides=("training.lr=0.5",), job_id="1000_99")
    write_manifest([*entries, other], sweep / "manifest.jsonl")
    loaded = load_sweeps([sweep], queue=None)
    rows = loaded.table.set_index("manifest_index")
    assert len(rows) == len(entries) + 1
    assert rows.loc[0, "outcome"] == "ok" and rows.loc[99, "outcome"] == "pending"
    assert not any("belong to no config" in w for w in loaded.warnings), loaded.warnings


def test_corrupt_record_is_a_warning(sweep: Path) -> None:
    (sweep / "runs" / "0" / "result.json").write_text("{not json")
    loaded = load_sweeps([sweep], queue=None)
    assert any("runs/0/result.json" in w for w in loaded.warnings)
    # Written whole or not at all, a record that cannot be read was damaged after its run ended: failed,
    # as `status` says (it read "pending", as if the run were still to write it).
    row = loaded.table.set_index("run_dir").loc["runs/0"]
    assert row["outcome"] == "fail" and row["reason"].startswith("runs/0/result.json cannot be read (JSONDecodeError: ")
    # Unless Slurm says its job lives on (requeued): then it waits, or runs, again.
    for state, outcome in (("PENDING (BeginTime)", "pending"), ("RUNNING", "running"), ("COMPLETED", "fail")):

        def queue(ids: Sequence[str], state: str = state) -> dict[str, str]:
            return dict.fromkeys(ids, state)

        table = load_sweeps([sweep], queue=queue).table.set_index("run_dir")
        assert table.loc["runs/0", "outcome"] == outcome, state
    # An exported task that has not begun (no job id recorded yet) is pending, as status says, whatever
    # lies in its directory.
    entries = read_manifest(sweep)
    exported = dataclasses.replace(entries[0], status="exported", job_id=None)
    write_manifest([exported, *entries[1:]], sweep / "manifest.jsonl")
    assert load_sweeps([sweep], queue=None).table.set_index("run_dir").loc["runs/0", "outcome"] == "pending"


def test_an_empty_result_file_or_a_directory_of_its_name_is_a_warning(sweep: Path) -> None:
    # A result.json that is a directory (a copy gone wrong, a tool's mkdir) was passed over without
    # a word: its config read as pending, as if it were still to run. An empty one already warned.
    (sweep / "runs" / "0" / "result.json").unlink()
    (sweep / "runs" / "0" / "result.json").mkdir()
    (sweep / "runs" / "1" / "result.json").write_text("")
    loaded = load_sweeps([sweep], queue=None)
    for run in ("0", "1"):
        (warning,) = [w for w in loaded.warnings if f"runs/{run}/result.json" in w]
        assert "not a readable result record" in warning and warning.endswith("; ignored")
    assert "Is a directory" in next(w for w in loaded.warnings if "runs/0/" in w)
    assert loaded.table.set_index("run_dir").loc["runs/0", "outcome"] == "pending"


def test_what_orjson_reads_otherwise_or_refuses_is_read_as_json_reads_it(sweep: Path) -> None:
    # result.json is parsed by orjson, which refuses NaN and reads integers beyond 64 bits as floats;
    # json reads both (a record written by hand or by an older trainer). Text that is not UTF-8
    # stays a warning. Each in a record of its own: one refused value sends the whole file to json.
    def rewrite(run: str, **fields: object) -> dict[str, object]:
        path = sweep / "runs" / run / "result.json"
        record = {**json.loads(path.read_text()), **fields}
        path.write_text(json.dumps(record))
        return record

    nan_record = rewrite("0", final_loss=math.nan)
    rewrite("2", params=2**70 + 1)  # no float: read as one, it would come back as 2**70
    (sweep / "runs" / "1" / "result.json").write_bytes(b'{"status": "ok", "device": "\xff"}')
    loaded = load_sweeps([sweep], queue=None)
    rows = loaded.table.set_index("run_dir")
    params = rows.loc["runs/2", "params"]
    assert type(params) is int and params == 2**70 + 1
    assert math.isnan(rows.loc["runs/0", "final_loss"]) and rows.loc["runs/0", "outcome"] == nan_record["status"]
    assert [w for w in loaded.warnings if "runs/1/result.json" in w and "not a readable result record" in w]
    assert not [w for w in loaded.warnings if "runs/0/" in w or "runs/2/" in w]


@pytest.mark.parametrize(
    "number",
    [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**18, 10**19, 123456789012345678, 0.1234567890123456789,
     1.0e300, -2.5e-300, 12345678901234567.0],
)
def test_numbers_parse_as_json_parses_them(number: float) -> None:
    # orjson turns integers beyond 64 bits into floats: whatever the shortcut that decides which
    # parser reads a record, every number must come back with json's type and value.
    text = json.dumps({"a": [number, {"b": number}], "id": f"x{number}"})
    parsed = _parse_json(text.encode())
    assert parsed == json.loads(text)
    assert type(parsed["a"][0]) is type(number) and type(parsed["a"][1]["b"]) is type(number)


def test_two_sweeps_in_one_table(tmp_path: Path) -> None:
    a, b = build_sweep(tmp_path / "a"), build_sweep(tmp_path / "b")
    loaded = load_sweeps([a, b], queue=None)
    assert loaded.labels == ("a", "b")
    assert loaded.table.groupby("sweep").size().to_dict() == {"a": 11, "b": 11}


def test_refused_and_exported_configs_from_the_manifest(tmp_path: Path) -> None:
    sweep = tmp_path / "handmade"
    message = "sbatch refused: sbatch: error: invalid partition specified: nosuch"
    entries = [
        ManifestEntry(0, ("cluster.partition=nosuch",), "0", "refused", message, None, {"nodes": 1}),
        ManifestEntry(1, ("training.lr=1",), "1", "exported", "exported to a.sbatch, array task 0"),
        ManifestEntry(2, ("training.lr=2",), "2", "exported", "exported to a.sbatch, array task 1"),
    ]
    # Config 2's array task has started and recorded its job id; config 1's has not.
    (sweep / EXPORTED_JOBS_DIR).mkdir(parents=True)
    write_manifest(entries, sweep / "manifest.jsonl")
    (sweep / EXPORTED_JOBS_DIR / "2").write_text("77_1\n")
    asked: list[list[str]] = []

    def queue(ids: Sequence[str]) -> dict[str, str]:
        asked.append(list(ids))
        return {"77_1": "RUNNING"}

    df = load_sweeps([sweep], queue=queue).table.set_index("manifest_index")
    assert asked == [["77_1"]]
    assert df.loc[0, "outcome"] == "refused" and df.loc[0, "reason"] == message
    assert (df.loc[1, "outcome"], df.loc[1, "job_id"]) == ("pending", "")
    assert (df.loc[2, "outcome"], df.loc[2, "job_id"]) == ("running", "77_1")
    assert summary_line(df) == "3 configs: 1 refused, 1 pending, 1 running"
    # In the seeds' table a refused config reads 'refused' where the memory goes, Slurm's words in Notes.
    (row,) = results_table(df).to_dict("records")
    assert row["Mem"] == "refused" and row["Sec/it"] == ""
    assert "invalid partition specified: nosuch" in row["Notes"]


def test_a_local_sweep_stopped_by_ctrl_c_is_interrupted_not_pending(tmp_path: Path) -> None:
    # The running config records `interrupted`; the one not yet started is so in the manifest.
    from launchers.local import INTERRUPTED_BEFORE_START

    sweep = tmp_path / "local"
    sweep.mkdir()
    entries = [
        ManifestEntry(0, ("training.lr=1",), "0", "submitted"),
        ManifestEntry(1, ("training.lr=2",), "1", "interrupted", INTERRUPTED_BEFORE_START),
    ]
    write_manifest(entries, sweep / "manifest.jsonl")
    record = {"status": "interrupted", "message": "interrupted by SIGINT", "overrides": ["training.lr=1"]}
    (sweep / "0").mkdir()
    (sweep / "0" / "result.json").write_text(json.dumps(record))
    df = load_sweeps([sweep], queue=None).table.set_index("manifest_index")
    assert list(df.loc[[0, 1], "outcome"]) == ["interrupted", "interrupted"]
    assert df.loc[1, "reason"] == INTERRUPTED_BEFORE_START
    assert summary_line(df) == "2 configs: 2 interrupted"


def test_a_failed_config_rerun_with_changed_fields_says_so_as_status_does(sweep: Path) -> None:
    # Status said "rerun as config N"; the analysis listed the failure as if nothing had been done.
    entries = read_manifest(sweep / "manifest.jsonl")
    (failed,) = [e for e in entries if e.output_dir == "runs/6"]
    rerun = ManifestEntry(len(entries), (*failed.overrides, "training.lr=1e-4"), "rerun", "submitted", None, "2000_0",
                          {"nodes": 1}, rerun_of=failed.index)  # fmt: skip
    refused = ManifestEntry(len(entries) + 1, ("training.lr=-1",), "refused", "skipped", "[training_values] ...",
                            rerun_of=entries[0].index)  # fmt: skip
    write_manifest([*entries, rerun, refused], sweep / "manifest.jsonl")
    df = load_sweeps([sweep], queue=None).table.set_index("manifest_index")
    # The skipped rerun stands for nothing (as status judges it): config 0 has none.
    assert df.loc[failed.index, "rerun_as"] == rerun.index and df["rerun_as"].notna().sum() == 1
    row = results_table(df.reset_index())
    (note,) = [n for n in row["Notes"] if f"rerun as config {rerun.index}" in n]
    assert "; rerun as config" in note and note.index("rerun as config") < note.index("Error")
    text = format_recommendations(recommend(df.reset_index()))
    assert "did not finish (" in text and "1 of them rerun with changed fields)" in text


def test_skipped_and_refused_configs_of_a_launched_sweep_carry_their_layout(tmp_path: Path) -> None:
    # A launched sweep has no plan.csv: its skipped and refused configs are planned from its configs,
    # as a plan directory's are, and their rows told apart by their layout.
    sweep = tmp_path / "launched"
    sweep.mkdir()
    refused = "sbatch refused: sbatch: error: invalid partition specified: nosuch"
    entries = [
        ManifestEntry(0, ("parallelism.tp=3", "training.train_iters=4"), "0", "skipped", "infeasible config: tp=3"),
        ManifestEntry(1, ("parallelism.tp=5", "training.train_iters=4"), "1", "skipped", "infeasible config: tp=5"),
        ManifestEntry(2, ("parallelism.tp=2", "cluster.partition=nosuch"), "2", "refused", refused, None, {"nodes": 1}),
    ]
    write_manifest(entries, sweep / "manifest.jsonl")
    loaded = load_sweeps([sweep], queue=None)
    assert not loaded.warnings
    df = loaded.table.set_index("manifest_index")
    composer = FastComposer.from_config_dir(CONFIG_DIR)
    for e in entries:
        plan = plan_run(composer.run_config(e.overrides))
        row = df.loc[e.index]
        assert (row["model"], row["dp"], row["tp"], row["pp"], row["mbs"], row["gbs"]) == (
            plan.model, plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.global_batch_size
        )
        assert row["size_params"] == plan.params and row["nodes"] == plan.nodes
    assert df["tp"].tolist() == [3, 5, 2] and set(df["model"]) == {"tiny"}
    assert [(r["TP"], r["Mem"]) for r in results_table(loaded.table).to_dict("records")] == [
        ("2", "refused"), ("3", "skipped"), ("5", "skipped")
    ]


_PLAN_LAYOUT = ("zero_stage", "offload", "recompute", "precision", "engine", "virtual_stages", "sequence_parallel")


def test_a_skipped_configs_layout_key_is_a_finished_runs_of_the_same_layout(tmp_path: Path) -> None:
    # One layout skipped in one sweep (a manifest's entry, planned here; a dry run's plan.csv row) and
    # finished in another: their layout_key left ZeRO, offload, recompute, precision and engine blank for
    # the skipped one ('tiny|cpu|8|4|1|1|1|||||' beside the record's 'tiny|cpu|8|4|1|1|1|0|none|none|fp32|native').
    overrides = ["parallelism.recompute=full", "training.train_iters=4"]
    run = FastComposer.from_config_dir(CONFIG_DIR).run_config(overrides)
    planned = plan_run(run, overrides=join_overrides(overrides))
    launched, dry, done = tmp_path / "launched", tmp_path / "dry", tmp_path / "done"
    for d in (launched, dry, done / "0"):
        d.mkdir(parents=True)
    write_manifest([ManifestEntry(0, tuple(overrides), "0", "skipped", "over the memory limit")],
                   launched / "manifest.jsonl")  # fmt: skip
    write_plan_csv([dataclasses.replace(planned, feasible=False, reasons=["over the memory limit"])], dry / "plan.csv")
    layout = {"dp": planned.dp, "tp": planned.tp, "pp": planned.pp, "mbs": planned.micro_batch_size,
              "gbs": planned.global_batch_size}  # fmt: skip
    spec = {"layout": layout, "nodes": 1, "params": planned.params, "mem_gib": 0.5, "sec_per_iter": 1.0, "tflops": 0.01}
    write_json_atomic(done / "0" / RESULT_FILE, make_record(run, spec, overrides))
    df = load_sweeps([launched, dry, done], queue=None).table.set_index("sweep")
    assert df["outcome"].to_dict() == {"launched": "skipped", "dry": "skipped", "done": "ok"}
    assert df.loc["done", "layout_key"].split("|")[-5:] == ["0", "none", "full", "fp32", "native"]
    assert df["layout_key"].nunique() == 1
    for name in _PLAN_LAYOUT:
        column = df[f"config.parallelism.{name}"]
        assert column.tolist() == [getattr(run.parallelism, name)] * 3, name
    # A plan written before a layout column leaves it blank: its PlanRow default is no config's value.
    with (dry / "plan.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    with (dry / "plan.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, [c for c in rows[0] if c != "engine"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    row = load_sweeps([dry], queue=None).table.iloc[0]
    assert pd.isna(row.get("config.parallelism.engine")) and row["layout_key"].endswith("|full|fp32|")
    assert row["config.parallelism.recompute"] == "full"


def _launched(sweep: Path, jobs: Sequence[Sequence[str]]) -> list[ManifestEntry]:
    """The manifest a Slurm launch of `jobs` writes (launchers.submit: planned, then queued as job 77),
    with no plan.csv and no record yet."""
    from launchers.submit import entry_for, plan_configs

    specs, skipped = plan_configs(FastComposer.from_config_dir(CONFIG_DIR), jobs, 0)
    entries = sorted([*skipped, *(entry_for(s, "submitted", job_id=f"77_{s.index}") for s in specs)],
                     key=lambda e: e.index)  # fmt: skip
    sweep.mkdir(parents=True, exist_ok=True)
    write_manifest(entries, sweep / "manifest.jsonl")
    return entries


def test_a_launched_config_without_a_record_shows_the_layout_its_launch_composed(tmp_path: Path) -> None:
    # Pending, running, and cancelled before it started: no record and no plan.csv, and composing each
    # config again costs the analysis ~0.5 s. The launch kept each one's layout in its manifest entry.
    sweep = tmp_path / "launched"
    jobs = [["parallelism.tp=2", "parallelism.micro_batch_size=2"], ["parallelism.pp=2", "parallelism.dp=2"],
            ["parallelism.tp=4", "model.seq_length=128"], ["parallelism.micro_batch_size=auto"]]  # fmt: skip
    entries = _launched(sweep, jobs)
    assert all(e.layout for e in entries)
    states = {"77_0": "PENDING (Priority)", "77_1": "RUNNING", "77_2": "CANCELLED by 0", "77_3": "PENDING (Priority)"}
    loaded = load_sweeps([sweep], queue=lambda ids: {i: states[i] for i in ids})
    assert not loaded.warnings
    df = loaded.table.set_index("manifest_index")
    assert df["outcome"].tolist() == ["pending", "running", "cancelled", "pending"]
    composer = FastComposer.from_config_dir(CONFIG_DIR)
    for e in entries:
        plan, row = plan_run(composer.run_config(e.overrides)), df.loc[e.index]
        assert (row["model"], row["hardware"], row["nodes"], row["devices"], row["dp"], row["tp"], row["pp"],
                row["gbs"], row["seq_length"], row["size_params"]) == (
            plan.model, plan.hardware, plan.nodes, plan.devices, plan.dp, plan.tp, plan.pp, plan.global_batch_size,
            plan.seq_length, plan.params)  # fmt: skip
        assert row["config.parallelism.zero_stage"] == plan.zero_stage and row["layout_key"] != ""
    # `auto` is the run's to choose at its start: no size until its record says one.
    assert df["mbs"].tolist()[:3] == [2, 4, 4] and math.isnan(df.loc[3, "mbs"])
    md = results_markdown(loaded.table, labels=loaded.labels, recommendation="")
    (cancelled,) = results_table(loaded.table).to_dict("records")
    assert [cancelled[c] for c in ("Nodes", "Size", "DP", "TP", "PP", "MBS", "GBS", "Mem")] == [
        "1", format_size(df.loc[2, "size_params"]), "1", "4", "1", "4", "8", "cancelled"
    ]  # fmt: skip
    header, _, *lines = [[c.strip() for c in line.split("|")[1:-1]] for line in md.split("## Missing\n\n", 1)[1].splitlines()]
    assert header == ["State", "Job", "Dir", "Nodes", "Size", "DP", "TP", "PP", "MBS", "GBS", "Overrides"]
    assert [cells[:10] for cells in lines] == [
        ["PENDING (Priority)", "77_0", "0", "1", "5.32M", "1", "2", "1", "2", "8"],
        ["RUNNING", "77_1", "1", "1", "5.32M", "2", "1", "2", "4", "8"],
        ["PENDING (Priority)", "77_3", "3", "1", "5.32M", "1", "1", "1", "", "8"],
    ]
    write_results_csv(loaded.table, tmp_path / "results.csv")
    with open(tmp_path / "results.csv", newline="") as f:
        rows = {int(r["manifest_index"]): r for r in csv.DictReader(f)}
    assert [rows[1][c] for c in ("outcome", "nodes", "devices", "dp", "tp", "pp", "mbs", "gbs", "seq_length")] == [
        "running", "1", "4", "2", "1", "2", "4", "8", "256"
    ]  # fmt: skip
    assert rows[2]["seq_length"] == "128" and rows[3]["mbs"] == ""


def test_an_old_manifest_without_layouts_still_loads_its_unrecorded_configs_blank(tmp_path: Path) -> None:
    sweep = tmp_path / "old"
    entries = _launched(sweep, [["parallelism.tp=2"], ["parallelism.tp=4"]])
    # As launchers wrote it before they kept layouts; then one whose layout was damaged by hand.
    write_manifest([dataclasses.replace(e, layout={}) for e in entries], sweep / "manifest.jsonl")
    loaded = load_sweeps([sweep], queue=None)
    assert not loaded.warnings and loaded.table["outcome"].tolist() == ["pending", "pending"]
    assert loaded.table["tp"].isna().all() and loaded.table["nodes"].tolist() == [1, 1]
    md = results_markdown(loaded.table, labels=loaded.labels, recommendation="")
    first = [c.strip() for c in md.split("## Missing\n\n", 1)[1].splitlines()[2].split("|")[1:-1]]
    assert first[:10] == ["pending", "77_0", "0", "1", "", "", "", "", "", ""]
    write_manifest([entries[0], dataclasses.replace(entries[1], layout={**entries[1].layout, "tp": "four"})],
                   sweep / "manifest.jsonl")  # fmt: skip
    loaded = load_sweeps([sweep], queue=None)
    (warning,) = loaded.warnings
    assert "1 launched config(s) keep a layout that cannot be read (layout.tp must be a positive integer" in warning
    assert loaded.table["tp"].tolist()[0] == 2 and math.isnan(loaded.table["tp"].tolist()[1])


def test_a_launched_sweep_is_planned_from_the_configs_its_multirun_yaml_names(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, conf, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (conf / "bigger.yaml").write_text((CONFIG_DIR / "config.yaml").read_text().replace("model: tiny", "model: gpt_350m"))
    sweep = tmp_path / "launched"
    sweep.mkdir()
    multirun = {"hydra": {"job": {"config_name": "bigger"},
                          "runtime": {"config_sources": [{"path": str(conf), "schema": "file", "provider": "main"}]}}}  # fmt: skip
    (sweep / "multirun.yaml").write_text(json.dumps(multirun))  # JSON is YAML
    entries = [
        ManifestEntry(0, ("parallelism.tp=3",), "0", "skipped", "infeasible config: tp=3"),
        ManifestEntry(1, ("model=nosuch",), "1", "skipped", "infeasible config: no such model"),
    ]
    write_manifest(entries, sweep / "manifest.jsonl")
    loaded = load_sweeps([sweep], queue=None)
    df = loaded.table.set_index("manifest_index")
    assert (df.loc[0, "model"], df.loc[0, "tp"]) == ("gpt_350m", 3)
    # A config that does not compose keeps its row, without a layout, and says so once.
    assert df.loc[1, "model"] == "" and math.isnan(df.loc[1, "tp"]) and df.loc[1, "outcome"] == "skipped"
    (warning,) = loaded.warnings
    assert "1 skipped or refused config(s) do not compose" in warning and "bigger.yaml" in warning
    # A launch killed before it kept the sweep's multirun.yaml left its own there, and the sweep's copy.
    (sweep / EARLIER_MULTIRUN_FILE).parent.mkdir()
    (sweep / MULTIRUN_FILE).replace(sweep / EARLIER_MULTIRUN_FILE)
    (sweep / MULTIRUN_FILE).write_text(json.dumps({"hydra": {"job": {"config_name": "config"}}}))
    df = load_sweeps([sweep], queue=None).table.set_index("manifest_index")
    assert (df.loc[0, "model"], df.loc[0, "tp"]) == ("gpt_350m", 3)


def test_bad_input_raises_analysis_error(tmp_path: Path) -> None:
    with pytest.raises(AnalysisError, match="does not exist"):
        load_sweeps([tmp_path / "nope"], queue=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalysisError, match="nothing to analyse"):
        load_sweeps([tmp_path / "empty"], queue=None)


def test_a_directory_of_sweeps_is_refused_and_each_is_named(tmp_path: Path) -> None:
    # Hydra's multirun/<date> holds one sweep per time: read as one, their records were pooled without
    # their manifests (an interrupted config, a rerun's link, lost), "12 configs" of four sweeps' 14.
    parent = tmp_path / "multirun" / "2026-11-29"
    for name in ("10-00-00", "11-30-00"):
        build_sweep(parent / name)
    with pytest.raises(AnalysisError) as info:
        load_sweeps([parent], queue=None)
    message = str(info.value)
    assert "is not a sweep directory but holds 2 sweep(s) (10-00-00, 11-30-00)" in message
    assert f"python -m analysis {parent / '10-00-00'} {parent / '11-30-00'}" in message
    # From above them too: the sweeps' own directories are named, not each of their run directories.
    with pytest.raises(AnalysisError, match=r"holds 2 sweep\(s\) \(2026-11-29/10-00-00, 2026-11-29/11-30-00\)"):
        load_sweeps([tmp_path / "multirun"], queue=None)
    # Each sweep, and both together, read as they did.
    assert len(load_sweeps([parent / "10-00-00", parent / "11-30-00"], queue=None).table) == 2 * len(
        load_sweeps([parent / "10-00-00"], queue=None).table)
    # A sweep that holds another below it (launched into one of its directories) is still a sweep.
    build_sweep(parent / "10-00-00" / "inner")
    assert not load_sweeps([parent / "10-00-00"], queue=None).table.empty


def test_a_figure_that_is_no_number_is_a_warning_and_read_as_missing(tmp_path: Path) -> None:
    # An `ok` record with "sec_per_iter": "fast" (or -1) was a row with a blank Sec/it beside its TFLOPs and
    # MFU, and no word why; a JSON syntax error, by contrast, was said.
    sweep = build_sweep(tmp_path / "s")
    record = sweep / "runs" / "0" / RESULT_FILE
    data = json.loads(record.read_text())
    assert data["status"] == "ok"
    record.write_text(json.dumps({**data, "sec_per_iter": "fast", "mfu": -1.0}))
    loaded = load_sweeps([sweep], queue=None)
    assert f"{record}: sec_per_iter='fast', mfu=-1.0 are not a number >= 0; read as missing" in loaded.warnings
    row = loaded.table.set_index("manifest_index").loc[0]
    assert math.isnan(row["sec_per_iter"]) and math.isnan(row["mfu"]) and row["tflops"] > 0
    # The others say nothing: every golden figure is a number or null.
    assert sum("not a number" in w for w in loaded.warnings) == 1


def test_a_sweep_whose_records_are_all_unreadable_says_which_and_why(tmp_path: Path) -> None:
    # The warnings about unreadable files are printed after loading; a sweep with nothing else in it
    # stops the loading, so they must be in the error, not lost behind "holds no result.json".
    texts = ['{"status": "ok", "sec_per', "[1, 2, 3]", '{"status": "ok"', "", "null"]
    for i, text in enumerate(texts):
        (tmp_path / "s" / str(i)).mkdir(parents=True)
        (tmp_path / "s" / str(i) / RESULT_FILE).write_text(text)
    with pytest.raises(AnalysisError) as info:
        load_sweeps([tmp_path / "s"], queue=None)
    message = str(info.value)
    assert "holds no readable result.json" in message and "5 file(s) could not be read" in message
    assert f"{tmp_path / 's' / '1' / RESULT_FILE}: not a result record (no 'status')" in message
    assert "not a readable result record" in message and "; and 2 more" in message
    assert "; ignored" not in message


# ---------------------------------------------------------------------------------------------
# CLI and import hygiene


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "analysis", *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_writes_files_and_prints_recommendation(sweep: Path, tmp_path: Path) -> None:
    # squeue/sacct are kept off PATH: the CLI must not need them.
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    proc = _cli(str(sweep), "-o", str(tmp_path / "out"), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Fastest for bloom_200b_l80_h14400" in proc.stdout and "DP=4 TP=8 PP=12 MBS=2" in proc.stdout
    assert "Missing (1 config(s) still pending or running)" in proc.stdout
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"results.csv", "results.md", "scaling.csv", "tflops_mfu.png"} <= names
    csv = pd.read_csv(tmp_path / "out" / "results.csv")
    assert len(csv) == 11 and "config.model.num_layers" in csv.columns


def test_csv_files_write_counts_as_integers(tmp_path: Path) -> None:
    # The golden sweep's skipped and pending configs have no record: their NaNs made every count a
    # float, and results.csv and scaling.csv wrote "dp=4.0", "nodes=48.0", "iterations_run=3.0".
    sweep = build_sweep(tmp_path / "bloom_sweep")
    proc = _cli(str(sweep), "--no-plots", "--no-queue", "-o", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    # The columns are the table's, named as the record and CORE_COLUMNS name them.
    assert reader.fieldnames == list(load_sweeps([sweep], queue=None).table.columns)
    assert set(WHOLE_CORE_COLUMNS) <= set(CORE_COLUMNS)
    first, pending = rows[0], rows[-1]
    assert [first[c] for c in ("nodes", "devices", "dp", "tp", "pp", "mbs", "gbs", "seq_length")] == [
        "40", "320", "4", "8", "10", "2", "2048", "2048"
    ]  # fmt: skip
    assert [first[c] for c in ("iterations_run", "world.dp", "config.parallelism.tp", "config.model.num_layers")] == [
        "3", "4", "8", "80"
    ]  # fmt: skip
    assert first["size_params"] == "202722768000" and first["manifest_index"] == "0"
    # A pending config has its layout but no record: its record's counts are empty, not "nan".
    assert (pending["outcome"], pending["dp"], pending["iterations_run"], pending["world.dp"]) == ("pending", "4", "", "")
    # Measurements stay floats, whole or not.
    assert (first["sec_per_iter"], first["mem_capacity_gib"], first["peak_tflops"]) == ("207.92", "78.15", "312.0")
    with open(tmp_path / "out" / "scaling.csv", newline="") as f:
        scaling = list(csv.DictReader(f))
    assert scaling and all(r["nodes"].isdigit() and r["devices"].isdigit() and r["gbs"].isdigit() for r in scaling)
    assert {(r["nodes"], r["devices"]) for r in scaling} == {("40", "320"), ("44", "352"), ("48", "384")}


def test_counts_inside_a_records_dict_fields_are_written_whole(tmp_path: Path) -> None:
    # peak_calibration.cores and power.samples were written "2.0" and "120.0" beside a skipped config:
    # their counts were known only as the record's dict[str, Any].
    sweep = build_sweep(tmp_path / "bloom_sweep")
    path = sweep / "runs" / "0" / "result.json"
    record = json.loads(path.read_text())
    record["peak_calibration"] = {"tflops": 0.19, "cores": 2, "threads": 2, "matrix_size": 1024, "host": "h"}
    record["power"] = {"available": True, "gpus": 8, "samples": 120, "tokens": 4096, "window_s": 30.0}
    path.write_text(json.dumps(record))
    df = load_sweeps([sweep], queue=None).table
    assert df["power.samples"].dtype.kind == "f"  # the other rows lack it
    write_results_csv(df, tmp_path / "results.csv")
    with open(tmp_path / "results.csv", newline="") as f:
        first = next(r for r in csv.DictReader(f) if r["run_dir"] == "runs/0")
    assert [first[c] for c in ("peak_calibration.cores", "peak_calibration.threads", "peak_calibration.matrix_size",
                               "power.gpus", "power.samples", "power.tokens")] == ["2", "2", "1024", "8", "120", "4096"]  # fmt: skip
    assert (first["peak_calibration.tflops"], first["power.window_s"]) == ("0.19", "30.0")  # measurements stay floats


def test_a_stopped_run_that_measured_iterations_is_partial_in_results_csv(tmp_path: Path) -> None:
    # Interrupted and timed out after 9 and 47 measured iterations, and timed out after 1: the figures
    # stay in their columns as the records give them, `partial` says which rows' they are.
    df = load_sweeps([build_sweep(tmp_path / "s", stopped_sweep_data())], queue=None).table
    assert df["partial"].dtype == bool
    write_results_csv(df, tmp_path / "results.csv")
    with open(tmp_path / "results.csv", newline="") as f:
        rows = {(r["outcome"], r["measured_iterations"]): r for r in csv.DictReader(f)}
    assert {key: row["partial"] for key, row in rows.items()} == {
        ("ok", "2"): "False", ("timeout", "47"): "True", ("timeout", "1"): "False", ("interrupted", "9"): "True",
    }  # fmt: skip
    assert rows[("timeout", "47")]["sec_per_iter"] == "150.0"
    # What scripts want of finished runs is still outcome == ok; of every measurement, ok or partial.
    measured = df[(df["outcome"] == "ok") | df["partial"]]
    assert sorted(measured["sec_per_iter"]) == [150.0, 172.36, 180.0, 207.92]


def test_a_failed_runs_speed_is_blank_in_results_csv_and_compare(tmp_path: Path) -> None:
    # An OOM, a NaN and an error after measured iterations (the trainer records their medians, as
    # a NaN run of the tiny model did: sec_per_iter 0.075 with status nan). results.csv gave them as a
    # finished run's, partial=False, for a sort on sec_per_iter or a filter on mfu to pick; and compare.csv
    # as that config's side. Blank now wherever the tables show none (a stop after 1 measured iteration too).
    data = stopped_sweep_data()
    failed = {"n48_pp6_mbs2": ("oom", "CUDA out of memory"), "n48_pp12_mbs2": ("nan", "loss became NaN"),
              "n44_pp11_mbs2": ("error", "NCCL communicator aborted")}  # fmt: skip
    for run in data["runs"]:
        if run["name"] in failed:
            run.update(status=failed[run["name"]][0], message=failed[run["name"]][1], sec_per_iter=90.0, tflops=300.0)
    df = load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table
    assert (df.loc[df["outcome"].isin(["oom", "nan", "fail"]), "sec_per_iter"] == 90.0).all()  # the table keeps them
    write_results_csv(df, tmp_path / "results.csv")
    with open(tmp_path / "results.csv", newline="") as f:
        rows = {r["outcome"]: r for r in csv.DictReader(f) if r["outcome"] != "timeout" or r["measured_iterations"] == "1"}
    speed = ("sec_per_iter", "sec_cv", "tflops", "mfu", "pflops", "samples_per_s", "tflops_per_device", "hfu",
             "sec_per_iter_min", "tokens_per_s_per_device")  # fmt: skip
    for outcome in ("oom", "nan", "fail", "timeout"):
        assert rows[outcome]["partial"] == "False" and rows[outcome]["measured_iterations"] not in ("", "0"), outcome
        assert [rows[outcome][c] for c in speed] == [""] * len(speed), (outcome, rows[outcome]["sec_per_iter"])
    assert rows["oom"]["mem_gib"] != "" and rows["oom"]["max_mem_gib"] != ""  # its peak so far stays
    assert rows["ok"]["sec_per_iter"] == "207.92" and rows["ok"]["tflops_per_device"] != ""
    # compare: the failed side has no figures either.
    c = compare_sweeps(df, df)
    oom = c.table[c.table["outcome_before"] == "oom"].iloc[0]
    assert pd.isna(oom["sec_before"]) and pd.isna(oom["tflops_after"])


def test_a_stopped_runs_record_that_does_not_say_how_many_it_measured_is_not_partial(tmp_path: Path) -> None:
    build_sweep(tmp_path / "s", stopped_sweep_data())
    # A record edited by hand, or not by this trainer: nothing says its figures cover enough iterations.
    path = tmp_path / "s" / "runs" / "3" / RESULT_FILE
    record = json.loads(path.read_text())
    assert record["status"] == "timeout" and record["measured_iterations"] == 47
    del record["measured_iterations"]
    path.write_text(json.dumps(record))
    df = load_sweeps([tmp_path / "s"], queue=None).table.set_index("run_dir")
    assert not df.loc["runs/3", "partial"] and df.loc["runs/2", "partial"]


def test_cli_default_output_is_first_sweeps_analysis_dir(sweep: Path) -> None:
    proc = _cli(str(sweep), "--no-queue", "--no-plots")
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "analysis" / "results.md").is_file()


@pytest.mark.parametrize("case", ["missing", "empty", "not_a_sweep", "bad_manifest", "no_args"])
def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, case: str) -> None:
    target = tmp_path / case
    if case in ("empty", "not_a_sweep", "bad_manifest"):
        target.mkdir()
    if case == "not_a_sweep":  # a directory with files, none of them a sweep's
        (target / "notes.txt").write_text("not a sweep\n")
        (target / "0").mkdir()
        (target / "0" / "config.json").write_text('{"lr": 1e-4}\n')
    if case == "bad_manifest":
        (target / "manifest.jsonl").write_text("[1, 2]\n")
    proc = _cli(*([] if case == "no_args" else [str(target)]), "--no-queue")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-nodes", "0"), ("--max-nodes", "-3"), ("--max-nodes", "two"), ("--dp-multiple", "0"),
     ("--max-mem-gib", "nan"), ("--max-mem-gib", "-1"), ("--max-mem-gib", "inf")],
)  # fmt: skip
def test_a_constraint_that_no_run_could_meet_is_refused(tmp_path: Path, flag: str, value: str) -> None:
    # --max-nodes 0 or --dp-multiple 0 used to exclude every run (or divide by zero) and report "no
    # run met the constraints"; a NaN limit did the same. The flag, its value and the rule are named.
    proc = _cli(str(tmp_path), flag, value, "--no-queue")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: argument {flag}: '{value}' is not a") and "e.g." in line, line


def test_analysis_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now raises\n"
        "import analysis, analysis.records, analysis.tables, analysis.recommend, analysis.plots, "
        "analysis.compare, train.contract, analysis.__main__\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_results_are_matched_to_their_configs_by_overrides(tmp_path: Path) -> None:
    """A sweep relaunched over an older one's directories: only records of its own configs count."""
    sweep = tmp_path / "relaunched"
    sweep.mkdir()
    entries = [ManifestEntry(i, (f"training.lr={lr}",), str(i), "submitted") for i, lr in enumerate((0.3, 0.4))]
    write_manifest(entries, sweep / "manifest.jsonl")
    for i, lr in enumerate((0.1, 0.4, 0.5)):  # 0 and 2 are an older sweep's (2 is in no config's directory)
        (sweep / str(i)).mkdir()
        record = {"status": "ok", "overrides": [f"training.lr={lr}"], "sec_per_iter": 1.0}
        (sweep / str(i) / "result.json").write_text(json.dumps(record))
    loaded = load_sweeps([sweep], queue=None)
    df = loaded.table.set_index("manifest_index")
    assert sorted(df.index) == [0, 1]
    assert (df.loc[0, "outcome"], df.loc[1, "outcome"]) == ("pending", "ok")
    (warning,) = [w for w in loaded.warnings if "belong to no config" in w]
    assert warning.startswith("2 result.json file(s)") and "0, 2" in warning


# ---------------------------------------------------------------------------------------------
# Predicted beside measured: the dry run's time model for each recorded config


def test_each_run_is_predicted_as_the_dry_run_predicts_its_config(tmp_path: Path) -> None:
    factors = [1.2, 0.9, 1.0, 1.5, 1.1]
    data, predicted = predicted_sweep_data(factors)
    sweep = build_sweep(tmp_path / "s", data)
    df = load_sweeps([sweep], queue=None).table.set_index("run_dir")
    for i, pred in enumerate(predicted):
        row = df.loc[f"runs/{i}"]
        # The record's config, read back from result.json, predicts what plan_run predicted from the RunConfig.
        assert row["pred_sec_per_iter"] == pred and row["pred_reason"] == ""
        assert row["pred_error"] == pytest.approx(pred / row["sec_per_iter"] - 1)
        assert row["pred_error"] == pytest.approx(1 / factors[i] - 1)
    # results.csv carries both columns.
    write_results_csv(df.reset_index(), tmp_path / "results.csv")
    csv = pd.read_csv(tmp_path / "results.csv").set_index("run_dir")
    assert csv.loc["runs/3", "pred_sec_per_iter"] == pytest.approx(predicted[3])
    assert csv.loc["runs/3", "pred_error"] == pytest.approx(1 / 1.5 - 1)


def _cpu_sweep(root: Path, hardware: dict[str, object]) -> tuple[Path, list[RunConfig]]:
    """Two finished runs of a tiny fp32 model on CPU processes (dp=1 and dp=2), result.json only."""
    runs = []
    for i, dp in enumerate((1, 2)):
        layout = {"dp": dp, "tp": 1, "pp": 1, "mbs": 1, "gbs": 2}
        base = run_config(dataclasses.asdict(CAL_MODEL), hardware, layout)
        run = dataclasses.replace(base, parallelism=dataclasses.replace(base.parallelism, precision=Precision.fp32))
        spec = {"layout": layout, "sec_per_iter": 0.01 * (i + 1), "tflops": 0.001, "mem_gib": 0.3}
        (root / f"runs/{i}").mkdir(parents=True)
        write_json_atomic(root / f"runs/{i}/result.json", make_record(run, spec, overrides_of(layout, "m")))
        runs.append(run)
    return root, runs


def test_an_uncalibrated_cpu_run_is_not_predicted_and_the_table_says_why_once(tmp_path: Path) -> None:
    sweep, _ = _cpu_sweep(tmp_path / "cpu", hardware_conf("cpu"))
    df = load_sweeps([sweep], queue=None).table
    assert df["pred_sec_per_iter"].isna().all() and df["pred_error"].isna().all()
    # A CPU's peak is measured at run time: the planner cannot know it without a calibration file.
    assert df["pred_reason"].str.contains("peak_measured=true").all()
    assert (results_table(df)["Pred s/it"] == "n/a").all()
    (note,) = prediction_notes(df)
    assert note.startswith("* n/a in Pred s/it (2 run(s)): ") and df["pred_reason"].iloc[0] in note
    md = results_markdown(df, labels=("cpu",), recommendation="")
    assert md.count(df["pred_reason"].iloc[0]) == 1


def test_a_sweep_planned_with_a_calibration_is_predicted_from_it(tmp_path: Path) -> None:
    hardware = {**hardware_conf("cpu"), "calibration": str(calibration(tmp_path))}
    sweep, runs = _cpu_sweep(tmp_path / "cpu", hardware)
    df = load_sweeps([sweep], queue=None).table.set_index("run_dir")
    for i, run in enumerate(runs):
        planned = plan_run(run, world_size=run.parallelism.dp)
        assert math.isfinite(planned.pred_sec_per_iter)
        assert df.loc[f"runs/{i}", "pred_sec_per_iter"] == planned.pred_sec_per_iter
    assert not prediction_notes(df)


def test_records_flatten_as_pandas_json_normalize_does() -> None:
    # Nested dicts to dotted keys, plain values first, empty dicts gone, lists whole, a dotted key
    # that collides with a flattened one: the same columns, values and order as pandas.json_normalize.
    records = [
        {"a": 1, "b": {"c": {"d": [1, 2]}, "e": {}}, "f": None, "b.x": "top", "g": {"h": {"i": True}}, "j": [{"k": 1}]},
        {"b": {"x": "nested", "c": {"d": []}}, "a": 2.5, "z": {}},
    ]
    expected = pd.json_normalize(records, sep=".")
    flat = pd.DataFrame([_flatten(r) for r in records])
    assert list(flat.columns) == list(expected.columns)
    pd.testing.assert_frame_equal(flat, expected)


@pytest.mark.parametrize(
    "records",
    [
        # One shape throughout, as a sweep's records mostly are.
        [{"status": "ok", "a": {"b": 1, "c": [1.0]}, "d": None}, {"status": "oom", "a": {"b": 2, "c": []}, "d": "x"}],
        # The same keys in another order, a key missing, an extra nested key, an empty dict filled later.
        [
            {"status": "ok", "a": {"b": 1, "c": 2}, "env": {}, "x": 1.5},
            {"x": 2, "status": "ok", "a": {"c": 3, "b": 4}, "env": {}},
            {"status": "fail", "a": {"b": 5}, "env": {"SLURM_NNODES": "2"}, "late": [1]},
            {"status": "ok", "a": {"b": 6, "c": 7}, "env": {}, "x": 3.5},
        ],
        # A value that is a dict in one record and plain (or a list) in others, either way round.
        [
            {"status": "ok", "v": "flat", "w": {"k": 1}},
            {"status": "ok", "v": {"torch": "2.4"}, "w": {"k": 2}},
            {"status": "ok", "v": "flat", "w": [1, 2]},
            {"status": "ok", "v": None, "w": {"k": 3, "j": {"deep": True}}},
        ],
        # A dotted key that collides with a flattened one; a record of top-level values only.
        [{"status": "ok", "b.x": "top", "b": {"x": "nested"}}, {"status": "ok"}],
    ],
)
def test_records_table_is_the_table_of_the_flattened_records(records: list[dict[str, object]]) -> None:
    # Built a column at a time per record shape, it must be what pandas makes of json_normalize's rows.
    expected = pd.json_normalize(copy.deepcopy(records), sep=".")
    table = _records_table(copy.deepcopy(records))
    assert list(table.columns) == list(expected.columns)
    pd.testing.assert_frame_equal(table, expected)


def test_keys_tell_true_from_one_and_print_integral_floats_as_ints() -> None:
    df = pd.DataFrame({"x": [True, 1, 1.0, 2.5, None, [1, 2]], "y": ["a", "a", "b", float("nan"), "c", "d"]})
    assert list(_join_str(df, ["x", "y"])) == ["True|a", "1|a", "1|b", "2.5|", "|c", "[1, 2]|d"]


def test_a_status_the_contract_does_not_know_is_a_failure_that_says_why(sweep: Path) -> None:
    # status 'OK' (a hand-written or another tool's record) or null read as "fail" with an empty
    # reason: a failure nobody explained, in results.md's Notes and the recommendation's counts.
    for run, status in (("0", "OK"), ("1", None)):
        path = sweep / "runs" / run / "result.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "status": status, "message": None}))
    rows = load_sweeps([sweep], queue=None).table.set_index("run_dir")
    assert rows.loc["runs/0", "outcome"] == rows.loc["runs/1", "outcome"] == "fail"
    assert rows.loc["runs/0", "reason"] == (
        "the record's status 'OK' is not one of ok, oom, nan, timeout, cancelled, error, interrupted"
    )
    assert rows.loc["runs/1", "reason"] == "the record gives no status (one of ok, oom, nan, timeout, cancelled, error, interrupted)"
    # A known failure keeps its own message.
    assert rows.loc["runs/5", "reason"].startswith("OutOfMemoryError")


def test_a_sec_per_iter_that_is_no_time_is_no_measurement(sweep: Path) -> None:
    # Hand-written or damaged records: sec_per_iter inf ranked last and read "margin: inf% faster
    # than the runner-up"; -5 sorted first in results.md. Neither is a time.
    for run, sec in (("0", float("inf")), ("1", -5.0), ("2", 0.0)):
        path = sweep / "runs" / run / "result.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "sec_per_iter": sec}))
    df = load_sweeps([sweep], queue=None).table
    rows = df.set_index("run_dir")
    assert rows.loc[["runs/0", "runs/1", "runs/2"], "sec_per_iter"].isna().all()
    assert rows.loc["runs/3", "sec_per_iter"] == 161.96
    (rec,) = recommend(df)
    assert rec.runs == 2 and "3 finished without a measured iteration" in rec.excluded
    assert "inf" not in format_recommendations([rec])


def test_a_sweep_given_twice_or_inside_another_is_refused(tmp_path: Path) -> None:
    # Read twice, its runs counted twice: "24 configs" for 12, "median of 2 runs" of one run.
    from analysis.records import AnalysisError, load_sweeps
    from tests.analysis.golden.build import build_sweep

    sweep = build_sweep(tmp_path / "s")
    (sweep / "inner").mkdir()
    for dirs in ([sweep, Path(f"{sweep}/")], [sweep, sweep / ".." / "s"], [sweep / "inner", sweep]):
        with pytest.raises(AnalysisError, match="give each sweep once"):
            load_sweeps(dirs, queue=None)


def test_a_layout_search_that_launched_nothing_is_named_as_such(tmp_path: Path) -> None:
    # search.top_k=0 leaves the ranking (search.csv) and nothing the analysis reads: it said only "holds no
    # readable result.json, plan.csv or manifest.jsonl", as of a directory with nothing of megasweep's in it.
    sweep = tmp_path / "searched"
    searched = subprocess.run(
        [sys.executable, "-m", "train", "-m", "hydra/sweeper=layouts", "hydra/launcher=plan", "hardware=a100_80gb",
         "search.nodes=[1]", "search.top_k=0", "search.show=0", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert searched.returncode == 0 and (sweep / SEARCH_FILE).exists(), searched.stderr
    with pytest.raises(AnalysisError) as info:
        load_sweeps([sweep], queue=None)
    assert str(info.value) == (
        f"sweep directory {sweep} holds no readable result.json, plan.csv or manifest.jsonl: nothing to analyse; its "
        "search.csv is a layout search's ranking of its feasible layouts, none launched (search.top_k=0): "
        "read it as it is, or search again with search.top_k=N and a launcher (hydra/launcher=plan plans them, slurm "
        "measures them)"
    )
