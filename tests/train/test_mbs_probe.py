"""micro_batch_size=auto, the job's half: the probe under a SIMULATED memory limit, and the trainer.

There is no device memory to exhaust on a CPU, so the probe tests run the real tiny model's
forward/backward inside train.mbs_probe.simulated_memory_limit, which counts the step's live
tensors and raises torch.OutOfMemoryError past a cap: the cap is set between the needs of two
sizes, so the largest sizes fail and the probe must walk down to the first that fits.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from conf.schema import ModelConfig, ParallelismConfig, RunConfig
from train.mbs_probe import auto_micro_batch, halving_ladder, probe_micro_batch, simulated_memory_limit
from train.planner.memory import GIB, estimate_memory

from .test_distributed import run_train

TINY = ModelConfig(
    name="autombs", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=256
)
SIZES = (1, 2, 4, 8, 16)


# ---------------------------------------------------------------------------------------------
# Probe half, under a simulated memory limit.


@pytest.fixture(scope="module")
def step_fn() -> object:
    from train.model import build_model, lm_loss_sum

    torch.manual_seed(0)
    model = build_model(TINY)

    def step(mbs: int) -> None:
        tokens = torch.randint(0, TINY.vocab_size, (mbs, TINY.seq_length + 1))
        loss = lm_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / (mbs * TINY.seq_length)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _peak(step_fn: object, mbs: int) -> int:
    with simulated_memory_limit(float("inf")) as peak:
        step_fn(mbs)  # type: ignore[operator]
    return peak()


def test_simulated_limit_scales_with_micro_batch(step_fn: object) -> None:
    peaks = [_peak(step_fn, c) for c in (1, 2, 4)]
    assert 0 < peaks[0] < peaks[1] < peaks[2]
    # Activations dominate: doubling the micro-batch nearly doubles the working memory.
    assert peaks[2] / peaks[1] == pytest.approx(2.0, rel=0.15)


def test_probe_walks_down_to_the_first_size_that_fits(step_fn: object) -> None:
    limit = 1.5 * _peak(step_fn, 4)  # below the need of 8 (about 2x that of 4)
    with simulated_memory_limit(limit):
        mbs, log = probe_micro_batch(step_fn, SIZES)  # type: ignore[arg-type]
    assert mbs == 4
    assert [(a.micro_batch_size, a.outcome) for a in log] == [(16, "oom"), (8, "oom"), (4, "ok")]
    assert "simulated memory limit" in log[0].message


def test_probe_returns_none_when_every_size_runs_out(step_fn: object) -> None:
    with simulated_memory_limit(1000):
        mbs, log = probe_micro_batch(step_fn, (1, 2))  # type: ignore[arg-type]
    assert mbs is None
    assert [a.outcome for a in log] == ["oom", "oom"]


def test_probe_lets_other_errors_through() -> None:
    def broken(mbs: int) -> None:
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError, match="not a memory problem"):
        probe_micro_batch(broken, (1, 2))


def test_auto_starts_at_the_prediction_and_the_probe_decides(step_fn: object) -> None:
    par = ParallelismConfig(micro_batch_size=1, global_batch_size=32)
    reserve = 0.5
    needs = {
        c: estimate_memory(TINY, dataclasses.replace(par, micro_batch_size=c), dp=1).needed for c in (8, 16)
    }
    # A device whose usable memory lies between the planner's figures for 8 and 16.
    memory_gib = reserve + (needs[8] + needs[16]) / 2 / GIB
    run = RunConfig(
        model=TINY,
        parallelism=par,
        hardware=dataclasses.replace(RunConfig().hardware, memory_gib=memory_gib, memory_reserve_gib=reserve),
    )
    limit = 1.5 * _peak(step_fn, 4)  # the "real" device is smaller than the planner thinks
    with simulated_memory_limit(limit):
        result = auto_micro_batch(run, dp=1, step_fn=step_fn, candidates=SIZES)  # type: ignore[arg-type]
    assert result.predicted == 8
    # 16 is never tried: the prediction caps the probe.
    assert [(a.micro_batch_size, a.outcome) for a in result.probe] == [(8, "oom"), (4, "ok")]
    assert result.micro_batch_size == 4
    assert "micro_batch_size=8" in result.reason


# ---------------------------------------------------------------------------------------------
# `auto` at the entry points: validation, the planner, the trainer.

CLI_TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "model.vocab_size=512",
    "model.make_vocab_size_divisible_by=64",
    "parallelism.global_batch_size=16",
    "parallelism.precision=fp32",
    "training.train_iters=3",
    "training.warmup_iters=1",
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=1.0",
    "logger=disabled",
]














def test_probe_treats_the_cpu_allocators_failure_as_out_of_memory() -> None:
    def step(mbs: int) -> None:
        if mbs > 2:  # what c10 raises under an address-space limit (tests/train/test_failures.py)
            raise RuntimeError(f"[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: {mbs}")

    mbs, log = probe_micro_batch(step, (1, 2, 4, 8))
    assert mbs == 2
    assert [(a.micro_batch_size, a.outcome) for a in log] == [(8, "oom"), (4, "oom"), (2, "ok")]
    assert "DefaultCPUAllocator" in log[0].message


def test_cli_auto_records_the_chosen_size(tmp_path: Path) -> None:
    proc, record = run_train(tmp_path, *CLI_TINY, "parallelism.micro_batch_size=auto")
    assert record["status"] == "ok", record["message"]
    # 16 GiB of CPU: the whole per-replica batch (gbs 16, dp 1) fits, predicted and probed.
    assert record["micro_batch"]["requested"] == "auto"
    assert record["micro_batch"]["chosen"] == record["micro_batch"]["predicted"] == 16
    assert record["micro_batch"]["probed"] == [{"micro_batch_size": 16, "outcome": "ok", "message": ""}]
    assert record["config"]["parallelism"]["micro_batch_size"] == 16
    assert "parallelism.micro_batch_size=auto" in record["overrides"]
    assert "micro_batch_size=auto -> 16" in proc.stdout


def test_trainer_walks_down_under_a_memory_limit_and_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIMULATED limit (train.mbs_probe.simulated_memory_limit, in-process): the trainer's CPU probe
    limit is replaced by one between the measured needs of micro-batches 2 and 4."""
    from tests.train.test_trainer import compose_run
    from train import setup, trainer
    from train.model import build_model

    run = compose_run(*CLI_TINY, "parallelism.micro_batch_size=auto")
    sized = dataclasses.replace(run, parallelism=dataclasses.replace(run.parallelism, micro_batch_size=1))
    torch.manual_seed(0)
    model = build_model(run.model)
    cpu = torch.device("cpu")
    peaks = {c: setup.probe_step(model, sized, c, device=cpu, limit_bytes=float("inf")) for c in (2, 4)}
    assert peaks[2] is not None and peaks[4] is not None and peaks[2] < peaks[4]
    limit = (peaks[2] + peaks[4]) / 2
    monkeypatch.setattr(setup, "probe_memory_limit", lambda *a, **k: limit)

    record = trainer.run_training(run, output_dir=tmp_path, overrides=["parallelism.micro_batch_size=auto"])
    assert record["status"] == "ok"
    chosen = record["micro_batch"]
    assert chosen["predicted"] == 16 and chosen["chosen"] == 2
    assert [(a["micro_batch_size"], a["outcome"]) for a in chosen["probed"]] == [
        (16, "oom"), (8, "oom"), (4, "oom"), (2, "ok"),
    ]
    assert "simulated memory limit" in chosen["probed"][0]["message"]
    assert record["config"]["parallelism"]["micro_batch_size"] == 2
    assert record["iterations_run"] == 3 and all(math.isfinite(x) for x in record["losses"])


def test_the_probe_halves_down_the_sizes_that_split_the_batch() -> None:
    # Every size that splits a batch of 120 is sixteen attempts, each of which may run out of memory.
    divisors = [c for c in range(1, 121) if 120 % c == 0]
    assert halving_ladder(divisors) == [120, 60, 30, 15, 6, 3, 1]
    assert halving_ladder([8, 4, 2, 1]) == [8, 4, 2, 1] and halving_ladder([]) == []
