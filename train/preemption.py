"""Stopping for Slurm and coming back: signals, the stop at a step boundary, resume; and test faults.

Slurm warns a job before its time limit (--signal=USR1@lead) and ends it with SIGTERM. A run that
does not checkpoint (training.save_interval = 0) turns either signal into TrainingTimeout at once,
so its record says `timeout` before the job dies. A checkpointing run only notes the signal
(StopRequest): at the next step boundary every rank agrees to stop (one scalar all-reduce), saves,
and raises TrainingPreempted; the process exits with train.contract.EXIT_REQUEUE and the
launcher's in-job wrapper requeues the job. The next attempt resumes from the checkpoint
(`resume`) without repeating a step. SIGUSR2 is left alone: submitit uses it for its own
checkpoint-and-requeue.

Test fault hooks (environment variables, read at each iteration, inert unless set) reproduce what
cannot be ordered on a real cluster: a rank dying (FAULT_ENV), Slurm's warning reaching one rank
(SIGNAL_ENV), a rank stuck before a collective (HANG_ENV), a first attempt too slow for its time
limit (SLOW_FIRST_ATTEMPT_ENV).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import RunConfig
from train.contract import REQUEUE_ADVICE
from train.planner.batch import BatchSchedule
from train.planner.layout import Rank
from train.signals import SLURM_STOP_SIGNALS, signals_to

if TYPE_CHECKING:
    import torch

    from train.checkpoint import Checkpointer
    from train.engine import Engine
    from train.trainer import Progress


_interrupted = threading.Event()


def interrupt_once(signum: int, frame: object) -> None:
    """SIGINT handler of the trainer's processes: KeyboardInterrupt the first time, then SIGINT is
    ignored. A terminal's Ctrl-C reaches every process of its group (a local spawn's parent and its
    workers), and the parent forwards it as well: a second one must not cut the record short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _interrupted.set()
    raise KeyboardInterrupt


def note_interrupt() -> None:
    """Record that this process got Ctrl-C, for a SIGINT handler of its own (the entry point's, before
    a run installs interrupt_once); interrupted() then says so."""
    _interrupted.set()


