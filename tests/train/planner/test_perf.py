"""train.planner.perf, the time model: each part by hand on small shapes, its physics (more bandwidth
is never slower, the bubble is (p-1) slots of the slowest stage), and two published tables of measured
seconds per iteration that nothing in the model was fitted to: BLOOM's (seed 001) and MPT's (seed 002).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from dataclasses import replace

import pytest

from conf.schema import Engine, HardwareConfig, ModelConfig, Offload, ParallelismConfig, Precision, Recompute
from train.planner.flops import layer_gemms, logits_gemm
from train.planner.memory import Stack
from train.planner.perf import PARTS, TimePrediction, UnknownHardwareFigure, predict_time
from train.planner.sizes import total_params

from .test_memory import load_hardware

# Every GEMM dimension a multiple of 256 and no SM count: tile and wave efficiency are exactly 1,
# so a GEMM takes FLOPs / (peak x gemm_efficiency) + the kernel overhead.
MODEL = ModelConfig(name="m", num_layers=4, hidden_size=512, num_attention_heads=4, seq_length=256,
                    vocab_size=1024, make_vocab_size_divisible_by=256)
HW = HardwareConfig(name="h", device_type="cuda", peak_tflops_bf16=100.0, peak_tflops_fp32=100.0, num_sms=None, memory_gib=80,
                    devices_per_node=8, intra_node_bw_gbs=100.0, inter_node_bw_gbs=80.0, memory_bw_gbs=1000.0,
                    gemm_efficiency=0.5, memory_bw_efficiency=1.0, intra_node_comm_efficiency=1.0,
                    inter_node_comm_efficiency=1.0, comm_latency_us=0.0, kernel_overhead_us=0.0)
FLOPS = 100e12 * 0.5


def par(**kw: object) -> ParallelismConfig:
    base: dict[str, object] = dict(micro_batch_size=2, global_batch_size=2, precision=Precision.bf16)
    base.update(kw)
    return ParallelismConfig(**base)  # type: ignore[arg-type]


def test_parts_sum_to_the_total_and_are_named() -> None:
    p = predict_time(MODEL, par(tp=2, pp=2, global_batch_size=8, recompute=Recompute.full), HW, dp=2)
    assert set(p.parts) == set(PARTS)
    assert p.sec_per_iter == pytest.approx(sum(p.parts.values()))
    assert all(v >= 0 for v in p.parts.values())


def test_gemms_are_flops_over_the_achieved_rate_backward_twice() -> None:
    p = predict_time(MODEL, par(), HW, dp=1)
    gemms = layer_gemms(MODEL, micro_batch_size=2)
    dense = sum(g.flops for g in gemms if g.name in ("qkv", "attn_proj", "mlp_in", "mlp_out"))
    core = sum(g.flops for g in gemms if g.name in ("attn_scores", "attn_values"))
    logits = logits_gemm(MODEL, micro_batch_size=2).flops
    assert p.parts["gemm"] == pytest.approx(3 * (4 * dense + logits) / FLOPS)
    # SDPA on a GPU skips the masked half of a causal score matrix.
    assert p.parts["attention"] == pytest.approx(3 * 4 * core / FLOPS / 2)
    explicit = predict_time(MODEL, par(), HW, dp=1, stack=Stack.megatron_deepspeed)
    assert explicit.parts["attention"] == pytest.approx(2 * p.parts["attention"])


def test_fused_attention_runs_at_the_hardwares_attention_efficiency_in_16_bit_only() -> None:
    fused = replace(HW, attention_efficiency=0.25)
    core = sum(g.flops for g in layer_gemms(MODEL, micro_batch_size=2) if g.name in ("attn_scores", "attn_values"))
    # Half the causal scores; forward once, backward 2.5 times its FLOPs (it recomputes the scores).
    p = predict_time(MODEL, par(), fused, dp=1)
    assert p.parts["attention"] == pytest.approx(4 * 3.5 * core / 2 / (100e12 * 0.25))
    # FlashAttention takes no fp32 operands, and Megatron's explicit core is two batched GEMMs: the GEMM rule.
    for layout, stack in ((par(precision=Precision.fp32), None), (par(), Stack.megatron_deepspeed)):
        assert predict_time(MODEL, layout, fused, dp=1, stack=stack).parts["attention"] == pytest.approx(
            predict_time(MODEL, layout, HW, dp=1, stack=stack).parts["attention"]
        )


def test_tensor_parallel_all_reduces_by_hand() -> None:
    # tp=2 inside a node: per layer 4 all-reduces of b*s*h bf16 (2 x 256 x 512 x 2 B = 524,288 B),
    # a ring moves 2(t-1)/t of them at 100 GB/s; the embedding and the logits' input add one each.
    p = predict_time(MODEL, par(tp=2), HW, dp=1)
    one = 2 * (2 - 1) / 2 * 524288 / 100e9
    loss = 3 * 2 * (2 - 1) / 2 * (2 * 256 * 4) / 100e9
    assert p.parts["tp_comm"] == pytest.approx((4 * 4 + 2) * one + loss)
    # Across nodes (tp=16 > 8 per node) it runs at a device's share of the network: 80 / 8 GB/s.
    wide = replace(MODEL, num_attention_heads=16)
    assert predict_time(wide, par(tp=16), HW, dp=1).parts["tp_comm"] > 10 * p.parts["tp_comm"]


def test_sequence_parallel_shards_the_memory_bound_ops_and_keeps_the_tp_traffic() -> None:
    for layout in (dict(tp=2), dict(tp=4, global_batch_size=8, recompute=Recompute.full)):
        plain = predict_time(MODEL, par(**layout), HW, dp=1)
        sp = predict_time(MODEL, par(**layout, sequence_parallel=True), HW, dp=1)
        # Reduce-scatter + all-gather: the two halves of the ring all-reduce, the same bytes and time.
        assert sp.parts["tp_comm"] == pytest.approx(plain.parts["tp_comm"])
        assert sp.parts["memory_bound"] < plain.parts["memory_bound"]
        for part in ("gemm", "attention"):
            assert sp.parts[part] == pytest.approx(plain.parts[part])
    # By hand, tp=2 in bf16: per layer the two LayerNorms (2 elements moved each) and two residual
    # adds (3 each) run on s/t tokens; forward and a backward of twice the bytes: 3 passes; and the
    # final LayerNorm likewise. Nothing else changes.
    plain, sp = predict_time(MODEL, par(tp=2), HW, dp=1), predict_time(MODEL, par(tp=2, sequence_parallel=True), HW, dp=1)
    tokens, h, e = 2 * 256, 512, 2
    per_layer = 3 * (2 * 2 + 2 * 3) * tokens * h * e / 1000e9
    final_norm = 3 * 2 * tokens * h * e / 1000e9
    assert plain.parts["memory_bound"] - sp.parts["memory_bound"] == pytest.approx((4 * per_layer + final_norm) / 2)
    # A pipeline boundary carries one TP rank's tokens.
    piped = dict(tp=2, pp=2, global_batch_size=8)
    assert predict_time(MODEL, par(**piped, sequence_parallel=True), HW, dp=1).parts["pp_comm"] == pytest.approx(
        predict_time(MODEL, par(**piped), HW, dp=1).parts["pp_comm"] / 2
    )


def test_full_recompute_repeats_the_forward_and_selective_the_attention_core() -> None:
    none = predict_time(MODEL, par(), HW, dp=1)
    full = predict_time(MODEL, par(recompute=Recompute.full), HW, dp=1)
    selective = predict_time(MODEL, par(recompute=Recompute.selective), HW, dp=1)
    layer_gemm = none.parts["gemm"] - 3 * logits_gemm(MODEL, micro_batch_size=2).flops / FLOPS
    # The forward is a third of forward + backward (the head is not recomputed).
    assert full.parts["recompute"] > (layer_gemm + none.parts["attention"]) / 3
    assert selective.parts["recompute"] == pytest.approx(none.parts["attention"] / 3)
    assert none.parts["recompute"] == 0


def test_pipeline_bubble_is_p_minus_1_slots_of_the_slowest_stage() -> None:
    p = predict_time(MODEL, par(pp=2, global_batch_size=16), HW, dp=1)
    assert p.micro_batches == 8
    assert p.parts["bubble"] == pytest.approx(max(p.stage_seconds))
    steady = p.sec_per_iter - p.parts["bubble"] - p.parts["dp_comm"] - p.parts["optimizer"]
    assert steady == pytest.approx(8 * max(p.stage_seconds))
    # The last stage holds the logits: it is the slower one.
    assert p.stage_seconds[1] > p.stage_seconds[0]


def test_interleaving_divides_the_bubble_by_v_and_multiplies_the_exchanges() -> None:
    plain = predict_time(MODEL, par(pp=2, global_batch_size=16), HW, dp=1)
    inter = predict_time(MODEL, par(pp=2, virtual_stages=2, global_batch_size=16), HW, dp=1)
    # (p-1)/v slots of the slowest stage: (p-1)/(v*m) of the steady time (Narayanan et al. 2021).
    assert inter.parts["bubble"] == pytest.approx(max(inter.stage_seconds) / 2)
    steady = inter.sec_per_iter - inter.parts["bubble"] - inter.parts["dp_comm"] - inter.parts["optimizer"]
    assert steady == pytest.approx(8 * max(inter.stage_seconds))
    # Each micro-batch crosses each rank once per chunk: on two ranks, one boundary each way becomes
    # three (chunk 0 -> 0, chunk 0 -> 1 wrapping back to rank 0, chunk 1 -> 1), all in the node.
    assert inter.parts["pp_comm"] == pytest.approx(3 * plain.parts["pp_comm"])
    # With as many micro-batches as stages the bubble dominates, and interleaving wins.
    few = [predict_time(MODEL, par(pp=2, virtual_stages=v, global_batch_size=4), HW, dp=1) for v in (1, 2)]
    assert few[1].sec_per_iter < few[0].sec_per_iter


def test_data_parallel_reduction_hides_behind_backward_only_in_megasweep_on_a_gpu() -> None:
    big = replace(MODEL, hidden_size=2048, num_attention_heads=16)
    # fp32: both stacks then reduce 4-byte gradients, so only the overlap differs.
    layout = par(global_batch_size=4, micro_batch_size=1, precision=Precision.fp32)
    slow_net = replace(HW, intra_node_bw_gbs=1.0)
    megasweep = predict_time(big, layout, slow_net, dp=4)
    deepspeed = predict_time(big, replace(layout, engine=Engine.deepspeed), slow_net, dp=4)
    assert 0 <= megasweep.parts["dp_comm"] < deepspeed.parts["dp_comm"]
    assert predict_time(big, layout, slow_net, dp=1).parts["dp_comm"] == 0
    # On a CPU gloo reduces on the cores the compute fills: megasweep hides nothing either.
    cpu = replace(slow_net, device_type="cpu")
    assert predict_time(big, layout, cpu, dp=4).parts["dp_comm"] == pytest.approx(
        predict_time(big, replace(layout, engine=Engine.deepspeed), cpu, dp=4).parts["dp_comm"]
    )


def test_more_bandwidth_is_never_slower() -> None:
    layout = par(tp=4, pp=4, global_batch_size=64, zero_stage=1, recompute=Recompute.full)
    wide = replace(MODEL, num_layers=8)
    base = predict_time(wide, layout, HW, dp=4).sec_per_iter
    for field in ("intra_node_bw_gbs", "inter_node_bw_gbs", "memory_bw_gbs"):
        faster = replace(HW, **{field: 2 * getattr(HW, field)})
        assert predict_time(wide, layout, faster, dp=4).sec_per_iter < base, field


def test_offload_crosses_the_host_link() -> None:
    layout = par(engine="deepspeed", zero_stage=2, offload=Offload.optimizer)
    with pytest.raises(UnknownHardwareFigure, match="host_link_bw_gbs"):
        predict_time(MODEL, layout, HW, dp=1)
    p = predict_time(MODEL, layout, replace(HW, host_link_bw_gbs=10.0), dp=1)
    assert p.parts["offload"] > 0


def test_cpu_peak_is_unknown_to_the_planner() -> None:
    with pytest.raises(UnknownHardwareFigure, match="measures its peak at run time"):
        predict_time(MODEL, par(), load_hardware("cpu"), dp=1)


# ----------------------------------------------------------------------------- BLOOM (seed 001)
#
# Every row of seed 001 with a measured Sec/it: Megatron-DeepSpeed (2022), bf16, ZeRO-1 unless
# stated, full recompute, seq 2048, vocabulary 250,680, A100 80GB nodes of 8, iteration 2. Two rows
# are read from the notes' own arithmetic where a cell contradicts it: "187B" ran on 40 nodes with
# TP=8, PP=10, so DP=4 (its TFLOPs check out at 320 GPUs, not at the DP=8 of the cell); the 18B rows
# ran at GBS=512, as the heading says (the cells say 2048; their TFLOPs agree with 512).
#
# (table, hidden, layers, heads, zero, dp, tp, pp, mbs, gbs, measured sec/it)
H14400, H14336, H13824, H13312, H12288 = 14400, 14336, 13824, 13312, 12288
BLOOM_SEC_PER_ITER: list[tuple[str, int, int, int, int, int, int, int, int, int, float]] = [
 ("48 nodes", H14400, 80, 96, 1, 12, 8, 4, 1, 2040, 189.06),
 ("48 nodes", H14400, 80, 96, 1, 9, 8, 5, 1, 2043, 208.40),
 ("48 nodes", H14400, 78, 96, 1, 8, 8, 6, 1, 2048, 183.64),
 ("48 nodes", H14400, 77, 96, 1, 6, 8, 7, 1, 2046, 202.99),
 ("48 nodes", H14400, 80, 96, 1, 6, 8, 8, 1, 2046, 185.75),
 ("48 nodes", H14400, 81, 96, 1, 5, 8, 9, 1, 2045, 199.14),
 ("48 nodes", H14400, 80, 96, 1, 4, 8, 10, 1, 2048, 221.21),
 ("48 nodes", H14400, 77, 96, 1, 4, 8, 11, 1, 2048, 197.15),
 ("48 nodes", H14400, 72, 96, 1, 4, 8, 12, 1, 2048, 172.40),
 ("MBS 194B", H14400, 78, 96, 1, 8, 8, 6, 2, 2048, 172.36),
 ("MBS 194B", H14400, 78, 96, 1, 8, 8, 6, 4, 2048, 173.92),
 ("MBS 194B", H14400, 78, 96, 1, 8, 8, 6, 8, 2048, 192.42),
 ("MBS 200B", H14400, 80, 96, 1, 4, 8, 10, 2, 2048, 207.92),
 ("MBS 200B", H14400, 80, 96, 1, 4, 8, 10, 4, 2048, 208.18),
 ("MBS 200B", H14400, 80, 96, 1, 4, 8, 10, 8, 2048, 229.69),
 ("MBS 195B", H14400, 77, 96, 1, 4, 8, 11, 2, 2048, 186.65),
 ("MBS 195B", H14400, 77, 96, 1, 4, 8, 11, 4, 2048, 185.79),
 ("MBS 195B", H14400, 77, 96, 1, 4, 8, 11, 8, 2048, 206.62),
 ("MBS 183B", H14400, 72, 96, 1, 4, 8, 12, 2, 2048, 161.96),
 ("MBS 183B", H14400, 72, 96, 1, 4, 8, 12, 4, 2048, 163.32),
 ("NHIDDEN", H13824, 80, 96, 1, 4, 8, 10, 1, 2048, 160.29),
 ("NHIDDEN", H13824, 80, 96, 1, 4, 8, 10, 2, 2048, 151.07),
 ("NHIDDEN", H13824, 80, 96, 1, 4, 8, 10, 4, 2048, 147.43),
 ("NHIDDEN", H13824, 80, 96, 1, 4, 8, 10, 8, 2048, 152.51),
 ("contenders 181B", H14336, 72, 64, 1, 4, 8, 12, 1, 2048, 143.31),
 ("contenders 181B", H14336, 72, 64, 1, 4, 8, 12, 2, 2048, 134.02),
 ("contenders 181B", H14336, 72, 64, 1, 4, 8, 12, 4, 2048, 123.69),
 ("contenders 181B", H14336, 72, 64, 1, 4, 8, 12, 8, 2048, 129.26),
 ("contenders 181B", H14336, 72, 64, 1, 8, 8, 6, 1, 2048, 139.82),
 ("contenders 181B", H14336, 72, 64, 1, 8, 8, 6, 2, 2048, 131.02),
 ("contenders 181B", H14336, 72, 64, 1, 8, 8, 6, 4, 2048, 121.48),
 ("contenders 196B", H13824, 84, 64, 1, 4, 8, 12, 2, 2048, 143.89),
 ("contenders 196B", H13824, 84, 64, 1, 4, 8, 12, 4, 2048, 133.12),
 ("contenders 196B", H13824, 84, 64, 1, 8, 8, 6, 2, 2048, 141.41),
 ("contenders 196B", H13824, 84, 64, 1, 8, 8, 6, 4, 2048, 130.31),
 ("187B pp10", H13824, 80, 64, 1, 4, 8, 10, 4, 2048, 147.04),
 ("max 18B", H14336, 6, 64, 1, 1, 8, 1, 2, 512, 130.43),
 ("max 18B", H14336, 6, 64, 1, 1, 8, 1, 2, 512, 119.19),
 ("max 18B", H14336, 10, 64, 1, 1, 8, 1, 1, 512, 205.52),
 ("ZeRO", H14336, 72, 64, 1, 4, 8, 12, 2, 2048, 120.29),
 ("ZeRO", H14336, 72, 64, 0, 4, 8, 12, 2, 2048, 137.34),
 ("final", H14336, 72, 64, 1, 4, 8, 12, 4, 2048, 123.79),
 ("final", H14336, 72, 64, 1, 8, 8, 6, 4, 2048, 120.85),
 ("final", H13312, 84, 64, 1, 4, 8, 12, 4, 2048, 125.52),
 ("final", H13312, 84, 64, 1, 8, 8, 6, 2, 2048, 135.55),
 ("final", H13312, 84, 64, 1, 8, 8, 6, 4, 2048, 122.93),
 ("final", H13824, 78, 64, 1, 8, 8, 6, 4, 2048, 121.28),
 ("final", H12288, 96, 64, 1, 8, 8, 6, 2, 2048, 136.73),
 ("final", H12288, 96, 64, 1, 8, 8, 6, 4, 2048, 122.96),
 ("NHEADS", H14336, 72, 16, 1, 8, 8, 6, 4, 2048, 121.03),
 ("NHEADS", H14336, 72, 32, 1, 8, 8, 6, 4, 2048, 124.01),
 ("NHEADS", H14336, 72, 64, 1, 8, 8, 6, 4, 2048, 120.18),
 ("NHEADS", H14336, 72, 112, 1, 8, 8, 6, 4, 2048, 138.72),
 ("NHEADS", H14336, 72, 128, 1, 8, 8, 6, 4, 2048, 124.89),
 ("NHEADS", H14336, 72, 256, 1, 8, 8, 6, 4, 2048, 132.85),
 ("GBS", H14336, 72, 64, 1, 8, 8, 6, 4, 1568, 113.01),
 ("GBS", H14336, 72, 64, 1, 8, 8, 6, 4, 2048, 114.11),
 ("GBS", H14336, 72, 64, 1, 8, 8, 6, 6, 2016, 123.57),
 ("GBS", H14336, 72, 64, 1, 4, 8, 12, 4, 1568, 92.75),
 ("GBS", H14336, 72, 64, 1, 4, 8, 12, 4, 2048, 117.07),
 ("GBS", H14336, 72, 64, 1, 4, 8, 12, 2, 1568, 99.93),
 ("GBS", H14336, 72, 64, 1, 4, 8, 12, 2, 2048, 128.82),
 ("lower PP", H14336, 72, 64, 1, 6, 8, 8, 4, 2016, 113.16),
 ("lower PP", H14336, 72, 64, 1, 12, 8, 4, 2, 2016, 125.52),
 ("lower PP", H14336, 72, 64, 1, 12, 8, 4, 4, 2016, 114.81),
 ("lower PP", H14336, 72, 64, 1, 24, 8, 2, 1, 2016, 145.45),
 ("lower PP", H14336, 72, 64, 1, 24, 8, 2, 2, 2016, 136.13),
 ("TP", H14336, 72, 64, 1, 8, 4, 12, 4, 2048, 111.89),
 ("TP", H14336, 72, 64, 1, 8, 4, 12, 2, 2048, 110.48),
 ("TP", H14336, 72, 64, 1, 8, 4, 12, 2, 2048, 113.54),
 ("TP", H14336, 72, 64, 1, 16, 4, 6, 4, 2048, 117.11),
 ("TP", H14336, 72, 64, 1, 16, 4, 6, 2, 2048, 111.71),
 ("TP", H14336, 72, 64, 1, 16, 2, 12, 2, 2048, 112.50),
]


BLOOM_NOT_COMPARABLE = {
    "ZeRO": "its two rows ran on different branches, and the notes ask for a retest on one",
}
"""Tables whose rows the notes themselves say cannot be compared with each other (seed 001, under
'Trying with ZeRO_STAGE=0/1': ZeRO_STAGE=0 could not run on master, nor 1 on the special branch).
Their rows still count in the error; only their order is left out of Kendall's tau."""


