"""Progress of a launched sweep, and resubmission of its failures.

    python -m launchers status <sweep dir> [--ok-if-failed] [--skip-cancelled] [--wait [--poll SECONDS]]
    python -m launchers rerun <sweep dir> --failed [--skip-cancelled] [--no-test-only] [field=value ...]

The state of each config comes from what outlives the submitting process: the manifest
(what was submitted, exported, refused or skipped, under which job id), each run's result.json
(written by the trainer whatever happens), and Slurm (squeue for live jobs, sacct for ended
ones). A result.json wins over Slurm once the job has ended: it says what the run itself saw.
While Slurm still holds the job (requeued by `scontrol requeue`, a preemption or a node failure, and
pending or running again), the record is an earlier attempt's and the config is pending or running.
A job that ended without one (killed by the time limit, out of host memory) is failed by its Slurm
state. A result.json counts for a config only when the overrides it records are the config's
(train.contract.record_matches): a directory may hold an older run of another config.

A config whose job was cancelled (scancel) is `cancelled`: sacct says CANCELLED, whether its record
says so (launchers.job writes it over the trainer's `timeout`: scancel's SIGTERM reads as a time
limit's to the trainer), says `timeout` (the wrapper was killed first) or is missing (cancelled in its
start-up). A pending array task cancelled leaves no trace in Slurm (launchers.queue.FORGOTTEN): it is
`cancelled` too ("cancelled while pending: Slurm forgot the task") while Slurm knows its array, which
tells it from a purged job; a job Slurm knows nothing of, nor of its array, is `failed`. A config
whose job Slurm PREEMPTED (a site's PreemptMode=CANCEL: the cluster took its nodes for another job)
is `preempted`, with its `timeout` record (the preemption's SIGTERM reads as a time limit's) or none:
it did not fail, and needs no longer time limit. A preemption that requeues the job leaves it
pending, then running, as any requeue.

A config whose sbatch Slurm refused is `refused` (Slurm's message as detail): it never ran.
A config of a local sweep stopped by Ctrl-C is `interrupted`: the one running then (its
result.json says so) and those that had not started (their manifest entries say so).
A config of an exported array script (`python -m launchers sbatch`, submitted by hand) has no
job id in the manifest; its array task records one when it starts (train.contract.
resolve_exported), and until then the config is `pending` (queued or not yet submitted: this
side cannot tell which).

Every failed config's log is named below the table: the run directory's own log (LOG_FILE, the
trainer's output), else Slurm's output of its job (a job that died before the trainer started).

A sweep directory moved (or copied) after its launch is not where its jobs write: the launch record
(.megasweep/launch.json) keeps the directory each config's job was given, and a config with no
record here whose job was given another directory says so in its detail and in a line below the
table. A job queued there fails before anything of it runs (Slurm cannot open its output), so no
log of it exists anywhere: that line, not "no result.json", is the cause to read.

`rerun --failed` resubmits the `failed`, `cancelled`, `preempted`, `interrupted` and `refused` configs: a refused
sbatch is a config that did not run, and rerunning it after fixing the cause (a partition back up, a
quota raised) is what a user wants; an infeasible (`skipped`) config would fail the same way
again and is left alone. A cancelled config goes again too (the job may have been cancelled to change
its allocation, or by an administrator); `--skip-cancelled` leaves the cancelled ones out, for a user
who cancelled configs to drop them, and `status --skip-cancelled` then counts them as no failure (exit 0
once the rest is done). Each config goes again the way its own launch (the first, or one
appended to the sweep) went, with the settings that launch saved in <sweep dir>/.megasweep/launch.json
(interpreter, config directory, sbatch options): exported and Slurm configs are resubmitted by the
launcher (submitit); a local sweep's configs run on this machine again (launchers.local.run_here),
one after another.

`rerun --failed field=value ...` resubmits them changed: each failed config's overrides with
those fields replaced (or added) is a new config of the same sweep, composed and checked by the
rules as a launch does, under a new index (after the last one) and in its own directory; its
manifest entry names the config it reruns (`rerun_of`). The failed config stays in the sweep as
it was, but a later `rerun --failed` leaves it alone and `status` no longer counts it as a
failure: its rerun stands for it. A changed config the rules refuse is recorded `skipped` and stands
for nothing (it never runs): the failed config stays failed. When the rules refuse every changed
config, nothing is written and `rerun` exits EXIT_USAGE.

Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launchers.compose import FastComposer, parse_override
from launchers.entry import check_entry
from launchers.queue import ask_states, stuck_reason, unanswered_words
from launchers.site import check_site
from launchers.states import judge, local_launchers
from launchers.submit import (
    ConfigSpec,
    LaunchSettings,
    SubdirNamer,
    check_sbatch_accepts,
    entry_for,
    launched_sweep_dirs,
    load_launches,
    merge_entries,
    plan_configs,
    save_launch_file,
    say_path_warnings,
    submit_configs,
    with_layouts,
)
from launchers.sweepdir import UsageError, lock_holder, next_index, sweep_lock
from train.contract import (
    ATTEMPT_RECORD_GLOB,
    LOG_FILE,
    MANIFEST_FILE,
    OOM_REPORT_GLOB,
    PLAN_FILE,
    RESULT_FILE,
    SLURM_LOG_DIR,
    SUBMITIT_DIR,
    ManifestEntry,
    earlier_job_name,
    load_record,
    manifest_path,
    previous_result_name,
    read_manifest,
    record_matches,
    reruns_of,
    resolve_exported,
    write_manifest,
)
from train.paths import PathWarnings

__all__ = [
    "RERUN_STATES",
    "STATES",
    "ConfigStatus",
    "NotASweep",
    "changed_overrides",
    "format_status",
    "read_sweep",
    "rerun_failed",
    "sweep_status",
    "unresolved_failures",
    "UNFINISHED_STATES",
    "wait_for_sweep",
]

STATES = ("pending", "running", "done", "failed", "cancelled", "preempted", "interrupted", "refused", "skipped")
RERUN_STATES = frozenset({"failed", "cancelled", "preempted", "interrupted", "refused"})
"""States `rerun --failed` resubmits (see the module docstring)."""
LOGGED_STATES = ("failed", "cancelled", "preempted")
"""States whose log `status` names below its table: where to read why (and how far) the run got."""
UNFINISHED_STATES = frozenset({"pending", "running"})
"""States of a config whose run is still to come or to end: `status` exits EXIT_UNFINISHED on them,
`status --wait` waits them out."""


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
    """Why failed, cancelled or skipped; empty otherwise."""
    rerun_as: int | None = None
    """Index of the config that reruns this failed one with changed fields; None when none does."""
    log: str | None = None
    """A failed or cancelled config's log (see the module docstring); None otherwise, or when there is none."""
    launched_in: str | None = None
    """The sweep directory the config's job writes to, when that is not this one (the directory was
    moved or copied after the launch) and no result of it is here; None otherwise."""
    unsubmitted: bool = False
    """A config of an exported array script that no task of has started: sbatch may never have been run
    on the script, so nothing here will ever end its wait."""



