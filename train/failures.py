"""What a failed run's exception means for its record: oom, timeout or error.

torch raises torch.OutOfMemoryError only for CUDA (and MPS). A CPU run that exhausts its memory (or a
Slurm job's memory limit, or an address-space rlimit) fails inside c10's DefaultCPUAllocator with a
plain RuntimeError, or in Python with MemoryError; a sweep must still see `oom` there, so the
classification goes by the allocator's messages. A collective that a peer never joins fails after
training.collective_timeout_s with a gloo or NCCL timeout error: that is `timeout`, like Slurm's
time limit, because the run did not finish in the time it was given.

This module does not import torch at module level: classification goes by type names and messages,
so it also works on exceptions that crossed a process boundary as text.
"""

from __future__ import annotations

OOM_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "not enough memory",
    "CUDA out of memory",
    "out of memory",
)
"""Substrings of allocator failures (c10's CPU allocator, CUDA's caching allocator, cuBLAS/cuDNN)."""

TIMEOUT_MESSAGES = (
    "Timed out waiting",  # gloo: "[../gloo/transport/tcp/pair.cc] Timed out waiting 10000ms for recv ..."
    "timed out",
    "Watchdog caught collective operation timeout",  # NCCL
    "Socket Timeout",
)

def classify(exc: BaseException) -> str:
    """'oom', 'timeout' or 'error' for an exception that ended training (TrainingTimeout is 'timeout'
    by the trainer's own handler). Chained causes count: a collective wrapper may re-raise an OOM."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = {cls.__name__ for cls in type(current).__mro__}
        text = str(current)
        if "OutOfMemoryError" in names or "MemoryError" in names or any(m in text for m in OOM_MESSAGES):
            return "oom"
        if isinstance(current, TimeoutError) or any(m in text for m in TIMEOUT_MESSAGES):
            return "timeout"
        current = current.__cause__ or current.__context__
    return "error"
