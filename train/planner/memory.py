"""Memory of one training rank, part by part, as the software that trains it holds it.

A planning model: it says which layouts cannot fit before an allocation is spent, and what each
rank will hold, component by component, so that every run can compare (train.memory measures the
same components and result.json holds both). Everything is bytes on ONE device (one rank).

Three software stacks, because the same layout costs different memory in each (`Stack`):

    megasweep           `python -m train`, engine=native (this trainer's own code)
    deepspeed           `python -m train`, engine=deepspeed (DeepSpeed's ZeRO on our model)
    megatron_deepspeed  Megatron-DeepSpeed as the BLOOM notes ran it in 2022 (seed 001): the stack
                        behind the published measurements that check this model

A rank's peak
-------------
    resident    weights + optimizer states + master copies + gradients (the model states)
    activations what the micro-batches in flight saved for their backward, the pipeline's buffers,
                the backward's working set, and gradient buffers held during backward
    transients  allocations of the reduction and optimizer step, after the activations are freed

    allocated   resident + max(activations, largest transient): live tensors at the worst moment.
                megasweep with one micro-batch per step: its loss backward runs before any gradient
                exists (the step sets them to None), so there the gradients join only the moments
                after it: resident - gradients + max(activations, gradients + what follows the loss
                backward, gradients + largest transient)
    reserved    what the allocator holds (a GPU's caching allocator; = allocated elsewhere). It
                keeps freed blocks and never merges blocks of different segments (PyTorch's "CUDA
                memory management" notes), so a flat transient larger than every cached activation
                block takes a segment of its own, while the transients, alive one after the other,
                reuse each other's (a cached block is split for a smaller request): resident +
                (activations + largest transient) / (1 - hardware.allocator_fragmentation), the
                fraction of what is allocated and freed during a step that fragmentation leaves
                unusable. When the device is full the allocator frees its cache and retries, so a
                reading never exceeds the device, and only `allocated` decides an out-of-memory
                (`predicts_oom`).
    overhead    memory outside the allocator (conf/hardware): the process's own
                (`process_overhead_gib`: CUDA context and kernel images, or a CPU process's
                resident set) and each communicator's buffers (`comm_buffer_gib`,
                `comm_buffer_pair_gib`: NCCL; 0 for gloo, whose buffers are host memory counted in
                the process)
    total       reserved + overhead: what nvidia-smi (or the process's resident set) shows at the peak

Model states (bytes per parameter P of this rank's shard; N = dp with ZeRO, else 1)
----------------------------------------------------------------------------------
megasweep keeps fp32 parameters in every precision (bf16/fp16 run under torch.autocast, which
casts GEMM operands to 16 bits on the fly) and steps them with AdamW:

    weights 4  gradients 4  optimizer 8 (Adam's two moments) + a 4-byte step counter per tensor
    ZeRO-1 (Megatron's distributed optimizer, train.dp): gradients 4/N (the reduced slice),
    optimizer 8/N, master 4/N (fp32 slice Adam updates) + a step counter per bucket; during
    backward the full flat buckets (4, padded to a multiple of N) exist until reduce-scattered.

Buckets come from train.planner.inventory.stage_buckets, the layout train.dp builds, so these
figures equal the tensors a rank holds (tests count them).

DeepSpeed (ZeRO stage 1/2 optimizer, deepspeed/runtime/zero/stage_1_and_2.py; mixed precision):

    weights 2  gradients 2 (16-bit .grad)  optimizer 8/N  master 4/N (fp32 partition)
    step transients, one after the other: the gradient norm, which DeepSpeed computes per gradient
    slice on a copy (`g.data.double().norm(2)` in get_grad_norm_direct, 8 bytes per element in
    2022, `grad_norm_copy_bytes`) of the largest slice; the partition's 16-bit gradients flattened
    (2/N) and converted to fp32 (4/N, the master's .grad during the step); with torch.optim.Adam
    (unfused) that fp32 gradient beside two fp32 temporaries (sqrt(v), the L2-decayed gradient:
    4 + 8 per N). Reduce: one bucket of reduce_bucket_size (5e8 elements, DeepSpeed's default)
    16-bit gradients when dp > 1. megasweep's own DeepSpeed engine (Stack.deepspeed, 5e7 elements)
    stages every gradient through contiguous buckets instead, at any dp (_gradient_bucket): held
    through each backward at ZeRO-1/2 (two with overlap_comm, on a GPU), resident at ZeRO-3.
    ZeRO-2 also divides the gradients (2/N) and holds one module's full gradients before
    reduce-scattering; ZeRO-3 divides the weights and gathers two modules (the one in use and the
    prefetched one). fp32: weights 4, gradients 4, the flat partition is already fp32.
    Offload: `optimizer` moves optimizer and master to the host (and the step with them);
    `params` (ZeRO-3) the weights too, leaving the gathered working set.

Activations, megasweep (train.model, measured per op with saved-tensor hooks on CPU)
--------------------------------------------------------------------------------------
One layer, one micro-batch of b sequences of s tokens, width h, ffn f, a heads, t TP ranks; the
residual stream is fp32 (the embeddings are fp32 and 16-bit outputs promote when added to it);
c = 4 bytes in fp32, 2 under autocast:

    2 LayerNorm inputs 4·sbh each, with their mean and rstd 2·4·bs each
    2 LayerNorm outputs as the next GEMM's input: 4·sbh in fp32 (the same tensor), c·sbh cast
    QKV output c·3sbh/t (SDPA saves q, k, v: views of it), SDPA output c·sbh/t (also the
    projection's input) and its log-sum-exp 4·b·(a/t)·s (SDPA's flash kernels store no s x s scores)
    MLP: GELU input and output c·sbf/t each

    none       all of the above
    selective  the attention core is recomputed: all but the log-sum-exp (SDPA stores no scores,
               so selective recompute saves little here)
    full       the layer's input, 4·sbh

Sequence parallel (train.parallel.apply_tp): the residual stream is a rank's s/t tokens, so the
LayerNorms' inputs and statistics (and the final norm's, and BERT's head transform up to its
LayerNorm), a full-recompute layer's input and the pipeline's stage boundary tensors divide by t.
The GEMM inputs do not: the QKV, MLP-in and output-layer GEMMs save the all-gathered c·sbh that
they multiply (Megatron saves the shard and gathers it again in backward; DTensor does not).

Under autocast each GEMM also saves its 16-bit weight copy (c·weights): once per autocast region,
and the trainer's regions hold one micro-batch (pp = 1) or one step (pipelines), so once per stage;
with full recompute only the output layer's copy is saved (the layers' are recast when recomputed).
First stage: the tokens and positions (int64). Last stage: the final LayerNorm (input, statistics,
output as above), the log-softmax output 4·bs·V/t (vocabulary-parallel: the softmax, a target
index, two masks), the labels; BERT's head adds its dense input, GELU input, LayerNorm and
decoder input.

Accumulation: when a micro-batch's backward ends, its largest weight's gradient (the word
embedding's on a first or last stage: a dense tensor the size of the weight) exists beside the
accumulated one before it is added to it (autograd keeps the first micro-batch's as it is), while
the other in-flight micro-batches' activations are still held: the peak is the larger of all
in-flight micro-batches with a layer's recompute working set, and the others with that gradient.

Pipeline (train.pipeline: Megatron's 1F1B; all forwards first when m < pp): stage i holds
min(pp - i, m) micro-batches in flight (m = micro-batches per step). Of each it keeps the received
input (the first layer's saved input, already counted) and its output until the backward (4·sbh,
non-last stages); while a backward runs, the gradient received for the output and the one sent for
the input (4·sbh each). Backward's working set also holds the fp32 gradient of the logits
on the last stage (4·bs·V/t: two of them, the log-softmax output's and its input's, under
F.cross_entropy at t = 1), and under full recompute one layer's recomputed activations.

Activations, megatron_deepspeed (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4; 16-bit, dropout masks 1 byte)
--------------------------------------------------------------------------------------------------
    none       s·b·h·(10 + 24/t + 5·a·s/(h·t))
    selective  s·b·h·(10 + 24/t)
    full       2·s·b·h (the layer input; BLOOM's runs used --checkpoint-activations)

plus the first stage's embedding dropout mask (s·b·h), the last stage's final-LN and output-layer
inputs (2·2·sbh) and fp32 logits (4·s·b·V/t), and, while one layer is recomputed, its whole `none`
working set. Sequence parallel divides the 10·sbh term by t too (s·b·h·34/t, the paper's Table 2). DeepSpeed's pipeline engine (deepspeed/runtime/pipe/engine.py) keeps each in-flight
micro-batch's stage output in its pipe buffers until the backward (2·sbh, non-last stages);
Megatron-LM's own schedule frees it (deallocate_output_tensor), DeepSpeed's did not.

Communicators (one NCCL communicator per process group a rank uses with more than one member)
---------------------------------------------------------------------------------------------
megasweep: the world group (record gathering), the DeviceMesh's tp, dp and pp groups, and the
first/last stages' tied-embedding pair. megatron_deepspeed: the world, Megatron's tp, dp and
model-parallel (tp x pp, gradient norm) groups, DeepSpeed's pipeline-group (loss broadcast), the
two-rank groups to the previous and next stage (p2p by broadcast) and the tied-embedding pair.
deepspeed: the world, tp and dp groups.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from conf.schema import (
    Engine,
    HardwareConfig,
    ModelConfig,
    ModelKind,
    Offload,
    OptimizerImpl,
    ParallelismConfig,
    Precision,
    Recompute,
)
from train.planner.inventory import (
    module_sizes,
    stage_buckets,
    stage_layers,
    stage_params,
    tied_word_embedding,
)
from train.planner.schedule import in_flight_peaks
from train.planner.sizes import padded_vocab_size

GIB = 2**30

_FP32 = 4
_INT64 = 8
_MASK = 1  # bool tensors and Megatron's dropout masks

DEEPSPEED_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default reduce_bucket_size (elements): one 16-bit bucket of these gradients is flattened
for the DP reduction (docs: deepspeed.ai/docs/config-json, zero_optimization.reduce_bucket_size)."""
MEGASWEEP_REDUCE_BUCKET = 50_000_000
"""The reduce_bucket_size megasweep's DeepSpeed engine is given (elements; train.ds_config writes it): a
tenth of DeepSpeed's default, whose staging buffers would dwarf a benchmark model on one accelerator."""
# Modules' worth of full parameters a ZeRO-3 rank holds gathered: the one in use and the one
# prefetched (DeepSpeed's stage3_prefetch_bucket_size keeps the next module in flight).
_ZERO3_GATHERED_MODULES = 2
# Modules' worth of full gradients a ZeRO-2/3 rank holds before reduce-scattering them.
_ZERO_GRAD_BUCKET_MODULES = 1


