"""Stop signals held while something that must not be cut short finishes. Torch-free: the launchers
use it too.

Two places need it: the trainer writing a run's record (a spawn's parent or Slurm may send SIGTERM
right after training ended, and the record is what the run leaves behind), and the Slurm launcher
between an sbatch that queued an array and the manifest line that lists it (a launcher stopped in
between left an array queued that no manifest knew). Inside the block a signal is only noted; the
caller decides what it means after the block.

A third needs more than a handler: a process started in the block (sbatch, `scontrol release`) is in
the same process group, so a terminal's Ctrl-C reaches it too, and it dies with the signal mid-way:
sbatch after queueing a held array but before printing its id, the release before releasing. There
the signals are blocked instead (signals_blocked), which the child inherits across exec.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator

SLURM_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What Slurm sends a job to stop it: SIGTERM at the time limit or on scancel, and SIGUSR1 ahead of
the limit (--signal=USR1@lead). SIGUSR2 is submitit's own checkpoint-and-requeue signal."""

TERMINAL_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a command a user runs: Ctrl-C, kill, and the terminal closing."""


@contextlib.contextmanager
def signals_held(signals: Iterable[signal.Signals]) -> Iterator[list[int]]:
    """`signals` received inside the block are noted, in the order they came (the list yielded), not
    acted on; the previous handlers come back after it. Outside the main thread, where Python cannot
    set handlers, nothing is held. A signal this process ignores (nohup, a background job's SIGINT)
    stays ignored: holding it would have the caller act on what the process chose to ignore."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def note(signum: int, frame: object) -> None:
        held.append(signum)

    with signals_to(note, [s for s in signals if signal.getsignal(s) != signal.SIG_IGN]):
        yield held


@contextlib.contextmanager
def signals_to(handler: Callable[[int, object], None], signals: Iterable[signal.Signals]) -> Iterator[None]:
    """`signals` go to `handler` inside the block (main thread only); the previous handlers come back
    after it, whatever ends the block."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def signals_blocked(signals: Iterable[signal.Signals]) -> Iterator[None]:
    """`signals` wait, blocked, until the block ends (then the handler in force takes each one that came,
    once); the processes started inside inherit them blocked, so a signal sent to the whole process
    group does not end them either. Main thread only, as with signals_held; elsewhere nothing waits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = set(signals)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    try:
        yield
    finally:
        # Only the ones this block added: a signal blocked before it stays blocked.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted - set(before))