class NotASweep(ValueError):
    """A directory that holds no sweep (the message says what it is and what reads it)."""


def read_sweep(sweep_dir: str | Path) -> list[ManifestEntry]:
    """The manifest of a sweep directory; NotASweep (one line) for anything else."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.exists():
        raise NotASweep(f"{sweep_dir} does not exist")
    if not sweep_dir.is_dir():
        raise NotASweep(f"{sweep_dir} is not a directory")
    path = manifest_path(sweep_dir)
    if not path.is_file():
        if (sweep_dir / PLAN_FILE).is_file():
            raise NotASweep(
                f"{sweep_dir} holds a dry run ({PLAN_FILE}), not a launched sweep: nothing there runs "
                f"or can fail (python -m analysis {shlex.quote(str(sweep_dir))} reads the plan)"
            )
        # Hydra's multirun/<date> holds one sweep per time: name them rather than leave the user to look.
        below = sorted({p.parent for pattern in (f"*/{MANIFEST_FILE}", f"*/*/{MANIFEST_FILE}")
                        for p in sweep_dir.glob(pattern)})  # fmt: skip
        within = (f"; it holds {len(below)} sweep(s): "
                  + ", ".join(shlex.quote(str(p)) for p in below[:8]) + (", ..." if len(below) > 8 else "")) if below else ""  # fmt: skip
        raise NotASweep(
            f"{sweep_dir} is not a sweep directory: it has no {MANIFEST_FILE} (hydra/launcher=slurm or "
            f"local, and python -m launchers sbatch, write one){within}"
        )
    entries = read_manifest(path)
    if not entries:
        # A launch writes its manifest before it submits anything: an empty one is a launch that
        # stopped before its first config (or a file truncated since), not a sweep whose configs all ran.
        raise NotASweep(f"{path} lists no config: nothing was launched into {sweep_dir} yet (a launch still "
                        "starting, or one that stopped before its first config)")
    return entries


def _record(sweep_dir: Path, entry: ManifestEntry) -> tuple[dict[str, Any] | None, str, str | None]:
    """The config's record, or None and why a record in its directory is not its own; and why the
    file there is no record at all, when its content says so (train.contract.load_record)."""
    record, damaged = load_record(sweep_dir / entry.output_dir / RESULT_FILE)
    if record is None or record_matches(record, entry.overrides):
        return record, "", damaged
    return None, f"{entry.output_dir}/{RESULT_FILE} is another config's ({' '.join(record['overrides'])})", None


_SBATCH_ARG = "sbatch_args.{name}"
"""How a rerun names a sbatch option its launch gave (hydra.launcher.sbatch_args, --sbatch-arg), as
.megasweep/launch.json keeps it."""


def run_log(sweep_dir: Path, entry: ManifestEntry) -> Path | None:
    """The log that says what happened to a config's run: its own, else its Slurm job's output. The run's
    own log gathers every attempt (each opens with `megasweep: <time> (<job>)`, launchers.job): a job of
    a rerun that died before its trainer wrote there is told by its Slurm output, not the earlier job's."""
    own = sweep_dir / entry.output_dir / LOG_FILE
    if own.is_file() and (not entry.job_id or _names_job(own, entry.job_id)):
        return own
    if not entry.job_id:
        return None
    # Exported scripts write <array>_<task>.out; submitit writes <job>_<task>_log.out per srun task.
    slurm = [sweep_dir / SLURM_LOG_DIR / f"{entry.job_id}.out"]
    slurm += sorted((sweep_dir / SUBMITIT_DIR / entry.job_id).glob("*_0_log.out"))
    return next((p for p in slurm if p.is_file()), None)


