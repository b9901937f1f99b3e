"""`hydra/launcher=plan`: one planned row per config, plan.csv in the sweep dir, nothing run, no torch."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.utils import JobStatus

from launchers.compose import FastComposer
from launchers.plan import _more_line, plan_sweep, shown_in_turn
from train.contract import EXIT_USAGE, ManifestEntry, PlanRow, read_plan_csv, write_manifest
from train.planner.plan import format_plan_table, plan_run, table_order

REPO = Path(__file__).resolve().parents[2]
TRAIN_MAIN = REPO / "train" / "__main__.py"

# Runs `python -m train <args>` and reports, at exit, whether torch was ever imported.
_RUN_TRAIN = """
import atexit, runpy, sys
atexit.register(lambda: print("TORCH_IMPORTED=" + str("torch" in sys.modules)))
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def run_train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RUN_TRAIN, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_dry_run_refuses_configs_that_would_share_an_output_directory(tmp_path: Path) -> None:
    # The launch refuses a subdir that names two configs' directories alike; the dry run passed it.
    for launcher in ("plan", "local"):
        proc = run_train("-m", "hydra.sweep.subdir=${parallelism.micro_batch_size}", "training.lr=1e-4,3e-4",
                         f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path / launcher}")  # fmt: skip
        assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("error: hydra.sweep.subdir gives configs 0 and 1 the same output directory "), proc.stderr
        assert not (tmp_path / launcher).exists()  # nor its multirun.yaml
    # Added to a sweep whose config 0 has that directory already, as the launchers judge it.
    sweep_dir = tmp_path / "added"
    sweep_dir.mkdir()
    write_manifest([ManifestEntry(0, ("training.lr=0.0001",), "0.0001", "submitted")], sweep_dir / "manifest.jsonl")
    added = run_train("-m", "hydra.sweep.subdir=${training.lr}", "training.lr=1e-4", "hydra/launcher=plan",
                      "hydra.launcher.append=true", f"hydra.sweep.dir={sweep_dir}")  # fmt: skip
    assert added.returncode == EXIT_USAGE, added.stdout + added.stderr
    assert "gives configs 0 and 1 the same output directory '0.0001'" in added.stderr, added.stderr
    # The default subdir (the index) too, where the sweep's own named config 0's directory "1".
    write_manifest([ManifestEntry(0, ("training.lr=0.0001",), "1", "submitted")], sweep_dir / "manifest.jsonl")
    default = run_train("-m", "training.lr=2e-4", "hydra/launcher=plan", "hydra.launcher.append=true",
                        f"hydra.sweep.dir={sweep_dir}")  # fmt: skip
    assert default.returncode == EXIT_USAGE and "configs 0 and 1 the same output directory '1'" in default.stderr, (
        default.stdout + default.stderr
    )


def test_a_dry_run_added_to_a_plan_whose_rows_do_not_read_is_refused(tmp_path: Path) -> None:
    # The plan is rewritten with the added rows: a row that does not read would be dropped from it, so
    # the dry run is refused (it raised TypeError's traceback) and the plan is left as it was.
    first = run_train("-m", "parallelism.micro_batch_size=1,2", "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path}")
    assert first.returncode == 0, first.stderr
    plan = tmp_path / "plan.csv"
    damaged = plan.read_text()[:-20]  # the last row cut short
    plan.write_text(damaged)
    added = run_train("-m", "parallelism.micro_batch_size=4", "hydra/launcher=plan", "hydra.launcher.append=true",
                      f"hydra.sweep.dir={tmp_path}")  # fmt: skip
    assert added.returncode == EXIT_USAGE, added.stdout + added.stderr
    assert added.stderr.startswith("error: hydra.launcher.append=true: the plan added to cannot be read ("), added.stderr
    assert "plan.csv, line 3: " in added.stderr and "Traceback" not in added.stderr
    assert plan.read_text() == damaged