def install_interrupt_handler() -> None:
    """Ctrl-C (SIGINT) goes to interrupt_once in this process (main thread only, as Python allows)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt_once)


def interrupted() -> bool:
    """Whether this process got Ctrl-C (SIGINT): an error that follows is its consequence (a peer
    that left a collective), not a failure of its own."""
    return _interrupted.is_set()


def raise_if_interrupted(exc: Exception) -> None:
    """Raise KeyboardInterrupt (from `exc`) if this process got Ctrl-C: `exc` then stands where the
    interrupt was (a cleanup that raised on the way out, a child that failed because of it), and a
    caller that goes on after a failure must stop instead."""
    if interrupted():
        raise KeyboardInterrupt from exc


class TrainingTimeout(Exception):
    """Slurm asked the job to stop (SIGTERM at the time limit, or the SIGUSR1 warning)."""


class TrainingPreempted(TrainingTimeout):
    """Slurm asked the job to stop and the state was checkpointed at a step boundary first: the
    record says `timeout`, the process exits with EXIT_REQUEUE, and a requeued attempt resumes
    from the checkpoint."""


@dataclass
class StopRequest:
    """Slurm's stop signal, noted by the handler and acted on at the next step boundary."""

    signal: str | None = None

    def agreed(self, device: torch.device) -> str | None:
        """The signal any rank got ('SIGUSR1', 'SIGTERM'), or None: a collective, every rank calls it
        at every step. Every rank learns which signal it was, also those that did not get it."""
        import torch

        number = torch.tensor(float(signal.Signals[self.signal] if self.signal else 0), device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(number, op=torch.distributed.ReduceOp.MAX)
        return signal.Signals(int(number.item())).name if number.item() else None


@contextlib.contextmanager
def timeout_signals(*, defer: bool = False) -> Iterator[StopRequest | None]:
    """Turn Slurm's SIGTERM and SIGUSR1 into TrainingTimeout, so the record is written before the job
    dies; the previous handlers come back afterwards. With `defer` (a checkpointing run) the handler
    only notes the signal in the yielded StopRequest for the step boundary to act on."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    stop = StopRequest() if defer else None

    def handler(signum: int, frame: object) -> None:
        if stop is not None:
            stop.signal = signal.Signals(signum).name
            return
        raise TrainingTimeout(f"received {signal.Signals(signum).name}; stopped before the end of training")

    with signals_to(handler, SLURM_STOP_SIGNALS):
        yield stop


def await_record(path: Path, *, since: datetime, timeout_s: float = 30.0) -> None:
    """Wait until `path` was written after `since` (by rank 0), at most timeout_s: ranks that stop
    together for a requeue must not exit (and have the local spawn end rank 0) before it is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= since.timestamp():
                return
        time.sleep(0.05)



def checkpoint_boundary(
    ckpt: Checkpointer,
    engine: Engine,
    *,
    step: int,
    run: RunConfig,
    consumed_samples: int,
    losses: list[float],
    device: torch.device,
    rank: int,
    stop: StopRequest | None,
) -> None:
    """After step `step`: save every training.save_interval steps (the last step too: save_last_step);
    when any rank got Slurm's signal, save now (synchronously), then raise TrainingPreempted. Every
    rank calls this at every step."""
    last_step = run.training.train_iters
    signal_hook(rank, step)
    # One scalar all-reduce per step: the ranks must stop at the same step even when the signal
    # reached them on either side of a boundary.
    received = stop.agreed(device) if stop is not None else None
    stopping = received is not None and step < last_step
    ckpt.poll()  # a finished asynchronous save becomes `latest` now, not at the next save
    if step % run.training.save_interval == 0 or stopping:
        state = engine.checkpoint_state()
        ckpt.save(step, **state, losses=losses, consumed_samples=consumed_samples, blocking=stopping)
    if stopping:
        assert stop is not None
        where = "" if stop.signal else " (on another rank)"
        raise TrainingPreempted(
            f"received {received}{where}; stopped after step {step} of {last_step} with a checkpoint "
            f"in {ckpt.dir}: {REQUEUE_ADVICE}"
        )


def save_last_step(
    ckpt: Checkpointer, engine: Engine, *, run: RunConfig, consumed_samples: int, losses: list[float]
) -> None:
    """After the run's last step, once its measurements are taken (the write is no step's time, energy or
    memory): save it when save_interval did not (train_iters not a multiple of it), as Megatron does.
    Unsaved, the steps after the last multiple were trained again by the same command run again, whose
    record, of unmeasured iterations, replaced the finished run's measured one. Every rank calls this."""
    step = run.training.train_iters
    if step % run.training.save_interval != 0:
        ckpt.save(step, **engine.checkpoint_state(), losses=losses, consumed_samples=consumed_samples)
    ckpt.wait()


# ---------------------------------------------------------------------------------------------
# Test fault hooks.

FAULT_ENV = "MEGASWEEP_FAULT_EXIT"
"""'<rank>:<iteration>': that rank exits abruptly (os._exit) at the start of that iteration. A test
hook for the failure path of multi-process runs (a worker dying mid-run, as on a node failure)."""
FAULT_EXIT_CODE = 17
SIGNAL_ENV = "MEGASWEEP_FAULT_SIGNAL"
"""'<rank>:<iteration>': that rank sends itself SIGUSR1 during that iteration, as Slurm's --signal
warning would. A test hook for stop-at-a-step-boundary, checkpoint and resume."""
HANG_ENV = "MEGASWEEP_FAULT_HANG"
"""'<rank>:<iteration>': that rank sleeps before its first collective of that iteration, as a rank
stuck in a kernel or on a dead NIC would. A test hook for training.collective_timeout_s."""
HANG_SLEEP_S = 3600.0
SLOW_FIRST_ATTEMPT_ENV = "MEGASWEEP_FAULT_SLOW_FIRST_ATTEMPT"
"""'<seconds>': every iteration of a Slurm job's first attempt (SLURM_RESTART_COUNT unset or 0) sleeps
that long, so that the attempt runs into its time limit whatever the machine's speed and the
requeued attempt finishes at full speed. A test hook for time limits and requeue."""


def _names(env: str, rank: int, iteration: int, environ: Mapping[str, str]) -> bool:
    return environ.get(env) == f"{rank}:{iteration}"


def fault_hooks(rank: int, iteration: int, environ: Mapping[str, str] = os.environ) -> None:
    """The hooks that act at the start of an iteration: exit, hang, slow first attempt."""
    if _names(FAULT_ENV, rank, iteration, environ):
        print(f"{FAULT_ENV}={environ[FAULT_ENV]}: rank {rank} exits now", file=sys.stderr, flush=True)
        os._exit(FAULT_EXIT_CODE)
    hang_hook(rank, iteration, environ)
    slow_first_attempt_hook(environ)


def signal_hook(rank: int, iteration: int, environ: Mapping[str, str] = os.environ) -> None:
    """Send this process SIGUSR1 when SIGNAL_ENV names this rank and iteration."""
    if _names(SIGNAL_ENV, rank, iteration, environ):
        os.kill(os.getpid(), signal.SIGUSR1)


def hang_hook(rank: int, iteration: int, environ: Mapping[str, str] = os.environ) -> None:
    """Sleep (interruptibly: the trainer's SIGTERM handler still fires) when HANG_ENV names this rank
    and iteration."""
    if _names(HANG_ENV, rank, iteration, environ):
        print(f"{HANG_ENV}={environ[HANG_ENV]}: rank {rank} hangs now", file=sys.stderr, flush=True)
        time.sleep(HANG_SLEEP_S)


def slow_first_attempt_hook(environ: Mapping[str, str] = os.environ) -> None:
    """Sleep SLOW_FIRST_ATTEMPT_ENV seconds when set and this is the job's first attempt (a signal
    handler still runs during the sleep; the trainer acts on it at the step boundary)."""
    spec = environ.get(SLOW_FIRST_ATTEMPT_ENV)
    if spec and environ.get("SLURM_RESTART_COUNT", "0") == "0":
        time.sleep(float(spec))


# ---------------------------------------------------------------------------------------------
# Resume.


def resume(
    run: RunConfig, engine: Engine, *, rank: Rank, progress: Progress, output_dir: Path | None
) -> tuple[Checkpointer | None, int, int]:
    """(the run's checkpointer, the step training goes on after, the samples consumed by then).

    No checkpointer when training.save_interval is 0; otherwise the latest checkpoint of this
    layout, if any, is restored into the engine's model, optimizer and scaler first."""
    if run.training.save_interval <= 0 or output_dir is None:
        return None, 0, 0
    from train.checkpoint import Checkpointer, CheckpointMismatch, checkpoint_root, fingerprint

    layout = rank.layout
    key = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "zero_stage": run.parallelism.zero_stage}
    if run.parallelism.virtual_stages > 1:  # only then: older checkpoints' layouts stay equal
        key["virtual_stages"] = run.parallelism.virtual_stages
    ckpt = Checkpointer(
        checkpoint_root(run, output_dir),
        layout=key,
        config=fingerprint(run),
        rank=rank.global_rank,
    )
    progress.checkpointer = ckpt
    resumed = ckpt.load_latest(**engine.checkpoint_state())
    if resumed is None:
        if ckpt.other_layouts:
            progress.warnings.append(
                f"checkpoint directory {ckpt.root} holds checkpoints of layout {', '.join(ckpt.other_layouts)} "
                f"only, not of this run's layout {ckpt.dir.name}: this run starts afresh (a run resumes only "
                "its own layout's; theirs are left as they are)"
            )
            if rank.lead:
                print(f"warning: {progress.warnings[-1]}", file=sys.stderr, flush=True)
        return ckpt, 0, 0
    expected = BatchSchedule.of(run.parallelism).consumed_before(resumed.step + 1)
    if resumed.consumed_samples != expected:
        raise CheckpointMismatch(
            f"checkpoint {resumed.path} consumed {resumed.consumed_samples} samples in {resumed.step} steps, "
            f"not the {expected} of this run's batch schedule (global_batch_size, rampup_batch_size)"
        )
    progress.resumed_from_step = resumed.step
    for skipped in resumed.skipped:
        progress.warnings.append(f"checkpoint not resumed from, unreadable: {skipped}")
        if rank.lead:
            print(f"warning: {progress.warnings[-1]}", file=sys.stderr, flush=True)
    progress.prior_losses = resumed.losses
    if resumed.step >= run.training.train_iters:
        # Nothing is left to train: the record says ok with no iteration (its final_loss the checkpoint's).
        progress.warnings.append(
            f"resumed from step {resumed.step} ({resumed.path}), at or beyond training.train_iters="
            f"{run.training.train_iters}: no iteration ran; raise train_iters to train on, or use another "
            "training.checkpoint_dir (or run directory) to start afresh"
        )
    if rank.lead:
        print(f"resumed from step {resumed.step} ({resumed.path})", flush=True)
        if resumed.step >= run.training.train_iters:
            print(f"warning: {progress.warnings[-1]}", file=sys.stderr, flush=True)
    return ckpt, resumed.step, resumed.consumed_samples
