"""Megatron-style training loop, on one process or over a (pp, dp, tp) device mesh.

run_training() owns the outcome: whatever happens (a clean run, a NaN loss, an OOM, any
exception, Slurm's SIGTERM) it writes one result.json and prints its path, then raises for
anything but `ok` so the process exits non-zero. train() / train_step() / forward_backward()
are the loop, the optimizer step and one micro-batch.

Parallelism is applied to the built model by train.parallel's functions (pipeline split, then
tensor, then data parallel); this module keeps the layout explicit: the world (dp, tp, pp), the
global-batch arithmetic and the per-rank sample indices are computed in one place. Rank 0 alone
prints and writes the record; the other ranks train quietly.

parallelism.engine=deepspeed (ZeRO 0-3 and offload over dp, with tp on plain-tensor shards and
DeepSpeed told the groups; no pp) swaps only the step's machinery:
setup() wraps the same model in a DeepSpeedEngine (train.ds_engine) configured from the run
(train.ds_config, written beside result.json) and train_step() hands it the same micro-batches;
data, LR schedule, log line, W&B and the record stay this module's.

The log line's TFLOPs and MFU use model FLOPs (per-GEMM count, no recompute) so that
MFU = TFLOPs / peak holds on the line; Megatron-LM's Eq. 3 figure is in the record, labelled.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conf.schema import (
    Engine,
    Offload,
    Precision,
    Recompute,
    RunConfig,
    WandbMode,
    is_auto_micro_batch,
    to_plain_dict,
)
from train import distributed, failures, flopcheck, flops, parallel, power, profiling, shapes
from train.calibrate import measure_peak_tflops
from train.checkpoint import Checkpointer, CheckpointMismatch, checkpoint_root, fingerprint
from train.data import TokenSource, get_batch, make_source
from train.ds_config import deepspeed_config, write_deepspeed_config
from train.ds_engine import (
    FlopsProfile,
    ModelParallelUnit,
    build_deepspeed_engine,
    deepspeed_train_step,
    profile_deepspeed_step,
)
from train.memory import usable_bytes
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
from train.validation import estimated_memory, resolve_dp
from train.wandb_log import WandbLogger

RESULT_FILE = "result.json"
FLOPS_CONVENTIONS = {
    "model": "per-GEMM count, forward + 2x backward, no recompute (train.flops); MFU and the log's TFLOPs",
    "hardware": "model FLOPs plus the recomputed forwards (train.flops); basis of HFU",
    "megatron_eq3": "Narayanan et al. 2021 Eq. 3, as Megatron-DeepSpeed prints TFLOPs (compare to its logs)",
}
_REPO_ROOT = Path(__file__).resolve().parents[1]
FAULT_ENV = "MEGASWEEP_FAULT_EXIT"
"""'<rank>:<iteration>': that rank exits abruptly (os._exit) at the start of that iteration. A test
hook for the failure path of multi-process runs (a worker dying mid-run, as on a node failure)."""
FAULT_EXIT_CODE = 17
SIGNAL_ENV = "MEGASWEEP_FAULT_SIGNAL"
"""'<rank>:<iteration>': that rank sends itself SIGUSR1 during that iteration, as Slurm's --signal
warning would. A test hook for stop-at-a-step-boundary, checkpoint and resume."""


class TrainingDiverged(RuntimeError):
    """The loss (or, outside fp16, the gradient norm) became NaN or inf; the record says `nan`."""


class TrainingTimeout(Exception):
    """Slurm asked the job to stop (SIGTERM at the time limit, or the SIGUSR1 warning)."""


class TrainingPreempted(TrainingTimeout):
    """Slurm asked the job to stop and the state was checkpointed at a step boundary first: the
    record says `timeout`, the process exits with checkpoint.REQUEUE_EXIT_CODE, and a requeued
    attempt resumes from the checkpoint."""


@dataclass(frozen=True)
class World:
    """Where this process sits in the job (all 1 / 0 for one process)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
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
    max_mem_per_rank: list[float] = field(default_factory=list)
    """Every rank's peak memory (GiB), gathered at the end of a successful run."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Optional measurements (flop_check, power, profile) added to the record under their keys."""
    run_dir: Path | None = None
    """The run directory (profiler traces go there)."""
    prior_losses: list[float] = field(default_factory=list)
    """Losses of the steps before this attempt's resume point, from the checkpoint: the record's
    `losses` is the whole run's, its medians and iteration times this attempt's."""
    run: RunConfig | None = None
    """The run as trained, once setup resolved micro_batch_size=auto; the record's config is this one."""


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
    world, progress = resolve_world(run), Progress(run_dir=output_dir)
    lead = world.rank == 0
    wandb = WandbLogger(
        run.logger if lead else replace(run.logger, wandb_mode=WandbMode.disabled),
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
        with _timeout_signals(defer=run.training.save_interval > 0) as stop:
            status = train(
                run, world=world, progress=progress, wandb=wandb, output_dir=output_dir, stop=stop
            )
    except torch.OutOfMemoryError as exc:
        status, message, failure = "oom", f"{type(exc).__name__}: {exc}", exc
    except TrainingTimeout as exc:
        status, message, failure = "timeout", str(exc), exc
    except BaseException as exc:  # the record is written for KeyboardInterrupt too
        # A CPU allocator failure is an OOM, a collective timeout a timeout (train.failures).
        status, message, failure = failures.classify(exc), f"{type(exc).__name__}: {exc}", exc
    finally:
        distributed.destroy_process_group()
    if status == "nan":
        message = (
            f"loss or gradient norm became NaN/inf at iteration {len(progress.iterations)}; training stopped"
        )
    if wandb.error:
        progress.warnings.append(wandb.error)
    record = build_record(
        progress.run or run,
        world=world,
        progress=progress,
        status=status,
        message=message,
        overrides=overrides,
        started=started,
        wall_s=time.perf_counter() - t0,
    )
    path = output_dir / RESULT_FILE
    if lead:
        write_json_atomic(path, record)
    wandb.summary(_summary_figures(record))
    wandb.finish(exit_code=0 if status == "ok" else 1)
    if lead:
        print(f"result: {path}", flush=True)
    if failure is not None:
        if isinstance(failure, TrainingPreempted) and not lead:
            # All ranks stop together; the local spawn's parent ends the others when the first
            # worker exits, so the rest wait for rank 0 to have written the record.
            _await_record(path, since=started)
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
    per_rank = progress.max_mem_per_rank or ([] if mem is None else [mem])
    mem = max(per_rank, default=None)
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
        max_mem_gib_per_rank=per_rank,
        max_mem_source=progress.max_mem_source,
        peak_tflops=progress.peak_tflops,
        peak_source=progress.peak_source,
        env=allowlisted_env(os.environ),
        losses=[*progress.prior_losses, *(it.loss for it in progress.iterations)],
        iteration_times_s=[it.elapsed_s for it in progress.iterations],
        warnings=list(progress.warnings),
        started_at=started.isoformat(timespec="seconds"),
        wall_s=wall_s,
    )
    result: dict[str, Any] = redact_values({**record.to_dict(), **progress.extra}, secret_values(os.environ))
    return result


