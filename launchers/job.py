"""What runs inside each Slurm task: the trainer as a child, and a requeue when it asks for one.

    python -m launchers.job --output-dir DIR --max-retries N -- python -m train <overrides> ...

The Slurm launcher ships a `TrainCommand` to every array task (submitit pickles it); the array
scripts of `python -m launchers sbatch` run the same thing as the command above, so there is
one piece of code for both.

Requeue (time limit, preemption): jobs are submitted with --requeue and --signal=USR1@<lead>.
A checkpointing trainer (training.save_interval > 0) saves at the next step boundary on USR1
and exits with EXIT_REQUEUE; the task then requeues its job (`scontrol requeue`) while
SLURM_RESTART_COUNT < cluster.max_retries, keeping the stopped attempt's record as
result.attempt<N>.json, and the next attempt resumes from the checkpoint. Past max_retries the
`timeout` record stands and the job fails.

Torch-free: torch is imported only by the trainer it starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.contract import EXIT_REQUEUE, RESULT_FILE, attempt_result_name

__all__ = ["TrainCommand", "main", "slurm_job_id"]


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

    def __call__(self) -> dict[str, Any]:
        code = self.run()
        result = Path(self.output_dir) / RESULT_FILE
        if code != 0:
            raise RuntimeError(self.failure(code))
        record: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
        return record

    def run(self) -> int:
        """Run the trainer and return its exit status; on EXIT_REQUEUE, requeue this job while
        retries remain (and then never return)."""
        env = {**os.environ, **dict(self.env)}
        # Slurm's USR1 warning reaches every process of the step; its default action would kill
        # this one (the task's wrapper process) while the trainer is still saving its checkpoint.
        _ignore_in_this_process(signal.SIGUSR1)
        # Inherited stdout/stderr: the trainer's log lines land in the task's Slurm log as they come.
        proc = subprocess.Popen(list(self.argv), cwd=self.cwd, env=env)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C: the trainer writes an `interrupted` record and exits, which subprocess.run
            # would cut short (SIGKILL after 0.25 s). It got the terminal's SIGINT too, unless only
            # this process was signalled: passing it on once more is harmless (ignored after one).
            proc.send_signal(signal.SIGINT)
            proc.wait()
            raise
        if code == EXIT_REQUEUE:
            self._requeue_or_give_up(os.environ, Path(self.output_dir) / RESULT_FILE)
        return code

    def failure(self, code: int) -> str:
        """The message of a trainer that exited with status `code`."""
        result = Path(self.output_dir) / RESULT_FILE
        where = f"; record: {result}" if result.exists() else " before writing result.json"
        return f"`{' '.join(self.argv)}` exited with status {code}{where}"

    def _requeue_or_give_up(self, environ: Mapping[str, str], result: Path) -> None:
        """Requeue this job while retries remain (never returns then); return to fail it otherwise."""
        restarts = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
        if restarts >= self.max_retries:
            print(
                f"slurm: trainer stopped for a requeue, but cluster.max_retries={self.max_retries} "
                f"requeue(s) are used up ({restarts} done): the job ends here",
                file=sys.stderr,
                flush=True,
            )
            return
        job = slurm_job_id(environ)
        if int(environ.get("SLURM_PROCID", "0")) == 0:
            # The stopped attempt's record stays beside the next one's: `status` must not read
            # its `timeout` as the config's outcome while the job waits to run again.
            kept = result.with_name(attempt_result_name(restarts))
            if result.exists():
                os.replace(result, kept)
            try:
                subprocess.run(
                    ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=True
                )
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", None) or exc
                print(f"slurm: scontrol requeue {job} failed: {detail}", file=sys.stderr, flush=True)
                if kept.exists():
                    os.replace(kept, result)
                return
            print(f"slurm: requeued {job} (retry {restarts + 1} of {self.max_retries})", flush=True)
        # No return value, no exception: submitit would pickle either as this job's result, and a
        # waiting launcher would take the stopped attempt's outcome for the job's.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_REQUEUE)


def _ignore_in_this_process(signum: signal.Signals) -> None:
    # A Python handler, not SIG_IGN: an ignored signal stays ignored across exec, and the trainer
    # child must get the signal's default meaning until it installs its own handler.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, lambda *_: None)


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
