"""launchers.entry: the interpreter and module a launch's jobs run, checked before anything runs."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from launchers.entry import EntryProblem, entry_problem
from tests.launchers.test_sbatch_export import export_cli
from tests.launchers.test_slurm_launcher import REPO, TINY
from train.contract import EXIT_USAGE

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

OPTIONS = ("hydra.launcher.python", "hydra.launcher.module")


def said(python: str, module: str, cwd: str) -> str | None:
    """entry_problem's message, for a problem every run would meet (certain); None without a problem."""
    problem = entry_problem(python, module, cwd, options=OPTIONS)
    assert problem is None or problem.certain, problem
    return None if problem is None else problem.message


def test_this_interpreter_and_its_trainer_pass_and_what_is_missing_is_named(tmp_path: Path) -> None:
    here = str(REPO)
    assert said(sys.executable, "train", here) is None
    assert said(sys.executable, "json", here) is None
    assert said(sys.executable, "nosuchmodule", here) == (
        f"hydra.launcher.module=nosuchmodule: {sys.executable} cannot import it from {here}; name a module on "
        "its path (the default, train, runs megasweep's trainer)"
    )
    # A module of the launch's working directory (python -m puts it first on the path), not of this one.
    (tmp_path / "myapp.py").write_text("")
    assert said(sys.executable, "myapp", str(tmp_path)) is None
    assert str(tmp_path) not in sys.path
    missing = tmp_path / "bin" / "python"
    assert said(str(missing), "train", here) == (
        f"hydra.launcher.python={missing}: no such file on this machine; name an interpreter that has megasweep "
        f"installed (e.g. {sys.executable}), or leave it unset for this one"
    )
    plain = tmp_path / "python"
    plain.write_text("")
    assert (said(str(plain), "train", here) or "").startswith(
        f"hydra.launcher.python={plain}: not executable on this machine;"
    )
    assert (said(str(tmp_path), "train", here) or "").startswith(
        f"hydra.launcher.python={tmp_path}: a directory, not an interpreter;"
    )  # os.access says a directory is executable: each config failed with "Permission denied"
    plain.chmod(0o755)  # executable, but no program the system can run
    assert said(str(plain), "train", here) == (
        f"hydra.launcher.python={plain}: cannot be run here (Exec format error)"
    )
    # A wrapper by another name is not started to be asked (it may do anything: count its calls, start a
    # container), only found.
    assert said("/bin/true", "nosuchmodule", here) is None
    # An interpreter by name that fails to answer, or answers as no Python does: said, but uncertain, so
    # that the local launcher only warns.
    (tmp_path / "env").mkdir()
    for name, body in (("python3", "exit 1"), ("python", "exit 0")):
        (tmp_path / "env" / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / "env" / name).chmod(0o755)
    assert entry_problem(str(tmp_path / "env" / "python3"), "train", here, options=OPTIONS) == EntryProblem(
        f"hydra.launcher.python={tmp_path / 'env' / 'python3'} failed to look up hydra.launcher.module=train from "
        f"{here} (exit status 1: no output)", certain=False)  # fmt: skip
    assert entry_problem(str(tmp_path / "env" / "python"), "train", here, options=OPTIONS) == EntryProblem(
        f"hydra.launcher.python={tmp_path / 'env' / 'python'}: not a Python interpreter, it seems (asked to look up "
        "train, it did not answer)", certain=False)  # fmt: skip
    assert (said("python-that-is-nowhere", "train", here) or "").startswith(
        "hydra.launcher.python=python-that-is-nowhere: not on this machine's PATH;"
    )


def test_another_interpreter_is_asked_what_it_can_import(tmp_path: Path) -> None:
    # A bare virtual environment finds `train` in the checkout, but none of what the trainer imports.
    venv.create(tmp_path / "bare", with_pip=False)
    bare = str(tmp_path / "bare" / "bin" / "python")
    assert said(bare, "train", str(REPO)) == (
        f"hydra.launcher.python={bare}: it cannot import hydra, omegaconf, torch, which hydra.launcher.module=train "
        f"needs; name an interpreter that has megasweep installed (e.g. {sys.executable})"
    )
    assert said(bare, "json", str(REPO)) is None
    assert (said(bare, "nosuchmodule", str(REPO)) or "").startswith(
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


def test_a_local_config_that_ends_well_without_a_record_is_failed_not_pending(tmp_path: Path) -> None:
    # An entry module that is no trainer (importable, so the check above passes) exits 0 and writes no
    # result.json: the config read pending for ever, and `status --wait` waited for it.
    from launchers.status import sweep_status

    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=local", "hydra.launcher.module=this",
         f"hydra.sweep.dir={sweep}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "exited with status 0 without writing result.json" in proc.stderr, proc.stderr
    (status,) = sweep_status(sweep, slurm_states={})
    assert status.state == "failed" and "exited with status 0 without writing result.json" in status.detail