def bloom_time(row: tuple[str, int, int, int, int, int, int, int, int, int, float]) -> TimePrediction:
    _, hidden, layers, heads, zero, dp, tp, pp, mbs, gbs, _ = row
    model = ModelConfig(name="bloom", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        seq_length=2048, vocab_size=250680)
    layout = ParallelismConfig(tp=tp, pp=pp, micro_batch_size=mbs, global_batch_size=gbs, zero_stage=zero,
                               recompute=Recompute.full, precision=Precision.bf16)
    # Jean Zay: the A100 80GB defaults with the network the BLOOM notes ran on (4 x Omni-Path 100 Gb/s).
    return predict_time(model, layout, load_hardware("a100_80gb_jean_zay"), dp=dp, stack=Stack.megatron_deepspeed)


def bloom_prediction(row: tuple[str, int, int, int, int, int, int, int, int, int, float]) -> float:
    return bloom_time(row).sec_per_iter


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """(concordant - discordant) / (concordant + discordant) pairs; ties in either count as neither."""
    signs = [(xs[i] - xs[j]) * (ys[i] - ys[j]) for i, j in itertools.combinations(range(len(xs)), 2)]
    concordant, discordant = sum(s > 0 for s in signs), sum(s < 0 for s in signs)
    return (concordant - discordant) / max(1, concordant + discordant)


