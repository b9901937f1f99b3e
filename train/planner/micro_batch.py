"""`micro_batch_size=auto`, the planner's half: the largest micro-batch predicted to fit.

`largest_fitting_micro_batch` answers from train.planner.memory's estimate, without torch, so
the launchers and the dry run can resolve `auto` on a login node; `resolve_micro_batch` puts
that size into the run at the entry points, so everything past them sees an int. The job then
settles it (train.mbs_probe): one forward/backward per size from this prediction down, because
the estimate leaves things out (allocator fragmentation, workspaces) and can be one size too
optimistic.

Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from conf.schema import AUTO_MICRO_BATCH, RunConfig, requested_micro_batch
from train.planner.memory import GIB, estimated_memory, predicts_oom, usable_bytes

DEFAULT_CANDIDATES: tuple[int, ...] = tuple(range(1, 129))
"""Every size up to 128, not its powers of two alone: of global_batch_size=6 on one replica, 3 and 6
split it too, and `auto` is the largest size predicted to fit (valid_micro_batches keeps those the
batch rules accept)."""


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
    """Candidates (ascending) that the batch rules accept on dp replicas (train.planner.rules.batch_violations):
    whole micro-batches for the global batch and each ramp-up batch, in groups of pp when interleaved.
    When none does, those that split the global batch alone: the size then chosen is one whose
    violation validate() names (a ramp-up start no size divides), not a bare "no size"."""
    from train.planner.rules import batch_violations  # rules resolves `auto` through this module

    par = run.parallelism
    splits = sorted({c for c in candidates if c >= 1 and par.global_batch_size % (c * dp) == 0})
    ruled = [c for c in splits if not batch_violations(dataclasses.replace(par, micro_batch_size=c), dp)]
    return ruled or splits


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
        c: estimated_memory(run.model, dataclasses.replace(par, micro_batch_size=c), dp, hw) for c in valid
    }
    totals = {c: e.needed for c, e in estimates.items()}
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


