"""The state of one launched config, judged in one place for `python -m launchers status` and for
`python -m analysis` (which then disagreed: a requeued job's old record, a damaged record, a local
launcher's queued or killed config).

A config is judged from what outlives the process that launched it (launchers.status explains each
rule): its manifest entry, its own result.json (None when there is none, or only another config's),
Slurm's state of its job, the local launcher that runs it (a local sweep has no Slurm job) and why
the file in its directory could not be read, if it could not. `judge` answers with the state, the
detail a user reads, and what decided it (`Judged.cause`), so that the analysis can keep the kind
of failure a record names (oom, nan, timeout) where status says `failed`.

Hydra-free and torch-free: the analysis imports it without either.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

from launchers.queue import (
    FORGOTTEN,
    GONE,
    base_state,
    is_cancelled,
    is_live,
    is_preempted,
    is_running,
    not_a_time_limit,
)
from train.contract import RESULT_FILE, LocalRun, ManifestEntry, read_local_runs

__all__ = ["CAUSES", "Judged", "asks_slurm", "classify", "judge", "local_launchers", "local_run_state", "process_start"]

Cause = Literal["manifest", "record", "requeued", "stopped", "slurm", "local", "damaged", "unknown"]
CAUSES: tuple[Cause, ...] = get_args(Cause)
"""What decided a config's state: its manifest entry (skipped, refused, interrupted, killed here); its
own record; Slurm running an earlier attempt's job again (`requeued`: the record is that attempt's);
a `timeout` record of a job cancelled or preempted (`stopped`: the state is `cancelled` for a cancelled
one, as for a record the in-job wrapper marked so or a job cancelled before its record, and `preempted`
for a preempted one); Slurm's state of a job without a record;
its local launcher; a record damaged after its run ended; nothing yet (`unknown`: no record, no state)."""


class Judged(NamedTuple):
    """One config's state (launchers.status.STATES), why, and what decided it (CAUSES)."""

    state: str
    detail: str
    cause: Cause


def judge(
    entry: ManifestEntry,
    record: Mapping[str, Any] | None,
    slurm_state: str | None,
    *,
    local_run: LocalRun | None = None,
    unreadable: str | None = None,
) -> Judged:
    """The state of the config of `entry`: `record` its own result.json (None: none, or another
    config's), `slurm_state` its job's (None: Slurm does not know it), `local_run` the local launcher
    that lists it, `unreadable` why the result.json in its directory is no record (None: it is one,
    or there is none)."""
    judged = classify(entry, record, slurm_state)
    queued_here = False  # behind the config a live local launcher runs: not begun
    if judged.state == "pending" and record is None and entry.job_id is None and local_run is not None:
        judged = Judged(*local_run_state(local_run, entry.index), "local")
        queued_here = judged.state == "pending"
    # An exported task may not have begun, nor a local config queued behind another.
    started = (entry.job_id is not None or entry.status == "submitted") and not queued_here
    if unreadable and started and judged.state in ("pending", "failed") and not (slurm_state and is_live(slurm_state)):
        # Written whole or not at all (write_json_atomic): a record there that cannot be read was
        # damaged since, and the run it speaks for has ended; "pending" never would.
        return Judged("failed", f"{entry.output_dir}/{RESULT_FILE} cannot be read ({unreadable})", "damaged")
    return judged


def asks_slurm(entry: ManifestEntry, record: Mapping[str, Any] | None) -> bool:
    """Whether Slurm's state of the entry's job can change what `judge` says of it: not for a config the
    manifest decided, nor for a record that finished or was interrupted, nor without a job."""
    return (entry.job_id is not None and entry.status in ("submitted", "exported")
            and (record is None or record.get("status") not in ("ok", "interrupted")))  # fmt: skip