def record_worker_failure(
    run: RunConfig,
    *,
    output_dir: Path,
    overrides: Sequence[str],
    failed_rank: int | None,
    failed_code: int | None,
) -> dict[str, Any]:
    """Make <output_dir>/result.json say `error`, naming the worker that failed first.

    Called by the parent of a local spawn. Rank 0's own record is kept when rank 0 failed first
    (its status, oom or nan say more); otherwise its record (if any: it may have been SIGKILLed)
    is kept for the iterations it saw, with the status and message of the real cause.
    """
    path = Path(output_dir) / RESULT_FILE
    cause = f"worker rank {failed_rank} exited with code {failed_code}; the other workers were ended"
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        record = build_record(
            run,
            world=World(),
            progress=Progress(),
            status="error",
            message=None,
            overrides=overrides,
            started=datetime.now(timezone.utc),
            wall_s=0.0,
        )
        record["world"] = {"world_size": None, "dp": None, "tp": run.parallelism.tp, "pp": run.parallelism.pp}
    if failed_rank == 0 and record.get("status") not in (None, "ok"):
        return record
    earlier = record.get("message")
    record["status"] = "error"
    record["message"] = f"{cause} (rank 0: {earlier})" if earlier else cause
    write_json_atomic(path, record)
    return record


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


LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits, labels) -> summed token cross-entropy (train.model.lm_loss_sum or its vocab-parallel twin)."""


class MicroBatchLoss:
    """The pipeline schedule's loss_fn: one micro-batch's share of the step's loss.

    The divisor (the global batch's labelled tokens) is set per step. The schedule also calls it
    once on placeholder tensors to infer shapes, so the step's losses come from the schedule's
    `losses` list, not from here.
    """

    def __init__(self, scaler: torch.amp.GradScaler, loss_sum: LossSum = lm_loss_sum) -> None:
        self.scaler = scaler
        self.loss_sum = loss_sum
        self.normalizer = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(self.loss_sum(logits, labels) / self.normalizer)


@dataclass(frozen=True)
class Parallel:
    """This rank's parallel machinery; all None (and dp size 1) on one process."""

    dp: parallel.DataParallel = field(default_factory=lambda: parallel.DataParallel(None, 1))
    tp_group: torch.distributed.ProcessGroup | None = None
    pp_group: torch.distributed.ProcessGroup | None = None
    tie_group: torch.distributed.ProcessGroup | None = None
    stage: parallel.PipelineStageModule | None = None
    schedule: Any = None
    """torch.distributed.pipelining Schedule1F1B when pp > 1."""
    loss_fn: MicroBatchLoss | None = None
    mesh: Any = None
    """The (pp, dp, tp) DeviceMesh."""
    loss_sum: LossSum = lm_loss_sum
    """Summed cross-entropy of the logits the model returns (vocab-parallel under TP)."""


@dataclass(frozen=True)
class Setup:
    """What train() builds before the first step."""

    device: torch.device
    model: nn.Module
    """The whole model on one process; this rank's (TP-sharded) pipeline stage otherwise."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    source: TokenSource
    par: Parallel


def setup(run: RunConfig, *, world: World, progress: Progress) -> Setup:
    """Device, process group, model (seeded, parallelized, checked against the layout), optimizer,
    loss scaler, data, peak."""
    par, tr = run.parallelism, run.training
    device = setup_device(run, progress)
    launch = distributed.launch_from_env(os.environ)
    if (threads := distributed.cpu_threads(os.environ)) is not None:
        torch.set_num_threads(threads)
    if launch is not None:
        distributed.init_process_group(launch, device_type=device.type, timeout_s=tr.collective_timeout_s)
    # Every rank builds the whole model from the same seed, so TP shards and the last stage's
    # embedding copy start exactly as the one-process model (fine at benchmark scale; a meta-device
    # build is the way for models that do not fit one device).
    torch.manual_seed(tr.seed)
    model: nn.Module = build_model(run.model, recompute=par.recompute, device=device, tp=world.tp)
    progress.params = count_params(model)
    if is_auto_micro_batch(par):
        run = choose_micro_batch(run, model, world=world, progress=progress, device=device)
        par = run.parallelism
    if par.engine == Engine.deepspeed:
        return _setup_deepspeed(run, model, world=world, progress=progress, device=device)
    # Its overflow decision is agreed over all ranks (parallel.GlobalGradScaler): all skip together.
    scaler = parallel.GlobalGradScaler(device.type, enabled=par.precision == Precision.fp16)
    # Only a last pipeline stage scales a loss, but every stage unscales its gradients (by the same
    # scale: all stages start equal and train_step keeps their overflow decisions equal).
    scaler.scale(torch.zeros((), device=device))
    parallel_state = Parallel()
    if launch is not None:
        model, parallel_state = parallelize(run, model, world=world, device=device, scaler=scaler)
    check_layout(run, world, layers=_layers_held(model, parallel_state.pp_group))
    optimizer, progress.optimizer = build_optimizer(
        model, impl=par.optimizer, lr=tr.lr, weight_decay=tr.weight_decay, device_type=device.type
    )
    if world.tp > 1:
        parallel.separate_dtensor_groups(optimizer)
    if par.zero_stage == 1 and world.dp > 1:
        assert launch is not None
        optimizer = parallel.apply_zero1(optimizer, dp_mesh=parallel_state.mesh["dp"])
        progress.optimizer = f"{progress.optimizer}+ZeRO-1"
    source = make_source(run.model, seed=tr.seed, data_path=tr.data_path)
    progress.peak_tflops, progress.peak_source = resolve_peak(run, device)
    return Setup(device, model, optimizer, scaler, source, parallel_state)


def _setup_deepspeed(
    run: RunConfig, model: nn.Module, *, world: World, progress: Progress, device: torch.device
) -> Setup:
    """setup()'s DeepSpeed half: the engine replaces parallelize, the optimizer, ZeRO and the loss
    scaler; its config comes from the run (train.ds_config) and is recorded beside result.json."""
    check_layout(run, world, layers=_layers_held(model, None))
    ds_cfg = deepspeed_config(run, dp=world.dp)
    if world.rank == 0 and progress.run_dir is not None:
        progress.extra["deepspeed_config"] = str(write_deepspeed_config(ds_cfg, progress.run_dir))
    parallel_state, mpu = Parallel(), None
    if world.tp > 1:
        # Megatron-DeepSpeed's split: our TP on plain tensors, DeepSpeed told the groups (mpu).
        mesh = distributed.build_mesh(device.type, pp=1, dp=world.dp, tp=world.tp)
        tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
        parallel.apply_tp_plain(model, tp_group=tp_group)
        mpu = ModelParallelUnit(tp_group=tp_group, dp_group=dp_group)
        parallel_state = Parallel(tp_group=tp_group, mesh=mesh, loss_sum=parallel.lm_loss_fn(model))
    engine, progress.optimizer = build_deepspeed_engine(model, ds_config=ds_cfg, mpu=mpu)
    # The engine's optimizer (a ZeRO wrapper from stage 1 on) exposes its inner optimizer's
    # param_groups, so train.optim.set_lr drives DeepSpeed's update as it drives torch's.
    source = make_source(run.model, seed=run.training.seed, data_path=run.training.data_path)
    progress.peak_tflops, progress.peak_source = resolve_peak(run, device)
    disabled = torch.amp.GradScaler(device.type, enabled=False)  # DeepSpeed scales fp16 itself
    return Setup(device, engine, engine.optimizer, disabled, source, parallel_state)


def parallelize(
    run: RunConfig, model: nn.Module, *, world: World, device: torch.device, scaler: torch.amp.GradScaler
) -> tuple[nn.Module, Parallel]:
    """This rank's part of `model` over the (pp, dp, tp) mesh: pipeline stage, then TP, then DP."""
    mesh = distributed.build_mesh(device.type, pp=world.pp, dp=world.dp, tp=world.tp)
    assert isinstance(model, TransformerLM)
    stage = parallel.split_for_pipeline(model, pp_mesh=mesh["pp"])
    parallel.apply_tp(stage, tp_mesh=mesh["tp"])
    dp = parallel.apply_dp(stage, dp_mesh=mesh["dp"])
    tie_group = parallel.embedding_tie_group(mesh)
    loss_sum = parallel.lm_loss_fn(stage)
    schedule, loss_fn = None, None
    if world.pp > 1:
        loss_fn = MicroBatchLoss(scaler, loss_sum)
        par = run.parallelism
        schedule = parallel.build_schedule(
            stage,
            pp_mesh=mesh["pp"],
            n_microbatches=par.global_batch_size // (par.mbs * world.dp),
            device=device,
            loss_fn=loss_fn,
        )
    groups = {d: (mesh[d].get_group() if mesh[d].size() > 1 else None) for d in ("tp", "pp")}
    return stage, Parallel(
        dp, groups["tp"], groups["pp"], tie_group, stage, schedule, loss_fn, mesh, loss_sum=loss_sum
    )


def _layers_held(model: nn.Module, pp_group: torch.distributed.ProcessGroup | None) -> int:
    """Blocks held by all pipeline stages together (by this rank's stage alone when pp = 1)."""
    held = torch.tensor(num_layers(model))  # type: ignore[arg-type]
    if pp_group is not None:
        torch.distributed.all_reduce(held, group=pp_group)
    return int(held)


def train(
    run: RunConfig,
    *,
    world: World,
    progress: Progress,
    wandb: WandbLogger,
    output_dir: Path | None = None,
    stop: StopRequest | None = None,
) -> str:
    """Run run.training.train_iters optimizer steps; 'ok', or 'nan' when the loss diverged.

    With training.save_interval > 0 (and an output_dir) it resumes from the run's latest checkpoint,
    saves every save_interval steps, and on Slurm's signal (`stop`) saves at the step boundary and
    raises TrainingPreempted.
    """
    s = setup(run, world=world, progress=progress)
    run = progress.run or run  # micro_batch_size=auto is a size from here on
    par, tr = run.parallelism, run.training
    lead = world.rank == 0
    ds_profile_at = _deepspeed_profile_iteration(run, progress)
    if lead:
        print(_banner(run, progress), flush=True)
        print(_shape_report(run, progress), flush=True)
        if tr.flop_check:  # opt-in: one extra model build and micro-batch
            check = flopcheck.flop_check(run, device=s.device)
            print(flopcheck.format_flop_check(check), flush=True)
            progress.extra["flop_check"] = check.to_dict()
            if abs(check.relative_error) > flopcheck.TOLERANCE:
                progress.warnings.append(flopcheck.format_flop_check(check))
    meter = power.PowerMeter.for_device(s.device)  # disabled (with its reason) off NVIDIA GPUs
    profiler = profiling.StepProfiler.for_steps(tr.profile_steps, run_dir=progress.run_dir, rank=world.rank)
    ckpt, resumed = _resume(run, s, world=world, progress=progress, output_dir=output_dir)
    for iteration in range(resumed + 1, tr.train_iters + 1):
        _fault_hook(world, iteration)
        if iteration == max(tr.warmup_iters, resumed) + 1:  # the measured iterations of this process
            meter.start()
        profiler.begin(iteration)
        start = time.perf_counter()
        lr = lr_at(iteration, peak=tr.lr, warmup_iters=tr.lr_warmup_iters, total_iters=tr.train_iters)
        set_lr(s.optimizer, lr)
        consumed = (iteration - 1) * par.global_batch_size
        batches = step_batches(run, s.source, world=world, consumed=consumed, device=s.device)
        if iteration == ds_profile_at:
            figures, ds = profile_deepspeed_step(s.model, batches, loss_sum=s.par.loss_sum)
            result = StepResult(ds.loss, ds.grad_norm, ds.loss_scale, skipped=ds.skipped)
            progress.extra["deepspeed_flops_profile"] = deepspeed_profile_record(
                figures, run, world=world, iteration=iteration
            )
        else:
            result = train_step(s.model, s.optimizer, s.scaler, batches, run=run, device=s.device, par=s.par)
        _sync(s.device)
        elapsed = time.perf_counter() - start
        profiler.end(iteration)
        progress.skipped += int(result.skipped)
        stats = _iteration_stats(
            run, iteration, elapsed, lr, result, world=world, progress=progress, device=s.device
        )
        diverged = stats.nan_iters > 0
        progress.iterations.append(stats)
        if lead and (iteration % tr.log_interval == 0 or diverged or iteration == tr.train_iters):
            print(format_log_line(stats), flush=True)
        wandb.log(_wandb_metrics(stats), step=iteration)
        if diverged:
            meter.stop(tokens=0)
            return "nan"
        if ckpt is not None:
            _checkpoint_boundary(ckpt, s, iteration, run=run, world=world, progress=progress, stop=stop)
    if ckpt is not None:
        ckpt.wait()
        progress.extra["checkpoint"] = _checkpoint_summary(ckpt)
    progress.max_mem_per_rank = _gather_memory(max_memory_gib(s.device), world)
    measured_iters = max(tr.train_iters - max(tr.warmup_iters, resumed), 0)
    measured_tokens = measured_iters * par.global_batch_size * run.model.seq_length
    progress.extra["power"] = power.gather(meter.stop(tokens=measured_tokens), world.world_size).to_dict()
    if profiler.record() is not None:
        progress.extra["profile"] = profiler.record()
    if progress.peak_source == "measured":
        # Any calibration is a lower bound on the peak (interference only slows it down), so
        # a second one after training tightens it for the record's MFU on a shared node.
        progress.peak_tflops = max(progress.peak_tflops or 0.0, measure_peak_tflops(s.device, par.precision))
    return "ok"


def choose_micro_batch(
    run: RunConfig, model: nn.Module, *, world: World, progress: Progress, device: torch.device
) -> RunConfig:
    """micro_batch_size=auto in the job: the planner's prediction, then a measured probe, agreed by all ranks.

    The probe (train.autombs.auto_micro_batch) runs one forward/backward of this rank's freshly
    built model per size, from the prediction down, with no collective: an OOM (CUDA's, or the
    CPU allocator's) rules a size out. With tp or pp > 1 the rank holds the whole unsplit model at
    this point, which would make the probe far too pessimistic, so those layouts take the
    prediction unprobed. Every rank then takes the smallest size any rank found (one MIN
    all-reduce), the record's `micro_batch` says what was chosen and why, and the returned run
    (also progress.run) carries the size. Raises torch.OutOfMemoryError when no size fits.
    """
    from train.autombs import ProbeAttempt, auto_micro_batch, largest_fitting_micro_batch

    predicted: int | None
    probed: tuple[ProbeAttempt, ...] = ()
    if world.tp * world.pp > 1:
        predicted, reason = largest_fitting_micro_batch(run, dp=world.dp)
        found = predicted
        how = "the planner's prediction, not probed (the probe needs the whole model on one rank: tp = pp = 1)"
    else:
        limit = probe_memory_limit(run, device, dp=world.dp)

        def step(size: int) -> object:
            return probe_step(model, run, size, device=device, limit_bytes=limit)

        choice = auto_micro_batch(run, dp=world.dp, step_fn=step)
        predicted, reason, probed, found = choice.predicted, choice.reason, choice.probe, choice.micro_batch_size
        memory = "a simulated limit of the usable memory" if limit is not None else "the device's memory"
        how = f"the largest size, from the planner's prediction down, whose probe step fit in {memory}"
    agreed = torch.tensor(found or 0, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    chosen = int(agreed)
    if chosen != (found or 0):
        how += f"; {chosen} is the smallest any rank found ({found} here)"
    progress.extra["micro_batch"] = {
        "requested": "auto",
        "chosen": chosen or None,
        "predicted": predicted,
        "probed": [asdict(a) for a in probed],
        "reason": f"{how}. Planner: {reason}",
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's cached blocks are not the run's
        torch.cuda.reset_peak_memory_stats(device)
    if chosen < 1:
        raise torch.OutOfMemoryError(
            f"parallelism.micro_batch_size=auto: no micro-batch size fits ({progress.extra['micro_batch']})"
        )
    if world.rank == 0:
        print(f"micro_batch_size=auto -> {chosen} ({how})", flush=True)
    progress.run = replace(run, parallelism=replace(run.parallelism, micro_batch_size=chosen))
    return progress.run


def probe_memory_limit(run: RunConfig, device: torch.device, *, dp: int) -> float | None:
    """Bytes the probe step may allocate: None on CUDA (the device's own OOM decides); on CPU, the
    usable hardware.memory_gib minus the weights and optimizer states the planner expects, enforced
    by train.autombs.simulated_memory_limit (the step's own tensors, gradients included, count)."""
    if device.type == "cuda":
        return None
    states = estimated_memory(run.model, replace(run.parallelism, micro_batch_size=1), dp)
    return max(usable_bytes(run.hardware) - states.weights - states.optimizer - states.optimizer_temp, 0.0)


def probe_step(
    model: nn.Module, run: RunConfig, size: int, *, device: torch.device, limit_bytes: float | None
) -> int | None:
    """One local forward/backward of `model` on `size` synthetic samples (no collective); the peak
    bytes the simulated limit counted (None without a limit). The gradients are dropped after."""
    from train.autombs import simulated_memory_limit

    m = run.model
    # A private generator: the probe must not shift the run's random stream.
    gen = torch.Generator().manual_seed(run.training.seed)
    tokens = torch.randint(0, m.vocab_size, (size, m.seq_length), generator=gen).to(device)
    limit = simulated_memory_limit(limit_bytes) if limit_bytes is not None else contextlib.nullcontext(None)
    try:
        with limit as peak:
            with _autocast(run, device):
                logits = model(tokens)
            lm_loss_sum(logits, tokens).backward()
            return None if peak is None else int(peak())
    finally:
        model.zero_grad(set_to_none=True)


def _deepspeed_profile_iteration(run: RunConfig, progress: Progress) -> int | None:
    """The iteration training.deepspeed_flops_profile profiles (warmup_iters + 1), or None."""
    tr = run.training
    if not tr.deepspeed_flops_profile:
        return None
    if run.parallelism.engine != Engine.deepspeed:
        progress.warnings.append("training.deepspeed_flops_profile applies to engine=deepspeed only; not run")
        return None
    if tr.warmup_iters + 1 > tr.train_iters:
        progress.warnings.append(
            f"training.deepspeed_flops_profile: iteration warmup_iters + 1 = {tr.warmup_iters + 1} is past "
            f"train_iters={tr.train_iters}; not run"
        )
        return None
    return tr.warmup_iters + 1


def deepspeed_profile_record(
    figures: FlopsProfile, run: RunConfig, *, world: World, iteration: int
) -> dict[str, Any]:
    """DeepSpeed's figures beside megasweep's per-GEMM model FLOPs for the same step.

    The profiler counts this rank's forwards only, so the comparable figure is 3 x forward x dp x tp
    (the backward as 2 forwards, all replicas, all TP shards: under TP a rank runs 1/tp of each
    sharded GEMM, while the replicated element-wise work it counts whole on every rank reads tp
    times over); `ratio_to_model_flops` is that over the model
    FLOPs of the iteration. Above 1 means DeepSpeed counted work Megatron's GEMM count leaves
    out (element-wise ops, bias adds); below 1, GEMMs it does not see (README: why they disagree).
    """
    model_flops = flops.model_flops_per_iteration(run.model, global_batch_size=run.parallelism.global_batch_size)
    comparable = 3 * figures.forward_flops * world.dp * world.tp
    return {
        **asdict(figures),
        "iteration": iteration,
        "model_flops_per_iteration": model_flops,
        "model_forward_flops_per_rank": model_flops / 3 / world.dp / world.tp,
        "ratio_to_model_flops": comparable / model_flops if model_flops else None,
        "ratio_convention": "3 x forward_flops x dp x tp / model FLOPs per iteration (train.flops)",
    }


def _resume(
    run: RunConfig, s: Setup, *, world: World, progress: Progress, output_dir: Path | None
) -> tuple[Checkpointer | None, int]:
    """The run's checkpointer (None when training.save_interval is 0) and the step training goes on
    after: the latest checkpoint's, restored into s, or 0."""
    progress.extra["resumed_from_step"] = None
    if run.training.save_interval <= 0 or output_dir is None:
        return None, 0
    par = run.parallelism
    ckpt = Checkpointer(
        checkpoint_root(run, output_dir),
        layout={"dp": world.dp, "tp": world.tp, "pp": world.pp, "zero_stage": par.zero_stage},
        config=fingerprint(run),
        rank=world.rank,
    )
    progress.extra["checkpoint"] = _checkpoint_summary(ckpt)
    resumed = ckpt.load_latest(model=s.model, optimizer=s.optimizer, scaler=s.scaler)
    if resumed is None:
        return ckpt, 0
    if resumed.consumed_samples != resumed.step * par.global_batch_size:
        raise CheckpointMismatch(
            f"checkpoint {resumed.path} consumed {resumed.consumed_samples} samples in {resumed.step} steps, "
            f"not {resumed.step} x global_batch_size {par.global_batch_size}"
        )
    progress.extra["resumed_from_step"] = resumed.step
    progress.prior_losses = resumed.losses
    if world.rank == 0:
        print(f"resumed from step {resumed.step} ({resumed.path})", flush=True)
    return ckpt, resumed.step


def _checkpoint_boundary(
    ckpt: Checkpointer,
    s: Setup,
    iteration: int,
    *,
    run: RunConfig,
    world: World,
    progress: Progress,
    stop: StopRequest | None,
) -> None:
    """After a step: save every save_interval steps; when any rank got Slurm's signal, save now
    (synchronously), then raise TrainingPreempted. Every rank calls this at every step."""
    tr = run.training
    spec = os.environ.get(SIGNAL_ENV)
    if spec and spec == f"{world.rank}:{iteration}":
        os.kill(os.getpid(), signal.SIGUSR1)
    # One scalar all-reduce per step: the ranks must stop at the same step even when the signal
    # reached them on either side of a boundary.
    stopping = stop is not None and stop.agreed(s.device) and iteration < tr.train_iters
    if iteration % tr.save_interval == 0 or stopping:
        ckpt.save(
            iteration,
            model=s.model,
            optimizer=s.optimizer,
            scaler=s.scaler,
            losses=[*progress.prior_losses, *(it.loss for it in progress.iterations)],
            consumed_samples=iteration * run.parallelism.global_batch_size,
            blocking=stopping,
        )
    progress.extra["checkpoint"] = _checkpoint_summary(ckpt)
    if stopping:
        assert stop is not None
        raise TrainingPreempted(
            f"received {stop.signal or 'a stop signal (on another rank)'}; stopped after step {iteration} "
            f"of {tr.train_iters} with a checkpoint in {ckpt.dir}: requeue to resume"
        )


def _checkpoint_summary(ckpt: Checkpointer) -> dict[str, Any]:
    return {
        "dir": str(ckpt.dir),
        "save_mode": ckpt.mode,
        "saved_steps": list(ckpt.committed),
        "warnings": list(ckpt.warnings),
    }


def _gather_memory(mine: float, world: World) -> list[float]:
    if world.world_size == 1 or not torch.distributed.is_initialized():
        return [mine]
    gathered: list[object] = [None] * world.world_size
    torch.distributed.all_gather_object(gathered, mine)
    return [float(x) for x in gathered]  # type: ignore[arg-type]


def _fault_hook(world: World, iteration: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{world.rank}:{iteration}":
        print(f"{FAULT_ENV}={spec}: rank {world.rank} exits now", file=sys.stderr, flush=True)
        os._exit(FAULT_EXIT_CODE)
    failures.hang_hook(world.rank, iteration)
    failures.slow_first_attempt_hook()


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
    par: Parallel | None = None,
) -> StepResult:
    """One optimizer step over all micro-batches: accumulate, sync, unscale, clip, step.

    Gradients are synchronised once, after the last micro-batch: tied-embedding copies between
    the first and last stage, then over DP. A non-finite loss returns before the optimizer
    touches the weights. In fp16 a non-finite gradient is the loss scaler's business: the step
    is skipped and counted, as in Megatron. With engine=deepspeed, `model` is the DeepSpeedEngine,
    which does all of this itself (`optimizer` and `scaler` are unused).
    """
    if run.parallelism.engine == Engine.deepspeed:
        # The engine normalizes, reduces, clips, scales (fp16) and steps; `model` is the engine.
        ds = deepspeed_train_step(model, batches, loss_sum=(par or Parallel()).loss_sum)
        return StepResult(ds.loss, ds.grad_norm, ds.loss_scale, skipped=ds.skipped)
    par = par or Parallel()
    optimizer.zero_grad(set_to_none=True)
    # Normalize by the global batch's labelled tokens (all DP ranks), so that accumulation and
    # data parallelism both equal one large batch.
    normalizer = _all_reduce_sum(
        torch.tensor(sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)), par.dp.group
    )
    if par.schedule is not None:
        loss = pipeline_forward_backward(par, batches, normalizer=int(normalizer), run=run)
    else:
        loss = torch.zeros((), device=device)
        for tokens, labels in batches:
            loss += forward_backward(
                model,
                tokens,
                labels,
                normalizer=int(normalizer),
                run=run,
                scaler=scaler,
                loss_sum=par.loss_sum,
            )
    # Only the last stage holds the loss (0 elsewhere); TP ranks all hold the same one.
    loss_value = float(_all_reduce_sum(_all_reduce_sum(loss.float(), par.dp.group), par.pp_group))
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    if not math.isfinite(loss_value):
        return StepResult(loss_value, math.nan, scale, skipped=False)
    if par.stage is not None:
        parallel.tie_embedding_grads(par.stage, group=par.tie_group)
    par.dp.sync_grads(model.parameters())
    scaler.unscale_(optimizer)  # in fp16, also agrees over all ranks whether any gradient overflowed
    grad_norm = parallel.clip_grad_norm(
        model.parameters(),
        max_norm=run.training.grad_clip if run.training.grad_clip > 0 else math.inf,
        tp_group=par.tp_group,
        pp_group=par.pp_group,
        exclude=par.stage.tied_copy() if par.stage is not None else None,
    )
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
    loss_sum: LossSum = lm_loss_sum,
) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its (detached) share of the step's loss."""
    with _autocast(run, tokens.device):
        logits = model(tokens)
    loss = loss_sum(logits, labels) / normalizer
    scaler.scale(loss).backward()
    return loss.detach()


def pipeline_forward_backward(
    par: Parallel, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, normalizer: int, run: RunConfig
) -> torch.Tensor:
    """Every micro-batch of the step through the 1F1B schedule; this stage's share of the loss
    (0 except on the last stage). The schedule cuts the concatenated batch back into the same
    micro-batches along dim 0."""
    assert par.stage is not None and par.loss_fn is not None
    par.loss_fn.normalizer = normalizer
    losses: list[torch.Tensor] = []
    tokens = torch.cat([t for t, _ in batches])
    labels = torch.cat([y for _, y in batches])
    target = labels if par.stage.is_last else None
    with _autocast(run, tokens.device):
        if par.stage.is_first:
            par.schedule.step(tokens, target=target, losses=losses, return_outputs=False)
        else:
            par.schedule.step(target=target, losses=losses, return_outputs=False)
    if not losses:
        return torch.zeros((), device=tokens.device)
    scaler = par.loss_fn.scaler
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    return torch.stack([loss.detach() for loss in losses]).sum() / scale


def _autocast(run: RunConfig, device: torch.device) -> torch.autocast:
    precision = run.parallelism.precision
    dtype = torch.bfloat16 if precision == Precision.bf16 else torch.float16
    return torch.autocast(device.type, dtype=dtype, enabled=precision != Precision.fp32)


def _all_reduce_sum(t: torch.Tensor, group: torch.distributed.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        torch.distributed.all_reduce(t, group=group)
    return t


# ---------------------------------------------------------------------------------------------
# Layout, batches, device.


def resolve_world(run: RunConfig) -> World:
    """This process's place in the job, from its launcher's environment (one process without one)."""
    par = run.parallelism
    launch = distributed.launch_from_env(os.environ)
    world_size = 1 if launch is None else launch.world_size
    # A wrong world size is the record's error, not a crash before there is a record.
    try:
        dp = resolve_dp(par, world_size)
    except ValueError:
        dp = max(world_size // (par.tp * par.pp), 1)
    return World(
        world_size=world_size,
        rank=0 if launch is None else launch.rank,
        local_rank=0 if launch is None else launch.local_rank,
        dp=dp,
        tp=par.tp,
        pp=par.pp,
    )


def check_layout(run: RunConfig, world: World, *, layers: int) -> None:
    """Fail before the first step unless the layout covers the world, every step consumes exactly
    global_batch_size samples and the model (all pipeline stages together) holds exactly num_layers
    layers."""
    par = run.parallelism
    if world.dp * world.tp * world.pp != world.world_size:
        raise ValueError(
            f"world size {world.world_size} is not dp x tp x pp = {world.dp} x {world.tp} x {world.pp}"
        )
    if par.rampup_batch_size:
        raise NotImplementedError("rampup_batch_size is not implemented yet")
    if par.engine == Engine.deepspeed:
        if world.pp > 1:
            raise NotImplementedError("engine=deepspeed runs no pipeline: use pp=1 (tp and dp combine with ZeRO)")
        if run.training.save_interval > 0:
            # train.checkpoint saves torch state dicts; DeepSpeed's partitioned states need its own.
            raise NotImplementedError("checkpointing (training.save_interval > 0) with engine=deepspeed")
    elif par.zero_stage > 1 or par.offload != Offload.none:
        raise NotImplementedError("the native engine implements ZeRO-1 only; use engine=deepspeed for 2-3")
    per_micro_step = par.mbs * world.dp
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
    if layers != run.model.num_layers:
        raise AssertionError(f"model holds {layers} layers, config asks for {run.model.num_layers}")


def micro_batch_indices(run: RunConfig, *, world: World, consumed: int) -> list[range]:
    """Global sample indices of this rank's micro-batches for the step starting at `consumed`.

    Micro-batch m of DP rank r takes samples [m*dp + r] x mbs onwards, so any (mbs, dp)
    split of a step covers the same global_batch_size samples exactly once. The DP rank is the
    rank's middle mesh coordinate (TP fastest, then DP): all TP ranks and all pipeline stages of
    one replica read the same samples.
    """
    par = run.parallelism
    mbs, dp = par.mbs, world.dp
    micro_batches = par.global_batch_size // (mbs * dp)
    rank = (world.rank // world.tp) % dp
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


def _banner(run: RunConfig, progress: Progress) -> str:
    params = progress.params or 0
    peak = (
        "unknown" if progress.peak_tflops is None else f"{progress.peak_tflops:.3f} ({progress.peak_source})"
    )
    return (
        f"megasweep: {run.model.name} ({_name(run.model.kind)}, {params / 1e6:.2f}M params) on "
        f"{progress.device_name} | precision {_name(run.parallelism.precision)} | recompute "
        f"{_name(run.parallelism.recompute)} | optimizer {progress.optimizer} | peak TFLOPs {peak}"
    )


def _shape_report(run: RunConfig, progress: Progress) -> str:
    """train.shapes' table for this run's GEMMs; its shape warnings (with the advisor's hidden sizes)
    also go into the record."""
    try:
        report = shapes.shape_report(run.model, run.parallelism, run.hardware)
    except ValueError as exc:
        return f"GEMM shapes: not analysed ({exc})"
    progress.warnings += [f"shapes: {w}" for w in report.warnings if "Advisor:" in w]
    return shapes.format_shape_report(report)


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


@dataclass
class StopRequest:
    """Slurm's stop signal, noted by the handler and acted on at the next step boundary."""

    signal: str | None = None

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank got the signal (a collective: every rank calls it at every step)."""
        flag = torch.tensor(float(self.signal is not None), device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


@contextlib.contextmanager
def _timeout_signals(*, defer: bool = False) -> Iterator[StopRequest | None]:
    """Turn Slurm's SIGTERM (time limit, scancel) and SIGUSR1 (--signal warning) into TrainingTimeout,
    so the record is written before the job dies; the previous handlers come back afterwards.
    With `defer` (a checkpointing run) the handler only notes the signal in the yielded StopRequest:
    the loop saves at the next step boundary, then stops. SIGUSR2 is left alone: submitit uses it
    for its own checkpoint-and-requeue."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    stop = StopRequest() if defer else None

    def handler(signum: int, frame: object) -> None:
        if stop is not None:
            stop.signal = signal.Signals(signum).name
            return
        raise TrainingTimeout(f"received {signal.Signals(signum).name}; stopped before the end of training")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _await_record(path: Path, *, since: datetime, timeout_s: float = 30.0) -> None:
    """Wait until `path` was written after `since` (by rank 0), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= since.timestamp():
                return
        time.sleep(0.05)


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
