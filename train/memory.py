"""Memory a rank really holds, counted from its tensors and measured, beside the planner's prediction.

    model_state_bytes   weights, gradients, optimizer states and master copies, summed over the
                        tensors the rank holds (each storage once)
    saved_activations   bytes one micro-batch's forward saves for its backward, seen by
                        torch.autograd.graph.saved_tensors_hooks (each storage once, parameters
                        excluded): what activation recompute changes
    process_baseline    the memory a process holds before its first tensor: the CUDA context on a
                        GPU (device memory in use, from the driver), the resident set on a CPU
    peak                max allocated and max reserved from the CUDA caching allocator, or the
                        peak resident set (getrusage) of a CPU process

train.planner.memory predicts each of these for the same rank (stage_memory); train.loop records
both in result.json (`memory`), so a prediction that drifts from what runs shows up in every run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from conf.schema import RunConfig
from train.contract import MEMORY_COMPONENTS, MemoryReport, OomReport, RankMemory
from train.planner.layout import Rank
from train.planner.memory import MemoryEstimate
from train.tensors import local

GIB = 2**30


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage under `t` (a DTensor's shard), None for an empty one."""
    t = local(t)
    # An async collective's result (DTensor's all-gather under sequence parallelism) is a wrapper
    # whose own storage is invalid; the gathered tensor it wraps is what autograd keeps.
    inner = getattr(t, "elem", None)
    if isinstance(inner, torch.Tensor):
        t = inner
    try:
        storage = t.untyped_storage()
        return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None


def _unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        key = _storage_key(t)
        if key is not None:
            seen[key[0]] = key[1]
    return sum(seen.values())


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's model states, each storage counted once."""

    weights: int
    """The parameters (the local TP shard)."""
    gradients: int
    """Gradients when the optimizer steps: the parameters' .grad (with DP, the reduced flat buckets
    they are views of), or under ZeRO-1 this rank's reduced slices."""
    optimizer: int
    """The optimizer's state tensors (Adam's moments and step counters)."""
    master: int
    """fp32 master copies the optimizer updates (ZeRO-1's main slices), 0 when it steps the parameters."""


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> ModelStates:
    """Count `model`'s and `optimizer`'s tensors, as they are right now (call it just before the step)."""
    params = list(model.parameters())
    weights = _unique_bytes(params)
    owned = {k[0] for k in map(_storage_key, params) if k is not None}
    main = list(getattr(optimizer, "main", []))  # train.dp.DistributedOptimizer's fp32 slices
    inner = getattr(optimizer, "inner", optimizer)
    states = [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in (main or params)]
    return ModelStates(
        weights=weights,
        gradients=_unique_bytes(grads),
        optimizer=_unique_bytes(states),
        master=_unique_bytes(m for m in main if (key := _storage_key(m)) is not None and key[0] not in owned),
    )