def _names_job(log: Path, job_id: str) -> bool:
    """Whether an attempt of Slurm job `job_id` wrote its header into `log` (a log of a run before the
    header existed, naming no job, counts as the job's own)."""
    try:
        with log.open("rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return False
    headers = re.findall(r"^megasweep: \S+ \(([^)]*)\):", text, flags=re.MULTILINE)
    return not headers or job_id in headers


def sweep_status(
    sweep_dir: str | Path, *, slurm_states: Mapping[str, str] | None = None, unanswered: list[str] | None = None
) -> list[ConfigStatus]:
    """Status of every config in the sweep's manifest (Slurm is asked unless `slurm_states` is given);
    NotASweep for a directory without one. `unanswered` gets why Slurm could not be asked, when it
    could not (queue.SlurmAnswer): a config whose job ended without a record then reads pending."""
    sweep_dir = Path(sweep_dir)
    entries = resolve_exported(read_sweep(sweep_dir), sweep_dir)
    if slurm_states is None:
        answer = ask_states(e.job_id for e in entries if e.job_id)
        slurm_states = answer.states
        if unanswered is not None:
            unanswered += answer.unanswered
    # A changed rerun the rules refused (`skipped`) never ran: it stands for nothing, and the config it
    # was to rerun stays a failure for status and for the next `rerun --failed`.
    elsewhere = _launched_elsewhere(sweep_dir)
    rerun_as = reruns_of(entries)
    refused_reruns = {e.rerun_of: e.index for e in entries if e.rerun_of is not None and e.status == "skipped"}
    local = local_launchers(sweep_dir)
    out = []
    for e in entries:
        slurm = slurm_states.get(e.job_id) if e.job_id else None
        record, foreign, unreadable = _record(sweep_dir, e)
        state, detail, _ = judge(e, record, slurm, local_run=local.get(e.index), unreadable=unreadable)
        if foreign and state in ("pending", *LOGGED_STATES):
            detail = f"{detail}; {foreign}" if detail else foreign
        # A job that wrote, or will write, its record into the directory it was launched into.
        moved = elsewhere.get(e.index) if record is None and state in ("pending", "running", *LOGGED_STATES) else None
        if moved is not None:
            detail = f"{moved[1]}; {detail}" if detail else moved[1]
        if e.index in rerun_as:
            detail = f"{detail} (rerun as config {rerun_as[e.index]})"
        elif e.index in refused_reruns:
            detail = f"{detail} (its rerun, config {refused_reruns[e.index]}, is infeasible)"
        log = run_log(sweep_dir, e) if state in LOGGED_STATES else None
        out.append(ConfigStatus(e.index, e.overrides, state, e.job_id, slurm, detail, rerun_as.get(e.index),
                                None if log is None else str(log), None if moved is None else moved[0],
                                e.status == "exported" and e.job_id is None))  # fmt: skip
    return out


def _launched_elsewhere(sweep_dir: Path) -> dict[int, tuple[str, str]]:
    """(sweep directory, why in words) of each config whose job was given another sweep directory
    than this one: the launch record (launchers.submit.launched_sweep_dirs) says where its jobs write
    their records and logs, which a directory moved while they were queued no longer holds."""
    here = sweep_dir.absolute()
    launched = launched_sweep_dirs(sweep_dir)
    why: dict[Path, str | None] = {}
    for there in set(launched.values()):
        if there == here or (there.is_dir() and _same_dir(there, here)):
            why[there] = None
        elif there.exists():
            why[there] = f"sweep directory copied or moved: its job writes under {there}, not here"
        else:
            why[there] = (
                f"sweep directory moved: its job was given {there}, which no longer exists (its record "
                "and log cannot land here)"
            )
    return {i: (str(d), text) for i, d in launched.items() if (text := why[d]) is not None}


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def unresolved_failures(statuses: Sequence[ConfigStatus]) -> list[ConfigStatus]:
    """Failed, cancelled, preempted, interrupted and refused configs (RERUN_STATES) that no rerun stands for: what makes `status` exit
    non-zero."""
    return [s for s in statuses if s.state in RERUN_STATES and s.rerun_as is None]


def wait_for_sweep(
    sweep_dir: str | Path, *, poll_s: float, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic
) -> list[ConfigStatus]:
    """sweep_status once no config is pending or running, asked every `poll_s` seconds; `say` is told
    a line whenever the counts change (not every poll: an overnight wait would fill a log). Slurm is
    asked once per poll, for every job at once, as `status` asks it (squeue, then sacct). A directory
    that lists no config yet is waited for while a launch holds its lock (sweepdir.lock_holder), a line
    naming it; NotASweep otherwise."""
    start, said = clock(), ""
    while True:
        unanswered: list[str] = []
        try:
            statuses = sweep_status(sweep_dir, unanswered=unanswered)
        except NotASweep:
            # A launch lists its configs once its first array is queued (after planning them and sbatch
            # --test-only): a script that starts waiting beside it waits for them while it holds the sweep's
            # lock. None holding it (stopped before its first config, or no launch there) ends the wait.
            if (holder := lock_holder(sweep_dir)) is None:
                raise
            line = f"status: waiting for a launch to list its configs in {sweep_dir} ({holder}); asking every {poll_s:g} s"
            if line != said:
                say(f"{line} [{_elapsed(clock() - start)} waited]")
                said = line
            time.sleep(poll_s)
            continue
        left = [s for s in statuses if s.state in UNFINISHED_STATES]
        if not left:
            return statuses
        counts = {state: sum(1 for s in left if s.state == state) for state in ("running", "pending")}
        # Exported configs without a job id stay pending until someone runs sbatch on their script.
        exported = sum(1 for s in left if s.unsubmitted)
        # Of the configs the bar counts: a skipped (infeasible) one never runs.
        total = sum(1 for s in statuses if s.state != "skipped")
        line = (f"status: waiting for {len(left)} of {total} configs ({counts['running']} running, "
                f"{counts['pending']} pending" + (f", {exported} of them exported and not started" if exported else "")
                + f"); asking every {poll_s:g} s")  # fmt: skip
        if unanswered:  # said while it lasts: a job that ended meanwhile reads pending until Slurm answers
            line += f"; {unanswered_words(unanswered)}"
        if line != said:
            say(f"{line} [{_elapsed(clock() - start)} waited]")
            said = line
        time.sleep(poll_s)


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def format_status(
    statuses: Sequence[ConfigStatus], *, width: int = 40, detail_chars: int = 100, sweep_dir: str = "<sweep dir>"
) -> str:
    """One row per config (only the overrides that differ between configs), then counts and a bar."""
    varying = _varying_overrides(statuses)
    rows = [("index", "state", "job", "overrides", "detail")]
    for s in statuses:
        shown = " ".join(o for o in s.overrides if o in varying[s.index]) or "-"
        detail = s.detail
        if s.rerun_as is not None:  # first: a long reason cut short hid that the failure is dealt with
            detail = f"rerun as config {s.rerun_as}: " + detail.removesuffix(f" (rerun as config {s.rerun_as})")
        detail = detail if len(detail) <= detail_chars else detail[: detail_chars - 3] + "..."
        rows.append((str(s.index), s.state, s.job_id or "-", shown, detail))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines = [line.rstrip() for line in lines]
    counts = {state: sum(1 for s in statuses if s.state == state) for state in STATES}
    total = len(statuses) - counts["skipped"]
    # A refused, cancelled or interrupted config will not run unless rerun: it is as finished as a failed one.
    finished = counts["done"] + sum(counts[state] for state in RERUN_STATES)
    filled = round(width * finished / total) if total else width
    bar = "#" * filled + "." * (width - filled)
    # Before the bar, which stays the last line: where to look first when a config failed.
    lines += _moved_lines(statuses)
    lines += _stuck_lines(statuses, sweep_dir)
    lines += [
        f"log of {s.state} config {s.index}{'' if s.rerun_as is None else f' (rerun as config {s.rerun_as})'}: "
        f"{s.log or _no_log(s)}"
        for s in statuses if s.state in LOGGED_STATES
    ]  # fmt: skip
    lines.append(
        f"[{bar}] {finished}/{total} finished: "
        # Only a local sweep stopped by Ctrl-C has interrupted configs, only a scancel cancelled ones and
        # only a cluster that preempts preempted ones:
        # other sweeps' line stays as it was.
        + ", ".join(f"{counts[state]} {state}" for state in STATES if state not in _SHOWN_IF_ANY or counts[state])
    )
    return "\n".join(lines)


_SHOWN_IF_ANY = ("cancelled", "preempted", "interrupted")
"""States the last line of `status` counts only where some config is in them."""


def _no_log(status: ConfigStatus) -> str:
    if status.launched_in is None:
        return "none found"
    return f"none found here (its job was to write it under {status.launched_in}: see above)"


def _moved_lines(statuses: Sequence[ConfigStatus]) -> list[str]:
    """One line per directory that configs were launched into and that this one is not (moved)."""
    by_dir: dict[str, list[int]] = {}
    for s in statuses:
        if s.launched_in is not None:
            by_dir.setdefault(s.launched_in, []).append(s.index)
    lines = []
    for there, indices in by_dir.items():
        shown = ", ".join(map(str, indices[:10])) + (", ..." if len(indices) > 10 else "")
        if Path(there).exists():
            fix = f"Their results land in {there}: read that directory, or resubmit them from this one"
        else:
            fix = f"It no longer exists: move this directory back to {there} before they start, or resubmit them"
        lines.append(
            f"sweep directory moved: the jobs of {len(indices)} config(s) ({shown}) were launched into {there} and "
            f"write their records and logs there, not in this directory. {fix} (once they failed, or after "
            "scancel) with `python -m launchers rerun --failed <this directory>`."
        )
    return lines


def _stuck_lines(statuses: Sequence[ConfigStatus], sweep_dir: str) -> list[str]:
    """One line per squeue reason that keeps pending configs from ever starting by themselves (a held
    job, a request the cluster no longer meets): `pending` alone reads as a wait that will end."""
    by_reason: dict[str, list[ConfigStatus]] = {}
    for s in statuses:
        if s.state == "pending" and s.slurm_state is not None and (words := stuck_reason(s.slurm_state)):
            by_reason.setdefault(f"{s.slurm_state.partition('(')[2].rstrip(')')}: {words}", []).append(s)
    lines = []
    for reason, stuck in by_reason.items():
        shown = ", ".join(f"{s.index} (job {s.job_id})" for s in stuck[:10]) + (", ..." if len(stuck) > 10 else "")
        lines.append(
            f"{len(stuck)} pending config(s) will not start as things stand: {shown}; squeue says {reason}. "
            f"Otherwise scancel them, then `python -m launchers rerun --failed {shlex.quote(sweep_dir)}` (with the "
            "fields to change after it)."
        )
    return lines


def _varying_overrides(statuses: Sequence[ConfigStatus]) -> dict[int, set[str]]:
    common = set.intersection(*(set(s.overrides) for s in statuses)) if statuses else set()
    return {s.index: set(s.overrides) - common for s in statuses}


def rerun_failed(
    sweep_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    test_only: bool = True,
    skip_cancelled: bool = False,
    seen: list[ConfigStatus] | None = None,
) -> list[ManifestEntry]:
    """Resubmit exactly the failed configs (result not ok, or ended in Slurm without a result), the
    cancelled ones unless `skip_cancelled` (a user cancelled them to drop them), and the refused ones
    (sbatch refused them; see the module docstring), except those a rerun with changed fields already
    stands for.

    Without `overrides`, each goes again under its own index: its old result.json is kept beside
    as result.<old job id>.json, so that `status` does not read it as the new run's; finished (ok)
    results are not touched. With `overrides` (field=value), each becomes a new config (see the
    module docstring). The manifest is rewritten after each array is queued. Returns the new
    manifest entries of the resubmitted configs (a config Slurm refuses again comes back
    `refused`, an infeasible changed one `skipped`). `test_only`: sbatch --test-only judges each
    launch's jobs first, for a launch that asked it too (LaunchSettings.test_only). `seen` gets the
    statuses the rerun was chosen from (Slurm asked once), for what a caller says of the configs left out.
    """
    from launchers.local import LocalMarks, run_here

    sweep_dir = Path(sweep_dir).resolve()
    read_sweep(sweep_dir)  # not a sweep: said as status says it, before the lock makes its directory
    entries: list[ManifestEntry] = []
    here: list[tuple[ConfigSpec, LaunchSettings]] = []
    # Locked until the manifest lists the resubmitted configs: a second rerun at the same time then
    # finds them pending instead of queueing them twice, and a launch added meanwhile keeps its indices.
    with sweep_lock(sweep_dir):
        statuses = sweep_status(sweep_dir)
        if seen is not None:
            seen += statuses
        failed = [s for s in unresolved_failures(statuses) if not (skip_cancelled and s.state == "cancelled")]
        if not failed:
            return []
        launches = load_launches(sweep_dir)
        missing = [s.index for s in failed if not any(s.index in specs for _, specs in launches)]
        if missing:
            raise ValueError(
                f"{sweep_dir}: no launch record for configs {missing} (launched by another launcher?)"
            )
        # Each config goes again the way it was launched: a sweep appended to may mix interpreters,
        # config directories, sbatch options, or Slurm and this machine.
        groups = [(settings, [specs[s.index] for s in failed if s.index in specs]) for settings, specs in launches]
        groups = [(settings, mine) for settings, mine in groups if mine]
        # A changed rerun's configs, planned once per launch from index 0 (the n-th failed config's is
        # index n), given their real indices and directories as each launch's are queued (_placed).
        changed = [_changed_specs(mine, settings, overrides) for settings, mine in groups] if overrides else []
        if overrides:
            _refuse_if_none_feasible(sweep_dir, groups, changed, overrides)
        # Every launch's configs are judged before any is renamed or queued: a second launch's refused
        # after the first's were queued made "Nothing was submitted" untrue. Changed ones as they will be
        # planned, named by the failed config each reruns.
        for g, (settings, mine) in enumerate(groups):
            # As a launch checks them (launchers.entry, train.paths): a plain rerun composes nothing else.
            check_entry(settings.python, settings.module, settings.cwd, options=_ENTRY_OPTIONS, here=settings.local)
            if not overrides:
                _check_paths(settings, mine)
            if settings.local:
                continue
            judged = mine
            if overrides:
                judged = [dataclasses.replace(spec, index=mine[spec.index].index) for spec in changed[g][0]]
            # Each launch's own sbatch options, as it submits them again.
            check_site((spec.key for spec in judged), settings.sbatch_args, option=_SBATCH_ARG)
            if test_only and settings.test_only:  # as the launch asked: --test-only that misjudges this site was left out
                check_sbatch_accepts(sweep_dir, judged, settings, option=_SBATCH_ARG, skip="--no-test-only", again="rerun")
        job_ids = {s.index: s.job_id for s in failed}
        for g, (settings, mine) in enumerate(groups):
            if overrides:
                listed, local = _rerun_changed(sweep_dir, mine, settings, changed[g])
            else:
                listed, local = _rerun_launch(sweep_dir, mine, job_ids, settings)
            entries += listed
            here += local
        # Marked as this live process's before the lock is let go: a rerun meanwhile finds them queued
        # here (launchers.states.local_run_state), not failed by the launcher that was killed.
        marks = LocalMarks(sweep_dir, [spec.index for spec, _ in here]) if here else None
    # What runs on this machine runs once the lock is let go (for hours, maybe), the Slurm jobs queued;
    # in one run_here, so that a Ctrl-C marks every config it did not start interrupted.
    if here:
        run_here(here, sweep_dir, marks=marks)
    return sorted(entries, key=lambda e: e.index)


_ENTRY_OPTIONS = ("python (the launch's, .megasweep/launch.json)", "module (the launch's)")
"""How a rerun names the interpreter and module it runs again: the launch's, which it cannot change."""


def _check_paths(settings: LaunchSettings, specs: Sequence[ConfigSpec]) -> None:
    """The token files and checkpoint directories of configs rerun unchanged, checked as a launch checks
    them (launchers.submit.plan_configs): the file may have gone or been fixed since."""
    composer, paths = _composer(settings), PathWarnings()
    for spec in specs:
        paths.note(composer.run_config(list(spec.overrides)))
    say_path_warnings(paths, here=settings.local, undone="nothing was rerun")


def _rerun_launch(
    sweep_dir: Path, specs: Sequence[ConfigSpec], job_ids: Mapping[int, str | None], settings: LaunchSettings
) -> tuple[list[ManifestEntry], list[tuple[ConfigSpec, LaunchSettings]]]:
    """rerun_failed, unchanged, for the failed configs one launch launched (`job_ids`: each one's last
    job): their new manifest entries, and for a local launch the configs that rerun_failed then runs here."""
    # Their jobs write into this directory now, wherever the first ones were given (a moved sweep).
    save_launch_file(sweep_dir, settings, specs)
    for spec in specs:
        old = sweep_dir / spec.output_dir / RESULT_FILE
        if old.exists():
            old.rename(_aside(old.with_name(previous_result_name(job_ids[spec.index]))))
        # The earlier job's OOM reports and stopped attempts' records too: the new run would read an old
        # report as its own OOM (train.trainer), and find its attempt's name taken (launchers.job).
        for leftover in (*old.parent.glob(OOM_REPORT_GLOB), *old.parent.glob(ATTEMPT_RECORD_GLOB)):
            leftover.rename(_aside(leftover.with_name(earlier_job_name(leftover.name, job_ids[spec.index]))))
    path = manifest_path(sweep_dir)
    before = read_manifest(path)
    # The launch record keeps no layout: each config's entry does, and its rerun runs the same one.
    specs = with_layouts(specs, before)
    if settings.local:
        return _run_here(sweep_dir, specs, settings, before)
    submission = submit_configs(
        sweep_dir,
        specs,
        settings,
        on_queued=lambda queued: write_manifest(merge_entries(before, queued), path),
    )
    write_manifest(merge_entries(before, submission.entries), path)
    return submission.entries, []


def _aside(path: Path) -> Path:
    """`path`, or with a number before its suffix when taken: a local run has no job id to tell its
    reruns' earlier records apart (result.previous.json, result.previous.2.json, ...)."""
    n, free = 1, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.stem}.{n}{path.suffix}")
    return free


