"""Seconds per iteration of a layout, part by part, before anything runs: the time model.

The model is the physics of one training step on the pipeline stage that limits it. Its figures
are a site's measurements when `hardware.calibration` names a file (train.planner.calibration),
else the datasheet's with the efficiencies conf/hardware/*.yaml states with their sources; never
a constant fitted to one table:

- GEMMs: a calibrated GEMM's measured seconds for its shape and operand layout; a shape it did not
  time runs at the achieved fraction of its class (the measured shape that differs from it in one
  dimension only, the nearest: the same GEMM at another micro-batch or TP degree); otherwise FLOPs /
  (dense peak x `gemm_efficiency` x the GEMM's tile x wave efficiency from train.planner.shapes)
  plus a launch overhead. Y = X W^T has two backward GEMMs, dX = dY W and dW = dY^T X.
- attention core: where a calibration timed SDPA at this length and head size, its measured
  forward and backward at this count of sequences x heads (interpolated between the counts timed,
  extrapolated along the nearest two) for megasweep's stacks, which run SDPA; at another head size,
  the timed one nearest in kernel head size at the count of the same work (_measured_attention);
  with no calibration, in 16-bit precision, the hardware's `attention_efficiency` of the dense peak
  (FlashAttention's published rate; its backward 2.5x the forward's FLOPs); otherwise the GEMM rule for QK^T and
  attention-over-values. Under SDPA on a GPU FlashAttention skips the masked
  half of a causal score matrix, so that work halves; Megatron's explicit baddbmm path computes
  it whole.
- pointwise ops (LayerNorm, GeLU, residual adds, softmax, cross-entropy, embedding lookup): the
  slower of their bytes over memory bandwidth and their elements at the op's calibrated rate; a
  pointwise backward moves twice its forward's bytes.
- gradient accumulation: each micro-batch's gradients added into the step's, per stack's dtypes.
- TP: per layer and micro-batch two all-reduces of b*s*h elements forward and two backward
  (Megatron's f and g operators), two more when full recompute re-runs the forward; a ring moves
  2(t-1)/t of the bytes, at intra-node bus bandwidth when the TP group fits in a node.
- sequence parallel (Korthikanti et al. 2022): each all-reduce becomes a reduce-scatter and an
  all-gather of the same bytes (the same time on a ring), and the LayerNorms and residual adds run
  on this rank's s/t tokens; a stage boundary carries b*s*h/t.
- PP: one send/recv of b*s*h per neighbouring stage and micro-batch each way (Megatron's 1F1B pairs
  a send with the opposite receive; DeepSpeed's pipe engine does not), and the 1F1B bubble: (p-1)
  micro-batch slots of the slowest stage (Narayanan et al. 2021, bubble fraction (p-1)/m). With v
  virtual stages (interleaved 1F1B) the bubble is (p-1)/v slots ((p-1)/(v*m) of the step) and each
  micro-batch crosses each neighbour v times, the first rank's previous one being the last rank.
- DP: the gradient all-reduce (ZeRO: reduce-scatter, then the all-gather of updated parameters),
  at the ring's bus bandwidth; on a GPU megasweep's bucketed reduction overlaps the last
  micro-batch's backward (train.dp), the DeepSpeed stacks reduce after it; on a CPU gloo's
  reduction runs on the cores the compute fills, so nothing overlaps.
- recompute: the forward again (full) or the attention core again (selective).
- optimizer: Adam's bytes per parameter held (fp32 parameter, gradient and two moments read, three
  written) at memory bandwidth; DeepSpeed offload: gradients to the host and parameters back over
  `host_link_bw_gbs`.
- framework (a CPU with a calibration): what a whole layer costs beyond all the above, per layer and
  micro-batch: the calibration runs a narrow model's layer with the trainer's own code at each TP
  degree, and the model adds what that measured beyond its own prediction of the same layer (Python,
  autograd and DTensor dispatch, which a CPU runs in series with the work; a GPU's launches run ahead
  of it, so there it is not added). The layer is measured without sequence parallelism; a layout
  with it is charged the same.

Inter-node bandwidth is shared by the devices of a node, which run their DP and PP groups' collectives at
the same time: a device gets inter_node_bw_gbs / devices_per_node.

Torch-free: the launcher plans on login nodes.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, replace

from conf.schema import (
    HardwareConfig,
    ModelConfig,
    ModelKind,
    Offload,
    ParallelismConfig,
    Precision,
    Recompute,
)
from train.planner.calibration import (
    LAYER_COUNTS,
    AttentionTiming,
    LayerTiming,
    Link,
    gemm_table,
    links,
    load_calibration,
    node_timing,
)
from train.planner.flops import Gemm, head_gemms, layer_gemms, peak_tflops
from train.planner.inventory import stage_layers, stage_numel
from train.planner.memory import Stack, parallelism_subset, stack_of
from train.planner.schedule import bubble_slots
from train.planner.shapes import alignment_elements, gemm_efficiency
from train.planner.sizes import padded_vocab_size

PARTS: tuple[str, ...] = (
    "gemm",
    "attention",
    "memory_bound",
    "grad_accumulation",
    "recompute",
    "tp_comm",
    "pp_comm",
    "bubble",
    "dp_comm",
    "optimizer",
    "offload",
    "framework",
)
"""Where the time goes, in the order the breakdown is printed."""

ADAM_BYTES_PER_PARAM = 28
"""Fused Adam reads an fp32 parameter, gradient and two moments (16 B) and writes three (12 B)."""

GRAD_ACCUMULATION_BYTES = {"megasweep": 18, "deepspeed": 6, "megatron_deepspeed": 10}
"""Bytes per parameter held that each micro-batch's gradient accumulation moves, by stack. megasweep:
autocast casts the 16-bit weight gradient to fp32 (read 2, write 4) and autograd adds it into .grad
(read 4 and 4, write 4). DeepSpeed ZeRO: the 16-bit gradient copied into its reduction bucket (read 2,
write 2) and accumulated there (2). DeepSpeed's 2022 BF16_Optimizer (Megatron-DeepSpeed): the 16-bit
gradient read (2) and added into its fp32 copy (read 4, write 4)."""

AUTOCAST_CAST_BYTES = 6
"""Bytes per parameter of autocast's 16-bit copy of an fp32 weight, made at every forward (read 4, write 2)."""

