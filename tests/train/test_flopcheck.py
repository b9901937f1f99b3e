"""train.flopcheck: FlopCounterMode on the real model agrees with train.planner.flops' per-GEMM count."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.flopcheck import flop_check, format_flop_check
from train.trainer import run_training

from .test_trainer import compose_run

# Tiny-ish shapes with every dimension distinct, so a transposed or missing GEMM cannot cancel out.
SHAPES = (
    "model.num_layers=2",
    "model.hidden_size=48",
    "model.num_attention_heads=3",
    "model.ffn_hidden_size=160",
    "model.seq_length=24",
    "model.vocab_size=300",
    "parallelism.micro_batch_size=2",
    "parallelism.global_batch_size=6",
)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_counted_equals_model_flops_without_recompute(kind: str) -> None:
    check = flop_check(compose_run(*SHAPES, f"model.kind={kind}"))
    assert check.micro_batches == 3
    assert check.counted_per_iteration == check.counted_per_micro_batch * 3
    # Every GEMM of train.planner.flops, forward x1 + backward x2, and nothing else the counter sees.
    assert check.counted_per_iteration == pytest.approx(check.model_flops_per_iteration, rel=0.01)
    assert check.hardware_flops_per_iteration == check.model_flops_per_iteration
    assert abs(check.relative_error) < 0.01


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_full_recompute_matches_hardware_flops(kind: str) -> None:
    run = compose_run(*SHAPES, f"model.kind={kind}", "parallelism.recompute=full")
    whole = flop_check(run, early_stop=False)
    # Re-running every layer forward, as Megatron does: train.planner.flops' hardware FLOPs.
    assert whole.counted_per_iteration == pytest.approx(whole.hardware_flops_per_iteration, rel=0.01)
    assert whole.counted_per_iteration > 1.2 * whole.model_flops_per_iteration
    # torch's default early stop skips each layer's mlp_out re-run; the check accounts for it and
    # the plain hardware figure is then visibly above what runs (6% at these shapes).
    early = flop_check(run)
    assert early.counted_per_iteration == pytest.approx(early.expected, rel=0.01)
    assert early.counted_per_iteration < 0.97 * early.hardware_flops_per_iteration
    assert early.skipped_recompute_flops > 0 and abs(early.relative_error) < 0.01


def test_selective_recompute_adds_the_attention_core() -> None:
    run = compose_run(*SHAPES, "parallelism.recompute=selective")
    whole = flop_check(run, early_stop=False)
    assert whole.counted_per_iteration == pytest.approx(whole.hardware_flops_per_iteration, rel=0.01)
    assert whole.hardware_flops_per_iteration > whole.model_flops_per_iteration
    assert abs(flop_check(run).relative_error) < 0.01


def test_trainer_records_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    plain = run_training(
        compose_run(*SHAPES, "training.flop_check=true"), output_dir=tmp_path / "plain", overrides=[]
    )
    assert plain["status"] == "ok"
    check = plain["flop_check"]
    assert abs(check["relative_error"]) < 0.01
    assert check["model_flops_per_iteration"] == plain["flops_per_iteration"]["model"]
    unchecked = run_training(compose_run(*SHAPES), output_dir=tmp_path / "off", overrides=[])
    assert "flop_check" not in unchecked
    # The check builds its own model under a forked RNG: training is unchanged by it.
    assert unchecked["losses"] == plain["losses"]


def test_format() -> None:
    line = format_flop_check(flop_check(compose_run(*SHAPES)))
    assert line.startswith("FLOPs check (none recompute): counted") and "+0.00%" in line


def test_shape_report_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The other start-of-run diagnostic: train.planner.shapes' table for the run's GEMMs, and the advisor's
    # hidden sizes in the record when the shapes are off (hidden_size=32 is not a multiple of 128).
    monkeypatch.setenv("WANDB_MODE", "disabled")
    record = run_training(compose_run(), output_dir=tmp_path, overrides=[])
    out = capsys.readouterr().out
    assert "GEMM shapes: model=tiny" in out and "FLOPs-weighted tile x wave efficiency" in out
    assert out.index("GEMM shapes:") < out.index(" iteration ")  # printed before training
    shape_warnings = [w for w in record["warnings"] if w.startswith("shapes: ")]
    assert any(
        "hidden_size=32 is not a multiple of 128" in w and "Advisor: try hidden_size" in w
        for w in shape_warnings
    )
    # Notes that offer no fix (an unknown SM count on CPU) stay on the console only.
    assert "unknown SM count" in out and not any("unknown SM count" in w for w in record["warnings"])
