"""The DeepSpeed config of a run, derived from its Hydra config (the one source of truth).

`parallelism.engine=deepspeed` never reads a hand-written ds_config.json: every DeepSpeed
setting that has a counterpart in RunConfig is computed from it here, so a sweep over
zero_stage / offload / precision / batch sizes changes the DeepSpeed run exactly as it changes
the native one, and the JSON written beside result.json records what DeepSpeed was told.

Mapping (RunConfig field -> DeepSpeed key):

    parallelism.global_batch_size     train_batch_size
    parallelism.micro_batch_size      train_micro_batch_size_per_gpu
    gbs / (mbs x dp)                  gradient_accumulation_steps (whole: rule global_batch_divisible)
    parallelism.zero_stage            zero_optimization.stage
    parallelism.offload=optimizer     zero_optimization.offload_optimizer.device = cpu
                                      (DeepSpeed then steps with its DeepSpeedCPUAdam)
    parallelism.offload=params        the above + zero_optimization.offload_param.device = cpu
                                      (ZeRO-3 only, as train.planner.rules requires)
    parallelism.precision             bf16.enabled / fp16.enabled (fp16 with dynamic loss
                                      scaling: loss_scale 0); fp32 enables neither
    parallelism.recompute             not DeepSpeed's: train.model.set_recompute for both engines;
                                      activation_checkpointing is written all off (see there)
    training.grad_clip                gradient_clipping (0 disables, in both)
    training.lr / weight_decay        optimizer.params (AdamW, betas and eps of train.optim)

Torch-free: the launcher writes the config on login nodes, and tests check it without DeepSpeed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from conf.schema import Offload, Precision, RunConfig
from train.contract import DS_CONFIG_FILE, write_json_atomic
from train.planner.layout import Layout
from train.planner.memory import MEGASWEEP_REDUCE_BUCKET
from train.planner.rules import InfeasibleConfig, validate

# train.optim's AdamW constants; repeated (not imported) because train.optim imports torch.
# tests/train/test_ds_config.py checks that they stay equal.
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8

# DeepSpeed prints a progress line every steps_per_print steps; the trainer prints its own line,
# so DeepSpeed's is pushed beyond any real run.
STEPS_PER_PRINT = 10**9

# fp16 dynamic loss scaling, as Megatron-LM's defaults: start at 2^16, halve on overflow, double
# after 1000 clean steps, tolerate 2 overflows before lowering (hysteresis).
FP16_INITIAL_SCALE_POWER = 16
FP16_LOSS_SCALE_WINDOW = 1000
FP16_HYSTERESIS = 2
FP16_MIN_LOSS_SCALE = 1

# Communication bucket sizes (elements). DeepSpeed's defaults are 5e8, sized for multi-GPU nodes;
# 5e7 keeps the staging buffers (2 or 4 bytes per element each) small next to a benchmark model
# on one accelerator and on a CPU test, at no measurable cost for the sizes swept here. The memory
# model counts the reduce bucket (train.planner.memory._gradient_bucket), so it is defined there.
REDUCE_BUCKET_SIZE = MEGASWEEP_REDUCE_BUCKET
ALLGATHER_BUCKET_SIZE = 50_000_000
STAGE3_PREFETCH_BUCKET_SIZE = 50_000_000
STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000


RELIES_ON = ("positive", "global_batch_divisible", "zero_stage", "offload_requires_zero")
"""The rules (train.planner.rules) whose breach DeepSpeed would reject or silently change: a global
batch that is not a whole number of micro-batches per replica, a ZeRO stage outside 0-3, offload
without the stage it needs."""


def deepspeed_config(run: RunConfig, *, dp: int) -> dict[str, Any]:
    """The DeepSpeed config dict of `run` on `dp` data-parallel replicas (a new dict each call).

    Raises InfeasibleConfig (a ValueError) naming the RELIES_ON rules the run breaks. `python -m
    train` has refused such a run before any worker started; the judge is asked again here, not
    restated, for callers that did not go through it.
    """
    par, tr = run.parallelism, run.training
    on_replicas = dataclasses.replace(run, parallelism=dataclasses.replace(par, dp=dp))
    broken = [v for v in validate(on_replicas) if v.rule in RELIES_ON]
    if broken:
        raise InfeasibleConfig(broken)
    gas = Layout(dp=dp, tp=par.tp, pp=par.pp).micro_batches(par.global_batch_size, par.mbs)
    precision, offload = Precision(par.precision), Offload(par.offload)
    cpu = run.hardware.device_type == "cpu"

    optimizer_params: dict[str, Any] = {
        "lr": tr.lr,
        "betas": list(ADAM_BETAS),
        "eps": ADAM_EPS,
        "weight_decay": tr.weight_decay,
    }
    if cpu and offload == Offload.none:
        # DeepSpeed's default AdamW is its FusedAdam, a CUDA kernel; on CPU (tests, the cpu
        # hardware config) torch's AdamW does the same arithmetic without building an op.
        optimizer_params["torch_adam"] = True

    return {
        "train_batch_size": par.global_batch_size,
        "train_micro_batch_size_per_gpu": par.mbs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": float(tr.grad_clip),
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "zero_optimization": _zero_optimization(par.zero_stage, offload, pin_memory=not cpu),
        "bf16": {"enabled": precision == Precision.bf16},
        "fp16": _fp16(enabled=precision == Precision.fp16),
        "activation_checkpointing": _activation_checkpointing(),
    }


def write_deepspeed_config(config: dict[str, Any], output_dir: str | Path) -> Path:
    """Write `config` as <output_dir>/deepspeed_config.json (atomically); return its path."""
    path = Path(output_dir) / DS_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, config)
    return path


def _zero_optimization(stage: int, offload: Offload, *, pin_memory: bool) -> dict[str, Any]:
    # Rules zero_stage and offload_requires_zero hold (deepspeed_config checked them).
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update(
            # One flat gradient buffer: fewer, larger reductions and no fragmentation.
            contiguous_gradients=True,
            # Overlap needs a second stream to pay off; on CPU it only adds buffers.
            overlap_comm=pin_memory,
            reduce_bucket_size=REDUCE_BUCKET_SIZE,
            reduce_scatter=True,
        )
    if stage in (1, 2):
        zero["allgather_bucket_size"] = ALLGATHER_BUCKET_SIZE
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = STAGE3_PREFETCH_BUCKET_SIZE
        zero["stage3_param_persistence_threshold"] = STAGE3_PARAM_PERSISTENCE_THRESHOLD
    if offload in (Offload.optimizer, Offload.params):
        # pin_memory speeds host<->GPU copies; on a CPU run there is no copy to speed up.
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload == Offload.params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return zero


def _fp16(*, enabled: bool) -> dict[str, Any]:
    if not enabled:
        return {"enabled": False}
    return {
        "enabled": True,
        "loss_scale": 0,  # 0 = dynamic
        "initial_scale_power": FP16_INITIAL_SCALE_POWER,
        "loss_scale_window": FP16_LOSS_SCALE_WINDOW,
        "hysteresis": FP16_HYSTERESIS,
        "min_loss_scale": FP16_MIN_LOSS_SCALE,
    }


def _activation_checkpointing() -> dict[str, Any]:
    """DeepSpeed's activation-checkpointing section: every option off, whatever the recompute.

    The recompute itself is train.model.set_recompute (torch.utils.checkpoint around each Block,
    or around the attention core), the same code for both engines so that their memory and
    FLOPs compare like for like. DeepSpeed's section configures only its own
    deepspeed.checkpointing.checkpoint, which megasweep's model does not call; its options
    (partitioning checkpoints over TP ranks, keeping them on the CPU, one contiguous buffer)
    would change memory in ways train.planner.memory does not model, so they are written explicitly
    off and the record says plainly that DeepSpeed added nothing on top.
    """
    return {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }
