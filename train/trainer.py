"""A run's outcome: run_training() trains (train.loop) and writes one result.json, whatever happens.

Whatever happens (a clean run, a NaN loss, an OOM, any exception, Slurm's SIGTERM), rank 0 writes
one record (train.contract.RunRecord) and prints its path, then run_training raises for anything
but `ok` so the process exits non-zero. The record is built from `Progress`, which setup and the
loop fill as they go, so a run that fails half-way still says what it measured.

The layout is judged once more here by train.planner.rules (the entry point already did, with the
world size): a caller that skips `python -m train` cannot start an infeasible run either, and the
refusal has a record too.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from conf.schema import RunConfig, WandbMode, to_plain_dict
from train import distributed, failures
from train.calibrate import forget_cached_peak
from train.contract import (
    EXIT_USAGE,
    RESULT_FILE,
    OomReport,
    PeakCalibration,
    RunRecord,
    cancelled_message,
    oom_report_name,
    read_oom_reports,
    read_record,
    write_json_atomic,
)
from train.loop import above_peak_warning, train, utilization
from train.metrics import (
    IterationStats,
    allowlisted_env,
    redact_values,
    scrub,
    scrub_overrides,
    secret_values,
    summarize,
)
from train.neighbours import NeighbourWatch, neighbour_warning
from train.planner import flops
from train.planner.layout import Layout, Rank
from train.planner.memory import GIB, usable_bytes
from train.planner.rules import InfeasibleConfig, advise, validate
from train.preemption import TrainingPreempted, TrainingTimeout, await_record, timeout_signals
from train.signals import SLURM_STOP_SIGNALS, signals_held
from train.sinks import MetricSinks
from train.wandb_log import WandbLogger

if TYPE_CHECKING:
    from train.checkpoint import Checkpointer
    from train.memory import MemoryProbe

_REPO_ROOT = Path(__file__).resolve().parents[1]

__all__ = [
    "Progress",
    "TrainingDiverged",
    "TrainingPreempted",
    "TrainingTimeout",
    "build_record",
    "current_rank",
    "record_interruption",
    "record_termination",
    "record_worker_failure",
    "run_training",
]


class TrainingDiverged(RuntimeError):
    """The loss (or, outside fp16, the gradient norm) became NaN or inf; the record says `nan`."""


@dataclass
class Progress:
    """What the run has learnt so far; the record is built from it even after a failure."""

    run_dir: Path | None = None
    """The run directory (profiler traces, DeepSpeed's config and TensorBoard files go there)."""
    run: RunConfig | None = None
    """The run as trained, once setup resolved micro_batch_size=auto; the record's config is this one."""
    device_name: str | None = None
    device_memory_gib: float | None = None
    params: int | None = None
    optimizer: str | None = None
    peak_tflops: float | None = None
    peak_source: str | None = None
    peak_calibration: dict[str, Any] | None = None
    """The cached calibration behind a measured peak (train.contract.PeakCalibration)."""
    max_mem_source: str | None = None
    iterations: list[IterationStats] = field(default_factory=list)
    skipped: int = 0
    warnings: list[str] = field(default_factory=list)
    max_mem_per_rank: list[float] = field(default_factory=list)
    """Every rank's peak memory (GiB), gathered at the end of a successful run."""
    prior_losses: list[float] = field(default_factory=list)
    """Losses of the steps before this attempt's resume point, from the checkpoint: the record's
    `losses` is the whole run's, its medians and iteration times this attempt's."""
    resumed_from_step: int | None = None
    checkpointer: Checkpointer | None = None
    micro_batch: dict[str, Any] | None = None
    flop_check: dict[str, Any] | None = None
    power: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    deepspeed_config: str | None = None
    deepspeed_flops_profile: dict[str, Any] | None = None
    tensorboard_dir: str | None = None
    memory: MemoryProbe | None = None
    """This rank's predicted and measured memory, filled by setup and the loop (train.memory)."""
    memory_report: dict[str, Any] | None = None
    """Every rank's memory, gathered at the end of a successful run."""
    memory_not_measured: str | None = None
    oom: dict[str, Any] | None = None
    """The OomReport of the rank that ran out of memory first."""
    neighbours: dict[str, Any] = field(default_factory=dict)
    """Other Slurm jobs on the job's nodes at the start and end of training (train.neighbours)."""

    def losses(self) -> list[float]:
        """Every step's loss so far: the earlier attempts' (from the checkpoint), then this one's."""
        return [*self.prior_losses, *(it.loss for it in self.iterations)]

    def final_loss(self) -> float | None:
        """The run's last loss: the checkpoint's when a resume left nothing to train (no iteration ran)."""
        losses = self.losses()
        return losses[-1] if losses else None


def current_rank(run: RunConfig, launch: distributed.LaunchEnv | None) -> Rank:
    """This process's place in the job its launcher described (one process without a launcher).

    Only for a layout the rules accepted on this world size (run_training checks first)."""
    if launch is None:
        return Rank(Layout.of(run.parallelism, 1))
    layout = Layout.of(run.parallelism, launch.world_size)
    return Rank(layout, global_rank=launch.rank, local_rank=launch.local_rank)


def run_training(
    run: RunConfig, *, output_dir: Path, overrides: Sequence[str], sweep_name: str | None = None
) -> dict[str, Any]:
    """Train `run`, write <output_dir>/result.json, print its path, return the record.

    Raises after writing the record when the status is not `ok`: InfeasibleConfig when the rules
    refuse the layout on this world size, the original exception for oom / error / timeout,
    TrainingDiverged for nan. `sweep_name` is the W&B group when logger.wandb_group is unset
    (default: the Hydra sweep's name, looked up by train.wandb_log).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    progress = Progress(run_dir=output_dir)
    path = output_dir / RESULT_FILE
    launch = distributed.launch_from_env(os.environ)
    violations = validate(run, world_size=1 if launch is None else launch.world_size, world_fixed=launch is not None)
    if violations:
        refused = InfeasibleConfig(violations)
        if launch is None or launch.rank == 0:
            write_json_atomic(path, build_record(
                run, rank=Rank(), progress=progress, status="error", message=str(refused),
                overrides=overrides, started=started, wall_s=time.perf_counter() - t0,
            ))
        raise refused
    rank = current_rank(run, launch)
    progress.warnings += [str(a) for a in advise(run)]
    wandb = _wandb(run, rank, output_dir, sweep_name)
    sinks = MetricSinks.for_run(wandb, enabled=run.logger.tensorboard and rank.lead, run_dir=output_dir)
    if sinks.tensorboard is not None:
        progress.tensorboard_dir = str(sinks.tensorboard.directory)
    # Held from the start: once training ends (its own handlers restored), a SIGTERM from the spawn's
    # parent or Slurm must not cut the record short.
    with signals_held(SLURM_STOP_SIGNALS):
        status, message, failure = _outcome(run, rank=rank, progress=progress, sinks=sinks, output_dir=output_dir)
        if status == "oom":
            write_oom_report(run, rank=rank, progress=progress, output_dir=output_dir, message=message or "")
        status, message = _final_status(progress, output_dir, status, message, rank=rank, since=started)
        progress.warnings += sinks.errors()
        said, record = len(progress.warnings), build_record(
            progress.run or run, rank=rank, progress=progress, status=status, message=message,
            overrides=overrides, started=started, wall_s=time.perf_counter() - t0,
        )
        own = record  # W&B's run is this attempt's: its own figures, not those of a record kept
        if rank.lead:
            record = _write_unless_kept(path, record, progress, failure, unsaid=own["warnings"][said:])
        if progress.run is not None and progress.run != run:  # micro_batch_size=auto, sized by setup
            wandb.reconfigure(**_wandb_identity(progress.run, rank))
        sinks.finish(summary=_summary_figures(own), ok=status == "ok")
    if rank.lead and (failure is None or record is own):  # a refusal that kept a finished run's record wrote none
        print(f"result: {path}", flush=True)
    if failure is not None:
        if isinstance(failure, TrainingPreempted) and not rank.lead:
            # All ranks stop together; the local spawn's parent ends the others when the first
            # worker exits, so the rest wait for rank 0 to have written the record.
            await_record(path, since=started)
        raise failure
    if status == "nan":
        raise TrainingDiverged(f"{message} (record: {path})")
    return record


def _write_unless_kept(
    path: Path, record: dict[str, Any], progress: Progress, failure: BaseException | None, *, unsaid: Sequence[str] = ()
) -> dict[str, Any]:
    """Write `record` to `path` and return it, unless `path` holds the record of a finished run (`ok`;
    with sec/it, see below) and this attempt trained no iteration, either because a resume found the
    run finished (the same command run again) or because the checkpoint directory was refused (another
    run's: other model, batch or update rule, or unreadable). Either record would replace the figures that
    run measured (sec/it, MFU, memory) with one that measured nothing; the measured one is kept and
    returned, and stderr says so. Refused, the attempt keeps any `ok` record, figures or not (a resume
    whose few iterations were all warm-up measured none): an `error` that trained nothing said the run
    that had finished had failed. Any other record (an attempt stopped after its last checkpoint, say)
    is replaced as before.

    `unsaid`: the record's warnings no console line gave yet (what its figures lack and why: nothing
    measured after a resume's warm-up, a ramp-up that never reached the batch; what they say: a peak
    above the usable memory or a rate above the device's peak), said first on stderr for a run that
    finished or was stopped after measuring iterations (its figures, partial, are shown by the analysis): in result.json alone, an
    `ok` run without sec/it said nothing of why, and a stopped one nothing of its peak above the usable
    memory. A run that failed (OOM, NaN, error) says why in its own line."""
    from train.checkpoint import CheckpointMismatch  # DCP stays unimported in runs that never checkpoint

    # A stopped run that measured nothing is told by its stop line ("no iteration was measured" adds nothing).
    stopped_measured = record["status"] in ("timeout", "cancelled", "interrupted") and record.get("measured_iterations")
    for warning in unsaid if record["status"] == "ok" or stopped_measured else ():
        print(f"warning: {warning}", file=sys.stderr, flush=True)

    finished = record["status"] == "ok" and progress.resumed_from_step is not None
    refused = isinstance(failure, CheckpointMismatch)
    if (finished or refused) and not progress.iterations:
        earlier = read_record(path)
        measured = earlier is not None and earlier.get("sec_per_iter") is not None
        if earlier is not None and earlier.get("status") == "ok" and (measured or refused):
            why = "the run had finished already" if finished else "this attempt was refused before training"
            figures = ", with its measured figures," if measured else ""
            print(f"warning: {why}: the finished run's record{figures} is kept ({path}); nothing was trained",
                  file=sys.stderr, flush=True)  # fmt: skip
            return earlier
    write_json_atomic(path, record)
    return record


def _outcome(
    run: RunConfig, *, rank: Rank, progress: Progress, sinks: MetricSinks, output_dir: Path
) -> tuple[str, str | None, BaseException | None]:
    """(status, message, the exception to raise after the record) of one training attempt."""
    status, message = "error", None
    failure: BaseException | None = None
    # One squeue per job, from the rank that writes the record.
    watch = NeighbourWatch(os.environ) if rank.lead else None
    try:
        with timeout_signals(defer=run.training.save_interval > 0) as stop:
            status = train(run, rank=rank, progress=progress, sink=sinks, output_dir=output_dir, stop=stop)
    except torch.OutOfMemoryError as exc:
        status, message, failure = "oom", f"{type(exc).__name__}: {exc}", exc
    except TrainingTimeout as exc:
        status, message, failure = "timeout", str(exc), exc
    except KeyboardInterrupt as exc:
        status, message, failure = "interrupted", _interrupted_message(len(progress.iterations)), exc
    except BaseException as exc:
        # A CPU allocator failure is an OOM, a collective timeout a timeout (train.failures).
        status, message, failure = failures.classify(exc), f"{type(exc).__name__}: {exc}", exc
    finally:
        # Frees what the run built (its Setup, the GradSync and the process groups they hold) while
        # the groups still exist: left to the interpreter's teardown, after the groups, gloo may
        # abort the process after a record that says ok (train.dp._weak_hook).
        distributed.destroy_process_group()
        if watch is not None:
            progress.neighbours = watch.stop()
            cl = run.cluster
            note = neighbour_warning(progress.neighbours, exclusive=cl.exclusive, cluster=cl.name, core_license=cl.core_license)
            progress.warnings += [note] if note else []
    if status == "nan":
        message = f"loss or gradient norm became NaN/inf at iteration {len(progress.iterations)}; training stopped"
    return status, message, failure


CANCEL_QUERY_TIMEOUT_S = 2.0
"""Longest the trainer waits for sacct to say whether a stopped job was cancelled (seconds); sacct
answered in well under a second on the local cluster."""


def _final_status(
    progress: Progress, output_dir: Path, status: str, message: str | None, *, rank: Rank, since: datetime
) -> tuple[str, str | None]:
    """The record's status and message, once what other ranks and Slurm know of the stop is read:
    another rank's OOM (_oom_elsewhere), a user's scancel (_cancelled_instead)."""
    status, message = _oom_elsewhere(progress, output_dir, status, message, rank=rank.global_rank, since=since)
    return _cancelled_instead(status, message, lead=rank.lead)


def _cancelled_instead(status: str, message: str | None, *, lead: bool) -> tuple[str, str | None]:
    """`cancelled` for a `timeout` of a Slurm job its user cancelled (scancel), whose SIGTERM reads as a time
    limit's: asked of Slurm's accounting here, before the record and W&B's summary are written, so that both
    say it. The in-job wrapper (launchers.job) asks again after the trainer's exit, but W&B's run has
    finished by then: it kept `timeout` while the record said `cancelled`. Other statuses, and runs outside
    Slurm, as they are; only the rank that writes the record (`lead`) asks."""
    if status != "timeout" or not lead:
        return status, message
    # Imported here: only a stopped run asks, and the trainer imports nothing of the launchers otherwise.
    from launchers.job import cancelled, slurm_job_id

    job = slurm_job_id(os.environ)
    # Briefly: Slurm's SIGKILL follows its SIGTERM after KillWait (30 s by default, 5 s on the local
    # cluster), and a slow slurmdbd must not cost the record; the wrapper asks again, for longer.
    asked = bool(job) and cancelled(job, timeout_s=CANCEL_QUERY_TIMEOUT_S)
    return ("cancelled", cancelled_message(job, message)) if asked else (status, message)


def write_oom_report(run: RunConfig, *, rank: Rank, progress: Progress, output_dir: Path, message: str) -> None:
    """This rank's OomReport (every rank that runs out of memory writes its own): where it was, what
    it held and what the planner predicted for it."""
    from train.memory import oom_report

    report = oom_report(run, rank=rank, probe=progress.memory, iteration=len(progress.iterations), message=message)
    write_json_atomic(output_dir / oom_report_name(rank.global_rank), report.to_dict())


def _oom_elsewhere(
    progress: Progress, output_dir: Path, status: str, message: str | None, *, rank: int, since: datetime
) -> tuple[str, str | None]:
    """The status and message of the record when some rank of this run (started `since`) ran out of
    memory: `oom`, naming the first such rank, even where this rank saw only the consequence (a
    collective that timed out)."""
    reports = read_oom_reports(output_dir, since=since)
    if not reports or status == "ok":
        return status, message
    first = reports[0]
    progress.oom = first
    sentence = OomReport(**first).sentence()
    if first["rank"] == rank:
        return "oom", f"{sentence}: {message}"
    return "oom", f"{sentence}: {first['message']} (rank {rank}: {message})"


def _wandb(run: RunConfig, rank: Rank, output_dir: Path, sweep_name: str | None) -> WandbLogger:
    return WandbLogger(
        run.logger if rank.lead else replace(run.logger, wandb_mode=WandbMode.disabled),
        **_wandb_identity(run, rank),
        output_dir=output_dir,
        group=sweep_name,
    )


def _wandb_identity(run: RunConfig, rank: Rank) -> dict[str, Any]:
    """The W&B run's config (credentials redacted) and name, of `run` as configured or as settled."""
    layout, par = rank.layout, run.parallelism
    world = {"world_size": layout.world_size, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    return {
        "config": redact_values({**scrub(to_plain_dict(run)), "world": world}, secret_values(os.environ)),
        "name": f"{run.model.name}-{layout.label()}-mbs{par.micro_batch_size}-gbs{par.global_batch_size}",
    }


def build_record(
    run: RunConfig,
    *,
    rank: Rank,
    progress: Progress,
    status: str,
    message: str | None,
    overrides: Sequence[str],
    started: datetime,
    wall_s: float,
) -> dict[str, Any]:
    """The JSON-ready record (medians after warm-up at the full batch, FLOPs, versions), credentials scrubbed."""
    layout = rank.layout
    ckpt = progress.checkpointer
    record = RunRecord(
        status=status,
        message=message,
        config=scrub(to_plain_dict(run)),
        overrides=scrub_overrides(overrides),
        world={"world_size": layout.world_size, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
        hardware=run.hardware.name,
        device=progress.device_name,
        device_memory_gib=progress.device_memory_gib,
        versions=versions(),
        git_commit=git_commit(),
        params=progress.params,
        optimizer=progress.optimizer,
        precision=str(getattr(run.parallelism.precision, "value", run.parallelism.precision)),
        iterations_run=len(progress.iterations),
        warmup_iters=run.training.warmup_iters,
        skipped_iterations=progress.skipped,
        final_loss=progress.final_loss(),
        max_mem_source=progress.max_mem_source,
        peak_tflops=progress.peak_tflops,
        peak_source=progress.peak_source,
        losses=progress.losses(),
        iteration_times_s=[it.elapsed_s for it in progress.iterations],
        global_batch_sizes=[it.global_batch_size for it in progress.iterations],
        env=allowlisted_env(os.environ),
        started_at=started.isoformat(timespec="seconds"),
        wall_s=wall_s,
        micro_batch=progress.micro_batch,
        flop_check=progress.flop_check,
        power=progress.power,
        profile=progress.profile,
        checkpoint=None if ckpt is None else _checkpoint_summary(ckpt),
        resumed_from_step=progress.resumed_from_step,
        deepspeed_config=progress.deepspeed_config,
        deepspeed_flops_profile=progress.deepspeed_flops_profile,
        tensorboard_dir=progress.tensorboard_dir,
        memory=progress.memory_report,
        oom=progress.oom,
        peak_calibration=progress.peak_calibration,
        neighbours=progress.neighbours,
        **_figures(run, layout, progress),
        warnings=list(progress.warnings),  # last: _figures may add one
    )
    result: dict[str, Any] = redact_values(record.to_dict(), secret_values(os.environ))
    return result


def profiled_iterations(progress: Progress) -> set[int]:
    """The iterations a profiler watched (training.profile_steps' span, DeepSpeed's flops profile)."""
    profiled: set[int] = set()
    if progress.profile is not None:
        first, last = progress.profile["iterations"]
        profiled.update(range(first, last + 1))
    if progress.deepspeed_flops_profile is not None:
        profiled.add(progress.deepspeed_flops_profile["iteration"])
    return profiled


def _figures(run: RunConfig, layout: Layout, progress: Progress) -> dict[str, Any]:
    """The record's measured figures: FLOPs, medians over the measured iterations (after the
    warm-up, at the full batch), MFU/HFU, and every rank's peak memory."""
    try:
        fpi = flops.iteration_flops(run.model, run.parallelism)
    except ValueError as exc:  # a shape the FLOPs model rejects must not cost the record
        fpi = {}
        progress.warnings.append(f"FLOPs not computed: {exc}")
    gbs = run.parallelism.global_batch_size
    medians = summarize(
        progress.iterations,
        warmup=run.training.warmup_iters,
        seq_length=run.model.seq_length,
        devices=layout.world_size,
        flops_per_iteration=fpi,
        full_batch_size=gbs,
        profiled=profiled_iterations(progress),
    )
    full_reached = any(it.global_batch_size == gbs for it in progress.iterations) or not progress.iterations
    if not full_reached:
        progress.warnings.append(
            f"the batch ramp-up never reached global_batch_size={gbs} in {len(progress.iterations)} "
            f"iterations: sec/it, throughput, TFLOPs and MFU are not given (they are figures of the full batch)"
        )
    elif progress.iterations and not medians.measured_iterations:
        # A resumed attempt near the end (a requeue, the same command again) warms up again: an `ok` with
        # every figure null said nothing of why.
        progress.warnings.append(
            f"no iteration was measured: this attempt ran {len(progress.iterations)} iteration(s), all within "
            f"training.warmup_iters={run.training.warmup_iters} (a resumed run warms up again), so sec/it, "
            "throughput, TFLOPs and MFU are not given"
        )
    if (above := above_peak_warning(progress)) is not None:
        cal = progress.peak_calibration
        if cal is not None and forget_cached_peak(PeakCalibration.from_dict(cal)):
            above += f"; dropped from {cal['cache_file']}, so the next run on this host measures it again"
        progress.warnings.append(above)
    peak, per_rank = _peak_memory(run, layout, progress)
    spread = medians.sec_spread
    return {
        "flops_per_iteration": fpi,
        "flops_conventions": dict(flops.FLOPS_CONVENTIONS),
        "measured_iterations": medians.measured_iterations,
        "full_batch_reached": full_reached,
        "sec_per_iter": medians.sec_per_iter,
        "sec_per_iter_min": None if spread is None else spread.min,
        "sec_per_iter_max": None if spread is None else spread.max,
        "sec_per_iter_cv": None if spread is None else spread.cv,
        "samples_per_s": medians.samples_per_s,
        "tokens_per_s_per_device": medians.tokens_per_s_per_device,
        "tflops_per_device": medians.tflops_per_device,
        "tflops_per_device_hardware": medians.tflops_per_device_hardware,
        "tflops_per_device_megatron_eq3": medians.tflops_per_device_megatron_eq3,
        "mfu": utilization(medians.tflops_per_device, progress, "MFU"),
        "hfu": utilization(medians.tflops_per_device_hardware, progress, "HFU"),
        "max_mem_gib": peak,
        "max_mem_gib_per_rank": per_rank,
    }


def _peak_memory(run: RunConfig, layout: Layout, progress: Progress) -> tuple[float | None, list[float]]:
    """The run's peak memory per device and every rank's (GiB); a warning when it passed the usable."""
    mem = max((it.max_mem_gib for it in progress.iterations), default=None)
    # Gathered after the last step; before it, the highest rank's so far is no list of every rank's.
    per_rank = progress.max_mem_per_rank or ([mem] if mem is not None and layout.world_size == 1 else [])
    peak = max(per_rank, default=mem)
    if (over := _over_capacity(run, peak)) is not None:
        progress.warnings.append(over)
    return peak, per_rank


def _over_capacity(run: RunConfig, peak_gib: float | None) -> str | None:
    """A warning when the measured peak exceeds the usable memory the dry run judged the run against:
    it ran, on a machine with more to spare, but did not fit the hardware config (the analysis lists it
    as a constraint not met; the run itself said nothing)."""
    hw = run.hardware
    usable = usable_bytes(hw) / GIB
    if peak_gib is None or peak_gib <= usable:
        return None
    return (
        f"peak memory {peak_gib:.2f} GiB per device is above the {usable:.2f} GiB usable of hardware={hw.name} "
        f"(memory_gib={hw.memory_gib:g} less memory_reserve_gib={hw.memory_reserve_gib:g}) that the dry run "
        "judged it against: it would not have fitted such a device"
    )


def _checkpoint_summary(ckpt: Checkpointer) -> dict[str, Any]:
    return {
        "dir": str(ckpt.dir),
        "save_mode": ckpt.mode,
        "saved_steps": list(ckpt.committed),
        "warnings": list(ckpt.warnings),
    }


def record_worker_failure(
    run: RunConfig,
    *,
    output_dir: Path,
    overrides: Sequence[str],
    failed_rank: int | None,
    failed_code: int | None,
    since: datetime | None = None,
) -> dict[str, Any]:
    """Make <output_dir>/result.json say `error`, naming the worker that failed first (`since`: when the
    workers were started, so that an earlier run's OOM reports in the directory are not this one's).

    Called by the parent of a local spawn. Rank 0's own record is kept when rank 0 failed first
    (its status, oom or nan say more); otherwise its record (if any: it may have been SIGKILLed)
    is kept for the iterations it saw, with the status and message of the real cause. A finished
    run's record (`ok`) from before `since` is kept whole when a worker refused its input
    (EXIT_USAGE, as every rank does on refusing the checkpoint directory: rank 0 kept that record
    and said so, _write_unless_kept); any other failure (an uncaught exception exits 1) replaces it.
    """
    path = Path(output_dir) / RESULT_FILE
    cause = f"worker rank {failed_rank} {distributed.how_it_ended(failed_code)}; the other workers were ended"
    written = _read_record(path)
    # Rank 0's record of this launch; one from before it (an earlier run in the directory: rank 0 was
    # ended before it wrote) says nothing of this launch, and its `nan` read as this one's outcome.
    if written is not None and since is not None and not _started_since(written, since):
        if failed_code == EXIT_USAGE and written.get("status") == "ok":
            return written  # a finished run's, kept whole (rank 0 kept it too, _write_unless_kept)
        written = None
    record = written if written is not None else _new_record(run, overrides, status="error")
    reports = read_oom_reports(output_dir, since=since)
    if reports:  # a worker ran out of memory: that is the answer, whoever exited first
        record["status"], record["oom"] = "oom", reports[0]
        record["message"] = f"{OomReport(**reports[0]).sentence()}: {reports[0]['message']} ({cause})"
        write_json_atomic(path, record)
        return record
    if failed_rank == 0 and written is not None and record.get("status") not in (None, "ok"):
        return record
    if written is not None and record.get("status") == "nan":
        # The loss is all-reduced: every rank sees it diverge and stops, and whichever exits first,
        # rank 0's record says why (error or nan at random, as the exits raced).
        return record
    if written is not None and record.get("status") == "error" and str(record.get("message")).startswith(INPUT_ERRORS):
        # The user's input (a data file, a checkpoint directory, a device), refused the same way on
        # every rank: whichever rank exited first, rank 0's words are the cause.
        return record
    earlier = record.get("message")
    record["status"] = "error"
    record["message"] = f"{cause} (rank 0: {earlier})" if earlier else cause
    write_json_atomic(path, record)
    return record


INPUT_ERRORS = ("DataFileError: ", "CheckpointMismatch: ", "CheckpointUnreadable: ", "DeviceUnavailable: ")
"""How a record's message starts when the run stopped on the user's input (train.data.DataFileError,
train.checkpoint.CheckpointMismatch and its CheckpointUnreadable, train.setup.DeviceUnavailable):
every rank finds it, and the local spawn's workers exit with it, each on its own."""


def record_interruption(run: RunConfig, *, output_dir: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """Make <output_dir>/result.json say `interrupted`, for the parent of a local spawn stopped by
    Ctrl-C: rank 0's record already says so unless a peer's failure (a collective it left) or the
    SIGKILL after the grace time got there first; the iterations it saw are kept."""
    path = Path(output_dir) / RESULT_FILE
    written = _read_record(path)
    if written is None:
        # Ctrl-C in start-up, before rank 0 got as far as a record (or rank 0 SIGKILLed): write one,
        # since the console names this file.
        record = _new_record(run, overrides, status="interrupted")
        write_json_atomic(path, record)
        return record
    if written.get("status") != "interrupted":
        written["status"] = "interrupted"
        written["message"] = _interrupted_message(int(written.get("iterations_run") or 0))
        write_json_atomic(path, written)
    return written


def record_termination(run: RunConfig, *, output_dir: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """Make <output_dir>/result.json say `timeout`, for the parent of a local spawn stopped by SIGTERM:
    rank 0's record says so unless it had none yet or a peer's failure (a collective the stopped
    ranks left) got there first; the iterations it saw are kept."""
    path = Path(output_dir) / RESULT_FILE
    record = _read_record(path) or _new_record(run, overrides, status="timeout")
    # Rank 0's `cancelled` (it asked Slurm: train.trainer._cancelled_instead) says more than a timeout.
    if record.get("status") not in ("timeout", "cancelled") or not record.get("message"):
        record["status"] = "timeout"
        record["message"] = (
            f"received SIGTERM; stopped after {int(record.get('iterations_run') or 0)} iterations, "
            "before the end of training (no checkpoint: training.save_interval=0)"
        )
    write_json_atomic(path, record)
    return record


def _interrupted_message(iterations: int) -> str:
    return f"stopped by SIGINT (Ctrl-C) after {iterations} iterations; every worker was stopped"


def _started_since(record: dict[str, Any], since: datetime) -> bool:
    """Whether `record` started at or after `since`, to the whole second started_at keeps (a record
    without a readable started_at, written by hand, did not)."""
    try:
        return datetime.fromisoformat(str(record.get("started_at"))) >= since.replace(microsecond=0)
    except (ValueError, TypeError):  # not a time, or one without its zone (written by hand)
        return False


def _read_record(path: Path) -> dict[str, Any] | None:
    """The record at `path`, or None when there is none (or not a whole one) yet."""
    try:
        record: dict[str, Any] = json.loads(path.read_text())
        return record
    except (OSError, ValueError):
        return None


def _new_record(run: RunConfig, overrides: Sequence[str], *, status: str) -> dict[str, Any]:
    """A record with `status` for a run whose rank 0 wrote none (stopped or killed in start-up)."""
    return build_record(
        run,
        rank=Rank(Layout.of(run.parallelism)),
        progress=Progress(),
        status=status,
        message=_interrupted_message(0) if status == "interrupted" else None,
        overrides=overrides,
        started=datetime.now(timezone.utc),
        wall_s=0.0,
    )


def _summary_figures(record: dict[str, Any]) -> dict[str, Any]:
    # What analysis.wandb_io rebuilds a record from when the sweep's files are gone: the figures, the
    # overrides that say which config the run was, why it failed, and its iterations' spread.
    keys = (
        "status",
        "message",
        "overrides",
        "optimizer",
        "sec_per_iter",
        "measured_iterations",
        "sec_per_iter_min",
        "sec_per_iter_max",
        "sec_per_iter_cv",
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
