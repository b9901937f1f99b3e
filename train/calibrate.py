"""Measured matmul peak, for devices without a trustworthy datasheet figure (CPUs, mostly).

A CPU's achievable dense peak depends on the vector units, the thread count the job got
and the clock under load, none of which a config file can know; so `hardware.peak_measured`
asks for a short square-matmul calibration at run time and the MFU computed from it is
labelled 'measured'. The budget is well under a second: the size grows until one matmul
is long enough to time reliably, then the best of a few repeats is kept (the best, because
any interference only ever makes a repeat slower).
"""

from __future__ import annotations

import time

import torch

from conf.schema import Precision

_DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16, Precision.fp32: torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    _sync(a.device)
    start = time.perf_counter()
    torch.mm(a, b)
    _sync(a.device)
    return time.perf_counter() - start


def measure_peak_tflops(
    device: torch.device | str,
    precision: Precision | str,
    *,
    budget_s: float = 0.4,
    min_time_s: float = 0.02,
    max_n: int = 4096,
) -> float:
    """Best square-matmul throughput in `precision` on `device` (TFLOP/s), within about `budget_s`."""
    device = torch.device(device)
    dtype = _DTYPES[Precision(precision)]
    deadline = time.perf_counter() + budget_s
    n, elapsed = 256, 0.0
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        _time_matmul(a, b)  # first call pays for kernel selection and page faults
        elapsed = _time_matmul(a, b)
        if elapsed >= min_time_s or n >= max_n or time.perf_counter() + 8 * elapsed > deadline:
            break
        n *= 2
    best = elapsed
    while time.perf_counter() + best < deadline:
        best = min(best, _time_matmul(a, b))
    return 2.0 * n**3 / best / 1e12
