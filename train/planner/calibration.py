"""A site's measured figures for the time model: the calibration file `hardware.calibration` names.

`python -m launchers calibrate` runs short Slurm jobs, on one node and on two, whose every task
measures at once what a training rank does (so a node's tasks share its cores, memory bus and
links as they will in training): the seconds of each GEMM the candidate layouts run (forward,
input gradient and weight gradient shapes), the memory bandwidth of a large copy, the cost of a
tiny op (dispatch and launch), and all-reduce, reduce-scatter, all-gather and send/recv times by
message size, inside a node and across nodes. This module is the file's schema and the lookups
train.planner.perf makes; train.calibration_job measures.

Collective times are reduced to the two numbers of the ring model the time model uses: the latency
of one ring step and the bus bandwidth, a least-squares fit of t = steps x latency + moved bytes /
bandwidth over the measured sizes (`fit_link`), so a group of another size is predicted by the
same physics: one fit of every collective of a scope, and each collective's own (`with_op_fits`),
which prices it where the backend runs it otherwise than the ring model says.

Torch-free.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

CALIBRATION_VERSION = 1
"""Bumped when a field's meaning changes; a file of another version is refused."""

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "send_recv")
"""The operations measured, by name."""


def ring_factors(op: str, ranks: int) -> tuple[int, float]:
    """(ring steps, share of the message each rank moves) of `op` over `ranks` ranks."""
    if op == "all_reduce":
        return 2 * (ranks - 1), 2 * (ranks - 1) / ranks
    if op in ("reduce_scatter", "all_gather"):
        return ranks - 1, (ranks - 1) / ranks
    if op == "send_recv":
        return 1, 1.0
    raise ValueError(f"unknown collective {op!r}: one of {', '.join(COLLECTIVES)}")


@dataclass(frozen=True)
class GemmTiming:
    """One GEMM shape and the seconds it took on one device, every task of the node busy."""

    m: int
    n: int
    k: int
    batch: int
    precision: str
    seconds: float
    layout: str = "nn"
    """Operand layouts as training runs them: 'nt' (forward, x @ W^T), 'nn' (input gradient, dY @ W),
    'tn' (weight gradient, dY^T @ X); a CPU's GEMM speed depends on them."""


@dataclass(frozen=True)
class CollectiveTiming:
    """Seconds of one collective of `nbytes` bytes (the whole message) over `ranks` ranks."""

    op: str
    scope: str
    """'intra' (ranks on one node) or 'inter' (one rank per node)."""
    ranks: int
    nbytes: int
    seconds: float


LAYER_COUNTS = (1, 9)
"""Layers of the two narrow models timed: their difference over the 8 layers between them is one
layer (the embeddings, the head and the loss cancel). On the local cluster the tp=2 layer's
forward + backward, timed three times in one job, spread over 7.4-18.5 ms with (1, 3) and over
8.1-10.5 ms with (1, 9): each timing's noise is divided among more layers."""


@dataclass(frozen=True)
class LayerTiming:
    """Seconds of one whole transformer layer of a narrow model, run by the trainer's own code at TP
    degree `tp` (train.calibration_job.layer_timings): the time model compares them with its own
    prediction of that layer, and what it does not count (Python, autograd, DTensor dispatch) is the
    difference."""

    tp: int
    kind: str
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    micro_batch_size: int
    forward_s: float
    """One layer's forward, autograd recording (s)."""
    step_s: float
    """One layer's forward and backward (s)."""


@dataclass(frozen=True)
class AttentionTiming:
    """The attention core as the trainer runs it (F.scaled_dot_product_attention) on one device: one
    fused kernel on a GPU (FlashAttention, cuDNN). Without it the time model prices the core as the
    two batched GEMMs of the same FLOPs, timed unfused, which on an H100 ran at a fifth (head size
    64) to a third (128) of the best GEMM rate."""

    batch: int
    """Sequences (micro-batch size)."""
    heads: int
    """Attention heads on one rank (num_attention_heads / TP)."""
    seq_length: int
    """Tokens per sequence."""
    head_dim: int
    """Elements per head (hidden size / heads)."""
    causal: bool
    """Masked to earlier tokens (GPT) or not (BERT)."""
    precision: str
    """The q, k and v dtype: fp32, bf16 or fp16."""
    forward_s: float
    """One forward (s)."""
    backward_s: float
    """Its backward: the forward and backward's time less the forward's (s)."""


