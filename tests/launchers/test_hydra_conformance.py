"""Hydra's own launcher conformance suites against `hydra/launcher=slurm` and `hydra/launcher=local`.

hydra.test_utils.launcher_common_tests is what every Hydra launcher plugin is held to
(hydra-submitit-launcher runs the same two suites, parametrized the same way): the
LauncherTestSuite sweeps toy task functions in this process, the IntegrationTestSuite runs
small generated apps (`python task.py -m ...`) in subprocesses. Neither uses megasweep's
schema, so these check the launchers' generic path: one array per sweep, the task function
pickled to the node by submitit, launch() waiting for each JobReturn. The Slurm cases run
on the real local cluster (slurm_cluster fixture).

The fixtures hydra_sweep_runner and hydra_restore_singletons come from Hydra's pytest plugin
(hydra.extra.pytest_plugin, registered by hydra-core's pytest11 entry point).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra.core.plugins import Plugins
from hydra.core.singleton import Singleton
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from hydra.version import VersionBase
from omegaconf import DictConfig

from hydra_plugins.megasweep.local_launcher import LocalLauncher
from hydra_plugins.megasweep.slurm_launcher import SlurmLauncher

# Hydra's and the job's own log lines would only slow the subprocess apps down.
QUIET = ["hydra/hydra_logging=disabled", "hydra/job_logging=disabled"]


@pytest.fixture(autouse=True)
def hydra_version_base_unset() -> Iterator[None]:
    """The suites are written for Hydra's default version base (unset: each job changes directory).

    Other test modules set it to 1.3 for the whole process (hydra.initialize_config_dir,
    FastComposer.from_config_dir), and hydra_restore_singletons keeps what it finds: cleared
    here for each test, put back after.
    """
    saved = Singleton._instances.pop(VersionBase, None)
    yield
    Singleton._instances.pop(VersionBase, None)
    if saved is not None:
        Singleton._instances[VersionBase] = saved


@pytest.mark.parametrize("cls", [SlurmLauncher, LocalLauncher])
def test_launchers_are_discovered_by_hydra(cls: type[Launcher]) -> None:
    assert cls.__name__ in [c.__name__ for c in Plugins.instance().discover(Launcher)]


# -- hydra/launcher=slurm on the local cluster ----------------------------------------------


@pytest.mark.usefixtures("slurm_cluster")
@pytest.mark.parametrize("launcher_name, overrides", [("slurm", ["hydra.launcher.array_parallelism=4"])])
class TestSlurmLauncher(LauncherTestSuite):
    pass


@pytest.mark.usefixtures("slurm_cluster")
@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", *QUIET, "hydra/launcher=slurm"])])
class TestSlurmLauncherIntegration(IntegrationTestSuite):
    pass


# -- hydra/launcher=local -------------------------------------------------------------------


@pytest.mark.parametrize("launcher_name, overrides", [("local", [])])
class TestLocalLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", *QUIET, "hydra/launcher=local"])])
class TestLocalLauncherIntegration(IntegrationTestSuite):
    pass


# -- beyond the suites ----------------------------------------------------------------------


APP = """
import hydra, os, sys


@hydra.main(version_base=None, config_path=None)
def app(cfg):
    if cfg.x == 2:
        raise ValueError("x=2 is refused by the app")
    # Where the job ran: a Slurm array task, on the cluster's nodes.
    with open(f"out_{cfg.x}.txt", "w") as f:
        f.write(f"{cfg.x} {os.environ.get('SLURM_ARRAY_JOB_ID')} {os.environ.get('SLURM_ARRAY_TASK_ID')}")


if __name__ == "__main__":
    app()
"""


def test_slurm_runs_a_generic_sweep_as_one_array_and_reports_a_failed_job(
    slurm_cluster: object, tmp_path: Path
) -> None:
    (tmp_path / "app.py").write_text(APP)
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "app.py",
            "-m",
            "+x=1,2,3",
            "hydra/launcher=slurm",
            f"hydra.sweep.dir={sweep_dir}",
            "hydra.job.chdir=true",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    # The failed job fails the sweep, with the app's own error...
    assert proc.returncode != 0
    assert "x=2 is refused by the app" in proc.stderr
    # ... and the other jobs ran, each as a task of one and the same array.
    ran = {}
    for x in (1, 3):
        job = int(x) - 1
        text = (sweep_dir / str(job) / f"out_{x}.txt").read_text().split()
        ran[x] = text
        assert text[0] == str(x)
    arrays = {words[1] for words in ran.values()}
    assert len(arrays) == 1 and "None" not in arrays, ran
    assert sorted(words[2] for words in ran.values()) == ["0", "2"]


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_local_returns_the_task_values_of_a_generic_sweep(hydra_sweep_runner: Any, tmp_path: Path) -> None:
    def double(cfg: DictConfig) -> int:
        return int(cfg.a) * 2

    sweep = hydra_sweep_runner(
        calling_file=None,
        calling_module="hydra.test_utils.a_module",
        task_function=double,
        config_path="configs",
        config_name="compose",
        overrides=["hydra/launcher=local", "+a=1,2,3"],
        temp_dir=tmp_path,
    )
    with sweep:
        assert sweep.returns is not None
        (batch,) = sweep.returns
        assert [r.return_value for r in batch] == [2, 4, 6]
        assert [r.hydra_cfg.hydra.job.num for r in batch] == [0, 1, 2]
        assert [r.hydra_cfg.hydra.runtime.output_dir for r in batch] == [
            str(tmp_path / str(i)) for i in range(3)
        ]
