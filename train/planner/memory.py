"""Per-device memory of one training layout: model states, activations, optimizer temporaries.

Everything here is bytes on ONE device of the worst pipeline stage, for an Adam-family
optimizer. It is a planning model: it predicts which layouts cannot fit, it is not an
allocator trace. What it leaves out (the CUDA context, NCCL buffers, allocator
fragmentation, transient gradient-of-activation buffers, pipeline send/receive buffers)
is what `HardwareConfig.memory_reserve_gib` stands for.

Model states (bytes per parameter, before ZeRO sharding)
--------------------------------------------------------
bf16 / fp16 mixed precision with Adam, the 20 bytes/param of the Azure large-model guide
(seed 000, "Estimate Memory Requirements"):

    weights    2   16-bit parameter the forward and backward read
    gradients  2   16-bit gradient the backward writes
    optimizer 16   fp32 master parameter 4 + Adam moments (m, v) 8 + fp32 gradient copy 4

fp32 has no master copy and no second gradient: weights 4, gradients 4, optimizer 8 (moments).

Other stacks count differently and the difference matters when reading their measurements:
Megatron-LM with bf16 keeps only an fp32 gradient buffer (main_grad): 2 + 4 + 12 = 18 bytes;
DeepSpeed's BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation) keeps the fp32
gradient buffer for the WHOLE local model, unsharded, so its ZeRO-1 cost is 6 + 12/N, not
the 4 + 16/N below.

ZeRO over the N data-parallel ranks (what is divided by N at each stage)
-------------------------------------------------------------------------
    stage 0: nothing                                     2 + 2 + 16       (fp32: 4 + 4 + 8)
    stage 1: the optimizer field (fp32 master, moments,  2 + 2 + 16/N     (fp32: 4 + 4 + 8/N)
             fp32 gradient copy), as Megatron's distributed optimizer does for fp16 and DeepSpeed's
             ZeRO-1/2 optimizer does: each rank keeps and updates only its 1/N slice
    stage 2: + the 16-bit gradients                      2 + 18/N         (fp32: 4 + 12/N)
    stage 3: + the 16-bit parameters                     20/N             (fp32: 16/N)

The ZeRO paper (Rajbhandari et al. 2020, Figure 1) counts K = 12 optimizer bytes
(master + moments) and no fp32 gradient copy: 4 + 12/N, 2 + 14/N, 16/N. Ours is the paper's
plus exactly 4/N at every stage (the sharded fp32 gradient copy).

Sharding has a working set that the per-parameter figures miss: with stage 3 each rank
all-gathers a module's full 16-bit parameters before using it, and prefetches the next
(`_ZERO3_GATHERED_MODULES` = 2 of the stage's largest module); with stages 2 and 3 a
module's full gradients exist until they are reduce-scattered (`_ZERO_GRAD_BUCKET_MODULES`
= 1 largest module). Neither can exceed the unsharded size, and neither exists at N = 1.

Offload: `optimizer` keeps the optimizer field on the host (0 on the device, and the Adam
step runs there, so no temporaries); `params` (ZeRO-3 only) keeps the parameter shard on the
host too, leaving only the gathered working set on the device. `params` below stage 3 is an
invalid combination that validation reports; here it degrades to `optimizer` so that a
planner can still show a number.

Parameters per device
---------------------
A stage holds ceil(L / pp) layers (the largest stage when pp does not divide L). One layer on
one tensor-parallel rank: the column-parallel QKV and MLP-in weights and biases, and the
row-parallel projection and MLP-out weights, are split over t; the row-parallel biases and
both LayerNorms are replicated. The first stage adds the word embedding (padded vocabulary,
split over t) and the positions (replicated); the last stage adds the final LayerNorm (and
BERT's LM-head transform and its vocabulary-parallel bias) and, when pp > 1, its own copy of
the tied word embedding for the output layer (Megatron keeps one and all-reduces its
gradient with the first stage; with pp = 1 it is the same tensor). The copy is a real
parameter with gradients and optimizer states.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4, tensor parallelism without sequence parallelism)
-----------------------------------------------------------------------------
One layer, one micro-batch of b sequences of s tokens, width h, a heads, t TP ranks:

    none:      s*b*h*(10 + 24/t + 5*a*s/(h*t))   bytes
    selective: s*b*h*(10 + 24/t)                 (the attention core, 5*a*s^2*b/t, is recomputed)
    full:      2*s*b*h                           (only the layer's input is kept)

with 16-bit activations and 1-byte dropout masks. Of the 10: 8 are 16-bit tensors every TP
rank keeps whole (two LayerNorm inputs, QKV input, MLP input) and 2 are dropout masks; the
24/t are 16-bit (Q, K, V, projection input, GeLU input and output); of the 5*a*s/(h*t),
4 are the 16-bit softmax and dropout outputs and 1 the dropout mask. fp32 precision doubles
the 16-bit terms and leaves the masks at 1 byte. The formula assumes unfused attention
(the s^2 term is what FlashAttention removes, which is what selective recompute models).

While one layer is recomputed and back-propagated its working set is live again: for full
recompute the whole `none` figure of one layer on one micro-batch (less its input, which is
the stored checkpoint), for selective the attention core of one layer.

Pipeline (1F1B schedule): stage i (0-based) holds min(pp - i, m) micro-batches in flight,
m = global_batch / (micro_batch x dp). The first stage therefore stores ceil(L/pp) x
min(pp, m) layers' worth, about all L layers when m >= pp, which is Korthikanti's
observation that the first stage's activation memory does not shrink with pp.

Stage extras: the first stage keeps the embedding dropout mask (s*b*h bytes per micro-batch
in flight; the dropped-out embedding output is the first layer's input, already counted).
The last stage keeps, for its one micro-batch in flight, the final LayerNorm input and the
output layer's input (2 x 2*s*b*h, 16-bit; BERT's head adds its transform, GeLU and
LayerNorm inputs, 3 x 2*s*b*h) and the fp32 logits the cross-entropy keeps for its backward:
4*s*b*V/t bytes (padded V, vocabulary-parallel).

Optimizer temporaries
---------------------
A fused Adam (apex FusedAdam, torch fused=True) updates in one kernel per chunk: ~0 extra.
An unfused multi-tensor Adam (torch foreach, the default of torch.optim.Adam) materialises
whole-list temporaries (sqrt(v) + eps, and with L2 weight decay the decayed gradient):
assumed 2 x fp32 of the parameters this rank's optimizer steps (its ZeRO shard), because
foreach processes a whole parameter group at once and a transformer's largest group (the
weight-decayed matrices) is nearly all of them. Seed 001 measured the same 200B layout at
61 GB with torch.optim.Adam and 51 GB with apex FusedAdam on the first node.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from conf.schema import (
    HardwareConfig,
    ModelConfig,
    ModelKind,
    Offload,
    OptimizerImpl,
    ParallelismConfig,
    Precision,
    Recompute,
)
from train.planner.sizes import padded_vocab_size

GIB = 2**30

# Modules' worth of full parameters a ZeRO-3 rank holds gathered: the one in use and the one
# prefetched (DeepSpeed's stage3_prefetch_bucket_size keeps the next module in flight).
_ZERO3_GATHERED_MODULES = 2
# Modules' worth of full gradients a ZeRO-2/3 rank holds before reduce-scattering them.
_ZERO_GRAD_BUCKET_MODULES = 1
# fp32 copies of the optimizer's shard an unfused (foreach) Adam step materialises.
_UNFUSED_ADAM_TEMP_COPIES = 2
_FP32 = 4
_MASK = 1  # dropout masks are bool tensors


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter on one device for the model states, after ZeRO sharding and offload."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one device on the worst pipeline stage (all figures in bytes)."""

    weights: float
    """Parameters resident on the device (16-bit in mixed precision), incl. ZeRO-3's gathered working set."""
    gradients: float
    """Parameter gradients in the compute precision, incl. ZeRO-2/3's reduce bucket."""
    optimizer: float
    """Optimizer states: fp32 master copy, Adam moments, fp32 gradient copy (mixed precision)."""
    activations: float
    """Activations kept for the backward, with the recompute working set and the stage extras."""
    optimizer_temp: float
    """Temporaries of the Adam step (unfused implementations only)."""
    total: float
    """Sum of the above."""
    params_on_device: int
    """Parameters of this stage's tensor-parallel shard (before ZeRO sharding)."""
    stage: str
    """Which pipeline stage is the worst: 'only' (pp == 1), 'first', 'middle' or 'last'."""

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def as_gib_dict(self) -> dict[str, float | int | str]:
        """Components in GiB (rounded to 3 decimals), for tables and logs."""
        return {
            "weights_gib": round(self.weights / GIB, 3),
            "gradients_gib": round(self.gradients / GIB, 3),
            "optimizer_gib": round(self.optimizer / GIB, 3),
            "activations_gib": round(self.activations / GIB, 3),
            "optimizer_temp_gib": round(self.optimizer_temp / GIB, 3),
            "total_gib": round(self.total_gib, 3),
            "params_on_device": self.params_on_device,
            "stage": self.stage,
        }


