"""train.planner.batch: the global batch of each step, with Megatron's ramp-up semantics."""

from __future__ import annotations

from conf.schema import ParallelismConfig
from train.planner.batch import BatchSchedule


def megatron_rampup(start: int, increment: int, samples: int, gbs: int, consumed: int) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatches.update, written out independently."""
    if consumed > samples:
        return gbs
    per_increment = samples / ((gbs - start) // increment)
    return start + int(consumed / per_increment) * increment


def test_no_ramp_is_the_full_batch_every_step() -> None:
    schedule = BatchSchedule.of(ParallelismConfig(global_batch_size=16))
    assert not schedule.ramps
    assert [schedule.batch_of(s) for s in (1, 2, 100)] == [16, 16, 16]
    assert schedule.consumed_before(4) == 48 and schedule.first_full_step() == 1


def test_ramp_grows_by_increment_over_the_ramp_samples_as_megatron() -> None:
    # BLOOM's ramp scaled down: start 4, +4 per step of the ramp, over 64 samples, to 16.
    schedule = BatchSchedule.of(ParallelismConfig(global_batch_size=16, rampup_batch_size=[4, 4, 64]))
    batches = [schedule.batch_of(s) for s in range(1, 20)]
    assert batches[0] == 4 and batches[-1] == 16 and batches == sorted(batches)
    consumed = 0
    for step, batch in enumerate(batches, start=1):
        assert batch == megatron_rampup(4, 4, 64, 16, consumed), step
        assert schedule.consumed_before(step) == consumed
        consumed += batch
    first = schedule.first_full_step()
    assert batches[first - 1] == 16 and all(b < 16 for b in batches[: first - 1])


def test_degenerate_ramps_are_no_ramp() -> None:
    for ramp in ([16, 4, 64], [4, 4, 0]):
        schedule = BatchSchedule.of(ParallelismConfig(global_batch_size=16, rampup_batch_size=ramp))
        assert not schedule.ramps and schedule.batch_of(1) == 16