class Stack(str, Enum):
    """The software whose memory is modelled (module docstring)."""

    megasweep = "megasweep"
    deepspeed = "deepspeed"
    megatron_deepspeed = "megatron_deepspeed"


@dataclass(frozen=True)
class StackTraits:
    """What distinguishes the stacks' memory."""

    states: str
    """'megasweep' (fp32 parameters, AdamW, train.dp buckets) or 'deepspeed' (ZeRO's optimizer)."""
    activations: str
    """'megasweep' (train.model under SDPA, measured) or 'megatron' (Korthikanti et al.)."""
    pipeline: str | None
    """'megasweep' (train.pipeline), 'deepspeed' (its pipe engine), None (no pipelines)."""
    grad_norm_copy_bytes: int
    """Bytes per element of the copy the gradient norm makes of each gradient slice (0: no copy)."""


TRAITS = {
    Stack.megasweep: StackTraits("megasweep", "megasweep", "megasweep", 0),
    Stack.deepspeed: StackTraits("deepspeed", "megasweep", None, 4),
    Stack.megatron_deepspeed: StackTraits("deepspeed", "megatron", "deepspeed", 8),
}
"""DeepSpeed >= 0.10 takes the norm on an fp32 copy (`.to(get_norm_dtype())`), 2022's on a double."""


def stack_of(par: ParallelismConfig) -> Stack:
    """The stack `python -m train` runs a layout with."""
    return Stack.deepspeed if Engine(par.engine) == Engine.deepspeed else Stack.megasweep


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's predicted memory (bytes), component by component (module docstring)."""

    stack: str
    """The software modelled (Stack)."""
    stage: str
    """'only' (pp = 1), 'first', 'middle' or 'last'."""
    stage_index: int
    """0-based pipeline stage."""
    params_on_device: int
    """Parameters of this rank's stage and TP shard (before ZeRO divides anything)."""
    weights: float
    """Parameters the device holds (ZeRO-3: the partition and the gathered working set)."""
    gradients: float
    """Gradients when the optimizer steps (megasweep ZeRO-1: the reduced slices)."""
    optimizer: float
    """Optimizer states: Adam's moments and step counters."""
    master: float
    """fp32 master copies the optimizer updates (0 when it steps the parameters themselves)."""
    activations_per_micro_batch: float
    """What one micro-batch's forward saves for its backward on this stage (what saved-tensor hooks see)."""
    activations: float
    """At the peak: the in-flight micro-batches' saved tensors, the pipeline's buffers, the
    backward's working set and gradient buffers held during backward."""
    transients: tuple[tuple[str, float], ...]
    """Allocations of the reduction and the optimizer step, by name (each alive on its own)."""
    overhead: float
    """Outside the allocator: the process's own memory and communicator buffers."""
    allocated: float
    """Peak bytes held by tensors."""
    reserved: float
    """Peak bytes the allocator holds (>= allocated)."""

    @property
    def optimizer_temp(self) -> float:
        """The largest transient of the step."""
        return max((b for _, b in self.transients), default=0.0)

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.master

    @property
    def total(self) -> float:
        """reserved + overhead: what a device monitor shows at the peak."""
        return self.reserved + self.overhead

    @property
    def needed(self) -> float:
        """allocated + overhead: what must fit in the device."""
        return self.allocated + self.overhead

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def as_gib_dict(self) -> dict[str, float | int | str]:
        """Components in GiB (rounded to 3 decimals), for tables and logs."""
        gib = {
            "weights_gib": self.weights,
            "gradients_gib": self.gradients,
            "optimizer_gib": self.optimizer,
            "master_gib": self.master,
            "activations_gib": self.activations,
            "optimizer_temp_gib": self.optimizer_temp,
            "overhead_gib": self.overhead,
            "allocated_gib": self.allocated,
            "reserved_gib": self.reserved,
            "total_gib": self.total,
        }
        out: dict[str, float | int | str] = {k: round(v / GIB, 3) for k, v in gib.items()}
        out.update(params_on_device=self.params_on_device, stage=self.stage, stack=self.stack)
        return out