def test_bloom_seconds_per_iteration_error_and_order(capsys: pytest.CaptureFixture[str]) -> None:
    predicted = [bloom_prediction(row) for row in BLOOM_SEC_PER_ITER]
    errors = [p / row[-1] - 1 for p, row in zip(predicted, BLOOM_SEC_PER_ITER, strict=True)]
    mae = statistics.mean(abs(e) for e in errors)
    tables: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row, p in zip(BLOOM_SEC_PER_ITER, predicted, strict=True):
        tables[row[0]].append((row[-1], p))
    taus = {
        name: kendall_tau([m for m, _ in v], [p for _, p in v])
        for name, v in tables.items()
        if len(v) > 1 and name not in BLOOM_NOT_COMPARABLE
    }
    with capsys.disabled():
        print(f"\nBLOOM sec/it, {len(errors)} rows: mean absolute error {mae:.1%}, median error "
              f"{statistics.median(errors):+.1%}; Kendall tau per table: "
              + ", ".join(f"{k} {t:+.2f}" for k, t in taus.items())
              + f"; mean tau {statistics.mean(taus.values()):+.2f}; not ordered: "
              + "; ".join(f"{k} ({why})" for k, why in BLOOM_NOT_COMPARABLE.items()))
    assert len(errors) == 73
    # With datasheet figures, the efficiencies conf/hardware/a100_80gb.yaml cites and Jean Zay's
    # network, the model is about 22% fast: what it leaves out of Megatron-DeepSpeed's 2022 step is
    # not yet known (issue 12's target is 10%). These bounds hold the model where it is, so a change
    # that makes it worse fails; every prediction is below the measurement (no overhead is invented).
    assert mae <= 0.23
    assert max(errors[i] for i, r in enumerate(BLOOM_SEC_PER_ITER) if not r[0].startswith("max 18B")) < 0
    assert statistics.mean(taus.values()) > 0.4