def test_plan_sweep_plans_and_runs_nothing(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "model=tiny,gpt_1.3b",
        "parallelism.tp=1,2,3",
        "hydra/launcher=plan",
        f"hydra.sweep.dir={sweep_dir}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "TORCH_IMPORTED=False" in proc.stdout

    rows = read_rows(sweep_dir / "plan.csv")
    assert len(rows) == 6
    assert {r["overrides"] for r in rows} == {
        f"model={m} parallelism.tp={tp}" for m in ("tiny", "gpt_1.3b") for tp in (1, 2, 3)
    }
    for row in rows:
        assert row["model"] in ("tiny", "gpt_1.3b")
        if row["tp"] == "3":
            # 3 divides neither 4 nor 16 heads.
            assert row["feasible"] == "False"
            assert "parallelism.tp=3" in row["reasons"]
        assert float(row["model_flops_per_iter"]) > 0 or row["tp"] == "3"
    tiny_tp1 = next(r for r in rows if r["overrides"] == "model=tiny parallelism.tp=1")
    assert tiny_tp1["feasible"] == "True" and tiny_tp1["reasons"] == ""
    assert int(tiny_tp1["params"]) > 1_000_000 and float(tiny_tp1["mem_gib"]) > 0

    # The feasible rows on the console, one per config; the infeasible ones counted by rule, and the summary.
    assert proc.stdout.count("\nok ") == sum(r["feasible"] == "True" for r in rows)
    assert "INFEASIBLE" not in proc.stdout
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("infeasible: ")]
    assert line.startswith(f"infeasible: {sum(r['feasible'] == 'False' for r in rows)} configs: ")
    assert "[heads_divisible_by_tp] 2" in line  # the two tp=3 configs
    assert "plan: 6 configs:" in proc.stdout
    # A CPU's peak is measured at run time: no row is predicted, and the console says why, once.
    feasible = [r for r in rows if r["feasible"] == "True"]
    assert all(r["pred_note"].startswith("hardware 'cpu' measures its peak at run time") for r in feasible)
    assert f"\nnot predicted: {len(feasible)} feasible config(s)" in proc.stdout
    assert proc.stdout.count("measures its peak at run time") == 1
    # Nothing ran: no job directories, no results.
    assert not list(sweep_dir.rglob("result.json"))
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["multirun.yaml", "plan.csv"]


def test_a_dry_run_where_nothing_is_feasible_exits_non_zero_after_its_report(tmp_path: Path) -> None:
    # The same launch with hydra/launcher=slurm or local would fail (nothing submitted): a script
    # that plans first must be able to stop there. The table and plan.csv still say why.
    sweep_dir = tmp_path / "sweep"
    proc = run_train("-m", "parallelism.tp=0,3", "hydra/launcher=plan", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == EXIT_USAGE, proc.stderr  # nothing can run: bad input, as a single run's
    assert "Nothing would be submitted: all 2 configs are infeasible" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "plan: 2 configs: 0 feasible, 2 infeasible" in proc.stdout
    assert "[positive] 1" in proc.stdout and "[ffn_divisible_by_tp] 1" in proc.stdout
    assert [r["feasible"] for r in read_rows(sweep_dir / "plan.csv")] == ["False", "False"]


def test_plan_of_a_thousand_configs(tmp_path: Path) -> None:
    # 4 x 5 x 5 x 5 x 2 = 1,000 configs: seconds, where one Hydra composition per job takes minutes.
    sweep_dir = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "parallelism.tp=1,2,4,8",
        "parallelism.pp=1,2,4,8,16",
        "parallelism.micro_batch_size=1,2,4,8,16",
        "model=gpt_350m,gpt_1.3b,gpt_2.7b,gpt_6.7b,gpt_13b",
        "hardware=a100_80gb,h100_sxm",
        "parallelism.global_batch_size=512",
        "hydra/launcher=plan",
        "hydra.launcher.table=false",
        "hydra.launcher.world_size=64",
        f"hydra.sweep.dir={sweep_dir}",
    )
    assert proc.returncode == 0, proc.stderr
    rows = read_rows(sweep_dir / "plan.csv")
    assert len(rows) == 1000
    assert len({r["overrides"] for r in rows}) == 1000
    assert {r["devices"] for r in rows} == {"64"}
    feasible = sum(r["feasible"] == "True" for r in rows)
    assert 0 < feasible < 1000
    assert f"plan: 1,000 configs: {feasible:,} feasible" in proc.stdout
    assert "INFEASIBLE" not in proc.stdout  # table=false: summary only


