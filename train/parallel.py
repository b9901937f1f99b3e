"""Tensor, pipeline and data parallelism, applied to a built single-device model from outside.

Each function takes the model (or the optimizer) and the sub-mesh it needs, keyword-only; the
model code knows nothing about them and they find their targets by the module names that
train.model documents (layers.N.attn.qkv, ...). Order of application, as the trainer does it:

    stage = split_for_pipeline(model, pp_mesh=...)   # this rank's layers (the whole model if pp=1)
    apply_tp(stage, tp_mesh=...)                     # shard the layers' matmuls over TP
    dp = apply_dp(stage, dp_mesh=...)                # gradient all-reduce over DP
    optimizer = apply_zero1(optimizer, dp_mesh=...)  # ZeRO-1: shard Adam states over DP

Vocabulary parallelism is not done: the word embedding and the logits stay replicated on every
TP rank (each TP rank computes the full logits and the same loss). That costs V x h memory and
the logits GEMM on every TP rank; the layers, where the FLOPs are, are split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from train.model import MaskedLMHead, TransformerLM

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce: large enough to amortise the per-call latency, small enough
not to double peak memory with one flat copy of all gradients (DDP's default size)."""

_COLWISE = ("attn.qkv", "mlp.fc_in")
_ROWWISE = ("attn.proj", "mlp.fc_out")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's shard, a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    return None if mesh is None or mesh.size() == 1 else mesh.get_group()


# ---------------------------------------------------------------------------------------------
# Tensor parallelism.


def apply_tp(model: nn.Module, *, tp_mesh: DeviceMesh) -> None:
    """Megatron's layer split: qkv and fc_in by output columns, proj and fc_out by input rows, so
    each layer needs one all-reduce forward (after proj / fc_out) and one backward.

    The qkv features are laid out per head, so a column split hands each rank whole heads and
    the attention code infers the local head count from the shard's width.
    """
    if tp_mesh.size() == 1:
        return
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if name.endswith(_COLWISE + _ROWWISE) and isinstance(module, nn.Linear):
            plan[name] = ColwiseParallel() if name.endswith(_COLWISE) else RowwiseParallel()
        if name.endswith("attn.qkv") and isinstance(module, nn.Linear):
            head_dim = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "head_dim", 1)
            heads = module.out_features // (3 * head_dim)
            if heads % tp_mesh.size():
                raise ValueError(f"{heads} attention heads do not split over tp={tp_mesh.size()}")
    parallelize_module(model, tp_mesh, plan)


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism.


def stage_layers(num_layers: int, *, stage: int, num_stages: int) -> range:
    """Layer indices of one stage: an even split, the remainder (if any) on the first stages."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class PipelineStageModule(nn.Module):
    """One pipeline stage of a TransformerLM: some of its Blocks, plus the embeddings on the first
    stage and the final norm and tied output layer on the last, under the model's own names.

    The last stage holds its own copy of the word embedding for the output layer (initialised
    identically: every rank builds the whole model from the same seed); the trainer all-reduces
    the two copies' gradients so they stay equal, as Megatron does.
    """

    def __init__(self, model: TransformerLM, *, stage: int, num_stages: int) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        keep = stage_layers(len(model.layers), stage=stage, num_stages=num_stages)
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in keep})
        self.wte = model.wte if self.is_first or self.is_last else None
        self.wpe = model.wpe if self.is_first else None
        self.norm = model.norm if self.is_last else None
        self.lm_head: MaskedLMHead | None = model.lm_head if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            assert self.wte is not None and self.wpe is not None
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():
            x = layer(x)
        if not self.is_last:
            return x
        assert self.norm is not None and self.wte is not None
        x = self.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x, self.wte.weight)
        return F.linear(x, self.wte.weight)

    def tied_copy(self) -> torch.Tensor | None:
        """The output layer's copy of the word embedding, on a last stage that is not also first."""
        return self.wte.weight if self.is_last and not self.is_first and self.wte is not None else None


def split_for_pipeline(model: TransformerLM, *, pp_mesh: DeviceMesh) -> PipelineStageModule:
    """This rank's stage of `model` (all of it when pp = 1)."""
    return PipelineStageModule(model, stage=pp_mesh.get_local_rank(), num_stages=pp_mesh.size())


def build_schedule(
    stage_module: PipelineStageModule,
    *,
    pp_mesh: DeviceMesh,
    n_microbatches: int,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Schedule1F1B:
    """1F1B over the step's micro-batches. `loss_fn` already divides by the step's token count,
    so the schedule must not also divide the gradients by the number of micro-batches."""
    if n_microbatches < pp_mesh.size():
        raise ValueError(
            f"{n_microbatches} micro-batches per step cannot fill {pp_mesh.size()} pipeline stages; "
            "raise global_batch_size or lower micro_batch_size"
        )
    stage = PipelineStage(
        stage_module, stage_module.stage, stage_module.num_stages, device, group=pp_mesh.get_group()
    )
    return Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)


def embedding_tie_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The two-rank group (first stage, last stage) of this rank's (dp, tp) position; None when
    pp = 1 or this rank is on a middle stage. Every rank must call this (new_group is collective)."""
    ranks = mesh.mesh  # [pp, dp, tp] global ranks
    pp = ranks.shape[0]
    if pp == 1:
        return None
    mine = None
    me = dist.get_rank()
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [int(ranks[0, d, t]), int(ranks[pp - 1, d, t])]
            group = dist.new_group(pair)
            if me in pair:
                mine = group
    return mine


def tie_embedding_grads(stage_module: PipelineStageModule, *, group: dist.ProcessGroup | None) -> None:
    """Sum the word embedding's gradient over its two copies (input embedding, output layer)."""
    if group is None or stage_module.wte is None:
        return
    weight = stage_module.wte.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(_local(weight.grad), group=group)


