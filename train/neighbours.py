"""The other Slurm jobs running on a job's nodes: what its timings shared the machines with.

Jobs of one sweep (and other users' jobs) share nodes unless they ask for whole ones
(cluster.exclusive), and a neighbour's work shows up in the seconds per iteration: within one
sweep, iterations of the same run went from 10.4 s to 1.8 s (issue 13). The record says who
was there, sampled from squeue at the start and at the end of training, so that a timing
measured beside other jobs is recognisable as such. Two samples miss a job that started after the
start and ended before the end, so the end also asks accounting (sacct) for every job that ran on
those nodes at any time between the two. Outside Slurm there is nothing to ask.

Torch-free.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from typing import Any

SQUEUE_TIMEOUT_S = 15
"""An answer later than this is not worth holding a training run for (seconds)."""


def own_job_ids(environ: Mapping[str, str]) -> set[str]:
    """The ids squeue may show this job under: its own, and '<array>_<task>' for an array task."""
    ids = {environ.get("SLURM_JOB_ID", "")}
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        ids.add(f"{array}_{task}")
    return ids - {""}


def running_on_nodes(environ: Mapping[str, str]) -> list[str] | None:
    """Job ids running on this job's nodes besides itself; None outside Slurm or when squeue fails."""
    nodes = environ.get("SLURM_JOB_NODELIST")
    if not nodes or not environ.get("SLURM_JOB_ID"):
        return None
    try:
        out = subprocess.run(
            ["squeue", f"--nodelist={nodes}", "--noheader", "--states=RUNNING,COMPLETING", "--format=%i"],
            capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted({line.strip() for line in out.splitlines() if line.strip()} - own_job_ids(environ))


def _sacct_time(epoch_s: float) -> str:
    # sacct reads local time, to the second; the window is widened by a second each way so that a
    # job starting or ending within our first or last second is still inside it.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch_s))


def ran_on_nodes_between(environ: Mapping[str, str], start_s: float, end_s: float) -> list[str] | None:
    """Job ids that were running on this job's nodes at any time between two epoch times, itself
    excepted (sacct: a state filter with a time window selects the jobs in that state during it);
    None outside Slurm or when accounting does not answer. A job that ended in the last few seconds may
    be missing: slurmdbd lists it for a --nodelist query up to ~3 s after it completes (local cluster)."""
    nodes = environ.get("SLURM_JOB_NODELIST")
    if not nodes or not environ.get("SLURM_JOB_ID"):
        return None
    try:
        out = subprocess.run(
            ["sacct", "-X", "-n", "-P", f"--nodelist={nodes}", "--state=RUNNING",
             f"--starttime={_sacct_time(start_s - 1)}", f"--endtime={_sacct_time(end_s + 1)}", "--format=JobID"],
            capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted({line.strip() for line in out.splitlines() if line.strip()} - own_job_ids(environ))


class NeighbourWatch:
    """Samples the neighbours at the start and the end of training, and asks accounting for every job
    that ran beside it in between (train.contract.RunRecord.neighbours)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.started = time.time()
        self.at_start = running_on_nodes(environ)
        self.at_end: list[str] | None = None

    def stop(self) -> dict[str, Any]:
        """The record's `neighbours`: empty outside Slurm."""
        self.at_end = running_on_nodes(self.environ)
        if self.at_start is None and self.at_end is None:
            return {}
        return {
            "nodes": self.environ.get("SLURM_JOB_NODELIST"),
            "at_start": self.at_start,
            "at_end": self.at_end,
            "during": ran_on_nodes_between(self.environ, self.started, time.time()),
        }


def seen(neighbours: Mapping[str, Any]) -> list[str]:
    """Every job a record saw on its nodes: at the start, at the end, or in accounting in between."""
    return sorted({*(neighbours.get("at_start") or ()), *(neighbours.get("at_end") or ()),
                   *(neighbours.get("during") or ())})  # fmt: skip


def isolation_note(*, exclusive: bool | None, cluster: str = "", core_license: str | None = None) -> str:
    """What neighbours mean for a run's timing, and what would have kept them off, as its cluster
    config says how it was isolated: a core license (the local cluster, whose emulated nodes share
    one host, so a whole node isolates nothing), whole nodes already asked for, or neither."""
    if core_license:
        return (
            f"cluster {cluster or '(unnamed)'}'s `{core_license}` license (cluster.core_license) kept the jobs "
            "running together to no more CPUs than the host has cores, but its timing may include their load "
            "on the host's memory and caches"
        )
    if exclusive:
        # Asking for whole nodes again is no remedy: the run already did.
        return (
            "it had asked for whole nodes (cluster.exclusive=true), yet Slurm listed them there (a partition "
            "that shares nodes whatever a job asks, or jobs at the edges of its training window), so its "
            "timing may include their load: compare it with a run that saw none"
        )
    return "its timing includes their load (cluster.exclusive=true asks for whole nodes)"


def neighbour_warning(
    neighbours: Mapping[str, Any], *, exclusive: bool, cluster: str = "", core_license: str | None = None
) -> str | None:
    """The record's warning when other jobs ran on the job's nodes (None when none did)."""
    jobs = seen(neighbours)
    if not jobs:
        return None
    note = isolation_note(exclusive=exclusive, cluster=cluster, core_license=core_license)
    return f"other Slurm jobs ran on this job's nodes ({neighbours.get('nodes')}): {', '.join(jobs)}; {note}"
