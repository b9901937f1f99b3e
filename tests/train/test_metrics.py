"""train.metrics: Megatron log lines, medians, credential scrubbing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from train.metrics import (
    IterationStats,
    allowlisted_env,
    format_log_line,
    interval_stats,
    median_after_warmup,
    redact_values,
    scrub,
    scrub_overrides,
    secret_values,
    spread,
    summarize,
)

# A line Megatron-DeepSpeed printed for BLOOM (seed 001, "bf16 - 1 node, 1 replica", 20B model).
BLOOM_LINE = (
    " iteration        2/   95367 | consumed samples:         4096 | consumed tokens:      8388608 |"
    " elapsed time per iteration (s): 777.09 | learning rate: 3.787E-06 | global batch size:  2048 |"
    " lm loss: 6.381926E+01 | loss scale: 1.0 | grad norm: 2.763 | num zeros: 0.0 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 2.635 |"
    " TFLOPs: 107.48 |"
)

NUMBER = r"[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"


def parse_megatron_line(line: str) -> dict[str, str]:
    """Fields of a Megatron iteration line, as a log parser would read them."""
    fields = {}
    for part in line.strip().strip("|").split(" | "):
        part = part.strip()
        if part.startswith("iteration"):
            m = re.fullmatch(r"iteration\s+(\d+)/\s*(\d+)", part)
            assert m, part
            fields["iteration"], fields["train_iters"] = m.groups()
        else:
            key, _, value = part.rpartition(": ")
            fields[key] = value.strip()
    return fields


def _stats(**overrides: object) -> IterationStats:
    base: dict[str, object] = dict(
        iteration=2,
        train_iters=95367,
        consumed_samples=4096,
        consumed_tokens=8388608,
        elapsed_s=777.09,
        learning_rate=3.787e-06,
        global_batch_size=2048,
        loss=63.81926,
        loss_scale=1.0,
        grad_norm=2.763,
        skipped_iters=0,
        nan_iters=0,
        samples_per_s=2.635,
        tflops=107.48,
        mfu=0.3445,
        max_mem_gib=68.0,
    )
    base.update(overrides)
    return IterationStats(**base)  # type: ignore[arg-type]


def test_log_line_has_megatrons_fields_in_megatrons_format() -> None:
    ours = parse_megatron_line(format_log_line(_stats()))
    theirs = parse_megatron_line(BLOOM_LINE)
    # Every field Megatron prints (except the optional `num zeros`) is there, with the same text
    # for the same numbers; elapsed time has one more decimal (documented in format_log_line).
    shared = set(theirs) - {"num zeros", "elapsed time per iteration (s)"}
    assert shared <= set(ours)
    for key in shared:
        assert ours[key] == theirs[key], key
    assert float(ours["elapsed time per iteration (s)"]) == pytest.approx(777.09)
    assert ours["MFU"] == "34.45%"
    assert ours["max memory (GiB)"] == "68.00"
    # Field order follows Megatron's
    keys = list(ours)
    assert keys.index("consumed samples") < keys.index("lm loss") < keys.index("TFLOPs") < keys.index("MFU")


def test_log_line_layout() -> None:
    line = format_log_line(_stats(iteration=7, train_iters=10, tflops=None, mfu=None))
    assert line.startswith(" iteration        7/      10 | consumed samples:")
    assert line.endswith(" |")
    assert "TFLOPs: n/a" in line and "MFU: n/a" in line
    small = parse_megatron_line(format_log_line(_stats(tflops=0.02806)))
    assert small["TFLOPs"] == "0.0281"  # sub-TFLOP CPU runs keep significant digits
    # Three of them however small: "0.0004" for 0.000449 read 11% below the MFU printed beside it.
    tiny = [parse_megatron_line(format_log_line(_stats(tflops=x)))["TFLOPs"] for x in (0.000449, 0.4, 0.0)]
    assert tiny == ["0.000449", "0.4000", "0.0000"]
    for value in parse_megatron_line(line).values():
        assert re.fullmatch(NUMBER + "%?|n/a", value), value


def test_a_line_over_several_iterations_averages_them_as_megatron_does() -> None:
    # training.log_interval=2: the line was the second iteration's alone (its time, its loss).
    first = _stats(iteration=1, elapsed_s=1.0, loss=4.0, samples_per_s=2048.0, tflops=30.0, mfu=0.3, learning_rate=1e-4)
    second = _stats(iteration=2, elapsed_s=3.0, loss=2.0, samples_per_s=2048 / 3, tflops=10.0, mfu=0.1, nan_iters=0,
                    learning_rate=2e-4, grad_norm=0.5)  # fmt: skip
    line = interval_stats([first, second])
    assert line.iteration == 2 and line.learning_rate == 2e-4 and line.grad_norm == 0.5  # the last iteration's
    assert line.elapsed_s == pytest.approx(2.0) and line.loss == pytest.approx(3.0)
    # Rates over the interval's whole time: 4,096 samples and 60 TFLOP in 4 s, not the mean of the two rates.
    assert line.samples_per_s == pytest.approx(1024.0)
    assert line.tflops == pytest.approx(15.0) and line.mfu == pytest.approx(0.15)
    assert interval_stats([second]) is second
    # A rate unknown for any iteration is unknown for the line; a NaN iteration counts.
    assert interval_stats([first, _stats(mfu=None, nan_iters=1)]).mfu is None
    assert interval_stats([first, _stats(nan_iters=1)]).nan_iters == 1
    # An fp16 overflow's skipped step updated nothing: its loss is left out of the mean, as Megatron's.
    overflow = _stats(iteration=3, loss=100.0, skipped_iters=1)
    assert interval_stats([first, overflow]).loss == pytest.approx(4.0)
    assert interval_stats([overflow, _stats(iteration=4, loss=6.0, skipped_iters=1)]).loss == pytest.approx(6.0)
    again = _stats(iteration=4, loss=50.0, skipped_iters=2)
    assert interval_stats([overflow, again]).loss == pytest.approx(75.0)  # none updated: every loss
    assert interval_stats([overflow, _stats(loss=6.0, skipped_iters=1)], skipped_before=1).loss == pytest.approx(53.0)


def test_median_excludes_warmup() -> None:
    # The two warm-up iterations are 100x slower; they must not move the median.
    assert median_after_warmup([100.0, 50.0, 1.0, 2.0, 3.0], warmup=2) == 2.0
    assert median_after_warmup([100.0, 50.0, 1.0, 2.0], warmup=2) == 1.5
    assert median_after_warmup([100.0, 50.0], warmup=2) is None
    assert median_after_warmup([1.0, None, 3.0], warmup=0) == 2.0
    assert median_after_warmup([5.0, 1.0], warmup=-3) == 3.0


def test_summarize_derives_throughput_from_median_time() -> None:
    its = [_stats(elapsed_s=t, global_batch_size=8) for t in (9.0, 9.0, 2.0, 1.0, 4.0)]
    m = summarize(
        its, warmup=2, seq_length=256, devices=2, flops_per_iteration={"model": 4e12, "hardware": 6e12}
    )
    assert m.measured_iterations == 3
    assert m.sec_per_iter == 2.0
    assert m.samples_per_s == 4.0
    assert m.tokens_per_s_per_device == 4.0 * 256 / 2
    assert m.tflops_per_device == pytest.approx(1.0)
    assert m.tflops_per_device_hardware == pytest.approx(1.5)
    assert m.tflops_per_device_megatron_eq3 is None
    # The spread of the same three measured iterations (2, 1, 4 s), warm-up left out.
    assert m.sec_spread is not None and (m.sec_spread.min, m.sec_spread.median, m.sec_spread.max) == (1.0, 2.0, 4.0)
    assert m.sec_spread.cv == pytest.approx(1.5275252 / (7 / 3))
    empty = summarize(its[:2], warmup=2, seq_length=256, devices=1, flops_per_iteration={"model": 1.0})
    assert empty.sec_per_iter is None and empty.measured_iterations == 0


def test_summarize_leaves_profiled_iterations_out_while_others_remain() -> None:
    its = [_stats(iteration=i, elapsed_s=t, global_batch_size=8) for i, t in enumerate((9.0, 1.0, 8.0, 2.0), 1)]
    m = summarize(its, warmup=1, seq_length=256, devices=1, flops_per_iteration={}, profiled={3})
    assert (m.measured_iterations, m.sec_per_iter) == (2, 1.5)
    # Every measured iteration profiled: they are all there is to report.
    m = summarize(its, warmup=1, seq_length=256, devices=1, flops_per_iteration={}, profiled={2, 3, 4})
    assert (m.measured_iterations, m.sec_per_iter) == (3, 2.0)


def test_spread_needs_two_values_for_a_cv() -> None:
    assert spread([]) is None
    one = spread([3.0])
    assert one is not None and (one.n, one.min, one.max, one.cv) == (1, 3.0, 3.0, None)
    same = spread([2.0, 2.0])
    assert same is not None and same.cv == 0.0


def test_env_allowlist_and_scrubbing() -> None:
    environ = {
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "NCCL_SECRET_KEY": "abc123",
        "SLURM_JOB_ID": "42",
        "CUDA_LAUNCH_BLOCKING": "1",
        "WANDB_API_KEY": "sekrit",
        "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "xyz",
    }
    env = allowlisted_env(environ)
    assert env == {
        "CUDA_LAUNCH_BLOCKING": "1",
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "NCCL_SECRET_KEY": "***",
        "SLURM_JOB_ID": "42",
    }


def test_scrub_config_and_overrides() -> None:
    cfg = {
        "cluster": {"env": {"WANDB_API_KEY": "sekrit", "NCCL_DEBUG": "INFO"}},
        "hf_token": "t0k",
        "lr": 1e-3,
    }
    assert scrub(cfg) == {
        "cluster": {"env": {"WANDB_API_KEY": "***", "NCCL_DEBUG": "INFO"}},
        "hf_token": "***",
        "lr": 1e-3,
    }
    assert scrub_overrides(["+cluster.env.WANDB_API_KEY=sekrit", "training.lr=1e-3", "model=tiny"]) == [
        "+cluster.env.WANDB_API_KEY=***",
        "training.lr=1e-3",
        "model=tiny",
    ]


def test_redact_values_catches_quoted_secrets() -> None:
    secrets = secret_values(
        {"WANDB_API_KEY": "sekrit-long", "MY_TOKEN": "sekrit", "PASSWORD": "1", "HOME": "/root"}
    )
    assert secrets == ["sekrit-long", "sekrit"]  # longest first; too-short values are not redacted
    record = {"message": "login failed for key sekrit-long", "overrides": ["a=sekrit"], "n": 1}
    assert redact_values(record, secrets) == {
        "message": "login failed for key ***",
        "overrides": ["a=***"],
        "n": 1,
    }


def test_metrics_module_does_not_import_torch() -> None:
    import subprocess

    code = "import sys, train.metrics; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
