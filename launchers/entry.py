"""The interpreter and entry module every job of a launch runs (`<python> -m <module> <overrides>`),
checked once before anything is queued or run.

A python that does not exist, or a module it cannot import from the launch's working directory,
failed every config of the sweep one by one: a local sweep of 100 configs said "No such file or
directory" 100 times, and a Slurm sweep queued 100 jobs that each failed at start. The local
launcher runs here, so what it finds is a refusal. A Slurm launch and an export run on nodes that
may have another file system (a python under /apps of the nodes alone, a module on their path):
what is missing here is a warning there, not a refusal.

The default (this interpreter and `train`, the module running this launch) is not checked: it
imports by definition, and a launch pays nothing. Another module with this interpreter is looked up
in this process (importlib's find_spec: no import of the module itself); another interpreter is asked
once, in a subprocess, from the launch's working directory.

Torch-free.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

_FIND_SPEC = (
    "import importlib.util, sys\n"
    "missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]\n"
    "print(' '.join(missing)); sys.exit(3 if missing else 0)"
)
"""What another interpreter runs to say which of the modules named it cannot import (exit 3: some)."""
TRAINER_NEEDS = ("hydra", "omegaconf", "torch")
"""What megasweep's trainer imports from the interpreter's site-packages: another interpreter running
`train` from a checkout finds the module itself in the working directory, and fails on these."""
_ASK_S = 60
"""Seconds another interpreter may take to answer (a cold start on a shared file system is slow)."""


def entry_problem(python: str, module: str, cwd: str, *, options: tuple[str, str]) -> str | None:
    """Why `python -m module`, run in `cwd`, cannot start here (one line naming the option of
    `options`, (python's, module's), its value and the fix), or None when it can or cannot be told."""
    python_option, module_option = options
    found = shutil.which(python) if os.sep not in python else (python if os.access(python, os.X_OK) else None)
    if found is None:
        if os.sep not in python:
            what = "not on this machine's PATH"
        else:
            what = "not executable on this machine" if Path(python).exists() else "no such file on this machine"
        return (f"{python_option}={python}: {what}; name an interpreter that has megasweep "
                f"installed (e.g. {sys.executable}), or leave it unset for this one")  # fmt: skip
    # Not resolved: every virtual environment's python links to one base interpreter, and only the
    # environment's own path says whose site-packages it reads.
    if os.path.abspath(found) == os.path.abspath(sys.executable):
        if module == "train" or _importable_here(module, cwd):
            return None
        return (f"{module_option}={module}: {sys.executable} cannot import it from {cwd}; name a module on its "
                "path (the default, train, runs megasweep's trainer)")  # fmt: skip
    return _asked(found, module, cwd, options)


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


def _asked(python: str, module: str, cwd: str, options: tuple[str, str]) -> str | None:
    needs = [module, *(TRAINER_NEEDS if module == "train" else ())]
    try:
        proc = subprocess.run([python, "-c", _FIND_SPEC, *needs], cwd=cwd, capture_output=True, text=True,
                              timeout=_ASK_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None  # it could not be asked: the jobs have the last word, as before
    python_option, module_option = options
    missing = proc.stdout.split()
    if proc.returncode == 3 and module in missing:
        return (f"{module_option}={module}: {python} cannot import it from {cwd}; name a module on its path "
                "(the default, train, runs megasweep's trainer)")  # fmt: skip
    if proc.returncode == 3:
        return (f"{python_option}={python}: it cannot import {', '.join(missing)}, which {module_option}={module} "
                f"needs; name an interpreter that has megasweep installed (e.g. {sys.executable})")  # fmt: skip
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{module_option}={module}: {python} failed to look it up from {cwd} ({last})"
    return None