class SavedTensors:
    """Storages autograd saves for backward while active (parameters and their views excluded).

    The pack hook keeps each saved tensor in `held` and gives autograd an index instead of the
    tensor: a node that saves its own output (softmax, exp, flash attention's output) would otherwise
    hold a tensor whose grad_fn is that node, a reference cycle through C++ that Python's collector
    cannot free, and the whole measured forward graph (a micro-batch's activations) stayed allocated
    for the rest of the run. Measured on an H100: gpt_350m, mbs 8, peaked at 47.7 GiB against a plain
    PyTorch loop's 30.4 GiB (tests/bench/results/gpu/). `held` keeps every storage alive until the
    watch ends, so a freed address cannot be reused and miscounted while measuring; the graph's
    backward is then unusable, which a measurement never runs."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {k[0] for k in map(_storage_key, exclude) if k is not None}
        self.storages: dict[int, int] = {}
        self.described: dict[int, str] = {}
        self.held: list[torch.Tensor] = []

    def _pack(self, t: torch.Tensor) -> int:
        key = _storage_key(t)
        if key is not None and key[0] not in self.excluded:
            self.storages[key[0]] = key[1]
            self.described.setdefault(key[0], f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        self.held.append(t)
        return len(self.held) - 1

    def _unpack(self, index: int) -> torch.Tensor:
        if index >= len(self.held):
            raise RuntimeError("backward through a graph SavedTensors measured: its saved tensors were released")
        return self.held[index]

    @contextlib.contextmanager
    def watching(self) -> Iterator[SavedTensors]:
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self.held.clear()

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def saved_activation_bytes(forward: Callable[[], object], model: nn.Module) -> int:
    """Bytes `forward()` (one micro-batch through `model`, loss included on a last stage) saves
    for its backward. The graph is dropped unused afterwards, and with it every tensor it made."""
    saved = SavedTensors(exclude=model.parameters())
    with saved.watching():
        out = forward()
        del out
    return saved.nbytes


def process_baseline_bytes(device: torch.device, *, held: int = 0) -> int:
    """Memory this process holds besides its tensors: on a GPU, the device memory in use outside the
    caching allocator (CUDA context, libraries' kernels, communicator buffers; total - free -
    reserved, which also counts other processes when the device is shared); on a CPU, the resident
    set less the `held` bytes of tensors it has allocated so far."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free - torch.cuda.memory_reserved(device))
    return max(rss_bytes() - held, 0)


def rss_bytes() -> int:
    """Resident set of this process now (Linux /proc; the peak when /proc is missing)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class Peak:
    """A rank's peak memory, from the allocator (GPU) or the operating system (CPU), in bytes."""

    allocated: int | None
    """Max bytes held by tensors (CUDA caching allocator); None on a CPU."""
    reserved: int | None
    """Max bytes the caching allocator held from the driver; None on a CPU."""
    rss: int | None
    """Peak resident set of the process; None on a GPU (it counts host memory there)."""


def peak(device: torch.device) -> Peak:
    if device.type == "cuda":
        return Peak(torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), None)
    return Peak(None, None, peak_rss_bytes())


# ---------------------------------------------------------------------------------------------
# One rank's prediction and measurements, as the trainer collects them.


@dataclass
class MemoryProbe:
    """What the trainer learns about a rank's memory as it goes (train.setup, train.loop)."""

    rank: int
    stage: int
    prediction: MemoryEstimate
    baseline: int
    """process_baseline_bytes: on a GPU before the model was built, on a CPU once it was (less its
    tensors), so that the libraries and connections its setup loaded count too."""
    activations: int | None = None
    """saved_activation_bytes of one micro-batch (None: not measured)."""
    states: ModelStates | None = None
    """model_state_bytes after the first step (None: not counted)."""

    def rank_memory(self, device: torch.device) -> RankMemory:
        est, top = self.prediction, peak(device)
        predicted = {
            "weights": est.weights,
            "gradients": est.gradients,
            "optimizer": est.optimizer,
            "master": est.master,
            "activations_per_micro_batch": est.activations_per_micro_batch,
            "activations": est.activations,
            "overhead": est.overhead,
            "allocated": est.allocated,
            "reserved": est.reserved,
            "total": est.total,
        }
        counted = dataclasses.asdict(self.states) if self.states is not None else dict.fromkeys(MEMORY_COMPONENTS[:4])
        measured: dict[str, float | None] = {
            **counted,
            "activations_per_micro_batch": self.activations,
            "process_baseline": self.baseline,
            "peak_allocated": top.allocated,
            "peak_reserved": top.reserved,
            "peak_rss": top.rss,
        }
        if device.type == "cuda":
            compared = ("allocated", "the caching allocator's max allocated against the predicted allocated")
            peak_predicted, peak_measured = est.allocated, top.allocated
        else:
            compared = ("rss", "the process's peak resident set against its measured baseline plus the predicted allocated")
            peak_predicted, peak_measured = self.baseline + est.allocated, top.rss
        return RankMemory(
            rank=self.rank, stage=self.stage, role=est.stage, predicted=predicted, measured=measured,
            peak_predicted=peak_predicted, peak_measured=peak_measured, peak_compares=compared[1],
        )

    def oom_report(self, device: torch.device, *, iteration: int, capacity: float, message: str) -> OomReport:
        top = peak(device)
        allocated = reserved = None
        if device.type == "cuda":
            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return OomReport(
            rank=self.rank, stage=self.stage, role=self.prediction.stage, iteration=iteration,
            allocated=allocated, peak=top.allocated if device.type == "cuda" else top.rss, reserved=reserved,
            predicted=self.prediction.needed, capacity=capacity, message=message,
        )