def test_top_limits_the_table_and_infeasible_configs_are_counted_by_rule(tmp_path: Path) -> None:
    # Predictable hardware, so that the table is ordered by predicted time; tp=3, pp=3, the 13B model
    # without enough devices and the small global batch break several different rules.
    sweep_dir = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "model=gpt_350m,gpt_13b",
        "hardware=a100_80gb",
        "parallelism.tp=1,2,3,4",
        "parallelism.pp=1,3,4",
        "parallelism.micro_batch_size=1,4",
        "hydra/launcher=plan",
        "hydra.launcher.world_size=16",
        "hydra.launcher.top=3",
        f"hydra.sweep.dir={sweep_dir}",
    )
    assert proc.returncode == 0, proc.stderr
    rows = read_plan_csv(sweep_dir / "plan.csv")
    assert len(rows) == 48  # plan.csv has every row, whatever the console shows
    feasible = [r for r in rows if r.feasible]
    infeasible = [r for r in rows if not r.feasible]
    assert len(feasible) > 3 and infeasible

    # Three rows: each model's fastest in turn (the two models' rank 1, then gpt_350m's rank 2), listed
    # model by model, fastest first; the three fastest of all were gpt_350m's alone.
    shown = [r for model in ("gpt_350m", "gpt_13b") for r in table_order(feasible) if r.model == model]
    shown = [r for r in shown if r.pred_rank <= (2 if r.model == "gpt_350m" else 1)]
    assert [(r.model, r.pred_rank) for r in shown] == [("gpt_350m", 1), ("gpt_350m", 2), ("gpt_13b", 1)]
    assert format_plan_table(shown) + "\n" in proc.stdout
    assert proc.stdout.count("\nok ") == 3 and "INFEASIBLE" not in proc.stdout
    assert f"... {len(feasible) - 3} more feasible config(s), each slower than its work's shown ones or unpredicted, in" in proc.stdout
    # A work with fewer rows leaves its turns to the others; top 0 shows none, a top past them all every row.
    ordered = table_order(feasible)
    large = [r for r in ordered if r.model == "gpt_13b"]
    small = [r for r in ordered if r.model == "gpt_350m"]
    assert len(small) >= 4 and len(large) >= 2
    assert shown_in_turn(table_order(small + large[:2]), 6) == small[:4] + large[:2]
    assert shown_in_turn(ordered, 0) == [] and shown_in_turn(ordered, len(ordered) + 5) == small + large
    assert shown_in_turn(small, 2) == small[:2]
    # A row without a prediction never pushes out another work's predicted one; it fills places left.
    unpredicted = dataclasses.replace(small[2], pred_rank=0, pred_sec_per_iter=math.nan)
    mixed = table_order([*small[:2], unpredicted, *large[:3]])
    assert shown_in_turn(mixed, 5) == [*small[:2], *large[:3]]
    assert shown_in_turn(mixed, 6) == [*small[:2], unpredicted, *large[:3]]
    # A work the table shows nothing of is said, not left out without a word.
    assert "(1 work(s) with none shown), in plan.csv" in _more_line(ordered, shown_in_turn(ordered, 1), "plan.csv")
    assert "slower or unpredicted, in plan.csv" in _more_line(small, small[:1], "plan.csv")


    # One count per rule, as plan.csv's reasons have them, most common first.
    expected: dict[str, int] = {}
    for row in infeasible:
        for rule in {re.match(r"\[(\w+)\]", reason).group(1) for reason in row.reasons}:  # type: ignore[union-attr]
            expected[rule] = expected.get(rule, 0) + 1
    assert len(expected) >= 4
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("infeasible: ")]
    assert line.startswith(f"infeasible: {len(infeasible)} configs: ")
    printed = {rule: int(n) for rule, n in re.findall(r"\[(\w+)\] (\d+)", line)}
    assert printed == expected
    assert list(printed.values()) == sorted(printed.values(), reverse=True)
    # One example line per rule, naming a config that breaks it.
    examples = [x for x in proc.stdout.splitlines() if x.startswith("  [")]
    assert [re.match(r"  \[(\w+)\] e\.g\. ", x).group(1) for x in examples] == list(printed)  # type: ignore[union-attr]
    by_overrides = {r.overrides: r for r in infeasible}
    for rule, example in zip(printed, examples, strict=True):
        overrides = example.split(" e.g. ", 1)[1].split(": ", 1)[0]
        assert any(reason.startswith(f"[{rule}]") for reason in by_overrides[overrides].reasons)


