"""launchers.states: one judgement of a launched config, which status and the analysis both give."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from analysis.records import load_sweeps
from launchers.states import judge, process_start
from launchers.status import format_status, sweep_status, unresolved_failures
from train.contract import RESULT_FILE, LocalRun, ManifestEntry, local_run_path, write_manifest

DEAD_PID = 99999999  # above any pid_max: no process has it

# (manifest status, job id, result.json: its status or "unreadable" or None, Slurm's state of the job,
#  the local launcher listing it: live (this process, or its parent) or killed, running it or queued
#  behind another) ->
# (status's state, the analysis's outcome).
CASES = [
    (("submitted", "9_0", "ok", "COMPLETED", None), ("done", "ok")),
    (("submitted", "9_1", "error", "FAILED", None), ("failed", "fail")),
    (("submitted", "9_2", "oom", "OUT_OF_MEMORY", None), ("failed", "oom")),
    (("submitted", "9_3", "nan", "COMPLETED", None), ("failed", "nan")),
    (("submitted", "9_4", "timeout", "TIMEOUT", None), ("failed", "timeout")),
    (("submitted", "9_5", "oom", "PENDING (BeginTime)", None), ("pending", "pending")),  # requeued
    (("submitted", "9_6", "timeout", "CANCELLED by 0", None), ("cancelled", "cancelled")),  # scancel, not a time limit
    (("submitted", "9_7", "timeout", "RUNNING", None), ("running", "running")),  # running again after a stop
    (("submitted", "9_8", "error", "RUNNING", None), ("failed", "fail")),  # this attempt's, ending
    (("submitted", "9_9", None, "OUT_OF_MEMORY", None), ("failed", "oom")),
    (("submitted", "9_10", None, "RUNNING", None), ("running", "running")),
    (("submitted", "9_11", None, "PENDING (Priority)", None), ("pending", "pending")),
    (("submitted", "9_12", None, None, None), ("pending", "pending")),
    (("submitted", "9_13", None, "GONE", None), ("failed", "fail")),
    (("submitted", "9_14", None, "COMPLETED", None), ("failed", "fail")),
    (("submitted", "9_15", "unreadable", "COMPLETED", None), ("failed", "fail")),
    (("submitted", "9_16", "unreadable", "PENDING", None), ("pending", "pending")),
    (("submitted", "9_17", "interrupted", "COMPLETED", None), ("interrupted", "interrupted")),
    (("exported", None, None, None, None), ("pending", "pending")),
    (("exported", None, "unreadable", None, None), ("pending", "pending")),  # its task has not begun
    (("skipped", None, None, None, None), ("skipped", "skipped")),
    (("refused", None, None, None, None), ("refused", "refused")),
    (("interrupted", None, None, None, None), ("interrupted", "interrupted")),
    (("failed", None, None, None, None), ("failed", "fail")),
    (("submitted", None, None, None, "live running"), ("running", "running")),
    (("submitted", None, None, None, "live queued"), ("pending", "pending")),
    (("submitted", None, "unreadable", None, "live queued"), ("pending", "pending")),
    (("submitted", None, "unreadable", None, "parent running"), ("running", "running")),
    (("submitted", None, None, None, "dead running"), ("failed", "fail")),
    (("submitted", None, None, None, "dead queued"), ("interrupted", "interrupted")),
    (("submitted", None, "unreadable", None, "dead queued"), ("interrupted", "interrupted")),  # never begun
    # Cancelled: the record launchers.job marked so, and a job cancelled before the trainer wrote one; a
    # preemption's `timeout` is no time limit either, yet no cancel: the run is preempted (status; it read
    # failed) and, to the analysis, stopped as by a time limit (its figures partial; it read fail).
    (("submitted", "9_18", "cancelled", "CANCELLED by 0", None), ("cancelled", "cancelled")),
    (("submitted", "9_19", None, "CANCELLED by 0", None), ("cancelled", "cancelled")),
    (("submitted", "9_20", "timeout", "PREEMPTED", None), ("preempted", "timeout")),
    (("submitted", "9_21", None, "PREEMPTED", None), ("preempted", "timeout")),
    # A pending task scancel took out of its array: Slurm forgot it (launchers.queue.FORGOTTEN), not its array.
    (("submitted", "9_22", None, "FORGOTTEN", None), ("cancelled", "cancelled")),
]


def build(sweep: Path) -> dict[str, str]:
    """A sweep directory of one config per case; the Slurm states of their jobs."""
    entries, states = [], {}
    host = socket.gethostname()
    runs: dict[tuple[str, int], list[int]] = {}
    running: dict[tuple[str, int], int] = {}
    for index, ((status, job, record, slurm, local), _) in enumerate(CASES):
        overrides = (f"training.seed={index}",)
        reason = {"skipped": "infeasible: [heads_divisible_by_tp]", "refused": "sbatch refused: no partition",
                  "interrupted": "Ctrl-C before it started", "exported": "exported to a.sbatch"}.get(status)  # fmt: skip
        entries.append(ManifestEntry(index, overrides, str(index), status, reason, job))
        if slurm is not None and job is not None:
            states[job] = slurm
        if record is not None:
            (sweep / str(index)).mkdir(parents=True)
            text = "{not json" if record == "unreadable" else json.dumps(
                {"status": record, "message": f"case {index}", "overrides": list(overrides)})  # fmt: skip
            (sweep / str(index) / RESULT_FILE).write_text(text)
        if local is not None:
            alive, what = local.split()  # live, parent or dead; running or queued
            key = (alive, {"live": os.getpid(), "parent": os.getppid()}.get(alive, DEAD_PID))
            runs.setdefault(key, []).append(index)
            if what == "running":
                running[key] = index
    write_manifest(entries, sweep / "manifest.jsonl")
    # Every local config's launcher: two live (this process and its parent) and one killed; each lists
    # its configs, the one it runs first.
    for (alive, pid), queued in runs.items():
        first = running.get((alive, pid))
        order = ([first] if first is not None else []) + [i for i in queued if i != first]
        started = "1" if pid == DEAD_PID else process_start(pid)
        run = LocalRun(host, pid, started, tuple(order), first)
        path = local_run_path(sweep, host, pid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(run)))
    return states


def test_status_and_the_analysis_give_every_config_one_state(tmp_path: Path) -> None:
    # They judged apart (launchers.status.classify; analysis.records' own rules for a record, Slurm and
    # a local launcher): a requeued job's old record, a damaged record and a local launcher's configs
    # each read one way in `status` and another in the analysis until each was mended on its own.
    states = build(tmp_path)
    asked: list[list[str]] = []

    def queue(ids: Sequence[str]) -> dict[str, str]:
        asked.append(list(ids))
        return {i: states[i] for i in ids if i in states}

    by_status = {s.index: s for s in sweep_status(tmp_path, slurm_states=states)}
    table = load_sweeps([tmp_path], queue=queue).table.set_index("manifest_index")
    for index, (case, (state, outcome)) in enumerate(CASES):
        assert by_status[index].state == state, (case, by_status[index])
        assert table.loc[index, "outcome"] == outcome, (case, table.loc[index, "reason"])
    # Slurm is asked once, about the jobs whose state can change a verdict: not a finished or
    # interrupted record's (configs 0 and 17).
    jobs = {job for (_, job, *_), _ in CASES if job is not None}
    assert len(asked) == 1 and set(asked[0]) == jobs - {"9_0", "9_17"}
    # Where Slurm or a launcher decided, the analysis gives status's words.
    for index in (5, 6, 7, 9, 15, 24, 28, 32, 33, 34):
        assert table.loc[index, "reason"] == by_status[index].detail, index
    # Counted as preempted, as a state of their own that `rerun --failed` resubmits.
    assert ", 2 preempted, " in format_status(list(by_status.values())).splitlines()[-1]
    assert {s.index for s in unresolved_failures(list(by_status.values())) if s.state == "preempted"} == {33, 34}


def test_a_record_keeps_its_kind_of_failure_where_status_says_failed() -> None:
    entry = ManifestEntry(0, ("a=1",), "0", "submitted", None, "9_0")
    assert judge(entry, {"status": "oom", "message": "CUDA out of memory"}, "FAILED").cause == "record"
    assert judge(entry, None, "OUT_OF_MEMORY").cause == "slurm"
    # A damaged record of a run that ended is failed, whatever Slurm last said of a job that ended.
    damaged = judge(entry, None, "COMPLETED", unreadable="JSONDecodeError: x")
    assert damaged == ("failed", "0/result.json cannot be read (JSONDecodeError: x)", "damaged")
    # No local launcher for a Slurm job: its own state decides.
    dead = LocalRun(socket.gethostname(), DEAD_PID, "1", (0,), 0)
    assert judge(entry, None, "RUNNING", local_run=dead).state == "running"
