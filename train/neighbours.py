"""The other Slurm jobs running on a job's nodes: what its timings shared the machines with.

Jobs of one sweep (and other users' jobs) share nodes unless they ask for whole ones
(cluster.exclusive), and a neighbour's work shows up in the seconds per iteration: within one
sweep, iterations of the same run went from 10.4 s to 1.8 s (issue 13). The record says who
was there, sampled from squeue at the start and at the end of training, so that a timing
measured beside other jobs is recognisable as such. Outside Slurm there is nothing to ask.

Torch-free.
"""

from __future__ import annotations

import subprocess
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


class NeighbourWatch:
    """Samples the neighbours at the start and the end of training (train.contract.RunRecord.neighbours)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
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
        }


def neighbour_warning(neighbours: Mapping[str, Any]) -> str | None:
    """The record's warning when other jobs ran on the job's nodes (None when none did)."""
    seen = sorted({*(neighbours.get("at_start") or ()), *(neighbours.get("at_end") or ())})
    if not seen:
        return None
    return (
        f"other Slurm jobs ran on this job's nodes ({neighbours.get('nodes')}): {', '.join(seen)}; its timings "
        "include their load (cluster.exclusive=true asks for whole nodes)"
    )