def test_bloom_hidden_13824_beats_14400() -> None:
    # The notes' tile and wave argument: 13824 = 864 x 16 runs its GEMMs faster per FLOP than 14400.
    # (Their whole step is 27% faster per parameter; the model's GEMMs explain a few percent of it.)
    rows = {r[1]: r for r in BLOOM_SEC_PER_ITER if r[0] in ("48 nodes", "NHIDDEN") and r[7] == 10 and r[8] == 1}
    per_param = {h: bloom_time(r).parts["gemm"] / (r[1] ** 2 * r[2]) for h, r in rows.items()}
    assert per_param[H13824] < per_param[H14400]
    assert math.isfinite(per_param[H13824])


# ----------------------------------------------------------------------------- MPT (seed 002)
#
# A second published table, held back like BLOOM's: MosaicML's MPT benchmarks on one node of eight
# A100 80GB (the "A100 80GB with 1600 Gbps node-node interconnect" table, its 8-GPU rows). A 2023
# stack unlike BLOOM's: Composer with PyTorch FSDP FULL_SHARD (parameters, gradients and optimizer
# states sharded over the 8 ranks, as ZeRO-3), amp_bf16, GPT-2 shapes (learned positions, biases,
# tied embeddings, vocabulary 50,368; NumParams agrees with the planner's count to the parameter)
# and FlashAttention. The measured seconds per iteration are GlobalBatchSize x SeqLen / Throughput (T/s).
# Its two multi-node rows (70b on 32 and 64 GPUs) are left out: FSDP overlaps each layer's gathers
# with the layer before, which no stack the model knows does (DeepSpeed's ZeRO-3 is priced without
# it), so those rows would check FSDP's scheduling rather than the model's physics.
MPT_LAYER_SHAPES = {  # (layers, hidden, heads): llm-foundry's scripts/train/yamls/pretrain/mpt-<size>.yaml
    "125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
    "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64),
}  # fmt: skip
# (model, SeqLen, MicroBatchSize, GlobalBatchSize, Activation Checkpointing, Throughput (T/s), NumParams)
MPT_A100_ONE_NODE: list[tuple[str, int, int, int, bool, int, int]] = [
 ("30b", 8192, 1, 168, True, 4594, 30019254272),
 ("30b", 4096, 1, 168, True, 6513, 29989894144),
 ("30b", 2048, 3, 504, True, 7330, 29975214080),
 ("30b", 1024, 6, 1008, True, 7571, 29967874048),
 ("30b", 512, 12, 2016, True, 7739, 29964204032),
 ("13b", 32768, 1, 24, True, 8134, 13011240960),
 ("13b", 16384, 3, 72, True, 11454, 12927354880),
 ("13b", 8192, 5, 120, True, 14362, 12885411840),
 ("13b", 4096, 10, 240, True, 16482, 12864440320),
 ("13b", 2048, 2, 48, False, 18097, 12853954560),
 ("13b", 1024, 40, 960, True, 18647, 12848711680),
 ("7b", 65536, 1, 16, True, 8108, 6918905856),
 ("7b", 32768, 2, 32, True, 13382, 6784688128),
 ("7b", 16384, 4, 64, True, 19629, 6717579264),
 ("7b", 8192, 8, 128, True, 25655, 6684024832),
 ("7b", 4096, 16, 256, True, 29472, 6667247616),
 ("7b", 2048, 6, 96, False, 37130, 6658859008),
 ("7b", 1024, 64, 1024, True, 34857, 6654664704),
 ("3b", 65536, 1, 16, True, 14137, 2814366720),
 ("3b", 32768, 3, 144, True, 24235, 2730480640),
 ("3b", 16384, 1, 48, False, 44233, 2688537600),
 ("3b", 8192, 3, 144, False, 61567, 2667566080),
 ("3b", 4096, 5, 240, False, 75658, 2657080320),
 ("3b", 2048, 10, 160, False, 86491, 2651837440),
 ("3b", 1024, 20, 960, False, 92643, 2649216000),
 ("3b", 512, 40, 1920, False, 97019, 2647905280),
 ("1b", 65536, 1, 16, True, 24353, 1445974016),
 ("1b", 32768, 1, 32, False, 50207, 1378865152),
 ("1b", 16384, 2, 64, False, 79650, 1345310720),
 ("1b", 8192, 3, 96, False, 110516, 1328533504),
 ("1b", 4096, 7, 224, False, 142457, 1320144896),
 ("1b", 2048, 14, 448, False, 164109, 1315950592),
 ("1b", 1024, 18, 576, False, 176898, 1313853440),
 ("1b", 512, 56, 1792, False, 185186, 1312804864),
 ("760m", 65536, 1, 16, True, 33150, 857988096),
 ("760m", 32768, 1, 16, False, 70417, 807656448),
 ("760m", 16384, 3, 48, False, 114198, 782490624),
 ("760m", 8192, 6, 96, False, 167471, 769907712),
 ("760m", 4096, 12, 192, False, 218808, 763616256),
 ("760m", 2048, 24, 384, False, 259472, 760470528),
 ("760m", 1024, 48, 768, False, 238122, 758897664),
 ("760m", 512, 96, 1536, False, 235571, 758111232),
 ("350m", 65536, 1, 16, False, 60195, 420997120),
 ("350m", 32768, 2, 32, False, 109222, 387442688),
 ("350m", 16384, 4, 64, False, 188478, 370665472),
 ("350m", 8192, 8, 128, False, 292559, 362276864),
 ("350m", 4096, 16, 256, False, 396442, 358082560),
 ("350m", 2048, 32, 512, False, 470263, 355985408),
 ("350m", 1024, 64, 1024, False, 518504, 354936832),
 ("350m", 512, 128, 2048, False, 554643, 354412544),
 ("125m", 65536, 1, 16, False, 162946, 174070272),
 ("125m", 32768, 2, 32, False, 291256, 148904448),
 ("125m", 16384, 4, 64, False, 480322, 136321536),
 ("125m", 8192, 8, 128, False, 723142, 130030080),
 ("125m", 4096, 16, 256, False, 947172, 126884352),
 ("125m", 2048, 40, 640, False, 1142641, 125311488),
 ("125m", 2048, 32, 512, False, 1133901, 125311488),
 ("125m", 1024, 64, 1024, False, 1251751, 124525056),
 ("125m", 512, 128, 2048, False, 1325455, 124131840),
]  # fmt: skip


