"""The DeepSpeed config is derived field by field from the composed Hydra config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conf.schema import RunConfig
from train import ds_config
from train.ds_config import DS_CONFIG_FILE, deepspeed_config, write_deepspeed_config
from train.planner.memory import MEGASWEEP_REDUCE_BUCKET

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_run(*overrides: str) -> RunConfig:
    from hydra import compose, initialize_config_dir

    from conf.schema import to_run_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize(
    ("overrides", "dp"),
    [
        (["parallelism.engine=deepspeed"], 1),
        (
            [
                "parallelism.engine=deepspeed",
                "parallelism.zero_stage=2",
                "parallelism.offload=optimizer",
                "parallelism.precision=bf16",
                "parallelism.micro_batch_size=2",
                "parallelism.global_batch_size=32",
                "training.lr=1e-4",
                "training.weight_decay=0.1",
                "training.grad_clip=0.5",
                "hardware=a100_80gb",
            ],
            4,
        ),
        (
            [
                "parallelism.engine=deepspeed",
                "parallelism.zero_stage=3",
                "parallelism.offload=params",
                "parallelism.precision=fp16",
                "parallelism.recompute=full",
                "parallelism.micro_batch_size=1",
                "parallelism.global_batch_size=16",
                "training.grad_clip=0",
            ],
            2,
        ),
    ],
)
def test_config_matches_hydra_field_by_field(overrides: list[str], dp: int) -> None:
    run = compose_run(*overrides)
    par, tr = run.parallelism, run.training
    cfg = deepspeed_config(run, dp=dp)

    assert cfg["train_batch_size"] == par.global_batch_size
    assert cfg["train_micro_batch_size_per_gpu"] == par.micro_batch_size
    # DeepSpeed checks train_batch_size == mbs x gas x world; the three must agree.
    assert cfg["gradient_accumulation_steps"] * par.micro_batch_size * dp == par.global_batch_size
    assert cfg["gradient_clipping"] == tr.grad_clip
    assert cfg["steps_per_print"] >= 10**6
    assert cfg["wall_clock_breakdown"] is False

    opt = cfg["optimizer"]
    assert opt["type"] == "AdamW"
    assert opt["params"]["lr"] == tr.lr
    assert opt["params"]["weight_decay"] == tr.weight_decay
    assert opt["params"]["betas"] == [0.9, 0.95]
    assert opt["params"]["eps"] == 1e-8
    cpu_without_offload = run.hardware.device_type == "cpu" and par.offload == "none"
    assert opt["params"].get("torch_adam", False) is cpu_without_offload

    zero = cfg["zero_optimization"]
    assert zero["stage"] == par.zero_stage
    assert ("offload_optimizer" in zero) == (par.offload in ("optimizer", "params"))
    assert ("offload_param" in zero) == (par.offload == "params")
    if par.zero_stage >= 1:
        # The buckets the memory model counts (train.planner.memory._gradient_bucket): their size, the
        # contiguous staging that allocates them, and their second one only with a GPU's overlap_comm.
        assert zero["reduce_bucket_size"] == MEGASWEEP_REDUCE_BUCKET and zero["contiguous_gradients"] is True
        assert zero["overlap_comm"] == (run.hardware.device_type == "cuda")
    for key in ("offload_optimizer", "offload_param"):
        if key in zero:
            assert zero[key]["device"] == "cpu"
            assert zero[key]["pin_memory"] == (run.hardware.device_type == "cuda")

    assert cfg["bf16"]["enabled"] == (par.precision == "bf16")
    assert cfg["fp16"]["enabled"] == (par.precision == "fp16")
    if par.precision == "fp16":
        assert cfg["fp16"]["loss_scale"] == 0  # dynamic
        assert cfg["fp16"]["initial_scale_power"] == 16
    # The recompute is the model's own for both engines; DeepSpeed's section adds nothing.
    assert not any(v for k, v in cfg["activation_checkpointing"].items() if k != "number_checkpoints")
    # JSON-serialisable as is.
    assert json.loads(json.dumps(cfg)) == cfg


def test_each_call_returns_a_fresh_dict() -> None:
    run = compose_run("parallelism.engine=deepspeed")
    first = deepspeed_config(run, dp=1)
    first["optimizer"]["params"]["lr"] = 123.0
    assert deepspeed_config(run, dp=1)["optimizer"]["params"]["lr"] == run.training.lr


@pytest.mark.parametrize(
    ("overrides", "dp", "match"),
    [
        (["parallelism.micro_batch_size=3", "parallelism.global_batch_size=8"], 1, "not a multiple"),
        (["parallelism.micro_batch_size=4", "parallelism.global_batch_size=8"], 3, "not a multiple"),
        (["parallelism.offload=optimizer", "parallelism.zero_stage=0"], 1, "offload=optimizer"),
        (["parallelism.offload=params", "parallelism.zero_stage=2"], 1, "offload=params"),
        (["parallelism.zero_stage=4"], 1, "zero_stage"),
    ],
)
def test_rejects_what_deepspeed_would_reject(overrides: list[str], dp: int, match: str) -> None:
    run = compose_run("parallelism.engine=deepspeed", *overrides)
    with pytest.raises(ValueError, match=match):
        deepspeed_config(run, dp=dp)


def test_writer_puts_json_beside_result(tmp_path: Path) -> None:
    run = compose_run("parallelism.engine=deepspeed", "parallelism.zero_stage=1")
    cfg = deepspeed_config(run, dp=2)
    path = write_deepspeed_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / DS_CONFIG_FILE
    assert json.loads(path.read_text()) == cfg


def test_adam_constants_equal_native_optimizer() -> None:
    from train import optim

    assert ds_config.ADAM_BETAS == optim.BETAS
    assert ds_config.ADAM_EPS == optim.EPS


def test_module_is_torch_free() -> None:
    code = "import sys, train.ds_config, train.planner.micro_batch, train.mbs_probe; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CONF_DIR.parent)
