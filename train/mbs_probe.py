"""`micro_batch_size=auto`, the job's half: a measured probe from the planner's prediction down.

`probe_micro_batch` runs one forward/backward at decreasing sizes and takes the first that does
not run out of memory (an OOM is an answer, not a failure); `auto_micro_batch` starts it at the
planner's prediction (train.planner.micro_batch). On a CPU there is no device memory to run out
of (the kernel's OOM killer ends the process instead of raising), so `simulated_memory_limit`
stands in for a device: it counts the bytes of the tensors the step keeps alive and raises
torch.OutOfMemoryError past a cap, which makes the probe's logic testable and a CPU run's `auto`
mean "fits in hardware.memory_gib".

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from conf.schema import RunConfig
from train.failures import classify
from train.planner.micro_batch import (
    DEFAULT_CANDIDATES,
    AutoMicroBatch,
    ProbeAttempt,
    largest_fitting_micro_batch,
    valid_micro_batches,
)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), or a CPU allocator failure / MemoryError (train.failures)."""
    return classify(exc) == "oom"


def probe_micro_batch(
    step_fn: Callable[[int], object], sizes: Sequence[int]
) -> tuple[int | None, tuple[ProbeAttempt, ...]]:
    """Run step_fn(size) for sizes from the largest down; the first size that does not run out of
    memory wins. Returns (size or None when all ran out, log of the attempts).

    Out of memory means torch.OutOfMemoryError, or what train.failures classifies as an OOM (c10's
    CPU allocator failure under an address-space limit, MemoryError). Any other exception
    propagates: only an OOM says the size is too large. After an OOM the
    failed attempt's tensors are dropped and the CUDA cache is emptied, so the next (smaller)
    attempt sees the memory the failed one held.
    """
    import torch

    log: list[ProbeAttempt] = []
    for size in sorted(set(sizes), reverse=True):
        try:
            step_fn(size)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            log.append(
                ProbeAttempt(size, "oom", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            )
            # The traceback holds the failed step's frames (and their tensors) until it is dropped.
            del exc
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        log.append(ProbeAttempt(size, "ok"))
        return size, tuple(log)
    return None, tuple(log)


def auto_micro_batch(
    run: RunConfig,
    *,
    dp: int,
    step_fn: Callable[[int], object],
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
) -> AutoMicroBatch:
    """The planner's prediction, then the probe from the prediction down the valid candidates'
    halving_ladder.

    When the planner predicts that nothing fits, the probe still walks the ladder from the largest
    valid size (the prediction can be pessimistic too: its reserve is a guess); it then decides.
    """
    predicted, reason = largest_fitting_micro_batch(run, dp=dp, candidates=candidates)
    valid = valid_micro_batches(run, dp=dp, candidates=candidates)
    chosen, log = probe_micro_batch(step_fn, halving_ladder([c for c in valid if predicted is None or c <= predicted]))
    return AutoMicroBatch(micro_batch_size=chosen, predicted=predicted, reason=reason, probe=log)


def halving_ladder(sizes: Sequence[int]) -> list[int]:
    """The largest of `sizes`, then each time the largest at most half the last: each attempt of the
    probe may run out of memory, and every size that splits a batch of 120 is sixteen of them where
    the ladder is seven (120, 60, 30, 15, 6, 3, 1)."""
    ladder: list[int] = []
    for size in sorted(set(sizes), reverse=True):
        if not ladder or 2 * size <= ladder[-1]:
            ladder.append(size)
    return ladder


@contextmanager
def simulated_memory_limit(limit_bytes: float) -> Iterator[Callable[[], int]]:
    """SIMULATES a device with `limit_bytes` of memory on any device (meant for CPU).

    Inside the block, every tensor an operator creates (forward and backward, seen through a
    TorchDispatchMode) is counted by its storage size while it is alive; when the live total
    would pass the limit, the operator's result is dropped and torch.OutOfMemoryError is raised,
    as the CUDA caching allocator would. Tensors created before the block (parameters) are not
    counted: the limit is the step's working memory. Yields a function returning the peak
    counted bytes. A view shares its base's storage and is not counted again; the storage is
    released when the tensor that created it dies (a view outliving it is not tracked), so the
    count can only be lower than the true live memory, never higher.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    live: dict[int, int] = {}  # storage data_ptr -> bytes
    peak = [0]

    def release(ptr: int) -> None:
        live.pop(ptr, None)

    class _Limit(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            # In-place ops and views return storage that already exists: not an allocation.
            inputs = {
                t.untyped_storage().data_ptr()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.device.type != "meta"
            }
            added: list[int] = []
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr == 0 or ptr in live or ptr in inputs:
                    continue
                live[ptr] = storage.nbytes()
                added.append(ptr)
                weakref.finalize(t, release, ptr)
            total = sum(live.values())
            if total > limit_bytes:
                for ptr in added:
                    live.pop(ptr, None)
                raise torch.OutOfMemoryError(
                    f"simulated memory limit: {func} would raise live tensor memory to {total} bytes, "
                    f"above the limit of {int(limit_bytes)} bytes"
                )
            peak[0] = max(peak[0], total)
            return out

    with _Limit():
        yield lambda: peak[0]