def mpt_case(row: tuple[str, int, int, int, bool, int, int]) -> tuple[ModelConfig, ParallelismConfig, float]:
    """(model, layout, measured sec/it) of one MPT row."""
    size, seq, mbs, gbs, checkpointing, tokens_per_s, _ = row
    layers, hidden, heads = MPT_LAYER_SHAPES[size]
    model = ModelConfig(name=f"mpt_{size}", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        seq_length=seq, vocab_size=50368, make_vocab_size_divisible_by=64)  # fmt: skip
    layout = ParallelismConfig(micro_batch_size=mbs, global_batch_size=gbs, zero_stage=3, engine=Engine.deepspeed,
                               recompute=Recompute.full if checkpointing else Recompute.none,
                               precision=Precision.bf16)  # fmt: skip
    return model, layout, gbs * seq / tokens_per_s


def test_mpt_rows_are_the_planners_shapes() -> None:
    for row in MPT_A100_ONE_NODE:
        model, _, _ = mpt_case(row)
        assert total_params(model) == row[-1], row


def test_mpt_seconds_per_iteration_error_and_order(capsys: pytest.CaptureFixture[str]) -> None:
    hw = load_hardware("a100_80gb")
    cases = [mpt_case(row) for row in MPT_A100_ONE_NODE]
    predicted = [predict_time(model, layout, hw, dp=8, stack=Stack.deepspeed) for model, layout, _ in cases]
    errors = [p.sec_per_iter / measured - 1 for p, (_, _, measured) in zip(predicted, cases, strict=True)]
    bands = {"seq <= 2048": (0, 2048), "4096-8192": (4096, 8192), "seq >= 16384": (16384, 1 << 30)}
    band_mae = {name: statistics.mean(abs(e) for e, row in zip(errors, MPT_A100_ONE_NODE, strict=True)
                                      if lo <= row[1] <= hi) for name, (lo, hi) in bands.items()}  # fmt: skip
    attention = {name: statistics.mean(p.parts["attention"] / p.sec_per_iter for p, row in
                                       zip(predicted, MPT_A100_ONE_NODE, strict=True) if lo <= row[1] <= hi)
                 for name, (lo, hi) in bands.items()}  # fmt: skip
    # Within one model, the order of the layouts (sequence length, micro-batch) by tokens per second.
    per_size: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row, p, (model, layout, _) in zip(MPT_A100_ONE_NODE, predicted, cases, strict=True):
        tokens = layout.global_batch_size * model.seq_length
        per_size[row[0]].append((row[5], tokens / p.sec_per_iter))
    taus = {size: kendall_tau([m for m, _ in v], [p for _, p in v]) for size, v in per_size.items()}
    mae = statistics.mean(abs(e) for e in errors)
    with capsys.disabled():
        print(f"\nMPT sec/it (A100 80GB, one node, uncalibrated), {len(errors)} rows: mean absolute error {mae:.1%}, "
              f"median error {statistics.median(errors):+.1%}; by sequence length: "
              + ", ".join(f"{k} {v:.1%} (attention {attention[k]:.0%} of the predicted time)" for k, v in band_mae.items())
              + "; Kendall tau of tokens/s per model: " + ", ".join(f"{k} {t:+.2f}" for k, t in taus.items())
              + f"; mean tau {statistics.mean(taus.values()):+.2f}")  # fmt: skip
    assert len(errors) == 59
    # Where the model stands, so that a change that makes it worse fails (nothing was fitted to this
    # table). The datasheet model is fast on all but three rows, as on BLOOM's rows and on the H100 and
    # H200 measured here without calibration; most at long sequences, where attention dominates: priced
    # at FlashAttention-2's published rate (conf/hardware/a100_80gb.yaml), it was 29.7% off in all
    # and 49.8% from 16,384 tokens as tensor-core GEMMs at the dense GEMM efficiency.
    assert mae <= 0.19
    assert band_mae["seq <= 2048"] < band_mae["4096-8192"] < band_mae["seq >= 16384"]
    assert sum(e < 0 for e in errors) >= 55
    assert statistics.mean(taus.values()) > 0.5


