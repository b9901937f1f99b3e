"""train.power: aggregation of NVML samples (pure), the sampler thread against a fake NVML, the CPU path.

No GPU here: the real pynvml path (device lookup by UUID, real readings) is untested on this machine.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from train.power import (
    DeviceInfo,
    PowerMeter,
    PowerSample,
    combine,
    summarize,
    time_weighted_mean_watts,
    unavailable,
)
from train.trainer import run_training

from .test_trainer import compose_run

INFO = DeviceInfo(power_limit_watts=400.0, memory_total_bytes=80 * 2**30)


def samples(
    watts: list[float], *, dt: float = 0.5, util: float = 90.0, mem_gib: list[float] | None = None
) -> list[PowerSample]:
    mem = mem_gib or [10.0] * len(watts)
    return [
        PowerSample(t=100.0 + i * dt, watts=w, utilization_pct=util, memory_used_bytes=int(m * 2**30))
        for i, (w, m) in enumerate(zip(watts, mem, strict=True))
    ]


def test_time_weighted_mean_uses_the_trapezoid() -> None:
    # 100 W for 1 s then a ramp to 300 W over 1 s: (100 + 200) / 2 s = 150 W, not the plain mean 166.7.
    s = [
        PowerSample(0.0, 100.0, None, None),
        PowerSample(1.0, 100.0, None, None),
        PowerSample(2.0, 300.0, None, None),
    ]
    assert time_weighted_mean_watts(s) == pytest.approx(150.0)
    assert time_weighted_mean_watts(s[:1]) == 100.0
    assert time_weighted_mean_watts([]) is None


def test_summary_of_one_gpu() -> None:
    summary = summarize(
        samples([300.0, 300.0, 300.0], mem_gib=[10.0, 30.0, 20.0]), INFO, window_s=2.0, tokens=1000
    )
    assert summary.available and summary.reason is None and summary.gpus == 1 and summary.samples == 3
    assert summary.mean_watts_per_gpu == pytest.approx(300.0)
    assert summary.mean_power_fraction == pytest.approx(0.75)
    assert summary.mean_utilization_pct == pytest.approx(90.0)
    assert summary.peak_memory_used_gib == pytest.approx(30.0) and summary.memory_capacity_gib == 80.0
    # No energy counter: 300 W x 2 s = 600 J over 1000 tokens.
    assert summary.energy_source == "mean power x window"
    assert summary.energy_j == pytest.approx(600.0) and summary.energy_per_token_j == pytest.approx(0.6)
    counted = summarize(samples([300.0, 300.0]), INFO, window_s=2.0, tokens=1000, energy_counter_j=500.0)
    assert counted.energy_source == "nvml energy counter" and counted.energy_per_token_j == pytest.approx(0.5)


def test_combined_gpus_sum_energy_and_average_power() -> None:
    a = summarize(samples([200.0, 200.0]), INFO, window_s=1.0, tokens=400)
    b = summarize(samples([400.0, 400.0]), INFO, window_s=1.0, tokens=400)
    both = combine([a, b])
    assert both.gpus == 2 and both.samples == 4
    assert both.mean_watts_per_gpu == pytest.approx(300.0) and both.mean_power_fraction == pytest.approx(0.75)
    assert both.energy_j == pytest.approx(600.0) and both.energy_per_token_j == pytest.approx(1.5)
    assert combine([a]) == a
    missing = combine([a, unavailable("device cpu: NVML measures NVIDIA GPUs only")])
    assert not missing.available and "1 rank(s)" in (missing.reason or "")


def test_no_samples_is_unavailable() -> None:
    summary = summarize([], INFO, window_s=1.0, tokens=10)
    assert not summary.available and summary.energy_per_token_j is None


def test_cpu_meter_is_disabled_with_a_reason() -> None:
    meter = PowerMeter.for_device(torch.device("cpu"))
    assert not meter.enabled
    meter.start()  # no thread, no error
    summary = meter.stop(tokens=100)
    assert not summary.available and "cpu" in (summary.reason or "")
    assert summary.mean_watts_per_gpu is None and summary.energy_per_token_j is None


class FakeNvml:
    """pynvml's calls the meter makes, with a draw that rises 10 W per reading (milliwatts, like NVML)."""

    def __init__(self) -> None:
        self.readings = 0
        self.energy_mj = 1_000_000

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: object) -> int:
        return 350_000

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> SimpleNamespace:
        return SimpleNamespace(total=40 * 2**30, used=(5 + self.readings) * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        self.readings += 1
        self.energy_mj += 20_000
        return 100_000 + 10_000 * self.readings

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> SimpleNamespace:
        return SimpleNamespace(gpu=50)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object) -> int:
        return self.energy_mj


def test_sampler_thread_with_a_fake_nvml() -> None:
    nvml = FakeNvml()
    meter = PowerMeter(nvml, handle="gpu0", interval_s=0.01)
    assert meter.enabled
    meter.start()
    time.sleep(0.2)
    summary = meter.stop(tokens=2000)
    assert summary.available and summary.samples == nvml.readings >= 3
    assert summary.power_limit_watts == 350.0 and summary.memory_capacity_gib == 40.0
    assert 110.0 <= summary.mean_watts_per_gpu <= 100.0 + 10.0 * nvml.readings  # type: ignore[operator]
    assert summary.peak_memory_used_gib == pytest.approx(5 + nvml.readings)
    assert summary.mean_utilization_pct == 50.0
    # The energy counter advanced 20 J per reading since start().
    assert summary.energy_source == "nvml energy counter"
    assert summary.energy_j == pytest.approx(20.0 * nvml.readings)
    assert summary.energy_per_token_j == pytest.approx(summary.energy_j / 2000)  # type: ignore[operator]


def test_cpu_record_has_null_power_with_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    record = run_training(compose_run(), output_dir=tmp_path, overrides=[])
    assert record["status"] == "ok"
    power = record["power"]
    assert power["available"] is False and "cpu" in power["reason"]
    for key in (
        "mean_watts_per_gpu",
        "power_limit_watts",
        "mean_utilization_pct",
        "peak_memory_used_gib",
        "memory_capacity_gib",
        "energy_per_token_j",
    ):
        assert power[key] is None, key
