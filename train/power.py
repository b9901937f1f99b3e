"""GPU power, utilization and memory during the measured iterations, from NVML (nvidia-ml-py).

A background thread samples this rank's GPU every `interval_s` between start() (after the warm-up
iterations) and stop(); the record gets the mean draw against the power limit, the utilization,
peak memory against capacity, and the energy per token. Energy comes from NVML's cumulative
energy counter (Volta and later) when it exists, and otherwise from the mean draw x the window.

NVML is imported lazily: without nvidia-ml-py, without a GPU, or on a CPU run the meter is
disabled quietly and the record says why (`available: false`, `reason`), every figure null.
The aggregation is pure functions on samples (`summarize`, `combine`), tested without a GPU.

NVML numbers its GPUs physically and ignores CUDA_VISIBLE_DEVICES, so a CUDA device is matched to
its NVML handle by UUID.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

_GIB = 2**30


@dataclass(frozen=True)
class PowerSample:
    """One NVML reading of one GPU."""

    t: float
    """time.monotonic() of the reading (seconds)."""
    watts: float
    utilization_pct: float | None
    memory_used_bytes: int | None


@dataclass(frozen=True)
class DeviceInfo:
    """What does not change during the window."""

    power_limit_watts: float | None
    memory_total_bytes: int | None


@dataclass(frozen=True)
class PowerSummary:
    """One GPU's window, or all GPUs of the run combined (`gpus` > 1). All None when unavailable."""

    available: bool
    reason: str | None
    gpus: int
    samples: int
    window_s: float | None
    mean_watts_per_gpu: float | None
    power_limit_watts: float | None
    mean_power_fraction: float | None
    """mean_watts_per_gpu / power_limit_watts."""
    mean_utilization_pct: float | None
    peak_memory_used_gib: float | None
    memory_capacity_gib: float | None
    energy_j: float | None
    """All GPUs together over the window."""
    energy_source: str | None
    """'nvml energy counter' or 'mean power x window'."""
    tokens: int | None
    energy_per_token_j: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unavailable(reason: str) -> PowerSummary:
    return PowerSummary(
        available=False,
        reason=reason,
        gpus=0,
        samples=0,
        window_s=None,
        mean_watts_per_gpu=None,
        power_limit_watts=None,
        mean_power_fraction=None,
        mean_utilization_pct=None,
        peak_memory_used_gib=None,
        memory_capacity_gib=None,
        energy_j=None,
        energy_source=None,
        tokens=None,
        energy_per_token_j=None,
    )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def time_weighted_mean_watts(samples: Sequence[PowerSample]) -> float | None:
    """Trapezoid mean over the samples' times; the plain mean when they do not span any time."""
    if len(samples) < 2 or samples[-1].t <= samples[0].t:
        return _mean([s.watts for s in samples])
    area = sum((b.t - a.t) * (a.watts + b.watts) / 2 for a, b in zip(samples[:-1], samples[1:], strict=True))
    return area / (samples[-1].t - samples[0].t)


def summarize(
    samples: Sequence[PowerSample],
    info: DeviceInfo,
    *,
    window_s: float,
    tokens: int,
    energy_counter_j: float | None = None,
) -> PowerSummary:
    """One GPU's figures over a window of `window_s` seconds in which the run processed `tokens` tokens.

    `energy_counter_j` (the difference of NVML's energy counter over the window) wins over the
    integral of the samples: it is accumulated by the device itself, not sampled.
    """
    if not samples:
        return unavailable("no power sample taken during the measured iterations")
    watts = time_weighted_mean_watts(samples)
    assert watts is not None
    if energy_counter_j is not None:
        energy, source = energy_counter_j, "nvml energy counter"
    else:
        energy, source = watts * window_s, "mean power x window"
    utils = [s.utilization_pct for s in samples if s.utilization_pct is not None]
    mems = [s.memory_used_bytes for s in samples if s.memory_used_bytes is not None]
    limit = info.power_limit_watts
    return PowerSummary(
        available=True,
        reason=None,
        gpus=1,
        samples=len(samples),
        window_s=window_s,
        mean_watts_per_gpu=watts,
        power_limit_watts=limit,
        mean_power_fraction=watts / limit if limit else None,
        mean_utilization_pct=_mean(utils),
        peak_memory_used_gib=max(mems) / _GIB if mems else None,
        memory_capacity_gib=info.memory_total_bytes / _GIB if info.memory_total_bytes else None,
        energy_j=energy,
        energy_source=source,
        tokens=tokens,
        energy_per_token_j=energy / tokens if tokens > 0 else None,
    )