def test_a_pipeline_boundary_between_nodes_runs_at_the_network_share() -> None:
    # tp=2 x dp=2 = 4 devices per stage, 8 per node: the boundary after stage 1 (devices 7 | 8) crosses
    # nodes, the others do not; only that one gets slower when the network does.
    layout = par(tp=2, pp=4, global_batch_size=8, micro_batch_size=1)
    deep = replace(MODEL, num_layers=8)
    base = predict_time(deep, layout, HW, dp=2)
    slow_net = predict_time(deep, layout, replace(HW, inter_node_bw_gbs=8.0), dp=2)
    slow_nvl = predict_time(deep, layout, replace(HW, intra_node_bw_gbs=10.0), dp=2)
    assert slow_net.parts["pp_comm"] > base.parts["pp_comm"]
    # (the parts are the slowest stage's: the last one, with the logits, until the network slows)
    assert max(slow_net.stage_seconds[1:3]) > max(base.stage_seconds[1:3])
    assert slow_nvl.parts["pp_comm"] > base.parts["pp_comm"]  # the in-node boundaries


def test_zero_3_gathers_parameters_every_micro_batch() -> None:
    layout = par(engine="deepspeed", global_batch_size=8, micro_batch_size=1, zero_stage=1)
    one, three = (predict_time(MODEL, replace(layout, zero_stage=z), HW, dp=2).parts["dp_comm"] for z in (1, 3))
    assert three > 4 * one


