"""Partition, account, QoS and core license are checked with Slurm before anything is queued; a launch that
queues nothing, or has configs refused, fails."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from launchers.site import site_choices
from tests.launchers.test_slurm_launcher import sweep
from tests.launchers.test_sweepdir import train_multirun

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo


def test_slurm_says_what_it_accepts(slurm_cluster: SlurmClusterInfo) -> None:
    assert site_choices("partition") == [slurm_cluster.partition]
    assert site_choices("account") and site_choices("qos")
    assert site_choices("core_license") == [slurm_cluster.core_license]


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("partition", "nosuch", "cluster.partition='nosuch' is not a partition of this cluster; partitions: {partition}"),
        ("partition", "debugg", "(did you mean '{partition}'?)"),
        ("account", "nosuch", "cluster.account='nosuch' is not an account you may charge on this cluster; accounts:"),
        ("qos", "nosuch", "cluster.qos='nosuch' is not a QoS you may use on this cluster; QoS:"),
        ("core_license", "core", "is not a license of this cluster (slurm.conf Licenses); licenses: {license}"),
    ],
)
def test_an_unknown_partition_account_qos_or_license_submits_nothing(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path, option: str, value: str, words: str
) -> None:
    # sbatch itself accepts an unknown account or QoS here (no AccountingStorageEnforce).
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, f"cluster.{option}={value}", "+hydra.launcher.sbatch_args.hold=''", check=False)
    assert proc.returncode != 0
    wanted = words.format(partition=slurm_cluster.partition, license=slurm_cluster.core_license)
    assert wanted in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (sweep_dir / "manifest.jsonl").exists() and not (sweep_dir / ".megasweep").exists()


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_a_launch_with_nothing_to_submit_fails(launcher: str, tmp_path: Path) -> None:
    # Without a measured peak fp32 on a CPU is infeasible: every config is skipped.
    proc = train_multirun(
        "hardware.peak_measured=false", "training.lr=1e-4,2e-4", f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path}"
    )
    assert proc.returncode != 0 and "Nothing was submitted: all 2 configs are infeasible" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
