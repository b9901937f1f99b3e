"""train.planner.flops: hand-counted GEMMs, Eq. 3 against BLOOM's logs, MosaicML's formula against MPT's tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from conf.schema import HardwareConfig, ModelConfig, ModelKind, ParallelismConfig, Precision, Recompute
from train.planner.flops import (
    Gemm,
    ImpossibleUtilization,
    achieved_tflops,
    hardware_flops_per_iteration,
    head_gemms,
    iteration_flops,
    layer_gemms,
    logits_gemm,
    megatron_eq3_flops_per_iteration,
    model_flops_per_iteration,
    mpt_attn_flops_per_seq,
    mpt_hfu,
    mpt_mfu,
    peak_tflops,
    utilization,
)
from train.planner.sizes import padded_vocab_size

from .test_perf import MPT_LAYER_SHAPES

REPO = Path(__file__).resolve().parents[3]

# h=64, s=32, 4 heads of 16, f=4h=256; V=1100 pads to 1152 (multiple of 128) at tp=1 and to
# 1280 (multiple of 256) at tp=2.
SMALL = ModelConfig(
    name="small",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    vocab_size=1100,
    make_vocab_size_divisible_by=128,
)


def load_hardware(name: str) -> HardwareConfig:
    node = OmegaConf.merge(
        OmegaConf.structured(HardwareConfig), OmegaConf.load(REPO / "conf" / "hardware" / f"{name}.yaml")
    )
    hw = OmegaConf.to_object(node)
    assert isinstance(hw, HardwareConfig)
    return hw


def by_name(gemms: list[Gemm]) -> dict[str, int]:
    return {g.name: g.flops for g in gemms}


def test_gemm_flops_counts_two_per_mac() -> None:
    assert Gemm("x", m=2, n=3, k=4, batch=5).flops == 2 * 2 * 3 * 4 * 5


def test_small_model_tp1_by_hand() -> None:
    # mbs=2 -> tokens T = 2 x 32 = 64; attention batched over mbs x heads = 8.
    assert by_name(layer_gemms(SMALL, micro_batch_size=2, tp=1)) == {
        "qkv": 2 * 64 * (3 * 64) * 64,  # 1,572,864
        "attn_scores": 2 * 8 * 32 * 32 * 16,  # 262,144: per head s x s x head_dim
        "attn_values": 2 * 8 * 32 * 16 * 32,  # 262,144: per head s x head_dim x s
        "attn_proj": 2 * 64 * 64 * 64,  # 524,288
        "mlp_in": 2 * 64 * 256 * 64,  # 2,097,152
        "mlp_out": 2 * 64 * 64 * 256,  # 2,097,152
    }
    assert logits_gemm(SMALL, micro_batch_size=2, tp=1) == Gemm("logits", 64, 1152, 64)
    assert logits_gemm(SMALL, micro_batch_size=2, tp=1).flops == 9_437_184


def test_small_model_tp2_by_hand() -> None:
    # One rank of two: 2 heads, QKV columns 3 x 32, MLP 128 wide; batch mbs x heads/tp = 4.
    gemms = layer_gemms(SMALL, micro_batch_size=2, tp=2)
    assert [(g.name, g.m, g.n, g.k, g.batch) for g in gemms] == [
        ("qkv", 64, 96, 64, 1),
        ("attn_scores", 32, 32, 16, 4),
        ("attn_values", 32, 16, 32, 4),
        ("attn_proj", 64, 64, 32, 1),
        ("mlp_in", 64, 128, 64, 1),
        ("mlp_out", 64, 64, 128, 1),
    ]
    assert by_name(gemms) == {
        "qkv": 786_432,
        "attn_scores": 131_072,
        "attn_values": 131_072,
        "attn_proj": 262_144,
        "mlp_in": 1_048_576,
        "mlp_out": 1_048_576,
    }
    # V padded to 1280 at tp=2, 640 rows per rank: 2 x 64 x 640 x 64.
    assert logits_gemm(SMALL, micro_batch_size=2, tp=2).flops == 5_242_880


def test_small_model_iteration_by_hand() -> None:
    # One layer forward at mbs=2: 1,572,864 + 2 x 262,144 + 524,288 + 2 x 2,097,152 = 6,815,744.
    # gbs=8 is 4 such micro-batches; 2 layers -> 54,525,952. Logits: 4 x 9,437,184 = 37,748,736.
    layers, core, logits = 2 * 4 * 6_815_744, 2 * 4 * 2 * 262_144, 4 * 9_437_184
    assert model_flops_per_iteration(SMALL, global_batch_size=8) == 3 * (layers + logits) == 276_824_064
    assert hardware_flops_per_iteration(SMALL, global_batch_size=8, recompute=Recompute.none) == 276_824_064
    assert hardware_flops_per_iteration(SMALL, global_batch_size=8, recompute=Recompute.selective) == (
        276_824_064 + core
    )
    assert hardware_flops_per_iteration(SMALL, global_batch_size=8, recompute=Recompute.full) == (
        276_824_064 + layers
    )
    # Padding for tp=2 adds 128 vocabulary rows: 3 x 2 x (8 x 32) x 128 x 64.
    assert model_flops_per_iteration(SMALL, global_batch_size=8, tp=2) - 276_824_064 == 3 * 2 * 256 * 128 * 64


@settings(max_examples=40, deadline=None)
@given(
    head_dim=st.sampled_from([8, 16, 64]),
    heads_per_rank=st.integers(1, 4),
    tp=st.sampled_from([1, 2, 4, 8]),
    seq=st.integers(1, 64),
    mbs=st.integers(1, 4),
)
def test_tp_ranks_sum_to_the_unsplit_layer(
    head_dim: int, heads_per_rank: int, tp: int, seq: int, mbs: int
) -> None:
    heads = heads_per_rank * tp
    model = ModelConfig(hidden_size=head_dim * heads, num_attention_heads=heads, seq_length=seq)
    whole = by_name(layer_gemms(model, micro_batch_size=mbs, tp=1))
    rank = by_name(layer_gemms(model, micro_batch_size=mbs, tp=tp))
    assert {name: tp * flops for name, flops in rank.items()} == whole


def test_uneven_tp_split_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        layer_gemms(SMALL, micro_batch_size=1, tp=3)
    with pytest.raises(ValueError, match="micro_batch_size"):
        layer_gemms(SMALL, micro_batch_size=0)


def test_bert_adds_its_lm_head_dense() -> None:
    bert = ModelConfig(
        name="b",
        kind=ModelKind.bert,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=1100,
    )
    assert [g.name for g in head_gemms(bert, micro_batch_size=2, tp=2)] == ["lm_head_dense", "logits"]
    assert [g.name for g in head_gemms(SMALL, micro_batch_size=2)] == ["logits"]
    # Same layers and logits as the GPT shape, plus 3 x (2 x tokens x h x h) with tokens = 8 x 32.
    extra = 3 * 2 * 256 * 64 * 64
    for tp in (1, 2):
        assert model_flops_per_iteration(bert, global_batch_size=8, tp=tp) == (
            model_flops_per_iteration(SMALL, global_batch_size=8, tp=tp) + extra
        )


def test_full_recompute_is_four_thirds_of_the_layers() -> None:
    model = ModelConfig(
        num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257
    )
    gbs = 512
    logits = 3 * logits_gemm(model, micro_batch_size=gbs).flops  # never recomputed
    mfu_layers = model_flops_per_iteration(model, global_batch_size=gbs) - logits
    hfu_layers = hardware_flops_per_iteration(model, global_batch_size=gbs, recompute=Recompute.full) - logits
    assert hfu_layers == pytest.approx(4 / 3 * mfu_layers, rel=1e-12)
    selective = hardware_flops_per_iteration(model, global_batch_size=gbs, recompute=Recompute.selective)
    assert model_flops_per_iteration(model, global_batch_size=gbs) < selective < hfu_layers + logits


@pytest.mark.parametrize(
    ("layers", "h", "heads", "s", "vocab", "gbs"),
    [(24, 2048, 16, 2048, 50257, 512), (72, 14336, 64, 2048, 250680, 2048), (2, 64, 4, 32, 1100, 8)],
)
def test_per_gemm_forward_matches_eq3_terms(
    layers: int, h: int, heads: int, s: int, vocab: int, gbs: int
) -> None:
    model = ModelConfig(
        num_layers=layers, hidden_size=h, num_attention_heads=heads, seq_length=s, vocab_size=vocab
    )
    v = padded_vocab_size(model)
    # Per-GEMM forward with f = 4h: 24 B s l h^2 (1 + s/(6h)) + 2 B s h V, in exact integers.
    forward = 24 * gbs * s * layers * h**2 + 4 * gbs * s**2 * layers * h + 2 * gbs * s * h * v
    assert model_flops_per_iteration(model, global_batch_size=gbs) == 3 * forward
    # With factor 4, Eq. 3 is exactly the full-recompute hardware count (logits run 3 times).
    eq3_full = megatron_eq3_flops_per_iteration(model, global_batch_size=gbs, full_recompute=True)
    hardware = hardware_flops_per_iteration(model, global_batch_size=gbs, recompute=Recompute.full)
    assert eq3_full == pytest.approx(hardware, rel=1e-12)
    # With factor 3 the logits term is 72 B s l h^2 x V/(16 l h) = 4.5 B s h V, not 3 x 2 B s h V.
    eq3_none = megatron_eq3_flops_per_iteration(model, global_batch_size=gbs, full_recompute=False)
    assert eq3_none == pytest.approx(3 * forward - 1.5 * gbs * s * h * v, rel=1e-12)
    # GLU coefficient 32 scales the whole formula by 32/24.
    glu = megatron_eq3_flops_per_iteration(model, global_batch_size=gbs, full_recompute=True, glu=True)
    assert glu == pytest.approx(eq3_full * 32 / 24, rel=1e-12)


# BLOOM notes (seed 001), rows logged after the Eq. 3 fix (Megatron-DeepSpeed PR 251), '48 node
# contenders' section onward: NHIDDEN=14336 NLAYERS=72 NHEADS=64, seq 2048, full recompute,
# 48 nodes x 8 A100 = 384 devices. Columns: DP, TP, PP, MBS, GBS, Sec/it, TFLOPs.
BLOOM_ROWS = [
    (
        4,
        8,
        12,
        1,
        2048,
        143.31,
        112.49,
    ),  # | 48 | 181B | 4 | 8 | 12 | 1 | 2048 | 29GB | 143.31 | 112.49 | 02-21 |
    (
        8,
        8,
        6,
        4,
        2048,
        121.48,
        132.71,
    ),  # | 48 | 181B | 8 | 8 | 6 | 4 | 2048 | 56GB | 121.48 | 132.71 | 02-21 |
    (8, 8, 6, 4, 2048, 120.85, 133.40),  # | 48 | 181B | 8 | 8 | 6 | 4 | 2048 | GB | 120.85 | 133.40 | 02-23 |
    (
        8,
        8,
        6,
        4,
        2048,
        114.11,
        141.27,
    ),  # | 48 | 181B | 8 | 8 | 6 | 4 | 2048 | 55GB | 114.11 | 141.27 | 02-25 |
    (
        8,
        8,
        6,
        4,
        1568,
        113.01,
        109.22,
    ),  # | 48 | 181B | 8 | 8 | 6 | 4 | 1568 | 56GB | 113.01 | 109.22 | 02-25 |
    (
        6,
        8,
        8,
        4,
        2016,
        113.16,
        140.24,
    ),  # | 48 | 181B | 6 | 8 | 8 | 4 | 2016 | 52GB | 113.16 | 140.24 | 02-25 |
    (
        8,
        4,
        12,
        2,
        2048,
        110.48,
        145.92,
    ),  # | 48 | 181B | 8 | 4 | 12 | 2 | 2048 | 44GB | 110.48 | 145.92 | 02-25 |
    (
        16,
        2,
        12,
        2,
        2048,
        112.50,
        143.30,
    ),  # | 48 | 181B | 16 | 2 | 12 | 2 | 2048 | 63GB | 112.50 | 143.30 | 02-25 |
]
BLOOM_181B = ModelConfig(
    name="bloom_181b",
    num_layers=72,
    hidden_size=14336,
    num_attention_heads=64,
    seq_length=2048,
    vocab_size=250680,
)


@pytest.mark.parametrize(("dp", "tp", "pp", "mbs", "gbs", "sec_per_iter", "logged"), BLOOM_ROWS)
def test_eq3_reproduces_bloom_logs(
    dp: int, tp: int, pp: int, mbs: int, gbs: int, sec_per_iter: float, logged: float
) -> None:
    devices = dp * tp * pp
    assert devices == 48 * 8
    # BLOOM's 250,680-token vocabulary padded to a multiple of 128 x tp is 250,880 for tp 2, 4 and 8.
    assert padded_vocab_size(BLOOM_181B, tp) == 250880
    flops = megatron_eq3_flops_per_iteration(BLOOM_181B, global_batch_size=gbs, full_recompute=True, tp=tp)
    # Logged to 2 decimals and Sec/it rounded to 2: 0.05% covers both (observed <= 0.01%).
    assert achieved_tflops(flops, sec_per_iter, devices) == pytest.approx(logged, rel=5e-4)


# MPT benchmark tables (seed 002); (n_layers, d_model) from MPT's yamls (test_perf). Columns: SeqLen, # GPUs,
# MFU, HFU, Throughput (T/s), Activation Checkpointing, NumParams.
MPT_SHAPES = {size: (layers, hidden) for size, (layers, hidden, _) in MPT_LAYER_SHAPES.items()}
MPT_H100_BF16 = [
    # |  7b | 2048 | 8 | h100_80gb | 46.44 | 46.44 | ... | 85144 | ... | False | False | 6658859008 |
    ("7b", 2048, 8, 46.44, 46.44, 85144, False, 6658859008),
    # |  7b | 1024 | 8 | h100_80gb | 42.83 | 57.11 | ... | 81628 | ... | True | False | 6654664704 |
    ("7b", 1024, 8, 42.83, 57.11, 81628, True, 6654664704),
    # |  7b | 8192 | 8 | h100_80gb | 37.14 | 49.52 | ... | 55481 | ... | True | False | 6684024832 |
    ("7b", 8192, 8, 37.14, 49.52, 55481, True, 6684024832),
    # |  13b | 2048 | 64 | h100_80gb | 39.86 | 39.86 | ... | 307209 | ... | False | False | 12853954560 |
    ("13b", 2048, 64, 39.86, 39.86, 307209, False, 12853954560),
    # |  13b | 4096 | 8 | h100_80gb | 41.6 | 55.47 | ... | 37740 | ... | True | False | 12864440320 |
    ("13b", 4096, 8, 41.6, 55.47, 37740, True, 12864440320),
    # |  30b | 2048 | 32 | h100_80gb | 43.92 | 58.57 | ... | 73860 | ... | True | False | 29975214080 |
    ("30b", 2048, 32, 43.92, 58.57, 73860, True, 29975214080),
    # |  30b | 8192 | 8 | h100_80gb | 29.92 | 39.9 | ... | 11072 | ... | True | False | 30019254272 |
    ("30b", 8192, 8, 29.92, 39.9, 11072, True, 30019254272),
    # |  70b | 2048 | 64 | h100_80gb | 42.57 | 56.76 | ... | 66523 | ... | True | False | 64862437376 |
    ("70b", 2048, 64, 42.57, 56.76, 66523, True, 64862437376),
    # |  3b | 2048 | 64 | h100_80gb | 40.8 | 40.8 | ... | 1441663 | ... | False | False | 2651837440 |
    ("3b", 2048, 64, 40.8, 40.8, 1441663, False, 2651837440),
    # |  1b | 65536 | 8 | h100_80gb | 26.34 | 35.12 | ... | 44050 | ... | True | False | 1445974016 |
    ("1b", 65536, 8, 26.34, 35.12, 44050, True, 1445974016),
]
MPT_A100_BF16 = [
    # |  13b | 2048 | 8 | a100_80gb | 59.57 | 59.57 | ... | 18097 | ... | False | False | 12853954560 |
    ("13b", 2048, 8, 59.57, 59.57, 18097, False, 12853954560),
    # |  7b | 4096 | 8 | a100_80gb | 54.84 | 73.12 | ... | 29472 | ... | True | False | 6667247616 |
    ("7b", 4096, 8, 54.84, 73.12, 29472, True, 6667247616),
    # |  30b | 2048 | 8 | a100_80gb | 55.3 | 73.74 | ... | 7330 | ... | True | False | 29975214080 |
    ("30b", 2048, 8, 55.3, 73.74, 7330, True, 29975214080),
]
# The tables round MFU/HFU to 0.01 pp (+-0.005) and throughput to whole tokens/s (relative error
# < 1e-4 for these rows). With the repo's dense peaks (conf/hardware: H100 SXM 989.4, A100 312)
# every row lands within 0.0095 pp, so 0.015 pp is asserted, well inside the 0.1 pp budget. A
# round 989 TFLOPs H100 peak would be off by up to 0.033 pp: the tables were made with 989.4.
MPT_TOLERANCE_PP = 0.015


@pytest.mark.parametrize(
    ("hardware", "row"),
    [("h100_sxm", row) for row in MPT_H100_BF16] + [("a100_80gb", row) for row in MPT_A100_BF16],
)
def test_mpt_convention_reproduces_mpt_tables(hardware: str, row: tuple) -> None:
    model, seq_len, gpus, mfu_pp, hfu_pp, tokens_per_sec, checkpointing, n_params = row
    n_layers, d_model = MPT_SHAPES[model]
    peak = peak_tflops(load_hardware(hardware), Precision.bf16)
    assert peak is not None
    common: dict[str, Any] = dict(
        n_params=n_params,
        n_layers=n_layers,
        d_model=d_model,
        seq_len=seq_len,
        tokens_per_sec=tokens_per_sec,
        gpus=gpus,
        peak_tflops=peak,
    )
    assert 100 * mpt_mfu(**common) == pytest.approx(mfu_pp, abs=MPT_TOLERANCE_PP)
    assert 100 * mpt_hfu(**common, activation_checkpointing=checkpointing) == pytest.approx(
        hfu_pp, abs=MPT_TOLERANCE_PP
    )


def test_mpt_attention_term_and_hfu_factor() -> None:
    assert mpt_attn_flops_per_seq(n_layers=2, d_model=8, seq_len=4) == 2 * 2 * 2 * 8 * 16
    common: dict[str, Any] = dict(
        n_params=10**9, n_layers=24, d_model=2048, seq_len=2048, tokens_per_sec=1e5, gpus=8, peak_tflops=312.0
    )
    mfu = mpt_mfu(**common)
    assert mpt_hfu(**common, activation_checkpointing=False) == mfu
    assert mpt_hfu(**common, activation_checkpointing=True) == pytest.approx(4 / 3 * mfu, rel=1e-12)
    with pytest.raises(ImpossibleUtilization):
        mpt_mfu(**{**common, "tokens_per_sec": 1e9})


def test_peak_tflops_per_precision() -> None:
    a100, v100, cpu = load_hardware("a100_80gb"), load_hardware("v100_32gb"), load_hardware("cpu")
    assert peak_tflops(a100, Precision.bf16) == 312.0
    assert peak_tflops(a100, Precision.fp32) == 156.0
    assert peak_tflops(v100, Precision.fp16) == 125.0
    assert peak_tflops(v100, Precision.bf16) is None  # V100 has no bf16
    assert peak_tflops(cpu, Precision.fp32) is None  # measured by the trainer, not a static figure
    measured = HardwareConfig(peak_tflops_bf16=100.0, peak_measured=True)
    assert peak_tflops(measured, Precision.bf16) is None


def test_achieved_tflops_and_utilization() -> None:
    assert achieved_tflops(3e15, 2.0, 10) == pytest.approx(150.0)
    assert utilization(156.0, 312.0) == 0.5
    assert utilization(312.0, 312.0) == 1.0
    assert utilization(1e9, None) is None
    with pytest.raises(ImpossibleUtilization, match="100%") as info:
        utilization(400.0, 312.0)
    assert isinstance(info.value, ValueError)
    assert info.value.ratio == pytest.approx(400 / 312)
    assert "128.2%" in str(info.value)
    with pytest.raises(ValueError, match="sec_per_iter"):
        achieved_tflops(1e15, 0.0, 8)
    with pytest.raises(ValueError, match="devices"):
        achieved_tflops(1e15, 1.0, 0)


def test_flops_module_does_not_import_torch() -> None:
    code = "import sys, train.planner.flops; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_the_trainers_count_pads_the_vocabulary_for_its_tp_as_the_plan_does() -> None:
    # The log line's and the record's TFLOPs (iteration_flops) padded the vocabulary for tp=1 while the
    # dry run and analysis.calc padded it for the run's TP: at tp=8, 50,257 rows are 51,200, not 50,304.
    model = ModelConfig(name="gpt2", num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128,
                        vocab_size=50257)  # fmt: skip
    par = ParallelismConfig(tp=8, micro_batch_size=1, global_batch_size=8, recompute=Recompute.full)
    counted = iteration_flops(model, par)
    assert counted["model"] == model_flops_per_iteration(model, global_batch_size=8, tp=8)
    assert counted["hardware"] == hardware_flops_per_iteration(model, global_batch_size=8, recompute=Recompute.full, tp=8)
    assert counted["model"] > model_flops_per_iteration(model, global_batch_size=8, tp=1)
