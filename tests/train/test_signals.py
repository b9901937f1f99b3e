"""train.signals: stop signals held while a record or a manifest line is written. Real signals, sent to
this process with os.kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from train.signals import SLURM_STOP_SIGNALS, TERMINAL_STOP_SIGNALS, signals_held, signals_to


def test_a_held_signal_is_noted_not_acted_on_and_the_handler_comes_back() -> None:
    got: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        with signals_held(SLURM_STOP_SIGNALS) as held:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)  # would end the process, unheld
            assert got == []
        assert held == [signal.SIGUSR1, signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler from before the block again
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_an_ignored_signal_stays_ignored() -> None:
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals_held(TERMINAL_STOP_SIGNALS) as held:
            os.kill(os.getpid(), signal.SIGHUP)
        assert held == []
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_outside_the_main_thread_nothing_is_held() -> None:
    seen: list[list[int]] = []

    def hold() -> None:
        with signals_held(SLURM_STOP_SIGNALS) as held:
            seen.append(held)

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=hold)
    thread.start()
    thread.join()
    assert seen == [[]] and signal.getsignal(signal.SIGTERM) == before


def test_handlers_come_back_when_the_block_raises() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    try:
        with signals_to(lambda signum, frame: None, [signal.SIGUSR1]):
            raise RuntimeError("the block failed")
    except RuntimeError:
        pass
    assert signal.getsignal(signal.SIGUSR1) == before


# A process that starts `sleep` and then sends SIGINT to its whole process group, as a terminal's Ctrl-C
# does, inside signals_blocked or not; it prints how the child ended and when its own handler ran.
CTRL_C_OF_THE_GROUP = """
import contextlib, os, signal, subprocess, sys
from train.signals import TERMINAL_STOP_SIGNALS, signals_blocked
signal.signal(signal.SIGINT, lambda signum, frame: print("handler", flush=True))
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # blocked before: stays blocked
with signals_blocked(TERMINAL_STOP_SIGNALS) if sys.argv[1] == "blocked" else contextlib.nullcontext():
    child = subprocess.Popen(["sleep", "1"])
    os.killpg(0, signal.SIGINT)
    print("child", child.wait(), flush=True)
print("after", flush=True)
print("usr2 still blocked", signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, set()), flush=True)
"""


@pytest.mark.parametrize("blocked", [True, False])
def test_a_blocked_ctrl_c_of_the_process_group_spares_the_child_and_reaches_the_process_after(blocked: bool) -> None:
    # sbatch, started inside the block, used to die of the terminal's Ctrl-C with the launcher's group.
    proc = subprocess.run([sys.executable, "-c", CTRL_C_OF_THE_GROUP, "blocked" if blocked else "open"],
                          capture_output=True, text=True, timeout=60, start_new_session=True,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    if blocked:
        assert proc.stdout.splitlines() == ["child 0", "handler", "after", "usr2 still blocked True"]
    else:
        assert proc.stdout.splitlines() == ["handler", f"child {-signal.SIGINT}", "after", "usr2 still blocked True"]
