"""One sweep per directory, checked before anything is written into it.

Every launcher (`hydra/launcher=slurm|local|plan`), `hydra/sweeper=megasweep|layouts` and the export
(`python -m launchers sbatch`) call these first:

- `writable_dir`: the directory is created and proved writable (a file made and removed), so an
  unwritable one is one paragraph naming the option to change, before a script, a manifest or a
  job exists, instead of a traceback halfway through.
- `removed_if_refused`: the directories a refused command created (writable_dir creates what it
  checks) are removed again, so that a refusal leaves nothing behind.
- `claim_sweep_dir`: a directory whose manifest.jsonl lists a sweep, or whose plan.csv holds a
  dry run, is refused, unless the user asks to add to that sweep (hydra.launcher.append=true,
  --append). Added configs then take the indices after the last one listed: an index (and the
  default output directory named after it) is never given to a second config, so no old
  result.json sits where a new config writes. A dry run's configs have no index to take after.
- `EarlierConfig`: Hydra's sweeper saves each launch's config as multirun.yaml, over the one there.
  Added to a sweep, the earlier launch's config (the one its configs, skipped ones included, are
  composed from again by the analysis) stays multirun.yaml, and the added launch's is kept beside
  it as multirun.append<N>.yaml (train.contract.appended_multirun_name).

The errors are Hydra's CompactHydraException: Hydra prints the message alone, without a traceback;
the command-line tools print it after `error:`.

Torch-free.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.errors import CompactHydraException

from train.contract import (
    MANIFEST_FILE,
    MULTIRUN_FILE,
    PLAN_FILE,
    SEARCH_FILE,
    ManifestEntry,
    ManifestError,
    appended_multirun_name,
    manifest_path,
    read_manifest,
    unwritable,
)

__all__ = [
    "HYDRA_OPTIONS",
    "EarlierConfig",
    "SweepDirError",
    "UsageError",
    "SweepOptions",
    "claim_sweep_dir",
    "first_index",
    "next_index",
    "removed_if_refused",
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


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist, deepest first."""
    missing = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    return missing


@contextlib.contextmanager
def removed_if_refused(*paths: Path) -> Iterator[None]:
    """The directories among `paths` (and their parents) that the block creates are removed again
    when it raises. Only empty ones go (rmdir): a directory that was there, or that another process
    wrote into meanwhile, stays as it is."""
    missing = {d for p in paths for d in _missing_dirs(Path(p).absolute())}
    try:
        yield
    except BaseException:
        # Deepest first: one of `paths` may lie inside another.
        for made in sorted(missing, key=lambda d: len(d.parts), reverse=True):
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


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


def _launch_files(sweep_dir: Path) -> tuple[bytes | None, ...]:
    """What a launch into `sweep_dir` writes besides Hydra's config (None for a file not there)."""
    out: list[bytes | None] = []
    for name in (MANIFEST_FILE, PLAN_FILE, SEARCH_FILE):
        try:
            out.append((sweep_dir / name).read_bytes())
        except OSError:
            out.append(None)
    return tuple(out)


@dataclass
class EarlierConfig:
    """The multirun.yaml of a sweep that a launch adds configs to, read before Hydra's sweeper saves
    the launch's own config over it (see the module docstring). `read` it first, then `keep` once the
    sweeper has saved (and again when the launch ends: a second call does nothing)."""

    sweep_dir: Path
    text: bytes | None
    """The earlier config; None when there is none to keep (a new sweep, or not appending)."""
    launch_files: tuple[bytes | None, ...] = ()
    kept: Path | None = field(default=None, init=False)
    """Where this launch's config went, once kept."""

    @classmethod
    def read(cls, sweep_dir: str | Path, *, append: bool) -> EarlierConfig:
        sweep_dir = Path(sweep_dir)
        try:
            text = (sweep_dir / MULTIRUN_FILE).read_bytes() if append else None
        except OSError:  # no earlier Hydra launch (an exported sweep): this one's config is the first
            text = None
        return cls(sweep_dir, text, _launch_files(sweep_dir) if text is not None else ())

    def keep(self) -> Path | None:
        """This launch's config moved to the first free appended_multirun_name and the earlier one put
        back, when the sweeper wrote a config that differs (an identical one needs no second copy)."""
        path = self.sweep_dir / MULTIRUN_FILE
        if self.text is None or self.kept is not None:
            return self.kept
        try:
            current = path.read_bytes()
        except OSError:
            current = None
        if current is None or current == self.text:
            return None
        number = 1
        while (self.sweep_dir / appended_multirun_name(number)).exists():
            number += 1
        self.kept = self.sweep_dir / appended_multirun_name(number)
        self.kept.write_bytes(current)
        # Replaced, not rewritten in place: multirun.yaml is never missing or half-written.
        tmp = path.with_name(f".{MULTIRUN_FILE}.{os.getpid()}.tmp")
        tmp.write_bytes(self.text)
        os.replace(tmp, path)
        return self.kept

    def keep_if_launched(self) -> None:
        """For a launch that ends in an exception: its config is kept only if it wrote something
        (a manifest, a plan); refused before that, it leaves the directory as it was."""
        self.keep()
        if self.kept is not None and _launch_files(self.sweep_dir) == self.launch_files:
            self.kept.unlink(missing_ok=True)
            self.kept = None
