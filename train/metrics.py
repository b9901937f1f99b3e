"""Torch-free bookkeeping of a run: Megatron log lines, medians, secret scrubbing.

The trainer fills `IterationStats` once per iteration and summarises them with `summarize`;
the record they go into (train.contract.RunRecord) is scrubbed of credentials here first.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
"""A name containing any of these (case-insensitive) holds a credential: its value is never recorded."""

ENV_ALLOWLIST_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_", "SLURM_JOB", "SLURM_ARRAY", "OMP_")
ENV_ALLOWLIST_NAMES = ("SLURM_PROCID", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_CLUSTER_NAME", "WORLD_SIZE")
"""The only environment variables a record may hold: they explain performance, nothing else."""

REDACTED = "***"
_MIN_SECRET_LEN = 4  # shorter values ("1", "on") would erase ordinary text when redacted


@dataclass(frozen=True)
class IterationStats:
    """One iteration's figures, in the units of Megatron's log line."""

    iteration: int
    train_iters: int
    consumed_samples: int
    consumed_tokens: int
    elapsed_s: float
    learning_rate: float
    global_batch_size: int
    loss: float
    loss_scale: float
    grad_norm: float
    skipped_iters: int
    nan_iters: int
    samples_per_s: float
    tflops: float | None
    """Achieved model TFLOP/s per device (per-GEMM count, the MFU numerator)."""
    mfu: float | None
    """Fraction of the peak; None when the peak is unknown. Above 1 means the peak is too low (a
    calibration under load): the loop warns with both figures rather than hide the ratio."""
    max_mem_gib: float
    """The highest peak memory of any rank so far (GiB; the record keeps each rank's)."""


def format_log_line(s: IterationStats) -> str:
    """The iteration as Megatron-LM prints it (field names and order), plus MFU and memory.

    Seconds get three decimals instead of Megatron's two: tiny CPU and GPU runs iterate in
    well under a second, and parsers read the numbers as floats either way.
    """
    tflops = "n/a" if s.tflops is None else tflops_text(s.tflops)
    mfu = "n/a" if s.mfu is None else f"{100.0 * s.mfu:.2f}%"
    fields = [
        f" iteration {s.iteration:8d}/{s.train_iters:8d}",
        f" consumed samples: {s.consumed_samples:12d}",
        f" consumed tokens: {s.consumed_tokens:12d}",
        f" elapsed time per iteration (s): {s.elapsed_s:.3f}",
        f" learning rate: {s.learning_rate:.3E}",
        f" global batch size: {s.global_batch_size:5d}",
        f" lm loss: {s.loss:.6E}",
        f" loss scale: {s.loss_scale:.1f}",
        f" grad norm: {s.grad_norm:.3f}",
        f" number of skipped iterations: {s.skipped_iters:3d}",
        f" number of nan iterations: {s.nan_iters:3d}",
        f" samples per second: {s.samples_per_s:.3f}",
        f" TFLOPs: {tflops}",
        f" MFU: {mfu}",
        f" max memory (GiB): {s.max_mem_gib:.2f}",
    ]
    return " |".join(fields) + " |"


def interval_stats(window: Sequence[IterationStats], *, skipped_before: int = 0) -> IterationStats:
    """The figures of a log line that covers several iterations (training.log_interval > 1), as
    Megatron-LM's training_log averages them over its interval: time per iteration, throughput, TFLOPs
    and MFU from the interval's total time (so they agree with each other), the loss averaged over the
    iterations that updated the model (an fp16 overflow's skipped step is left out; every loss where
    all were skipped); the counters, learning rate, loss scale, grad norm and batch are the last
    iteration's, and nan_iters the interval's count. `skipped_before`: the skipped-iteration counter
    before the window. One iteration's line is that iteration's."""
    last = window[-1]
    if len(window) == 1:
        return last
    seconds = sum(s.elapsed_s for s in window)
    counters = [skipped_before, *(s.skipped_iters for s in window)]
    updated = [s.loss for s, before in zip(window, counters, strict=False) if s.skipped_iters == before]

    def time_weighted(values: list[float | None]) -> float | None:
        # FLOPs over the interval / its time: a mean of per-iteration rates would overweight fast ones.
        if any(v is None for v in values) or seconds <= 0:
            return None
        return sum(v * s.elapsed_s for v, s in zip(values, window, strict=True) if v is not None) / seconds

    return dataclasses.replace(
        last,
        elapsed_s=seconds / len(window),
        loss=statistics.fmean(updated or [s.loss for s in window]),
        nan_iters=sum(s.nan_iters for s in window),
        samples_per_s=sum(s.global_batch_size for s in window) / seconds if seconds > 0 else last.samples_per_s,
        tflops=time_weighted([s.tflops for s in window]),
        mfu=time_weighted([s.mfu for s in window]),
    )


def tflops_text(tflops: float) -> str:
    """A throughput as megasweep prints it (TFLOP/s, PFLOP/s): Megatron's two decimals, but CPU and tiny
    runs sit far below 1, so three significant digits there (at least four decimals). Four decimals
    alone left 0.00045 one digit, "0.0004", 11% below the MFU printed beside it from the same figure."""
    if tflops >= 1.0:
        return f"{tflops:.2f}"
    decimals = 4 if tflops <= 0 else max(4, 2 - math.floor(math.log10(tflops)))
    return f"{tflops:.{decimals}f}"


def median_after_warmup(values: Sequence[float | None], warmup: int) -> float | None:
    """Median of the values after the first `warmup` ones; None if nothing (or only None) is left.

    The leading iterations pay for allocator growth, kernel selection and caches, so they
    would bias a benchmark's figure; Megatron-style runs report steady state.
    """
    kept = [v for v in values[max(warmup, 0) :] if v is not None]
    return statistics.median(kept) if kept else None


@dataclass(frozen=True)
class Spread:
    """How far a set of timings (or throughputs) spreads around its median."""

    n: int
    min: float
    median: float
    max: float
    cv: float | None
    """Sample standard deviation / mean (fraction); None for fewer than 2 values or a zero mean."""


def spread(values: Sequence[float]) -> Spread | None:
    """min, median, max and coefficient of variation of `values`; None when there are none."""
    if not values:
        return None
    mean = statistics.fmean(values)
    cv = statistics.stdev(values) / mean if len(values) > 1 and mean > 0 else None
    return Spread(len(values), min(values), statistics.median(values), max(values), cv)


@dataclass(frozen=True)
class Medians:
    """Steady-state figures of a run: medians over the iterations after warm-up."""

    measured_iterations: int
    sec_per_iter: float | None
    samples_per_s: float | None
    tokens_per_s_per_device: float | None
    tflops_per_device: float | None
    """Model FLOPs (per-GEMM count, no recompute) per second per device (TFLOP/s)."""
    tflops_per_device_hardware: float | None
    """Hardware FLOPs (recomputed forwards included) per second per device (TFLOP/s)."""
    tflops_per_device_megatron_eq3: float | None
    """Megatron-LM's Eq. 3 estimate per second per device, as Megatron-DeepSpeed prints it (TFLOP/s)."""
    sec_spread: Spread | None = None
    """Spread of the same iterations' seconds (the noise a comparison of medians must beat)."""


def summarize(
    iterations: Sequence[IterationStats],
    *,
    warmup: int,
    seq_length: int,
    devices: int,
    flops_per_iteration: Mapping[str, float],
    full_batch_size: int | None = None,
    profiled: Collection[int] = (),
) -> Medians:
    """Medians of the iterations after warm-up, and the throughputs derived from them.

    With `full_batch_size`, only iterations that ran that global batch count (a batch ramp-up's
    smaller steps are not the configuration being measured; flops_per_iteration is the full
    batch's). The `profiled` iterations (their numbers) are left out while any other remains: a
    profiler's tracing slows the step it watches. Throughputs come from the median time per
    iteration (not the median of per-iteration throughputs) so that every figure of the record
    describes the same representative step.
    """
    kept = [
        it
        for it in iterations[max(warmup, 0) :]
        if full_batch_size is None or it.global_batch_size == full_batch_size
    ]
    kept = [it for it in kept if it.iteration not in profiled] or kept
    sec = median_after_warmup([it.elapsed_s for it in kept], 0)
    if sec is None or sec <= 0 or not kept:
        return Medians(len(kept), None, None, None, None, None, None)
    sec_spread = spread([it.elapsed_s for it in kept])
    gbs = kept[-1].global_batch_size
    samples_per_s = gbs / sec

    def tflops(key: str) -> float | None:
        flops = flops_per_iteration.get(key)
        return None if flops is None else flops / sec / devices / 1e12

    return Medians(
        measured_iterations=len(kept),
        sec_per_iter=sec,
        samples_per_s=samples_per_s,
        tokens_per_s_per_device=samples_per_s * seq_length / devices,
        tflops_per_device=tflops("model"),
        tflops_per_device_hardware=tflops("hardware"),
        tflops_per_device_megatron_eq3=tflops("megatron_eq3"),
        sec_spread=sec_spread,
    )


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """True for names that conventionally hold credentials (WANDB_API_KEY, HF_TOKEN, ...)."""
    # Cached: an analysis asks it of every override of every config of a sweep, which repeat a few names.
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def allowlisted_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables a record may keep: allow-listed names, secret-looking ones redacted."""
    kept = {
        k: v
        for k, v in environ.items()
        if k in ENV_ALLOWLIST_NAMES or any(k.startswith(p) for p in ENV_ALLOWLIST_PREFIXES)
    }
    return {k: (REDACTED if is_secret_name(k) else v) for k, v in sorted(kept.items())}


def scrub(obj: Any) -> Any:
    """Copy of nested dicts/lists with the values under secret-looking keys redacted.

    A config may carry credentials (e.g. cluster.env.WANDB_API_KEY); they must not reach
    result.json or W&B.
    """
    if isinstance(obj, Mapping):
        return {k: (REDACTED if is_secret_name(str(k)) else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [scrub(v) for v in obj]
    return obj


def scrub_overrides(overrides: Iterable[str]) -> list[str]:
    """Hydra overrides with any secret-looking key's value redacted (`a.API_KEY=x` -> `a.API_KEY=***`)."""
    out = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        out.append(f"{key}{sep}{REDACTED}" if sep and is_secret_name(key) else item)
    return out


def secret_values(environ: Mapping[str, str]) -> list[str]:
    """Values of the environment's secret-named variables, longest first (so no partial redaction)."""
    values = {v for k, v in environ.items() if is_secret_name(k) and len(v) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact_values(obj: Any, secrets: Sequence[str]) -> Any:
    """Copy of `obj` with every occurrence of the given secret strings replaced by '***'.

    The last line of defence: an exception message or an override may quote a credential
    that no key name gives away.
    """
    if not secrets:
        return obj
    if isinstance(obj, str):
        for secret in secrets:
            obj = obj.replace(secret, REDACTED)
        return obj
    if isinstance(obj, Mapping):
        return {redact_values(k, secrets): redact_values(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_values(v, secrets) for v in obj]
    return obj
