"""The one reader of Slurm's queue: job states from squeue and sacct, for `status` and the analysis.

    read_states(["1234_0", "1234_1", "1240"])  ->  {"1234_0": "COMPLETED", "1234_1": "RUNNING", ...}

sacct (accounting) knows every job that started or ended, squeue every job still in the queue;
squeue wins for a job both know, because accounting lags the controller by up to a poll. Array
tasks are asked for by their array's id, so one call covers a whole sweep; a pending array that
either tool prints as a range ('1234_[2-5%2]') is expanded to its tasks. A job requeued after a
time limit appears in sacct once per run, oldest first: the last line is the current run.

States are Slurm's names with any suffix dropped ('CANCELLED by 0' is CANCELLED), and a job squeue
holds with its reason ('PENDING (Licenses)'; base_state reads the name). What they mean
for a config without a result.json is decided here too, once: `is_live` (queued or running, a
result may still come), `is_running`, `is_cancelled`, `is_preempted`, and `ended_outcome` (the outcome the seeds would
write for a job that ended without a record: oom, timeout, cancelled or fail).

Nothing here fails: the tools may be absent (a laptop with a copy of the sweep), the controller
down or slow. An id the tools do not answer for is simply not in the result; an id that both
answered without knowing it is FORGOTTEN when they know its array (a pending array task cancelled:
Slurm keeps no record of it), else GONE.

Torch-free.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from typing import NamedTuple

__all__ = [
    "ENDED_OUTCOMES",
    "FORGOTTEN",
    "GONE",
    "base_state",
    "LIVE_STATES",
    "RUNNING_STATES",
    "STUCK_REASONS",
    "ended_outcome",
    "expand_job_ids",
    "is_cancelled",
    "is_live",
    "is_preempted",
    "is_running",
    "not_a_time_limit",
    "parse_states",
    "read_states",
    "ask_states",
    "SlurmAnswer",
    "unanswered_words",
    "stuck_reason",
]

RUNNING_STATES = frozenset(
    {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SUSPENDED", "SIGNALING", "STOPPED"}
)
"""Allocated: the job's processes exist (or are being set up or torn down); STOPPED ones by SIGSTOP."""
LIVE_STATES = RUNNING_STATES | frozenset(
    # SPECIAL_EXIT: requeued and held after an exit code the site's RequeueExitHold names.
    {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
)
"""Not ended: a result.json may still come."""
GONE = "GONE"
"""Not a Slurm state: a job that neither squeue nor sacct knows although both answered, nor any task of its
array (a job purged from accounting, another cluster's id): it will not run, and nothing says why."""
FORGOTTEN = "FORGOTTEN"
"""Not a Slurm state: an array task that neither squeue nor sacct knows although both answered, while they
know its array (another of its tasks, or the array's own record). Slurm forgets a task cancelled with
scancel while the array was pending: it is split off the array's record and never accounted (Slurm 22.05,
the local cluster: `scancel 12_1` of a held array 12_[0-2] left sacct `12_[0,2]|PENDING` and squeue 12_0
and 12_2). Nothing else takes one task out of an array Slurm still holds or accounts, so it reads as
cancelled; it never ran and never will."""
ENDED_OUTCOMES = {"OUT_OF_MEMORY": "oom", "TIMEOUT": "timeout", "DEADLINE": "timeout", "CANCELLED": "cancelled",
                  FORGOTTEN: "cancelled", "PREEMPTED": "timeout"}  # fmt: skip
"""A job that ended without a record, as the seeds' tables write it (`cancelled`: by scancel; `timeout`: stopped
by its time limit or a preemption, as records.PARTIAL_OUTCOMES reads it); any other ended state is 'fail'."""

_ARRAY_RANGE = re.compile(r"^(\d+)_\[([\d,\-]+)(?:%\d+)?\]$")


def expand_job_ids(job_id: str) -> list[str]:
    """'12_[0-2,5%2]' -> ['12_0', '12_1', '12_2', '12_5']; any other id unchanged."""
    match = _ARRAY_RANGE.match(job_id)
    if not match:
        return [job_id]
    array, ranges = match.groups()
    ids: list[str] = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        ids.extend(f"{array}_{i}" for i in range(int(first), int(last or first) + 1))
    return ids


def base_state(state: str) -> str:
    """Slurm's state name without a suffix: 'CANCELLED by 0' -> 'CANCELLED'."""
    words = state.split()
    return words[0] if words else ""


def is_live(state: str) -> bool:
    return base_state(state) in LIVE_STATES


def is_running(state: str) -> bool:
    return base_state(state) in RUNNING_STATES


def is_cancelled(state: str) -> bool:
    """Whether the job was cancelled (scancel): 'CANCELLED by <uid>' in sacct. Never a GONE task's: that one
    may have been cancelled while pending, or purged from accounting, and nobody can tell which."""
    return base_state(state) == "CANCELLED"


def is_preempted(state: str) -> bool:
    """Whether the job ended preempted (PreemptMode=CANCEL): the cluster took its nodes for another job. A
    preemption that requeues the job leaves it live (PENDING, REQUEUED) instead."""
    return base_state(state) == "PREEMPTED"


STUCK_REASONS = {
    "JobHeldUser": "held; `scontrol release <job>` lets it start",
    "JobHeldAdmin": "held by root or an administrator; only they can release it (`scontrol release <job>`)",
    "BadConstraints": "no node meets what it asks (features, gres or memory) as the cluster stands now",
    "PartitionTimeLimit": "its time limit is above the partition's",
    "PartitionNodeLimit": "it asks more nodes than the partition now allows",
    "InvalidAccount": "its account is no longer valid",
    "InvalidQOS": "its QOS is no longer valid",
    "AccountNotAllowed": "its account may no longer use the partition",
    "QOSNotAllowed": "its QOS may no longer use the partition",
    "DependencyNeverSatisfied": "a job it depends on ended in a way it waits for no longer",
}
"""squeue's reasons (Slurm's job_reason_codes) that no amount of waiting clears: a job pending for one
of them starts only once someone releases it or changes the request or the cluster. Others (Priority,
Resources, Licenses, ...) clear by themselves."""


def stuck_reason(state: str) -> str | None:
    """STUCK_REASONS' words for a pending job squeue holds for one of them ('PENDING (JobHeldUser)');
    None otherwise."""
    reason = state.partition("(")[2].rstrip(")").strip()
    return STUCK_REASONS.get(reason) if base_state(state) == "PENDING" else None


def not_a_time_limit(state: str) -> str | None:
    """Why a job whose record says `timeout` stopped, when Slurm's `state` says its time limit did not stop
    it: scancel and a preemption send the SIGTERM a time limit sends, so the record cannot tell them
    apart, and such a run needs no longer time limit. None for any other state."""
    base = base_state(state)
    return f"{base.lower()} (Slurm state {base}), not a time limit" if base in ("CANCELLED", "PREEMPTED") else None


def ended_outcome(state: str) -> str:
    """oom, timeout, cancelled or fail: the outcome of a job that ended in `state` without writing a record."""
    return ENDED_OUTCOMES.get(base_state(state), "fail")


def parse_states(text: str) -> dict[str, str]:
    """`JobID|State[|Reason]` lines (squeue -o '%i|%T|%r', sacct -P -o JobID,State) -> {task id:
    state, with squeue's reason when it gives one: 'PENDING (Licenses)'}; later lines win, ranges
    are expanded."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        job, sep, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        base, reason = base_state(state), reason.strip()
        if sep and job and base:
            # A reason says why a job waits; for one that ended (squeue -t all) it is stale.
            shown = f"{base} ({reason})" if reason and reason != "None" and base in LIVE_STATES else base
            for one in expand_job_ids(job.strip()):
                states[one] = shown
    return states


def _run(cmd: list[str], timeout_s: float) -> tuple[str | None, str]:
    """The command's stdout, or None and why: it is absent, failed or timed out."""
    if shutil.which(cmd[0]) is None:
        return None, f"{cmd[0]} is not on this machine's PATH"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return None, f"{cmd[0]} did not answer within {timeout_s:g} s"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{cmd[0]} could not be run ({exc})"
    if proc.returncode == 0:
        return proc.stdout, ""
    # squeue asked for one id that the controller no longer (or never) held: an answer, not a failure.
    if cmd[0] == "squeue" and "Invalid job id specified" in proc.stderr:
        return "", ""
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"{cmd[0]} failed (exit status {proc.returncode}: {last})"


class SlurmAnswer(NamedTuple):
    """What Slurm said of some jobs, and why it said nothing where it could not be asked."""

    states: dict[str, str]
    """read_states' answer."""
    unanswered: tuple[str, ...]
    """Why sacct or squeue gave no answer (empty: both answered). A job that ended without a record
    is then no different here from one still pending: status and the analysis say so."""


def ask_states(job_ids: Iterable[str], *, timeout_s: float = 30.0) -> SlurmAnswer:
    """read_states, and why a tool that gave no answer gave none."""
    ids = sorted({str(j) for j in job_ids if j})
    if not ids:
        return SlurmAnswer({}, ())
    arrays = ",".join(sorted({j.split("_")[0] for j in ids}))
    accounted, no_sacct = _run(["sacct", "-X", "-n", "-P", "-j", arrays, "--format=JobID,State"], timeout_s)
    # -r: one line per array task, so that '1234_5' appears as itself. -t all: also the jobs that
    # ended within MinJobAge, which accounting may not have recorded yet.
    # %r: why a pending job waits (Licenses, Priority, PartitionConfig...), which status shows.
    queued, no_squeue = _run(["squeue", "-h", "-r", "-t", "all", "-j", arrays, "-o", "%i|%T|%r"], timeout_s)
    states = parse_states(accounted or "")
    states.update(parse_states(queued or ""))
    if accounted is not None and queued is not None:
        # The controller holds every job from its submission on, and accounting every job that
        # started or ended: an id neither knows will never run (see GONE and FORGOTTEN).
        known_arrays = {j.split("_")[0] for j in states}
        return SlurmAnswer({j: states.get(j, FORGOTTEN if _array_of(j) in known_arrays else GONE) for j in ids}, ())
    return SlurmAnswer({j: states[j] for j in ids if j in states}, tuple(w for w in (no_sacct, no_squeue) if w))


def _array_of(job_id: str) -> str | None:
    """The array id of an array task's id ('12_3' -> '12'); None for a job that is no array's task."""
    array, sep, task = job_id.partition("_")
    return array if sep and task else None


def unanswered_words(unanswered: Iterable[str]) -> str:
    """How status and the analysis say that Slurm could not be asked, and what it means for them."""
    return (f"Slurm could not be asked ({'; '.join(unanswered)}): a config whose job ended without a record reads "
            "pending until it answers")  # fmt: skip


def read_states(job_ids: Iterable[str], *, timeout_s: float = 30.0) -> dict[str, str]:
    """Slurm's state of each job (or array task) id that sacct or squeue knows (parse_states); FORGOTTEN
    for an array task that neither knows although both answered and know its array, GONE for any other
    id that neither knows."""
    return ask_states(job_ids, timeout_s=timeout_s).states

