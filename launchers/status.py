"""Progress of a launched sweep, and resubmission of its failures.

    python -m launchers status <sweep dir>
    python -m launchers rerun <sweep dir> --failed

The state of each config comes from what outlives the submitting process: the manifest
(what was submitted, exported, refused or skipped, under which job id), each run's result.json
(written by the trainer whatever happens), and Slurm (squeue for live jobs, sacct for ended
ones). A result.json wins over Slurm: it says what the run itself saw. A job that ended without
one (killed by the time limit, out of host memory, cancelled) is failed by its Slurm state.

A config whose sbatch Slurm refused is `refused` (Slurm's message as detail): it never ran.
A config of an exported array script (`python -m launchers sbatch`, submitted by hand) has no
job id in the manifest; its array task records one when it starts (analysis.manifest.
resolve_exported), and until then the config is `pending` (queued or not yet submitted: this
side cannot tell which).

`rerun --failed` resubmits the `failed` and the `refused` configs: a refused sbatch is a
config that did not run, and rerunning it after fixing the cause (a partition back up, a
quota raised) is what a user wants; an infeasible (`skipped`) config would fail the same way
again and is left alone. Exported configs are resubmitted by the launcher (submitit), with the
settings the export saved in <sweep dir>/.megasweep/launch.json.

Torch-free.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.manifest import ManifestEntry, manifest_path, read_manifest, resolve_exported, write_manifest
from launchers.slurm import RESULT_FILE, load_launch_file, merge_entries, submit_configs

__all__ = [
    "RERUN_STATES",
    "STATES",
    "ConfigStatus",
    "classify",
    "expand_job_ids",
    "format_status",
    "query_slurm_states",
    "rerun_failed",
    "sweep_status",
]

STATES = ("pending", "running", "done", "failed", "refused", "skipped")
RERUN_STATES = frozenset({"failed", "refused"})
"""States `rerun --failed` resubmits (see the module docstring)."""
# Slurm states of a job that ended without success (sacct's names; 'CANCELLED by 0' is cut to its first word).
FAILED_SLURM_STATES = frozenset(
    {"FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)
RUNNING_SLURM_STATES = frozenset(
    {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SUSPENDED", "SIGNALING"}
)


@dataclass(frozen=True)
class ConfigStatus:
    """Where one config of a sweep stands."""

    index: int
    overrides: tuple[str, ...]
    state: str
    """One of STATES."""
    job_id: str | None
    slurm_state: str | None
    """As squeue/sacct last reported it; None when Slurm does not know the job (yet)."""
    detail: str
    """Why failed or skipped; empty otherwise."""


def classify(
    entry: ManifestEntry, record: Mapping[str, Any] | None, slurm_state: str | None
) -> tuple[str, str]:
    """(state, detail) of one config from its manifest entry, result.json and Slurm state."""
    if entry.status == "skipped":
        return "skipped", entry.reason or ""
    if entry.status == "refused":
        return "refused", entry.reason or ""
    if record is not None:
        status = record.get("status")
        if status == "ok":
            return "done", ""
        return "failed", f"result.json status {status}: {record.get('message') or 'no message'}"
    if slurm_state is None:
        if entry.status == "exported" and entry.job_id is None:
            return "pending", f"no job started yet ({entry.reason or 'exported'})"
        return "pending", ""
    base = slurm_state.split()[0] if slurm_state.split() else ""
    if base in FAILED_SLURM_STATES:
        return "failed", f"Slurm state {base}, no result.json"
    if base == "COMPLETED":
        # The trainer writes result.json before it exits: a job that completed without one ran something else.
        return "failed", "job completed without writing result.json"
    if base in RUNNING_SLURM_STATES:
        return "running", ""
    return "pending", base


_ARRAY_RANGE = re.compile(r"^(\d+)_\[([\d,\-]+)(?:%\d+)?\]$")


def expand_job_ids(job_id: str) -> list[str]:
    """'12_[0-2,5%2]' -> ['12_0', '12_1', '12_2', '12_5']; any other id unchanged (squeue/sacct spell pending arrays so)."""
    match = _ARRAY_RANGE.match(job_id)
    if not match:
        return [job_id]
    array, ranges = match.groups()
    ids: list[str] = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        ids.extend(f"{array}_{i}" for i in range(int(first), int(last or first) + 1))
    return ids


def _run(args: Sequence[str]) -> str | None:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def query_slurm_states(job_ids: Iterable[str]) -> dict[str, str]:
    """State of each job (or array task) id: sacct's record, overridden by squeue for live jobs."""
    arrays = sorted({j.split("_")[0] for j in job_ids})
    if not arrays:
        return {}
    states: dict[str, str] = {}
    joined = ",".join(arrays)
    # sacct lists a requeued job once per run, oldest first: the last line is the current one.
    for out, sep in (
        (_run(["sacct", "-X", "-n", "-P", "-j", joined, "--format=JobID,State"]), "|"),
        (_run(["squeue", "-h", "-r", "-j", joined, "-o", "%i|%T"]), "|"),
    ):
        for line in (out or "").splitlines():
            jid, _, state = line.strip().partition(sep)
            if jid and state:
                for one in expand_job_ids(jid):
                    states[one] = state.strip()
    return states


