"""Megatron-style training loop: one process, one device, for now.

run_training() owns the outcome: whatever happens (a clean run, a NaN loss, an OOM, any
exception, Slurm's SIGTERM) it writes one result.json and prints its path, then raises for
anything but `ok` so the process exits non-zero. train() / train_step() / forward_backward()
are the loop, the optimizer step and one micro-batch.

Parallelism comes later as functions applied to the built model (tensor/pipeline/data over a
DeviceMesh); this module already keeps the layout explicit: the world (dp, tp, pp), the
global-batch arithmetic and the per-rank sample indices are computed in one place.

The log line's TFLOPs and MFU use model FLOPs (per-GEMM count, no recompute) so that
MFU = TFLOPs / peak holds on the line; Megatron-LM's Eq. 3 figure is in the record, labelled.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conf.schema import Precision, Recompute, RunConfig, to_plain_dict
from train import flops
from train.calibrate import measure_peak_tflops
from train.data import TokenSource, get_batch, make_source
from train.metrics import (
    IterationStats,
    RunRecord,
    allowlisted_env,
    format_log_line,
    redact_values,
    scrub,
    scrub_overrides,
    secret_values,
    summarize,
    write_json_atomic,
)
from train.model import IGNORE_INDEX, TransformerLM, build_model, count_params, lm_loss_sum, num_layers
from train.optim import build_optimizer, lr_at, set_lr
from train.wandb_log import WandbLogger

RESULT_FILE = "result.json"
FLOPS_CONVENTIONS = {
    "model": "per-GEMM count, forward + 2x backward, no recompute (train.flops); MFU and the log's TFLOPs",
    "hardware": "model FLOPs plus the recomputed forwards (train.flops); basis of HFU",
    "megatron_eq3": "Narayanan et al. 2021 Eq. 3, as Megatron-DeepSpeed prints TFLOPs (compare to its logs)",
}
_REPO_ROOT = Path(__file__).resolve().parents[1]


class TrainingDiverged(RuntimeError):
    """The loss (or, outside fp16, the gradient norm) became NaN or inf; the record says `nan`."""


class TrainingTimeout(Exception):
    """Slurm asked the job to stop (SIGTERM at the time limit, or the SIGUSR1 warning)."""


@dataclass(frozen=True)
class World:
    """Where this process sits in the job; all 1 until the parallel engines land."""

    world_size: int = 1
    rank: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1


@dataclass
class Progress:
    """What the run has learnt so far; the record is built from it even after a failure."""

    device_name: str | None = None
    params: int | None = None
    optimizer: str | None = None
    peak_tflops: float | None = None
    peak_source: str | None = None
    max_mem_source: str | None = None
    iterations: list[IterationStats] = field(default_factory=list)
    skipped: int = 0
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool


# ---------------------------------------------------------------------------------------------
# The outcome of a run: one record, whatever happens.


def run_training(
    run: RunConfig, *, output_dir: Path, overrides: Sequence[str], sweep_name: str | None = None
) -> dict[str, Any]:
    """Train `run`, write <output_dir>/result.json, print its path, return the record.

    Raises after writing the record when the status is not `ok`: the original exception for
    oom / error / timeout, TrainingDiverged for nan. `sweep_name` is the W&B group when
    logger.wandb_group is unset (default: the Hydra sweep's name, looked up by train.wandb_log).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    world, progress = resolve_world(run), Progress()
    wandb = WandbLogger(
        run.logger,
        config=redact_values(
            {**scrub(to_plain_dict(run)), "world": asdict(world)}, secret_values(os.environ)
        ),
        output_dir=output_dir,
        name=(
            f"{run.model.name}-tp{world.tp}-pp{world.pp}-dp{world.dp}-mbs{run.parallelism.micro_batch_size}"
            f"-gbs{run.parallelism.global_batch_size}"
        ),
        group=sweep_name,
    )
    status, message = "error", None
    failure: BaseException | None = None
    try:
        with _timeout_signals():
            status = train(run, world=world, progress=progress, wandb=wandb)
    except torch.OutOfMemoryError as exc:
        status, message, failure = "oom", f"{type(exc).__name__}: {exc}", exc
    except TrainingTimeout as exc:
        status, message, failure = "timeout", str(exc), exc
    except BaseException as exc:  # the record is written for KeyboardInterrupt too
        status, message, failure = "error", f"{type(exc).__name__}: {exc}", exc
    if status == "nan":
        message = (
            f"loss or gradient norm became NaN/inf at iteration {len(progress.iterations)}; training stopped"
        )
    if wandb.error:
        progress.warnings.append(wandb.error)
    record = build_record(
        run,
        world=world,
        progress=progress,
        status=status,
        message=message,
        overrides=overrides,
        started=started,
        wall_s=time.perf_counter() - t0,
    )
    path = output_dir / RESULT_FILE
    write_json_atomic(path, record)
    wandb.summary(_summary_figures(record))
    wandb.finish(exit_code=0 if status == "ok" else 1)
    print(f"result: {path}", flush=True)
    if failure is not None:
        raise failure
    if status == "nan":
        raise TrainingDiverged(f"{message} (record: {path})")
    return record


def build_record(
    run: RunConfig,
    *,
    world: World,
    progress: Progress,
    status: str,
    message: str | None,
    overrides: Sequence[str],
    started: datetime,
    wall_s: float,
) -> dict[str, Any]:
    """The JSON-ready record: medians after warm-up, FLOPs, versions; credentials scrubbed."""
    try:
        fpi = flops_per_iteration(run)
    except ValueError as exc:  # a shape the FLOPs model rejects must not cost the record
        fpi = {}
        progress.warnings.append(f"FLOPs not computed: {exc}")
    medians = summarize(
        progress.iterations,
        warmup=run.training.warmup_iters,
        seq_length=run.model.seq_length,
        devices=world.world_size,
        flops_per_iteration=fpi,
    )
    last = progress.iterations[-1] if progress.iterations else None
    mem = max((it.max_mem_gib for it in progress.iterations), default=None)
    record = RunRecord(
        status=status,
        message=message,
        config=scrub(to_plain_dict(run)),
        overrides=scrub_overrides(overrides),
        world={"world_size": world.world_size, "dp": world.dp, "tp": world.tp, "pp": world.pp},
        hardware=run.hardware.name,
        device=progress.device_name,
        versions=versions(),
        git_commit=git_commit(),
        params=progress.params,
        optimizer=progress.optimizer,
        precision=_name(run.parallelism.precision),
        flops_per_iteration=fpi,
        flops_conventions=dict(FLOPS_CONVENTIONS),
        iterations_run=len(progress.iterations),
        warmup_iters=run.training.warmup_iters,
        measured_iterations=medians.measured_iterations,
        skipped_iterations=progress.skipped,
        final_loss=last.loss if last else None,
        sec_per_iter=medians.sec_per_iter,
        samples_per_s=medians.samples_per_s,
        tokens_per_s_per_device=medians.tokens_per_s_per_device,
        tflops_per_device=medians.tflops_per_device,
        tflops_per_device_hardware=medians.tflops_per_device_hardware,
        tflops_per_device_megatron_eq3=medians.tflops_per_device_megatron_eq3,
        mfu=_utilization(medians.tflops_per_device, progress, "MFU"),
        hfu=_utilization(medians.tflops_per_device_hardware, progress, "HFU"),
        max_mem_gib=mem,
        max_mem_gib_per_rank=[] if mem is None else [mem],
        max_mem_source=progress.max_mem_source,
        peak_tflops=progress.peak_tflops,
        peak_source=progress.peak_source,
        env=allowlisted_env(os.environ),
        losses=[it.loss for it in progress.iterations],
        iteration_times_s=[it.elapsed_s for it in progress.iterations],
        warnings=list(progress.warnings),
        started_at=started.isoformat(timespec="seconds"),
        wall_s=wall_s,
    )
    result: dict[str, Any] = redact_values(record.to_dict(), secret_values(os.environ))
    return result


def flops_per_iteration(run: RunConfig) -> dict[str, float]:
    """FLOPs of one optimizer step: model (MFU), hardware (HFU, with recompute), Megatron Eq. 3."""
    m, par = run.model, run.parallelism
    gbs = par.global_batch_size
    return {
        "model": flops.model_flops_per_iteration(m, global_batch_size=gbs),
        "hardware": flops.hardware_flops_per_iteration(m, global_batch_size=gbs, recompute=par.recompute),
        # Megatron-DeepSpeed applies its recompute factor 4 to any recompute, selective too.
        "megatron_eq3": flops.megatron_eq3_flops_per_iteration(
            m, global_batch_size=gbs, full_recompute=par.recompute != Recompute.none, tp=par.tp
        ),
    }


def _utilization(tflops: float | None, progress: Progress, what: str, *, warn: bool = True) -> float | None:
    """MFU/HFU, or None (with a warning in the record) when the peak is unknown or exceeded.

    Above 100% means the peak or the FLOPs count is wrong (a noisy calibration, say); the
    run's own figures are still right, so the record keeps them and flags the ratio.
    """
    if tflops is None:
        return None
    try:
        return flops.utilization(tflops, progress.peak_tflops)
    except flops.ImpossibleUtilization as exc:
        if warn:  # the medians' figure only; one noisy iteration is not worth a warning
            progress.warnings.append(f"{what} not recorded: {exc}")
        return None


def _summary_figures(record: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "status",
        "optimizer",
        "sec_per_iter",
        "samples_per_s",
        "tokens_per_s_per_device",
        "tflops_per_device",
        "tflops_per_device_megatron_eq3",
        "mfu",
        "hfu",
        "max_mem_gib",
        "peak_tflops",
        "peak_source",
        "final_loss",
        "skipped_iterations",
    )
    return {k: record.get(k) for k in keys}


# ---------------------------------------------------------------------------------------------
# The loop.


@dataclass(frozen=True)
class Setup:
    """What train() builds before the first step."""

    device: torch.device
    model: TransformerLM
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    source: TokenSource


def setup(run: RunConfig, *, world: World, progress: Progress) -> Setup:
    """Device, model (seeded, checked against the layout), optimizer, loss scaler, data, peak."""
    par, tr = run.parallelism, run.training
    device = setup_device(run, progress)
    torch.manual_seed(tr.seed)
    model = build_model(run.model, recompute=par.recompute, device=device)
    check_layout(run, model, world)
    progress.params = count_params(model)
    optimizer, progress.optimizer = build_optimizer(
        model, impl=par.optimizer, lr=tr.lr, weight_decay=tr.weight_decay, device_type=device.type
    )
    scaler = torch.amp.GradScaler(device.type, enabled=par.precision == Precision.fp16)
    source = make_source(run.model, seed=tr.seed, data_path=tr.data_path)
    progress.peak_tflops, progress.peak_source = resolve_peak(run, device)
    return Setup(device, model, optimizer, scaler, source)


def train(run: RunConfig, *, world: World, progress: Progress, wandb: WandbLogger) -> str:
    """Run run.training.train_iters optimizer steps; 'ok', or 'nan' when the loss diverged."""
    par, tr = run.parallelism, run.training
    s = setup(run, world=world, progress=progress)
    print(_banner(run, s.model, progress), flush=True)
    for iteration in range(1, tr.train_iters + 1):
        start = time.perf_counter()
        lr = lr_at(iteration, peak=tr.lr, warmup_iters=tr.lr_warmup_iters, total_iters=tr.train_iters)
        set_lr(s.optimizer, lr)
        consumed = (iteration - 1) * par.global_batch_size
        batches = step_batches(run, s.source, world=world, consumed=consumed, device=s.device)
        result = train_step(s.model, s.optimizer, s.scaler, batches, run=run, device=s.device)
        _sync(s.device)
        elapsed = time.perf_counter() - start
        progress.skipped += int(result.skipped)
        stats = _iteration_stats(
            run, iteration, elapsed, lr, result, world=world, progress=progress, device=s.device
        )
        diverged = stats.nan_iters > 0
        progress.iterations.append(stats)
        if iteration % tr.log_interval == 0 or diverged or iteration == tr.train_iters:
            print(format_log_line(stats), flush=True)
        wandb.log(_wandb_metrics(stats), step=iteration)
        if diverged:
            return "nan"
    if progress.peak_source == "measured":
        # Any calibration is a lower bound on the peak (interference only slows it down), so
        # a second one after training tightens it for the record's MFU on a shared node.
        progress.peak_tflops = max(progress.peak_tflops or 0.0, measure_peak_tflops(s.device, par.precision))
    return "ok"


def _iteration_stats(
    run: RunConfig,
    iteration: int,
    elapsed: float,
    lr: float,
    result: StepResult,
    *,
    world: World,
    progress: Progress,
    device: torch.device,
) -> IterationStats:
    """The figures of Megatron's log line for one finished iteration."""
    gbs = run.parallelism.global_batch_size
    tflops = flops.achieved_tflops(flops_per_iteration(run)["model"], elapsed, world.world_size)
    diverged = not (math.isfinite(result.loss) and (math.isfinite(result.grad_norm) or result.skipped))
    return IterationStats(
        iteration=iteration,
        train_iters=run.training.train_iters,
        consumed_samples=iteration * gbs,
        consumed_tokens=iteration * gbs * run.model.seq_length,
        elapsed_s=elapsed,
        learning_rate=lr,
        global_batch_size=gbs,
        loss=result.loss,
        loss_scale=result.loss_scale,
        grad_norm=result.grad_norm,
        skipped_iters=progress.skipped,
        nan_iters=int(diverged),
        samples_per_s=gbs / elapsed,
        tflops=tflops,
        mfu=_utilization(tflops, progress, "MFU", warn=False),
        max_mem_gib=max_memory_gib(device),
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    run: RunConfig,
    device: torch.device,
) -> StepResult:
    """One optimizer step over all micro-batches: accumulate, unscale, clip, step.

    A non-finite loss returns before the optimizer touches the weights. In fp16 a non-finite
    gradient is the loss scaler's business: the step is skipped and counted, as in Megatron.
    """
    optimizer.zero_grad(set_to_none=True)
    # Normalize by the global batch's labelled tokens, so accumulation == one large batch.
    normalizer = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
    loss = torch.zeros((), device=device)
    for tokens, labels in batches:
        loss += forward_backward(model, tokens, labels, normalizer=normalizer, run=run, scaler=scaler)
    loss_value = loss.item()
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    if not math.isfinite(loss_value):
        return StepResult(loss_value, math.nan, scale, skipped=False)
    scaler.unscale_(optimizer)
    clip = run.training.grad_clip if run.training.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    scaler.step(optimizer)  # in fp16, skips the update when any gradient is inf/NaN
    scaler.update()
    skipped = scaler.is_enabled() and float(scaler.get_scale()) < scale
    return StepResult(loss_value, grad_norm, scale, skipped=skipped)


def forward_backward(
    model: nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    normalizer: int,
    run: RunConfig,
    scaler: torch.amp.GradScaler,
) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its (detached) share of the step's loss."""
    precision = run.parallelism.precision
    dtype = torch.bfloat16 if precision == Precision.bf16 else torch.float16
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=precision != Precision.fp32):
        logits = model(tokens)
    loss = lm_loss_sum(logits, labels) / normalizer
    scaler.scale(loss).backward()
    return loss.detach()


