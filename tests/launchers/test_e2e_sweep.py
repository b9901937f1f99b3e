"""A whole sweep against the real local Slurm cluster: launch, run on emulated nodes, analyse.

One `python -m train -m ... hydra/launcher=slurm` sweep of nine layouts of a tiny GPT: one-node
and two-node jobs (hardware.devices_per_node=2, so dp x tp x pp = 4 takes two nodes of two srun
tasks), data, tensor and pipeline parallelism, and one infeasible layout (tp=3). The layouts are
config-group files in a --config-dir, as a user would write them. Then `python -m analysis` on
the sweep directory, as issue 5 asks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.wandb_io import read_offline_runs
from tests.launchers.test_slurm_launcher import REPO, array_of, result, sacct, wait_until
from train.contract import read_manifest

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

# Smaller than test_slurm_launcher.TINY (two layers for pipeline stages, four heads for TP) and a
# datasheet peak instead of a calibration per rank: 23 ranks share two cores.
SMALL = (
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "model.vocab_size=512",
    "training.train_iters=3",
    "training.warmup_iters=1",
    "parallelism.micro_batch_size=1",
    "parallelism.global_batch_size=4",
    "parallelism.precision=fp32",
    "hardware.devices_per_node=2",
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=1.0",
)
# name: (dp, tp, pp); devices = dp * tp * pp, two per node.
LAYOUTS = {
    "l_dp1": (1, 1, 1),
    "l_dp2": (2, 1, 1),
    "l_tp2": (1, 2, 1),
    "l_pp2": (1, 1, 2),
    "l_dp2tp2": (2, 2, 1),
    "l_tp2pp2": (1, 2, 2),
    "l_dp2pp2": (2, 1, 2),
    "l_dp4": (4, 1, 1),
    "l_tp3": (1, 3, 1),  # 4 heads and a 64-wide model do not split in three
}
INFEASIBLE = {"l_tp3"}
# 23 ranks of ~8 CPU-seconds each on two cores, plus start-up of nine jobs.
E2E_TIMEOUT_S = 300


def write_layouts(config_dir: Path) -> None:
    """One parallelism/<name>.yaml per layout, each the `single` group option with dp/tp/pp set."""
    group = config_dir / "parallelism"
    group.mkdir(parents=True)
    for name, (dp, tp, pp) in LAYOUTS.items():
        (group / f"{name}.yaml").write_text(
            f"defaults:\n  - single\n  - _self_\n\ndp: {dp}\ntp: {tp}\npp: {pp}\n", encoding="utf-8"
        )


def layout_of(overrides: tuple[str, ...]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("parallelism="))


def test_sweep_of_layouts_runs_on_emulated_nodes_and_is_analysed(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    config_dir, sweep_dir = tmp_path / "conf", tmp_path / "e2e-layouts"
    write_layouts(config_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_RUN_GROUP")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "-m",
            f"--config-dir={config_dir}",
            *SMALL,
            "logger=offline",
            f"parallelism={','.join(LAYOUTS)}",
            f"hydra.sweep.dir={sweep_dir}",
            "hydra/launcher=slurm",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "9 configs: 8 submitted in 3 array(s)" in proc.stdout and "1 infeasible" in proc.stdout

    entries = read_manifest(sweep_dir)
    assert [layout_of(e.overrides) for e in entries] == list(LAYOUTS)
    skipped = [e for e in entries if e.status == "skipped"]
    submitted = [e for e in entries if e.status == "submitted"]
    assert [layout_of(e.overrides) for e in skipped] == ["l_tp3"]
    assert skipped[0].job_id is None and skipped[0].reason and "tp" in skipped[0].reason

    # One array per resource shape: 1 node x 1 task, 1 node x 2 tasks, 2 nodes x 2 tasks.
    by_shape: dict[tuple[int, int], list[str]] = defaultdict(list)
    for e in submitted:
        dp, tp, pp = LAYOUTS[layout_of(e.overrides)]
        nodes, per_node = (1, dp * tp * pp) if dp * tp * pp <= 2 else (dp * tp * pp // 2, 2)
        assert (e.shape["nodes"], e.shape["tasks_per_node"]) == (nodes, per_node), e
        by_shape[(nodes, per_node)].append(str(e.job_id))
    assert sorted(by_shape) == [(1, 1), (1, 2), (2, 2)]
    arrays = {shape: {array_of(j) for j in ids} for shape, ids in by_shape.items()}
    assert all(len(a) == 1 for a in arrays.values()), arrays
    assert len({a for ids in arrays.values() for a in ids}) == 3
    for ids in by_shape.values():
        if len(ids) > 1:  # array tasks <array>_<i>, one per config
            assert sorted(ids) == sorted(f"{array_of(ids[0])}_{i}" for i in range(len(ids))), ids

    wait_until(
        "a result.json of every submitted config",
        lambda: all(result(sweep_dir, e) is not None for e in submitted),
        timeout=E2E_TIMEOUT_S,
    )
    results = [r for e in submitted if (r := result(sweep_dir, e)) is not None]
    for entry, record in zip(submitted, results, strict=True):
        dp, tp, pp = LAYOUTS[layout_of(entry.overrides)]
        assert record["status"] == "ok", (entry, record.get("message"))
        assert record["world"] == {"world_size": dp * tp * pp, "dp": dp, "tp": tp, "pp": pp}
        assert record["iterations_run"] == 3
        # The ranks really were spread over the job's nodes by srun.
        assert record["env"]["SLURM_NNODES"] == str(entry.shape["nodes"])
        assert record["env"]["SLURM_NTASKS"] == str(dp * tp * pp)

    # sacct: the three arrays, every task COMPLETED on the node count of its shape.
    all_arrays = sorted({a for ids in arrays.values() for a in ids})
    expected = {job: entry.shape["nodes"] for entry in submitted for job in [str(entry.job_id)]}

    def sacct_agrees() -> bool:
        rows = sacct("-X", "-j", ",".join(all_arrays), "--format=JobID,State,NNodes")
        seen = {r[0]: (r[1], int(r[2])) for r in rows}
        return all(seen.get(job) == ("COMPLETED", nodes) for job, nodes in expected.items())

    wait_until("sacct to list every task COMPLETED on its shape's nodes", sacct_agrees, timeout=60)

    # One offline W&B run per config (rank 0's only), grouped under the sweep's name.
    runs = read_offline_runs([sweep_dir])
    assert sorted(r.run_dir for r in runs) == sorted(e.output_dir for e in submitted), runs
    assert {r.group for r in runs} == {sweep_dir.name}

    # Issue 5: the analysis of the sweep directory.
    out = tmp_path / "analysis"
    analysed = subprocess.run(
        [sys.executable, "-m", "analysis", str(sweep_dir), "-o", str(out), "--no-plots"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert analysed.returncode == 0, analysed.stdout + analysed.stderr
    # Tiny runs on two shared cores are noisy: a winner is called only outside the runs' spread.
    first = next(line for line in analysed.stdout.splitlines() if " for tiny " in line)
    assert first.startswith(("Fastest for tiny", "No clear winner for tiny")), analysed.stdout
    rows = results_table(out / "results.md")
    # A row per config: the layout's DP/TP/PP and node count for the eight that ran, the reason for tp=3.
    assert len(rows) == len(LAYOUTS), rows
    by_layout = {layout_in(row["Notes"]): row for row in rows}
    assert set(by_layout) == set(LAYOUTS), rows
    for name, (dp, tp, pp) in LAYOUTS.items():
        row = by_layout[name]
        if name in INFEASIBLE:
            assert row["Mem"] == "skipped" and "parallelism.tp=3" in row["Notes"], row
            continue
        nodes = 1 if dp * tp * pp <= 2 else 2
        assert (row["Nodes"], row["DP"], row["TP"], row["PP"]) == (str(nodes), str(dp), str(tp), str(pp)), row
        assert float(row["Sec/it"]) > 0, row
    assert "9 configs: 8 ok, 1 skipped." in (out / "results.md").read_text(encoding="utf-8")


def layout_in(notes: str) -> str:
    return next(
        word.split("=", 1)[1].rstrip(";") for word in notes.split() if word.startswith("parallelism=")
    )


def results_table(path: Path) -> list[dict[str, str]]:
    """The first markdown table of results.md (one row per config), as {column: cell}."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)))
    return rows
