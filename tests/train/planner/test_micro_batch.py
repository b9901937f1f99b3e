"""micro_batch_size=auto, the planner's half: the largest size predicted to fit, at every entry point."""

from __future__ import annotations

import dataclasses

import pytest

from conf.schema import ModelConfig, ParallelismConfig, Precision, RunConfig
from train.planner.memory import GIB, estimate_memory, predicts_oom
from train.planner.micro_batch import largest_fitting_micro_batch, resolve_micro_batch, valid_micro_batches
from train.planner.plan import format_plan_table, plan_run
from train.planner.rules import validate

TINY = ModelConfig(
    name="autombs", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=256
)


def _compose(*overrides: str) -> RunConfig:
    from tests.train.test_ds_config import compose_run

    return compose_run(*overrides)


# ---------------------------------------------------------------------------------------------
# Planner half (torch-free arithmetic).


@pytest.mark.parametrize(
    ("overrides", "dp"),
    [
        (
            [
                "model=gpt_13b",
                "hardware=a100_80gb",
                "parallelism.global_batch_size=256",
                "parallelism.engine=deepspeed",
                "parallelism.zero_stage=3",
                "parallelism.precision=bf16",
                "parallelism.recompute=selective",
            ],
            16,
        ),
        (["model=gpt_6.7b", "hardware=a100_80gb", "parallelism=megatron_3d", "parallelism.tp=4"], 2),
        (
            [
                "model=gpt_13b",
                "hardware=a100_80gb",
                "parallelism=megatron_3d",
                "parallelism.recompute=full",
                "parallelism.global_batch_size=256",
            ],
            1,
        ),
    ],
)
def test_planner_picks_the_largest_size_predicted_to_fit(overrides: list[str], dp: int) -> None:
    run = _compose(*overrides)
    mbs, reason = largest_fitting_micro_batch(run, dp=dp)

    def fits(c: int) -> bool:
        par = dataclasses.replace(run.parallelism, micro_batch_size=c)
        return not predicts_oom(estimate_memory(run.model, par, dp=dp, hardware=run.hardware), run.hardware)

    valid = valid_micro_batches(run, dp=dp)
    expected = max((c for c in valid if fits(c)), default=None)
    assert mbs == expected
    assert mbs is not None, "these layouts were chosen so that some size fits"
    # The limit is binding: the next valid size would not fit (else the case tests nothing).
    larger = [c for c in valid if c > mbs]
    assert larger and not fits(larger[0])
    assert (
        f"micro_batch_size={mbs}" in reason and "GiB" in reason and f"micro_batch_size={larger[0]}" in reason
    )


def test_planner_reports_none_when_nothing_fits() -> None:
    run = _compose("model=bloom_176b", "hardware=a100_40gb", "parallelism.global_batch_size=8")
    mbs, reason = largest_fitting_micro_batch(run, dp=1)
    assert mbs is None
    assert "micro_batch_size=1" in reason and "a100_40gb" in reason


def test_planner_only_considers_sizes_that_split_the_global_batch() -> None:
    run = _compose("parallelism.global_batch_size=12")
    # Every size that splits it, not its powers of two alone (auto took 2 of 6 per replica, where 3 and 6 fit).
    assert valid_micro_batches(run, dp=2) == [1, 2, 3, 6]
    assert largest_fitting_micro_batch(run, dp=2)[0] == 6
    assert valid_micro_batches(run, dp=2, candidates=(3, 6, 5)) == [3, 6]
    mbs, reason = largest_fitting_micro_batch(run, dp=4, candidates=(2, 4))
    assert mbs is None and "divides" in reason