def state_bytes_per_param(
    precision: Precision, zero_stage: int, dp: int, offload: Offload = Offload.none
) -> StateBytes:
    """Model-state bytes per parameter on one device (see the module docstring's ZeRO table).

    Excludes ZeRO's gathered working sets, which depend on module sizes (estimate_memory adds them).
    """
    _check_positive(dp=dp)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if Precision(precision) == Precision.fp32:
        weights, gradients, optimizer = 4.0, 4.0, 8.0
    else:
        weights, gradients, optimizer = 2.0, 2.0, 16.0
    if zero_stage >= 1:
        optimizer /= dp
    if zero_stage >= 2:
        gradients /= dp
    if zero_stage >= 3:
        weights /= dp
    if Offload(offload) != Offload.none:
        optimizer = 0.0
    if Offload(offload) == Offload.params and zero_stage == 3:
        weights = 0.0
    return StateBytes(weights=weights, gradients=gradients, optimizer=optimizer)


def layer_params_per_rank(model: ModelConfig, tp: int = 1) -> int:
    """Parameters of one transformer layer held by one TP rank (largest rank if t does not divide)."""
    _check_positive(tp=tp)
    h, f = model.hidden_size, model.ffn
    split = 3 * h * h + 3 * h + h * h + h * f + f + f * h  # column-parallel W and b, row-parallel W
    replicated = h + h + 2 * 2 * h  # row-parallel biases (added after the all-reduce), 2 LayerNorms
    return _ceil_div(split, tp) + replicated


