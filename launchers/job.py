"""What runs inside each Slurm task: the trainer as a child, and a requeue when it asks for one.

    python -m launchers.job --output-dir DIR --max-retries N -- python -m train <overrides> ...

The Slurm launcher ships a `TrainCommand` to every array task (submitit pickles it); the array
scripts of `python -m launchers sbatch` run the same thing as the command above, so there is
one piece of code for both.

Requeue (time limit, preemption): jobs are submitted with --requeue and --signal=USR1@<lead>.
A checkpointing trainer (training.save_interval > 0) saves at the next step boundary on USR1
and exits with EXIT_REQUEUE; srun task 0 then requeues its job (`scontrol requeue`) while
SLURM_RESTART_COUNT < cluster.max_retries, keeping the stopped attempt's record as
result.attempt<N>.json, and the next attempt resumes from the checkpoint (the other tasks leave
with 0 meanwhile, so that srun's --kill-on-bad-exit does not end task 0 first). Past max_retries the
`timeout` record stands and the job fails, unless the stop was Slurm's own requeue (`scontrol
requeue`, a preemption): that job runs again whatever max_retries says, so its record goes aside
as for a requeue of ours, and the task says so instead of saying the job ends. A task that Slurm
killed before it could keep the record (KillWait) leaves it to the next attempt, whose task 0 keeps
it before its trainer starts; that task also says the job runs again, and whether past max_retries.
Slurm's SIGTERM (a requeue, a preemption, scancel) reaches this wrapper too, and it outlives it to
do all that; a job cancelled with scancel is not requeued.

Cancelled: scancel's SIGTERM comes without the USR1 warning that precedes a time limit, yet the trainer
cannot tell it from the time limit's own SIGTERM (or a preemption's) by the signal. Accounting knows at
once (on the local cluster sacct said CANCELLED within half a second of the scancel, before the trainer
had written its record): the trainer asks it before its record and W&B's summary are written
(train.trainer), and task 0 asks again once the trainer has exited on a `timeout` record (accounting
slower than the trainer), writes `cancelled` over it and says so at the end of the run's log. KillWait's
SIGKILL may end this wrapper first: `status` and the analysis read sacct's CANCELLED themselves
(launchers.states), so they say cancelled either way.

Logs: the trainer's stdout and stderr go to the run directory's own log (train.contract.LOG_FILE
for srun task 0, rank_log_name(R) for the others), appended attempt after attempt, and the task
echoes that file to its own output as it grows, so Slurm's log (or the local launcher's console)
still shows the iteration lines. The trainer writes the file itself, not through a pipe: a wrapper
that Slurm ends first must not take the trainer's output, or its record, down with it.

Torch-free: torch is imported only by the trainer it starts.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

from launchers.queue import is_cancelled, parse_states
from train.contract import (
    EXIT_REQUEUE,
    REQUEUE_ADVICE,
    RESULT_FILE,
    attempt_result_name,
    cancelled_message,
    cancelled_words,
    rank_log_name,
    write_json_atomic,
)

__all__ = ["TrainCommand", "cancelled", "cancelled_words", "main", "requeued_by_slurm", "slurm_job_id"]


@dataclass(frozen=True)
class TrainCommand:
    """What one array task runs: picklable (submitit ships it to the node), no torch inside.

    Runs the trainer as a subprocess so that each srun task is a fresh interpreter whose
    torch.distributed start-up reads SLURM_PROCID / SLURM_NTASKS; returns the run's
    result.json (the value Hydra's JobReturn carries with hydra.launcher.wait=true).
    """

    argv: tuple[str, ...]
    cwd: str
    output_dir: str
    env: tuple[tuple[str, str], ...] = ()
    max_retries: int = 0
    """Requeues allowed after the trainer stopped on Slurm's signal with a checkpoint."""
    time_limit_s: float | None = None
    """The time limit this command enforces itself (a local launch's cluster.time_limit_min, in
    seconds); None where Slurm enforces it."""

    def __call__(self) -> dict[str, Any]:
        code = self.run()
        result = Path(self.output_dir) / RESULT_FILE
        if code != 0:
            raise RuntimeError(self.failure(code))
        record: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
        return record

    def run(self) -> int:
        """Run the trainer and return its exit status; on EXIT_REQUEUE, requeue this job while
        retries remain (and then never return); on another failure of an attempt Slurm has requeued
        itself, never return either (_end_if_requeued_by_slurm)."""
        env = {**os.environ, **dict(self.env)}
        # Slurm's USR1 warning, and the SIGTERM of a requeue, a preemption or the time limit, reach
        # every process of the step; their default action would kill this one (the task's wrapper)
        # while the trainer still saves its checkpoint and record, which then goes unkept.
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            _outlive(signum)
        self._begin_requeued_attempt(os.environ)
        code = run_logged(list(self.argv), cwd=self.cwd, env=env, log=self.log_path(os.environ),
                          time_limit_s=self.time_limit_s)  # fmt: skip
        if code == EXIT_REQUEUE and self.time_limit_s is not None:
            # A local launch (its own time limit, or a kill): no Slurm job of its own to requeue. Inside an
            # salloc, `scontrol requeue` would have requeued the user's allocation, this launch with it.
            _not_requeued(Path(self.output_dir) / RESULT_FILE, self.log_path(os.environ),
                          "a run of this machine: no Slurm job of its own to requeue")  # fmt: skip
        elif code == EXIT_REQUEUE:
            self._requeue_or_give_up(os.environ, Path(self.output_dir) / RESULT_FILE)
        elif code != 0:
            self._end_if_requeued_by_slurm(os.environ, Path(self.output_dir) / RESULT_FILE)
            self._say_if_cancelled(os.environ)
        return code

    def _say_if_cancelled(self, environ: Mapping[str, str]) -> None:
        """Task 0 of a job its user cancelled (scancel) while the trainer ran without a checkpoint to
        requeue from: the trainer's `timeout` record becomes `cancelled` (unless the trainer, which asks
        Slurm too, wrote it so), and the log says why (see the module docstring). Slurm is asked only after
        a `timeout` record: no other stop reads as one."""
        job, result = slurm_job_id(environ), Path(self.output_dir) / RESULT_FILE
        # A local launch (time_limit_s) stops by its own limit, whatever Slurm allocation it runs inside.
        if self.time_limit_s is not None or not job or _task(environ) != 0:
            return
        status = (_load_record(result) or {}).get("status")
        if status == "timeout" and cancelled(job):
            _mark_cancelled(result, job)
        elif status != "cancelled":  # the trainer asked Slurm itself, when accounting knew in time
            return
        said = f"{cancelled_words(job)}: it stopped on scancel's SIGTERM, not at a time limit; its record says cancelled"
        print(f"slurm: {said}", file=sys.stderr, flush=True)
        try:
            with open(self.log_path(environ), "a") as out:
                out.write(f"megasweep: {said}\n")
        except OSError:
            pass  # the record is what status and the analysis read

    def _end_if_requeued_by_slurm(self, environ: Mapping[str, str], result: Path) -> None:
        """Never return when Slurm has requeued this job (`scontrol requeue`, a preemption) of a run
        without a checkpoint: its SIGTERM stopped the trainer, which failed, and the job runs again
        from the start. This attempt's failure is not the job's outcome: raised here, submitit kept it
        as the job's result, and a waiting launch (hydra.launcher.wait=true) reported the config failed,
        exit 1, while the next attempt went on to finish it."""
        job, restarts = slurm_job_id(environ), _restarts(environ)
        if not (job and requeued_by_slurm(job, restarts)):
            return
        lead = _task(environ) == 0
        if lead:
            self._keep_attempt_record(result, restarts)
        print(f"slurm: {job} was requeued by Slurm itself: this attempt's failure is not the job's outcome; "
              "the next attempt trains again (from the last checkpoint, if any)", flush=True)  # fmt: skip
        sys.stderr.flush()
        os._exit(EXIT_REQUEUE if lead else 0)

    def log_path(self, environ: Mapping[str, str]) -> Path:
        """This srun task's log in the run directory (see the module docstring)."""
        return Path(self.output_dir) / rank_log_name(_task(environ))

    def failure(self, code: int) -> str:
        """The message of a trainer that exited with status `code`."""
        result = Path(self.output_dir) / RESULT_FILE
        where = f"; record: {result}" if result.exists() else " before writing result.json"
        return f"`{' '.join(self.argv)}` exited with status {code}{where}"

    def _requeue_or_give_up(self, environ: Mapping[str, str], result: Path) -> None:
        """Requeue this job while retries remain (never returns then); return to fail it otherwise,
        unless Slurm has requeued it itself (never returns then either)."""
        restarts = _restarts(environ)
        job = slurm_job_id(environ)
        lead = _task(environ) == 0
        # Aside first: Slurm's SIGKILL follows its SIGTERM (a requeue, a preemption) within KillWait
        # seconds, and asking scontrol and sacct below takes time. Put back if the job ends here.
        kept = self._keep_attempt_record(result, restarts) if lead else None
        if (why := self._next_attempt_comes(job, restarts, lead)) is not None:
            if kept is not None and kept.exists():
                os.replace(kept, result)
            if lead and why == cancelled_words(job):
                _mark_cancelled(result, job)
            if lead:
                _not_requeued(result, self.log_path(environ), why)
            return
        # No return value, no exception: submitit would pickle either as this job's result, and a
        # waiting launcher would take the stopped attempt's outcome for the job's.
        sys.stdout.flush()
        sys.stderr.flush()
        # Task 0 requeues for all. Any other task leaves with 0: srun's --kill-on-bad-exit ends the
        # step when a task exits non-zero, which killed task 0 while it still asked Slurm to requeue
        # the job (which then ended FAILED). Task 0 leaving non-zero still fails a job it did not requeue.
        os._exit(EXIT_REQUEUE if lead else 0)

    def _next_attempt_comes(self, job: str, restarts: int, lead: bool) -> str | None:
        """None when the job runs again (Slurm requeued it itself, or task 0 requeued it: retries remain);
        else why it does not, as the task's log and the record say it."""
        if not lead:  # task 0 decides and requeues for all: the others ask no more than they did
            comes = restarts < self.max_retries or (bool(job) and requeued_by_slurm(job, restarts))
            return None if comes else "task 0 decides"
        if job and requeued_by_slurm(job, restarts):
            # `scontrol requeue`, a preemption: the next attempt runs whatever max_retries says, and
            # resumes from the checkpoint.
            beyond = (
                f", beyond cluster.max_retries={self.max_retries} ({restarts} requeue(s) done before)"
                if restarts >= self.max_retries
                else ""
            )
            print(f"slurm: {job} was requeued by Slurm itself{beyond}: the next attempt resumes from the checkpoint",
                  flush=True)  # fmt: skip
            return None
        if job and cancelled(job):
            # scancel's SIGTERM stops a checkpointing trainer as a time limit's does; a requeue now
            # would bring back the job its user has just cancelled.
            print(f"slurm: {job} was cancelled (scancel): not requeued, the stopped attempt's record says cancelled",
                  file=sys.stderr, flush=True)  # fmt: skip
            return cancelled_words(job)
        if restarts >= self.max_retries:
            print(
                f"slurm: trainer stopped for a requeue, but cluster.max_retries={self.max_retries} "
                f"requeue(s) are used up ({restarts} done): the job ends here",
                file=sys.stderr,
                flush=True,
            )
            return f"cluster.max_retries={self.max_retries} requeue(s) are used up ({restarts} done)"
        return None if self._requeue(job, restarts) else f"scontrol requeue {job} failed (its Slurm log says why)"

    def _begin_requeued_attempt(self, environ: Mapping[str, str]) -> None:
        """A requeued attempt's task 0 says it runs again, and keeps aside the record the attempt before it
        left as result.json.

        The stopped attempt's own task does that when the trainer exits (_requeue_or_give_up), unless
        Slurm's SIGKILL comes first: KillWait seconds after the SIGTERM of a requeue, while a loaded
        node still saves the checkpoint and record (CI, 2026-11-26: the wrapper was killed 7 s after
        `scontrol requeue`, the record written but never kept, then overwritten by the next attempt's)."""
        restarts = _restarts(environ)
        if restarts == 0 or _task(environ) != 0:
            return
        # Said here too: the stopped attempt's own words (_next_attempt_comes) are lost when that SIGKILL
        # ends its wrapper first. Past max_retries no wrapper requeues, so Slurm did (scontrol, preemption).
        beyond = (
            f", beyond cluster.max_retries={self.max_retries}: Slurm requeued it itself"
            if restarts > self.max_retries
            else ""
        )
        print(f"slurm: {slurm_job_id(environ)} runs again (requeue {restarts}{beyond}); it resumes from its "
              "last checkpoint", flush=True)  # fmt: skip
        kept = self._keep_attempt_record(Path(self.output_dir) / RESULT_FILE, restarts - 1)
        if kept is not None:
            print(f"slurm: kept the record attempt {restarts - 1} left as {kept.name}", flush=True)

    @staticmethod
    def _keep_attempt_record(result: Path, restarts: int) -> Path | None:
        """The stopped attempt's record, moved beside the next one's: `status` must not read its
        `timeout` as the config's outcome while the job waits to run again. Where it went; None when
        there was no record, or that attempt's is kept already (by its own task: it is not replaced)."""
        kept = result.with_name(attempt_result_name(restarts))
        if not result.exists() or kept.exists():
            return None
        os.replace(result, kept)
        return kept

    def _requeue(self, job: str, restarts: int) -> bool:
        """`scontrol requeue` this job (task 0 does it for all); False when that failed."""
        try:
            subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = str(getattr(exc, "stderr", None) or exc).strip()
            if ALREADY_REQUEUED not in detail:
                print(f"slurm: scontrol requeue {job} failed: {detail}", file=sys.stderr, flush=True)
                return False
            # Slurm requeued the job itself since it was asked above: the next attempt comes all the same.
            print(f"slurm: {job} was requeued by Slurm; the next attempt resumes", flush=True)
        else:
            print(f"slurm: requeued {job} (retry {restarts + 1} of {self.max_retries})", flush=True)
        return True


ALREADY_REQUEUED = "Job is pending execution"
"""scontrol requeue's words for a job that Slurm has requeued already (and that waits to run again)."""


def _not_requeued(result: Path, log: Path, why: str) -> None:
    """A stopped run's record and task log, whose job ends here, say what resumes it: their "requeue to
    resume" was written before anyone knew that no requeue would come (`why`: cluster.max_retries used
    up, a cancel, a refused scontrol), and status, the analysis and the log's last line showed it as
    the advice. Both say why, where the user reads first (the reason was only in submitit's log)."""
    advice = (
        f"this job was not requeued ({why}); python -m launchers rerun {result.parent.parent} --failed resumes "
        "it from there (where that is the sweep's directory)"
    )
    try:
        with open(log, "a") as out:
            out.write(f"megasweep: {advice}\n")
    except OSError:
        pass  # the record below is what status and the analysis read
    try:
        record = json.loads(result.read_text())
    except (OSError, ValueError):
        return
    message = record.get("message") if isinstance(record, dict) else None
    if isinstance(message, str) and message.endswith(REQUEUE_ADVICE):
        record["message"] = message.removesuffix(REQUEUE_ADVICE) + advice
        write_json_atomic(result, record)


def _load_record(result: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(result.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _mark_cancelled(result: Path, job: str) -> None:
    """The stopped run's `timeout` record says `cancelled` instead, and why: status, the analysis and a
    user reading result.json took it for a time limit, and a longer cluster.time_limit_min for the cure."""
    record = _load_record(result)
    if record is None or record.get("status") != "timeout":
        return
    record["status"] = "cancelled"
    record["message"] = cancelled_message(job, record.get("message"))
    write_json_atomic(result, record)


def _task(environ: Mapping[str, str]) -> int:
    """This srun task's rank in its step (SLURM_PROCID; 0 outside Slurm)."""
    return int(environ.get("SLURM_PROCID", "0") or 0)


def _restarts(environ: Mapping[str, str]) -> int:
    """How often Slurm has requeued this job so far (SLURM_RESTART_COUNT; 0 on its first attempt)."""
    return int(environ.get("SLURM_RESTART_COUNT", "0") or 0)

ECHO_INTERVAL_S = 0.2
"""How often the task copies what the trainer added to its log to its own output (seconds)."""


LOCAL_KILL_WAIT_S = 30.0
"""Seconds between a local run's SIGTERM at its time limit and the SIGKILL after it: Slurm's default
KillWait, so that a run saves its record (and checkpoint) here as it would in a job."""


def run_logged(
    argv: Sequence[str], *, cwd: str, env: Mapping[str, str], log: Path, time_limit_s: float | None = None
) -> int:
    """Run `argv` with stdout and stderr appended to `log`, echoing the file to this process's stdout
    while it runs; the exit status. `time_limit_s`: where no Slurm enforces cluster.time_limit_min (a
    local launch), SIGTERM after that long and SIGKILL LOCAL_KILL_WAIT_S later, as Slurm ends a job."""
    log.parent.mkdir(parents=True, exist_ok=True)
    # Unbuffered: stdout and stderr share the file, and a line must land in it when it is printed.
    env = {**env, "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED") or "1"}
    with open(log, "ab") as out:
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        job = slurm_job_id(os.environ) or "no Slurm job"
        out.write(f"megasweep: {started} ({job}): {' '.join(argv)}\n".encode())
        out.flush()
        offset = out.tell()
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with open(log, "rb") as follow, subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=out, stderr=out) as proc:
            follow.seek(offset)
            begun = time.monotonic()
            stopped: float | None = None
            try:
                while proc.poll() is None:
                    _echo(follow, decode)
                    time.sleep(ECHO_INTERVAL_S)
                    if time_limit_s is None:
                        continue
                    if stopped is None and time.monotonic() - begun >= time_limit_s:
                        stopped = time.monotonic()
                        said = (f"megasweep: cluster.time_limit_min reached ({time_limit_s / 60:g} min): SIGTERM, as "
                                f"Slurm ends a job at its time limit; SIGKILL in {LOCAL_KILL_WAIT_S:g} s\n")  # fmt: skip
                        out.write(said.encode())
                        out.flush()
                        proc.send_signal(signal.SIGTERM)
                    elif stopped is not None and time.monotonic() - stopped >= LOCAL_KILL_WAIT_S:
                        proc.kill()
            except KeyboardInterrupt:
                # Ctrl-C: the trainer writes an `interrupted` record and exits; killing it would cut
                # that short. It got the terminal's SIGINT too, unless only this process was
                # signalled: passing it on once more is harmless (ignored after one).
                proc.send_signal(signal.SIGINT)
                proc.wait()
                _echo(follow, decode)
                raise
            except BaseException:  # as subprocess.run: the trainer does not outlive an interrupted task
                proc.kill()
                raise
            _echo(follow, decode)
    return proc.returncode


def _echo(follow: BinaryIO, decode: codecs.IncrementalDecoder) -> None:
    # Text, not bytes: a launcher's (or a test's) stdout may have no binary buffer.
    text = decode.decode(follow.read())
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _outlive(signum: signal.Signals) -> None:
    # A Python handler, not SIG_IGN: an ignored signal stays ignored across exec, and the trainer
    # child must get the signal's default meaning until it installs its own handler. (submitit's job
    # process bypasses SIGTERM already; `python -m launchers.job` did not.) Slurm's SIGKILL follows
    # KillWait seconds after its SIGTERM whatever this process does.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, lambda *_: None)


def requeued_by_slurm(job: str, restarts: int) -> bool:
    """Whether Slurm has requeued `job` since the attempt whose SLURM_RESTART_COUNT is `restarts`
    started: `scontrol show job` counts one more restart (Slurm counts it when it requeues, before
    the job's processes are stopped). False when scontrol does not answer: the job then ends."""
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    match = re.search(r"(?:^|\s)Restarts=(\d+)(?:\s|$)", out)
    return match is not None and int(match.group(1)) > restarts


def cancelled(job: str, *, timeout_s: float = 60.0) -> bool:
    """Whether `job` was cancelled (scancel). Accounting says so as soon as it is; scontrol and squeue
    show any job being stopped as COMPLETING, whatever stops it. False when sacct does not answer (within
    `timeout_s` seconds)."""
    try:
        out = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-j", job, "--format=JobID,State"],
            capture_output=True, text=True, timeout=timeout_s, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return is_cancelled(parse_states(out).get(job, ""))


def slurm_job_id(environ: Mapping[str, str]) -> str:
    """This job's id as scontrol knows it: '<array>_<task>' for an array task."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else environ.get("SLURM_JOB_ID", "")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m launchers.job --output-dir DIR --max-retries N -- <trainer command>`.

    Runs one srun task of an exported array script exactly as TrainCommand runs one of the
    launcher's: the trainer as a child, USR1 left to it, and on EXIT_REQUEUE the job
    requeued while SLURM_RESTART_COUNT < N (the stopped attempt's record kept aside). Exits
    with the trainer's status (after printing why, when it is not 0).
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m launchers.job",
        description="Run one array task's trainer; requeue the job when it stops on Slurm's signal.",
    )
    parser.add_argument("--output-dir", required=True, help="the run's directory (where result.json goes)")
    parser.add_argument("--max-retries", type=int, required=True, help="cluster.max_retries (requeues)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the trainer's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no trainer command: give it after `--`")
    if args.max_retries < 0:
        parser.error(f"--max-retries={args.max_retries}: must be 0 or more (requeues allowed)")
    task = TrainCommand(
        argv=tuple(command), cwd=os.getcwd(), output_dir=args.output_dir, max_retries=args.max_retries
    )
    code = task.run()
    if code != 0:
        print(f"slurm: {task.failure(code)}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
