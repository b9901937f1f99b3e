"""Measure, in every task of a Slurm job at once, what the time model needs (train.planner.calibration).

Each task is a rank as training places it: same device, same thread count (SLURM_CPUS_PER_TASK),
its node's other tasks busy beside it. All tasks time the same work at the same moment, so what
they share (a node's cores and memory bus on a CPU, its NICs across nodes) is shared as in training:
- the GEMM shapes the candidate layouts run (`CalibrationSpec.gemms`), forward and backward shapes;
- the attention core (SDPA) at the same layouts' micro-batches and heads per rank;
- a large copy (memory bandwidth) and a tiny pointwise op (what any op costs beyond its work);
- all-reduce, all-gather, reduce-scatter and send/recv by message size: over the whole job when it
  is one node ('intra'), over pairs of ranks on different nodes when it is two ('inter'), every
  pair at once.

Each figure is the best of several timings, `trials` x `min_seconds` in all, after a warm-up, so a
momentary neighbour does not decide it: in one process the best of short windows (best_seconds);
across ranks the best of `trials` timings of at least `min_seconds`, each started on all ranks at
once and counting the slowest rank's time (concurrent_seconds), as a training step does. `launchers.calibrate` submits the
jobs and writes the file. (train.calibrate is the trainer's own run-time peak measurement for MFU;
this is the site calibration of the time model.)
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from train import distributed
from train.dp import all_gather_flat, reduce_scatter_flat
from train.planner.calibration import COLLECTIVES, LAYER_COUNTS, AttentionTiming, CollectiveTiming, GemmTiming

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
T = TypeVar("T")


@dataclass(frozen=True)
class CalibrationSpec:
    """What a calibration job measures."""

    gemms: tuple[tuple[int, int, int, int, str], ...]
    """(m, n, k, batch, layout) of every GEMM to time (layouts: train.planner.calibration.GemmTiming)."""
    precision: str
    device_type: str
    message_bytes: tuple[int, ...]
    """Collective message sizes (bytes)."""
    copy_bytes: int
    """Size of the tensor the bandwidth copy moves (bytes)."""
    pointwise: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(kind, shape) of each pointwise op to time forward and backward (kinds: POINTWISE)."""
    layer_model: tuple[str, int, int, int, int, int] | None = None
    """(kind, hidden, heads, seq, vocab, micro-batch) of the narrow model whose layers are timed
    whole, per TP degree (train.planner.calibration.LayerTiming); None times none."""
    layer_tp: tuple[int, ...] = (1,)
    """TP degrees the layers are timed at (each divides the tasks of a node)."""
    attention: tuple[tuple[int, int, int, int, bool], ...] = ()
    """(micro-batch, heads on a rank, sequence, head size, causal) of each attention core to time
    (train.planner.calibration.AttentionTiming)."""
    min_seconds: float = 0.05
    trials: int = 3
    timeout_s: float = 300.0
    sustained_seconds: float = 0.5
    """Length of each of the sustained GEMM's trials (s): long against a CPU scheduler's slice of a
    few ms, as a training step is (sustained_rate)."""


WINDOW_S = 1e-3
"""Length of one timing window on a CPU (s): best_seconds keeps the best window's mean per call.

A CPU's torch runs each op on an OpenMP team, one thread per core, whose threads wait for each
other at the op's end. A process of another job or user on one of those cores deschedules one
thread, and the op waits for it: a scheduler slice of several ms. On the 2-core development VM, other
processes busy, a 256x256x256 GEMM (0.18 ms) took 16 ms a call for seconds at a time, its threads each
running half the time (clock ticks per thread), 3 involuntary context switches a call and no page
fault; every 50 ms trial's mean then carried the stalls (0.52 ms, and up to 20 ms for a 1.4 ms shape)
while its best 1 ms window kept 0.18 ms, as the shape timed alone (4 runs each, same sequences).
Which shape met a busy neighbour decided the file: the tiny model's --here run recorded 256x256x256
at 20 ms, and its narrow layer's step below its forward."""


