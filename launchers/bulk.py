"""The cyclic garbage collector paused while a batch of thousands of configs or records is built.

Torch- and Hydra-free, so that the analysis (which loads 10,000 records under it) imports neither.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

__all__ = ["bulk_allocation"]

_freezing_at_exit = False


@contextlib.contextmanager
def bulk_allocation() -> Iterator[None]:
    """CPython's cyclic garbage collector paused while a sweep's batch is composed or planned.

    A batch of 10,000 configs creates some 10 objects per config that all stay alive (RunConfigs,
    memoised estimates, plan rows): each burst of allocations starts a collection that walks every
    live object, Hydra's and the caches' included, again and again, to free nothing, since these
    objects hold no cycles (reference counting frees what is dropped). Measured on the 10,000-config
    plan (tests/bench/bench_plan.py): 0.3-0.5 s of 4 s. The collector's state comes back after.

    Also, once per process, an exit handler freezes what is alive then (gc.freeze): the
    interpreter's last collection at exit would otherwise walk every object of the plan (0.3 s
    for 10,000 configs) just before the process frees its memory as a whole. In a process that
    goes on (a test session) the collector keeps working normally until then.
    """
    global _freezing_at_exit
    if not _freezing_at_exit:
        atexit.register(gc.freeze)
        _freezing_at_exit = True
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
