"""train.planner.calibration: the file's round trip, the ring fit, and the time model reading it."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conf.schema import HardwareConfig, ModelConfig, ParallelismConfig, Precision, Recompute
from train.planner.calibration import (
    CALIBRATION_VERSION,
    AttentionTiming,
    Calibration,
    CollectiveTiming,
    GemmTiming,
    LayerTiming,
    NodeTiming,
    fit_link,
    gemm_table,
    links,
    load_calibration,
    node_timing,
    ring_factors,
)
from train.planner.flops import layer_gemms, logits_gemm
from train.planner.inventory import stage_numel
from train.planner.memory import Stack
from train.planner.perf import (
    FORWARD_LAYOUT,
    UnknownHardwareFigure,
    _kernel_head,
    _machine_cached,
    _one_gemm,
    _quantized,
    backward_gemm_shapes,
    predict_time,
)
from train.planner.shapes import alignment_elements

MODEL = ModelConfig(name="m", num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=32, vocab_size=256,
                    make_vocab_size_divisible_by=64)
LATENCY, BANDWIDTH = 20e-6, 1e9
_FILES = itertools.count()


def timings(scope: str, ranks: int) -> list[CollectiveTiming]:
    out = []
    for op in ("all_reduce", "all_gather", "send_recv"):
        r = 2 if op == "send_recv" else ranks
        for nbytes in (1 << 12, 1 << 16, 1 << 20):
            steps, share = ring_factors(op, r)
            out.append(CollectiveTiming(op, scope, r, nbytes, steps * LATENCY + share * nbytes / BANDWIDTH))
    return out


def _timed_shapes() -> set[tuple[int, int, int, int, str]]:
    # Every GEMM of a tp=1, mbs=1 layout, forward and backward.
    gemms = [*layer_gemms(MODEL, micro_batch_size=1), logits_gemm(MODEL, micro_batch_size=1)]
    shapes = {(g.m, g.n, g.k, g.batch, FORWARD_LAYOUT) for g in gemms}
    return shapes | {s for g in gemms for s in backward_gemm_shapes(g)}


def calibration(tmp_path: Path) -> Path:
    # Every GEMM of a tp=1, mbs=1 layout, forward and backward, timed at 1 ms.
    timed = [GemmTiming(m, n, k, b, "fp32", 1e-3, layout) for m, n, k, b, layout in sorted(_timed_shapes())]
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


def test_a_collective_the_backend_runs_as_another_is_priced_as_measured(tmp_path: Path) -> None:
    # gloo's reduce-scatter is an all-reduce and a copy: timed as such, it costs twice its half-ring
    # figure, which sequence parallelism pays twice per layer; the one fit keeps the other collectives'.
    rs = [CollectiveTiming("reduce_scatter", "intra", 2, t.nbytes, t.seconds) for t in timings("intra", 2)
          if t.op == "all_reduce"]  # fmt: skip
    cal = Calibration(
        version=CALIBRATION_VERSION, hardware="cpu", host="h", device="cpu x1", measured_at="now", torch="2.13",
        nodes=load_calibration(str(calibration(tmp_path))).nodes, collectives=timings("intra", 2) + rs,
    )
    path = cal.write(tmp_path / "gloo.json")
    link = links(str(path))["intra"]
    # Each collective priced at its own measured times (the largest message, where bandwidth rules).
    for t in cal.collectives:
        if t.nbytes == 1 << 20:
            assert link.seconds(t.op, t.ranks, t.nbytes) == pytest.approx(t.seconds, rel=0.1), t
    assert link.seconds("reduce_scatter", 2, 1 << 20) > 1.8 * link.seconds("all_gather", 2, 1 << 20)
    model = replace(MODEL, num_attention_heads=2)
    hw = HardwareConfig(peak_measured=True, devices_per_node=2, calibration=str(path))
    sp, plain = (ParallelismConfig(tp=2, micro_batch_size=1, global_batch_size=1, precision=Precision.fp32,
                                   sequence_parallel=on) for on in (True, False))  # fmt: skip
    activation = model.seq_length * model.hidden_size * 4
    # Megatron's f / g operators: four per layer and one at the head; each an all-reduce, or under
    # sequence parallel a reduce-scatter and an all-gather.
    sp_op = link.seconds("reduce_scatter", 2, activation) + link.seconds("all_gather", 2, activation)
    plain_op = link.seconds("all_reduce", 2, activation)
    gap = predict_time(model, sp, hw, dp=1).parts["tp_comm"] - predict_time(model, plain, hw, dp=1).parts["tp_comm"]
    assert sp_op > 1.4 * plain_op
    assert gap == pytest.approx((4 * model.num_layers + 1) * (sp_op - plain_op))


def test_the_file_round_trips_and_another_version_is_refused(tmp_path: Path) -> None:
    path = calibration(tmp_path)
    cal = load_calibration(str(path))
    assert cal.nodes[0].gemms[0].seconds == 1e-3 and len(cal.collectives) == 9
    old = tmp_path / "old.json"
    old.write_text(path.read_text().replace(f'"version": {CALIBRATION_VERSION}', '"version": 0'))
    with pytest.raises(ValueError, match="version 0"):
        load_calibration(str(old))
    # A file of this version missing a field is refused naming it, not left to a TypeError.
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "hardware"}))
    with pytest.raises(ValueError, match="partial.json.*missing.*'hardware'"):
        load_calibration(str(partial))


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


def test_a_file_measured_on_other_hardware_is_refused(tmp_path: Path) -> None:
    # An H100's file on an A100 was ranked as the A100's, at a predicted MFU of 148%.
    hw = HardwareConfig(name="a100_80gb", peak_measured=True, devices_per_node=2, calibration=str(calibration(tmp_path)))
    layout = ParallelismConfig(micro_batch_size=1, global_batch_size=1, precision=Precision.fp32)
    with pytest.raises(UnknownHardwareFigure, match="hardware.calibration=.*measured on hardware 'cpu'.*'a100_80gb'"):
        predict_time(MODEL, layout, hw, dp=1)


def test_an_untimed_shape_runs_at_its_class_measured_fraction(tmp_path: Path) -> None:
    hw = HardwareConfig(peak_measured=True, devices_per_node=2, calibration=str(calibration(tmp_path)))
    one = ParallelismConfig(micro_batch_size=1, global_batch_size=1, precision=Precision.fp32)
    p1 = predict_time(MODEL, one, hw, dp=1)
    # mbs=2 was not timed. Each of its GEMMs differs from a timed one in one dimension (the tokens m,
    # the batch of heads, or dW's inner k), doubled. The attention GEMMs' batch of heads fills no
    # more of a tile: at the timed rate, twice the time.
    p2 = predict_time(MODEL, replace(one, micro_batch_size=2, global_batch_size=2), hw, dp=1)
    assert p2.parts["attention"] == pytest.approx(2 * p1.parts["attention"])
    # The dense ones at most twice: a 32-token m fills half a 64-row tile, 64 tokens all of it.
    assert p1.parts["gemm"] < p2.parts["gemm"] <= 2 * p1.parts["gemm"]
    # The old fallback, the best measured rate (the logits' dX GEMM, the most FLOPs in 1 ms), would
    # have priced the attention GEMMs, timed at an eighth of it, eight times too fast.
    best = max(2 * m * n * k * b / 1e-3 for m, n, k, b, _ in _timed_shapes())
    scores = next(g for g in layer_gemms(MODEL, micro_batch_size=2) if g.name == "attn_scores")
    at_best = MODEL.num_layers * 2 * 3 * scores.flops / best
    assert p2.parts["attention"] == pytest.approx(8 * at_best)
    # At seq 64 every attention GEMM differs from each timed one in two dimensions (m and n, or m
    # and k): no class, so the best rate x its tile efficiency, and a launch overhead.
    longer = replace(MODEL, seq_length=64)
    core = [g for g in layer_gemms(longer, micro_batch_size=1) if g.name in {"attn_scores", "attn_values"}]
    shapes = [s for g in core for s in ((g.m, g.n, g.k, g.batch, FORWARD_LAYOUT), *backward_gemm_shapes(g))]
    fallback = sum(2 * m * n * k * b / (best * _quantized(m, n, k, b, None, alignment_elements(Precision.fp32))[1]) + 7e-6
                   for m, n, k, b, _ in shapes)  # fmt: skip
    assert predict_time(longer, one, hw, dp=1).parts["attention"] == pytest.approx(MODEL.num_layers * fallback)


def test_an_untimed_shape_never_runs_above_the_best_measured_rate(tmp_path: Path) -> None:
    # The best rate's own GEMM at four times the tokens fills its tiles better than the timed one;
    # its class's fraction x that efficiency exceeds 1, and the rate stays at the best measured.
    hw = HardwareConfig(peak_measured=True, devices_per_node=2, calibration=str(calibration(tmp_path)))
    mach = _machine_cached(hw, Precision.fp32, 1)
    best = max(2 * m * n * k * b / 1e-3 for m, n, k, b, _ in _timed_shapes())
    assert mach.flops == pytest.approx(best)
    gemms = [*layer_gemms(MODEL, micro_batch_size=4), logits_gemm(MODEL, micro_batch_size=4)]
    shapes = {(g.m, g.n, g.k, g.batch, FORWARD_LAYOUT) for g in gemms} | {s for g in gemms for s in backward_gemm_shapes(g)}
    rates = [2 * m * n * k * b / _one_gemm(m, n, k, b, layout, mach, Precision.fp32) for m, n, k, b, layout in shapes]
    assert max(rates) == pytest.approx(best)


def with_attention(tmp_path: Path, *timings: AttentionTiming) -> HardwareConfig:
    cal = load_calibration(str(calibration(tmp_path)))
    # A new name each time: files are memoised by path.
    name = f"sdpa{next(_FILES)}.json"
    out = replace(cal, nodes=[replace(cal.nodes[0], attention=list(timings))]).write(tmp_path / name)
    return HardwareConfig(peak_measured=True, devices_per_node=2, calibration=str(out))


def test_a_timed_attention_core_is_what_megasweep_stacks_pay(tmp_path: Path) -> None:
    # SDPA timed at mbs 1, tp 1 (2 sequences x heads): 5 ms forward, 7 ms backward.
    hw = with_attention(tmp_path, AttentionTiming(1, 2, 32, 32, True, "fp32", 5e-3, 7e-3))
    layout = ParallelismConfig(micro_batch_size=1, global_batch_size=1, precision=Precision.fp32)
    assert predict_time(MODEL, layout, hw, dp=1).parts["attention"] == pytest.approx(2 * 12e-3)
    # mbs 2 ran 4 sequences x heads: twice the timed one's work; tp 2 half of it.
    mbs2 = replace(layout, micro_batch_size=2, global_batch_size=2)
    assert predict_time(MODEL, mbs2, hw, dp=1).parts["attention"] == pytest.approx(2 * 24e-3)
    assert predict_time(MODEL, replace(layout, tp=2), hw, dp=1).parts["attention"] == pytest.approx(2 * 6e-3)
    # On a GPU the GEMM rule halves a causal core (FlashAttention skips the masked half); a timed
    # core is what it measured.
    cuda = replace(hw, device_type="cuda")
    assert predict_time(MODEL, layout, cuda, dp=1).parts["attention"] == pytest.approx(2 * 12e-3)
    # Selective recompute runs the core's forward again.
    selective = predict_time(MODEL, replace(layout, recompute=Recompute.selective), hw, dp=1)
    assert selective.parts["recompute"] == pytest.approx(2 * 5e-3)
    # Megatron-DeepSpeed's explicit core (baddbmm, softmax) runs no SDPA: its timed GEMMs (1 ms each).
    megatron = predict_time(MODEL, layout, hw, dp=1, stack=Stack.megatron_deepspeed)
    assert megatron.parts["attention"] == pytest.approx(2 * 2 * 3e-3)
    # Another sequence length, causality or precision: the GEMMs again.
    plain = HardwareConfig(peak_measured=True, devices_per_node=2, calibration=str(calibration(tmp_path)))
    longer = replace(MODEL, seq_length=64)
    gemm_rule = predict_time(longer, layout, plain, dp=1).parts["attention"]
    assert predict_time(longer, layout, hw, dp=1).parts["attention"] == pytest.approx(gemm_rule)
    bidirectional = with_attention(tmp_path, AttentionTiming(1, 2, 32, 32, False, "fp32", 5e-3, 7e-3))
    assert predict_time(MODEL, layout, bidirectional, dp=1).parts["attention"] == pytest.approx(2 * 2 * 3e-3)


def test_another_head_size_takes_the_nearest_timed_one_at_the_same_kernel_work(tmp_path: Path) -> None:
    # MODEL's heads are 32 wide; the file timed heads of 40 and 128 (another model's), 2 rows each,
    # proportional from one count: 2 ms forward and 4 ms backward per row of 40.
    hw = with_attention(tmp_path, AttentionTiming(1, 2, 32, 40, True, "fp32", 4e-3, 8e-3),
                        AttentionTiming(1, 2, 32, 128, True, "fp32", 1.0, 1.0))  # fmt: skip
    layout = ParallelismConfig(micro_batch_size=1, global_batch_size=1, precision=Precision.fp32)
    # A CPU's kernel loops over the head: MODEL's 2 rows of 32 are the work of 1.6 rows of 40.
    assert predict_time(MODEL, layout, hw, dp=1).parts["attention"] == pytest.approx(MODEL.num_layers * 1.6 * 6e-3)
    # FlashAttention-2 pads 40 to 64 and runs 32 as is: 2 rows of 32 are one padded row of 40.
    cuda = replace(hw, device_type="cuda")
    assert predict_time(MODEL, layout, cuda, dp=1).parts["attention"] == pytest.approx(MODEL.num_layers * 6e-3)
    # Past 192 FlashAttention-2 runs its 256 kernel.
    assert _kernel_head(200, "cuda") == 256 and _kernel_head(200, "cpu") == 200 and _kernel_head(96, "cuda") == 96


def test_untimed_attention_counts_lie_on_the_line_through_the_nearest_timed_ones(tmp_path: Path) -> None:
    # Forward 1 ms + 0.5 ms per row from 2 to 4 rows, then 2 ms more to 8 (its fixed cost shows at the
    # low counts, as on a GPU the kernel does not fill); backward twice that. mbs 1, 2 and 4 at tp 1.
    hw = with_attention(tmp_path, AttentionTiming(1, 2, 32, 32, True, "fp32", 2e-3, 4e-3),
                        AttentionTiming(2, 2, 32, 32, True, "fp32", 3e-3, 6e-3),
                        AttentionTiming(4, 2, 32, 32, True, "fp32", 5e-3, 10e-3))  # fmt: skip

    def per_layer(tp: int, mbs: int) -> float:
        layout = ParallelismConfig(tp=tp, micro_batch_size=mbs, global_batch_size=mbs, precision=Precision.fp32)
        return predict_time(MODEL, layout, hw, dp=1).parts["attention"] / MODEL.num_layers

    assert per_layer(1, 2) == pytest.approx(9e-3)  # timed
    assert per_layer(2, 3) == pytest.approx(7.5e-3)  # 3 rows: halfway between 2 and 4 rows
    assert per_layer(1, 3) == pytest.approx(12e-3)  # 6 rows: halfway between 4 and 8
    # 16 rows: along the last line (0.5 ms a row forward, 1 ms backward), not 8 ms x 16 / 8.
    assert per_layer(1, 8) == pytest.approx(3 * (5e-3 + 8 * 0.5e-3))
    # 1 row: along the first line (2 ms - 0.5 ms), at least a proportional share of the 2-row time.
    assert per_layer(2, 1) == pytest.approx(3 * 1.5e-3)
    # A line steeper than proportional (no fixed cost) is held to proportional going up, and a
    # falling one never makes more rows faster.
    steep = with_attention(tmp_path, AttentionTiming(1, 2, 32, 32, True, "fp32", 1e-3, 2e-3),
                           AttentionTiming(2, 2, 32, 32, True, "fp32", 4e-3, 8e-3))  # fmt: skip
    layout = ParallelismConfig(micro_batch_size=4, global_batch_size=4, precision=Precision.fp32)
    assert predict_time(MODEL, layout, steep, dp=1).parts["attention"] == pytest.approx(2 * 2 * 12e-3)
    falling = with_attention(tmp_path, AttentionTiming(1, 2, 32, 32, True, "fp32", 2e-3, 4e-3),
                             AttentionTiming(2, 2, 32, 32, True, "fp32", 1e-3, 2e-3))  # fmt: skip
    assert predict_time(MODEL, layout, falling, dp=1).parts["attention"] == pytest.approx(2 * 3e-3)
    # The same count timed twice (mbs 2 at tp 2 and mbs 1 at tp 1: 2 rows each): their mean.
    twice = with_attention(tmp_path, AttentionTiming(1, 2, 32, 32, True, "fp32", 2e-3, 4e-3),
                           AttentionTiming(2, 1, 32, 32, True, "fp32", 4e-3, 8e-3))  # fmt: skip
    one = ParallelismConfig(micro_batch_size=1, global_batch_size=1, precision=Precision.fp32)
    assert predict_time(MODEL, one, twice, dp=1).parts["attention"] == pytest.approx(2 * 9e-3)


def test_a_link_the_file_did_not_fit_keeps_the_hardware_figures(tmp_path: Path) -> None:
    # `calibrate --here` times no collective: a tp=2 layout's all-reduces then run over the hardware
    # config's intra-node link, not "unknown". Here that link is the one the full file fits (20 us a
    # ring step, 1 GB/s), so both files predict the same step.
    full = calibration(tmp_path)
    here = replace(load_calibration(str(full)), collectives=[]).write(tmp_path / "here.json")
    sheet = HardwareConfig(peak_measured=True, devices_per_node=2, intra_node_bw_gbs=BANDWIDTH / 1e9,
                           intra_node_comm_efficiency=1.0, comm_latency_us=LATENCY * 1e6)  # fmt: skip
    tp2 = ParallelismConfig(tp=2, micro_batch_size=1, global_batch_size=1, precision=Precision.fp32)
    fitted = predict_time(MODEL, tp2, replace(sheet, calibration=str(full)), dp=1)
    kept = predict_time(MODEL, tp2, replace(sheet, calibration=str(here)), dp=1)
    assert kept.parts["tp_comm"] > 0 and kept.parts == pytest.approx(fitted.parts)
    # Without the figure either, the layout stays unpredictable, naming it.
    with pytest.raises(UnknownHardwareFigure, match="intra_node_bw_gbs"):
        predict_time(MODEL, tp2, replace(sheet, calibration=str(here), intra_node_bw_gbs=None), dp=1)


def test_the_dp_reduction_hides_behind_the_backward_gemms_and_attention(tmp_path: Path) -> None:
    # Every GEMM timed at 1 ms (a layer: 4 dense forward, 8 backward; the head's logits 1 + 2) and
    # SDPA at 5 ms forward, 7 ms backward. The gradients cross a 1 MB/s link, which nothing hides.
    sdpa = with_attention(tmp_path, AttentionTiming(1, 2, 32, 32, True, "fp32", 5e-3, 7e-3))
    assert sdpa.calibration is not None
    here = replace(load_calibration(sdpa.calibration), collectives=[]).write(tmp_path / "slow_link.json")
    slow = HardwareConfig(peak_measured=True, devices_per_node=2, intra_node_bw_gbs=1e-3,
                          comm_latency_us=LATENCY * 1e6, calibration=str(here))  # fmt: skip
    layout = ParallelismConfig(micro_batch_size=1, global_batch_size=2, precision=Precision.fp32)
    gpu = predict_time(MODEL, layout, replace(slow, device_type="cuda"), dp=2)
    cpu = predict_time(MODEL, layout, replace(slow, device_type="cpu"), dp=2)
    assert gpu.parts["dp_comm"] > 0
    # On a GPU NCCL reduces while the last micro-batch's backward runs: the backward GEMMs and SDPA's
    # backward (34 ms if it were 2/3 of the GEMMs and attention, as the model once took it).
    hidden = cpu.parts["dp_comm"] - gpu.parts["dp_comm"]
    assert hidden == pytest.approx(MODEL.num_layers * (8e-3 + 7e-3) + 2e-3)


def test_a_calibration_from_before_the_attention_timings_still_reads(tmp_path: Path) -> None:
    path = calibration(tmp_path)
    data = json.loads(path.read_text())
    for node in data["nodes"]:
        del node["attention"]
    path.write_text(json.dumps(data))
    assert load_calibration(str(path)).nodes[0].attention == []


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


def test_ranks_that_share_cores_hide_the_pipeline_bubble(tmp_path: Path) -> None:
    # The local cluster's two emulated nodes share one host: the calibration's two-node job ran 4 tasks
    # on 2 cores, half a core each. A pp rank that waits (in the bubble, or on a stage with less work)
    # leaves its core to the others, so the step takes the host's mean work at the shared speed, or the
    # critical path at an unshared rank's speed if that is longer (measured on the local cluster: dp=2
    # pp=2 vpp=2 on two nodes ran 28-39% faster than with the whole bubble counted).
    one = load_calibration(str(calibration(tmp_path)))
    # What the two-node job timed itself (short trials, its slowest rank below its share) is not used.
    slow = [replace(g, seconds=3 * g.seconds) for g in one.nodes[0].gemms]
    two = replace(one.nodes[0], nodes=2, gemms=slow, core_share=0.5, nodes_per_host=2)
    shared = replace(one, nodes=[one.nodes[0], two], collectives=[*one.collectives, *timings("inter", 4)])
    path = shared.write(tmp_path / "shared.json")
    hw = HardwareConfig(peak_measured=True, devices_per_node=2, calibration=str(path))
    assert _machine_cached(hw, Precision.fp32, 2).core_share == pytest.approx(0.5)
    assert _machine_cached(hw, Precision.fp32, 1).core_share == 1.0
    # The one-node job's figures, each rank on half a core.
    own = node_timing(shared, 1)
    half = node_timing(shared, 2)
    assert own is not None and half is not None and (half.nodes, half.core_share, half.nodes_per_host) == (2, 0.5, 2)
    assert [g.seconds for g in half.gemms] == [2 * g.seconds for g in own.gemms]
    assert half.memory_bw_gbs == own.memory_bw_gbs / 2 and half.op_overhead_us == 2 * own.op_overhead_us
    assert gemm_table(str(path), 2) == {key: 2 * s for key, s in gemm_table(str(path), 1).items()}
    # Where both jobs sustained the largest GEMM, their ratio is the share (switching between ranks
    # costs), never above the count; where either did not, the count.
    sustained = [replace(one.nodes[0], sustained_tflops=0.1), replace(two, sustained_tflops=0.04)]
    assert node_timing(replace(shared, nodes=sustained), 2).core_share == pytest.approx(0.4)  # type: ignore[union-attr]
    above = [sustained[0], replace(two, sustained_tflops=0.07)]
    assert node_timing(replace(shared, nodes=above), 2).core_share == 0.5  # type: ignore[union-attr]
    unmeasured = [sustained[0], two]
    assert node_timing(replace(shared, nodes=unmeasured), 2).core_share == 0.5  # type: ignore[union-attr]
    slower = node_timing(replace(shared, nodes=sustained), 2)
    assert slower is not None and [g.seconds for g in slower.gemms] == pytest.approx([g.seconds / 0.4 for g in own.gemms])
    layout = ParallelismConfig(pp=2, micro_batch_size=1, global_batch_size=2, precision=Precision.fp32)
    on_one = predict_time(MODEL, layout, hw, dp=1)  # 2 devices: one node, each rank owns its core
    assert on_one.parts["bubble"] == pytest.approx(max(on_one.stage_seconds))
    on_two = predict_time(MODEL, layout, hw, dp=2)  # 4 devices: two nodes, one micro-batch per rank
    first, last = on_two.stage_seconds
    assert last > first  # the last stage computes the logits
    # The critical path, (1 micro-batch + 1 slot) of the last stage at the unshared speed, is that
    # stage's work at the shared speed: beyond the mean of the host's stages by half their difference.
    assert on_two.parts["bubble"] == pytest.approx((last - first) / 2)
    assert on_two.parts["gemm"] < on_one.parts["gemm"]  # the two stages' mean, not the last one's
    assert on_two.sec_per_iter - on_two.parts["dp_comm"] - on_two.parts["optimizer"] == pytest.approx(last)
    deep = replace(MODEL, num_layers=4)
    four = predict_time(deep, replace(layout, pp=4, global_batch_size=1), hw, dp=1)  # 3 slots, 1 micro-batch
    mean = sum(four.stage_seconds) / 4
    assert four.parts["bubble"] == pytest.approx((1 + 3) * max(four.stage_seconds) * 0.5 - mean)
    # Nodes on hosts of their own (a real cluster's, oversubscribed): a host holds one stage's ranks, so
    # the last stage's host does its own work at the shared speed; the critical path adds nothing.
    apart = replace(shared, nodes=[one.nodes[0], replace(two, nodes_per_host=1)]).write(tmp_path / "apart.json")
    real = predict_time(MODEL, layout, replace(hw, calibration=str(apart)), dp=2)
    assert real.parts["bubble"] == pytest.approx(0.0) and real.parts["gemm"] > on_two.parts["gemm"]
    assert real.sec_per_iter - real.parts["dp_comm"] - real.parts["optimizer"] == pytest.approx(last)


@pytest.mark.parametrize(
    ("edit", "words"),
    [(lambda d: d["nodes"][0]["gemms"][0].update(seconds=0), r"nodes\[0\]\.gemms\[0\]\.seconds=0 must be a number above 0"),
     (lambda d: d["nodes"][0]["gemms"][1].update(seconds=-1.0), r"nodes\[0\]\.gemms\[1\]\.seconds=-1\.0 must be a number above 0"),
     (lambda d: d["nodes"][0]["gemms"][0].update(m="64"), r"nodes\[0\]\.gemms\[0\]\.m='64' must be a number above 0"),
     (lambda d: d["nodes"][0].update(nodes="one"), r"nodes\[0\]\.nodes='one' must be a number above 0"),
     (lambda d: d["collectives"][2].update(seconds=None), r"collectives\[2\]\.seconds=None must be a number above 0")],
)  # fmt: skip
def test_a_figure_that_is_no_measurement_is_refused_naming_it(edit: Any, words: str, tmp_path: Path) -> None:
    # A hand-edited or damaged file: a GEMM of 0 seconds ended `analysis.calc predict=true` in a
    # ZeroDivisionError traceback (the search said only "division by zero", naming no file), a string
    # in "unsupported operand type(s)", and -1 s was priced as a negative time without a word.
    data = json.loads(calibration(tmp_path).read_text())
    edit(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"bad.json' is not a calibration file of version 1: {words}; measure again"):
        load_calibration(str(bad))


def test_a_cpu_calibration_of_other_ranks_per_node_is_advised_against(tmp_path: Path) -> None:
    # cpu.yaml's 8 devices a node beside a file measured with 2 ranks a node: each of 8 ranks was priced
    # at the speed one of 2 measured (its share of the cores), and a search ranked impossible nodes first.
    from conf.schema import RunConfig
    from train.planner.rules import ADVISORIES, advise

    path = str(calibration(tmp_path))  # measured with tasks_per_node=2
    notes = advise(RunConfig(hardware=HardwareConfig(devices_per_node=8, calibration=path)))
    said = [n for n in notes if n.rule == "calibration_ranks_per_node"]
    assert len(said) == 1 and "calibration_ranks_per_node" in ADVISORIES
    assert said[0].fields == {"hardware.devices_per_node": 8, "hardware.calibration": path}
    assert str(said[0]).startswith(f"[calibration_ranks_per_node] hardware.devices_per_node=8 but hardware.calibration={path!r} "
                                   "was measured with 2 rank(s) per node")
    assert "Set hardware.devices_per_node=2" in said[0].message
    # The calibrated count, a GPU (its speed is its own, whatever its neighbours), a file the time model
    # cannot read (it says why itself) and no file: nothing to say.
    for hw in (HardwareConfig(devices_per_node=2, calibration=path),
               HardwareConfig(name="h100_sxm", device_type="cuda", devices_per_node=8, calibration=path),
               HardwareConfig(devices_per_node=8, calibration=str(tmp_path / "missing.json")),
               HardwareConfig(devices_per_node=8)):  # fmt: skip
        assert not [n for n in advise(RunConfig(hardware=hw)) if n.rule == "calibration_ranks_per_node"], hw
