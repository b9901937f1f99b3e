"""Global batch size per step, with Megatron-LM's batch ramp-up.

`parallelism.rampup_batch_size = [start, increment, ramp_samples]` (Megatron's
--rampup-batch-size, used by the BLOOM runs: start 32, increment 32 over 6M samples) grows
the global batch from `start` by `increment` until `ramp_samples` samples have been consumed,
then holds it at `global_batch_size`. As in Megatron's RampupBatchsizeNumMicroBatches:

    increments = (global_batch_size - start) / increment
    per_increment = ramp_samples / increments            (samples between two increments)
    batch(consumed) = global_batch_size                   if consumed > ramp_samples
                    = start + floor(consumed / per_increment) x increment   otherwise

The batch of a step is decided by the samples consumed before it, so the schedule is a
function of the step number alone, the same on every rank and after a resume. The rules
(`rampup_batch_size`) require start and increment to be multiples of micro_batch_size x dp,
so every intermediate batch splits into whole micro-batches on every replica.

A ramp with no increment to make (start = global_batch_size) or no samples to make it over
(ramp_samples = 0) is no ramp: every step runs the full batch.

Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conf.schema import ParallelismConfig


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch of every step of a run."""

    global_batch_size: int
    """The batch every step runs once the ramp (if any) is over (samples)."""
    start: int | None = None
    """First batch of the ramp; None: no ramp (samples)."""
    increment: int = 0
    """Growth of the batch at each increment of the ramp (samples)."""
    ramp_samples: int = 0
    """Samples consumed over the ramp (samples)."""

    @classmethod
    def of(cls, par: ParallelismConfig) -> BatchSchedule:
        """The schedule of parallelism.global_batch_size and rampup_batch_size (checked by the rules)."""
        ramp = par.rampup_batch_size
        if not ramp:
            return cls(par.global_batch_size)
        start, increment, samples = (int(v) for v in ramp)
        if start >= par.global_batch_size or samples <= 0 or increment <= 0:
            return cls(par.global_batch_size)
        return cls(par.global_batch_size, start=start, increment=increment, ramp_samples=samples)

    @property
    def ramps(self) -> bool:
        return self.start is not None

    def batch_after(self, consumed: int) -> int:
        """Global batch of the step that starts after `consumed` samples."""
        if self.start is None or consumed > self.ramp_samples:
            return self.global_batch_size
        increments = (self.global_batch_size - self.start) // self.increment
        per_increment = self.ramp_samples / increments
        return min(self.start + math.floor(consumed / per_increment) * self.increment, self.global_batch_size)

    def consumed_before(self, step: int) -> int:
        """Samples consumed by steps 1 .. step-1 (steps count from 1)."""
        consumed, done = 0, 0
        while done < step - 1:
            if self.start is None or consumed > self.ramp_samples:
                # The rest are full batches: no need to walk them one by one.
                return consumed + (step - 1 - done) * self.global_batch_size
            consumed += self.batch_after(consumed)
            done += 1
        return consumed

    def batch_of(self, step: int) -> int:
        """Global batch of step `step` (from 1)."""
        return self.batch_after(self.consumed_before(step))

    def first_full_step(self) -> int:
        """The first step that runs the full global batch."""
        step, consumed = 1, 0
        while self.batch_after(consumed) < self.global_batch_size:
            consumed += self.batch_after(consumed)
            step += 1
        return step
