"""analysis.wandb_io on real offline W&B runs: a trainer run read back, analysis runs logged, failures.

The module fixture runs the real trainer once (tiny model, CPU, WANDB_MODE=offline), so the W&B
run it reads back is exactly what train.wandb_log writes; the result.json of the same run is the
reference the W&B route must reproduce.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from analysis.__main__ import main
from analysis.records import load_sweeps
from analysis.wandb_io import (
    ANALYSIS_JOB_TYPE,
    WandbRun,
    _fold_log,
    api_run_to_wandb_run,
    find_offline_run_files,
    log_analysis,
    offline_sweeps,
    read_offline_run,
    resolve_destination,
    run_to_record,
    runs_to_sweeps,
)
from tests.analysis.golden.build import build_sweep

REPO = Path(__file__).resolve().parents[2]
SWEEP = "wb_sweep"
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "model.vocab_size=256",
    "model.make_vocab_size_divisible_by=64",
    "parallelism.micro_batch_size=2",
    "parallelism.global_batch_size=4",
    "training.train_iters=3",
    "training.warmup_iters=1",
    "logger=offline",
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=10.0",  # a datasheet placeholder: the rules refuse a run with no peak
]
# Columns a W&B run carries: they must equal those built from the same run's result.json.
SAME = [
    "sweep",
    "run_dir",
    "outcome",
    "reason",
    "model",
    "hardware",
    "nodes",
    "devices",
    "dp",
    "tp",
    "pp",
    "mbs",
    "gbs",
    "seq_length",
    "size_params",
    "sec_per_iter",
    "tflops",
    "mfu",
    "pflops",
    "mem_gib",
    "mem_pred_gib",
    "mem_capacity_gib",
    "date",
    "layout_key",
    # In the trainer's W&B summary too: which config the run was, and its iterations' spread.
    "config_key",
    "sec_cv",
]


def _isolate_wandb(mp: pytest.MonkeyPatch, root: Path) -> None:
    # wandb keeps caches, artifact staging and settings under the home directory: not in tests.
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        mp.setenv(name, str(root / name.lower()))


@pytest.fixture(scope="module")
def trainer_sweep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """<tmp>/wb_sweep/0: one real trainer run with its result.json and its offline W&B run."""
    from hydra import compose, initialize_config_dir

    from conf.schema import to_run_config
    from train.trainer import run_training

    root = tmp_path_factory.mktemp("wandb_io")
    sweep = root / SWEEP
    with pytest.MonkeyPatch.context() as mp:
        _isolate_wandb(mp, root)
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            run = to_run_config(compose("config", overrides=SMALL))
        # The trainer's default group is the sweep directory's name, as under a Hydra multirun.
        run_training(run, output_dir=sweep / "0", overrides=SMALL, sweep_name=SWEEP)
        yield sweep


@pytest.fixture()
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _isolate_wandb(monkeypatch, tmp_path)
    return tmp_path


def _log_lines(run_file: Path) -> list[str]:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.splitlines()


def test_offline_run_rebuilds_the_result_json_table(trainer_sweep: Path) -> None:
    files = load_sweeps([trainer_sweep], queue=None).table
    wb = offline_sweeps([trainer_sweep])
    assert wb.labels == (SWEEP,)
    table = wb.table
    assert len(table) == len(files) == 1
    record = json.loads((trainer_sweep / "0" / "result.json").read_text())
    assert record["status"] == "ok" and table.loc[0, "outcome"] == "ok"
    pd.testing.assert_frame_equal(table[SAME], files[SAME], check_dtype=False)
    # The record's median, not the last iteration's throughput that W&B's auto-summary leaves
    # under the same name (see analysis.wandb_io._fix_samples_per_s).
    assert table.loc[0, "samples_per_s"] == pytest.approx(record["samples_per_s"], rel=1e-12)
    assert table.loc[0, "wandb_state"] == "finished" and table.loc[0, "wandb_group"] == SWEEP
    assert (
        table.loc[0, "config.model.hidden_size"] == 32
        and table.loc[0, "config.logger.wandb_mode"] == "offline"
    )


def test_record_fields_come_from_config_and_summary(trainer_sweep: Path) -> None:
    [(run_file, _)] = find_offline_run_files([trainer_sweep])
    run = read_offline_run(run_file, root=trainer_sweep)
    assert run.group == SWEEP and run.run_dir == "0" and run.job_type is None and run.state == "finished"
    assert [h["_step"] for h in run.history] == [1, 2, 3]
    record = run_to_record(run)
    assert record["world"] == {"world_size": 1, "dp": 1, "tp": 1, "pp": 1}  # rank / local_rank dropped
    assert record["hardware"] == "cpu" and isinstance(record["config"]["hardware"], dict)
    assert set(record["config"]) == {"model", "parallelism", "hardware", "cluster", "logger", "training", "search"}
    assert record["status"] == "ok" and record["wandb_has_result"] is True
    # Which config the run was and its iterations' spread are in the summary, as in its result.json.
    on_disk = json.loads((trainer_sweep / "0" / "result.json").read_text())
    assert record["overrides"] == on_disk["overrides"] and record["sec_per_iter_cv"] == on_disk["sec_per_iter_cv"]
    # A field the trainer may add later (params in config, env in summary) flows through.
    later = WandbRun(
        run_id="x",
        config={**run.config, "params": 123},
        summary={**run.summary, "env": {"A": "1"}},
        state="finished",
    )
    assert run_to_record(later)["params"] == 123 and run_to_record(later)["env"] == {"A": "1"}


def test_run_without_result_is_running_or_failed(trainer_sweep: Path) -> None:
    [(run_file, _)] = find_offline_run_files([trainer_sweep])
    lines = _log_lines(run_file)
    # The same log cut before its summary and exit: a job killed (or still going) mid-training.
    first_summary = next(i for i, line in enumerate(lines) if '"status":"ok"' in line)
    cut = [line for line in lines[:first_summary] if '"type":"exit"' not in line]
    running = _fold_log(cut, run_file, trainer_sweep)
    assert running.state == "running" and "status" not in running.summary
    failed = WandbRun(**{**running.__dict__, "run_id": "f", "state": "failed", "run_dir": "1"})
    table = runs_to_sweeps([running, failed]).table.set_index("run_dir")
    assert table.loc["0", "outcome"] == "running" and "no result yet" in table.loc["0", "reason"]
    assert table.loc["1", "outcome"] == "fail" and "W&B state: failed" in table.loc["1", "reason"]


def test_public_api_runs_convert_like_offline_ones(trainer_sweep: Path) -> None:
    [(run_file, _)] = find_offline_run_files([trainer_sweep])
    offline = read_offline_run(run_file, root=trainer_sweep)
    # The attributes wandb.apis.public.Run offers, holding this run's data.
    api_run = types.SimpleNamespace(
        id=offline.run_id,
        config=dict(offline.config),
        summary_metrics=dict(offline.summary),
        state="finished",
        name=offline.name,
        group=SWEEP,
        project="megasweep",
        entity="me",
        job_type=None,
        created_at=offline.start_time,
    )
    converted = api_run_to_wandb_run(api_run)
    assert converted.run_dir == "" and converted.entity == "me"
    a = runs_to_sweeps([converted]).table
    b = runs_to_sweeps([offline]).table
    cols = [c for c in SAME if c != "run_dir"]
    pd.testing.assert_frame_equal(a[cols], b[cols])
    assert a.loc[0, "run_dir"] == ""
    with pytest.raises(Exception, match="no training runs in group 'other'"):
        runs_to_sweeps([converted], group="other")


def test_analysis_run_logged_offline_and_never_read_as_a_training_run(
    trainer_sweep: Path, tmp_path: Path, wandb_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["--wandb-offline", str(trainer_sweep), "-o", str(out), "--wandb-log", "--no-queue"]) == 0
    stdout = capsys.readouterr().out
    assert "W&B (offline): analysis run in megasweep/wb_sweep" in stdout
    assert (out / "results.md").is_file() and len(pd.read_csv(out / "results.csv")) == 1
    [(log, _)] = find_offline_run_files([out])
    assert f"upload it with: wandb sync {log.parent}" in stdout, stdout
    run = read_offline_run(log)
    assert run.job_type == ANALYSIS_JOB_TYPE and run.group == SWEEP and run.project == "megasweep"
    assert run.summary["recommendation"].startswith("Fastest for tiny")
    assert run.summary["outcomes/ok"] == 1
    logged = run.history[0]
    assert logged["results._type"] == "table-file" and logged["results.nrows"] == 1
    assert {k.split(".")[0] for k in logged if k.startswith("plots/")} == {
        "plots/tflops_mfu",
        "plots/sec_per_iter_vs_nodes",
        "plots/memory_measured_vs_predicted",
    }
    # The analysis run sits in the sweep's group; reading the group back skips it.
    both = offline_sweeps([trainer_sweep, out])
    assert len(both.table) == 1 and both.labels == (SWEEP,)


def test_wandb_failure_never_fails_the_analysis(
    tmp_path: Path, wandb_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import wandb

    def broken_init(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("no route to api.wandb.ai")

    monkeypatch.setattr(wandb, "init", broken_init)
    sweep = build_sweep(tmp_path / "bloom_sweep")
    assert main([str(sweep), "--wandb-log", "--no-queue", "--no-plots"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "W&B" in line]
    assert warnings == [
        "warning: W&B logging skipped: wandb init failed: ConnectionError: no route to api.wandb.ai"
    ]
    assert (sweep / "analysis" / "results.md").is_file() and (sweep / "analysis" / "results.csv").is_file()


def test_log_failure_after_init_still_finishes(tmp_path: Path, wandb_env: Path) -> None:
    sweep = build_sweep(tmp_path / "bloom_sweep")
    df = load_sweeps([sweep], queue=None).table
    dest = resolve_destination(df, labels=("bloom_sweep",))
    missing_plot = tmp_path / "absent.png"
    run_dir, warning = log_analysis(
        df, dest=dest, out_dir=tmp_path, recommendation="r", results_markdown="m", plots=[missing_plot]
    )
    assert warning is not None and warning.startswith("W&B logging incomplete")
    assert run_dir is not None
    [(log, _)] = find_offline_run_files([Path(run_dir)])
    assert read_offline_run(log).state == "failed"


def test_destination_flags_then_records_then_defaults() -> None:
    df = pd.DataFrame(
        {
            "config.logger.wandb_project": ["proj", "proj"],
            "config.logger.wandb_entity": [None, "team"],
            "config.logger.wandb_group": [None, None],
            "config.logger.wandb_mode": ["online", "online"],
        }
    )
    d = resolve_destination(df, labels=("s1",), environ={})
    assert (d.project, d.entity, d.group, d.mode) == ("proj", "team", "s1", "online")
    d = resolve_destination(
        df, labels=("s1",), project="p", entity="e", group="g", environ={"WANDB_MODE": "offline"}
    )
    assert (d.project, d.entity, d.group, d.mode) == ("p", "e", "g", "offline")
    bare = resolve_destination(pd.DataFrame({"x": [1]}), labels=(), environ={})
    assert (bare.project, bare.entity, bare.group, bare.mode) == ("megasweep", None, None, "offline")
    # A sweep run with W&B disabled still gets a (local) analysis run when one is asked for...
    off = df.assign(**{"config.logger.wandb_mode": "disabled"})
    assert resolve_destination(off, labels=("s",), environ={}).mode == "offline"
    # ...but WANDB_MODE=disabled in the environment turns it off.
    assert resolve_destination(off, labels=("s",), environ={"WANDB_MODE": "disabled"}).mode == "disabled"
    assert log_analysis(
        df,
        dest=resolve_destination(off, labels=("s",), environ={"WANDB_MODE": "disabled"}),
        out_dir=Path("."),
        recommendation="",
        results_markdown="",
    ) == (
        None,
        "W&B logging skipped: WANDB_MODE is disabled",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--wandb", "e/p"], "--wandb needs --group"),
        (["--wandb", "not-a-path", "--group", "g"], "--wandb wants ENTITY/PROJECT"),
        (["somewhere", "--wandb-offline", "x"], "one of them"),
        ([], "one of them"),
        (["somewhere", "--group", "g"], "--group selects W&B runs"),
    ],
)
def test_cli_source_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_offline_dir_without_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--wandb-offline", str(tmp_path)]) == 2
    assert "holds no W&B run log" in capsys.readouterr().err