def best_seconds(fn: Callable[[], object], *, device: torch.device, min_seconds: float, trials: int) -> float:
    """Seconds of one call of `fn`: warmed up, then the best mean over windows of calls that together
    last at least `trials` x `min_seconds` (and number at least `trials`).

    A window is WINDOW_S on a CPU, so the best is one no neighbour interrupted (WINDOW_S says why);
    interference only adds time, so the best window is the machine's own speed. On a GPU a window is
    `min_seconds` (`trials` windows): its kernels queue ahead of the host, which a neighbour slows
    without slowing them, and a longer window keeps a sustained run's clocks."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    window = min_seconds if device.type == "cuda" else min(WINDOW_S, min_seconds)
    for _ in range(2):
        fn()
    sync()
    best, spent, windows = float("inf"), 0.0, 0
    while windows < trials or spent < trials * min_seconds:
        calls, tic = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            # A GPU synchronises every 4 calls (its queue stays full); a CPU's sync is free.
            if device.type != "cuda" or calls % 4 == 0 or calls < 4:
                sync()
                elapsed = time.perf_counter() - tic
                if elapsed >= window:
                    break
        best = min(best, elapsed / calls)
        spent += elapsed
        windows += 1
    return best


def concurrent_seconds(fn: Callable[[], object], *, device: torch.device, min_seconds: float, trials: int) -> float:
    """best_seconds with every rank of the job timing `fn` (a computation or a collective) at the same
    moment, each trial's figure the span from the first rank's start to the last rank's finish: what
    a training step sees, since it waits for its slowest rank.

    Timed rank by rank, ranks drift apart: whichever finishes its list first leaves the others the
    cores it shared with them, and their best trials then show more than a node delivers. On the
    local cluster (4 ranks of 2 emulated nodes on 2 cores) the 2-node GEMM rate summed over ranks
    came to 0.216 TFLOP/s against the 1-node job's 0.19 on the same 2 cores. Each rank's own time
    after a common start is not enough either: ranks sharing a core can run their trial one pair
    after the other, each pair timing itself alone. So a trial starts and ends at a barrier, every
    rank makes the same number of calls (agreed from the slowest rank's warm timing; a collective
    needs that too), and the trial counts the longest rank's time, closing barrier included (about
    1 ms on gloo over a CPU, under 2% of a trial; microseconds on NCCL).
    Without a process group it is best_seconds."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return best_seconds(fn, device=device, min_seconds=min_seconds, trials=trials)
    # NCCL returns when a collective is queued: synchronise around every timing on a GPU.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    tic = time.perf_counter()
    for _ in range(3):
        fn()
    sync()
    per_call = torch.tensor([(time.perf_counter() - tic) / 3], dtype=torch.float64, device=device)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    calls = max(1, math.ceil(min_seconds / max(per_call.item(), 1e-9)))
    best = float("inf")
    for _ in range(trials):
        sync()
        dist.barrier()
        tic = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        dist.barrier()
        elapsed = torch.tensor([time.perf_counter() - tic], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item() / calls)
    return best