def classify(entry: ManifestEntry, record: Mapping[str, Any] | None, slurm_state: str | None) -> Judged:
    """`judge` from the manifest entry, the record and the Slurm state alone."""
    if entry.status == "skipped":
        return Judged("skipped", entry.reason or "", "manifest")
    if entry.status in ("refused", "interrupted", "failed"):
        return Judged(entry.status, entry.reason or "", "manifest")
    if record is not None:
        status = record.get("status")
        if status == "ok":
            return Judged("done", "", "record")
        if status == "interrupted":  # Ctrl-C of a local sweep, or SIGINT to the run
            return Judged("interrupted", f"result.json status interrupted: {record.get('message') or 'no message'}", "record")
        detail = f"result.json status {status}: {record.get('message') or 'no message'}"
        if slurm_state is not None and is_live(slurm_state) and not is_running(slurm_state):
            # Waiting to run again (requeued after a node failure, by hand, or by a preemption): this
            # attempt has written nothing yet, so the record, whatever it says, is an earlier attempt's.
            # Failed, `rerun --failed` would queue a second run into the directory the job writes.
            return Judged("pending", f"requeued ({slurm_state}); the last attempt's {detail}", "requeued")
        if status in ("timeout", "cancelled") and slurm_state is not None and is_running(slurm_state):
            # Running after a requeue (a stopped attempt records `timeout`), or this attempt between its
            # record and its end: failed now, `rerun --failed` would queue a second run into the directory
            # it writes. Any other record of a running job is this attempt's, written just before its end
            # (read as running, a config that failed showed running until Slurm saw the job end).
            return Judged("running", f"still running; its {detail}", "requeued")
        if status == "timeout" and slurm_state is not None and (stopped := not_a_time_limit(slurm_state)):
            # The in-job wrapper writes `cancelled` over it when it can; KillWait's SIGKILL may end it first.
            # A preempted run did not fail either: the cluster took its nodes (PreemptMode=CANCEL).
            return Judged("cancelled" if is_cancelled(slurm_state) else "preempted", f"{stopped}; {detail}", "stopped")
        return Judged("cancelled" if status == "cancelled" else "failed", detail, "record")
    if slurm_state is None:
        if entry.status == "exported" and entry.job_id is None:
            return Judged("pending", f"no job started yet ({entry.reason or 'exported'})", "unknown")
        return Judged("pending", "", "unknown")
    if is_running(slurm_state):
        return Judged("running", "", "slurm")
    if is_live(slurm_state):
        return Judged("pending", slurm_state, "slurm")  # with squeue's reason: Licenses, Priority, PartitionConfig...
    if slurm_state == FORGOTTEN:
        return Judged("cancelled", "cancelled while pending: Slurm forgot the task (not in squeue or sacct, while "
                      "its array is), no result.json", "slurm")  # fmt: skip
    if slurm_state == GONE:
        return Judged("failed", "not in squeue or sacct, nor is its array (purged from accounting, or another "
                      "cluster's job?), no result.json", "slurm")  # fmt: skip
    if is_cancelled(slurm_state):
        # Cancelled before the trainer wrote a record (in its start-up), or its record was lost.
        return Judged("cancelled", "Slurm state CANCELLED (scancel), no result.json", "slurm")
    if is_preempted(slurm_state):
        return Judged("preempted", "Slurm state PREEMPTED (the cluster took its nodes), no result.json", "slurm")
    if base_state(slurm_state) == "COMPLETED":
        # The trainer writes result.json before it exits: a job that completed without one ran something else.
        return Judged("failed", "job completed without writing result.json", "slurm")
    return Judged("failed", f"Slurm state {base_state(slurm_state)}, no result.json", "slurm")


def local_run_state(run: LocalRun, index: int) -> tuple[str, str]:
    """(state, detail) of config `index` of a local launch (no Slurm job to ask): running, or pending
    behind the config it runs, while that launcher lives; once it is gone without the config's
    record (killed: SIGKILL, the OOM killer, a closed terminal), failed if it had started the config and
    interrupted if not, both of which `rerun --failed` runs again. On another host the mark is taken at
    its word."""
    where = f"local launcher, pid {run.pid}"
    running = run.running == index
    if run.host != socket.gethostname():
        return ("running" if running else "pending"), (
            f"{'run' if running else 'queued'} by a {where} on {run.host} (not checked from {socket.gethostname()})"
        )
    if _alive(run):
        return ("running", f"by this machine's {where}") if running else (
            "pending", f"queued by this machine's {where}")  # fmt: skip
    if running:
        return "failed", f"its {where}, ended without the config's result.json (killed?)"
    return "interrupted", f"its {where}, ended before it started the config (killed?)"


def process_start(pid: int) -> str | None:
    """Start time of process `pid` in clock ticks since boot (/proc/<pid>/stat's 22nd field); None
    without /proc or without the process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # after the command name, which may hold spaces


def _alive(run: LocalRun) -> bool:
    if run.started is not None:
        return process_start(run.pid) == run.started  # not a later process given the same id
    try:
        os.kill(run.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def local_launchers(sweep_dir: Path) -> dict[int, LocalRun]:
    """The LocalRun that speaks for each config index its files list. A SIGKILLed launcher leaves its
    file, so a config rerun since is listed by the dead one's and by the rerun's: a live launcher wins
    (one on another host taken at its word, as in local_run_state), then the latest started (None:
    oldest), not whichever file name sorts last."""
    here = socket.gethostname()

    def rank(run: LocalRun) -> tuple[bool, int]:
        started = str(run.started)
        return run.host != here or _alive(run), int(started) if started.isdigit() else -1

    return {i: run for run in sorted(read_local_runs(sweep_dir), key=rank) for i in run.queued}
