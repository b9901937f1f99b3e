"""The interpreter and entry module every job of a launch runs (`<python> -m <module> <overrides>`),
checked once before anything is queued or run.

A python that does not exist, or a module it cannot import from the launch's working directory,
failed every config of the sweep one by one: a local sweep of 100 configs said "No such file or
directory" 100 times, and a Slurm sweep queued 100 jobs that each failed at start. The local
launcher runs here, so what it finds for certain is a refusal (an interpreter that failed to answer
is a warning: EntryProblem.certain). A Slurm launch and an export run on nodes that may have another
file system (a python under /apps of the nodes alone, a module on their path): what is missing here
is a warning there, not a refusal.

The default (this interpreter and `train`, the module running this launch) is not checked: it
imports by definition, and a launch pays nothing. Another module with this interpreter is looked up
in this process (importlib's find_spec: no import of the module itself); another interpreter named
as one (python, python3, python3.11) is asked once, in a subprocess, from the launch's working
directory; a wrapper by another name (a container's launcher, a script) is only checked to exist, since
starting it may do anything.

Torch-free.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from launchers.sweepdir import UsageError

_ANSWER = "megasweep-entry-ok"
"""What it prints when it can import them all: a program that is no Python (/bin/true) exits 0 too."""
_FIND_SPEC = (
    "import importlib.util, sys\n"
    "missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]\n"
    f"print(' '.join(missing) or {_ANSWER!r}); sys.exit(3 if missing else 0)"
)
"""What another interpreter runs to say which of the modules named it cannot import (exit 3: some)."""
TRAINER_NEEDS = ("hydra", "omegaconf", "torch")
"""What megasweep's trainer imports from the interpreter's site-packages: another interpreter running
`train` from a checkout finds the module itself in the working directory, and fails on these."""
_PYTHON_NAME = re.compile(r"python[0-9.]*")
"""Names of the interpreters asked what they can import (python, python3, python3.11)."""
_ASK_S = 60
"""Seconds another interpreter may take to answer (a cold start on a shared file system is slow)."""


class EntryProblem(NamedTuple):
    """Why the jobs' `python -m module` would not start here."""

    message: str
    """One line naming the option, its value and the fix."""
    certain: bool
    """True: no such interpreter, or it cannot import the module: every run here fails. False: an
    interpreter that failed to answer or answered as no Python does (a wrapper script, a program that
    is meant to fail: tests stand one in for a trainer that fails), which a run may still get past."""


def entry_problem(python: str, module: str, cwd: str, *, options: tuple[str, str]) -> EntryProblem | None:
    """Why `python -m module`, run in `cwd`, cannot start here (`options`: the names of python's and
    module's options), or None when it can or cannot be told."""
    python_option, module_option = options
    # A relative path is the jobs' working directory's (a rerun may be started from another one).
    path = python if os.path.isabs(python) else os.path.join(cwd, python)
    runnable = os.path.isfile(path) and os.access(path, os.X_OK)  # a directory is "executable" too
    found = shutil.which(python) if os.sep not in python else (path if runnable else None)
    if found is None:
        if os.sep not in python:
            what = "not on this machine's PATH"
        elif Path(path).is_dir():
            what = "a directory, not an interpreter"
        else:
            what = "not executable on this machine" if Path(path).exists() else "no such file on this machine"
        return EntryProblem(f"{python_option}={python}: {what}; name an interpreter that has megasweep installed "
                            f"(e.g. {sys.executable}), or leave it unset for this one", certain=True)  # fmt: skip
    # Not resolved: every virtual environment's python links to one base interpreter, and only the
    # environment's own path says whose site-packages it reads.
    if os.path.abspath(found) == os.path.abspath(sys.executable):
        if module == "train" or _importable_here(module, cwd):
            return None
        return EntryProblem(f"{module_option}={module}: {sys.executable} cannot import it from {cwd}; name a module "
                            "on its path (the default, train, runs megasweep's trainer)", certain=True)  # fmt: skip
    if not _PYTHON_NAME.fullmatch(os.path.basename(found)):
        return None  # a wrapper (a container's launcher, a script): starting it may do anything, so it is not asked
    return _asked(found, module, cwd, options)


def check_entry(python: str, module: str, cwd: str, *, options: tuple[str, str], here: bool) -> None:
    """entry_problem's verdict, said: `here` (the runs are this machine's: the local launcher) refuses a
    certain problem (UsageError) and warns of another; the nodes' runs (Slurm, an export) are warned of
    either, since the nodes may see other files than this machine."""
    problem = entry_problem(python, module, cwd, options=options)
    if problem is None:
        return
    if here and problem.certain:
        raise UsageError(f"{problem.message}. Nothing was run.")
    where = "" if here else " (checked on this machine: the nodes may see another file system)"
    print(f"warning: {problem.message}{where}", file=sys.stderr, flush=True)


def _importable_here(module: str, cwd: str) -> bool:
    """Whether this interpreter, started in `cwd` as `python -m` starts (cwd first on its path), finds it."""
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, an empty or relative name
        return False
    finally:
        if added:
            sys.path.remove(cwd)


def _asked(python: str, module: str, cwd: str, options: tuple[str, str]) -> EntryProblem | None:
    needs = [module, *(TRAINER_NEEDS if module == "train" else ())]
    try:
        proc = subprocess.run([python, "-c", _FIND_SPEC, *needs], cwd=cwd, capture_output=True, text=True,
                              timeout=_ASK_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None  # it could not be asked in time: the jobs have the last word, as before
    except OSError as exc:  # found and executable, yet the system will not run it (no interpreter, ...)
        return EntryProblem(f"{options[0]}={python}: cannot be run here ({exc.strerror or exc})", certain=True)
    python_option, module_option = options
    missing = proc.stdout.split()
    answered = proc.returncode == 3 and missing and not proc.stderr.strip()
    if answered and module in missing:
        return EntryProblem(f"{module_option}={module}: {python} cannot import it from {cwd}; name a module on its "
                            "path (the default, train, runs megasweep's trainer)", certain=True)  # fmt: skip
    if answered:
        return EntryProblem(f"{python_option}={python}: it cannot import {', '.join(missing)}, which "
                            f"{module_option}={module} needs; name an interpreter that has megasweep installed (e.g. "
                            f"{sys.executable})", certain=True)  # fmt: skip
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return EntryProblem(f"{python_option}={python} failed to look up {module_option}={module} from {cwd} "
                            f"(exit status {proc.returncode}: {last})", certain=False)  # fmt: skip
    if proc.stdout.strip() != _ANSWER:
        return EntryProblem(f"{python_option}={python}: not a Python interpreter, it seems (asked to look up "
                            f"{module}, it did not answer)", certain=False)  # fmt: skip
    return None