# ---------------------------------------------------------------------------------------------
# Layout, batches, device.


def resolve_world(run: RunConfig) -> World:
    """The layout this process runs; only one device is implemented so far."""
    par = run.parallelism
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dp = par.dp if par.dp is not None else max(world_size // (par.tp * par.pp), 1)
    return World(world_size=world_size, dp=dp, tp=par.tp, pp=par.pp)


def check_layout(run: RunConfig, model: TransformerLM, world: World) -> None:
    """Fail before the first step unless every step consumes exactly global_batch_size samples
    and the model holds exactly num_layers layers."""
    par = run.parallelism
    if (world.world_size, world.dp, world.tp, world.pp) != (1, 1, 1, 1):
        raise NotImplementedError(
            f"this trainer runs one process on one device; got world_size={world.world_size} dp={world.dp} "
            f"tp={world.tp} pp={world.pp}"
        )
    if par.engine != "native" or par.zero_stage != 0 or par.rampup_batch_size:
        raise NotImplementedError(
            "engine=deepspeed, zero_stage > 0 and rampup_batch_size are not implemented yet"
        )
    per_micro_step = par.micro_batch_size * world.dp
    if par.global_batch_size % per_micro_step:
        raise ValueError(
            f"global_batch_size {par.global_batch_size} is not a multiple of "
            f"micro_batch_size x dp = {per_micro_step}"
        )
    consumed = sum(len(r) for r in micro_batch_indices(run, world=world, consumed=0)) * world.dp
    if consumed != par.global_batch_size:
        raise AssertionError(
            f"a step would consume {consumed} samples, not global_batch_size {par.global_batch_size}"
        )
    if num_layers(model) != run.model.num_layers:
        raise AssertionError(
            f"model holds {num_layers(model)} layers, config asks for {run.model.num_layers}"
        )


def micro_batch_indices(run: RunConfig, *, world: World, consumed: int) -> list[range]:
    """Global sample indices of this rank's micro-batches for the step starting at `consumed`.

    Micro-batch m of DP rank r takes samples [m*dp + r] x mbs onwards, so any (mbs, dp)
    split of a step covers the same global_batch_size samples exactly once.
    """
    par = run.parallelism
    mbs, dp = par.micro_batch_size, world.dp
    micro_batches = par.global_batch_size // (mbs * dp)
    rank = world.rank % dp
    return [
        range(consumed + (m * dp + rank) * mbs, consumed + (m * dp + rank + 1) * mbs)
        for m in range(micro_batches)
    ]


def step_batches(
    run: RunConfig, source: TokenSource, *, world: World, consumed: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        get_batch(source, run.model, indices=indices, seed=run.training.seed, device=device)
        for indices in micro_batch_indices(run, world=world, consumed=consumed)
    ]


def setup_device(run: RunConfig, progress: Progress) -> torch.device:
    if run.hardware.device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"hardware {run.hardware.name} needs CUDA, and no CUDA device is visible")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        # The configs' fp32 peaks are TF32 tensor-core peaks; run fp32 matmuls the same way.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        progress.device_name = torch.cuda.get_device_name(device)
        progress.max_mem_source = "torch.cuda.max_memory_allocated"
    else:
        device = torch.device(run.hardware.device_type)
        progress.device_name = _cpu_name()
        progress.max_mem_source = "peak RSS of the process (getrusage)"
    return device


