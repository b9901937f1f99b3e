"""train.signals: stop signals held while a record or a manifest line is written. Real signals, sent to
this process with os.kill."""

from __future__ import annotations

import os
import signal
import threading

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