def combine(per_gpu: Sequence[PowerSummary]) -> PowerSummary:
    """All ranks' GPUs as one: mean per-GPU figures, summed energy, energy per token of the whole run.

    Every rank saw the same global tokens in the same window, so the tokens are taken once.
    Unavailable on any rank (a rank without NVML) makes the whole unavailable, with that reason.
    """
    if not per_gpu:
        return unavailable("no rank reported")
    missing = [s for s in per_gpu if not s.available]
    if missing:
        return (
            missing[0] if len(per_gpu) == 1 else unavailable(f"{len(missing)} rank(s): {missing[0].reason}")
        )
    if len(per_gpu) == 1:
        return per_gpu[0]

    def mean_of(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return _mean(known) if len(known) == len(values) else None

    energy = sum(s.energy_j or 0.0 for s in per_gpu)
    tokens = per_gpu[0].tokens
    watts = mean_of([s.mean_watts_per_gpu for s in per_gpu])
    limit = mean_of([s.power_limit_watts for s in per_gpu])
    peaks = [s.peak_memory_used_gib for s in per_gpu if s.peak_memory_used_gib is not None]
    sources = {s.energy_source for s in per_gpu}
    return PowerSummary(
        available=True,
        reason=None,
        gpus=sum(s.gpus for s in per_gpu),
        samples=sum(s.samples for s in per_gpu),
        window_s=max(s.window_s or 0.0 for s in per_gpu),
        mean_watts_per_gpu=watts,
        power_limit_watts=limit,
        mean_power_fraction=watts / limit if watts is not None and limit else None,
        mean_utilization_pct=mean_of([s.mean_utilization_pct for s in per_gpu]),
        peak_memory_used_gib=max(peaks) if peaks else None,
        memory_capacity_gib=mean_of([s.memory_capacity_gib for s in per_gpu]),
        energy_j=energy,
        energy_source=sources.pop() if len(sources) == 1 else "mixed",
        tokens=tokens,
        energy_per_token_j=energy / tokens if tokens else None,
    )


# ---------------------------------------------------------------------------------------------
# The sampler.


class PowerMeter:
    """Samples one GPU through an NVML module (pynvml) on a daemon thread between start() and stop().

    Built by `for_device`; `nvml` and `handle` can be any objects with pynvml's functions (tests
    pass a fake). A meter built with a `reason` is disabled: start() does nothing and stop()
    returns that reason.
    """

    def __init__(
        self, nvml: Any = None, handle: Any = None, *, interval_s: float = 0.1, reason: str | None = None
    ) -> None:
        self.nvml, self.handle, self.interval_s = nvml, handle, interval_s
        self.reason = reason if nvml is not None else (reason or "no NVML")
        self.samples: list[PowerSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._energy0: float | None = None
        self.info = DeviceInfo(None, None)

    @classmethod
    def for_device(cls, device: Any, *, interval_s: float = 0.1) -> PowerMeter:
        """The meter of a torch device; disabled with a reason on CPU, without nvidia-ml-py or NVML."""
        if getattr(device, "type", str(device)) != "cuda":
            return cls(reason=f"device {device}: NVML measures NVIDIA GPUs only")
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            return cls(reason="nvidia-ml-py (pynvml) is not installed")
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(device))
        except Exception as exc:  # NVML missing from the driver, no permission, unknown bus id
            return cls(reason=f"NVML unavailable: {type(exc).__name__}: {exc}")
        return cls(pynvml, handle, interval_s=interval_s)

    @property
    def enabled(self) -> bool:
        return self.nvml is not None and self.reason is None

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self.info = DeviceInfo(
            power_limit_watts=_call(lambda: self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000),
            memory_total_bytes=_call(lambda: int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).total)),
        )
        self._energy0 = self._energy_j()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="megasweep-power", daemon=True)
        self._thread.start()

    def stop(self, *, tokens: int) -> PowerSummary:
        """End sampling; the summary of the window for `tokens` tokens processed in it."""
        if not self.enabled:
            return unavailable(self.reason or "disabled")
        if self._thread is None:
            return unavailable("the meter was never started (no measured iterations)")
        self._stop.set()
        self._thread.join()
        window = time.monotonic() - self._t0
        end = self._energy_j()
        energy = end - self._energy0 if end is not None and self._energy0 is not None else None
        return summarize(self.samples, self.info, window_s=window, tokens=tokens, energy_counter_j=energy)

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                self._sample()  # the window's end, so short windows have two readings
                return

    def _sample(self) -> None:
        watts = _call(lambda: self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000)
        if watts is None:
            return
        self.samples.append(
            PowerSample(
                t=time.monotonic(),
                watts=float(watts),
                utilization_pct=_call(
                    lambda: float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
                ),
                memory_used_bytes=_call(lambda: int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)),
            )
        )

    def _energy_j(self) -> float | None:
        mj = _call(lambda: self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        return None if mj is None else mj / 1000


def _call(fn: Any) -> Any:
    # A reading the GPU does not support (NVMLError_NotSupported) is a missing value, not a failure.
    try:
        return fn()
    except Exception:
        return None


def _nvml_uuid(device: Any) -> str:
    """NVML's name for a CUDA device ('GPU-<uuid>'), which survives CUDA_VISIBLE_DEVICES renumbering."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def gather(summary: PowerSummary, world_size: int) -> PowerSummary:
    """Every rank's summary combined (a collective: every rank calls it); the summary itself on one process."""
    import torch.distributed as dist

    if world_size == 1 or not dist.is_initialized():
        return combine([summary])
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, summary)
    return combine([s for s in gathered if isinstance(s, PowerSummary)])
