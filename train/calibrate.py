"""Measured matmul peak, for devices without a trustworthy datasheet figure (CPUs, mostly).

A CPU's achievable dense peak depends on the vector units, the thread count the job got and
the clock under load, none of which a config file can know; so `hardware.peak_measured` asks
for a square-matmul calibration, and the MFU computed from it is labelled 'measured'. The matmul is
timed as the model's GEMMs run it, x @ W^T (train.contract.PEAK_KERNEL says why it matters).

A short calibration taken by every run, under whatever else the node was doing, gave peaks a
factor of three apart from one run to the next (issue 13), and with them MFUs that meant
nothing. So the peak is calibrated once per host and cached (train.contract.peak_cache_path,
keyed by device, precision, cores, threads and torch version): warmed up first, then several
trials long enough to time reliably, and the best trial is the peak, because interference
only ever makes a trial slower. The trials' spread is kept with it. Concurrent runs on one
host take a file lock, so one of them calibrates while the others wait for its figure instead
of measuring each other. Delete the cache file to calibrate again (after a BIOS or driver
change, say); a run that beats the cached figure drops it itself (forget_cached_peak).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from conf.schema import Precision
from train.contract import PeakCalibration, peak_cache_key, peak_cache_path, write_json_atomic
from train.metrics import spread

_DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16, Precision.fp32: torch.float32}

WARMUP_S = 0.5
"""Matmuls run before timing: page faults, kernel selection and the clock's ramp-up (seconds)."""
TRIALS = 5
"""Timed trials; the best is the peak, the others give its spread."""
TRIAL_S = 0.4
"""Length of one trial: tens of matmuls, so one slow one moves the trial little (seconds)."""
MIN_MATMUL_S = 0.02
"""The matrix grows until one matmul takes at least this long (seconds)."""
MAX_N = 4096


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a @ b^T, as nn.Linear multiplies: the kernel the model's GEMMs run (train.contract.PEAK_KERNEL).
    return torch.nn.functional.linear(a, b)


def _time_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    _sync(a.device)
    start = time.perf_counter()
    _matmul(a, b)
    _sync(a.device)
    return time.perf_counter() - start


def _operands(device: torch.device, dtype: torch.dtype, *, min_time_s: float, max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Square operands large enough that one matmul takes min_time_s (or max_n wide)."""
    n = 256
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        _time_matmul(a, b)  # the first call pays for kernel selection and page faults
        if _time_matmul(a, b) >= min_time_s or n >= max_n:
            return a, b
        n *= 2


def _trial(a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    """Throughput of back-to-back matmuls for at least `seconds` (TFLOP/s)."""
    n = a.shape[0]
    reps, start = 0, time.perf_counter()
    while True:
        _matmul(a, b)
        reps += 1
        _sync(a.device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * n**3 * reps / elapsed / 1e12


def device_label(device: torch.device) -> str:
    """'cpu', or the GPU's product name: what the peak belongs to."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def calibrate(
    device: torch.device | str,
    precision: Precision | str,
    *,
    warmup_s: float = WARMUP_S,
    trials: int = TRIALS,
    trial_s: float = TRIAL_S,
    min_time_s: float = MIN_MATMUL_S,
    max_n: int = MAX_N,
) -> PeakCalibration:
    """Measure the square-matmul peak in `precision` on `device` (not cached): warm-up, then `trials`
    trials of `trial_s` each; the best trial is the peak."""
    device = torch.device(device)
    precision = Precision(precision)
    if trials < 1:
        raise ValueError(f"trials={trials}: at least one trial is needed")
    start = time.perf_counter()
    a, b = _operands(device, _DTYPES[precision], min_time_s=min_time_s, max_n=max_n)
    _trial(a, b, warmup_s)
    rates = [_trial(a, b, trial_s) for _ in range(trials)]
    stats = spread(rates)
    assert stats is not None
    return PeakCalibration(
        tflops=stats.max,
        trials_tflops=rates,
        median_tflops=stats.median,
        min_tflops=stats.min,
        cv=stats.cv or 0.0,
        matrix_size=int(a.shape[0]),
        seconds=time.perf_counter() - start,
        host=socket.gethostname(),
        device=device_label(device),
        precision=precision.value,
        cores=os.cpu_count() or 1,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        calibrated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _read_entries(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def cached_peak(
    device: torch.device | str,
    precision: Precision | str,
    *,
    environ: Mapping[str, str] | None = None,
    **calibration: Any,
) -> tuple[PeakCalibration, str | None]:
    """This host's peak in `precision` on `device`: from the cache, or calibrated now and cached.

    Returns (calibration, warning): the warning says why the figure could not be cached (it is
    still measured, for this run only). `calibration` goes to `calibrate` (tests shorten it)."""
    device = torch.device(device)
    precision = Precision(precision)
    host = socket.gethostname()
    key = peak_cache_key(
        device=device_label(device), precision=precision.value, cores=os.cpu_count() or 1,
        threads=torch.get_num_threads(), torch=torch.__version__,
    )
    path = peak_cache_path(host, environ)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 (held across the calibration)
    except OSError as exc:
        why = f"peak calibration not cached ({exc}): measured for this run only"
        return calibrate(device, precision, **calibration), why
    with lock:
        # The other runs of this host wait here for the figure instead of slowing its trials down.
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read_entries(path)
        try:
            return replace(PeakCalibration.from_dict(entries[key]), cache_file=str(path), from_cache=True), None
        except (KeyError, TypeError, ValueError):
            pass  # not calibrated yet with this key (or an unreadable entry): measure it
        measured = replace(calibrate(device, precision, **calibration), cache_file=str(path))
        try:
            write_json_atomic(path, {"entries": {**entries, key: measured.to_dict()}})
        except OSError as exc:
            return replace(measured, cache_file=None), f"peak calibration not cached ({exc}): measured for this run only"
        return measured, None


def forget_cached_peak(calibration: PeakCalibration) -> bool:
    """Drop `calibration` from its host's cache if it is still the entry there; True if dropped.

    A run that went faster than the peak proves the figure too low (calibrated while other work
    shared the cores): kept, it would put every later run on this host above 100% MFU. Dropped,
    the next run measures again. An entry another run wrote since (another calibrated_at) stays.
    """
    if calibration.cache_file is None:
        return False
    path = Path(calibration.cache_file)
    try:
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 (held across the rewrite)
    except OSError:
        return False
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read_entries(path)
        entry = entries.get(calibration.key)
        if not isinstance(entry, dict) or entry.get("calibrated_at") != calibration.calibrated_at:
            return False
        try:
            write_json_atomic(path, {"entries": {k: v for k, v in entries.items() if k != calibration.key}})
        except OSError:
            return False
        return True
