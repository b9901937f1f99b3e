"""`micro_batch_size=auto`: the largest micro-batch that fits, predicted first, then measured.

Two halves, because they run in different places:

* `largest_fitting_micro_batch` is the planner's answer (train.memory's estimate, no torch):
  the launcher and the dry run use it, and the job starts its probe there.
* `probe_micro_batch` is the job's answer: it runs one forward/backward at decreasing sizes and
  takes the first that does not raise torch.OutOfMemoryError (an OOM is an answer, not a
  failure). The planner's model leaves things out (allocator fragmentation, workspace, NCCL
  buffers; see train.memory), so the prediction can be one size too optimistic, and the probe
  is what settles it.

`auto_micro_batch` chains them: the probe starts at the prediction and walks down.

On a CPU there is no device memory to run out of (the kernel's OOM killer ends the process
instead of raising), so `simulated_memory_limit` stands in for a device: it counts the bytes
of the tensors the step keeps alive and raises torch.OutOfMemoryError past a cap, which makes
the probe's logic testable and a CPU run's `auto` mean "fits in hardware.memory_gib".

The module imports without torch (torch is imported inside the functions that need it), so
the launcher can call the planner half on a login node.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from conf.schema import AUTO_MICRO_BATCH, RunConfig, requested_micro_batch
from train.failures import classify
from train.memory import GIB, predicts_oom, usable_bytes
from train.validation import estimated_memory

DEFAULT_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class ProbeAttempt:
    """One try of the probe: the size, 'ok' or 'oom', and the OOM's message when it failed."""

    micro_batch_size: int
    outcome: str
    message: str = ""


@dataclass(frozen=True)
class AutoMicroBatch:
    """What `auto` chose and why: the planner's prediction, the probe's log, the final size."""

    micro_batch_size: int | None
    """The size the run uses; None when even the smallest candidate ran out of memory."""
    predicted: int | None
    """The planner's largest fitting size (None: it predicts none fits)."""
    reason: str
    """The planner's sentence."""
    probe: tuple[ProbeAttempt, ...]


def valid_micro_batches(
    run: RunConfig, *, dp: int, candidates: Sequence[int] = DEFAULT_CANDIDATES
) -> list[int]:
    """Candidates (ascending) that split the global batch into whole micro-batches on dp replicas."""
    gbs = run.parallelism.global_batch_size
    return sorted({c for c in candidates if c >= 1 and gbs % (c * dp) == 0})


def largest_fitting_micro_batch(
    run: RunConfig, *, dp: int, candidates: Sequence[int] = DEFAULT_CANDIDATES
) -> tuple[int | None, str]:
    """(largest candidate that the planner predicts fits, one-sentence reason); (None, reason)
    when none of the valid candidates fits.

    A candidate is valid when gbs is a multiple of candidate x dp (the trainer's rule). Larger
    micro-batches are not always heavier on every stage (with pp > 1 fewer micro-batches are
    in flight), so every valid candidate is estimated, not just the ones below a first failure.
    """
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    par, hw = run.parallelism, run.hardware
    valid = valid_micro_batches(run, dp=dp, candidates=candidates)
    if not valid:
        return None, (
            f"no candidate micro_batch_size in {sorted(set(candidates))} divides "
            f"global_batch_size / dp = {par.global_batch_size} / {dp}"
        )
    capacity = usable_bytes(hw)
    estimates = {
        c: estimated_memory(run.model, dataclasses.replace(par, micro_batch_size=c), dp) for c in valid
    }
    totals = {c: e.total for c, e in estimates.items()}
    # The same test as validation's memory rule, so `auto` never picks what validate() rejects.
    fitting = [c for c in valid if not predicts_oom(estimates[c], hw)]
    cap = f"{capacity / GIB:.2f} GiB usable on {hw.name}"
    if not fitting:
        return None, (
            f"even micro_batch_size={valid[0]} is predicted to need {totals[valid[0]] / GIB:.2f} GiB, "
            f"more than the {cap}"
        )
    best = max(fitting)
    larger = [c for c in valid if c > best]
    beyond = (
        f" (micro_batch_size={larger[0]} would need {totals[larger[0]] / GIB:.2f} GiB)"
        if larger
        else f" (the largest valid candidate; gbs/dp = {par.global_batch_size // dp})"
    )
    return (
        best,
        f"micro_batch_size={best} is predicted to need {totals[best] / GIB:.2f} GiB of the {cap}{beyond}",
    )


def resolve_micro_batch(run: RunConfig, *, dp: int) -> tuple[RunConfig, AutoMicroBatch | None]:
    """`run` with micro_batch_size='auto' replaced by the planner's largest fitting size, and what
    was chosen and why; (run, None) unchanged when the size is already an int.

    The entry points call this once, so every function past them sees an int. Raises ValueError
    when the planner predicts that no valid size fits (the reason says why), or when the value
    is a string other than 'auto'.
    """
    requested = requested_micro_batch(run.parallelism)
    if not isinstance(requested, str):
        return run, None
    if requested != AUTO_MICRO_BATCH:
        raise ValueError(
            f"parallelism.micro_batch_size={requested!r} is not a size: give a positive integer or 'auto'"
        )
    predicted, reason = largest_fitting_micro_batch(run, dp=dp)
    if predicted is None:
        raise ValueError(f"parallelism.micro_batch_size=auto found no size: {reason}")
    chosen = dataclasses.replace(run, parallelism=dataclasses.replace(run.parallelism, micro_batch_size=predicted))
    return chosen, AutoMicroBatch(micro_batch_size=predicted, predicted=predicted, reason=reason, probe=())


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
    """The planner's prediction, then the probe from the prediction down over the valid candidates.

    When the planner predicts that nothing fits, the probe still tries every valid size (the
    prediction can be pessimistic too: its reserve is a guess); it then decides.
    """
    predicted, reason = largest_fitting_micro_batch(run, dp=dp, candidates=candidates)
    valid = valid_micro_batches(run, dp=dp, candidates=candidates)
    sizes = [c for c in valid if predicted is None or c <= predicted]
    chosen, log = probe_micro_batch(step_fn, sizes)
    return AutoMicroBatch(micro_batch_size=chosen, predicted=predicted, reason=reason, probe=log)


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