ATTENTION_CORE = frozenset({"attn_scores", "attn_values"})
"""The attention core's GEMMs (QK^T and attention over values), reported apart from the dense ones."""

CROSS_ENTROPY_BYTES = 20
"""Bytes per logit of Megatron's vocab-parallel cross-entropy beyond the 16-bit read: an fp32 copy
written, read for the max and for the exponentials, the softmax written, read by backward (4 x 5)."""


class UnknownHardwareFigure(ValueError):
    """A figure the time model needs is null in the hardware config (a CPU's peak, its bandwidth)."""


@dataclass(frozen=True)
class TimePrediction:
    """Predicted seconds per iteration and where they go."""

    sec_per_iter: float
    """Predicted seconds per optimizer step (s)."""
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per iteration of each of PARTS (s); they sum to sec_per_iter."""
    stage_seconds: tuple[float, ...] = ()
    """One micro-batch's forward and backward on each pipeline stage, communication included (s)."""
    micro_batches: int = 1
    """Micro-batches per step on one replica."""


def _need(value: float | None, name: str, hw: HardwareConfig) -> float:
    if value is None or not value > 0:
        # A zero is a typo to fix, not a figure left unknown.
        why = ": the time model needs it (a positive number)" if value is None else " must be a positive number"
        raise UnknownHardwareFigure(
            f"hardware.{name}={value!r} for hardware '{hw.name}'{why}; set it in conf/hardware or measure it "
            "(calibration)"
        )
    return float(value)