def layer_activation_bytes(
    model: ModelConfig,
    *,
    micro_batch_size: int,
    tp: int = 1,
    precision: Precision = Precision.bf16,
    recompute: Recompute = Recompute.none,
) -> float:
    """Activation bytes one layer keeps for its backward, per micro-batch (Korthikanti et al. 2022)."""
    kept, core = _layer_terms(model, micro_batch_size, tp, precision)
    recompute = Recompute(recompute)
    if recompute == Recompute.none:
        return kept + core
    if recompute == Recompute.selective:
        return kept
    return _layer_input_bytes(model, micro_batch_size, precision)


def estimate_memory(
    model: ModelConfig, par: ParallelismConfig, *, dp: int, fused_optimizer: bool = True
) -> MemoryEstimate:
    """Peak bytes per device of the worst pipeline stage (formulas in the module docstring)."""
    _check_positive(dp=dp, tp=par.tp, pp=par.pp, micro_batch_size=par.mbs)
    pp = par.pp
    layers = math.ceil(model.num_layers / pp)
    micro_batches = max(1, par.global_batch_size // (par.mbs * dp))
    if pp == 1:
        candidates = [_stage_estimate(model, par, dp, fused_optimizer, "only", layers, 1)]
    else:
        candidates = [
            _stage_estimate(model, par, dp, fused_optimizer, "first", layers, min(pp, micro_batches)),
            _stage_estimate(model, par, dp, fused_optimizer, "last", layers, 1),
        ]
        if pp > 2:
            # Stage 1 is the fullest middle stage: the most micro-batches in flight after the first.
            candidates.append(
                _stage_estimate(model, par, dp, fused_optimizer, "middle", layers, min(pp - 1, micro_batches))
            )
    # Ties go to the earlier stage in the list (first before last), which is the more common report.
    return max(candidates, key=lambda e: e.total)


def usable_bytes(hw: HardwareConfig) -> float:
    """Device memory the planner lets a run use: capacity less the stated reserve."""
    return (hw.memory_gib - hw.memory_reserve_gib) * GIB


def predicts_oom(estimate: MemoryEstimate, hw: HardwareConfig) -> bool:
    """True when the estimate does not fit in the device's usable memory."""
    return estimate.total > usable_bytes(hw)


def _stage_estimate(
    model: ModelConfig,
    par: ParallelismConfig,
    dp: int,
    fused_optimizer: bool,
    stage: str,
    layers: int,
    in_flight: int,
) -> MemoryEstimate:
    tp = par.tp
    has_embedding = stage in ("first", "only")
    has_head = stage in ("last", "only")
    word_embedding = padded_vocab_size(model, tp) * model.hidden_size // tp
    layer = layer_params_per_rank(model, tp)

    params = layers * layer
    modules = [layer]
    if has_embedding:
        params += word_embedding + model.seq_length * model.hidden_size
        modules.append(word_embedding)
    if has_head:
        params += _head_params_per_rank(model, tp)
        if stage == "last":  # the tied output weight's own copy; with pp == 1 it is the embedding itself
            params += word_embedding
            modules.append(word_embedding)

    offload = Offload(par.offload)
    per_param = state_bytes_per_param(par.precision, par.zero_stage, dp, offload)
    full = state_bytes_per_param(par.precision, 0, 1)
    largest = max(modules)

    weights = params * per_param.weights
    if par.zero_stage == 3 and (dp > 1 or offload == Offload.params):
        weights = min(params * full.weights, weights + _ZERO3_GATHERED_MODULES * largest * full.weights)
    gradients = params * per_param.gradients
    if par.zero_stage >= 2 and dp > 1:
        gradients = min(params * full.gradients, gradients + _ZERO_GRAD_BUCKET_MODULES * largest * full.gradients)
    optimizer = params * per_param.optimizer

    activations = _stage_activations(model, par, layers, in_flight, has_embedding, has_head)

    optimizer_temp = 0.0
    if not fused_optimizer and offload == Offload.none:
        stepped = params / dp if par.zero_stage >= 1 else params
        optimizer_temp = _UNFUSED_ADAM_TEMP_COPIES * _FP32 * stepped

    total = weights + gradients + optimizer + activations + optimizer_temp
    return MemoryEstimate(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        optimizer_temp=optimizer_temp,
        total=total,
        params_on_device=params,
        stage=stage,
    )


def _stage_activations(
    model: ModelConfig, par: ParallelismConfig, layers: int, in_flight: int, has_embedding: bool, has_head: bool
) -> float:
    mbs, tp, precision = par.mbs, par.tp, par.precision
    recompute = Recompute(par.recompute)
    kept, core = _layer_terms(model, mbs, tp, precision)
    stored = layers * in_flight * layer_activation_bytes(
        model, micro_batch_size=mbs, tp=tp, precision=precision, recompute=recompute
    )
    # The layer being back-propagated has its recomputed part live again.
    if recompute == Recompute.full:
        stored += kept + core - _layer_input_bytes(model, mbs, precision)
    elif recompute == Recompute.selective:
        stored += core

    sbh = model.seq_length * mbs * model.hidden_size
    if has_embedding:
        stored += in_flight * _MASK * sbh
    if has_head:
        head_inputs = 5 if model.kind == ModelKind.bert else 2
        stored += head_inputs * _act_bytes(precision) * sbh
        stored += _FP32 * model.seq_length * mbs * padded_vocab_size(model, tp) / tp
    return stored


def _layer_terms(model: ModelConfig, mbs: int, tp: int, precision: Precision) -> tuple[float, float]:
    """(kept, core): one layer's activation bytes outside and inside the attention core."""
    _check_positive(micro_batch_size=mbs, tp=tp)
    w = _act_bytes(precision)
    s, h, a = model.seq_length, model.hidden_size, model.num_attention_heads
    sbh = s * mbs * h
    # Korthikanti's 10 + 24/t with the 16-bit parts (8 and 24/t) scaled to the activation width.
    kept = sbh * (8 * w / 2 + 2 * _MASK + 24 * w / 2 / tp)
    # Korthikanti's 5*a*s^2*b/t: softmax and dropout outputs (16-bit) and the dropout mask.
    core = a * s * s * mbs * (4 * w / 2 + _MASK) / tp
    return kept, core


def _layer_input_bytes(model: ModelConfig, mbs: int, precision: Precision) -> float:
    return _act_bytes(precision) * model.seq_length * mbs * model.hidden_size


def _act_bytes(precision: Precision) -> int:
    return 4 if Precision(precision) == Precision.fp32 else 2


def _head_params_per_rank(model: ModelConfig, tp: int) -> int:
    h = model.hidden_size
    final_norm = 2 * h
    if model.kind == ModelKind.bert:
        # The LM-head transform and its LayerNorm are replicated; the output bias is vocabulary-parallel.
        return final_norm + (h * h + h) + 2 * h + padded_vocab_size(model, tp) // tp
    return final_norm


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# A sweep plans thousands of layouts that share (model, parallelism, dp): memoise.


def _cache_key(par: ParallelismConfig) -> ParallelismConfig:
    # The ramp-up list makes the dataclass unhashable, and memory does not depend on it.
    return par if par.rampup_batch_size is None else dataclasses.replace(par, rampup_batch_size=None)


@functools.lru_cache(maxsize=1 << 16)
def _estimate_cached(model: ModelConfig, par: ParallelismConfig, dp: int) -> MemoryEstimate:
    # Only plain torch.optim.Adam (foreach) materialises whole-shard temporaries; `auto` picks a fused one.
    fused = OptimizerImpl(par.optimizer) != OptimizerImpl.torch
    return estimate_memory(model, par, dp=dp, fused_optimizer=fused)


def estimated_memory(model: ModelConfig, par: ParallelismConfig, dp: int) -> MemoryEstimate:
    """`estimate_memory` for this layout, memoised on its (frozen) arguments.

    The optimizer implementation decides `fused_optimizer`: only `torch` (foreach Adam) is unfused.
    """
    return _estimate_cached(model, _cache_key(par), dp)