def changed_overrides(old: Sequence[str], changes: Sequence[str]) -> tuple[str, ...]:
    """`old` with every field (or group) that `changes` sets replaced by the change, which comes last,
    spelled as Hydra's sweepers spell a job's override (key=value from the parsed value: 1e-4 as 0.0001),
    so that a rerun's new config and the same config in a sweep or a dry run have the same overrides
    (analysis matches a dry run's rows to the manifest's configs by them)."""
    keys = {parse_override(text).key_or_group for text in changes}
    return (*(o for o in old if parse_override(o).key_or_group not in keys), *_kept_additions(old, changes))


def _kept_additions(old: Sequence[str], changes: Sequence[str]) -> list[str]:
    """`changes` as swept, where a key the config added (`+cluster.env.X=1`, as cluster.env's variables
    are given) stays added: a plain `cluster.env.X=2` changes it (it was refused as "no such key", the
    `+` dropped with the old override), and `~cluster.env.X` removes it by leaving the addition out
    (it was refused as deleting a key that, the addition dropped, did not exist)."""
    parsed = list(map(parse_override, old))
    added = {o.key_or_group for o in parsed if o.is_add()}
    forced = {o.key_or_group for o in parsed if o.is_force_add()}  # `++`: set or added, so it may be the base's
    out = []
    for text in changes:
        change = parse_override(text)
        plain = not (change.is_delete() or change.is_add() or change.is_force_add())
        if change.key_or_group in added:
            if change.is_delete():
                continue
            if plain:
                text = f"+{text}"
        elif change.key_or_group in forced and plain:
            text = f"++{text}"
        out.append(_as_swept(text))
    return out


