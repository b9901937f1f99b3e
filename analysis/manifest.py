"""The sweep manifest: <sweep dir>/manifest.jsonl, one JSON object per config per line.

The launchers (and `python -m launchers sbatch`) write one entry per config they were given;
`python -m launchers status` and the analysis read it to know which configs are still missing
a result.json. Both sides use this module so that the format has one definition.

    {"index": 3, "overrides": ["parallelism.tp=2"], "output_dir": "3", "status": "submitted",
     "reason": null, "job_id": "1234_3", "shape": {"nodes": 2, "tasks_per_node": 2}}

An entry's status is one of ENTRY_STATUSES:

    submitted   a job was queued for it (job_id says which; null for the local launcher)
    exported    written into an array script by `python -m launchers sbatch`, for the user to
                submit: no job id is known when the manifest is written. Each array task records
                its own job id in <sweep dir>/.megasweep/jobs/<index> when it starts, and
                resolve_exported() puts it into the entry for the readers.
    refused     sbatch refused its job (unknown partition, bad gres): reason holds Slurm's words
    skipped     infeasible, never submitted: reason holds the validator's paragraph

Manifests written before `refused` existed stored a refused sbatch as `skipped` with a reason
starting "sbatch refused: "; they are read as `refused`, so that old sweeps report (and rerun)
them as the failures they are.

Torch-free and pandas-free: the launcher imports it on login nodes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from train.metrics import write_text_atomic

MANIFEST_FILE = "manifest.jsonl"
ENTRY_STATUSES = ("submitted", "exported", "refused", "skipped")
REFUSED_PREFIX = "sbatch refused: "
"""How the reason of a `refused` entry starts (and how old manifests marked one, as `skipped`)."""
EXPORTED_JOBS_DIR = ".megasweep/jobs"
"""Where an exported script's array tasks record their job ids (one file per config index)."""
_JOB_ID = re.compile(r"\d+(_\d+)?")


class ManifestError(ValueError):
    """A manifest line that is not a valid entry (the message names the file and line)."""


