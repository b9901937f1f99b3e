"""Adam implementation choice and the learning-rate schedule.

Which Adam runs changes both speed and memory (BLOOM's notes: apex FusedAdam used 10 GB less
than torch.optim.Adam on the first node of a 200B run), so the implementation that actually
ran is returned by name and recorded with every result. apex is optional and detected at
run time; it is never a dependency.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from conf.schema import OptimizerImpl

APEX = "apex.FusedAdam"
TORCH_FUSED = "torch.AdamW(fused)"
TORCH_FOREACH = "torch.AdamW(foreach)"

BETAS = (0.9, 0.95)
EPS = 1e-8


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Decay matrices only: biases, LayerNorm parameters and BERT's decoder bias (all 1-D) are not
    decayed, as in Megatron-LM and GPT-2."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _apex_fused_adam() -> type | None:
    try:
        return importlib.import_module("apex.optimizers").FusedAdam  # type: ignore[no-any-return]
    except Exception:  # ImportError, or a broken apex build that fails on import
        return None


def build_optimizer(
    model: nn.Module,
    *,
    impl: OptimizerImpl | str,
    lr: float,
    weight_decay: float,
    device_type: str,
) -> tuple[torch.optim.Optimizer, str]:
    """(optimizer, implementation name) for `impl`.

    auto: apex FusedAdam when importable and on GPU, else torch's fused AdamW, else foreach.
    An explicit choice that cannot be honoured raises instead of silently running another
    implementation, since the run's figures would then describe the wrong thing.
    """
    impl = OptimizerImpl(impl)
    groups = param_groups(model, weight_decay)
    if impl in (OptimizerImpl.auto, OptimizerImpl.apex):
        fused_adam = _apex_fused_adam() if device_type == "cuda" else None
        if fused_adam is not None:
            return fused_adam(groups, lr=lr, betas=BETAS, eps=EPS, adam_w_mode=True), APEX
        if impl == OptimizerImpl.apex:
            where = "importable" if device_type == "cuda" else "usable on a CPU run"
            raise ValueError(
                f"parallelism.optimizer=apex but apex FusedAdam is not {where}; use auto or torch_fused"
            )
    if impl in (OptimizerImpl.auto, OptimizerImpl.torch_fused):
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, fused=True), TORCH_FUSED
        except (RuntimeError, ValueError):
            if impl == OptimizerImpl.torch_fused:
                raise
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, foreach=True), TORCH_FOREACH


def lr_at(
    iteration: int, *, peak: float, warmup_iters: int, total_iters: int, min_ratio: float = 0.1
) -> float:
    """Learning rate of 1-based `iteration`: linear warm-up to `peak`, then cosine decay to
    min_ratio x peak at `total_iters`."""
    if warmup_iters > 0 and iteration <= warmup_iters:
        return peak * iteration / warmup_iters
    decay_iters = max(total_iters - warmup_iters, 1)
    progress = min(max(iteration - warmup_iters - 1, 0) / decay_iters, 1.0)
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