def _record(sweep_dir: Path, entry: ManifestEntry) -> dict[str, Any] | None:
    path = sweep_dir / entry.output_dir / RESULT_FILE
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def sweep_status(
    sweep_dir: str | Path, *, slurm_states: Mapping[str, str] | None = None
) -> list[ConfigStatus]:
    """Status of every config in the sweep's manifest (Slurm is asked unless `slurm_states` is given)."""
    sweep_dir = Path(sweep_dir)
    entries = resolve_exported(read_manifest(manifest_path(sweep_dir)), sweep_dir)
    if slurm_states is None:
        slurm_states = query_slurm_states(e.job_id for e in entries if e.job_id)
    out = []
    for e in entries:
        slurm = slurm_states.get(e.job_id) if e.job_id else None
        state, detail = classify(e, _record(sweep_dir, e), slurm)
        out.append(ConfigStatus(e.index, e.overrides, state, e.job_id, slurm, detail))
    return out


def format_status(statuses: Sequence[ConfigStatus], *, width: int = 40, detail_chars: int = 100) -> str:
    """One row per config (only the overrides that differ between configs), then counts and a bar."""
    varying = _varying_overrides(statuses)
    rows = [("index", "state", "job", "overrides", "detail")]
    for s in statuses:
        shown = " ".join(o for o in s.overrides if o in varying[s.index]) or "-"
        detail = s.detail if len(s.detail) <= detail_chars else s.detail[: detail_chars - 3] + "..."
        rows.append((str(s.index), s.state, s.job_id or "-", shown, detail))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines = [line.rstrip() for line in lines]
    counts = {state: sum(1 for s in statuses if s.state == state) for state in STATES}
    total = len(statuses) - counts["skipped"]
    # A refused config will not run unless rerun: it is as finished as a failed one.
    finished = counts["done"] + counts["failed"] + counts["refused"]
    filled = round(width * finished / total) if total else width
    bar = "#" * filled + "." * (width - filled)
    lines.append(
        f"[{bar}] {finished}/{total} finished: " + ", ".join(f"{counts[state]} {state}" for state in STATES)
    )
    return "\n".join(lines)


def _varying_overrides(statuses: Sequence[ConfigStatus]) -> dict[int, set[str]]:
    common = set.intersection(*(set(s.overrides) for s in statuses)) if statuses else set()
    return {s.index: set(s.overrides) - common for s in statuses}


def rerun_failed(sweep_dir: str | Path) -> list[ManifestEntry]:
    """Resubmit exactly the failed configs (result not ok, or ended in Slurm without a result)
    and the refused ones (sbatch refused them; see the module docstring).

    Their old result.json is kept beside as result.<old job id>.json, so that `status` does
    not read it as the new run's; finished (ok) results are not touched. The manifest is
    rewritten after each array is queued. Returns the new manifest entries of the resubmitted
    configs (a config Slurm refuses again comes back `refused`).
    """
    sweep_dir = Path(sweep_dir).resolve()
    failed = [s for s in sweep_status(sweep_dir) if s.state in RERUN_STATES]
    if not failed:
        return []
    settings, specs = load_launch_file(sweep_dir)
    missing = [s.index for s in failed if s.index not in specs]
    if missing:
        raise ValueError(
            f"{sweep_dir}: no launch record for configs {missing} (launched by another launcher?)"
        )
    for s in failed:
        old = sweep_dir / specs[s.index].output_dir / RESULT_FILE
        if old.exists():
            old.rename(old.with_name(f"result.{s.job_id or 'previous'}.json"))
    path = manifest_path(sweep_dir)
    before = read_manifest(path)
    submission = submit_configs(
        sweep_dir,
        [specs[s.index] for s in failed],
        settings,
        on_queued=lambda queued: write_manifest(merge_entries(before, queued), path),
    )
    write_manifest(merge_entries(before, submission.entries), path)
    return submission.entries