# ---------------------------------------------------------------------------------------------
# The public entry points.


def estimate_memory(
    model: ModelConfig,
    par: ParallelismConfig,
    *,
    dp: int,
    hardware: HardwareConfig | None = None,
    stack: Stack | None = None,
    fused_optimizer: bool | None = None,
) -> MemoryEstimate:
    """The rank that needs the most memory (first, middle or last stage; module docstring).

    `hardware` adds its overheads (none without it); `stack` defaults to what python -m train runs;
    `fused_optimizer` to par.optimizer (only `torch`, foreach AdamW, is unfused)."""
    _check_positive(dp=dp, tp=par.tp, pp=par.pp, micro_batch_size=par.mbs)
    m = _micro_batches(par, dp)
    if stack is None and fused_optimizer is None:
        # The sweep's path: memoised on the fields it reads (_worst_stage).
        return _worst_stage(model, _stage_key(par), dp, _memory_view(hardware), m)
    return _worst(
        stage_memory(model, par, dp=dp, stage=s, hardware=hardware, stack=stack, fused_optimizer=fused_optimizer)
        for s in _distinct_stages(par.pp, m)
    )


def _worst(candidates: Iterable[MemoryEstimate]) -> MemoryEstimate:
    # Ties go to the earlier stage (first before last), the more common report.
    return max(candidates, key=lambda e: e.needed)


def stage_memory(
    model: ModelConfig,
    par: ParallelismConfig,
    *,
    dp: int,
    stage: int = 0,
    hardware: HardwareConfig | None = None,
    stack: Stack | None = None,
    fused_optimizer: bool | None = None,
    micro_batches: int | None = None,
) -> MemoryEstimate:
    """One rank of pipeline stage `stage` (any of its TP and DP ranks: they hold the same)."""
    _check_positive(dp=dp, tp=par.tp, pp=par.pp, micro_batch_size=par.mbs)
    if par.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {par.zero_stage}")
    if not 0 <= stage < par.pp:
        raise ValueError(f"stage must be in [0, {par.pp}), got {stage}")
    stack = Stack(stack) if stack is not None else stack_of(par)
    traits = TRAITS[stack]
    if fused_optimizer is not None:
        fused = fused_optimizer
    elif stack == Stack.deepspeed:
        # megasweep's DeepSpeed engine steps with DeepSpeed's FusedAdam on a GPU, and with torch's AdamW
        # on a CPU (train.ds_config: torch_adam, deepspeed/runtime/engine.py's basic optimizer), whose
        # single-tensor loop makes temporaries (an offloaded step runs on the host: no device memory).
        fused = hardware is None or hardware.device_type != "cpu" or Offload(par.offload) != Offload.none
    else:
        fused = OptimizerImpl(par.optimizer) != OptimizerImpl.torch
    m = micro_batches if micro_batches is not None else _micro_batches(par, dp)
    tensors = _stage_tensors(model, par.tp, stage, par.pp)
    if traits.states == "megasweep":
        states = _megasweep_states(model, tensors, par, dp=dp, stage=stage, fused=fused)
    else:
        # On a CPU the host is the device: what ZeRO offloads stays in the same memory.
        host_is_device = hardware is not None and hardware.device_type == "cpu"
        states = _deepspeed_states(tensors, par, dp=dp, fused=fused, norm_copy=traits.grad_norm_copy_bytes,
                                   offload=Offload.none if host_is_device else Offload(par.offload),
                                   bucket=_gradient_bucket(stack, par, tensors.numel, host_is_device))  # fmt: skip
    acts = _activations_cached(model, _cache_key(par), traits, stage, _in_flight_key(par, stage, m))
    resident = states.weights + states.gradients + states.optimizer + states.master
    held = acts.peak + states.gradient_buffers
    allocated = resident + max([held, *(b for _, b in states.transients)])
    if traits.states == "megasweep" and m == 1 and acts.after_loss is not None:
        # One micro-batch per step: its forward and its loss backward, where the logit gradients
        # peak, run before any parameter gradient exists (train.loop sets them to None at each
        # step's start, and train.dp's buckets start empty), so those never add up. On an H100,
        # gpt_1.3b at mbs 8 and global batch 8 peaked 4.8 GiB (its fp32 gradients, 4.9) below the sum.
        # The backward then walks down the layers, each freeing what it saved as its gradients appear:
        # the activations peak at its first layer (beside the head's and that layer's gradients), the
        # gradients at its last (beside one layer's activations). On an H200, gpt_2.7b at mbs 8 peaked
        # 3.6 GiB (full recompute: 4.8) below all its gradients (9.9) beside the first layer's moment.
        grads = states.gradients
        per_element = grads / tensors.numel if tensors.numel else 0.0  # ZeRO-1: the reduced slice's share
        after = acts.after_loss + states.gradient_buffers
        first_layer = after + per_element * (tensors.head_numel + tensors.layer_numel)
        last_layer = after - max(acts.layers - 1, 0) * acts.per_layer + grads
        allocated = resident - grads + max([held, first_layer, last_layer, *(grads + b for _, b in states.transients)])
    reserved = allocated
    if hardware is not None and hardware.device_type == "cuda":
        # Cached activation blocks are too small for a flat transient, which takes its own segment;
        # the transients, one after the other, reuse each other's (a cached block is split for a
        # smaller request); fragmentation leaves part of what is allocated and freed unusable.
        dynamic = held + max((b for _, b in states.transients), default=0.0)
        reserved = resident + dynamic / (1.0 - hardware.allocator_fragmentation)
    overhead = _overhead(par, dp=dp, stage=stage, stack=stack, hardware=hardware)
    return MemoryEstimate(
        stack=stack.value,
        stage=_role(stage, par.pp),
        stage_index=stage,
        params_on_device=tensors.numel,
        weights=states.weights,
        gradients=states.gradients,
        optimizer=states.optimizer,
        master=states.master,
        activations_per_micro_batch=acts.per_micro_batch,
        activations=held,
        transients=states.transients,
        overhead=overhead,
        allocated=allocated,
        reserved=reserved,
    )