def test_a_plan_for_a_given_world_advises_memory_fixes_on_that_world(tmp_path: Path) -> None:
    # hydra.launcher.world_size=8: a fix that kept dp=8 (tp=4: 32 devices) was refused when planned again.
    args = ("-m", "model=gpt_2.7b", "hardware=a100_40gb", "parallelism.precision=bf16", "parallelism.global_batch_size=64",
            "parallelism.dp=8", "hydra/launcher=plan", "hydra.launcher.world_size=8")  # fmt: skip
    proc = run_train(*args, f"hydra.sweep.dir={tmp_path / 'a'}")
    assert proc.returncode == EXIT_USAGE, proc.stderr
    (row,) = read_plan_csv(tmp_path / "a" / "plan.csv")
    assert ("(the world of 8 devices kept, overrides as Hydra takes them): parallelism.tp=4 parallelism.dp=2, "
            "parallelism.pp=4 parallelism.dp=2.") in row.reasons[0], row.reasons  # fmt: skip
    proc = run_train(*args, "parallelism.tp=4", "parallelism.dp=2", f"hydra.sweep.dir={tmp_path / 'b'}")
    assert proc.returncode == 0 and read_plan_csv(tmp_path / "b" / "plan.csv")[0].feasible, proc.stderr


def test_console_output_stays_bounded_for_a_large_plan(tmp_path: Path) -> None:
    # 800 configs: the console gets the default 30 rows and a line per rule, not a row per config.
    proc = run_train(
        "-m",
        "parallelism.tp=1,2,3,4,8",
        "parallelism.pp=1,2,3,4,8",
        "parallelism.micro_batch_size=1,2,4,8",
        "model=gpt_350m,gpt_1.3b,gpt_13b,gpt_30b",
        "training.lr=1e-4,2e-4",
        "hardware=a100_80gb",
        "parallelism.global_batch_size=512",
        "hydra/launcher=plan",
        "hydra.launcher.world_size=64",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    rows = read_plan_csv(tmp_path / "plan.csv")
    assert len(rows) == 800 and sum(r.feasible for r in rows) > 30
    lines = proc.stdout.splitlines()
    rules = len({reason.split("]")[0] for r in rows for reason in r.reasons})
    # Header, 30 rows, the 'more' line, the rules line and its examples, the summary (and the torch probe).
    assert len(lines) <= 1 + 30 + 1 + 1 + rules + 2
    assert proc.stdout.count("\nok ") == 30
    assert len(proc.stdout) < 40_000


def test_top_null_prints_every_feasible_row_and_a_negative_top_or_world_size_is_refused_once(tmp_path: Path) -> None:
    args = ("-m", "model=tiny", "parallelism.pp=1,2,3,4", "hydra/launcher=plan")
    proc = run_train(*args, "hydra.launcher.top=null", f"hydra.sweep.dir={tmp_path / 'all'}")
    assert proc.returncode == 0, proc.stderr
    feasible = [r for r in read_plan_csv(tmp_path / "all" / "plan.csv") if r.feasible]
    assert proc.stdout.count("\nok ") == len(feasible) == 3 and "more feasible" not in proc.stdout
    proc = run_train(*args, "hydra.launcher.top=-1", f"hydra.sweep.dir={tmp_path / 'neg'}")
    # Bad input, in one line (it was Hydra's "Error in call to target", exit 1), and nothing written.
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: hydra.launcher.top=-1: the plan table shows a whole number of feasible rows, 0 or more; null shows them all"
    ]
    assert not (tmp_path / "neg").exists()
    # A world size of 0 is the option's mistake, said once, not every config's "positive" violation.
    proc = run_train(*args, "hydra.launcher.world_size=0", f"hydra.sweep.dir={tmp_path / 'zero'}")
    assert proc.returncode == EXIT_USAGE and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: hydra.launcher.world_size=0: ") and "leave it out" in proc.stderr
    assert not (tmp_path / "zero").exists()


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_job_returns_and_batches(hydra_sweep_runner, tmp_path: Path) -> None:
    # In-process, through Hydra's own sweep machinery: the launcher contract (one COMPLETED
    # JobReturn per job, return_value the PlanRow), batches of 2, and the task never called.
    called: list[object] = []
    sweep = hydra_sweep_runner(
        calling_file=str(TRAIN_MAIN),
        calling_module=None,
        task_function=called.append,
        config_path="../conf",
        config_name="config",
        overrides=[
            "model=tiny,gpt2_124m",
            "parallelism.pp=1,2,3",
            "hydra/launcher=plan",
            "hydra.launcher.table=false",
            "hydra.sweeper.max_batch_size=2",
        ],
        temp_dir=tmp_path / "sweep",
    )
    with sweep:
        assert sweep.returns is not None
        assert [len(batch) for batch in sweep.returns] == [2, 2, 2]
        returns = [r for batch in sweep.returns for r in batch]
        assert all(r.status is JobStatus.COMPLETED for r in returns)
        assert all(isinstance(r.return_value, PlanRow) for r in returns)
        assert [r.overrides for r in returns] == [
            [f"model={m}", f"parallelism.pp={pp}"] for m in ("tiny", "gpt2_124m") for pp in (1, 2, 3)
        ]
        assert [r.return_value.pp for r in returns] == [1, 2, 3, 1, 2, 3]
        # tiny has 4 layers: pp=3 does not split them evenly.
        assert not returns[2].return_value.feasible
        # plan.csv holds every batch, not only the last one.
        assert len(read_rows(tmp_path / "sweep" / "plan.csv")) == 6
    assert called == []