def _as_swept(text: str) -> str:
    override = parse_override(text)
    if override.is_sweep_override() or override.is_delete():
        return text
    # What hydra's BasicSweeper.split_arguments writes for a single value.
    return f"{override.get_key_element()}={override.get_value_element_as_str()}"


def _rerun_changed(
    sweep_dir: Path,
    failed: Sequence[ConfigSpec],
    settings: LaunchSettings,
    changed: tuple[list[ConfigSpec], list[ManifestEntry]],
) -> tuple[list[ManifestEntry], list[tuple[ConfigSpec, LaunchSettings]]]:
    """rerun_failed with changes for the failed configs one launch launched, `changed` their changed
    configs as _changed_specs planned them: as _rerun_launch."""
    path = manifest_path(sweep_dir)
    before = read_manifest(path)
    first = next_index(before)
    specs, skipped = _placed(changed, first, _free_output_dir(sweep_dir, before))
    origin = {first + i: s.index for i, s in enumerate(failed)}

    def traced(entries: Sequence[ManifestEntry]) -> list[ManifestEntry]:
        return [dataclasses.replace(e, rerun_of=origin[e.index]) for e in entries]

    known = merge_entries(before, traced(skipped))
    save_launch_file(sweep_dir, settings, specs)
    if settings.local:
        listed, local = _run_here(sweep_dir, specs, settings, known, rerun_of=origin)
        return sorted([*traced(skipped), *listed], key=lambda e: e.index), local
    submission = submit_configs(
        sweep_dir, specs, settings, on_queued=lambda queued: write_manifest(merge_entries(known, traced(queued)), path)
    )
    write_manifest(merge_entries(known, traced(submission.entries)), path)
    return sorted([*traced(skipped), *traced(submission.entries)], key=lambda e: e.index), []