def usable_bytes(hw: HardwareConfig) -> float:
    """Device memory the planner lets a run use: capacity less the stated margin."""
    return (hw.memory_gib - hw.memory_reserve_gib) * GIB


def predicts_oom(estimate: MemoryEstimate, hw: HardwareConfig) -> bool:
    """True when the live tensors plus the overhead do not fit in the device's usable memory."""
    return estimate.needed > usable_bytes(hw)


def device_reading(estimate: MemoryEstimate, hw: HardwareConfig) -> float:
    """What a device monitor would show at the peak: the total, at most the device (the allocator
    frees its cache rather than fail)."""
    return min(estimate.total, hw.memory_gib * GIB)


# ---------------------------------------------------------------------------------------------
# A stage's tensors, summed once.


@dataclass(frozen=True)
class _StageTensors:
    """What the estimate reads of a stage's parameter list (inventory.stage_params), computed once
    per (model, tp, stage, stages): a sweep estimates thousands of layouts on the same stages, and
    walking a list of hundreds of tensors each time was most of a plan's time."""

    count: int
    """Tensors (each has its own step counter)."""
    numel: int
    """Elements of all of them."""
    largest: int
    """Elements of the largest tensor (0 without tensors)."""
    largest_module: int
    """Elements of the largest module's own tensors (inventory.module_sizes; 0 without tensors)."""
    gemm_numel: int
    """Elements of the GEMM operands (autocast's 16-bit copies)."""
    gemm_wte_numel: int
    """Elements of the word embedding's GEMM operand (the copy full recompute still saves)."""
    layer_numel: int
    """Elements of the stage's largest transformer layer (the gradients one layer backward makes)."""
    head_numel: int
    """Elements whose gradients a loss backward makes before the first layer backward: the last
    stage's final norm and output weight (the word embedding or its tied twin); 0 on other stages."""


@functools.lru_cache(maxsize=1 << 12)
def _stage_tensors(model: ModelConfig, tp: int, stage: int, num_stages: int) -> _StageTensors:
    params = stage_params(model, tp=tp, stage=stage, num_stages=num_stages)
    layers: dict[str, int] = {}
    for p in params:
        if p.name.startswith("layers."):
            key = p.name.split(".", 2)[1]
            layers[key] = layers.get(key, 0) + p.numel
    last = stage == num_stages - 1
    return _StageTensors(
        count=len(params),
        numel=sum(p.numel for p in params),
        largest=max((p.numel for p in params), default=0),
        largest_module=max(module_sizes(params), default=0),
        gemm_numel=sum(p.numel for p in params if p.gemm),
        gemm_wte_numel=sum(p.numel for p in params if p.gemm and "wte" in p.name),
        layer_numel=max(layers.values(), default=0),
        head_numel=sum(p.numel for p in params if not p.name.startswith(("layers.", "wpe."))) if last else 0,
    )


@functools.lru_cache(maxsize=1 << 12)
def _bucket_numels(model: ModelConfig, tp: int, stage: int, num_stages: int) -> tuple[int, ...]:
    """Elements of each fp32 gradient bucket train.dp builds for this stage, before padding.

    Which tensors share a bucket does not depend on dp (only bytes and dtypes decide), so the
    buckets are planned once per stage and padded for each dp (_bucket_totals)."""
    params = stage_params(model, tp=tp, stage=stage, num_stages=num_stages)
    tied = tied_word_embedding(stage=stage, num_stages=num_stages)
    return tuple(b.numel for b in stage_buckets(params, dp=1, element_bytes=_FP32, tied=tied))