def resolve_peak(run: RunConfig, device: torch.device) -> tuple[float | None, str | None]:
    """(peak TFLOP/s per device, 'measured' | 'datasheet'), or (None, None) when unknown."""
    if run.hardware.peak_measured:
        return measure_peak_tflops(device, run.parallelism.precision), "measured"
    peak = flops.peak_tflops(run.hardware, run.parallelism.precision)
    return peak, ("datasheet" if peak is not None else None)


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.partition(':')[2].strip()} x {torch.get_num_threads()} threads"
    return f"cpu: {platform.processor() or platform.machine()} x {torch.get_num_threads()} threads"


def max_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux (bytes on macOS, where this overstates by 1024x).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _banner(run: RunConfig, model: nn.Module, progress: Progress) -> str:
    params = count_params(model)
    peak = (
        "unknown" if progress.peak_tflops is None else f"{progress.peak_tflops:.3f} ({progress.peak_source})"
    )
    return (
        f"megasweep: {run.model.name} ({_name(run.model.kind)}, {params / 1e6:.2f}M params) on "
        f"{progress.device_name} | precision {_name(run.parallelism.precision)} | recompute "
        f"{_name(run.parallelism.recompute)} | optimizer {progress.optimizer} | peak TFLOPs {peak}"
    )


