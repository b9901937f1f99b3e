"""FLOPs of a training iteration, three ways, and the utilization figures built on them.

1. The per-GEMM count (megasweep's own convention, used for MFU and HFU everywhere):
   every matrix multiplication of the model is listed with its shape (`Gemm`), and one
   multiply-accumulate counts as 2 FLOPs. Per layer: QKV, attention scores QK^T, attention
   over values, output projection, MLP in and MLP out; after the last layer the logits
   (and, for BERT, the masked-LM head's dense h x h transform before them).
   Conventions:
   - backward = 2 x forward (gradients with respect to inputs and to weights);
   - causal attention is NOT halved: the kernels megasweep runs compute the full s x s
     score matrix and mask it, and Megatron's Eq. 3 counts it full too, so halving would
     make our numbers incomparable; bidirectional (BERT) attention is full s x s anyway;
   - the logits use the PADDED vocabulary (`train.planner.sizes.padded_vocab_size`), because the
     padded rows are real rows of the GEMM the device executes;
   - LayerNorm, softmax, GeLU, dropout, residual adds, the embedding lookup and the
     optimizer are not GEMMs and are not counted (they are well under 1% at scale);
   - model FLOPs (for MFU) never include recomputation; hardware FLOPs (for HFU) add the
     recomputed forwards: `selective` recomputes the attention core (QK^T and attention over
     values, Korthikanti et al. 2022), `full` recomputes every layer GEMM but not the logits
     (the head runs after the last checkpointed layer, so nothing re-runs it).
2. Megatron-DeepSpeed's printed TFLOPs: Narayanan et al. 2021, Eq. 3, exactly as that code
   evaluates it (`megatron_eq3_flops_per_iteration`), to reproduce logged numbers.
3. MosaicML's MPT benchmark convention, 2 x parameters per token plus attention
   (`mpt_mfu`, `mpt_hfu`), to reproduce their published tables.

This module is pure arithmetic and must not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conf.schema import HardwareConfig, ModelConfig, ModelKind, ParallelismConfig, Precision, Recompute
from train.planner.sizes import padded_vocab_size

# A multiply-accumulate is a multiply and an add.
FLOPS_PER_MAC = 2
# Forward once, backward twice (input gradients and weight gradients, each a forward-sized GEMM).
FORWARD_BACKWARD = 3

LAYER_GEMM_NAMES = ("qkv", "attn_scores", "attn_values", "attn_proj", "mlp_in", "mlp_out")
# Korthikanti et al. 2022: selective recomputation re-runs only the attention core, whose
# activations are large (s x s per head) but cheap to recompute.
SELECTIVE_RECOMPUTE_GEMMS = frozenset({"attn_scores", "attn_values"})


class ImpossibleUtilization(ValueError):
    """A utilization above 100%: the inputs (time, devices, batch or peak) are wrong."""

    def __init__(self, tflops_per_device: float, peak_tflops: float, what: str = "utilization") -> None:
        self.tflops_per_device = tflops_per_device
        self.peak_tflops = peak_tflops
        self.ratio = tflops_per_device / peak_tflops
        super().__init__(
            f"{what} would be {self.ratio:.1%}: {tflops_per_device:.4g} TFLOP/s per device against a "
            f"dense peak of {peak_tflops:g} TFLOP/s; no device exceeds its peak, so the seconds per "
            f"iteration, the device count, the batch size or the peak is wrong (utilization must be <= 100%)"
        )


@dataclass(frozen=True)
class Gemm:
    """One matrix multiplication C[m, n] = A[m, k] @ B[k, n], repeated `batch` times."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> int:
        """FLOPs of one forward execution (2 per multiply-accumulate)."""
        return FLOPS_PER_MAC * self.m * self.n * self.k * self.batch


