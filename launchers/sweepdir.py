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
  --append). A manifest of configs that were all infeasible (`skipped`) lists none that ran, and
  the next launch replaces it. Added configs then take the indices after the last one listed: an
  index (and the default output directory named after it) is never given to a second config, so no
  old result.json sits where a new config writes. A dry run's configs have no index to take after.
- `sweep_lock`: whoever gives configs indices in a sweep (a launch, an export, a rerun) holds the
  directory's lock from reading its manifest until it has written the configs there, so that two
  launches added to one sweep at once never take the same indices, and no rewrite of the manifest
  (a rerun, a local launcher marking its configs) drops what another wrote meanwhile. The second
  waits, saying for whom.
- `EarlierConfig`: Hydra's sweepers save each launch's config as multirun.yaml, over the one there,
  before the launcher runs. Added to a sweep, the earlier launch's config (the one its configs, skipped
  ones included, are composed from again by the analysis) stays multirun.yaml, and the added launch's
  is kept beside it as multirun.append<N>.yaml (train.contract.appended_name); a refused launch puts
  the earlier one back. megasweep's launchers read it when Hydra sets them up, before any sweeper
  (Hydra's basic one too) writes there; the layouts search keeps its search.csv the same way.

The errors are Hydra's CompactHydraException: Hydra prints the message alone, without a traceback;
the command-line tools print it after `error:`.

Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from hydra.errors import CompactHydraException

from train.contract import (
    EARLIER_MULTIRUN_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    MULTIRUN_FILE,
    PLAN_FILE,
    SEARCH_FILE,
    ManifestEntry,
    ManifestError,
    appended_name,
    manifest_path,
    read_manifest,
    unwritable,
    write_text_atomic,
)

__all__ = [
    "HYDRA_OPTIONS",
    "EarlierConfig",
    "RunsFailed",
    "SweepDirError",
    "UsageError",
    "SweepOptions",
    "check_indices_free",
    "claim_sweep_dir",
    "free_append_number",
    "first_index",
    "launch_files",
    "lock_holder",
    "missing_dirs",
    "next_index",
    "removed_if_refused",
    "sweep_lock",
    "writable_dir",
]


class UsageError(CompactHydraException):
    """A launch refused for its input before anything ran (a sweep directory, a site option, a search
    option): one paragraph, and the sweepers exit with EXIT_USAGE (launchers.compose.usage_exits),
    where Hydra would exit 1 for any exception, the same status as a run that failed."""


class RunsFailed(CompactHydraException):
    """A launch that ran or queued what it could, some of whose configs failed or were refused: one
    paragraph (which, where their words are, how to rerun them), and the sweepers exit with EXIT_FAILED
    (launchers.compose.usage_exits) without Hydra's hint to set HYDRA_FULL_ERROR, which reads as a crash
    of megasweep's own."""


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
    why = "it is a file, not a directory" if path.exists() and not path.is_dir() else unwritable(path)
    if why is not None:
        raise SweepDirError(
            f"{option}={path}: cannot write there ({why}). Nothing was launched or written. "
            f"Choose a directory you can create and write, e.g. {option}=<a path in your home or "
            "scratch space>."
        )
    return path


def missing_dirs(path: Path) -> list[Path]:
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
    missing = {d for p in paths for d in missing_dirs(Path(p).absolute())}
    try:
        yield
    except BaseException:
        # Deepest first: one of `paths` may lie inside another.
        for made in sorted(missing, key=lambda d: len(d.parts), reverse=True):
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


_HELD: dict[Path, int] = {}
"""The sweep directories whose lock this process holds, with how many blocks hold it (sweep_lock)."""

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""flock's errors where the file system has no locks (NFS without a lock manager, Lustre mounted
without `flock`)."""


@contextlib.contextmanager
def sweep_lock(sweep_dir: str | Path) -> Iterator[None]:
    """The sweep directory's lock (LOCK_FILE, flock) held through the block; the module docstring
    says who takes it. Waits while another process holds it, saying who that is on stderr. A process
    may take it again inside its own block (a rerun's local launch marks configs).

    Where it cannot be had, the block runs without it: a directory that cannot be written (the
    launch that follows refuses it in its own words), a file system without locks (one warning).
    NFS mounted `nolock` and Lustre mounted `localflock` lock within one machine only, silently:
    launches from two login nodes at once then do not wait for each other.
    When the block raises, the lock file and the directories made for it go again (empty ones only),
    so that a refused launch leaves nothing behind. A process that waited for a lock file removed
    meanwhile locks the new one: it checks that the file it holds is still the directory's."""
    key = Path(sweep_dir).resolve()  # one directory, however it was spelled: a second flock would wait for ever
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    path = key / LOCK_FILE
    locked = _locked(path)
    if locked is None:
        yield
        return
    fd, made = locked
    _HELD[key] = 1
    try:
        # Who holds it, for a process that waits (a long command line cut short).
        holder = f"{socket.gethostname()} pid {os.getpid()}: {shlex.join(sys.argv)}"
        os.pwrite(fd, (holder[:300] + ("..." if len(holder) > 300 else "") + "\n").encode(), 0)
        yield
    except BaseException:
        if made:
            path.unlink(missing_ok=True)  # before the unlock: a process waiting for it then takes a new one
            for d in made:
                with contextlib.suppress(OSError):
                    d.rmdir()
        raise
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # a process that waits next names no holder that has let go
        os.close(fd)  # the lock goes with the last descriptor of the file


_warned_no_locks = False


def _locked(path: Path) -> tuple[int, list[Path]] | None:
    """A descriptor of `path` holding its flock and the directories made for it, or None where there
    is none to have (see sweep_lock)."""
    global _warned_no_locks
    waited = False
    for _ in range(100):
        made = missing_dirs(path.parent)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:
            continue  # a refused holder removed the directories between the two calls: make them again
        except OSError:
            return None  # not writable: the launch refuses the directory in its own words
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                print(f"{path.parent.parent}: waiting for another launch, export or rerun into this sweep to "
                      f"list its configs ({holder}); Ctrl-C stops waiting", file=sys.stderr, flush=True)  # fmt: skip
                fcntl.flock(fd, fcntl.LOCK_EX)
                waited = True
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_LOCKS:
                raise
            if not _warned_no_locks:
                _warned_no_locks = True
                print(f"warning: {path.parent.parent}: this file system has no locks ({exc.strerror}); two "
                      "launches into this sweep at once could take the same indices", file=sys.stderr)  # fmt: skip
            return None
        except BaseException:  # Ctrl-C while waiting
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            if waited:
                print(f"{path.parent.parent}: its lock is free; going on", file=sys.stderr, flush=True)
            return fd, made
        os.close(fd)  # removed while this process waited (a refused launch's): lock the one there now
    return None


def lock_holder(sweep_dir: str | Path) -> str | None:
    """The line of the process that holds the sweep's lock now (a launch, export or rerun listing its
    configs: host, pid, command), or None when none does. Read, not taken: a holder's line is there until
    it lets go, and flock is asked only then, whether the line is a live holder's or one killed (SIGKILL
    leaves it) whose lock went with it. Where the file system has no locks, None."""
    path = Path(sweep_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        line = os.pread(fd, 400, 0).decode(errors="replace").strip()
        if not line:
            return None
        try:
            # Shared: a holder's exclusive lock refuses it; with none, it is let go at once.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return line
        except OSError:
            return None
        return None
    finally:
        os.close(fd)  # and with it a shared lock this took


def _holder(fd: int) -> str:
    """The line a lock's holder wrote: a holder that has just taken it writes it a moment later."""
    for _ in range(5):
        text = os.pread(fd, 400, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "another process"


def check_indices_free(old: Sequence[ManifestEntry], new: Sequence[ManifestEntry], sweep_dir: Path) -> None:
    """SweepDirError when an index of `new` is listed in `old` already: another launch took it between
    two batches of this one (a sweeper's batches are claimed once, at the first)."""
    taken = sorted({e.index for e in old} & {e.index for e in new})
    if taken:
        raise SweepDirError(
            f"{sweep_dir}: indices {', '.join(map(str, taken[:10]))}{', ...' if len(taken) > 10 else ''} of this "
            f"launch's configs were taken by another launch meanwhile ({MANIFEST_FILE}). These configs were not "
            "launched; launch them again with hydra.launcher.append=true: they get the next free indices."
        )


def next_index(entries: Sequence[ManifestEntry]) -> int:
    """The index the next config added to a sweep gets: after every index it ever listed."""
    return max((e.index for e in entries), default=-1) + 1


def claim_sweep_dir(
    sweep_dir: str | Path, *, append: bool, options: SweepOptions = HYDRA_OPTIONS, replace_skipped: bool = False
) -> int:
    """Check that configs may be written into `sweep_dir` (created if need be); return the index of
    the first one: see first_index."""
    directory = writable_dir(sweep_dir, option=options.directory)
    return first_index(directory, append=append, options=options, replace_skipped=replace_skipped)


def first_index(
    sweep_dir: str | Path, *, append: bool, options: SweepOptions = HYDRA_OPTIONS, replace_skipped: bool = False
) -> int:
    """The index of the first config launched into `sweep_dir`; nothing is created but the lock
    `replace_skipped` takes.

    0 for a new directory or a dry run's. A directory that holds a sweep or a dry run is refused
    unless `append`, and then its next free index is returned (see the module docstring). `append`
    into a directory that holds neither (nor a layout search's ranking) is refused too: there is
    nothing to add to, and a mistyped directory would start a sweep of its own without a word.

    A manifest every config of which was `skipped` (a launch or export whose configs were all
    infeasible) holds no sweep: nothing ran or was given to Slurm, so no result can be taken for
    another's. Launched into without `append`, it is judged as if it were not there; the launch about
    to write its own (`replace_skipped`: the claim it makes with the sweep's lock, just before it
    writes) removes it, under the lock, once every other refusal here has passed. A check made earlier
    (a sweeper's, before Hydra writes multirun.yaml) leaves it: that launch may yet be refused.
    """
    sweep_dir = Path(sweep_dir)
    path = manifest_path(sweep_dir)
    replaceable = False
    if path.exists():
        entries = _entries(path, sweep_dir, options)
        if append:
            return next_index(entries)
        replaceable = all(e.status == "skipped" for e in entries)
        if not replaceable:
            _refuse_sweep(sweep_dir, entries, options)
    if (sweep_dir / PLAN_FILE).is_file() and not append:
        # Launched there, the dry run's rows would vanish from the analysis of the directory
        # (it reports the launched sweep's manifest) and its results.md would be replaced.
        raise SweepDirError(
            f"{sweep_dir} already holds a dry run ({PLAN_FILE}), and a directory holds one sweep. "
            f"Nothing was launched or written. Launch into a new directory ({options.directory}=...), "
            f"or into this one with {options.append}: {PLAN_FILE} then stays beside the configs added."
        )
    if append and not any((sweep_dir / name).is_file() for name in (PLAN_FILE, SEARCH_FILE)):
        raise SweepDirError(
            f"{options.append}: {sweep_dir} holds no sweep to add these configs to (no {MANIFEST_FILE}, "
            f"{PLAN_FILE} or {SEARCH_FILE}). Nothing was launched or written. Check the directory "
            f"({options.directory}=...), or leave {options.append.split('=')[0]} out to start a sweep there."
        )
    if replaceable and replace_skipped:
        with sweep_lock(sweep_dir):  # held already by the claim; another launch may have listed configs since
            entries = _entries(path, sweep_dir, options) if path.exists() else []
            if not all(e.status == "skipped" for e in entries):
                _refuse_sweep(sweep_dir, entries, options)
            path.unlink(missing_ok=True)
    return 0


def _entries(path: Path, sweep_dir: Path, options: SweepOptions) -> list[ManifestEntry]:
    try:
        return read_manifest(path)
    except (OSError, ManifestError) as exc:
        raise SweepDirError(
            f"{sweep_dir} holds a {MANIFEST_FILE} that cannot be read ({exc}), so it cannot be added to. "
            f"Launch into a new directory ({options.directory}=...)."
        ) from None


def _refuse_sweep(sweep_dir: Path, entries: Sequence[ManifestEntry], options: SweepOptions) -> NoReturn:
    raise SweepDirError(
        f"{sweep_dir} already holds a sweep ({len(entries)} configs in {MANIFEST_FILE}), and "
        "a directory holds one sweep, so that status and the analysis never take its results for "
        f"another's. Nothing was launched or written. Launch into a new directory "
        f"({options.directory}=...), or add these configs to that sweep with {options.append}: "
        f"they get new indices, from {next_index(entries)} on."
    )


def launch_files(sweep_dir: Path) -> tuple[tuple[str, bytes | None], ...]:
    """What a launch into `sweep_dir` writes besides Hydra's config (None for a file not there)."""
    names = [MANIFEST_FILE, PLAN_FILE, SEARCH_FILE]
    names += sorted(p.name for p in sweep_dir.glob(appended_name(SEARCH_FILE, "*")))
    out: list[tuple[str, bytes | None]] = []
    for name in names:
        try:
            out.append((name, (sweep_dir / name).read_bytes()))
        except OSError:
            out.append((name, None))
    return tuple(out)


def free_append_number(sweep_dir: Path, *names: str) -> int:
    """The first N (from 1) for which no appended_name(name, N) of `names` is in `sweep_dir`: one
    number per added launch, shared by the files it keeps (multirun.append2.yaml, search.append2.csv)."""
    number = 1
    while any((sweep_dir / appended_name(name, number)).exists() for name in names):
        number += 1
    return number


@dataclass
class EarlierConfig:
    """The multirun.yaml in a sweep directory before a launch, read before a sweeper saves the
    launch's own config over it (see the module docstring). `read` it first; then, once the sweeper
    has saved, `keep` (a launch that goes ahead) or `keep_if_launched` (one that ends in an exception).
    A second call of either does what is left, if anything.

    Read with `copy`, it is also copied to EARLIER_MULTIRUN_FILE until kept, so that a launch killed
    before it keeps it (SIGKILL, SIGTERM while the sweeper checks its configs) loses nothing: the
    next `read` with `copy` finds that copy, puts it back and keeps it as the earlier config."""

    sweep_dir: Path
    text: bytes | None
    """The earlier config; None when there was none."""
    append: bool
    """The launch adds configs to the sweep there; without it, its config is the directory's own."""
    launch_files: tuple[tuple[str, bytes | None], ...] = ()
    copied: bool = False
    """EARLIER_MULTIRUN_FILE holds `text` until kept."""
    kept: Path | None = field(default=None, init=False)
    """Where this launch's config went, once kept."""

    @classmethod
    def read(cls, sweep_dir: str | Path, *, append: bool, copy: bool = False) -> EarlierConfig:
        sweep_dir = Path(sweep_dir)
        copy_path = sweep_dir / EARLIER_MULTIRUN_FILE
        try:
            left = copy_path.read_bytes() if copy else None
        except OSError:
            left = None
        if left is not None:
            # An earlier launch was killed before it kept the sweep's config: the multirun.yaml
            # there now may be that launch's own.
            earlier = cls(sweep_dir, left, append, copied=True)
            earlier._put_back()
        else:
            try:
                text = (sweep_dir / MULTIRUN_FILE).read_bytes()
            except OSError:  # no earlier Hydra launch (a new or an exported sweep): this one's is the first
                text = None
            earlier = cls(sweep_dir, text, append)
            if copy and text is not None:
                # A directory that cannot take the copy cannot take the launch either: the claim on
                # it says why (launchers.sweepdir.writable_dir), not a traceback from here.
                with contextlib.suppress(OSError):
                    copy_path.parent.mkdir(exist_ok=True)
                    write_text_atomic(copy_path, text)
                    earlier.copied = True
        if earlier.text is not None:
            earlier.launch_files = launch_files(sweep_dir)
        return earlier

    def keep(self, number: int | None = None) -> Path | None:
        """An added launch's config moved to appended_name(MULTIRUN_FILE, N) and the earlier one put
        back, when the sweeper wrote a config that differs (an identical one needs no second copy).
        N: `number`, else free_append_number's."""
        if self.text is None or self.kept is not None:
            return self.kept
        current = self._current()
        if self.append and current is not None and current != self.text:
            if number is None:
                number = free_append_number(self.sweep_dir, MULTIRUN_FILE, SEARCH_FILE)
            self.kept = self.sweep_dir / appended_name(MULTIRUN_FILE, number)
            self.kept.write_bytes(current)
            self._put_back()
        self._drop_copy()
        return self.kept

    def keep_if_launched(self) -> None:
        """For a launch that ends in an exception: its config is kept (`keep`) only if it wrote
        something (a manifest, a plan, a search); refused before that, appended or not, it leaves the
        directory as it was, the earlier config in multirun.yaml."""
        if self.text is None:
            return
        if launch_files(self.sweep_dir) != self.launch_files:
            self.keep()
            return
        if self.kept is not None:
            self.kept.unlink(missing_ok=True)
            self.kept = None
        if self._current() != self.text:
            self._put_back()
        self._drop_copy()

    def _current(self) -> bytes | None:
        try:
            return (self.sweep_dir / MULTIRUN_FILE).read_bytes()
        except OSError:
            return None

    def _put_back(self) -> None:
        assert self.text is not None
        # Replaced, not rewritten in place: multirun.yaml is never missing or half-written.
        write_text_atomic(self.sweep_dir / MULTIRUN_FILE, self.text)

    def _drop_copy(self) -> None:
        if self.copied:
            path = self.sweep_dir / EARLIER_MULTIRUN_FILE
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the state directory goes too if the copy was all it held
                path.parent.rmdir()
            self.copied = False
