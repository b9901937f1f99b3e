"""Several gloo ranks for a test, started from a fork server instead of spawned.

A spawned rank imports torch again (~2.5 CPU-seconds each on this 2-core machine, 2026-11-26):
tests/train/test_memory.py's 22 ranks took 66 s that way and 33 s from a fork server, which imports
torch and the test's module once per pytest process and forks each rank from there. A rank forked so
ends with os._exit, without the interpreter's teardown: the tests of what that teardown does with gloo
(tests/train/test_dp.py, the GradSync test of tests/train/test_trainer.py) spawn their ranks instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run fn(rank, *args) in `nprocs` processes and wait for all; raises what a rank raised."""
    # Read when the fork server starts, at its first use in this process; a later test's module is
    # imported by each of its ranks, torch never again.
    mp.set_forkserver_preload(["torch", fn.__module__])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