def _refuse_if_none_feasible(
    sweep_dir: Path,
    groups: Sequence[tuple[LaunchSettings, Sequence[ConfigSpec]]],
    changed: Sequence[tuple[list[ConfigSpec], list[ManifestEntry]]],
    changes: Sequence[str],
) -> None:
    """UsageError, before anything is written, when the rules refuse every failed config with
    `changes` (`changed`: each group's, as _changed_specs planned them): recorded `skipped`, each try
    of such a rerun added the same refused configs again."""
    if any(planned for planned, _ in changed):
        return
    refused = [f"config {mine[e.index].index} with {' '.join(changes)}: {e.reason}"
               for (_, mine), (_, skipped) in zip(groups, changed, strict=True) for e in skipped]  # fmt: skip
    raise UsageError(
        f"every changed config is infeasible, so nothing was resubmitted or written, and the failed configs "
        f"stay failed: {'; '.join(refused)}. Change other fields: python -m launchers rerun --failed {shlex.quote(str(sweep_dir))} "
        "<field=value ...>"
    )


def _changed_specs(
    failed: Sequence[ConfigSpec], settings: LaunchSettings, changes: Sequence[str]
) -> tuple[list[ConfigSpec], list[ManifestEntry]]:
    """The failed configs with `changes`, planned as new configs from index 0 (the n-th failed config's
    is index n): the feasible ones' specs, and the infeasible ones' `skipped` entries."""
    return plan_configs(_composer(settings), [changed_overrides(s.overrides, changes) for s in failed], 0,
                        undone="nothing was rerun", name=lambda n: f"the rerun of config {failed[n].index}",
                        here=settings.local,
                        fix="Leave training.checkpoint_dir out of the changes (each rerun then checkpoints in its own "
                            "run directory)")  # fmt: skip