@dataclass(frozen=True)
class NodeTiming:
    """What a job on `nodes` nodes measured of each device's compute and memory."""

    nodes: int
    tasks_per_node: int
    gemms: list[GemmTiming] = field(default_factory=list)
    memory_bw_gbs: float = 0.0
    """A large copy's bytes read and written per second, per device (GB/s)."""
    op_overhead_us: float = 0.0
    """Seconds of a tiny pointwise op, i.e. what every op costs beyond its work (microseconds)."""
    pointwise: dict[str, list[float]] = field(default_factory=dict)
    """[forward, backward] seconds per element of each pointwise op kind (layer_norm, gelu, add,
    softmax, cross_entropy) at training's sizes."""
    layers: list[LayerTiming] = field(default_factory=list)
    """A narrow model's layer per TP degree measured (files from before it have none)."""
    attention: list[AttentionTiming] = field(default_factory=list)
    """The attention core at each (micro-batch, TP) the search runs (files from before it have none:
    the time model then prices the core as two batched GEMMs)."""
    core_share: float = 1.0
    """The share of a CPU core each rank's thread gets while all compute: the host's CPUs over the
    threads the job's ranks run on it, at most 1 (1 where each has its own, and on a GPU). Below 1 on
    an emulated cluster, whose nodes share one host (files from before it: 1)."""
    nodes_per_host: int = 1
    """The job's nodes that run on one host: 1 on a real cluster, all of them on an emulated one."""
    sustained_tflops: float = 0.0
    """The largest GEMM's rate per device with every device of the job running it back to back for
    half a second at once (TFLOP/s; train.calibration_job.sustained_rate; files from before it: 0)."""


@dataclass(frozen=True)
class Calibration:
    """The calibration file (JSON)."""

    version: int
    hardware: str
    """hardware.name it was measured for."""
    host: str
    device: str
    """What measured it: the GPU's name, or the CPU and thread count."""
    measured_at: str
    torch: str
    nodes: list[NodeTiming] = field(default_factory=list)
    collectives: list[CollectiveTiming] = field(default_factory=list)

    def write(self, path: str | Path) -> Path:
        """Write the file as JSON (atomically: a rename)."""
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(out)
        return out


def _from_dict(data: dict[str, Any]) -> Calibration:
    nodes = [
        NodeTiming(**{**n, "gemms": [GemmTiming(**g) for g in n.get("gemms", [])],
                      "layers": [LayerTiming(**t) for t in n.get("layers", [])],
                      "attention": [AttentionTiming(**a) for a in n.get("attention", [])]})
        for n in data.get("nodes", [])
    ]  # fmt: skip
    collectives = [CollectiveTiming(**c) for c in data.get("collectives", [])]
    return Calibration(**{**data, "nodes": nodes, "collectives": collectives})