def measure_stage_activations(
    stage: nn.Module,
    *,
    run: RunConfig,
    device: torch.device,
    first: bool,
    last: bool,
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> int:
    """saved_activation_bytes of one micro-batch through this rank's stage, as the loop runs it:
    token ids into a first stage (else a received fp32 activation), the loss on a last stage, under
    the run's autocast. The values are synthetic (a private generator): only their sizes matter.
    With virtual stages, the sum over the rank's chunks, each run as the interleaved schedule runs
    it (tokens into chunk 0 of the first rank, the loss after the last rank's last chunk)."""
    from train.loop import autocast, boundary_shape

    m, b = run.model, run.parallelism.mbs
    chunks = run.parallelism.virtual_stages
    gen = torch.Generator().manual_seed(run.training.seed)
    tokens, labels = torch.randint(0, m.vocab_size, (2, b, m.seq_length), generator=gen).to(device).unbind()
    labels = labels.clone()  # its own storage, as the loop's labels have

    def measure(chunk: int) -> int:
        embeds, ends = first and chunk == 0, last and chunk == chunks - 1
        x = tokens.clone() if embeds else torch.zeros(boundary_shape(run), device=device, requires_grad=True)

        def forward() -> torch.Tensor:
            with autocast(run, device):
                out: torch.Tensor = stage(x, chunk=chunk) if chunks > 1 else stage(x)
                return loss_sum(out, labels) if ends else out

        return saved_activation_bytes(forward, stage)

    try:
        return sum(measure(c) for c in range(chunks))
    finally:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)


def gather_report(mine: RankMemory, *, world_size: int, stack: str, not_measured: str | None) -> MemoryReport:
    """Every rank's RankMemory (collective: all ranks call it), lowest rank first."""
    ranks = [mine]
    if world_size > 1 and torch.distributed.is_initialized():
        gathered: list[object] = [None] * world_size
        torch.distributed.all_gather_object(gathered, mine)
        ranks = [r for r in gathered if isinstance(r, RankMemory)]
    return MemoryReport(stack=stack, ranks=sorted(ranks, key=lambda r: r.rank), not_measured=not_measured)


def oom_report(run: RunConfig, *, rank: Rank, probe: MemoryProbe | None, iteration: int, message: str) -> OomReport:
    """This rank's OomReport; before setup made a probe, the planner's prediction for its stage."""
    from train.planner.memory import usable_bytes

    on_gpu = run.hardware.device_type == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if probe is None:
        probe = MemoryProbe(rank.global_rank, rank.coords.pp, predict_rank(run, rank), baseline=0)
    return probe.oom_report(device, iteration=iteration, capacity=usable_bytes(run.hardware), message=message)


def predict_rank(run: RunConfig, rank: Rank) -> MemoryEstimate:
    """train.planner.memory's prediction for this rank's pipeline stage (micro_batch_size resolved)."""
    from train.planner.memory import stage_memory

    layout, par = rank.layout, run.parallelism
    return stage_memory(
        run.model, par, dp=layout.dp, stage=rank.coords.pp, hardware=run.hardware,
        micro_batches=layout.micro_batches(par.global_batch_size, par.mbs),
    )
