"""train.planner.calibration: the file's round trip, the ring fit, and the time model reading it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conf.schema import HardwareConfig, ModelConfig, ParallelismConfig, Precision
from train.planner.calibration import (
    CALIBRATION_VERSION,
    Calibration,
    CollectiveTiming,
    GemmTiming,
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