@functools.lru_cache(maxsize=16)
def load_calibration(path: str) -> Calibration:
    """The calibration file at `path` (memoised: a search asks thousands of times)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"hardware.calibration={path!r} cannot be read as a calibration file: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"hardware.calibration={path!r} holds a JSON {type(data).__name__}, not a calibration file's object")
    if data.get("version") != CALIBRATION_VERSION:
        raise ValueError(
            f"hardware.calibration={path!r} is version {data.get('version')!r}, this megasweep reads version "
            f"{CALIBRATION_VERSION}: measure again with `python -m launchers calibrate`"
        )
    try:
        cal = _from_dict(data)
    except (TypeError, KeyError) as exc:
        # A missing or misspelled field surfaces as a constructor's TypeError naming it.
        raise ValueError(f"hardware.calibration={path!r} is not a calibration file of version "
                         f"{CALIBRATION_VERSION}: {exc}") from exc
    if (problem := _bad_figure(cal)) is not None:
        raise ValueError(f"hardware.calibration={path!r} is not a calibration file of version {CALIBRATION_VERSION}: "
                         f"{problem}; measure again with `python -m launchers calibrate`")
    return cal


POSITIVE = {"m", "n", "k", "batch", "seconds", "ranks", "nbytes", "nodes", "tasks_per_node"}
"""Fields the time model divides by or counts with: a GEMM of 0 seconds divided by zero (a traceback), one of
-1 s was priced as a negative time."""


def _bad_figure(cal: Calibration) -> str | None:
    """The first measured figure that is not a finite number (a positive one where POSITIVE names it), as
    '<where>.<field>=<value> <rule>'; None when every one is."""
    entries: list[tuple[str, Any]] = [(f"collectives[{i}]", c) for i, c in enumerate(cal.collectives)]
    for i, node in enumerate(cal.nodes):
        entries.append((f"nodes[{i}]", node))
        for name in ("gemms", "layers", "attention"):
            entries += [(f"nodes[{i}].{name}[{j}]", x) for j, x in enumerate(getattr(node, name))]
    for where, entry in entries:
        for f in fields(entry):
            value = getattr(entry, f.name)
            if f.type not in ("int", "float"):
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not number or (f.name in POSITIVE and value <= 0):
                rule = "must be a number above 0" if f.name in POSITIVE else "must be a finite number"
                return f"{where}.{f.name}={value!r} {rule}"
    return None


@dataclass(frozen=True)
class Link:
    """A scope's ring-model figures: latency of one step (s) and bus bandwidth (bytes/s)."""

    latency: float
    bandwidth: float
    ops: tuple[tuple[str, float, float], ...] = ()
    """(collective, latency, bandwidth) of each collective the file timed at two sizes or more, its own
    ring fit; the scope's figures above price the others. A backend may run one collective as another:
    gloo's reduce-scatter is an all-reduce and a copy, twice its half-ring time on the local cluster
    (2026-11-26), which sequence parallelism pays twice per layer."""

    def seconds(self, op: str, ranks: int, nbytes: float) -> float:
        """One `op` of `nbytes` (the whole message) over `ranks` ranks on this link."""
        latency, bandwidth = next(((lat, bw) for name, lat, bw in self.ops if name == op), (self.latency, self.bandwidth))
        steps, share = ring_factors(op, ranks)
        return steps * latency + share * nbytes / bandwidth


def fit_link(timings: list[CollectiveTiming]) -> Link | None:
    """Least-squares latency and bandwidth of t = steps x latency + share x bytes / bandwidth."""
    rows = [(*ring_factors(t.op, t.ranks), t) for t in timings]
    if len({(t.op, t.nbytes) for *_, t in rows}) < 2:
        return None
    # Normal equations of t = a x steps + b x (share x bytes), a = latency, b = 1 / bandwidth.
    xs = [(float(steps), share * t.nbytes, t.seconds) for steps, share, t in rows]
    s11 = sum(a * a for a, _, _ in xs)
    s12 = sum(a * b for a, b, _ in xs)
    s22 = sum(b * b for _, b, _ in xs)
    y1 = sum(a * y for a, _, y in xs)
    y2 = sum(b * y for _, b, y in xs)
    det = s11 * s22 - s12 * s12
    if det <= 0:
        return None
    latency = (y1 * s22 - y2 * s12) / det
    inverse_bw = (s11 * y2 - s12 * y1) / det
    if inverse_bw <= 0:
        return None
    return Link(latency=max(latency, 0.0), bandwidth=1.0 / inverse_bw)


@functools.lru_cache(maxsize=64)
def links(path: str) -> dict[str, Link]:
    """The fitted Link of each scope the file measured ('intra', 'inter'), with each collective's own fit."""
    return fitted_links(load_calibration(path))


def fitted_links(cal: Calibration) -> dict[str, Link]:
    """`links` of a calibration already read (what `launchers calibrate` prints)."""
    fitted = {}
    for scope in ("intra", "inter"):
        timings = [c for c in cal.collectives if c.scope == scope]
        link = fit_link(timings)
        if link is not None:
            fitted[scope] = with_op_fits(link, timings)
    return fitted


def with_op_fits(link: Link, timings: list[CollectiveTiming]) -> Link:
    """`link` (the fit of every collective together) with each collective's own ring fit: the physics
    (steps and bytes moved) stays the ring model's, while latency and bandwidth are what this backend
    shows for that collective."""
    ops = []
    for op in sorted({t.op for t in timings}):
        own = fit_link([t for t in timings if t.op == op])
        if own is not None:
            ops.append((op, own.latency, own.bandwidth))
    return replace(link, ops=tuple(ops))


def node_timing(cal: Calibration, nodes: int) -> NodeTiming | None:
    """One device's figures on `nodes` nodes: the measurement taken on that many nodes, else on the
    nearest count measured. Where that job's ranks time-shared their host's cores (core_share < 1),
    its compute figures are those of the nearest job whose ranks had a core each, divided among the
    ranks sharing one (time_shared)."""
    if not cal.nodes:
        return None
    timing = min(cal.nodes, key=lambda n: (abs(n.nodes - nodes), n.nodes))
    own = [n for n in cal.nodes if n.core_share >= 1.0]
    if timing.core_share >= 1.0 or not own:
        return timing
    return time_shared(min(own, key=lambda n: (abs(n.nodes - nodes), n.nodes)), timing)


def time_shared(own: NodeTiming, shared: NodeTiming) -> NodeTiming:
    """`own`'s figures (ranks with a core each) for the ranks of `shared`, which time-share cores:
    every time divided by their share, the copy bandwidth multiplied by it. The share is the
    sustained GEMM rate of `shared` over that of `own` (what switching between ranks costs
    included), at most the counted core_share; the counted one where either job did not measure it.

    Why not the figures the shared job timed itself, shape by shape: a time-sharing scheduler is fair over periods
    long against its slice (a few ms), as a training step is (0.25 s for the local cluster's small
    GPT), but not over a calibration's trials of 20-50 ms, whose slowest rank (the one each trial
    counts, train.calibration_job.concurrent_seconds) got less than its share. On the local cluster
    (4 ranks of 2 emulated nodes on the host's 2 cores, share 0.5), three calibrations of 2026-11-26
    timed the two-node GEMMs at 0.39-0.45 of the one-node rate (median over shapes; 0.22-0.89 by
    shape) and the narrow layer at 0.38-0.82; the search's two-node layouts, predicted from such
    figures, took 1-45% less than predicted (both attempts of the local-cluster test in CI on dc0bb49),
    its one-node layouts within 13%."""
    share = shared.core_share
    if shared.sustained_tflops > 0 and own.sustained_tflops > 0:
        share = min(share, shared.sustained_tflops / own.sustained_tflops)
    return replace(
        own,
        nodes=shared.nodes,
        tasks_per_node=shared.tasks_per_node,
        core_share=share,
        nodes_per_host=shared.nodes_per_host,
        gemms=[replace(g, seconds=g.seconds / share) for g in own.gemms],
        memory_bw_gbs=own.memory_bw_gbs * share,
        op_overhead_us=own.op_overhead_us / share,
        pointwise={kind: [seconds / share for seconds in both] for kind, both in own.pointwise.items()},
        layers=[replace(t, forward_s=t.forward_s / share, step_s=t.step_s / share) for t in own.layers],
        attention=[replace(a, forward_s=a.forward_s / share, backward_s=a.backward_s / share) for a in own.attention],
    )


@functools.lru_cache(maxsize=64)
def gemm_table(path: str, nodes: int) -> dict[tuple[int, int, int, int, str, str], float]:
    """(m, n, k, batch, precision, layout) -> seconds, as measured on (the nearest count to) `nodes` nodes."""
    timing = node_timing(load_calibration(path), nodes)
    if timing is None:
        return {}
    return {(g.m, g.n, g.k, g.batch, g.precision, g.layout): g.seconds for g in timing.gemms}


__all__ = [
    "AttentionTiming",
    "CALIBRATION_VERSION",
    "COLLECTIVES",
    "Calibration",
    "CollectiveTiming",
    "GemmTiming",
    "LAYER_COUNTS",
    "LayerTiming",
    "Link",
    "NodeTiming",
    "fit_link",
    "gemm_table",
    "links",
    "load_calibration",
    "node_timing",
    "ring_factors",
    "time_shared",
]
