"""train.calibrate: the CPU peak calibrated once per host and cached, and a real `python -m train`
whose log lines and record use that one peak, warning (never `n/a`) when an iteration beats it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.launchers.test_slurm_launcher import TINY
from train.calibrate import cached_peak, calibrate, forget_cached_peak
from train.contract import (
    CACHE_DIR_ENV,
    RESULT_FILE,
    PeakCalibration,
    peak_cache_key,
    peak_cache_path,
    read_record,
    write_json_atomic,
)

from .test_distributed import REPO, worker_env

# A short calibration: these tests check the bookkeeping, not the figure.
QUICK = {"warmup_s": 0.02, "trials": 3, "trial_s": 0.03, "max_n": 256}
# The launcher tests' one-second model, with a measured fp32 peak.
TINY_RUN = (*TINY, "hardware.peak_measured=true", "parallelism.precision=fp32")
LOG_MFU = re.compile(r" TFLOPs: ([0-9.]+) \| MFU: ([^|]+) \|")


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_calibration_spread_and_best_trial() -> None:
    cal = calibrate("cpu", "fp32", **QUICK)  # type: ignore[arg-type]
    assert len(cal.trials_tflops) == 3 and cal.tflops == max(cal.trials_tflops)
    assert 0 < cal.min_tflops <= cal.median_tflops <= cal.tflops < 100  # a few CPU cores: far below a GPU
    assert cal.cv >= 0 and cal.matrix_size == 256 and cal.seconds > 0
    assert cal.host == socket.gethostname() and cal.cores == os.cpu_count()
    assert cal.threads == torch.get_num_threads() and cal.torch == torch.__version__


def test_peak_is_calibrated_once_per_host_and_thread_count(tmp_path: Path, threads: None) -> None:
    env = {CACHE_DIR_ENV: str(tmp_path / "cache")}
    first, warning = cached_peak("cpu", "fp32", environ=env, **QUICK)
    assert warning is None and not first.from_cache
    path = peak_cache_path(socket.gethostname(), env)
    assert first.cache_file == str(path) and path.parent == tmp_path / "cache"
    again, _ = cached_peak("cpu", "fp32", environ=env, **QUICK)
    # The cached figure, spread included, not a new measurement.
    assert again.from_cache and again.tflops == first.tflops and again.trials_tflops == first.trials_tflops
    torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)
    other, _ = cached_peak("cpu", "fp32", environ=env, **QUICK)
    assert not other.from_cache and other.threads == torch.get_num_threads()
    entries = json.loads(path.read_text())["entries"]
    assert set(entries) == {first.key, other.key}


def test_an_unwritable_cache_still_measures_and_says_why(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cal, warning = cached_peak("cpu", "fp32", environ={CACHE_DIR_ENV: str(blocker / "cache")}, **QUICK)
    assert cal.tflops > 0 and not cal.from_cache
    assert warning is not None and "not cached" in warning


def run_train(out: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    # One thread: the cache key the seeded entry below is written for.
    env = worker_env(**{CACHE_DIR_ENV: str(cache)})
    return subprocess.run(
        [sys.executable, "-m", "train", *TINY_RUN, f"hydra.run.dir={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


def test_a_run_calibrates_caches_and_logs_with_the_records_peak(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    proc = run_train(tmp_path / "run", cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_record(tmp_path / "run" / RESULT_FILE)
    assert record is not None and record["peak_source"] == "measured"
    cal = record["peak_calibration"]
    assert not cal["from_cache"] and cal["threads"] == 1 and cal["tflops"] == record["peak_tflops"]
    assert len(cal["trials_tflops"]) >= 3 and cal["min_tflops"] <= cal["median_tflops"] <= cal["tflops"]
    cached = json.loads(Path(cal["cache_file"]).read_text())["entries"]
    assert list(cached.values())[0]["tflops"] == record["peak_tflops"]
    assert "calibrated now, cached in" in proc.stdout
    # Every log line's MFU is its TFLOPs over the record's peak: one peak for both.
    lines = LOG_MFU.findall(proc.stdout)
    assert len(lines) == 3
    for tflops, mfu in lines:
        assert mfu.strip() != "n/a"
        assert float(mfu.strip().rstrip("%")) / 100 == pytest.approx(float(tflops) / record["peak_tflops"], rel=0.02, abs=1e-3)


def test_iterations_above_a_cached_peak_warn_with_both_figures(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # A peak far below what any iteration reaches, as a calibration under heavy load could leave.
    low = PeakCalibration(
        tflops=1e-6, trials_tflops=[1e-6], median_tflops=1e-6, min_tflops=1e-6, cv=0.0, matrix_size=256,
        seconds=1.0, host=socket.gethostname(), device="cpu", precision="fp32", cores=os.cpu_count() or 1,
        threads=1, torch=torch.__version__, calibrated_at="2024-01-01T00:00:00+00:00",
    )
    path = peak_cache_path(socket.gethostname(), {CACHE_DIR_ENV: str(cache)})
    path.parent.mkdir(parents=True)
    assert low.key == peak_cache_key(device="cpu", precision="fp32", cores=low.cores, threads=1, torch=low.torch)
    other = dataclasses.replace(low, threads=2, tflops=1.0)  # another thread count's entry: kept
    write_json_atomic(path, {"entries": {low.key: low.to_dict(), other.key: other.to_dict()}})

    proc = run_train(tmp_path / "run", cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_record(tmp_path / "run" / RESULT_FILE)
    assert record is not None and record["peak_tflops"] == 1e-6 and record["peak_calibration"]["from_cache"]
    assert "peak TFLOPs 1e-06 (measured) [best of 1 trials, cv 0.0%; cached in" in proc.stdout
    lines = LOG_MFU.findall(proc.stdout)
    assert len(lines) == 3 and all(mfu.strip().endswith("%") and float(mfu.strip()[:-1]) > 100 for _, mfu in lines)
    warned = [line for line in proc.stdout.splitlines() if line.startswith("warning: iteration ")]
    assert len(warned) == 3 and all("above the measured peak of 1e-06 TFLOP/s" in w for w in warned)
    assert any("3 of 3 iterations ran above the measured peak of 1e-06" in w for w in record["warnings"])
    # The run proved the cached figure too low: it is dropped, so the next run measures again.
    assert any(w.endswith(f"dropped from {path}, so the next run on this host measures it again") for w in record["warnings"])
    assert json.loads(path.read_text())["entries"] == {other.key: other.to_dict()}
    assert record["mfu"] is None and any(w.startswith("MFU not recorded") for w in record["warnings"])
    # ... and the analysis shows the ratio, marked, rather than an empty MFU cell.
    from analysis.records import load_sweeps
    from analysis.tables import results_table

    (mfu,) = results_table(load_sweeps([tmp_path], queue=None).table)["MFU"]
    ratio = record["tflops_per_device"] / record["peak_tflops"]
    assert ratio > 1 and mfu == f"{100 * ratio:.0f}% (above peak)"


def test_an_fp16_run_on_a_cpu_stays_below_its_measured_peak(tmp_path: Path) -> None:
    # The peak is timed as the model multiplies (x @ W^T, train.contract.PEAK_KERNEL). Timed with
    # torch.mm(a, b), fp16 on this CPU took a path 10-30x slower than the model's, and every iteration
    # of this run logged an MFU above 100% (223% in one) with a warning, the record's MFU left null.
    env = worker_env(**{CACHE_DIR_ENV: str(tmp_path / "cache")})
    proc = subprocess.run(
        [sys.executable, "-m", "train", *TINY, "hardware.peak_measured=true", "parallelism.precision=fp16",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_record(tmp_path / "run" / RESULT_FILE)
    assert record is not None and record["peak_source"] == "measured" and record["precision"] == "fp16"
    assert record["peak_calibration"]["precision"] == "fp16"
    assert record["mfu"] is not None and 0 < record["mfu"] < 1
    assert not [w for w in record["warnings"] if "above the" in w]
    mfus = [float(m.strip().rstrip("%")) for _, m in LOG_MFU.findall(proc.stdout)]
    assert mfus and max(mfus) < 100


def test_forget_drops_only_the_entry_it_was_given(tmp_path: Path) -> None:
    """A run that beat its peak drops that calibration; one another run wrote since stays."""
    environ = {CACHE_DIR_ENV: str(tmp_path)}
    measured, _ = cached_peak("cpu", "fp32", environ=environ, **QUICK)
    path = Path(measured.cache_file or "")
    newer = dataclasses.replace(measured, calibrated_at="2099-01-01T00:00:00+00:00")
    write_json_atomic(path, {"entries": {newer.key: newer.to_dict()}})
    assert not forget_cached_peak(measured)
    assert json.loads(path.read_text())["entries"] == {newer.key: newer.to_dict()}
    assert forget_cached_peak(newer) and json.loads(path.read_text())["entries"] == {}
    assert not forget_cached_peak(dataclasses.replace(newer, cache_file=None))