@functools.lru_cache(maxsize=1 << 14)
def _bucket_totals(model: ModelConfig, tp: int, stage: int, num_stages: int, dp: int) -> tuple[int, int]:
    """(padded elements, buckets) of this stage's buckets at this dp: each bucket's elements rounded
    up to a multiple of dp, as inventory.BucketPlan.padded."""
    numels = _bucket_numels(model, tp, stage, num_stages)
    return sum(-(-n // dp) * dp for n in numels), len(numels)


# ---------------------------------------------------------------------------------------------
# Model states.


@dataclass(frozen=True)
class _States:
    weights: float
    gradients: float
    optimizer: float
    master: float
    gradient_buffers: float
    """Gradient bytes held during backward on top of `gradients` (megasweep ZeRO-1's flat buckets)."""
    transients: tuple[tuple[str, float], ...]


def _megasweep_states(
    model: ModelConfig, tensors: _StageTensors, par: ParallelismConfig, *, dp: int, stage: int, fused: bool
) -> _States:
    total = tensors.numel
    weights = _FP32 * total
    if dp == 1:  # no reduction: each parameter's own .grad
        gradients, buffers = float(_FP32 * total), 0.0
        optimizer, master = 8.0 * total + _FP32 * tensors.count, 0.0
        stepped = total
    else:
        padded, buckets = _bucket_totals(model, par.tp, stage, par.pp, dp)
        if par.zero_stage >= 1:
            # Megatron's distributed optimizer: reduced slices, fp32 main slices, Adam on the slices.
            gradients, buffers = float(_FP32 * padded // dp), float(_FP32 * padded)
            optimizer = 8.0 * padded / dp + _FP32 * buckets
            master = float(_FP32 * padded // dp)
            stepped = padded // dp
        else:  # the reduced flat buckets back the parameters' gradients
            gradients, buffers = float(_FP32 * padded), 0.0
            optimizer, master = 8.0 * total + _FP32 * tensors.count, 0.0
            stepped = total
    # foreach AdamW (torch's multi-tensor path) materialises sqrt(v) for the whole list it steps.
    transients = () if fused else (("foreach Adam's sqrt(v)", float(_FP32 * stepped)),)
    return _States(weights, gradients, optimizer, master, buffers, transients)


def _gradient_bucket(stack: Stack, par: ParallelismConfig, numel: float, host_is_device: bool) -> float | None:
    """Bytes of the contiguous-gradient bucket megasweep's DeepSpeed engine stages its reductions in
    (train.ds_config: contiguous_gradients, and overlap_comm off a CPU), at any dp: ZeRO-1/2 allocate
    reduce_bucket_size elements of the gradients' dtype at a backward's first gradient, a second with
    overlap_comm, and free them at its end (deepspeed/runtime/zero/stage_1_and_2.py, setup_buckets and
    _release_ipg_buffers); ZeRO-3 one, for good, at start-up (stage3.py). torch.empty: a GPU allocates
    all of it; on a CPU only the pages the gradients are copied into become resident (at most this
    stage's). None where the dp > 1 reduce bucket stands for it: ZeRO-0 (the engine's all-reduce), and
    Megatron-DeepSpeed, whose 2022 buffers nothing here measured."""
    if stack != Stack.deepspeed or par.zero_stage == 0:
        return None
    c = _act_bytes(par.precision)  # the gradients' dtype
    if host_is_device:
        return float(c * min(MEGASWEEP_REDUCE_BUCKET, numel))
    return float(c * MEGASWEEP_REDUCE_BUCKET * (2 if par.zero_stage < 3 else 1))


def _deepspeed_states(
    tensors: _StageTensors,
    par: ParallelismConfig,
    *,
    dp: int,
    fused: bool,
    norm_copy: int,
    offload: Offload,
    bucket: float | None = None,
) -> _States:
    """`offload`: what ZeRO moves off the device (par.offload, or none where the host is the device);
    `bucket`: _gradient_bucket's bytes, None for the dp > 1 reduce bucket instead."""
    total = tensors.numel
    c = _act_bytes(par.precision)
    n = dp if par.zero_stage >= 1 else 1
    largest_module = tensors.largest_module
    weights = float(c * total)
    if par.zero_stage == 3:
        partition = 0.0 if offload == Offload.params else c * total / dp
        weights = partition
        if dp > 1 or offload == Offload.params:  # the gathered modules (none to gather at dp = 1)
            weights = min(c * total, partition + _ZERO3_GATHERED_MODULES * largest_module * c)
    gradients = float(c * total)
    if par.zero_stage >= 2 and dp > 1:
        gradients = min(c * total, c * total / dp + _ZERO_GRAD_BUCKET_MODULES * largest_module * c)
    optimizer, master = 8.0 * total / n, _FP32 * total / n
    if par.zero_stage == 0 and c == _FP32:
        # No ZeRO and no mixed precision: DeepSpeed wraps no optimizer around the base one, which steps
        # the fp32 weights themselves (deepspeed/runtime/engine.py, _configure_optimizer).
        master = 0.0
    transients: list[tuple[str, float]] = []
    if offload != Offload.none:
        optimizer = master = 0.0  # and the step runs on the host
    elif par.zero_stage == 0 and not fused:
        # No flat partition: the gradients' all-reduce flattens a bucket of them (engine.py's
        # allreduce_bucket, at any dp), and torch's AdamW steps one tensor at a time, its temporaries
        # (sqrt(v) and its bias-corrected quotient) the size of the tensor it steps; a 16-bit run's
        # wrapper first copies every gradient to fp32 (runtime/fp16/unfused_optimizer.py).
        if norm_copy:
            transients.append(("gradient-norm copy", norm_copy * tensors.largest))
        transients.append(("gradients flattened for the all-reduce", c * min(DEEPSPEED_REDUCE_BUCKET, total)))
        fp32_grads = _FP32 * total if c != _FP32 else 0.0
        transients.append(("unfused AdamW's per-tensor temporaries", fp32_grads + 2 * _FP32 * tensors.largest))
    else:
        partition = total / n
        if norm_copy:
            transients.append(("gradient-norm copy", norm_copy * min(tensors.largest, partition)))
        # The partition's gradients flattened, then converted to fp32 (both alive during the conversion).
        flat = c * partition + (_FP32 * partition if c != _FP32 else 0.0)
        transients.append(("fp32 gradient partition and its flat source", flat))
        if not fused:  # torch.optim.Adam beside the fp32 gradient: sqrt(v) and the L2-decayed gradient
            transients.append(("fp32 gradient partition and unfused Adam's temporaries", 3 * _FP32 * partition))
    buffers = 0.0
    if bucket is None:
        if dp > 1:
            transients.append(("reduce bucket", c * min(DEEPSPEED_REDUCE_BUCKET, total)))
    elif par.zero_stage == 3:
        gradients += bucket  # allocated at start-up, beside the gradient partition, for good
    else:
        buffers = bucket  # held through each backward, beside its activations
    return _States(weights, gradients, optimizer, master, buffers, tuple(transients))


# ---------------------------------------------------------------------------------------------
# Activations.


@dataclass(frozen=True)
class _Activations:
    per_micro_batch: float
    peak: float
    after_loss: float | None = None
    """megasweep: the peak of the moments from a loss backward's first layer backward on, when a step
    of one micro-batch has made gradients (its forward's end and its loss backward come before any;
    None for the other stacks)."""
    per_layer: float = 0.0
    """megasweep 1F1B: what one layer saves per micro-batch (its backward frees it)."""
    layers: int = 0
    """megasweep 1F1B: the stage's layers; 0 where the backward's walk down them is not modelled."""


def _activations(
    model: ModelConfig, par: ParallelismConfig, traits: StackTraits, *, stage: int, micro_batches: int,
    tensors: _StageTensors,
) -> _Activations:
    if par.virtual_stages > 1 and par.pp > 1:
        return _interleaved_activations(model, par, traits, stage=stage, micro_batches=micro_batches, tensors=tensors)
    pp, m = par.pp, micro_batches
    in_flight = min(pp - stage, m)
    first, last = stage == 0, stage == pp - 1
    layers = len(stage_layers(model.num_layers, stage=stage, num_stages=pp))
    b, s, h = par.mbs, model.seq_length, model.hidden_size
    sbh = s * b * h
    boundary = sbh / _seq_shards(par)  # a stage's input or output: its tokens of the residual stream
    vocab_shard = s * b * padded_vocab_size(model, par.tp) / par.tp
    recompute = Recompute(par.recompute)
    if traits.activations == "megasweep":
        per_layer, working = _megasweep_layer(model, par, recompute)
        extras = _megasweep_ends(model, par, first=first, last=last)
        c = _act_bytes(par.precision)
        copies = 0.0
        if c != _FP32:  # autocast's 16-bit GEMM operand copies, saved once per stage
            copies = c * (tensors.gemm_numel if recompute != Recompute.full else tensors.gemm_wte_numel)
        stored = layers * per_layer + extras
        per_mb = stored + copies
        backward = _with_accumulation(in_flight, stored, working * (layers > 0), tensors.largest, _FP32, m) + copies
        before = 0.0  # the moments of a step's first micro-batch before any gradient exists
        if recompute == Recompute.full and c != _FP32:
            # Autocast caches each weight's 16-bit copy until its region ends, so a forward's end holds
            # every GEMM weight's copy (after it, full recompute keeps only the word embedding's): on
            # an H100, gpt_1.3b mbs 1 peaked there, 1.4 GiB above the loss backward's moment.
            before = in_flight * stored + c * tensors.gemm_numel
        if last:
            # A loss backward's logit gradients are freed by the hidden state's gradient before any
            # layer backward (and its recompute) runs, and before a backward's last gradient is
            # accumulated: a moment of its own, with the in-flight micro-batches' saved tensors.
            before = max(before, in_flight * stored + copies + _FP32 * vocab_shard * _loss_backward_logit_grads(par.tp))
        buffers = _pipeline_buffers(boundary, in_flight=in_flight, first=first, last=last) if pp > 1 and traits.pipeline == "megasweep" else 0.0
        return _Activations(per_mb, max(backward, before) + buffers, backward + buffers, per_layer, layers)
    # Megatron (Korthikanti et al.), 16-bit activations and 1-byte dropout masks.
    kept, core = _korthikanti_terms(model, par)
    w = _act_bytes(par.precision)
    per_layer = {Recompute.none: kept + core, Recompute.selective: kept, Recompute.full: w * boundary}[recompute]
    stored = layers * per_layer
    if first:
        stored += _MASK * sbh  # the embedding's dropout mask
    if pp > 1 and not last and traits.pipeline == "deepspeed":
        stored += w * boundary  # the stage output DeepSpeed's pipe buffers keep until the backward
    working = {Recompute.none: 0.0, Recompute.selective: core, Recompute.full: kept + core - w * boundary}[recompute]
    peak = _with_accumulation(in_flight, stored, working, tensors.largest, w, m)
    if last:
        head_inputs = 5 if model.kind == ModelKind.bert else 2
        peak += head_inputs * w * sbh + _FP32 * vocab_shard
    per_mb = stored + (2 * w * sbh + _FP32 * vocab_shard if last else 0.0)
    return _Activations(per_mb, peak)


def _in_flight_key(par: ParallelismConfig, stage: int, micro_batches: int) -> int:
    """The micro-batch count as far as a stage's activations tell: 1F1B reads it only through
    min(pp - stage, m) and m > 1, which min(m, pp - stage + 1) keeps, so the layouts of a sweep that
    differ in dp or global batch share the activations; the interleaved schedule reads all of it."""
    if par.virtual_stages > 1 and par.pp > 1:
        return micro_batches
    return min(micro_batches, par.pp - stage + 1)


@functools.lru_cache(maxsize=1 << 16)
def _activations_cached(
    model: ModelConfig, par: ParallelismConfig, traits: StackTraits, stage: int, micro_batches: int
) -> _Activations:
    # Frozen, shared: stage_memory only reads it.
    tensors = _stage_tensors(model, par.tp, stage, par.pp)
    return _activations(model, par, traits, stage=stage, micro_batches=micro_batches, tensors=tensors)


def _interleaved_activations(
    model: ModelConfig, par: ParallelismConfig, traits: StackTraits, *, stage: int, micro_batches: int,
    tensors: _StageTensors,
) -> _Activations:
    """Activations of a rank of the interleaved schedule (train.planner.schedule): what is in flight
    is counted in (micro-batch, chunk) units, each 1/v of the rank's layers. Rank r starts its
    first backward after 2(p-1-r) + (v-1)p forwards, so the first rank holds (v+1)p - 1 units:
    L/p·(1 + (p-1)/(p·v)) layers' worth of micro-batches, against L/p·p for 1F1B (the factor
    Korthikanti et al. 2022, section 4.2.3, give for the interleaved schedule's first stage). The
    schedule's own in-flight counts are used, so the embedding (chunk 0 of the first rank) and the
    head (chunk v-1 of the last) are counted for as many units of their chunk as are in flight."""
    pp, v = par.pp, par.virtual_stages
    first, last = stage == 0, stage == pp - 1
    chunk = len(stage_layers(model.num_layers, stage=stage, num_stages=pp)) / v  # layers per unit
    b, s, h = par.mbs, model.seq_length, model.hidden_size
    sbh = s * b * h
    boundary = sbh / _seq_shards(par)
    vocab_shard = s * b * padded_vocab_size(model, par.tp) / par.tp
    recompute = Recompute(par.recompute)
    if traits.activations == "megasweep":
        per_layer, working = _megasweep_layer(model, par, recompute)
        c = _act_bytes(par.precision)
        head_extra = _megasweep_ends(model, par, first=False, last=last)
        embed_extra = _megasweep_ends(model, par, first=first, last=False)
        grad_bytes = _FP32
    else:
        kept, core = _korthikanti_terms(model, par)
        c = w = _act_bytes(par.precision)
        per_layer = {Recompute.none: kept + core, Recompute.selective: kept, Recompute.full: w * boundary}[recompute]
        working = {Recompute.none: 0.0, Recompute.selective: core, Recompute.full: kept + core - w * boundary}[recompute]
        embed_extra = _MASK * sbh if first else 0.0
        head_extra = 2 * w * sbh + _FP32 * vocab_shard if last else 0.0
        grad_bytes = w
    copies = 0.0
    if traits.activations == "megasweep" and c != _FP32:  # autocast's 16-bit GEMM copies, once per step
        copies = c * (tensors.gemm_numel if recompute != Recompute.full else tensors.gemm_wte_numel)
    unit = chunk * per_layer
    per_mb = v * unit + embed_extra + head_extra
    if traits.activations == "megasweep":
        per_mb += copies
    largest = tensors.largest if micro_batches > 1 else 0
    peak = 0.0
    for units, chunk0, chunk_last in in_flight_peaks(rank=stage, pp=pp, virtual_stages=v, micro_batches=micro_batches):
        held = units * unit + chunk0 * embed_extra + chunk_last * head_extra
        # As _with_accumulation: one unit's recompute working set, or, as a backward ends, the
        # others beside the largest weight's gradient before it is accumulated.
        at = max(held + working * (chunk > 0), held - unit + grad_bytes * largest)
        if traits.pipeline == "megasweep":
            # Each unit's output until its backward (not the loss's), and a gradient received and sent.
            outputs = units - (chunk_last if last else 0)
            at += (outputs + 2) * _FP32 * boundary
        peak = max(peak, at)
    peak += copies
    if not last:
        return _Activations(per_mb, peak)
    if traits.activations == "megasweep":
        # Counted beside the interleaved peak (whichever moment it is), as it once was for 1F1B.
        return _Activations(per_mb, peak + _FP32 * vocab_shard * _loss_backward_logit_grads(par.tp), peak)
    return _Activations(per_mb, peak + _FP32 * vocab_shard)  # the fp32 gradient of the logits


def _with_accumulation(
    in_flight: int, stored: float, working: float, largest_numel: int, grad_bytes: int, micro_batches: int
) -> float:
    """Activations at the peak: all in-flight micro-batches with one layer's recompute working set,
    or, when a micro-batch's backward ends, the others with its largest weight's gradient before it
    is added to the accumulated one (the word embedding's, on a first or last stage: a dense
    gradient the size of the weight; the first micro-batch's is kept as it is, so only m > 1)."""
    largest = largest_numel if micro_batches > 1 else 0
    return max(in_flight * stored + working, (in_flight - 1) * stored + grad_bytes * largest)


def _megasweep_layer(model: ModelConfig, par: ParallelismConfig, recompute: Recompute) -> tuple[float, float]:
    """(bytes one layer saves per micro-batch, the extra working set of its recompute)."""
    b, s, h, t = par.mbs, model.seq_length, model.hidden_size, par.tp
    sbh, bs = s * b * h, s * b
    c = _act_bytes(par.precision)
    heads = model.num_attention_heads // t
    local = _seq_shards(par)  # sequence parallel: the residual stream holds s / t tokens
    norm_inputs = 2 * (_FP32 * sbh + 2 * _FP32 * bs) / local  # fp32 residual in, mean and rstd
    gemm_inputs = 2 * c * sbh  # the two LayerNorm outputs the QKV and MLP-in GEMMs read
    attention = c * 3 * sbh / t + c * sbh / t  # QKV output (q, k, v views), SDPA output
    lse = _FP32 * b * heads * s
    mlp = 2 * c * s * b * model.ffn / t  # GELU input and output
    none = norm_inputs + gemm_inputs + attention + lse + mlp
    if recompute == Recompute.none:
        return none, 0.0
    if recompute == Recompute.selective:
        return none - lse, lse
    return _FP32 * sbh / local, none - _FP32 * sbh / local


def _loss_backward_logit_grads(tp: int) -> int:
    """fp32 logit-sized gradients alive at once when backward starts at the loss, beyond the saved
    log-softmax output. F.cross_entropy (tp = 1) is log_softmax then nll_loss: nll_loss's backward
    makes a dense gradient of the log-softmax output, and log_softmax's backward then makes the
    gradient of its input beside it, two b·s·V fp32 tensors (the CUDA allocator's history of an
    H100 run shows both, tests/bench/results/gpu/). The vocabulary-parallel loss (tp > 1) computes
    its softmax gradient from the saved softmax in one tensor."""
    return 2 if tp == 1 else 1


def _megasweep_ends(model: ModelConfig, par: ParallelismConfig, *, first: bool, last: bool) -> float:
    """Per micro-batch: the first stage's token and position indices, the last stage's final norm,
    head and loss."""
    b, s, h, t = par.mbs, model.seq_length, model.hidden_size, par.tp
    sbh, bs = s * b * h, s * b
    c = _act_bytes(par.precision)
    vocab_shard = bs * padded_vocab_size(model, t) / t
    out = 0.0
    if first:
        out += _INT64 * bs + _INT64 * s  # token ids, positions
        if t > 1:
            out += _MASK * bs  # the vocabulary-parallel lookup's mask of this rank's tokens
    if last:
        local = _seq_shards(par)  # sequence parallel: per-token work on s / t tokens until the logits
        out += (_FP32 * sbh + 2 * _FP32 * bs) / local  # final norm: input, statistics
        if model.kind == ModelKind.bert:
            # final norm output (dense input), dense output (GELU input), GELU output (LayerNorm
            # input, fp32), statistics; then the LN output the decoder GEMM reads, gathered
            out += (c * sbh + c * sbh + _FP32 * sbh + 2 * _FP32 * bs) / local + c * sbh
        else:
            out += c * sbh  # the final norm output the output-layer GEMM reads, gathered
        if t > 1:
            out += _FP32 * vocab_shard + _INT64 * bs + 2 * _MASK * bs  # softmax, index, two masks
        else:
            out += _FP32 * vocab_shard + _INT64 * bs + _FP32  # log-softmax output, labels, weight sum
    return out


def _pipeline_buffers(sbh: float, *, in_flight: int, first: bool, last: bool) -> float:
    """train.pipeline's tensors beyond the saved activations: each in-flight micro-batch's output, and
    during a backward the gradients received for the output and sent for the input (fp32)."""
    out = 0.0
    if not last:
        out += (in_flight + 1) * _FP32 * sbh
    if not first:
        out += _FP32 * sbh
    return out


def _korthikanti_terms(model: ModelConfig, par: ParallelismConfig) -> tuple[float, float]:
    """(kept, core): one layer's activation bytes outside and inside the attention core."""
    w = _act_bytes(par.precision)
    s, h, a, mbs, tp = model.seq_length, model.hidden_size, model.num_attention_heads, par.mbs, par.tp
    sbh = s * mbs * h
    # The norms', dropouts' and residual's 10·sbh (16-bit) are sharded too under sequence parallel.
    kept = sbh * ((8 * w / 2 + 2 * _MASK) / _seq_shards(par) + 24 * w / 2 / tp)
    core = a * s * s * mbs * (4 * w / 2 + _MASK) / tp
    return kept, core


def _seq_shards(par: ParallelismConfig) -> int:
    """Over how many ranks the residual stream's tokens are split: tp under sequence parallel, else 1."""
    return par.tp if par.sequence_parallel else 1


def _act_bytes(precision: Precision) -> int:
    return _FP32 if Precision(precision) == Precision.fp32 else 2


# ---------------------------------------------------------------------------------------------
# Overheads.


def communicators(par: ParallelismConfig, *, dp: int, stage: int, stack: Stack) -> list[int]:
    """Sizes of the communicators (process groups of more than one rank) a rank of `stage` uses."""
    tp, pp = par.tp, par.pp
    ends = stage in (0, pp - 1)
    sizes = [dp * tp * pp, tp, dp]
    if stack == Stack.megasweep:
        sizes += [pp] + ([2] if pp > 1 and ends else [])
    elif stack == Stack.megatron_deepspeed:
        sizes += [tp * pp]
        if pp > 1:
            neighbours = (stage > 0) + (stage < pp - 1)
            sizes += [pp] + [2] * neighbours + ([2] if ends else [])
    return [n for n in sizes if n > 1]


def _overhead(
    par: ParallelismConfig, *, dp: int, stage: int, stack: Stack, hardware: HardwareConfig | None
) -> float:
    if hardware is None:
        return 0.0
    comms = communicators(par, dp=dp, stage=stage, stack=stack)
    buffers = sum(hardware.comm_buffer_pair_gib if n == 2 else hardware.comm_buffer_gib for n in comms)
    return (hardware.process_overhead_gib + buffers) * GIB


# ---------------------------------------------------------------------------------------------
# Helpers.


def _micro_batches(par: ParallelismConfig, dp: int) -> int:
    return max(1, par.global_batch_size // (par.mbs * dp))


def _distinct_stages(pp: int, m: int) -> list[int]:
    """The stages whose memory can differ: first, the fullest middle one, last."""
    return sorted({0, min(1, pp - 1), pp - 1})


def _role(stage: int, pp: int) -> str:
    if pp == 1:
        return "only"
    return "first" if stage == 0 else "last" if stage == pp - 1 else "middle"


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# A sweep plans thousands of layouts that share a model, most parallelism fields and the devices'
# overheads (its devices differ in capacity and speed, which memory does not read): memoise on the
# fields that are read, so layouts that differ in the others share one estimate.


_STAGE_FIELDS = (
    "tp", "pp", "micro_batch_size", "zero_stage", "offload", "recompute", "sequence_parallel", "precision", "engine",
    "optimizer", "virtual_stages",
)  # fmt: skip
"""The fields of a ParallelismConfig that stage_memory reads once given the micro-batch count (_stage_key)."""
_STAGE_FIELD_SET = frozenset(_STAGE_FIELDS)


def parallelism_subset(par: ParallelismConfig, fields: Iterable[str]) -> ParallelismConfig:
    """`par` with only `fields` kept, the others at their defaults: the key of a memo that reads only those
    fields, which layouts differing elsewhere share (here, and in train.planner.perf)."""
    return ParallelismConfig(**{name: getattr(par, name) for name in fields})


def _stage_key(par: ParallelismConfig) -> ParallelismConfig:
    """The fields of `par` that stage_memory reads once given the micro-batch count; the others
    (dp, which comes as its own argument, the global batch and its ramp-up) at their defaults."""
    return parallelism_subset(par, _STAGE_FIELDS)


_View = tuple[str, float, float, float, float] | None
"""The figures of a device that stage_memory reads, as a key (a tuple hashes faster than the device's thirty)."""


def _memory_view(hw: HardwareConfig | None) -> _View:
    """The figures of `hw` that stage_memory reads (devices of a sweep often share them all)."""
    if hw is None:
        return None
    return (hw.device_type, hw.process_overhead_gib, hw.comm_buffer_gib, hw.comm_buffer_pair_gib, hw.allocator_fragmentation)


@functools.lru_cache(maxsize=1 << 8)
def _viewed_hardware(view: _View) -> HardwareConfig | None:
    """A device with those figures and every other field at its default."""
    if view is None:
        return None
    device_type, process, buffers, pairs, fragmentation = view
    return HardwareConfig(
        name="",
        device_type=device_type,
        process_overhead_gib=process,
        comm_buffer_gib=buffers,
        comm_buffer_pair_gib=pairs,
        allocator_fragmentation=fragmentation,
    )


@functools.lru_cache(maxsize=1 << 16)
def _worst_stage(
    model: ModelConfig, key: ParallelismConfig, dp: int, view: _View, micro_batches: int
) -> MemoryEstimate:
    return _worst(_stage_cached(model, key, dp, s, view, micro_batches) for s in _distinct_stages(key.pp, micro_batches))


@functools.lru_cache(maxsize=1 << 16)
def _stage_cached(
    model: ModelConfig, key: ParallelismConfig, dp: int, stage: int, view: _View, micro_batches: int
) -> MemoryEstimate:
    return stage_memory(model, key, dp=dp, stage=stage, hardware=_viewed_hardware(view), micro_batches=micro_batches)


@functools.lru_cache(maxsize=1 << 16)
def _changed_key(key: ParallelismConfig, change: tuple[tuple[str, Any], ...]) -> ParallelismConfig:
    # The fix search tries the same changes of one layout on each device of a sweep: copy once.
    return dataclasses.replace(key, **dict(change))


def _cache_key(par: ParallelismConfig) -> ParallelismConfig:
    # The ramp-up list makes the dataclass unhashable, and memory does not depend on it.
    return par if par.rampup_batch_size is None else dataclasses.replace(par, rampup_batch_size=None)


@functools.lru_cache(maxsize=1 << 16)
def _estimate_cached(model: ModelConfig, par: ParallelismConfig, dp: int, hw: HardwareConfig | None) -> MemoryEstimate:
    # A lookup on the arguments as given: the rules and the row ask for the same layout's estimate.
    return estimate_memory(model, par, dp=dp, hardware=hw)


def estimated_variants(
    model: ModelConfig, par: ParallelismConfig, dp: int, hardware: HardwareConfig | None = None
) -> Callable[..., MemoryEstimate]:
    """`variant(**change)`: estimated_memory(model, dataclasses.replace(par, **change), dp, hardware), the same
    memoised estimate, for a search that tries many changes of one layout (the memory rule's fixes). A
    change of the fields the estimate reads goes straight to the estimate's own memo, without copying the
    whole config and looking it up on its arguments first: a tenth of a 10,000-config plan otherwise."""
    key, view = _stage_key(par), _memory_view(hardware)

    def variant(**change: Any) -> MemoryEstimate:
        if not change.keys() <= _STAGE_FIELD_SET:
            return estimated_memory(model, dataclasses.replace(par, **change), dp, hardware)
        changed = _changed_key(key, tuple(change.items()))
        # As estimate_memory: the same checks, the micro-batch count from this layout's global batch.
        _check_positive(dp=dp, tp=changed.tp, pp=changed.pp, micro_batch_size=changed.mbs)
        return _worst_stage(model, changed, dp, view, max(1, par.global_batch_size // (changed.mbs * dp)))

    return variant


def estimated_memory(
    model: ModelConfig, par: ParallelismConfig, dp: int, hardware: HardwareConfig | None = None
) -> MemoryEstimate:
    """`estimate_memory` for this layout, memoised on its (frozen) arguments, and below that on the
    fields it reads (_worst_stage), which layouts of a sweep that differ elsewhere share."""
    return _estimate_cached(model, _cache_key(par), dp, hardware)


def layer_activation_bytes(
    model: ModelConfig, par: ParallelismConfig, *, stack: Stack | None = None
) -> float:
    """One layer's saved activations for one micro-batch, as `stack` stores them."""
    traits = TRAITS[Stack(stack) if stack is not None else stack_of(par)]
    if traits.activations == "megasweep":
        return _megasweep_layer(model, par, Recompute(par.recompute))[0]
    kept, core = _korthikanti_terms(model, par)
    recompute = Recompute(par.recompute)
    if recompute == Recompute.none:
        return kept + core
    if recompute == Recompute.selective:
        return kept
    return _act_bytes(par.precision) * model.seq_length * par.mbs * model.hidden_size / _seq_shards(par)


__all__ = [
    "GIB",
    "MemoryEstimate",
    "Stack",
    "communicators",
    "device_reading",
    "estimate_memory",
    "estimated_memory",
    "estimated_variants",
    "parallelism_subset",
    "layer_activation_bytes",
    "predicts_oom",
    "stack_of",
    "stage_memory",
    "usable_bytes",
]