def test_memoised_pieces_read_only_their_keys() -> None:
    # predict_time memoises a rank's layer and ends on a reduced layout (_per_rank_key) and, without a
    # calibration, the machine on no node count: each must equal the piece computed on the whole layout.
    from train.planner.memory import stack_of
    from train.planner.perf import _ends, _layer, _machine, _per_rank_key

    from .test_memory import load_model

    models = [MODEL, load_model("gpt_1.3b"), load_model("bert_345m")]
    devices = [replace(HW, peak_tflops_fp16=100.0), load_hardware("h100_sxm"), load_hardware("a100_40gb")]
    layouts = [
        par(tp=tp, pp=pp, micro_batch_size=mbs, global_batch_size=64, precision=prec, recompute=rc,
            sequence_parallel=sp, zero_stage=zero, engine=engine, offload=off)
        for tp, pp, mbs, prec, rc, sp, zero, engine, off in [
            (1, 1, 1, Precision.bf16, Recompute.none, False, 0, "native", Offload.none),
            (2, 4, 2, Precision.fp16, Recompute.selective, True, 1, "native", Offload.none),
            (4, 2, 4, Precision.fp32, Recompute.full, False, 0, "native", Offload.none),
            (1, 1, 2, Precision.bf16, Recompute.full, False, 3, "deepspeed", Offload.optimizer),
        ]
    ]  # fmt: skip
    layouts.append(replace(layouts[1], virtual_stages=2))  # interleaved 1F1B
    for model, hw, layout in itertools.product(models, devices, layouts):
        precision = Precision(layout.precision)
        for nodes in (1, 2, 8):
            mach = _machine(hw, precision, nodes)
            assert _machine(hw, precision, 0) == mach
            key, stack = _per_rank_key(layout), stack_of(layout)
            for causal_skip in (0.5, 1.0):
                assert _layer(model, key, mach, stack, causal_skip).parts == _layer(model, layout, mach, stack, causal_skip).parts
            for first, last in itertools.product((False, True), repeat=2):
                assert _ends(model, key, mach, first=first, last=last).parts == _ends(
                    model, layout, mach, first=first, last=last
                ).parts


def test_a_zero_figure_must_be_positive_and_a_null_one_is_unknown() -> None:
    two_nodes = par(global_batch_size=16)
    with pytest.raises(UnknownHardwareFigure, match=r"hardware.inter_node_bw_gbs=0.0 must be a positive number of GB/s"):
        predict_time(MODEL, two_nodes, replace(HW, inter_node_bw_gbs=0.0), dp=16)
    with pytest.raises(UnknownHardwareFigure, match=r"hardware.inter_node_bw_gbs is unknown"):
        predict_time(MODEL, two_nodes, replace(HW, inter_node_bw_gbs=None), dp=16)
    with pytest.raises(UnknownHardwareFigure, match=r"hardware.memory_bw_gbs=0.0 for hardware '\w+' must be a positive"):
        predict_time(MODEL, two_nodes, replace(HW, memory_bw_gbs=0.0), dp=16)
