"""`hydra/launcher=plan`: one planned row per config, plan.csv in the sweep dir, nothing run, no torch."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.utils import JobStatus

from launchers.compose import FastComposer
from launchers.plan import plan_sweep
from train.contract import PlanRow
from train.planner.plan import plan_run

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

    # The same rows on the console, one per config, and the summary.
    assert proc.stdout.count("INFEASIBLE") == sum(r["feasible"] == "False" for r in rows)
    assert "plan: 6 configs:" in proc.stdout
    # Nothing ran: no job directories, no results.
    assert not list(sweep_dir.rglob("result.json"))
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["multirun.yaml", "plan.csv"]


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
