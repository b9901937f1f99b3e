"""The training loop: train() runs the steps, train_step() is one native step, forward_backward() one
micro-batch.

Each step takes the global batch the batch schedule gives (train.planner.batch: a ramp-up grows
it), reads this rank's micro-batches of it (train.planner.layout.Layout.sample_indices), asks the
engine (train.engine) for one update, and turns the result into Megatron's log line
(train.metrics.IterationStats). Rank 0 alone prints and logs; every rank keeps the figures.

The log line's TFLOPs and MFU use model FLOPs (per-GEMM count, no recompute) of the step's batch,
so that MFU = TFLOPs / peak holds on the line; Megatron-LM's Eq. 3 figure is in the record,
labelled.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from conf.schema import Precision, RunConfig
from train import flopcheck, memory, power, profiling
from train.data import TokenSource, get_batch
from train.engine import Batch, StepResult
from train.metrics import IterationStats, format_log_line, interval_stats
from train.model import IGNORE_INDEX, LossSum, lm_loss_sum
from train.optim import lr_at, set_lr
from train.planner import flops, shapes
from train.planner.batch import BatchSchedule
from train.planner.layout import Rank
from train.preemption import StopRequest, checkpoint_boundary, fault_hooks, resume, save_last_step

if TYPE_CHECKING:
    from train.setup import ParallelState, Setup
    from train.trainer import Progress

IterationSink = Callable[[IterationStats], None]


def train(
    run: RunConfig,
    *,
    rank: Rank,
    progress: Progress,
    sink: IterationSink,
    output_dir: Path | None = None,
    stop: StopRequest | None = None,
) -> str:
    """Run run.training.train_iters optimizer steps; 'ok', or 'nan' when the loss diverged.

    With training.save_interval > 0 (and an output_dir) it resumes from the run's latest checkpoint,
    saves every save_interval steps, and on Slurm's signal (`stop`) saves at the step boundary and
    raises TrainingPreempted (train.preemption).
    """
    from train.setup import setup

    s = setup(run, rank=rank, progress=progress)
    run = progress.run or run  # micro_batch_size=auto is a size from here on
    tr, schedule = run.training, BatchSchedule.of(run.parallelism)
    if rank.lead:
        announce(run, progress, device=s.device)
    meter = power.PowerMeter.for_device(s.device)  # disabled (with its reason) off NVIDIA GPUs
    profiler = profiling.StepProfiler.for_steps(tr.profile_steps, run_dir=progress.run_dir, rank=rank.global_rank)
    ckpt, resumed, consumed = resume(run, s.engine, rank=rank, progress=progress, output_dir=output_dir)
    measured_from = max(tr.warmup_iters, resumed) + 1  # the first measured iteration of this process
    line_from, skipped_before = len(progress.iterations), progress.skipped  # where the next console line starts
    for iteration in range(resumed + 1, tr.train_iters + 1):
        fault_hooks(rank.global_rank, iteration)
        if iteration == measured_from:
            meter.start()
        profiler.begin(iteration)
        stats = timed_step(run, s, iteration, batch=schedule.batch_after(consumed), consumed=consumed, rank=rank, progress=progress)
        profiler.end(iteration)
        count_model_states(s, progress)
        consumed = stats.consumed_samples
        progress.iterations.append(stats)
        above_peak = note_above_peak(stats, progress)
        if rank.lead and (iteration % tr.log_interval == 0 or stats.nan_iters or iteration == tr.train_iters or above_peak):
            print(format_log_line(interval_stats(progress.iterations[line_from:], skipped_before=skipped_before)), flush=True)
            line_from, skipped_before = len(progress.iterations), progress.skipped
            if above_peak:
                print(f"warning: {above_peak}", flush=True)
        sink(stats)
        if stats.nan_iters:
            meter.stop(tokens=0)
            return "nan"
        if ckpt is not None:
            checkpoint_boundary(
                ckpt, s.engine, step=iteration, run=run, consumed_samples=consumed, losses=progress.losses(),
                device=s.device, rank=rank.global_rank, stop=stop,
            )
    if ckpt is not None:
        ckpt.wait()
    finish(run, s, meter, profiler, measured_from=measured_from, rank=rank, progress=progress)
    if ckpt is not None and progress.iterations:
        save_last_step(ckpt, s.engine, run=run, consumed_samples=consumed, losses=progress.losses())
    return "ok"


def timed_step(
    run: RunConfig, s: Setup, iteration: int, *, batch: int, consumed: int, rank: Rank, progress: Progress
) -> IterationStats:
    """One timed optimizer step of `batch` samples after `consumed`, as Megatron's log line figures."""
    tr = run.training
    start = time.perf_counter()
    lr = lr_at(iteration, peak=tr.lr, warmup_iters=tr.lr_warmup_iters, total_iters=tr.train_iters)
    set_lr(s.engine.optimizer, lr)
    batches = step_batches(run, s.source, rank=rank, consumed=consumed, global_batch_size=batch, device=s.device)
    result = s.engine.step(batches, iteration=iteration)
    sync(s.device)
    elapsed = time.perf_counter() - start
    progress.skipped += int(result.skipped)
    tflops = flops.achieved_tflops(
        flops.iteration_flops(run.model, run.parallelism, global_batch_size=batch)["model"],
        elapsed,
        rank.layout.world_size,
    )
    diverged = not (math.isfinite(result.loss) and (math.isfinite(result.grad_norm) or result.skipped))
    return IterationStats(
        iteration=iteration,
        train_iters=tr.train_iters,
        consumed_samples=consumed + batch,
        consumed_tokens=(consumed + batch) * run.model.seq_length,
        elapsed_s=elapsed,
        learning_rate=lr,
        global_batch_size=batch,
        loss=result.loss,
        loss_scale=result.loss_scale,
        grad_norm=result.grad_norm,
        skipped_iters=progress.skipped,
        nan_iters=int(diverged),
        samples_per_s=batch / elapsed,
        tflops=tflops,
        # The ratio even above 1 (note_above_peak warns): a hidden MFU would read as 'not measured'.
        mfu=None if tflops is None or not progress.peak_tflops else tflops / progress.peak_tflops,
        max_mem_gib=highest_memory_gib(s.device, rank),
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: Sequence[Batch],
    *,
    run: RunConfig,
    device: torch.device,
    state: ParallelState | None = None,
) -> StepResult:
    """One native optimizer step over all micro-batches: accumulate, reduce, unscale, clip, step.

    The DP reduction of a bucket starts during the last micro-batch's backward, as soon as its
    gradients are complete (train.dp); the tied-embedding copies of the first and last stage are
    summed after backward, then reduced. A non-finite loss returns before the optimizer touches
    the weights. In fp16 a non-finite gradient is the loss scaler's business: the step is skipped
    and counted, as in Megatron.
    """
    from train.setup import ParallelState

    state = state or ParallelState()
    optimizer.zero_grad(set_to_none=True)
    state.dp.begin_step(len(batches))
    # Normalize by the global batch's labelled tokens (all DP ranks), so that accumulation and
    # data parallelism both equal one large batch.
    normalizer = int(
        all_reduce_sum(torch.tensor(sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)), state.dp.group)
    )
    if state.stage is not None and state.stage.num_stages > 1:
        loss = pipeline_forward_backward(state, batches, normalizer=normalizer, run=run)
    else:
        loss = torch.zeros((), device=device)
        for tokens, labels in batches:
            loss += forward_backward(
                model, tokens, labels, normalizer=normalizer, run=run, scaler=scaler, loss_sum=state.loss_sum
            )
    # Only the last stage holds the loss (0 elsewhere); TP ranks all hold the same one.
    loss_value = float(all_reduce_sum(all_reduce_sum(loss.float(), state.dp.group), state.pp_group))
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    if not math.isfinite(loss_value):
        state.dp.finish()  # the reductions in flight complete before the step is abandoned
        return StepResult(loss_value, math.nan, scale, skipped=False)
    if state.stage is not None:
        from train import parallel

        parallel.tie_embedding_grads(state.stage, group=state.tie_group)
    state.dp.finish()  # DP reductions were launched during backward; the tied embedding's now
    scaler.unscale_(optimizer)  # in fp16, also agrees over all ranks whether any gradient overflowed
    grad_clip = run.training.grad_clip
    grad_norm = state.dp.clip_grad_norm(
        model.parameters(),
        max_norm=grad_clip if grad_clip > 0 else math.inf,
        tp_group=state.tp_group,
        pp_group=state.pp_group,
        exclude=state.stage.tied_copy() if state.stage is not None else None,
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
    with autocast(run, tokens.device):
        logits = model(tokens)
    loss = loss_sum(logits, labels) / normalizer
    # No backward needs the 16-bit logits (the loss upcasts them first); a name still holding them
    # kept b·s·V of them allocated through the whole backward (1.5 GiB at gpt_350m, mbs 8).
    del logits
    scaler.scale(loss).backward()
    return loss.detach()


def boundary_shape(run: RunConfig) -> tuple[int, int, int]:
    """[b, s, h] of the activation one pipeline stage sends the next: under sequence parallelism,
    this TP rank's s / tp tokens only."""
    par = run.parallelism
    seq = run.model.seq_length // par.tp if par.sequence_parallel else run.model.seq_length
    return (par.mbs, seq, run.model.hidden_size)


def pipeline_forward_backward(
    state: ParallelState, batches: Sequence[Batch], *, normalizer: int, run: RunConfig
) -> torch.Tensor:
    """Every micro-batch of the step through the 1F1B schedule (train.pipeline), interleaved over
    the rank's model chunks when parallelism.virtual_stages > 1; this stage's share of the loss (0
    except on the last stage)."""
    from train.pipeline import interleaved_one_f_one_b, one_f_one_b

    assert state.stage is not None and state.loss_fn is not None and state.links is not None
    state.loss_fn.normalizer = normalizer
    device = batches[0][0].device
    shape = boundary_shape(run)
    chunks = run.parallelism.virtual_stages
    with autocast(run, device):
        if chunks > 1:
            losses = interleaved_one_f_one_b(
                state.stage, batches, links=state.links, virtual_stages=chunks, loss_fn=state.loss_fn,
                activation_shape=shape, device=device,
            )  # fmt: skip
        else:
            losses = one_f_one_b(
                state.stage, batches, links=state.links, loss_fn=state.loss_fn, activation_shape=shape, device=device
            )
    if not losses:
        return torch.zeros((), device=device)
    scaler = state.loss_fn.scaler
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    return torch.stack([loss.detach() for loss in losses]).sum() / scale


def step_batches(
    run: RunConfig, source: TokenSource, *, rank: Rank, consumed: int, global_batch_size: int, device: torch.device
) -> list[Batch]:
    """This rank's micro-batches of the step of `global_batch_size` samples after `consumed`."""
    indices = rank.layout.sample_indices(
        rank.global_rank,
        consumed=consumed,
        global_batch_size=global_batch_size,
        micro_batch_size=run.parallelism.mbs,
    )
    return [get_batch(source, run.model, indices=r, seed=run.training.seed, device=device) for r in indices]


# ---------------------------------------------------------------------------------------------
# Around the steps.


def announce(run: RunConfig, progress: Progress, *, device: torch.device) -> None:
    """Rank 0's banner, GEMM shape report and (training.flop_check) FLOPs cross-check."""
    print(banner(run, progress), flush=True)
    try:
        report = shapes.shape_report(run.model, run.parallelism, run.hardware)
    except ValueError as exc:
        print(f"GEMM shapes: not analysed ({exc})", flush=True)
    else:
        progress.warnings += [f"shapes: {w}" for w in report.warnings if "Advisor:" in w]
        print(shapes.format_shape_report(report), flush=True)
    if run.training.flop_check:  # opt-in: one extra model build and micro-batch
        check = flopcheck.flop_check(run, device=device)
        print(flopcheck.format_flop_check(check), flush=True)
        progress.flop_check = check.to_dict()
        if abs(check.relative_error) > flopcheck.TOLERANCE:
            progress.warnings.append(flopcheck.format_flop_check(check))


def banner(run: RunConfig, progress: Progress) -> str:
    params = progress.params or 0
    peak = "unknown" if progress.peak_tflops is None else f"{progress.peak_tflops:.4g} ({progress.peak_source})"
    if (cal := progress.peak_calibration) is not None:
        trials = len(cal["trials_tflops"])
        where = "cached in" if cal["from_cache"] else "calibrated now, cached in"
        peak += f" [best of {trials} trials, cv {100 * cal['cv']:.1f}%; {where} {cal['cache_file'] or 'nothing'}]"
    par = run.parallelism
    return (
        f"megasweep: {run.model.name} ({_name(run.model.kind)}, {params / 1e6:.2f}M params) on "
        f"{progress.device_name} | precision {_name(par.precision)} | recompute {_name(par.recompute)} | "
        f"optimizer {progress.optimizer} | peak TFLOPs {peak}"
    )


def finish(
    run: RunConfig,
    s: Setup,
    meter: power.PowerMeter,
    profiler: profiling.StepProfiler,
    *,
    measured_from: int,
    rank: Rank,
    progress: Progress,
) -> None:
    """After the last step: every rank's peak memory, energy over the measured steps, the profile."""
    progress.max_mem_per_rank = gather_memory(max_memory_gib(s.device), rank)
    if progress.memory is not None:
        report = memory.gather_report(
            progress.memory.rank_memory(s.device), world_size=rank.layout.world_size,
            stack=progress.memory.prediction.stack, not_measured=progress.memory_not_measured,
        )
        progress.memory_report = report.to_dict()
    measured = sum(it.global_batch_size for it in progress.iterations if it.iteration >= measured_from)
    tokens = measured * run.model.seq_length
    progress.power = power.gather(meter.stop(tokens=tokens), rank.layout.world_size).to_dict()
    progress.profile = profiler.record()


def count_model_states(s: Setup, progress: Progress) -> None:
    """After this process's first step (Adam's states exist, the gradients are not yet dropped):
    the bytes of the rank's model states, as its engine counts them."""
    probe = progress.memory
    if probe is not None and probe.states is None:
        probe.states = s.engine.model_states()


def utilization(tflops: float | None, progress: Progress, what: str) -> float | None:
    """The record's MFU/HFU, or None (with a warning in the record) when the peak is unknown or exceeded.

    Above 100% means the peak or the FLOPs count is wrong (a calibration under load, say); the
    run's own figures are still right, so the record keeps them and flags the ratio.
    """
    if tflops is None:
        return None
    try:
        return flops.utilization(tflops, progress.peak_tflops)
    except flops.ImpossibleUtilization as exc:
        progress.warnings.append(f"{what} not recorded: {exc}")
        return None


def note_above_peak(stats: IterationStats, progress: Progress) -> str | None:
    """The log's warning for an iteration faster than the peak allows (None for any other), naming
    both figures and the iteration (a line under training.log_interval > 1 gives its interval's mean,
    which may be below the peak).

    The log line still shows its ratio, above 100% too: a hidden MFU reads as 'not measured', while the
    real news is that the peak is too low. The record says it once (above_peak_warning)."""
    if stats.mfu is None or stats.mfu <= 1.0 or stats.tflops is None:
        return None
    return (
        f"iteration {stats.iteration}: {stats.tflops:.4g} TFLOP/s per device is above the "
        f"{progress.peak_source or 'given'} peak of {progress.peak_tflops:.4g} TFLOP/s (MFU {100 * stats.mfu:.0f}%): "
        "the peak is too low for this run (a calibration under load, or a wrong datasheet figure)"
    )


def above_peak_warning(progress: Progress) -> str | None:
    """The record's one warning about the iterations that ran above the peak, or None."""
    above = [it for it in progress.iterations if it.mfu is not None and it.mfu > 1.0 and it.tflops is not None]
    if not above:
        return None
    top = max(above, key=lambda it: it.mfu or 0.0)
    return (
        f"{len(above)} of {len(progress.iterations)} iterations ran above the {progress.peak_source or 'given'} "
        f"peak of {progress.peak_tflops:.4g} TFLOP/s per device (up to {top.tflops:.4g} TFLOP/s, MFU "
        f"{100 * (top.mfu or 0.0):.0f}%, iteration {top.iteration}): the peak is too low for this run"
    )


def autocast(run: RunConfig, device: torch.device) -> torch.autocast:
    precision = run.parallelism.precision
    dtype = torch.bfloat16 if precision == Precision.bf16 else torch.float16
    return torch.autocast(device.type, dtype=dtype, enabled=precision != Precision.fp32)


def all_reduce_sum(t: torch.Tensor, group: torch.distributed.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        torch.distributed.all_reduce(t, group=group)
    return t


def max_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux (bytes on macOS, where this overstates by 1024x).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def highest_memory_gib(device: torch.device, rank: Rank) -> float:
    """The highest peak memory of any rank so far (GiB): the log line's figure. Rank 0's alone
    understated it (the last pipeline stage holds the logits), while the record takes every rank's."""
    mine = max_memory_gib(device)
    if rank.layout.world_size == 1 or not torch.distributed.is_initialized():
        return mine
    peak = torch.tensor([mine], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return float(peak.item())


def gather_memory(mine: float, rank: Rank) -> list[float]:
    if rank.layout.world_size == 1 or not torch.distributed.is_initialized():
        return [mine]
    gathered: list[object] = [None] * rank.layout.world_size
    torch.distributed.all_gather_object(gathered, mine)
    return [float(x) for x in gathered]  # type: ignore[arg-type]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _name(value: object) -> str:
    return str(getattr(value, "value", value))
