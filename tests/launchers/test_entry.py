"""launchers.entry: the interpreter and module a launch's jobs run, checked before anything runs."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from launchers.entry import entry_problem
from tests.launchers.test_sbatch_export import export_cli
from tests.launchers.test_slurm_launcher import REPO, TINY
from train.contract import EXIT_USAGE

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

OPTIONS = ("hydra.launcher.python", "hydra.launcher.module")


def test_this_interpreter_and_its_trainer_pass_and_what_is_missing_is_named(tmp_path: Path) -> None:
    here = str(REPO)
    assert entry_problem(sys.executable, "train", here, options=OPTIONS) is None
    assert entry_problem(sys.executable, "json", here, options=OPTIONS) is None
    assert entry_problem(sys.executable, "nosuchmodule", here, options=OPTIONS) == (
        f"hydra.launcher.module=nosuchmodule: {sys.executable} cannot import it from {here}; name a module on "
        "its path (the default, train, runs megasweep's trainer)"
    )
    # A module of the launch's working directory (python -m puts it first on the path), not of this one.
    (tmp_path / "myapp.py").write_text("")
    assert entry_problem(sys.executable, "myapp", str(tmp_path), options=OPTIONS) is None
    assert str(tmp_path) not in sys.path
    missing = tmp_path / "bin" / "python"
    assert entry_problem(str(missing), "train", here, options=OPTIONS) == (
        f"hydra.launcher.python={missing}: no such file on this machine; name an interpreter that has megasweep "
        f"installed (e.g. {sys.executable}), or leave it unset for this one"
    )
    plain = tmp_path / "python"
    plain.write_text("")
    assert (entry_problem(str(plain), "train", here, options=OPTIONS) or "").startswith(
        f"hydra.launcher.python={plain}: not executable on this machine;"
    )
    assert (entry_problem("python-that-is-nowhere", "train", here, options=OPTIONS) or "").startswith(
        "hydra.launcher.python=python-that-is-nowhere: not on this machine's PATH;"
    )


def test_another_interpreter_is_asked_what_it_can_import(tmp_path: Path) -> None:
    # A bare virtual environment finds `train` in the checkout, but none of what the trainer imports.
    venv.create(tmp_path / "bare", with_pip=False)
    bare = str(tmp_path / "bare" / "bin" / "python")
    assert entry_problem(bare, "train", str(REPO), options=OPTIONS) == (
        f"hydra.launcher.python={bare}: it cannot import hydra, omegaconf, torch, which hydra.launcher.module=train "
        f"needs; name an interpreter that has megasweep installed (e.g. {sys.executable})"
    )
    assert entry_problem(bare, "json", str(REPO), options=OPTIONS) is None
    assert (entry_problem(bare, "nosuchmodule", str(REPO), options=OPTIONS) or "").startswith(
        f"hydra.launcher.module=nosuchmodule: {bare} cannot import it from {REPO};"
    )


@pytest.mark.parametrize(
    ("option", "words"),
    [("hydra.launcher.python=/nonexistent/python", "error: hydra.launcher.python=/nonexistent/python: no such file"),
     ("hydra.launcher.module=nosuchmodule", "error: hydra.launcher.module=nosuchmodule: ")],
)  # fmt: skip
def test_a_local_sweep_whose_jobs_cannot_start_is_refused_before_any_runs(option: str, words: str, tmp_path: Path) -> None:
    # Each config of the sweep failed in turn ("No such file or directory" once per config), exit 1.
    proc = subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, "training.lr=1e-4,2e-4", "hydra/launcher=local", option,
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    assert proc.stderr.startswith(words) and proc.stderr.strip().endswith("Nothing was run."), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "sweep").exists()


def test_an_export_whose_module_is_missing_here_warns_and_exports(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    # The nodes run the scripts and may see what this machine does not: a warning, not a refusal.
    proc = export_cli(tmp_path, "entry", "--module=nosuchmodule")
    assert proc.stderr.startswith(
        f"warning: --module=nosuchmodule: {sys.executable} cannot import it from {REPO}; name a module on its path"
    ), proc.stderr
    assert proc.stderr.splitlines()[0].endswith("(checked on this machine: the nodes may see another file system)")
    assert list((tmp_path / "scripts").glob("entry*.sbatch"))