def _placed(
    changed: tuple[list[ConfigSpec], list[ManifestEntry]], first: int, subdir: SubdirNamer
) -> tuple[list[ConfigSpec], list[ManifestEntry]]:
    """Changed configs planned from index 0 (_changed_specs) as new configs from index `first`, each in
    the directory `subdir` names, asked in index order as plan_configs asks it."""
    specs, skipped = changed
    configs: list[ConfigSpec | ManifestEntry] = sorted([*specs, *skipped], key=lambda c: c.index)
    dirs = {c.index: subdir(first + c.index, c.overrides) for c in configs}
    placed = [dataclasses.replace(s, index=first + s.index, output_dir=dirs[s.index]) for s in specs]
    left = [dataclasses.replace(e, index=first + e.index, output_dir=dirs[e.index]) for e in skipped]
    return placed, left


def _free_output_dir(sweep_dir: Path, entries: Sequence[ManifestEntry]) -> SubdirNamer:
    """A new config's output directory: its index, as Hydra's default hydra.sweep.subdir names it, or,
    where a sweep's own subdir gave that name to another config (subdir=${...micro_batch_size}: "4")
    or something is there, `rerun<index>` (then .2, .3, ...). The new config's job wrote over that
    config's result.json, and each then read as the other's."""
    taken = {e.output_dir for e in entries}

    def name(index: int, overrides: Sequence[str]) -> str:
        candidates = (f"rerun{index}" + (f".{n}" if n > 1 else "") for n in itertools.count(1))
        for candidate in itertools.chain([str(index)], candidates):
            if candidate not in taken and not (sweep_dir / candidate).exists():
                taken.add(candidate)
                return candidate
        raise AssertionError("unreachable: itertools.count is endless")

    return name