@pytest.mark.parametrize(
    ("overrides", "world", "chosen"),
    [
        # Interleaved: 16 / (mbs x dp) micro-batches in groups of pp=2; auto took 16 (one micro-batch).
        (["parallelism.pp=2", "parallelism.virtual_stages=2", "parallelism.global_batch_size=16"], 2, 8),
        # Ramp-up from 16 by 16: auto took 64, which no ramp-up batch splits into.
        (["parallelism.global_batch_size=64", "parallelism.rampup_batch_size=[16,16,1000]"], 1, 16),
    ],
)
def test_auto_takes_a_size_the_batch_rules_accept(overrides: list[str], world: int, chosen: int) -> None:
    run = _compose("model.num_layers=4", "parallelism.micro_batch_size=auto", *overrides)
    assert validate(run, world_size=world) == []
    assert resolve_micro_batch(run, dp=world // run.parallelism.pp)[0].parallelism.mbs == chosen


def test_auto_with_a_ramp_no_size_splits_names_the_ramp() -> None:
    # A start of 0 fits no size: auto falls back to a size of the global batch, so that validate
    # reports the ramp-up's own rule, not "no micro-batch size".
    run = _compose("parallelism.global_batch_size=64", "parallelism.micro_batch_size=auto",
                   "parallelism.rampup_batch_size=[0,16,1000]")  # fmt: skip
    assert [v.rule for v in validate(run, world_size=1)] == ["rampup_batch_size"]


def _auto_run(memory_gib: float) -> RunConfig:
    """TINY, micro_batch_size=auto, gbs 32, on a device with memory_gib usable (no reserve)."""
    return RunConfig(
        model=TINY,
        parallelism=ParallelismConfig(micro_batch_size="auto", global_batch_size=32, precision=Precision.fp32),  # the unresolved form
        hardware=dataclasses.replace(
            RunConfig().hardware, memory_gib=memory_gib, memory_reserve_gib=0.0, peak_tflops_fp32=1.0
        ),
    )


def _between_8_and_16() -> float:
    par = ParallelismConfig(micro_batch_size=1, global_batch_size=32, precision=Precision.fp32)
    needs = {c: estimate_memory(TINY, dataclasses.replace(par, micro_batch_size=c), dp=1).needed for c in (8, 16)}
    return (needs[8] + needs[16]) / 2 / GIB


def test_resolve_replaces_auto_by_the_prediction_and_keeps_an_int() -> None:
    run = _auto_run(_between_8_and_16())
    resolved, choice = resolve_micro_batch(run, dp=1)
    assert resolved.parallelism.micro_batch_size == 8
    assert choice is not None and choice.predicted == 8 and choice.probe == ()
    assert resolved.parallelism.global_batch_size == 32  # nothing else changes
    fixed = dataclasses.replace(run, parallelism=dataclasses.replace(run.parallelism, micro_batch_size=4))
    assert resolve_micro_batch(fixed, dp=1) == (fixed, None)
    with pytest.raises(ValueError, match="found no size"):
        resolve_micro_batch(_auto_run(1e-4), dp=1)


def test_validate_and_plan_show_the_predicted_size() -> None:
    run = _auto_run(_between_8_and_16())
    assert validate(run) == []
    row = plan_run(run)
    assert row.feasible and row.micro_batch_size == 8
    # The memory column is that of the chosen size, which fits.
    assert 0 < row.mem_gib <= row.mem_capacity_gib
    table = format_plan_table([row]).splitlines()
    header, line = table[0].split(), table[1].split()
    assert line[header.index("MBS")] == "8"


def test_validate_reports_why_auto_finds_no_size_and_rejects_other_words() -> None:
    (v,) = validate(_auto_run(1e-4))
    assert v.rule == "micro_batch_auto" and "even micro_batch_size=1" in v.message
    row = plan_run(_auto_run(1e-4))
    assert not row.feasible and row.micro_batch_size == 0 and row.reasons == [str(v)] == [f"[{v.rule}] {v.message}"]
    word = dataclasses.replace(
        _auto_run(80.0), parallelism=dataclasses.replace(_auto_run(80.0).parallelism, micro_batch_size="max")
    )
    (w,) = validate(word)
    assert w.rule == "micro_batch_size" and "parallelism.micro_batch_size=max" in w.message and "auto" in w.message


def test_composed_auto_stays_a_string_until_resolved() -> None:
    run = _compose("parallelism.micro_batch_size=auto")
    assert run.parallelism.micro_batch_size == "auto"
    assert isinstance(_compose("parallelism.micro_batch_size=8").parallelism.micro_batch_size, int)