def _name(value: object) -> str:
    return str(getattr(value, "value", value))


def _wandb_metrics(s: IterationStats) -> dict[str, float | int | None]:
    return {
        "lm_loss": s.loss,
        "learning_rate": s.learning_rate,
        "grad_norm": s.grad_norm,
        "loss_scale": s.loss_scale,
        "elapsed_time_per_iteration_s": s.elapsed_s,
        "samples_per_s": s.samples_per_s,
        "tflops": s.tflops,
        "mfu": s.mfu,
        "max_mem_gib": s.max_mem_gib,
        "skipped_iterations": s.skipped_iters,
        "consumed_samples": s.consumed_samples,
    }


@contextlib.contextmanager
def _timeout_signals() -> Iterator[None]:
    """Turn Slurm's SIGTERM (time limit, scancel) and SIGUSR1 (--signal warning) into TrainingTimeout,
    so the record is written before the job dies; the previous handlers come back afterwards.
    SIGUSR2 is left alone: submitit uses it for its own checkpoint-and-requeue."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise TrainingTimeout(f"received {signal.Signals(signum).name}; stopped before the end of training")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ---------------------------------------------------------------------------------------------
# Provenance.


def versions() -> dict[str, str | None]:
    """Versions that change performance. DeepSpeed by metadata only: importing it costs seconds."""
    nccl = None
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "deepspeed": _dist_version("deepspeed"),
        "wandb": _dist_version("wandb"),
        "numpy": _dist_version("numpy"),
    }


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit(repo: Path = _REPO_ROOT) -> str | None:
    """HEAD of the checkout the code runs from (suffix '-dirty' with local changes); None when
    not a git checkout, git is missing, or there is no commit yet."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head or None