@dataclass(frozen=True)
class _Machine:
    """The hardware figures the model uses, in SI units."""

    flops: float
    """Achieved GEMM rate (FLOP/s): the datasheet's peak x gemm_efficiency, or a calibration's best
    measured rate (the cap of every untimed shape, and its rate where no timed shape is its class's)."""
    mem_bw: float
    kernel: float
    intra: Link | None
    inter: Link | None
    per_node: int
    hw: HardwareConfig
    attention_flops: float | None = None
    """Achieved rate of a fused attention kernel (FLOP/s): the datasheet's peak x attention_efficiency;
    None under a calibration (it times SDPA itself) or where the hardware states no such figure."""
    gemms: dict[tuple[int, int, int, int, str, str], float] = field(default_factory=dict)
    """Measured seconds of GEMM shapes (calibration), by (m, n, k, batch, precision, layout)."""
    pointwise: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Measured (forward, backward) seconds per element of each pointwise op kind (calibration)."""
    layers: dict[int, LayerTiming] = field(default_factory=dict)
    """A narrow model's measured layer, by TP degree (calibration)."""
    classes: dict[tuple[tuple[int, ...], int, str, str], tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """Measured GEMMs by class: (the shape without dimension i, i, precision, layout) -> (dimension i,
    achieved rate / (`flops` x its tile x wave efficiency)) of each (calibration)."""
    attention: dict[tuple[int, int, bool, str], tuple[tuple[int, float, float], ...]] = field(default_factory=dict)
    """Measured attention cores (calibration): (sequence, head size, causal, precision) -> (sequences x
    heads, forward s, backward s) of each count timed, ascending."""
    core_share: float = 1.0
    """The share of a core each rank computes on when all compute at once: below 1 where a CPU job's
    ranks outnumber the cores they run on (the calibration's NodeTiming.core_share, counted); 1 on a
    GPU, each rank's own."""
    host_ranks: int = 0
    """Ranks that time-share one host's cores, consecutive in rank order (where core_share < 1): the
    calibration's nodes per host x devices per node; 0 where none do."""
    unmeasured: dict[tuple[int, int, int, int, str, str], float] = field(default_factory=dict, compare=False, repr=False)
    """Seconds of the untimed shapes predicted so far, filled as they are asked for: a memo of what the
    figures above give (the same whichever shape is asked first), not a figure of its own."""


def _machine(hw: HardwareConfig, precision: Precision, nodes: int) -> _Machine:
    per_node = max(1, hw.devices_per_node)
    if hw.calibration:
        return _calibrated(hw, precision, nodes, per_node)
    if hw.peak_measured:
        raise UnknownHardwareFigure(
            f"hardware '{hw.name}' measures its peak at run time (peak_measured=true), so the planner "
            "does not know it; measure this machine with `python -m launchers calibrate` and give the file "
            "as hardware.calibration, or give its figures with hardware.peak_measured=false: its peak_tflops_*, "
            "memory_bw_gbs and intra_node_bw_gbs (inter_node_bw_gbs too across nodes)"
        )
    peak = _need(peak_tflops(hw, precision), f"peak_tflops_{Precision(precision).value}", hw)
    mem = _need(hw.memory_bw_gbs, "memory_bw_gbs", hw)
    intra, inter = _sheet_links(hw, per_node)
    return _Machine(
        flops=peak * 1e12 * hw.gemm_efficiency,
        attention_flops=peak * 1e12 * hw.attention_efficiency if hw.attention_efficiency else None,
        mem_bw=mem * 1e9 * hw.memory_bw_efficiency,
        kernel=hw.kernel_overhead_us * 1e-6,
        intra=intra,
        inter=inter,
        per_node=per_node,
        hw=hw,
    )


def _sheet_links(hw: HardwareConfig, per_node: int) -> tuple[Link | None, Link | None]:
    """(intra-node, inter-node) links from the hardware config's bandwidths and efficiencies; a node's
    devices share its network, so each gets 1/per_node of the inter-node bandwidth."""
    latency = hw.comm_latency_us * 1e-6
    intra = hw.intra_node_bw_gbs * 1e9 * hw.intra_node_comm_efficiency if hw.intra_node_bw_gbs else None
    inter = hw.inter_node_bw_gbs * 1e9 * hw.inter_node_comm_efficiency / per_node if hw.inter_node_bw_gbs else None
    return (Link(latency, intra) if intra else None), (Link(latency, inter) if inter else None)


def _calibrated(hw: HardwareConfig, precision: Precision, nodes: int, per_node: int) -> _Machine:
    """Measured figures: a GEMM's own time where its shape was timed, its class's measured rate for the
    others (_class_fraction), the measured copy bandwidth and op cost, the timed attention cores, and
    the fitted links (train.planner.calibration); a link the file did not fit (`calibrate --here`
    times no collective) keeps the hardware config's figures."""
    assert hw.calibration is not None
    cal = load_calibration(hw.calibration)
    if cal.hardware != hw.name:
        # Another machine's seconds would be ranked as this one's (an H100's file on an A100 predicted
        # an MFU of 148%). A site's own config (a100_80gb_jean_zay) is measured under its own name.
        raise UnknownHardwareFigure(
            f"hardware.calibration={hw.calibration!r} was measured on hardware '{cal.hardware}', not on this "
            f"config's hardware '{hw.name}': give it with hardware={cal.hardware}, or measure {hw.name} with "
            f"`python -m launchers calibrate hardware={hw.name}`"
        )
    timing = node_timing(cal, nodes)
    if timing is None or not timing.gemms or timing.memory_bw_gbs <= 0:
        raise UnknownHardwareFigure(f"hardware.calibration={hw.calibration!r} holds no compute measurement")
    table = gemm_table(hw.calibration, nodes)
    rates = [2 * g.m * g.n * g.k * g.batch / g.seconds for g in timing.gemms if g.precision == precision.value]
    if not rates:
        raise UnknownHardwareFigure(
            f"hardware.calibration={hw.calibration!r} timed no {precision.value} GEMM: calibrate with that precision"
        )
    fitted = links(hw.calibration)
    sheet = _sheet_links(hw, per_node)
    best = max(rates)
    return _Machine(
        flops=best,
        mem_bw=timing.memory_bw_gbs * 1e9,
        kernel=timing.op_overhead_us * 1e-6,
        intra=fitted.get("intra") or sheet[0],
        inter=fitted.get("inter") or sheet[1],
        per_node=per_node,
        hw=hw,
        gemms=table,
        pointwise={kind: (f, b) for kind, (f, b) in timing.pointwise.items()},
        layers={layer.tp: layer for layer in timing.layers},
        classes=_gemm_classes(table, best, hw.num_sms),
        attention=_attention_table(timing.attention),
        core_share=timing.core_share if hw.device_type == "cpu" else 1.0,
        host_ranks=timing.nodes_per_host * per_node if hw.device_type == "cpu" and timing.core_share < 1.0 else 0,
    )


def _attention_table(
    timings: list[AttentionTiming],
) -> dict[tuple[int, int, bool, str], tuple[tuple[int, float, float], ...]]:
    found: dict[tuple[int, int, bool, str], dict[int, list[tuple[float, float]]]] = {}
    for a in timings:
        key = (a.seq_length, a.head_dim, a.causal, a.precision)
        found.setdefault(key, {}).setdefault(a.batch * a.heads, []).append((a.forward_s, a.backward_s))
    # Layouts with the same sequences x heads (mbs 2 at tp 2, mbs 1 at tp 1) run the same kernel.
    return {
        key: tuple((rows, sum(f for f, _ in t) / len(t), sum(b for _, b in t) / len(t)) for rows, t in sorted(counts.items()))
        for key, counts in found.items()
    }


def _between(points: list[tuple[int, float]], rows: float) -> float:
    """Seconds at `rows` from timed (rows, seconds), ascending: linear between the two timed counts
    around it (a kernel's fixed cost plus a cost per sequence and head), and outside them along the
    nearest two's line, bounded by proportional scaling (a fuller GPU is never less efficient per
    row) and by the nearest timed figure (more rows never take less time)."""
    if len(points) == 1:
        (count, seconds), = points
        return seconds * rows / count
    if rows > points[-1][0]:
        (c0, t0), (c1, t1) = points[-2], points[-1]
        return min(t1 + max(t1 - t0, 0.0) / (c1 - c0) * (rows - c1), t1 * rows / c1)
    if rows < points[0][0]:
        (c0, t0), (c1, t1) = points[0], points[1]
        return min(max(t0 - max(t1 - t0, 0.0) / (c1 - c0) * (c0 - rows), t0 * rows / c0), t0)
    for (c0, t0), (c1, t1) in itertools.pairwise(points):
        if c0 <= rows <= c1:
            return t0 + (t1 - t0) * (rows - c0) / (c1 - c0)
    raise AssertionError("unreachable: rows lies within the timed counts")


def _kernel_head(head_dim: int, device_type: str) -> int:
    """The head size SDPA's kernel computes: on a GPU FlashAttention-2 is compiled for multiples of 32
    up to 192, then 256, and pads a head up to the next (its flash_api.cpp, `head_size_rounded`); a
    CPU's kernels loop over the head's own elements."""
    if device_type != "cuda":
        return head_dim
    return -(-head_dim // 32) * 32 if head_dim <= 192 else 256


def _measured_attention(
    rows: int, seq: int, head_dim: int, causal: bool, precision: str, mach: _Machine
) -> tuple[float, float] | None:
    """(forward, backward) seconds of SDPA over `rows` sequences x heads, from the timings of the
    same sequence length, head size, causality and precision (_between); None without one at this
    length. On the H100, gpt_350m's forward took 0.051/0.081/0.124/0.203 ms at 16/32/64/128 rows:
    far from proportional at the counts that do not fill the GPU.

    A calibration times the head size of the model it was run for; another model's (gpt_2.7b's 80
    against gpt_1.3b's 128) takes the timed head size nearest in kernel head size (_kernel_head), at
    the count of rows that holds the same kernel work (rows x its kernel head / the timed one's): the
    score matrix and its softmax are per row, the two products scale with the head. Each model's core
    priced so from another model's file came within 0.82-1.25x of its own timing on an H100 and two
    H200s, where the GEMM rule gave 0.28-1.23x (tests/bench/results/gpu/REPORT.md, derived from calls
    5, 6 and 11; tests/test_gpu_results.py holds it)."""
    timed = mach.attention.get((seq, head_dim, causal, precision))
    work = float(rows)
    if not timed:
        heads = [d for (s, d, c, p) in mach.attention if (s, c, p) == (seq, causal, precision)]
        if not heads:
            return None
        device, own = mach.hw.device_type, _kernel_head(head_dim, mach.hw.device_type)
        near = min(heads, key=lambda d: (abs(math.log(_kernel_head(d, device) / own)), -d))
        timed, work = mach.attention[(seq, near, causal, precision)], rows * own / _kernel_head(near, device)
    forward = _between([(count, f) for count, f, _ in timed], work)
    return forward, _between([(count, b) for count, _, b in timed], work)


def _gemm_classes(
    table: dict[tuple[int, int, int, int, str, str], float], best: float, num_sms: int | None
) -> dict[tuple[tuple[int, ...], int, str, str], tuple[tuple[int, float], ...]]:
    """Each measured GEMM's achieved rate / (the best rate x its tile and wave efficiency), filed
    under each of its four dimensions. A calibration times the GEMMs of the micro-batches it was
    asked for; a layout at another one (micro_batch_size=auto reaches 16 or 32) runs the same GEMMs
    with one dimension scaled (the tokens m, the batch of heads, or dW's inner k), and its speed is
    that class's, not the best of all: on an H100 the batched attention GEMMs ran at a fifth to a third
    of it."""
    classes: dict[tuple[tuple[int, ...], int, str, str], list[tuple[int, float]]] = {}
    for (m, n, k, batch, precision, layout), seconds in table.items():
        if seconds <= 0:
            continue
        flops, quant = _quantized(m, n, k, batch, num_sms, alignment_elements(Precision(precision)))
        fraction = flops / seconds / (best * quant)
        dims = (m, n, k, batch)
        for i in range(4):
            key = (dims[:i] + dims[i + 1 :], i, precision, layout)
            classes.setdefault(key, []).append((dims[i], fraction))
    return {key: tuple(sorted(found)) for key, found in classes.items()}


def _class_fraction(dims: tuple[int, int, int, int], precision: str, layout: str, mach: _Machine) -> float | None:
    """The achieved fraction of the measured GEMM nearest to `dims` (by the ratio of the one dimension
    they differ in; the larger on a tie), or None when no measured GEMM differs in one dimension only."""
    best: tuple[float, int, float] | None = None
    for i in range(4):
        for value, fraction in mach.classes.get((dims[:i] + dims[i + 1 :], i, precision, layout), ()):
            distance = abs(math.log(value / dims[i]))
            if best is None or (distance, -value) < (best[0], -best[1]):
                best = (distance, value, fraction)
    return None if best is None else best[2]


def _link(mach: _Machine, span: int) -> Link:
    """The link of a group whose ranks span `span` consecutive devices."""
    inside = span <= mach.per_node and mach.per_node % span == 0
    link = mach.intra if inside else mach.inter
    if link is None:
        name = "intra_node_bw_gbs" if inside else "inter_node_bw_gbs"
        value = getattr(mach.hw, name)
        # _sheet_links drops a zero or negative bandwidth as it drops a null one; only null is unknown.
        what = " is unknown" if value is None else f"={value!r} must be a positive number of GB/s"
        raise UnknownHardwareFigure(
            f"hardware.{name}{what} for hardware '{mach.hw.name}' (and no calibration measured it): "
            "the time model needs it for this layout's communication"
        )
    return link


def _ring(mach: _Machine, nbytes: float, ranks: int, span: int, *, op: str) -> float:
    """A ring collective `op` (all_reduce, reduce_scatter, all_gather) over `ranks` ranks."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return _link(mach, span).seconds(op, ranks, nbytes)


def _one_gemm(m: int, n: int, k: int, batch: int, layout: str, mach: _Machine, precision: Precision) -> float:
    key = (m, n, k, batch, precision.value, layout)
    measured = mach.gemms.get(key)
    if measured is None:
        measured = mach.unmeasured.get(key)
    if measured is not None:
        return measured
    flops, quant = _quantized(m, n, k, batch, mach.hw.num_sms, alignment_elements(precision))
    fraction = _class_fraction((m, n, k, batch), precision.value, layout, mach) if mach.classes else None
    if fraction is None:
        seconds = flops / (mach.flops * quant) + mach.kernel
    else:
        # The class's measured time holds its launch; no shape runs above the best measured rate.
        seconds = flops / (mach.flops * min(quant * fraction, 1.0))
    mach.unmeasured[key] = seconds
    return seconds


@functools.lru_cache(maxsize=1 << 16)
def _quantized(m: int, n: int, k: int, batch: int, num_sms: int | None, alignment: int) -> tuple[int, float]:
    """(FLOPs, tile x wave efficiency) of one GEMM shape: the tile chooser tries every tile, and a
    sweep's layouts repeat a few hundred shapes thousands of times."""
    g = Gemm("", m, n, k, batch)
    return g.flops, gemm_efficiency(g, num_sms=num_sms, alignment=alignment).efficiency


def _gemm_seconds(gemms: list[Gemm], mach: _Machine, precision: Precision) -> tuple[float, float]:
    """(forward, backward) seconds of `gemms`. Y[m,n] = X[m,k] W^T (W stored [n,k]) has two backward
    GEMMs: dX = dY W (m x k, inner n) and dW = dY^T X (n x k, inner m)."""
    forward = backward = 0.0
    for g in gemms:
        forward += _one_gemm(g.m, g.n, g.k, g.batch, FORWARD_LAYOUT, mach, precision)
        backward += sum(_one_gemm(*shape, mach, precision) for shape in backward_gemm_shapes(g))
    return forward, backward


FORWARD_LAYOUT = "nt"
"""A forward GEMM's operand layout: activations times a weight stored [out, in], transposed (x @ W^T)."""


def backward_gemm_shapes(g: Gemm) -> tuple[tuple[int, int, int, int, str], tuple[int, int, int, int, str]]:
    """(m, n, k, batch, layout) of the input-gradient (dY @ W) and weight-gradient (dY^T @ X) GEMMs of `g`."""
    return (g.m, g.k, g.n, g.batch, "nn"), (g.n, g.k, g.m, g.batch, "tn")


def _act_bytes(precision: Precision) -> int:
    return 4 if Precision(precision) == Precision.fp32 else 2


@dataclass
class _Stage:
    """One micro-batch's forward + backward on one stage, part by part (s)."""

    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    backward: float = 0.0
    """Of parts' GEMM and attention seconds, those of the backward pass (the DP reduction's cover)."""

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] += seconds

    @property
    def total(self) -> float:
        return sum(self.parts.values())


POINTWISE_BYTES = {"layer_norm": 2, "gelu": 2, "add": 3, "softmax": 2}
"""Elements read and written per element by each pointwise op's forward (a residual add reads two)."""


def _pointwise(ops: list[tuple[str, int]], mach: _Machine, e: int) -> tuple[float, float]:
    """(forward, backward) seconds of pointwise ops given as (kind, elements): each the slower of its
    bytes over memory bandwidth and its elements at the calibrated rate of that op (on a CPU, GeLU's
    erf or a softmax's exp cost more than their bytes); backward moves twice the forward's bytes."""
    forward = backward = 0.0
    for kind, n in ops:
        nbytes = n * (e + CROSS_ENTROPY_BYTES if kind == "cross_entropy" else POINTWISE_BYTES[kind] * e)
        per_f, per_b = mach.pointwise.get(kind, (0.0, 0.0))
        forward += max(nbytes / mach.mem_bw, n * per_f) + mach.kernel
        backward += max(2 * nbytes / mach.mem_bw, n * per_b) + mach.kernel
    return forward, backward


def _layer(model: ModelConfig, par: ParallelismConfig, mach: _Machine, stack: Stack, causal_skip: float) -> _Stage:
    """One layer, one micro-batch, forward and backward and recompute, on one TP rank."""
    t, b, s, h = par.tp, par.mbs, model.seq_length, model.hidden_size
    e, precision = _act_bytes(par.precision), Precision(par.precision)
    gemms = layer_gemms(model, micro_batch_size=b, tp=t)
    dense_f, dense_b = _gemm_seconds([g for g in gemms if g.name not in ATTENTION_CORE], mach, precision)
    tokens, heads = b * s, model.num_attention_heads // t
    # megasweep's model runs SDPA; Megatron-DeepSpeed's explicit core (baddbmm, fused softmax) does not.
    sdpa = None
    sdpa_kernel = stack != Stack.megatron_deepspeed
    if sdpa_kernel:
        causal = model.kind == ModelKind.gpt
        sdpa = _measured_attention(b * heads, s, h // model.num_attention_heads, causal, precision.value, mach)
    core = [g for g in gemms if g.name in ATTENTION_CORE]
    if sdpa is not None:
        core_f, core_b = sdpa
    elif sdpa_kernel and mach.attention_flops and precision != Precision.fp32:
        # One fused kernel each way, at the rate FlashAttention's authors measured; its backward does
        # 2.5x the forward's FLOPs (five products against two: it recomputes the scores). FlashAttention
        # takes 16-bit operands only: in fp32 SDPA runs another kernel, left to the GEMM rule.
        forward = causal_skip * sum(g.flops for g in core) / mach.attention_flops
        core_f, core_b = forward + mach.kernel, 2.5 * forward + mach.kernel
    else:
        core_f, core_b = (causal_skip * x for x in _gemm_seconds(core, mach, precision))
    # The residual stream's tokens on this rank: s/t under sequence parallel.
    local = tokens // t if par.sequence_parallel else tokens
    # The pointwise ops: two LayerNorms, GeLU on the f/t activations, two residual adds; megasweep's
    # attention also copies its heads back into a [b, s, h/t] layout, Megatron's explicit core runs
    # the fused softmax over the s x s scores (which SDPA keeps on chip).
    ops = [("layer_norm", local * h)] * 2 + [("gelu", tokens * (model.ffn // t))] + [("add", local * h)] * 2
    ops += [("softmax", b * heads * s * s)] if stack == Stack.megatron_deepspeed else [("add", tokens * (h // t))]
    fwd_mem, bwd_mem = _pointwise(ops, mach, e)
    softmax_f = _pointwise([("softmax", b * heads * s * s)], mach, e)[0] if stack == Stack.megatron_deepspeed else 0.0
    ar = _tp_collective(mach, tokens * h * e, t, sequence_parallel=par.sequence_parallel)
    stage = _Stage(backward=dense_b + core_b)
    stage.add("gemm", dense_f + dense_b)
    stage.add("attention", core_f + core_b)
    stage.add("memory_bound", fwd_mem + bwd_mem)
    stage.add("tp_comm", 4 * ar)
    recompute = Recompute(par.recompute)
    if recompute == Recompute.full:
        stage.add("recompute", dense_f + core_f + fwd_mem + 2 * ar)
    elif recompute == Recompute.selective:
        stage.add("recompute", core_f + softmax_f)
    return stage


def _tp_collective(mach: _Machine, nbytes: float, t: int, *, sequence_parallel: bool) -> float:
    """One of Megatron's f / g operators on `nbytes`: an all-reduce, or under sequence parallel a
    reduce-scatter and an all-gather (the two halves of a ring all-reduce: the same time, unless the
    calibration timed this backend's collectives otherwise)."""
    if sequence_parallel:
        return _ring(mach, nbytes, t, t, op="reduce_scatter") + _ring(mach, nbytes, t, t, op="all_gather")
    return _ring(mach, nbytes, t, t, op="all_reduce")


def _ends(model: ModelConfig, par: ParallelismConfig, mach: _Machine, *, first: bool, last: bool) -> _Stage:
    """The embedding (first stage) and the head (last stage) for one micro-batch."""
    t, tokens, h = par.tp, par.mbs * model.seq_length, model.hidden_size
    e, precision = _act_bytes(par.precision), Precision(par.precision)
    stage = _Stage()
    if first:
        # Lookup, position add and the backward's scatter-add, each counted as an add of b*s*h
        # elements (forward and backward); the vocabulary-parallel lookup is summed over TP.
        stage.add("memory_bound", sum(_pointwise([("add", tokens * h)] * 3, mach, e)))
        stage.add("tp_comm", _ring(mach, tokens * h * e, t, t, op="all_reduce"))
    if last:
        head_f, head_b = _gemm_seconds(head_gemms(model, micro_batch_size=par.mbs, tp=t), mach, precision)
        stage.add("gemm", head_f + head_b)
        stage.backward += head_b
        logits = tokens * padded_vocab_size(model, t) // t
        local = tokens // t if par.sequence_parallel else tokens
        norms = [("layer_norm", local * h)] * (2 if model.kind == ModelKind.bert else 1)
        stage.add("memory_bound", sum(_pointwise([*norms, ("cross_entropy", logits)], mach, e)))
        # The logits' input gradient is summed over TP (sequence parallel: the input gathered, its
        # gradient reduce-scattered); the loss's max and sum are b*s floats.
        head = _tp_collective(mach, tokens * h * e, t, sequence_parallel=par.sequence_parallel)
        stage.add("tp_comm", head + 3 * _ring(mach, tokens * 4, t, t, op="all_reduce"))
    return stage


def _dp_seconds(
    model: ModelConfig, par: ParallelismConfig, mach: _Machine, *, dp: int, stage: int, stack: Stack, micro_batches: int
) -> float:
    """The DP gradient reduction and ZeRO's parameter all-gather of one rank of `stage` (s)."""
    n = stage_numel(model, tp=par.tp, stage=stage, num_stages=par.pp)
    span, e = par.tp * dp, _act_bytes(par.precision)
    zero = par.zero_stage
    if stack == Stack.megasweep:
        # fp32 gradients in train.dp's buckets; ZeRO-1 reduce-scatters them and all-gathers fp32 weights.
        if zero == 0:
            return _ring(mach, 4 * n, dp, span, op="all_reduce")
        return _ring(mach, 4 * n, dp, span, op="reduce_scatter") + _ring(mach, 4 * n, dp, span, op="all_gather")
    if stack == Stack.megatron_deepspeed:
        # DeepSpeed's 2022 BF16_Optimizer all-reduces fp32 gradients, then all-gathers 16-bit weights.
        return _ring(mach, 4 * n, dp, span, op="all_reduce") + (_ring(mach, e * n, dp, span, op="all_gather") if zero else 0.0)
    # DeepSpeed ZeRO reduces 16-bit gradients; stage 1 reduce-scatters them once per step, stages 2
    # and 3 after every micro-batch's backward (its gradients are partitioned as they are produced),
    # and stage 3 gathers the parameters for every forward and backward besides; the updated 16-bit
    # weights are all-gathered after the step.
    if zero == 0:
        return _ring(mach, e * n, dp, span, op="all_reduce")
    scatter = _ring(mach, e * n, dp, span, op="reduce_scatter")
    gather = _ring(mach, e * n, dp, span, op="all_gather")
    per_step = (micro_batches if zero >= 2 else 1) * scatter + gather
    return per_step + (2 * micro_batches * gather if zero == 3 else 0.0)


def predict_time(
    model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, *, dp: int, stack: Stack | None = None
) -> TimePrediction:
    """Seconds per iteration of `par` on `dp` replicas of `hw`, and their breakdown (module docstring).

    Raises UnknownHardwareFigure when a figure it needs is null (a CPU's peak is measured at run time).
    """
    stack = stack or stack_of(par)
    per_node = max(1, hw.devices_per_node)
    # Only a calibration's figures depend on the node count: without one, every count shares a machine.
    nodes = -(-dp * par.tp * par.pp // per_node) if hw.calibration else 0
    return _predict(model, par, hw, dp=dp, stack=stack, nodes=nodes, framework=True)


def _predict(
    model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, *, dp: int, stack: Stack, nodes: int, framework: bool
) -> TimePrediction:
    precision = Precision(par.precision)
    mach = _machine_cached(hw, precision, nodes)
    m = max(1, par.global_batch_size // (par.mbs * dp))
    causal_skip = 0.5 if stack != Stack.megatron_deepspeed and model.kind == ModelKind.gpt and hw.device_type == "cuda" else 1.0
    rank = _rank_work(model, _per_rank_key(par), hw, precision, nodes, stack, causal_skip)
    # Under sequence parallel a stage sends its TP rank's tokens only.
    sent_tokens = model.seq_length // par.tp if par.sequence_parallel else model.seq_length
    p2p_bytes = par.mbs * sent_tokens * model.hidden_size * _act_bytes(par.precision)
    # Consecutive stages are tp * dp devices apart (Megatron's rank order: TP, DP, then PP): the
    # boundary after stage s crosses nodes when its two sides sit on different nodes. That is how dp
    # enters the stages, so layouts of other dp or global batch with the same crossings share them.
    width = par.tp * dp
    chunks = par.virtual_stages if par.pp > 1 else 1
    # Boundary b of 1..pp-1 follows stage b-1; 0 and pp are the interleaved schedule's wrap, from the
    # last rank to the first.
    crossings = tuple(
        (par.pp * width - 1) // mach.per_node != 0
        if b % par.pp == 0
        else (b * width - 1) // mach.per_node != (b * width) // mach.per_node
        for b in range(par.pp + 1)
    )
    numels = _stage_numels(model, par.tp, par.pp)
    stages = rank.stages(par.pp, chunks, crossings, p2p_bytes, numels, _stage_layer_counts(model.num_layers, par.pp))
    totals = [st.total for st in stages]
    slowest = stages[totals.index(max(totals))]
    parts = {k: m * v for k, v in slowest.parts.items()}
    # (p-1) slots of the slowest stage; with v chunks per rank each slot is a chunk, 1/v of it.
    slots = bubble_slots(pp=par.pp, virtual_stages=chunks)
    parts["bubble"] = slots * slowest.total
    if mach.core_share < 1.0:
        parts = _time_shared_parts(stages, mach, m=m, slots=slots, width=width, ranks=width * par.pp)
    worst_stage = numels.index(max(numels))
    dp_time = _dp_seconds(model, par, mach, dp=dp, stage=worst_stage, stack=stack, micro_batches=m)
    if stack == Stack.megasweep and hw.device_type == "cuda":
        # Buckets reduce while the last micro-batch's backward GEMMs and attention still run: NCCL
        # moves them on its own SMs and links. Gloo on a CPU sums and copies them on threads of the
        # same cores the rank's compute already fills (one intra-op thread per allocated CPU), so
        # there nothing hides (a profile of dp=2 on the local cluster: the all-reduce thread's time
        # is added to the step's).
        dp_time = max(dp_time - slowest.backward, 0.0)
    if par.pp > 1:
        # The tied word embedding's fp32 gradient is summed between the first and the last stage
        # (train.parallel.tie_embedding_grads; Megatron's embedding group), after backward.
        words = padded_vocab_size(model, par.tp) // par.tp * model.hidden_size
        dp_time += _ring(mach, 4 * words, 2, par.tp * dp * par.pp, op="all_reduce")
    parts["dp_comm"] = dp_time
    held = numels[worst_stage]
    stepped = held / dp if par.zero_stage >= 1 else held
    parts["optimizer"] = ADAM_BYTES_PER_PARAM * stepped / mach.mem_bw
    if Offload(par.offload) != Offload.none:
        host = _need(hw.host_link_bw_gbs, "host_link_bw_gbs", hw) * 1e9
        # 16-bit gradients to the host, updated 16-bit parameters back; the CPU's Adam is not modelled.
        parts["offload"] = 2 * 2 * stepped / host
    if framework and hw.device_type == "cpu" and par.tp in mach.layers:
        # What a layer costs beyond the counted work, per micro-batch (a full recompute runs the
        # forward's share again), on every layer of the slowest stage.
        residual = _layer_residual(hw, precision, nodes, par.tp, stack)
        layer = mach.layers[par.tp]
        share = min(max(layer.forward_s / layer.step_s, 0.0), 1.0) if layer.step_s > 0 else 0.0
        again = share if Recompute(par.recompute) == Recompute.full else 0.0
        layers = _stage_layer_counts(model.num_layers, par.pp)[totals.index(max(totals))]
        parts["framework"] = m * layers * residual * (1 + again)
    return TimePrediction(
        sec_per_iter=math.fsum(parts.values()),
        parts=parts,
        stage_seconds=tuple(totals),
        micro_batches=m,
    )


def _time_shared_parts(stages: list[_Stage], mach: _Machine, *, m: int, slots: float, width: int, ranks: int) -> dict[str, float]:
    """The pipeline's parts where ranks time-share their host's cores (an emulated cluster's nodes on
    one host), each stage priced at its share of a core (mach.core_share).

    A rank that waits (in the bubble, or because its stage has less work) leaves its core to the ranks
    beside it on the host, which then run faster. So the step takes the host's work spread over its
    cores, the mean over its ranks of their stages' m micro-batches at the shared speed, or the
    critical path, m + slots of the slowest stage at an unshared rank's speed, whichever is longer;
    the busiest host decides. The parts are that host's mean, and the bubble what the critical path
    exceeds it by. (Measured on the local cluster before: dp=2 pp=2 vpp=2 on two nodes ran 28-39%
    faster than with the whole bubble counted; dp=2 pp=2, whose last stage's logits make it 1.7x the
    first, 8-45% faster than its slowest stage's m micro-batches at the shared speed.)"""
    totals = [st.total for st in stages]
    per_host = mach.host_ranks if 0 < mach.host_ranks < ranks else ranks
    # Megatron's rank order (TP fastest, then DP, then PP): rank r runs stage r // width.
    hosts = [[r // width for r in range(first, min(first + per_host, ranks))] for first in range(0, ranks, per_host)]
    busiest = max(hosts, key=lambda held: sum(totals[s] for s in held) / len(held))
    parts = {k: m * sum(stages[s].parts[k] for s in busiest) / len(busiest) for k in stages[0].parts}
    shared_work = m * sum(totals[s] for s in busiest) / len(busiest)
    parts["bubble"] = max(0.0, (m + slots) * max(totals) * mach.core_share - shared_work)
    return parts


# A sweep predicts thousands of layouts that share a layer's and the ends' per-rank work (the same
# model, tp, micro-batch, precision and recompute on the same device, at any pp, dp or global batch):
# the pieces below are memoised on exactly the fields they read, so each is computed once.


@functools.lru_cache(maxsize=1 << 12)
def _stage_numels(model: ModelConfig, tp: int, pp: int) -> tuple[int, ...]:
    return tuple(stage_numel(model, tp=tp, stage=s, num_stages=pp) for s in range(pp))


@functools.lru_cache(maxsize=1 << 12)
def _stage_layer_counts(num_layers: int, pp: int) -> tuple[int, ...]:
    return tuple(len(stage_layers(num_layers, stage=s, num_stages=pp)) for s in range(pp))


@functools.lru_cache(maxsize=1 << 8)
def _layer_residual(hw: HardwareConfig, precision: Precision, nodes: int, tp: int, stack: Stack) -> float:
    """Seconds of one layer's forward and backward that the calibration measured beyond this model's
    own prediction of the same narrow layer (never negative): on a CPU, Python, autograd and (under
    TP) DTensor dispatch, which run serially with the work."""
    timing = _machine_cached(hw, precision, nodes).layers[tp]
    narrow = ModelConfig(name="narrow", kind=ModelKind(timing.kind), hidden_size=timing.hidden_size,
                         num_attention_heads=timing.num_attention_heads, seq_length=timing.seq_length,
                         vocab_size=timing.vocab_size)  # fmt: skip
    par = ParallelismConfig(tp=tp, pp=1, dp=1, micro_batch_size=timing.micro_batch_size,
                            global_batch_size=timing.micro_batch_size, precision=precision)  # fmt: skip

    def in_stage(layers: int) -> float:
        p = _predict(replace(narrow, num_layers=layers), par, hw, dp=1, stack=stack, nodes=nodes, framework=False)
        return p.sec_per_iter - p.parts["optimizer"] - p.parts["dp_comm"]

    few, many = LAYER_COUNTS
    predicted = (in_stage(many) - in_stage(few)) / (many - few)
    return max(timing.step_s - predicted, 0.0)


@functools.lru_cache(maxsize=1 << 10)
def _machine_cached(hw: HardwareConfig, precision: Precision, nodes: int) -> _Machine:
    # Shared: the time model reads a machine's figures and only adds to its memo of untimed shapes.
    return _machine(hw, precision, nodes)


def _per_rank_key(par: ParallelismConfig) -> ParallelismConfig:
    """The fields of `par` that _layer and _ends read; the others at their defaults."""
    return parallelism_subset(par, ("tp", "micro_batch_size", "precision", "recompute", "sequence_parallel"))


@dataclass(eq=False)
class _RankWork:
    """One TP rank's work per micro-batch on one device: its layer, its ends by kind of stage, and the
    stages of each pipeline depth it was asked for (shared, never modified: predict_time only reads them)."""

    model: ModelConfig
    key: ParallelismConfig
    mach: _Machine
    stack: Stack
    layer: _Stage
    _ends: dict[tuple[bool, bool], _Stage] = field(default_factory=dict)
    _stages: dict[tuple[int, int, tuple[bool, ...], float], list[_Stage]] = field(default_factory=dict)

    def ends(self, first: bool, last: bool) -> _Stage:
        """_ends' stage (the caller copies it into a stage of its own, which it adds to)."""
        ends = self._ends.get((first, last))
        if ends is None:
            ends = self._ends[(first, last)] = _ends(self.model, self.key, self.mach, first=first, last=last)
        return ends

    def stages(
        self, pp: int, chunks: int, crossings: tuple[bool, ...], p2p_bytes: float, numels: tuple[int, ...],
        counts: tuple[int, ...],
    ) -> list[_Stage]:
        """Each of `pp` stages' parts (`chunks` model chunks per rank): the ends, its layers (`counts`), its
        transfers over the boundaries 0..pp (`crossings`: whether each crosses nodes), its gradient
        accumulation (`numels` parameters)."""
        key = (pp, chunks, crossings, p2p_bytes)
        found = self._stages.get(key)
        if found is None:
            found = self._stages[key] = self._compute_stages(pp, chunks, crossings, p2p_bytes, numels, counts)
        return found

    def _compute_stages(
        self, pp: int, chunks: int, crossings: tuple[bool, ...], p2p_bytes: float, numels: tuple[int, ...],
        counts: tuple[int, ...],
    ) -> list[_Stage]:
        mach, stack = self.mach, self.stack

        def p2p(boundary: int) -> float:
            link = _link(mach, 2 * mach.per_node if crossings[boundary] else 1)
            return link.seconds("send_recv", 2, p2p_bytes)

        per_neighbour = 2 if stack == Stack.megatron_deepspeed else 1
        casts = stack == Stack.megasweep and Precision(self.key.precision) != Precision.fp32
        forwards = 2 if Recompute(self.key.recompute) == Recompute.full else 1
        layer_parts = tuple(self.layer.parts.items())
        alike: dict[tuple[bool, bool, int, tuple[float, ...], int], _Stage] = {}
        stages = []
        for s in range(pp):
            first, last = s == 0, s == pp - 1
            ends = self.ends(first, last)  # before the transfers: which missing figure is reported first
            # Megatron's and megasweep's 1F1B pair each send with the opposite receive; DeepSpeed's pipe
            # engine runs its four transfers per micro-batch (activation and gradient, in and out) one by one.
            if chunks > 1:
                # Interleaved (Narayanan et al. 2021): each micro-batch crosses every rank once per
                # chunk, so v exchanges with each neighbour, the previous rank wrapping from the first
                # to the last one (all but the embedding's input and the loss's output).
                neighbours = [(chunks - first) * p2p(s), (chunks - last) * p2p(s + 1)]
            else:
                neighbours = ([p2p(s)] if s > 0 else []) + ([p2p(s + 1)] if s < pp - 1 else [])
            layers, held = counts[s], numels[s]
            # Stages alike (the middle ones, mostly) are computed once.
            key_s = (first, last, layers, tuple(neighbours), held)
            stage = alike.get(key_s)
            if stage is None:
                stage = _Stage(dict(ends.parts), ends.backward + layers * self.layer.backward)
                for part, seconds in layer_parts:
                    stage.add(part, layers * seconds)
                stage.add("pp_comm", per_neighbour * sum(neighbours))
                stage.add("grad_accumulation", held * GRAD_ACCUMULATION_BYTES[stack.value] / mach.mem_bw + mach.kernel)
                if casts:
                    stage.add("memory_bound", held * AUTOCAST_CAST_BYTES / mach.mem_bw)
                    stage.add("recompute", (forwards - 1) * held * AUTOCAST_CAST_BYTES / mach.mem_bw)
                alike[key_s] = stage
            stages.append(stage)
        return stages


@functools.lru_cache(maxsize=1 << 14)
def _rank_work(
    model: ModelConfig, key: ParallelismConfig, hw: HardwareConfig, precision: Precision, nodes: int,
    stack: Stack, causal_skip: float,
) -> _RankWork:
    # One lookup per prediction (hashing a device's thirty figures once, not once per piece).
    mach = _machine_cached(hw, precision, nodes)
    return _RankWork(model, key, mach, stack, _layer(model, key, mach, stack, causal_skip))


__all__ = ["PARTS", "TimePrediction", "UnknownHardwareFigure", "predict_time"]