@dataclass(frozen=True)
class ManifestEntry:
    """One config of a sweep as the launcher handled it."""

    index: int
    """Position of the config in the sweep (the Slurm array task id when submitted)."""
    overrides: tuple[str, ...]
    """The Hydra overrides of the config (a list in JSON)."""
    output_dir: str
    """The run's output directory, relative to the sweep directory (POSIX separators)."""
    status: str
    """One of ENTRY_STATUSES (see the module docstring)."""
    reason: str | None = None
    """Why the config was skipped or refused; where it was exported to; None when submitted."""
    job_id: str | None = None
    """Slurm job id of the run, e.g. '1234_5' for array task 5 of job 1234; None when none is known."""
    shape: Mapping[str, int] = field(default_factory=dict)
    """Slurm shape of the job, e.g. {'nodes': 2, 'tasks_per_node': 2}."""

    def __post_init__(self) -> None:
        # Validate here so that an entry that exists is always one the other side can read.
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ManifestError(f"index must be a non-negative integer, got {self.index!r}")
        if not all(isinstance(o, str) for o in self.overrides):
            raise ManifestError(f"overrides must be strings, got {list(self.overrides)!r}")
        if self.status not in ENTRY_STATUSES:
            raise ManifestError(f"status must be one of {', '.join(ENTRY_STATUSES)}, got {self.status!r}")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ManifestError(f"output_dir must be a non-empty relative path, got {self.output_dir!r}")
        if PurePosixPath(self.output_dir).is_absolute():
            raise ManifestError(f"output_dir must be relative to the sweep directory, got {self.output_dir!r}")
        for key, value in self.shape.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int):
                raise ManifestError(f"shape must map names to integers, got {dict(self.shape)!r}")
        # Frozen: normalise through object.__setattr__ so equal entries compare equal whatever their input.
        object.__setattr__(self, "overrides", tuple(self.overrides))
        object.__setattr__(self, "output_dir", normalize_dir(self.output_dir))
        object.__setattr__(self, "shape", dict(self.shape))

    @property
    def nodes(self) -> int | None:
        return self.shape.get("nodes")

    def to_json(self) -> dict[str, Any]:
        """The entry as the JSON object of one manifest line."""
        return {
            "index": self.index,
            "overrides": list(self.overrides),
            "output_dir": self.output_dir,
            "status": self.status,
            "reason": self.reason,
            "job_id": self.job_id,
            "shape": dict(self.shape),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ManifestEntry:
        """Entry from one line's object; ManifestError when a key is missing or of the wrong type."""
        if not isinstance(obj, Mapping):
            raise ManifestError(f"expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in ("index", "overrides", "output_dir", "status") if k not in obj]
        if missing:
            raise ManifestError(f"missing key(s) {', '.join(missing)}")
        overrides = obj["overrides"]
        if not isinstance(overrides, list):
            raise ManifestError(f"overrides must be a list of strings, got {overrides!r}")
        reason, job_id, shape = obj.get("reason"), obj.get("job_id"), obj.get("shape") or {}
        if reason is not None and not isinstance(reason, str):
            raise ManifestError(f"reason must be a string or null, got {reason!r}")
        status = obj["status"]
        if status == "skipped" and reason is not None and reason.startswith(REFUSED_PREFIX):
            status = "refused"  # written before `refused` existed (see the module docstring)
        if job_id is not None and not isinstance(job_id, str | int):
            raise ManifestError(f"job_id must be a string or null, got {job_id!r}")
        if not isinstance(shape, Mapping):
            raise ManifestError(f"shape must be an object, got {shape!r}")
        return cls(
            index=obj["index"],
            overrides=tuple(overrides),
            output_dir=obj["output_dir"],
            status=status,
            reason=reason,
            job_id=None if job_id is None else str(job_id),
            shape=shape,
        )


def normalize_dir(path: str) -> str:
    """A relative directory in one spelling ('./a//b/' -> 'a/b'), so that paths from both sides match."""
    parts = [p for p in PurePosixPath(path.replace(os.sep, "/")).parts if p not in ("", ".")]
    return "/".join(parts) or "."


def manifest_path(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / MANIFEST_FILE


def read_manifest(path: str | Path) -> list[ManifestEntry]:
    """Entries of a manifest file (or of <dir>/manifest.jsonl when given a directory), in file order.

    A last line without its newline that does not parse is a line the launcher is still
    writing: it is ignored. Any other bad line raises ManifestError naming the line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_FILE
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last_unterminated = number == len(lines) and not text.endswith("\n")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if last_unterminated:
                break
            raise ManifestError(f"{path}:{number}: not JSON ({exc.msg})") from None
        try:
            entries.append(ManifestEntry.from_json(obj))
        except ManifestError as exc:
            raise ManifestError(f"{path}:{number}: {exc}") from None
    return entries


def recorded_job_id(sweep_dir: str | Path, index: int) -> str | None:
    """The job id an exported script's array task recorded for config `index`, or None (not started)."""
    try:
        text = (Path(sweep_dir) / EXPORTED_JOBS_DIR / str(index)).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    # Anything else is not what the script writes: better unknown than a wrong job's state.
    return text if _JOB_ID.fullmatch(text) else None


def resolve_exported(entries: Iterable[ManifestEntry], sweep_dir: str | Path) -> list[ManifestEntry]:
    """Entries with each `exported` one's job id filled in from what its array task recorded.

    The status stays `exported` (the job was submitted by hand, not by megasweep); an entry
    whose task has not started yet keeps job_id None.
    """
    out = []
    for e in entries:
        if e.status == "exported" and e.job_id is None:
            job = recorded_job_id(sweep_dir, e.index)
            e = dataclasses.replace(e, job_id=job) if job is not None else e
        out.append(e)
    return out


def write_manifest(entries: Iterable[ManifestEntry], path: str | Path) -> Path:
    """Write the whole manifest atomically (a reader sees the old file or the new one)."""
    path = Path(path)
    text = "".join(json.dumps(e.to_json(), sort_keys=False) + "\n" for e in entries)
    write_text_atomic(path, text)
    return path


def append_manifest(entries: Iterable[ManifestEntry], path: str | Path) -> Path:
    """Append entries, one whole line per write, for a launcher that submits in batches."""
    path = Path(path)
    with open(path, "a", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e.to_json()) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


__all__ = [
    "ENTRY_STATUSES",
    "EXPORTED_JOBS_DIR",
    "MANIFEST_FILE",
    "REFUSED_PREFIX",
    "ManifestEntry",
    "ManifestError",
    "append_manifest",
    "manifest_path",
    "normalize_dir",
    "read_manifest",
    "recorded_job_id",
    "resolve_exported",
    "write_manifest",
]