def sustained_rate(fn: Callable[[], object], *, device: torch.device, seconds: float, trials: int = 2) -> float:
    """Calls of `fn` per second that this rank sustains while every rank of the job calls it back to
    back for `seconds` of wall time from a common start (the best of `trials`): the mean over ranks
    is what each gets of the hardware they share over a whole step.

    Where ranks time-share cores (an emulated cluster's nodes on one host), concurrent_seconds' short
    trials, each counting its slowest rank, understate that share (train.planner.calibration.
    time_shared), and the count of cores over ranks overstates it: it leaves out what switching
    between ranks costs (caches refilled, context switches). A trial this long includes those, and
    a rank that falls behind in one slice catches up in the next."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    barrier = dist.barrier if dist.is_available() and dist.is_initialized() else (lambda: None)
    for _ in range(2):
        fn()
    best = 0.0
    for _ in range(trials):
        sync()
        barrier()
        calls, tic = 0, time.perf_counter()
        while time.perf_counter() - tic < seconds:
            fn()
            calls += 1
            if device.type == "cuda" and calls % 4 == 0:
                sync()
        sync()
        best = max(best, calls / (time.perf_counter() - tic))
    return best


CACHE_BYTES = 256 << 20
"""Operand bytes a GEMM's or attention core's timing cycles through: more than any last-level cache,
so that each call reads its operands from memory as training's ever-new activations do, not from a
warm cache."""


def operand_copies(nbytes: int) -> int:
    """Copies of `nbytes` of operands a timing takes turns with: at least two, and as many as
    CACHE_BYTES holds (at most 64)."""
    return max(2, min(64, CACHE_BYTES // max(1, nbytes)))


def fresh_operands(make: Callable[[], T], nbytes: int) -> Callable[[], T]:
    """A supplier that hands out, in turn, copies made by `make` (`nbytes` each, operand_copies of
    them), so no call finds the previous one's operands cached."""
    copies = operand_copies(nbytes)
    made = [make() for _ in range(copies)]
    turn = itertools.count()
    return lambda: made[next(turn) % copies]