def _require_positive(**values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise ValueError(f"{key}={value} is invalid: {key} must be a positive integer")


def _split(total: int, parts: int, what: str, by: str = "tp") -> int:
    """`total` divided evenly into `parts`; Megatron cannot split heads or matrices unevenly."""
    if total % parts:
        raise ValueError(
            f"{by}={parts} does not divide {what}={total}: {what} is split evenly into {by} parts, "
            f"so {by} must be one of its divisors"
        )
    return total // parts


def layer_gemms(model: ModelConfig, *, micro_batch_size: int, tp: int = 1) -> list[Gemm]:
    """One transformer layer's GEMMs on ONE tensor-parallel rank, for one micro-batch (forward).

    Megatron's split: QKV and MLP-in are column-parallel (output dimension / tp), the
    projection and MLP-out are row-parallel (inner dimension / tp), and each rank owns
    heads / tp whole heads, so the attention-core GEMMs are batched over mbs x heads / tp.
    Summed over the tp ranks these are exactly the tp=1 GEMMs. The attention-core GEMMs
    are the full s x s, causal or not: masking does not skip the work, so it is not halved.
    """
    heads = model.num_attention_heads
    _require_positive(micro_batch_size=micro_batch_size, tp=tp, num_attention_heads=heads)
    h, s, f = model.hidden_size, model.seq_length, model.ffn
    head_dim = _split(h, heads, "hidden_size", by="num_attention_heads")
    tokens = micro_batch_size * s
    heads_here = _split(heads, tp, "num_attention_heads")
    f_here = _split(f, tp, "ffn_hidden_size")
    batched = micro_batch_size * heads_here
    return [
        Gemm("qkv", tokens, 3 * heads_here * head_dim, h),
        Gemm("attn_scores", s, s, head_dim, batch=batched),
        Gemm("attn_values", s, head_dim, s, batch=batched),
        Gemm("attn_proj", tokens, h, heads_here * head_dim),
        Gemm("mlp_in", tokens, f_here, h),
        Gemm("mlp_out", tokens, h, f_here),
    ]


def logits_gemm(model: ModelConfig, *, micro_batch_size: int, tp: int = 1) -> Gemm:
    """The output layer on one TP rank: every token against this rank's slice of the padded vocabulary.

    The vocabulary is padded for this tp (as Megatron pads), so it always splits evenly.
    """
    _require_positive(micro_batch_size=micro_batch_size, tp=tp)
    vocab_here = padded_vocab_size(model, tp) // tp
    return Gemm("logits", micro_batch_size * model.seq_length, vocab_here, model.hidden_size)


def head_gemms(model: ModelConfig, *, micro_batch_size: int, tp: int = 1) -> list[Gemm]:
    """GEMMs after the last layer on one TP rank: BERT's LM-head dense h x h (replicated), then the logits."""
    gemms = []
    if model.kind == ModelKind.bert:
        # Megatron keeps BERT's LM-head transform whole on every TP rank.
        tokens = micro_batch_size * model.seq_length
        gemms.append(Gemm("lm_head_dense", tokens, model.hidden_size, model.hidden_size))
    gemms.append(logits_gemm(model, micro_batch_size=micro_batch_size, tp=tp))
    return gemms


def _forward_flops(model: ModelConfig, global_batch_size: int, tp: int) -> tuple[int, int, int]:
    """(layer GEMMs of all layers, selective-recompute part of them, head) forward FLOPs of one iteration.

    GEMM FLOPs are linear in the batch, so one GEMM list over the whole global batch gives the
    iteration. Layers are counted at tp=1 (the model's own work, whatever the layout); the head's
    vocabulary is padded for `tp` because that padding is computed on the device.
    """
    _require_positive(global_batch_size=global_batch_size, tp=tp)
    gemms = layer_gemms(model, micro_batch_size=global_batch_size, tp=1)
    layers = model.num_layers * sum(g.flops for g in gemms)
    attention_core = model.num_layers * sum(g.flops for g in gemms if g.name in SELECTIVE_RECOMPUTE_GEMMS)
    # BERT's LM-head dense is replicated over TP ranks, so it is counted once; the logits are
    # split, so tp x one rank's share is the whole padded GEMM.
    head = sum(
        g.flops for g in head_gemms(model, micro_batch_size=global_batch_size, tp=tp) if g.name != "logits"
    )
    head += tp * logits_gemm(model, micro_batch_size=global_batch_size, tp=tp).flops
    return layers, attention_core, head


def model_flops_per_iteration(model: ModelConfig, *, global_batch_size: int, tp: int = 1) -> float:
    """Model FLOPs of one optimizer step: every GEMM forward x1 + backward x2, no recomputation (MFU basis).

    `tp` only pads the vocabulary as a run with that TP degree does (default: padding for tp=1).
    """
    layers, _, head = _forward_flops(model, global_batch_size, tp)
    return float(FORWARD_BACKWARD * (layers + head))


def hardware_flops_per_iteration(
    model: ModelConfig, *, global_batch_size: int, recompute: Recompute, tp: int = 1
) -> float:
    """FLOPs the devices execute in one step: model FLOPs plus the recomputed forwards (HFU basis).

    selective: + the attention core (scores and values) of every layer; full: + every layer GEMM
    (so the layer part is 4/3 of the model FLOPs); the logits are never recomputed.
    """
    layers, attention_core, head = _forward_flops(model, global_batch_size, tp)
    recomputed = {Recompute.none: 0, Recompute.selective: attention_core, Recompute.full: layers}[
        Recompute(recompute)
    ]
    return float(FORWARD_BACKWARD * (layers + head) + recomputed)


def megatron_eq3_flops_per_iteration(
    model: ModelConfig, *, global_batch_size: int, full_recompute: bool, glu: bool = False, tp: int = 1
) -> float:
    """Narayanan et al. 2021, Eq. 3, as Megatron-DeepSpeed computes the TFLOPs it prints.

        c x factor x B x s x l x h^2 x (1 + s/(6h) + V/(16 l h))

    c = 24 (32 for a GLU MLP keeping f = 4h: three h x 4h matrices instead of two), factor = 4
    with activation recomputation and 3 without, V = vocabulary padded for `tp` as the run pads it.
    Megatron-DeepSpeed applies factor 4 to selective recomputation too; to reproduce its logs, pass
    full_recompute=True for any recompute != none (analysis.calc does). The formula assumes f = 4h
    and ignores `ffn_hidden_size`; with factor 4 it equals the per-GEMM hardware count for full
    recomputation, while with factor 3 its logits term is 3/4 of the true one (a quirk of the code,
    which scales the logits by the recompute factor; kept so printed numbers reproduce).
    """
    _require_positive(global_batch_size=global_batch_size, tp=tp)
    b, s, layers, h = global_batch_size, model.seq_length, model.num_layers, model.hidden_size
    vocab = padded_vocab_size(model, tp)
    coefficient = 32 if glu else 24
    factor = 4 if full_recompute else 3
    return coefficient * factor * b * s * layers * h**2 * (1.0 + s / (6.0 * h) + vocab / (16.0 * layers * h))


def mpt_attn_flops_per_seq(*, n_layers: int, d_model: int, seq_len: int) -> int:
    """MosaicML's attention forward FLOPs per sequence: n_layers x 2 x 2 x d_model x seq_len^2.

    Two s x s x d GEMMs (scores and values) per layer at 2 FLOPs per MAC, full (not halved) s x s.
    """
    return n_layers * 2 * 2 * d_model * seq_len**2


def mpt_flops_per_seq(*, n_params: int, n_layers: int, d_model: int, seq_len: int, passes: int = 3) -> int:
    """MosaicML's FLOPs per sequence for `passes` network passes (3: fwd + bwd; 4: + checkpointing recompute).

    Per pass: 2 FLOPs per parameter per token (every parameter, embeddings included), plus attention.
    """
    flops_per_seq = 2 * n_params * seq_len
    return passes * (
        flops_per_seq + mpt_attn_flops_per_seq(n_layers=n_layers, d_model=d_model, seq_len=seq_len)
    )


def _mpt_utilization(
    flops_per_seq: int, *, seq_len: int, tokens_per_sec: float, gpus: int, peak_tflops: float, what: str
) -> float:
    if tokens_per_sec < 0 or gpus < 1 or peak_tflops <= 0:
        raise ValueError(
            f"tokens_per_sec={tokens_per_sec}, gpus={gpus}, peak_tflops={peak_tflops}: "
            "throughput must be >= 0, gpus >= 1 and the peak > 0"
        )
    seq_per_sec = tokens_per_sec / seq_len
    tflops_per_gpu = flops_per_seq * seq_per_sec / gpus / 1e12
    ratio = tflops_per_gpu / peak_tflops
    if ratio > 1.0:
        raise ImpossibleUtilization(tflops_per_gpu, peak_tflops, what)
    return ratio


def mpt_mfu(
    *,
    n_params: int,
    n_layers: int,
    d_model: int,
    seq_len: int,
    tokens_per_sec: float,
    gpus: int,
    peak_tflops: float,
) -> float:
    """MosaicML MFU (fraction): (3 x flops_per_seq + 3 x attn_flops_per_seq) x seq/s / (gpus x peak).

    `peak_tflops` is the dense peak per GPU in TFLOP/s (MPT's H100 tables use 989.4, A100 312).
    Raises ImpossibleUtilization above 1.
    """
    flops = mpt_flops_per_seq(
        n_params=n_params, n_layers=n_layers, d_model=d_model, seq_len=seq_len, passes=3
    )
    return _mpt_utilization(
        flops,
        seq_len=seq_len,
        tokens_per_sec=tokens_per_sec,
        gpus=gpus,
        peak_tflops=peak_tflops,
        what="MPT MFU",
    )


def mpt_hfu(
    *,
    n_params: int,
    n_layers: int,
    d_model: int,
    seq_len: int,
    tokens_per_sec: float,
    gpus: int,
    peak_tflops: float,
    activation_checkpointing: bool,
) -> float:
    """MosaicML HFU (fraction): as `mpt_mfu` with factor 4 instead of 3 when activations are checkpointed.

    Without checkpointing MosaicML's HFU equals its MFU. Raises ImpossibleUtilization above 1.
    """
    passes = 4 if activation_checkpointing else 3
    flops = mpt_flops_per_seq(
        n_params=n_params, n_layers=n_layers, d_model=d_model, seq_len=seq_len, passes=passes
    )
    return _mpt_utilization(
        flops,
        seq_len=seq_len,
        tokens_per_sec=tokens_per_sec,
        gpus=gpus,
        peak_tflops=peak_tflops,
        what="MPT HFU",
    )


def peak_tflops(hw: HardwareConfig, precision: Precision) -> float | None:
    """Dense peak TFLOP/s per device for `precision`; None when unknown or measured at run time.

    Hardware with peak_measured=True (generic CPUs) gets its peak from the trainer's matmul
    calibration, so no static figure is returned for it here.
    """
    if hw.peak_measured:
        return None
    return {
        Precision.bf16: hw.peak_tflops_bf16,
        Precision.fp16: hw.peak_tflops_fp16,
        Precision.fp32: hw.peak_tflops_fp32,
    }[Precision(precision)]


def achieved_tflops(flops_per_iteration: float, sec_per_iter: float, devices: int) -> float:
    """TFLOP/s per device: an iteration's FLOPs spread over `devices` for `sec_per_iter` seconds."""
    if not (math.isfinite(sec_per_iter) and sec_per_iter > 0):
        raise ValueError(f"sec_per_iter={sec_per_iter} is invalid: it must be a positive number of seconds")
    if devices < 1:
        raise ValueError(f"devices={devices} is invalid: it must be a positive integer")
    if not (math.isfinite(flops_per_iteration) and flops_per_iteration >= 0):
        raise ValueError(f"flops_per_iteration={flops_per_iteration} is invalid: it must be >= 0")
    return flops_per_iteration / (sec_per_iter * devices * 1e12)


def utilization(tflops_per_device: float, peak: float | None) -> float | None:
    """Achieved / peak as a fraction; None when the peak is unknown.

    Raises ImpossibleUtilization when above 1.0: more than 100% is an input error, never a result.
    """
    if peak is None:
        return None
    if not peak > 0:
        raise ValueError(f"peak={peak} is invalid: a known peak must be a positive number of TFLOP/s")
    ratio = tflops_per_device / peak
    if ratio > 1.0:
        raise ImpossibleUtilization(tflops_per_device, peak)
    return ratio


FLOPS_CONVENTIONS = {
    "model": "per-GEMM count, forward + 2x backward, no recompute (train.planner.flops); MFU and the log's TFLOPs",
    "hardware": "model FLOPs plus the recomputed forwards (train.planner.flops); basis of HFU",
    "megatron_eq3": "Narayanan et al. 2021 Eq. 3, as Megatron-DeepSpeed prints TFLOPs (compare to its logs)",
}
"""What each entry of `iteration_flops` counts, in words (a record keeps this beside the figures)."""


def iteration_flops(
    model: ModelConfig, par: ParallelismConfig, *, global_batch_size: int | None = None
) -> dict[str, float]:
    """FLOPs of one optimizer step of `global_batch_size` samples (default: the full batch), in each of
    FLOPS_CONVENTIONS: model (MFU), hardware (HFU, with recompute), megatron_eq3."""
    gbs = par.global_batch_size if global_batch_size is None else global_batch_size
    # The logits over the vocabulary as padded for this TP degree: the rows the devices multiply, and
    # the count the dry run and analysis.calc give the same layout.
    return {
        "model": model_flops_per_iteration(model, global_batch_size=gbs, tp=par.tp),
        "hardware": hardware_flops_per_iteration(model, global_batch_size=gbs, recompute=par.recompute, tp=par.tp),
        # Megatron-DeepSpeed applies its recompute factor 4 to any recompute, selective too.
        "megatron_eq3": megatron_eq3_flops_per_iteration(
            model, global_batch_size=gbs, full_recompute=par.recompute != Recompute.none, tp=par.tp
        ),
    }