def test_a_dry_run_in_batches_warns_of_each_path_once(tmp_path: Path) -> None:
    # hydra.sweeper.max_batch_size=1 said the missing file's warning again for each of the sweep's batches.
    missing = tmp_path / "missing.bin"
    proc = run_train("-m", "model=tiny", "parallelism.tp=1,2", f"training.data_path={missing}",
                     "hydra.sweeper.max_batch_size=1", "hydra/launcher=plan", "hydra.launcher.table=false",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("plan: 1 configs") == 2, proc.stdout  # two batches
    (warning,) = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert warning.startswith(f"warning: training.data_path={str(missing)!r} cannot be read as a token file")


def test_plan_sweep_matches_plan_run() -> None:
    composer = FastComposer.from_config_dir(REPO / "conf")
    jobs = [["model=gpt_1.3b", f"parallelism.tp={tp}", "hardware=a100_80gb"] for tp in (1, 2, 4)]
    rows, seconds = plan_sweep(composer, jobs, world_size=8)
    assert seconds >= 0
    for job, row in zip(jobs, rows, strict=True):
        expected = plan_run(composer.run_config(job), world_size=8)
        assert row.overrides == " ".join(job)
        assert row == PlanRow(**{**expected.__dict__, "overrides": " ".join(job)})


@pytest.mark.parametrize(
    ("override", "named"),
    [("parallelism.tp=abc,1", "parallelism.tp=abc"), ("model=tiny,nosuch", "nosuch")],
)
def test_bad_override_in_a_plan_sweep(tmp_path: Path, override: str, named: str) -> None:
    proc = run_train("-m", override, "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode != 0
    assert named in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "plan.csv").exists()


def _clear_planner_memos() -> None:
    # Every memo of the planner (functools caches in train.planner.*), so that a config is planned alone.
    for name, module in list(sys.modules.items()):
        if name.startswith("train.planner") and module is not None:
            for value in vars(module).values():
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


def test_a_mixed_sweep_plans_as_each_config_composed_by_hydra_and_planned_alone(tmp_path: Path) -> None:
    # The fast path end to end (group options derived from one composition, the planner's memos shared
    # across the sweep, rows written in one pass) against the slow one: each job composed by Hydra in
    # full and planned on empty memos. plan.csv must be the same bytes and the console the same text.
    from hydra import compose, initialize_config_dir

    from conf.schema import to_run_config
    from launchers.plan import PlanSummary, format_plan_report
    from train.contract import write_plan_csv
    from train.planner.plan import infeasible_by_rule, rank_predictions

    axes = [
        ("model", ["gpt_350m", "gpt_13b"]),
        ("hardware", ["cpu", "h100_sxm"]),  # the CPU's peak is measured at run time: unpredicted rows
        ("parallelism", ["single", "megatron_3d"]),  # a group choice that changes the node values go to
        ("parallelism.pp", ["1", "2", "3"]),  # 3 splits 24 layers, not 40
        ("parallelism.micro_batch_size", ["1", "auto"]),
        ("parallelism.virtual_stages", ["1", "2"]),  # interleaved 1F1B where pp > 1
    ]
    sweep_dir = tmp_path / "sweep"
    proc = run_train(
        "-m",
        *[f"{key}={','.join(values)}" for key, values in axes],
        "hydra/launcher=plan",
        "hydra.launcher.top=null",
        f"hydra.sweep.dir={sweep_dir}",
    )
    assert proc.returncode == 0, proc.stderr

    jobs = [list(job) for job in itertools.product(*[[f"{k}={v}" for v in values] for k, values in axes])]
    expected = []
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for job in jobs:
            _clear_planner_memos()
            expected.append(plan_run(to_run_config(compose("config", overrides=job)), overrides=" ".join(job)))
    expected = rank_predictions(expected)
    feasible = sum(r.feasible for r in expected)
    assert 0 < feasible < len(jobs)  # both kinds, so that both are compared
    # Predicted rows that share memoised work: the same model, device and layout at several pp.
    assert sum(r.feasible and r.pred_rank > 0 for r in expected) >= 8
    assert len({r.reasons[0].split("]")[0] for r in expected if r.reasons}) >= 3  # several rules broken

    write_plan_csv(expected, tmp_path / "expected.csv")
    assert (sweep_dir / "plan.csv").read_bytes() == (tmp_path / "expected.csv").read_bytes()
    summary = PlanSummary(
        configs=len(jobs),
        feasible=feasible,
        infeasible=len(jobs) - feasible,
        compose_seconds=0.0,
        plan_seconds=0.0,
        hydra_compositions=0,
        by_rule=tuple(infeasible_by_rule(expected)),
    )
    report = format_plan_report(expected, summary, top=None, csv_name="plan.csv")
    assert proc.stdout.split("\nplan: ")[0] == report


def test_a_calibration_file_the_time_model_cannot_read_is_each_rows_note(tmp_path: Path) -> None:
    # The rows were feasible with '-' for every prediction, and nothing said why.
    from tests.train.planner.test_rules import compose_run
    from train.planner.plan import plan_run

    bad = tmp_path / "cal.json"
    bad.write_text("[1, 2]")
    row = plan_run(compose_run("hardware=a100_80gb", f"hardware.calibration={bad}"), world_size=2)
    assert row.feasible and math.isnan(row.pred_sec_per_iter)
    assert row.pred_note == f"hardware.calibration={str(bad)!r} holds a JSON list, not a calibration file's object"
    assert plan_run(compose_run("hardware=a100_80gb"), world_size=2).pred_note == ""  # the datasheet's figures


def test_a_dry_run_warns_of_paths_the_runs_would_refuse_once_per_path(tmp_path: Path) -> None:
    # Each was accepted here, queued, and refused by the run at its start.
    file = tmp_path / "a_file"
    file.write_text("")
    good = tmp_path / "tokens.bin"
    good.write_bytes(bytes(2 * (80 * 256 + 1)))  # tiny: 80 samples of 257 uint16 ids, all 0
    missing = tmp_path / "missing.bin"
    # Two layouts for each checkpoint_dir: two configs of one layout in one directory are refused.
    proc = run_train("-m", "model=tiny", "parallelism.tp=1,2", f"training.data_path={missing}",
                     "training.save_interval=5", f"training.checkpoint_dir={file}/ckpt_1,{file}/ckpt_2",
                     "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # warnings, not refusals: the nodes may see other files
    assert "TORCH_IMPORTED=False" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3, proc.stderr  # the missing file once for its four configs; each checkpoint_dir once
    missing_line, *checkpoint_lines = warnings
    assert missing_line.startswith(f"warning: training.data_path={str(missing)!r} cannot be read as a token file")
    assert missing_line.endswith("after the sweep was queued; 4 config(s) name it]"), missing_line
    for tp, line in zip((1, 2), checkpoint_lines, strict=True):
        assert line.startswith(f"warning: training.checkpoint_dir={file}/ckpt_{tp}: cannot write there ({file} is a "
                               "file)"), line  # fmt: skip
        assert "[checked on this machine (" in line and line.endswith("; 2 config(s) name it]"), line
    assert len(read_rows(tmp_path / "sweep" / "plan.csv")) == 4
    # Valid paths: no warning.
    ok = run_train("-m", "model=tiny", f"training.data_path={good}", "training.save_interval=5",
                   f"training.checkpoint_dir={tmp_path / 'ckpt'}", "hydra/launcher=plan",
                   f"hydra.sweep.dir={tmp_path / 'ok'}")  # fmt: skip
    assert ok.returncode == 0 and "warning" not in ok.stderr, ok.stderr
    assert "TORCH_IMPORTED=False" in ok.stdout  # the file was opened, numpy only
    assert not (tmp_path / "ckpt").exists()  # judged, not made
