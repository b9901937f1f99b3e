"""train.planner.calibration: the file's round trip, the ring fit, and the time model reading it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conf.schema import HardwareConfig, ModelConfig, ParallelismConfig, Precision, Recompute
from train.planner.calibration import (
    CALIBRATION_VERSION,
    Calibration,
    CollectiveTiming,
    GemmTiming,
    LayerTiming,
    NodeTiming,
    fit_link,
    load_calibration,
    ring_factors,
)
from train.planner.flops import layer_gemms, logits_gemm
from train.planner.inventory import stage_numel
from train.planner.memory import Stack
from train.planner.perf import FORWARD_LAYOUT, backward_gemm_shapes, predict_time

MODEL = ModelConfig(name="m", num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=32, vocab_size=256,
                    make_vocab_size_divisible_by=64)
LATENCY, BANDWIDTH = 20e-6, 1e9


def timings(scope: str, ranks: int) -> list[CollectiveTiming]:
    out = []
    for op in ("all_reduce", "all_gather", "send_recv"):
        r = 2 if op == "send_recv" else ranks
        for nbytes in (1 << 12, 1 << 16, 1 << 20):
            steps, share = ring_factors(op, r)
            out.append(CollectiveTiming(op, scope, r, nbytes, steps * LATENCY + share * nbytes / BANDWIDTH))
    return out


def calibration(tmp_path: Path) -> Path:
    # Every GEMM of a tp=1, mbs=1 layout, forward and backward, timed at 1 ms.
    gemms = [*layer_gemms(MODEL, micro_batch_size=1), logits_gemm(MODEL, micro_batch_size=1)]
    shapes = {(g.m, g.n, g.k, g.batch, FORWARD_LAYOUT) for g in gemms}
    shapes |= {s for g in gemms for s in backward_gemm_shapes(g)}
    timed = [GemmTiming(m, n, k, b, "fp32", 1e-3, layout) for m, n, k, b, layout in sorted(shapes)]
    cal = Calibration(
        version=CALIBRATION_VERSION, hardware="cpu", host="h", device="cpu x1", measured_at="now", torch="2.13",
        nodes=[NodeTiming(nodes=1, tasks_per_node=2, gemms=timed, memory_bw_gbs=10.0, op_overhead_us=7.0)],
        collectives=timings("intra", 2),
    )
    return cal.write(tmp_path / "cal.json")


def test_the_ring_fit_recovers_latency_and_bandwidth() -> None:
    link = fit_link(timings("inter", 4))
    assert link is not None
    assert link.latency == pytest.approx(LATENCY) and link.bandwidth == pytest.approx(BANDWIDTH)
    assert fit_link(timings("inter", 4)[:1]) is None  # one size cannot separate the two


def test_the_file_round_trips_and_another_version_is_refused(tmp_path: Path) -> None:
    path = calibration(tmp_path)
    cal = load_calibration(str(path))
    assert cal.nodes[0].gemms[0].seconds == 1e-3 and len(cal.collectives) == 9
    old = tmp_path / "old.json"
    old.write_text(path.read_text().replace(f'"version": {CALIBRATION_VERSION}', '"version": 0'))
    with pytest.raises(ValueError, match="version 0"):
        load_calibration(str(old))


def test_a_calibrated_cpu_is_predicted_from_its_measured_gemms(tmp_path: Path) -> None:
    hw = HardwareConfig(peak_measured=True, devices_per_node=2, calibration=str(calibration(tmp_path)))
    layout = ParallelismConfig(micro_batch_size=1, global_batch_size=1, precision=Precision.fp32)
    p = predict_time(MODEL, layout, hw, dp=1)
    # 2 layers x 4 dense GEMMs + the logits, each 1 ms forward and 2 x 1 ms backward.
    assert p.parts["gemm"] == pytest.approx((2 * 4 + 1) * 3e-3)
    assert p.parts["attention"] == pytest.approx(2 * 2 * 3e-3)
    # dp=2 inside the node all-reduces fp32 gradients over the fitted link (DeepSpeed: not overlapped):
    # 2 steps of latency, and each rank moves the whole message once at 1 GB/s.
    two = predict_time(MODEL, replace(layout, global_batch_size=2), hw, dp=2, stack=Stack.deepspeed)
    assert two.parts["dp_comm"] == pytest.approx(2 * LATENCY + 4 * stage_numel(MODEL) / BANDWIDTH)
    # An unmeasured shape (mbs=2) falls back to the best measured rate: still a prediction.
    assert predict_time(MODEL, replace(layout, micro_batch_size=2, global_batch_size=2), hw, dp=1).sec_per_iter > 0


def with_layers(tmp_path: Path, *layers: LayerTiming) -> HardwareConfig:
    path = calibration(tmp_path)
    cal = load_calibration(str(path))
    node = replace(cal.nodes[0], layers=list(layers))
    out = replace(cal, nodes=[node]).write(tmp_path / f"layers{len(list(tmp_path.iterdir()))}.json")
    return HardwareConfig(peak_measured=True, devices_per_node=2, calibration=str(out))


def narrow(tp: int, forward_s: float, step_s: float) -> LayerTiming:
    return LayerTiming(tp=tp, kind="gpt", hidden_size=32, num_attention_heads=2, seq_length=32, vocab_size=256,
                       micro_batch_size=1, forward_s=forward_s, step_s=step_s)  # fmt: skip


def test_what_a_measured_layer_costs_beyond_the_model_is_added_per_layer_and_micro_batch(tmp_path: Path) -> None:
    layout = ParallelismConfig(micro_batch_size=1, global_batch_size=2, precision=Precision.fp32)
    plain = predict_time(MODEL, layout, HardwareConfig(peak_measured=True, devices_per_node=2,
                                                       calibration=str(calibration(tmp_path))), dp=1)  # fmt: skip
    assert plain.parts["framework"] == 0  # a file without a narrow layer adds nothing
    one, two = (predict_time(MODEL, layout, with_layers(tmp_path, narrow(1, s / 3, s)), dp=1) for s in (1.0, 2.0))
    # Both well above the model's own figure for the narrow layer: the residuals differ by 1 s a layer,
    # paid on 2 layers x 2 micro-batches.
    assert two.parts["framework"] - one.parts["framework"] == pytest.approx(2 * 2 * 1.0)
    assert one.sec_per_iter == pytest.approx(plain.sec_per_iter + one.parts["framework"])
    # Full recompute runs each layer's forward again: a third of this layer's step.
    full = predict_time(MODEL, replace(layout, recompute=Recompute.full), with_layers(tmp_path, narrow(1, 2 / 3, 2.0)),
                        dp=1)  # fmt: skip
    assert full.parts["framework"] == pytest.approx(two.parts["framework"] * 4 / 3)
    # Measured below the model's figure: nothing (never negative); a TP degree not measured: nothing.
    assert predict_time(MODEL, layout, with_layers(tmp_path, narrow(1, 0.0, 1e-9)), dp=1).parts["framework"] == 0
    tp2 = replace(layout, tp=2, global_batch_size=2)
    assert predict_time(MODEL, tp2, with_layers(tmp_path, narrow(1, 1.0, 3.0)), dp=1).parts["framework"] == 0
    # A GPU runs its launches ahead of its work: not added there.
    gpu = replace(with_layers(tmp_path, narrow(1, 1.0, 3.0)), device_type="cuda")
    assert predict_time(MODEL, layout, gpu, dp=1).parts["framework"] == 0