def _run_here(
    sweep_dir: Path, specs: Sequence[ConfigSpec], settings: LaunchSettings, before: Sequence[ManifestEntry],
    *, rerun_of: Mapping[int, int] | None = None,
) -> tuple[list[ManifestEntry], list[tuple[ConfigSpec, LaunchSettings]]]:
    """A local sweep's rerun: the configs' entries `submitted` again (no job id), and the configs with
    their settings, which rerun_failed runs here once the sweep's lock is let go."""
    entries = [
        dataclasses.replace(entry_for(s, "submitted"), rerun_of=(rerun_of or {}).get(s.index)) for s in specs
    ]
    path = manifest_path(sweep_dir)
    write_manifest(merge_entries(before, entries), path)
    return entries, [(spec, settings) for spec in specs]


def _composer(settings: LaunchSettings) -> FastComposer:
    """A composer for the sweep's configs: the config directory and name its runs were given."""
    from conf import CONFIG_DIR

    options = dict(arg.removeprefix("--").split("=", 1) for arg in settings.entry_args if "=" in arg)
    return _composer_at(str(Path(options.get("config-dir") or CONFIG_DIR).resolve()), options.get("config-name", "config"))


@functools.lru_cache(maxsize=8)
def _composer_at(config_dir: str, config_name: str) -> FastComposer:
    # One per config directory in a process: the launches a changed rerun plans (a sweep appended to
    # has one per launch) mostly share a config directory, and with it the Hydra loader and its bases.
    return FastComposer.from_config_dir(config_dir, config_name)