# ---------------------------------------------------------------------------------------------
# Data parallelism and ZeRO-1.


@dataclass(frozen=True)
class DataParallel:
    """Gradient all-reduce over the DP group, once per step after the last micro-batch.

    Why not torch DDP: DDP cannot wrap DTensor (TP-sharded) parameters, and under pipelining the
    schedule, not DDP's forward, drives backward; one explicit, bucketed all-reduce after the
    step's backward is correct for every layout and trivially has no sync between micro-batches.
    The cost is no overlap of the reduction with backward (DDP's main speed-up), which is the
    next step for dp-heavy layouts. Gradients are SUMMED, not averaged: the loss is already
    divided by the global batch's token count.
    """

    group: dist.ProcessGroup | None
    size: int

    def sync_grads(self, params: Iterable[nn.Parameter]) -> None:
        if self.group is None:
            return
        grads = []
        for p in params:
            if p.grad is None:  # a parameter unused on this rank still joins the collective
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        for bucket in _buckets(grads, BUCKET_BYTES):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.group)
            for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                grad.copy_(synced)


def apply_dp(model: nn.Module, *, dp_mesh: DeviceMesh) -> DataParallel:
    """The gradient synchroniser of `model`'s replicas (no-op when dp = 1)."""
    del model  # all state is in the gradients; kept in the signature for symmetry with apply_tp
    return DataParallel(group=_group(dp_mesh), size=dp_mesh.size())


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if not out or size + t.numel() * t.element_size() > limit or out[-1][0].dtype != t.dtype:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel() * t.element_size()
    return out


def partition_params(sizes: Sequence[int], parts: int) -> list[int]:
    """Owner (0..parts-1) of each parameter: greedy largest-first onto the least loaded part, so
    every DP rank holds about 1/parts of the optimizer states. Deterministic on every rank."""
    load = [0] * parts
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(parts), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ZeroOneOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 ('distributed optimizer'): each DP rank keeps Adam states for, and updates, only
    the parameters it owns, then broadcasts them to the other replicas.

    Its param_groups list every parameter, so the loss scaler unscales all gradients and the
    learning-rate schedule reaches the inner optimizer; the inner optimizer (Adam states are
    created lazily at its first step) sees only the owned ones.
    """

    def __init__(self, inner: torch.optim.Optimizer, *, dp_mesh: DeviceMesh) -> None:
        groups = [{**g, "params": list(g["params"])} for g in inner.param_groups]
        super().__init__(groups, dict(inner.defaults))
        self.inner = inner
        self.group = _group(dp_mesh)
        self.dp_rank = dp_mesh.get_local_rank()
        self.params = [p for g in groups for p in g["params"]]
        self.owner = partition_params([_local(p).numel() for p in self.params], dp_mesh.size())
        mine = {id(p) for p, o in zip(self.params, self.owner, strict=True) if o == self.dp_rank}
        for g in inner.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in mine]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner["lr"], inner["weight_decay"] = outer["lr"], outer["weight_decay"]
        self.inner.step()
        if self.group is None:
            return
        for src in range(dist.get_world_size(self.group)):
            owned = [_local(p) for p, o in zip(self.params, self.owner, strict=True) if o == src]
            for bucket in _buckets(owned, BUCKET_BYTES):
                flat = _flatten_dense_tensors(bucket)
                dist.broadcast(flat, group=self.group, group_src=src)
                if src != self.dp_rank:
                    for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                        t.copy_(synced)


def apply_zero1(optimizer: torch.optim.Optimizer, *, dp_mesh: DeviceMesh) -> torch.optim.Optimizer:
    """`optimizer` with its states sharded over DP (unchanged when dp = 1)."""
    return optimizer if dp_mesh.size() == 1 else ZeroOneOptimizer(optimizer, dp_mesh=dp_mesh)


def separate_dtensor_groups(optimizer: torch.optim.Optimizer) -> None:
    """Split every param group into its DTensor (TP-sharded) and plain parameters, in place.

    torch's fused and foreach Adam kernels take one tensor list per group and refuse a mix of
    DTensors and plain tensors; the hyperparameters of both halves stay those of the group.
    Call before the first step (no optimizer state exists yet).
    """
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        sharded = [p for p in group["params"] if isinstance(p, DTensor)]
        plain = [p for p in group["params"] if not isinstance(p, DTensor)]
        groups.extend({**group, "params": params} for params in (sharded, plain) if params)
    optimizer.param_groups[:] = groups


# ---------------------------------------------------------------------------------------------
# Gradient norm over every layout.


def clip_grad_norm(
    params: Iterable[nn.Parameter],
    *,
    max_norm: float,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    exclude: torch.Tensor | None = None,
) -> float:
    """Global L2 norm of the model's gradients, then scale them to at most `max_norm` (as
    torch.nn.utils.clip_grad_norm_). TP shards are summed over TP, replicated tensors counted
    once; stages are summed over PP; `exclude` (the last stage's tied embedding copy) is skipped
    in the norm because its twin on the first stage is already counted. Call after the DP sync:
    then every DP replica holds the same gradients and the same norm."""
    grads = [(p, p.grad) for p in params if p.grad is not None]
    ref = next((_local(g) for _, g in grads), torch.zeros(()))
    sharded = torch.zeros((), device=ref.device, dtype=torch.float32)
    replicated = torch.zeros((), device=ref.device, dtype=torch.float32)
    for p, g in grads:
        if p is exclude:
            continue
        sq = _local(g).float().pow(2).sum()
        if isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements):
            sharded += sq
        else:
            replicated += sq
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0 and math.isfinite(norm):
        for _, g in grads:
            _local(g).mul_(coef)
    return norm
