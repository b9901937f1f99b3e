"""The training engine: what turns one step's micro-batches into one optimizer update.

The loop (train.loop) sees only this interface, so it has no engine branches:

    engine.step(batches, iteration=i) -> StepResult   forward/backward, reduce, clip, update
    engine.optimizer                                   whose param_groups carry the learning rate
    engine.checkpoint_state()                          what train.checkpoint saves and restores
    engine.model_states()                              the rank's model-state bytes, where countable

NativeEngine is megasweep's own torch.distributed code (train.loop.train_step over the parallel
state train.setup built: DP gradient reduction and ZeRO-1, DTensor TP, the pipeline schedule,
fp16 loss scaling). DeepSpeedEngine wraps DeepSpeed's engine (ZeRO 0-3, offload), which
normalizes, reduces, clips, scales and steps itself; it also runs DeepSpeed's flops profiler on
the iteration training.deepspeed_flops_profile asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from conf.schema import RunConfig
from train import memory
from train.planner import flops
from train.planner.layout import Layout

if TYPE_CHECKING:
    from train.setup import ParallelState
    from train.trainer import Progress

Batch = tuple[torch.Tensor, torch.Tensor]
"""(tokens [b, s], labels [b, s]) of one micro-batch."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports: the step's mean token loss, the gradient norm before
    clipping, the loss scale it ran at, and whether fp16 overflow skipped the update."""

    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool


class Engine(Protocol):
    """One optimizer step over a step's micro-batches, however the layout and the engine do it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def step(self, batches: Sequence[Batch], *, iteration: int) -> StepResult: ...

    def checkpoint_state(self) -> dict[str, Any]:
        """model, optimizer and scaler, as train.checkpoint.Checkpointer.save takes them."""
        ...

    def model_states(self) -> memory.ModelStates | None:
        """This rank's weights, gradients, optimizer states and master copies, counted from its
        tensors as they are now (after a step: Adam's states exist); None where the engine's
        tensors are its own to lay out (the record then says what was not measured)."""
        ...


@dataclass
class NativeEngine:
    """megasweep's own engine: train.loop.train_step on this rank's model and parallel state."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    state: ParallelState
    run: RunConfig
    device: torch.device

    def step(self, batches: Sequence[Batch], *, iteration: int) -> StepResult:
        from train.loop import train_step

        return train_step(
            self.model, self.optimizer, self.scaler, batches, run=self.run, device=self.device, state=self.state
        )

    def checkpoint_state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scaler": self.scaler}

    def model_states(self) -> memory.ModelStates | None:
        return memory.model_state_bytes(self.model, self.optimizer)


@dataclass
class DeepSpeedEngine:
    """DeepSpeed's engine (train.ds_engine); `model` is the DeepSpeedEngine itself."""

    model: Any
    optimizer: torch.optim.Optimizer
    state: ParallelState
    run: RunConfig
    layout: Layout
    progress: Progress
    """Where the profiled iteration's figures go (deepspeed_flops_profile)."""
    profile_at: int | None = None
    """The iteration to run under DeepSpeed's flops profiler (None: none)."""

    def step(self, batches: Sequence[Batch], *, iteration: int) -> StepResult:
        from train.ds_engine import deepspeed_train_step, profile_deepspeed_step

        # A batch ramp-up changes the micro-batches per step: DeepSpeed's accumulation follows.
        batch = len(batches) * self.run.parallelism.mbs * self.layout.dp
        if self.model.train_batch_size() != batch:
            self.model.set_train_batch_size(batch)
        if iteration != self.profile_at:
            return deepspeed_train_step(self.model, batches, loss_sum=self.state.loss_sum)
        figures, result = profile_deepspeed_step(self.model, batches, loss_sum=self.state.loss_sum)
        record = deepspeed_profile_record(asdict(figures), self.run, layout=self.layout)
        self.progress.deepspeed_flops_profile = {**record, "iteration": iteration}
        return result

    def checkpoint_state(self) -> dict[str, Any]:
        # The rules refuse training.save_interval > 0 with engine=deepspeed (`deepspeed_checkpoint`).
        raise NotImplementedError("engine=deepspeed does not checkpoint (rule deepspeed_checkpoint)")

    def model_states(self) -> memory.ModelStates | None:
        # ZeRO's flat partitions and offloaded states are DeepSpeed's own buffers, not the
        # parameters' tensors that train.memory counts (setup's memory_not_measured says so).
        return None


def deepspeed_profile_record(figures: dict[str, Any], run: RunConfig, *, layout: Layout) -> dict[str, Any]:
    """DeepSpeed's flops-profiler figures beside megasweep's per-GEMM model FLOPs for the same step.

    The profiler counts this rank's forwards only, so the comparable figure is 3 x forward x dp x tp
    (the backward as 2 forwards, all replicas, all TP shards: under TP a rank runs 1/tp of each
    sharded GEMM, while the replicated element-wise work it counts whole on every rank reads tp
    times over); `ratio_to_model_flops` is that over the model FLOPs of the iteration. Above 1
    means DeepSpeed counted work Megatron's GEMM count leaves out (element-wise ops, bias adds);
    below 1, GEMMs it does not see (README: why they disagree).
    """
    # The vocabulary padded for this run's TP, as the record's flops_per_iteration pads it.
    model_flops = flops.model_flops_per_iteration(
        run.model, global_batch_size=run.parallelism.global_batch_size, tp=layout.tp
    )
    comparable = 3 * figures["forward_flops"] * layout.dp * layout.tp
    return {
        **figures,
        "model_flops_per_iteration": model_flops,
        "model_forward_flops_per_rank": model_flops / 3 / layout.dp / layout.tp,
        "ratio_to_model_flops": comparable / model_flops if model_flops else None,
        "ratio_convention": "3 x forward_flops x dp x tp / model FLOPs per iteration (train.planner.flops)",
    }