_POOLS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _align(dtype: torch.dtype) -> int:
    # Each view starts on 64 bytes, as torch's allocator aligns a tensor.
    return max(1, 64 // dtype.itemsize)


def pool_elements(dtype: torch.dtype, nbytes: int) -> int:
    """Elements of the buffer _carver needs for operands of `nbytes` (room to align two views per copy)."""
    return operand_copies(nbytes) * (nbytes // dtype.itemsize + 2 * _align(dtype))


def _operand_bytes(m: int, n: int, k: int, batch: int, dtype: torch.dtype) -> int:
    return dtype.itemsize * batch * (m * k + k * n)


def _carver(dtype: torch.dtype, device: torch.device, nbytes: int) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """A `make` helper for fresh_operands: each call returns the next `shape` of one random buffer
    that the whole process shares (read only), at least operand_copies(nbytes) x `nbytes` long.

    Views, not new tensors: drawing every shape's copies anew (randn; clones were no faster) took
    30-41 s of the tiny model's 89-114 s --here run, 28 GB of fresh pages over its 189 GEMM shapes
    (65,536 page faults per 256 MiB). The buffer is drawn once, and again only where a shape needs
    more (measure() lets it go at the end)."""
    key = (device, dtype)
    align = _align(dtype)
    elements = pool_elements(dtype, nbytes)
    if key not in _POOLS or _POOLS[key].numel() < elements:
        _POOLS.pop(key, None)
        _POOLS[key] = torch.randn(elements, device=device).to(dtype)
    pool, offset = _POOLS[key], 0

    def take(shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal offset
        size = math.prod(shape)
        offset = -(-offset // align) * align
        if offset + size > pool.numel():
            offset = 0
        view = pool[offset : offset + size].view(shape)
        offset += size
        return view

    return take


def _gemm(m: int, n: int, k: int, batch: int, layout: str, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """One call of the GEMM C[m,n] = A[m,k] B[k,n] with training's operand layouts, on fresh operands."""
    lead = (batch,) if batch > 1 else ()
    a_shape = (*lead, k, m) if layout == "tn" else (*lead, m, k)
    b_shape = (*lead, n, k) if layout == "nt" else (*lead, k, n)
    nbytes = _operand_bytes(m, n, k, batch, dtype)
    take = _carver(dtype, device, nbytes)
    pairs = fresh_operands(lambda: (take(a_shape), take(b_shape)), nbytes)

    def call() -> object:
        a, b = pairs()
        return torch.matmul(a.transpose(-2, -1) if layout == "tn" else a, b.transpose(-2, -1) if layout == "nt" else b)

    return call


def _pointwise_op(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    if kind == "layer_norm":
        weight, bias = torch.ones(shape[-1], device=device, dtype=dtype), torch.zeros(shape[-1], device=device, dtype=dtype)
        return lambda x: torch.nn.functional.layer_norm(x, shape[-1:], weight, bias)
    if kind == "gelu":
        return torch.nn.functional.gelu
    if kind == "add":
        other = torch.randn(shape, device=device).to(dtype)
        return lambda x: x + other
    if kind == "softmax":
        return lambda x: torch.softmax(x, dim=-1)
    if kind == "cross_entropy":
        target = torch.randint(0, shape[-1], shape[:-1], device=device)
        return lambda x: torch.nn.functional.cross_entropy(x.float(), target)
    raise ValueError(f"unknown pointwise op {kind!r}")


def pointwise_seconds(
    kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, timing: dict[str, Any]
) -> tuple[float, float]:
    """(forward, backward) seconds per element of one pointwise op on a tensor of `shape`."""
    op = _pointwise_op(kind, shape, dtype, device)
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    forward = concurrent_seconds(lambda: op(x.detach()), device=device, **timing)

    def both() -> None:
        y = op(x)
        y.backward(torch.ones_like(y))

    both_s = concurrent_seconds(both, device=device, **timing)
    elements = math.prod(shape)
    return forward / elements, max(both_s - forward, 0.0) / elements


def attention_seconds(
    shape: tuple[int, int, int, int, bool], dtype: torch.dtype, device: torch.device, timing: dict[str, Any]
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core as train.model runs it: SDPA on the q, k and
    v views of one [b, s, heads, 3, head_dim] QKV output (strided, as the model hands them over), its
    output's gradient the transposed view of a [b, s, heads, head_dim] one (the model's output
    projection reads the output through transpose(1, 2)). Each call takes the next of fresh_operands'
    QKV outputs and output gradients."""
    b, heads, s, d, causal = shape
    nbytes = dtype.itemsize * b * s * heads * 4 * d
    take = _carver(dtype, device, nbytes)
    # Each QKV output a leaf of its own (its gradient goes to it, not to the shared buffer).
    operands = fresh_operands(lambda: (take((b, s, heads, 3, d)).detach().requires_grad_(),
                                       take((b, s, heads, d)).transpose(1, 2)), nbytes)  # fmt: skip

    def core(x: torch.Tensor) -> torch.Tensor:
        q, k, v = x.permute(3, 0, 2, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # Recorded by autograd, as training's forward is (a GPU kernel then also keeps its softmax
    # statistics for backward); the graph goes with the output.
    forward = concurrent_seconds(lambda: core(operands()[0]), device=device, **timing)

    def both() -> None:
        qkv, grad = operands()
        core(qkv).backward(grad)
        qkv.grad = None

    return forward, max(concurrent_seconds(both, device=device, **timing) - forward, 0.0)


def _collective(op: str, nbytes: int, group: Any, peer: int | None, device: torch.device) -> Callable[[], object] | None:
    size = dist.get_world_size(group)
    n = max(size, nbytes // 4 // size * size)
    x = torch.ones(n, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        # nbytes is the whole gathered message, as for the other collectives.
        shard = torch.ones(n // size, dtype=torch.float32, device=device)
        gathered = torch.empty(n, dtype=torch.float32, device=device)
        return lambda: all_gather_flat(gathered, shard, group=group)
    if op == "reduce_scatter":
        out = torch.empty(n // size, dtype=torch.float32, device=device)
        return lambda: reduce_scatter_flat(out, x, group=group)
    if peer is None:
        return None
    rank = dist.get_rank()
    other = torch.empty_like(x)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, other, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    return exchange if rank != peer else None


def gemm_seconds(spec: CalibrationSpec, dtype: torch.dtype, device: torch.device) -> list[float]:
    """Seconds of each of spec.gemms: the median of `trials` timings (concurrent_seconds, each the
    best of its windows), taken in `trials` passes over all the shapes rather than shape after shape.

    A machine's speed drifts over seconds to minutes (a VM's neighbours, clocks); timed shape after
    shape, a slow stretch falls on some shapes only, and the time model then ranks layouts by which
    of their GEMMs met it. On the local cluster, GEMM time of the small GPT's layouts at micro-batch 1
    against 2 (same tokens per step) came out from 5% lower to 24% higher across calibrations of one
    hour, while training measured them within the runs' noise of each other. In passes, every shape
    is timed in every stretch; the median keeps each at the machine's typical speed over the
    calibration, as training runs through all of its stretches (the best pass, tried first, priced
    every layout at the fastest stretch: in its three runs 33 of 36 rows were predicted fast, by
    7.6-15.4% on average)."""
    # The largest buffer first: the operands' buffer (_carver) is drawn once, and every shape's
    # operands are views of it, alive together.
    order = sorted(range(len(spec.gemms)), key=lambda i: -pool_elements(dtype, _operand_bytes(*spec.gemms[i][:4], dtype)))
    calls = {i: _gemm(*spec.gemms[i], dtype, device) for i in order}
    timed: list[list[float]] = [[] for _ in spec.gemms]
    for _ in range(spec.trials):
        for i in order:
            timed[i].append(concurrent_seconds(calls[i], device=device, min_seconds=spec.min_seconds, trials=1))
    return [statistics.median(t) for t in timed]


def measure(spec: CalibrationSpec) -> dict[str, Any]:
    """This task's measurements (JSON-ready): its GEMMs, copy bandwidth, op cost and collectives."""
    env = os.environ
    if (threads := distributed.cpu_threads(env)) is not None:
        torch.set_num_threads(threads)
    launch = distributed.launch_from_env(env)
    device = torch.device("cuda", launch.local_rank if launch else 0) if spec.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if launch is not None:
        distributed.init_process_group(launch, device_type=device.type, timeout_s=spec.timeout_s)
    timing: dict[str, Any] = {"min_seconds": spec.min_seconds, "trials": spec.trials}
    dtype = DTYPES[spec.precision]
    barrier = dist.barrier if launch is not None else (lambda: None)
    barrier()
    gemms = [asdict(GemmTiming(m, n, k, b, spec.precision, s, lay)) for (m, n, k, b, lay), s in zip(spec.gemms, gemm_seconds(spec, dtype, device), strict=True)]
    # The largest GEMM, sustained: what ranks that share cores each get of them (sustained_rate).
    sustained = 0.0
    if spec.gemms:
        m, n, k, b, lay = max(spec.gemms, key=lambda g: g[0] * g[1] * g[2] * g[3])
        sustained = 2 * m * n * k * b * sustained_rate(_gemm(m, n, k, b, lay, dtype, device), device=device,
                                                       seconds=spec.sustained_seconds)  # fmt: skip
    # Written first: a CPU's untouched torch.empty reads as the kernel's one zero page, from cache
    # (a 64 MiB copy then took 1.3 ms, "113 GB/s", against 8 ms from a written source).
    src = torch.randn(max(1, spec.copy_bytes // 4), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy = concurrent_seconds(lambda: dst.copy_(src), device=device, **timing)
    tiny = torch.ones(8, device=device)
    op = concurrent_seconds(lambda: tiny.add(1.0), device=device, **timing)
    pointwise = {kind: list(pointwise_seconds(kind, shape, dtype, device, timing)) for kind, shape in spec.pointwise}
    attention = [
        asdict(AttentionTiming(b, heads, s, d, causal, spec.precision, *attention_seconds((b, heads, s, d, causal), dtype, device, timing)))
        for b, heads, s, d, causal in spec.attention
    ]
    _POOLS.clear()  # the operands' buffer (_carver): what follows runs in training's memory
    collectives = _collectives(spec, launch, device, timing) if launch is not None else []
    layers = layer_timings(spec, launch, device, timing) if spec.layer_model is not None else []
    barrier()
    with contextlib.suppress(Exception):
        distributed.destroy_process_group()
    return {
        "rank": launch.rank if launch else 0,
        # Which ranks time-share a host's cores (launchers.calibrate.core_share): an emulated cluster's
        # nodes all run on one host, under one host name.
        "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "host_cpus": os.cpu_count() or 1,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads",
        "gemms": gemms,
        "sustained_tflops": sustained / 1e12,
        "memory_bw_gbs": 2 * src.numel() * 4 / copy / 1e9,
        "op_overhead_us": op * 1e6,
        "pointwise": pointwise,
        "attention": attention,
        "collectives": collectives,
        "layers": layers,
    }


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    # As the trainer runs a 16-bit precision: fp32 weights, autocast to the 16-bit type.
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def layer_timings(
    spec: CalibrationSpec, launch: distributed.LaunchEnv | None, device: torch.device, timing: dict[str, Any]
) -> list[dict[str, Any]]:
    """Seconds of one transformer layer's forward, and of its forward and backward, per TP degree, run
    by the trainer's own code (train.model, train.parallel.apply_tp) at a narrow width: what a layer
    costs beyond the GEMMs, pointwise ops and collectives the time model counts (Python, autograd and
    DTensor dispatch) shows as the difference from the model's own prediction of the same layer."""
    from conf.schema import ModelConfig, ModelKind
    from train.init import initialize
    from train.model import build_model
    from train.parallel import apply_tp, lm_loss_fn

    assert spec.layer_model is not None
    kind, hidden, heads, seq, vocab, mbs = spec.layer_model
    world = launch.world_size if launch is not None else 1
    per_node = world // int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    out = []
    for tp in spec.layer_tp:
        if tp > 1 and (launch is None or per_node % tp):
            continue
        mesh = distributed.build_mesh(device.type, pp=1, dp=world // tp, tp=tp) if tp > 1 else None
        calls: dict[int, tuple[Callable[[], object], Callable[[], object]]] = {}
        for layers in LAYER_COUNTS:
            cfg = ModelConfig(kind=ModelKind(kind), num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                              seq_length=seq, vocab_size=vocab)  # fmt: skip
            model = build_model(cfg, device="meta", tp=tp)
            if mesh is not None:
                apply_tp(model, tp_mesh=mesh["tp"])
            model.to_empty(device=device)
            initialize(model, seed=0, num_layers=layers)
            loss_fn = lm_loss_fn(model)
            tokens = torch.randint(0, vocab, (mbs, seq), device=device)

            def forward(model: torch.nn.Module = model, tokens: torch.Tensor = tokens) -> object:
                with _autocast(spec.precision, device):
                    return model(tokens)

            def step(model: torch.nn.Module = model, tokens: torch.Tensor = tokens, loss_fn: Any = loss_fn) -> None:
                with _autocast(spec.precision, device):
                    loss = loss_fn(model(tokens), tokens)
                loss.backward()

            calls[layers] = (forward, step)
        out.append({"tp": tp, "kind": kind, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": seq,
                    "vocab_size": vocab, "micro_batch_size": mbs,
                    **_layer_seconds(calls, device, timing, tp=tp)})  # fmt: skip
    return out


LAYER_ATTEMPTS = (2, 3)
"""Timings of the two narrow models _layer_seconds keeps the best of: at least the first, apart in
time (a narrow layer's call runs dozens of ops, each a chance for a neighbour to stall it, so one
busy spell decides a whole timing: on the 2-core VM a 1-layer forward timed 58-88 ms, then 0.22 ms
seconds later), and at most the second while their difference is no layer's."""


def per_layer(few: tuple[float, float], many: tuple[float, float]) -> tuple[float, float] | None:
    """(forward, forward + backward) seconds of one layer from the (forward, step) seconds of the
    LAYER_COUNTS models, or None where they cannot be one layer's: a forward not above zero, or a
    step below its forward (each model's figures timed apart, a neighbour can slow the smaller
    model's; a --here run on a busy 2-core VM recorded forward 112 ms, step -22.6 ms)."""
    span = LAYER_COUNTS[1] - LAYER_COUNTS[0]
    forward, step = (many[0] - few[0]) / span, (many[1] - few[1]) / span
    return (forward, step) if 0 < forward <= step else None


def _layer_seconds(
    calls: dict[int, tuple[Callable[[], object], Callable[[], object]]], device: torch.device, timing: dict[str, Any], *, tp: int
) -> dict[str, float]:
    """forward_s and step_s of one layer: the difference of the LAYER_COUNTS models' best timings.

    Interference only adds time, so each figure keeps its best over attempts, and an inconsistent
    difference (per_layer) is timed again, up to LAYER_ATTEMPTS[1] times. Every rank gets the same
    figures from concurrent_seconds (the slowest rank's), so the ranks of a TP group agree on another
    attempt and keep calling as often as each other. Still inconsistent, the file gets the larger
    model's time per layer: positive, step no less than forward, and an upper bound (it spreads the
    embeddings', head's and loss's time over the layers), so the time model's framework residual
    errs towards pricing more, never a negative time."""
    best: dict[int, tuple[float, float]] = {}
    for attempt in range(1, LAYER_ATTEMPTS[1] + 1):
        for layers, (forward_fn, step_fn) in calls.items():
            f, st = concurrent_seconds(forward_fn, device=device, **timing), concurrent_seconds(step_fn, device=device, **timing)
            f0, st0 = best.get(layers, (f, st))
            best[layers] = (min(f0, f), min(st0, st))
        few, many = (best[n] for n in LAYER_COUNTS)
        if attempt >= LAYER_ATTEMPTS[0] and (seconds := per_layer(few, many)) is not None:
            return {"forward_s": seconds[0], "step_s": seconds[1]}
    forward, step = many[0] / LAYER_COUNTS[1], many[1] / LAYER_COUNTS[1]
    # Reported: the file keeps no note of it.
    print(f"calibrate: the narrow layer at tp={tp} timed {few} s at {LAYER_COUNTS[0]} layer(s) and {many} s at "
          f"{LAYER_COUNTS[1]} (forward, step) in {LAYER_ATTEMPTS[1]} attempts, no consistent difference: recording the "
          f"{LAYER_COUNTS[1]}-layer model's time per layer instead (an upper bound)", file=sys.stderr, flush=True)  # fmt: skip
    return {"forward_s": forward, "step_s": max(step, forward)}


def _collectives(
    spec: CalibrationSpec, launch: distributed.LaunchEnv, device: torch.device, timing: dict[str, Any]
) -> list[dict[str, Any]]:
    """Intra-node over the whole job (one node), or inter-node over pairs of ranks on two nodes."""
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    world, rank = launch.world_size, launch.rank
    peer: int | None
    if nodes > 1:
        # Pairs (i, i + half): the same local rank on each node; every rank must create every group.
        half = world // nodes
        pairs = [dist.new_group([i, i + half]) for i in range(half)]
        group, scope, ranks = pairs[rank % half], "inter", 2
        peer = (rank + half) % world
    else:
        group, scope, ranks = None, "intra", world
        peer = rank ^ 1 if (rank ^ 1) < world else None
    out = []
    for op in COLLECTIVES:
        for nbytes in spec.message_bytes:
            fn = _collective(op, nbytes, group, peer, device)
            if fn is None:
                continue
            seconds = concurrent_seconds(fn, device=device, **timing)
            n = 2 if op == "send_recv" else ranks
            out.append(asdict(CollectiveTiming(op, scope, n, nbytes, seconds)))
            dist.barrier()
    return out


__all__ = ["CalibrationSpec", "best_seconds", "measure"]
