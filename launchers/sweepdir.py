"""One sweep per directory, checked before anything is written into it.

Every launcher (`hydra/launcher=slurm|local|plan`), `hydra/sweeper=megasweep|layouts` and the export
(`python -m launchers sbatch`) call these first:

- `writable_dir`: the directory is created and proved writable (a file made and removed), so an
  unwritable one is one paragraph naming the option to change, before a script, a manifest or a
  job exists, instead of a traceback halfway through.
- `claim_sweep_dir`: a directory whose manifest.jsonl lists a sweep, or whose plan.csv holds a
  dry run, is refused, unless the user asks to add to that sweep (hydra.launcher.append=true,
  --append). Added configs then take the indices after the last one listed: an index (and the
  default output directory named after it) is never given to a second config, so no old
  result.json sits where a new config writes. A dry run's configs have no index to take after.

The errors are Hydra's CompactHydraException: Hydra prints the message alone, without a traceback;
the command-line tools print it after `error:`.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.errors import CompactHydraException

from train.contract import (
    MANIFEST_FILE,
    PLAN_FILE,
    ManifestEntry,
    ManifestError,
    manifest_path,
    read_manifest,
    unwritable,
)

__all__ = [
    "HYDRA_OPTIONS",
    "SweepDirError",
    "UsageError",
    "SweepOptions",
    "claim_sweep_dir",
    "first_index",
    "next_index",
    "writable_dir",
]


class UsageError(CompactHydraException):
    """A launch refused for its input before anything ran (a sweep directory, a site option, a search
    option): one paragraph, and the sweepers exit with EXIT_USAGE (launchers.compose.usage_exits),
    where Hydra would exit 1 for any exception, the same status as a run that failed."""


class SweepDirError(UsageError):
    """A sweep directory that cannot be used as asked (one paragraph: what, why, what to do)."""


@dataclass(frozen=True)
class SweepOptions:
    """How the user names the directory and the permission to add to a sweep, in the tool at hand."""

    directory: str
    """The option that sets the sweep directory, e.g. 'hydra.sweep.dir'."""
    append: str
    """The option that adds to an existing sweep, e.g. 'hydra.launcher.append=true'."""


HYDRA_OPTIONS = SweepOptions(directory="hydra.sweep.dir", append="hydra.launcher.append=true")


def writable_dir(path: str | Path, *, option: str) -> Path:
    """`path` created if need be and proved writable; SweepDirError naming `option` otherwise."""
    path = Path(path)
    why = unwritable(path)
    if why is not None:
        raise SweepDirError(
            f"{option}={path}: cannot write there ({why}). Nothing was launched or written. "
            f"Choose a directory you can create and write, e.g. {option}=<a path in your home or "
            "scratch space>."
        )
    return path


def next_index(entries: Sequence[ManifestEntry]) -> int:
    """The index the next config added to a sweep gets: after every index it ever listed."""
    return max((e.index for e in entries), default=-1) + 1


def claim_sweep_dir(sweep_dir: str | Path, *, append: bool, options: SweepOptions = HYDRA_OPTIONS) -> int:
    """Check that configs may be written into `sweep_dir` (created if need be); return the index of
    the first one: see first_index."""
    return first_index(writable_dir(sweep_dir, option=options.directory), append=append, options=options)


def first_index(sweep_dir: str | Path, *, append: bool, options: SweepOptions = HYDRA_OPTIONS) -> int:
    """The index of the first config launched into `sweep_dir`; nothing is created or written.

    0 for a new directory or a dry run's. A directory that holds a sweep or a dry run is refused
    unless `append`, and then its next free index is returned (see the module docstring).
    """
    sweep_dir = Path(sweep_dir)
    path = manifest_path(sweep_dir)
    if not path.exists():
        if (sweep_dir / PLAN_FILE).is_file() and not append:
            # Launched there, the dry run's rows would vanish from the analysis of the directory
            # (it reports the launched sweep's manifest) and its results.md would be replaced.
            raise SweepDirError(
                f"{sweep_dir} already holds a dry run ({PLAN_FILE}), and a directory holds one sweep. "
                f"Nothing was launched or written. Launch into a new directory ({options.directory}=...), "
                f"or into this one with {options.append}: {PLAN_FILE} then stays beside the configs added."
            )
        return 0
    try:
        entries = read_manifest(path)
    except (OSError, ManifestError) as exc:
        raise SweepDirError(
            f"{sweep_dir} holds a {MANIFEST_FILE} that cannot be read ({exc}), so it cannot be added to. "
            f"Launch into a new directory ({options.directory}=...)."
        ) from None
    first = next_index(entries)
    if append:
        return first
    raise SweepDirError(
        f"{sweep_dir} already holds a sweep ({len(entries)} configs in {MANIFEST_FILE}), and "
        "a directory holds one sweep, so that status and the analysis never take its results for "
        f"another's. Nothing was launched or written. Launch into a new directory "
        f"({options.directory}=...), or add these configs to that sweep with {options.append}: "
        f"they get new indices, from {first} on."
    )
