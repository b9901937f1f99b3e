"""`python -m analysis` (analysis/__main__.py): the ZeRO comparison it writes, from fixture records and
from a real sweep over parallelism.engine, zero_stage and offload on the local Slurm cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import pytest

from analysis.__main__ import main
from tests.analysis.golden.build import build_sweep, fixture
from tests.analysis.test_tables import zero_sweep_dir
from tests.launchers.test_slurm_launcher import REPO
from train.contract import EXIT_FAILED, EXIT_UNFINISHED, EXIT_USAGE, read_manifest

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

ZERO_SECTION = "## ZeRO comparison"


def zero_section(results_md: str) -> list[list[str]]:
    """The ZeRO comparison table of results.md as rows of cells: the header, then one row per variant."""
    assert ZERO_SECTION + "\n\n|" in results_md, results_md
    table = []
    for line in results_md.split(ZERO_SECTION + "\n\n", 1)[1].splitlines():
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [table[0], *table[2:]]  # without the alignment rule


def test_cli_writes_the_zero_section_and_zero_csv(tmp_path: Path) -> None:
    sweep = zero_sweep_dir(tmp_path / "zero")
    assert main([str(sweep), "--no-queue", "--no-plots"]) == 0
    out = sweep / "analysis"
    md = (out / "results.md").read_text()
    rows = zero_section(md)
    assert rows[0] == ["model \\ nodes*devices", "1*8", "4*8"]
    # After Scaling, before Missing, as results_markdown orders them.
    assert md.index("## Scaling") < md.index(ZERO_SECTION) < md.index("## Missing")
    csv = pd.read_csv(out / "zero.csv")
    assert csv["variant"].drop_duplicates().tolist() == [r[0] for r in rows[1:]]
    ds3 = csv[(csv["variant"] == "bert_345m (mp=1) with deepspeed zero3") & (csv["scale"] == "4*8")].iloc[0]
    assert (ds3["engine"], ds3["zero_stage"], ds3["offload"], ds3["nodes"], ds3["devices"]) == (
        "deepspeed", 3, "none", 4, 32)
    assert ds3["samples_per_s"] == pytest.approx(1001.94) and ds3["tflops"] == pytest.approx(0.52)


def test_cli_writes_no_zero_table_when_the_sweep_does_not_vary_the_engine(tmp_path: Path) -> None:
    # The golden BLOOM sweep: one engine setting (native ZeRO-1) throughout.
    sweep = build_sweep(tmp_path / "bloom_sweep")
    assert main([str(sweep), "--no-queue", "--no-plots"]) == 0
    out = sweep / "analysis"
    assert ZERO_SECTION not in (out / "results.md").read_text()
    assert (out / "scaling.csv").exists() and not (out / "zero.csv").exists()


def test_an_earlier_analysiss_zero_table_is_not_left_beside_this_ones(tmp_path: Path) -> None:
    # The ZeRO sweep analysed into one output directory, then the BLOOM sweep into the same one: its
    # results.md had no ZeRO section, and the ZeRO sweep's zero.csv stayed beside it as if it were its own.
    out = tmp_path / "out"
    assert main([str(zero_sweep_dir(tmp_path / "zero")), "--no-queue", "--no-plots", "-o", str(out)]) == 0
    assert (out / "zero.csv").exists()
    assert main([str(build_sweep(tmp_path / "bloom_sweep")), "--no-queue", "--no-plots", "-o", str(out)]) == 0
    assert ZERO_SECTION not in (out / "results.md").read_text() and not (out / "zero.csv").exists()


def test_bad_input_ends_the_plotting_process_whatever_its_sigterm_handler(tmp_path: Path) -> None:
    # A process whose SIGTERM handler only records the signal (a trainer's, in a test process) analysed a
    # directory that does not exist: the plotting process it had forked inherited the handler and the
    # parent's end of their pipe, so it waited for a table for ever, and the parent for it (a pytest
    # worker hung so; `timeout`'s SIGTERM could not end it either).
    script = (
        "import signal, sys\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"
        "from analysis.__main__ import main\n"
        f"sys.exit(main([{str(tmp_path / 'missing')!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("missing does not exist"), proc.stderr


def test_no_plots_leaves_no_earlier_analysiss_plots_beside_this_ones_tables(tmp_path: Path) -> None:
    # An earlier analysis's plots (of other sweeps, or of fewer runs) in the output directory stayed
    # beside the new tables under --no-plots, as if drawn from them (a plot with nothing to draw goes).
    from analysis.plots import PLOT_FILES

    out = tmp_path / "out"
    out.mkdir()
    for name in PLOT_FILES:
        (out / name).write_bytes(b"an earlier analysis's plot")
    assert main([str(build_sweep(tmp_path / "bloom_sweep")), "--no-queue", "--no-plots", "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.md", "scaling.csv"]


# ---------------------------------------------------------------------------------------------
# End to end on the local Slurm cluster


# The smallest model every engine setting can shard over dp=2 (test_e2e_sweep's SMALL), one measured
# iteration after one warm-up (a first DeepSpeed step carries its lazy set-up: no figure to compare),
# a stated CPU peak (a calibration per rank would cost seconds each), no W&B (the analysis reads
# result.json), and one thread per rank: the ranks take turns on the cluster's two cores (its `cores` license).
TINY = (
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "model.vocab_size=512",
    "training.train_iters=2",
    "training.warmup_iters=1",
    "parallelism.micro_batch_size=1",
    "parallelism.global_batch_size=2",
    "parallelism.precision=fp32",
    "hardware=cpu",
    "hardware.devices_per_node=2",
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=1.0",
    "logger=disabled",
    "+cluster.env.OMP_NUM_THREADS=1",
)
# parallelism/<name>.yaml: (engine, zero_stage, offload) -> the row the ZeRO table gives it. The native
# engine refuses stages 2-3 and offload (train/validation.py), hence one native row: the baseline.
# Two stages and offload make the sweep; each DeepSpeed job costs ~20 CPU-seconds of start-up on the
# test machine's two cores, so stages 0 and 2 (run in tests/train/test_ds_engine.py) are left out.
VARIANTS = {
    "native": (("native", 0, "none"), "tiny (mp=1)"),
    "ds_zero1": (("deepspeed", 1, "none"), "tiny (mp=1) with deepspeed zero1"),
    "ds_zero3": (("deepspeed", 3, "none"), "tiny (mp=1) with deepspeed zero3"),
    "ds_zero3_offload": (("deepspeed", 3, "optimizer"), "tiny (mp=1) with deepspeed zero3+offload(optimizer)"),
}
# A hang guard, not a speed target: a fresh machine also compiles DeepSpeed's CPU ops once, while
# make test's other worker shares the two cores.
SWEEP_TIMEOUT_S = 600
CELL = re.compile(r"^(\d+\.\d\d) samples/sec  (\d+\.\d\d|\d\.\d\de-\d\d) tflops/dev$")


def write_variants(config_dir: Path) -> None:
    """One parallelism/<name>.yaml per variant, dp=2 over the `single` option, as a user would write them."""
    group = config_dir / "parallelism"
    group.mkdir(parents=True)
    for name, ((engine, zero, offload), _) in VARIANTS.items():
        (group / f"{name}.yaml").write_text(
            f"defaults:\n  - single\n  - _self_\n\ndp: 2\nengine: {engine}\nzero_stage: {zero}\noffload: {offload}\n",
            encoding="utf-8",
        )


def test_zero_sweep_on_slurm_renders_the_zero_comparison(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    config_dir, sweep_dir, out = tmp_path / "conf", tmp_path / "zero-sweep", tmp_path / "analysis"
    write_variants(config_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_RUN_GROUP")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "train", "-m", f"--config-dir={config_dir}", *TINY,
            f"parallelism={','.join(VARIANTS)}", f"hydra.sweep.dir={sweep_dir}",
            "hydra/launcher=slurm", "hydra.launcher.wait=true",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{len(VARIANTS)} configs: {len(VARIANTS)} submitted" in proc.stdout, proc.stdout

    # wait=true: every job has ended, so every record is there; each really ran its engine setting.
    for entry in read_manifest(sweep_dir):
        record = json.loads((sweep_dir / entry.output_dir / "result.json").read_text())
        name = next(o.split("=", 1)[1] for o in entry.overrides if o.startswith("parallelism="))
        (engine, zero, offload), _ = VARIANTS[name]
        assert record["status"] == "ok", (name, record.get("message"))
        assert record["world"] == {"world_size": 2, "dp": 2, "tp": 1, "pp": 1}, name
        par = record["config"]["parallelism"]
        assert (par["engine"], par["zero_stage"], par["offload"]) == (engine, zero, offload), name
        assert record["optimizer"].startswith("deepspeed:" if engine == "deepspeed" else "torch."), record["optimizer"]

    analysed = subprocess.run(
        [sys.executable, "-m", "analysis", str(sweep_dir), "-o", str(out), "--no-plots"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert analysed.returncode == 0, analysed.stdout + analysed.stderr
    assert "zero.csv" in analysed.stdout, analysed.stdout
    rows = zero_section((out / "results.md").read_text(encoding="utf-8"))
    # One row per variant in the seed's order (baseline, then DeepSpeed by stage, offload last),
    # one column: every job was one node of two devices.
    assert rows[0] == ["model \\ nodes*devices", "1*2"], rows
    assert [r[0] for r in rows[1:]] == [label for _, label in VARIANTS.values()], rows
    cells = {}
    for label, cell in rows[1:]:
        match = CELL.match(cell)
        assert match, (label, cell)
        assert float(match[1]) > 0 and float(match[2]) > 0, (label, cell)
        cells[label] = (match[1], match[2])

    csv = pd.read_csv(out / "zero.csv")
    assert csv["variant"].tolist() == list(cells)
    assert (csv["scale"] == "1*2").all() and (csv["outcome"] == "ok").all()
    for row in csv.itertuples():
        (engine, zero, offload), _ = next(v for v in VARIANTS.values() if v[1] == row.variant)
        assert (row.engine, row.zero_stage, row.offload, row.tp, row.pp) == (engine, zero, offload, 1, 1)
        # The markdown's cell is the CSV's figures, rounded as the table writes them.
        samples, tflops = cells[str(row.variant)]
        assert samples == f"{row.samples_per_s:.2f}"
        assert tflops == (f"{row.tflops:.2f}" if row.tflops >= 0.01 else f"{row.tflops:.2e}")


def test_a_dry_runs_directory_is_planned_not_run_and_draws_no_empty_plots(tmp_path: Path) -> None:
    from tests.launchers.test_plan import run_train
    from train.contract import read_plan_csv

    # A real dry run: feasible layouts with predictions (A100), infeasible ones (tp=3, pp=3) skipped.
    sweep = tmp_path / "plan"
    planned = run_train("-m", "model=gpt_350m", "hardware=a100_80gb", "parallelism.tp=1,2,3,4",
                        "parallelism.pp=1,3,4", "hydra/launcher=plan", "hydra.launcher.world_size=16",
                        "hydra.launcher.table=false", f"hydra.sweep.dir={sweep}")
    assert planned.returncode == 0, planned.stderr
    rows = read_plan_csv(sweep / "plan.csv")
    feasible = [r for r in rows if r.feasible]
    assert 0 < len(feasible) < len(rows)
    # A stale plot of an earlier analysis is not left to pass for this one's.
    (sweep / "analysis").mkdir()
    (sweep / "analysis" / "tflops_mfu.png").write_bytes(b"old")

    proc = subprocess.run([sys.executable, "-m", "analysis", str(sweep), "--no-queue"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = f"{len(rows)} configs: {len(rows) - len(feasible)} skipped, {len(feasible)} planned, not run"
    assert proc.stdout.startswith(summary + "\n"), proc.stdout
    assert "pending" not in proc.stdout and "Missing" not in proc.stdout
    assert f"This is a dry run: {len(feasible)} config(s) planned, not run" in proc.stdout
    assert f"Planned, not run ({len(feasible)} feasible config(s)" in proc.stdout
    # The planned configs, fastest predicted first, with the plan's figures.
    fastest = min(feasible, key=lambda r: r.pred_sec_per_iter)
    listed = [line for line in proc.stdout.splitlines() if "hardware=a100_80gb model=gpt_350m" in line]
    assert len(listed) == len(feasible)
    assert f"parallelism.pp={fastest.pp} parallelism.tp={fastest.tp}" in listed[0]
    assert f"{100 * fastest.pred_mfu:.1f}%" in listed[0]
    # No plot: nothing was measured; the console says so, and no PNG is left behind.
    assert "plots not drawn: tflops_mfu.png (no successful run" in proc.stdout
    out = sweep / "analysis"
    assert not list(out.glob("*.png"))
    md = (out / "results.md").read_text()
    assert summary + "." in md and "## Planned, not run" in md and "pending" not in md
    assert md.count("hardware=a100_80gb model=gpt_350m") == len(feasible)


def test_a_dry_run_added_to_a_launched_sweep_lists_its_configs_never_launched(tmp_path: Path) -> None:
    from tests.launchers.test_plan import run_train

    # A sweep exported for sbatch (its manifest lists two configs), then a dry run added to it: the
    # analysis showed only the two pending configs, as if the dry run had never been made.
    sweep = tmp_path / "sweep"
    exported = subprocess.run(
        [sys.executable, "-m", "launchers", "sbatch", f"--sweep-dir={sweep}", f"--out-dir={tmp_path / 'scripts'}",
         "training.lr=1e-4,3e-4"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    # One of the configs planned is the sweep's own (lr 1e-4): its row is the manifest's, not a second one.
    # The same dry run added twice plans its configs twice: each is one row.
    for _ in range(2):
        planned = run_train("-m", "training.lr=1e-4,1e-3", "hydra/launcher=plan", "hydra.launcher.append=true",
                            "hydra.launcher.table=false", f"hydra.sweep.dir={sweep}")
        assert planned.returncode == 0, planned.stderr
    proc = subprocess.run([sys.executable, "-m", "analysis", str(sweep), "--no-queue"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    # Nothing has run yet and two configs are still to: no recommendation yet, which a script can tell.
    assert proc.returncode == EXIT_UNFINISHED, proc.stderr
    assert proc.stderr.endswith("analysis: no recommendation yet: 2 config(s) still pending or running "
                                f"(python -m launchers status --wait {sweep} waits for them)\n"), proc.stderr  # fmt: skip
    assert proc.stdout.startswith("3 configs: 2 pending, 1 planned, not run\n"), proc.stdout
    assert "Planned, not run (1 feasible config(s)" in proc.stdout
    assert "training.lr=0.001" in proc.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--maxnodes", "2"], "unrecognized arguments: --maxnodes; did you mean --max-nodes? (see python -m analysis --help)"),
        (["compare", "a", "b", "--outt", "x"],
         "unrecognized arguments: --outt x; did you mean --out? (see python -m analysis compare --help)"),
    ],
)
def test_a_misspelt_option_is_one_line_with_the_close_one(args: list[str], words: str) -> None:
    # argparse's message named the option but not the one meant; a command's help is its own (the
    # main help, where it pointed, documents no compare option).
    proc = subprocess.run([sys.executable, "-m", "analysis", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr == f"error: {words}\n"


def test_the_help_names_the_compare_and_calibrate_commands() -> None:
    proc = subprocess.run([sys.executable, "-m", "analysis", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "python -m analysis compare" in proc.stdout
    assert "python -m analysis calibrate" in proc.stdout


def test_the_compare_help_says_what_each_argument_is() -> None:
    # --match listed its three choices and nothing of what they pair; before and after had no words.
    proc = subprocess.run([sys.executable, "-m", "analysis", "compare", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "pair configs by their overrides" in text and "by overrides, else by layout" in text
    assert "sweep directory before the change" in text and "sweep directory after the change" in text


def test_a_misspelt_command_is_named_beside_the_missing_sweep_directory(tmp_path: Path) -> None:
    # `calibrat` was read as a sweep directory, and only its absence was said.
    proc = subprocess.run([sys.executable, "-m", "analysis", "calibrat", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr == "error: sweep directory calibrat does not exist; did you mean python -m analysis calibrate?\n"


@pytest.mark.parametrize("where", ["file", "under_a_file", "sysfs"])
def test_an_output_directory_that_cannot_be_written_is_named_by_its_option(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # mkdir's OSError said "File exists: <path>" or "Operation not permitted: /sys/x", naming no option,
    # and only once the sweeps were loaded.
    sweep = zero_sweep_dir(tmp_path / "zero")
    (tmp_path / "a_file").write_text("")
    out = {"file": tmp_path / "a_file", "under_a_file": tmp_path / "a_file" / "sub",
           "sysfs": Path("/sys/megasweep-test/out")}[where]  # fmt: skip
    why = {"file": "it is a file", "under_a_file": f"{tmp_path / 'a_file'} is a file", "sysfs": ""}[where]
    for command in ([str(sweep), "--no-plots"], ["compare", str(sweep), str(sweep)]):
        assert main([*command, "-o", str(out), "--no-queue"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.startswith(f"error: -o {out}: cannot write the analysis there ({why}"), err
    assert not (sweep / "analysis").exists()
    # A writable -o is made only once the sweeps have loaded: a refusal leaves no empty directory.
    assert main([str(tmp_path / "no_sweep"), "-o", str(tmp_path / "new" / "out"), "--no-queue"]) == EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_the_exit_status_says_whether_a_layout_is_recommended(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It was 0 whether a layout was recommended or none could be (every run failed, the constraints left
    # none, the sweep had yet to run): a script could not tell an answer from its absence.
    def analyse(sweep: Path, *options: str) -> tuple[int, str]:
        code = main([str(sweep), "--no-queue", "--no-plots", "-o", str(tmp_path / "out"), *options])
        return code, capsys.readouterr().err

    data = fixture()
    under_way = build_sweep(tmp_path / "under_way", data)  # one config still pending
    assert analyse(under_way) == (0, "analysis: the recommendation may change: 1 config(s) still pending or "
                                     f"running (python -m launchers status --wait {under_way} waits for them)\n")  # fmt: skip
    assert analyse(under_way, "--max-mem-gib", "0.001") == (
        EXIT_UNFINISHED, "analysis: no recommendation yet: 1 config(s) still pending or running "
        f"(python -m launchers status --wait {under_way} waits for them)\n")  # fmt: skip
    over = build_sweep(tmp_path / "over", {**data, "runs": [r for r in data["runs"] if not r.get("pending")]})
    assert analyse(over) == (0, "")
    assert analyse(over, "--max-mem-gib", "0.001") == (
        EXIT_FAILED, "analysis: no recommendation: no run that ended qualifies (see above)\n")
    assert (tmp_path / "out" / "results.md").is_file()  # the tables are written all the same
    # A plan (or launch) whose every config is infeasible is no answer either: it exited 0.
    skipped = build_sweep(tmp_path / "skipped", {**data, "runs": [r for r in data["runs"] if r.get("status") == "skipped"]})
    assert analyse(skipped) == (EXIT_FAILED, "analysis: no recommendation: every config is infeasible (skipped) "
                                             "(see above)\n")  # fmt: skip
