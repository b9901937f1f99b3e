"""Cross-check of train.planner.flops against the FLOPs PyTorch itself counts for one training step.

train.planner.flops is arithmetic on a list of GEMM shapes; a wrong shape there (a missing head GEMM, a
forgotten backward) would silently skew every MFU figure. This module runs one micro-batch's
forward and backward of the run's model under torch.utils.flop_counter.FlopCounterMode and scales
it to the optimizer step (x micro-batches of the whole global batch).

Two details make the comparison meaningful:

- FlopCounterMode counts CPU scaled_dot_product_attention as 0 FLOPs, so the model is built with
  the explicit matmul attention (same shapes, same GEMMs; train.model's `attention="explicit"`).
- torch's non-reentrant checkpoint stops recomputing as soon as every saved tensor the backward
  needs is back ("early stop", its default, which the trainer uses). The last GEMM of each
  checkpointed region (mlp_out for `full`, attention-over-values for `selective`) is then never
  re-run, so the device executes fewer FLOPs than train.planner.flops.hardware_flops_per_iteration
  (Megatron's convention: the whole region is re-run) says. `early_stop=False` re-runs the whole
  region and matches that convention; `skipped_recompute_flops` quantifies the difference.

Enabled in the trainer by `training.flop_check=true`; the result goes into the record under
`flop_check`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from conf.schema import Recompute, RunConfig
from train.data import get_batch, make_source
from train.model import build_model, lm_loss_sum
from train.planner import flops

TOLERANCE = 0.01
"""Relative disagreement above which the trainer adds a warning to the record."""

# The GEMM that ends each checkpointed region: its output is not saved for backward, so an
# early-stopping recompute never re-runs it.
_LAST_GEMM_OF_REGION = {Recompute.none: None, Recompute.selective: "attn_values", Recompute.full: "mlp_out"}


@dataclass(frozen=True)
class FlopCheck:
    """Counted vs. modelled FLOPs of one optimizer step (whole global batch, all devices together)."""

    counted_per_micro_batch: int
    micro_batches: int
    """Micro-batches in the global batch (global_batch_size / micro_batch_size, over all DP ranks)."""
    counted_per_iteration: float
    model_flops_per_iteration: float
    hardware_flops_per_iteration: float
    skipped_recompute_flops: float
    """Recompute FLOPs train.planner.flops counts that an early-stopping checkpoint does not run (0 without)."""
    recompute: str
    checkpoint_early_stop: bool

    @property
    def expected(self) -> float:
        """What train.planner.flops predicts this step executes, given how the checkpoint recomputes."""
        skipped = self.skipped_recompute_flops if self.checkpoint_early_stop else 0.0
        return self.hardware_flops_per_iteration - skipped

    @property
    def relative_error(self) -> float:
        """counted / expected - 1."""
        return self.counted_per_iteration / self.expected - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "expected": self.expected, "relative_error": self.relative_error}


def count_step_flops(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> int:
    """FLOPs FlopCounterMode sees in one forward + backward of `model` on one micro-batch."""
    counter = FlopCounterMode(display=False)
    with counter:
        lm_loss_sum(model(tokens), labels).backward()
    return int(counter.get_total_flops())


def skipped_recompute_flops(run: RunConfig) -> float:
    """Forward FLOPs of the last GEMM of every checkpointed region over one step (see module doc)."""
    name = _LAST_GEMM_OF_REGION[Recompute(run.parallelism.recompute)]
    if name is None:
        return 0.0
    gemms = flops.layer_gemms(run.model, micro_batch_size=run.parallelism.global_batch_size)
    return float(run.model.num_layers * sum(g.flops for g in gemms if g.name == name))


def flop_check(run: RunConfig, *, device: torch.device | str = "cpu", early_stop: bool = True) -> FlopCheck:
    """Count one micro-batch of `run`'s model (explicit attention, the run's recompute) and compare.

    The model is a fresh build, not the training one, so the check cannot change training: the
    RNG state is restored afterwards and the training model's gradients are untouched. It costs
    one extra model (and one micro-batch of activations) on `device` for the duration of the check.
    """
    par, device = run.parallelism, torch.device(device)
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(run.training.seed)
        model = build_model(run.model, recompute=par.recompute, attention="explicit", device=device)
        tr = run.training
        source = make_source(run.model, seed=tr.seed, data_path=tr.data_path, data_dtype=tr.data_dtype)
        tokens, labels = get_batch(
            source, run.model, indices=range(par.mbs), seed=run.training.seed, device=device
        )
        with set_checkpoint_early_stop(early_stop):
            counted = count_step_flops(model, tokens, labels)
    micro_batches = par.global_batch_size // par.mbs
    gbs = par.global_batch_size
    return FlopCheck(
        counted_per_micro_batch=counted,
        micro_batches=micro_batches,
        counted_per_iteration=float(counted * micro_batches),
        model_flops_per_iteration=flops.model_flops_per_iteration(run.model, global_batch_size=gbs),
        hardware_flops_per_iteration=flops.hardware_flops_per_iteration(
            run.model, global_batch_size=gbs, recompute=par.recompute
        ),
        skipped_recompute_flops=skipped_recompute_flops(run),
        recompute=Recompute(par.recompute).value,
        checkpoint_early_stop=early_stop,
    )


def format_flop_check(check: FlopCheck) -> str:
    """One log line."""
    return (
        f"FLOPs check ({check.recompute} recompute): counted {check.counted_per_iteration:.4g} per iteration "
        f"vs. train.planner.flops {check.expected:.4g} ({check.relative_error:+.2%}); model FLOPs "
        f"{check.model_flops_per_iteration:.4g}, hardware {check.hardware_flops_per_iteration:.4g}"
    )
