"""Tensor, pipeline and data parallelism, applied to a single-device model from outside.

Each function takes the model (or the optimizer) and the sub-mesh it needs, keyword-only; the
model code knows nothing about them and they find their targets by the module names that
train.model documents (layers.N.attn.qkv, ...). Order of application, as train.setup does it:

    model = build_model(cfg, device="meta")          # shapes only, no storage
    stage = split_for_pipeline(model, pp_mesh=...)   # this rank's layers (the whole model if pp=1)
    apply_tp(stage, tp_mesh=...)                     # shard the layers' matmuls over TP
    stage.to_empty(device=...); init.initialize(stage, ...)   # only now: this rank's shards
    sync = apply_dp(stage, dp_mesh=..., groups=..., zero=...)  # DP reduction overlapped with backward
    optimizer = apply_zero1(optimizer, sync=sync)    # ZeRO-1: Adam on this DP rank's slices

Both splits work on meta tensors and on real ones (a test splits a built model to compare).

Under TP the vocabulary is split too (Megatron's vocab-parallel embedding): each TP rank holds
padded_vocab / tp rows of the word embedding, looks up only the tokens in its range and the ranks
sum their lookups; the tied output layer computes the logits of those rows only, and the loss
(lm_loss_fn) is a cross-entropy whose max and sum-exp are all-reduced over TP, so the full logits
[b, s, V] never exist on any rank. BERT's decoder bias is split with the rows it belongs to.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from train.dp import DistributedOptimizer, GradSync, make_buckets
from train.init import ShardSpec, mark_shard
from train.model import IGNORE_INDEX, MaskedLMHead, TransformerLM, WordEmbedding, exclude_padding, lm_loss_sum
from train.planner.schedule import chunk_layers
from train.tensors import is_dtensor, local

_COLWISE = ("attn.qkv", "mlp.fc_in")
_ROWWISE = ("attn.proj", "mlp.fc_out")


def _group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    return None if mesh is None or mesh.size() == 1 else mesh.get_group()


# ---------------------------------------------------------------------------------------------
# Tensor parallelism.


def apply_tp(model: nn.Module, *, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Megatron's layer split: qkv and fc_in by output columns, proj and fc_out by input rows, so
    each layer needs one all-reduce forward (after proj / fc_out) and one backward.

    The qkv features are laid out per head, so a column split hands each rank whole heads and
    the attention code infers the local head count from the shard's width. The word embedding
    (and the tied output layer with it, and BERT's decoder bias) is split by vocabulary rows:
    use lm_loss_fn(model) for the loss of the logit slice the model then returns.

    With `sequence_parallel` (Korthikanti et al. 2022) the residual stream between the matmuls is
    [b, s / tp, h] on each rank: the LayerNorms (and BERT's head transform) run on this rank's
    tokens with replicated weights, each all-reduce becomes a reduce-scatter after proj / fc_out and
    an all-gather before qkv / fc_in, the summed embedding is cut to this rank's tokens before the
    first layer, and the output layer gathers the tokens back. A pipeline stage then sends and
    receives its sequence shard.
    """
    if tp_mesh.size() == 1:
        return
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # The sequence dimension of [b, s, h].
    seq = Shard(1)
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if name.endswith(_COLWISE + _ROWWISE) and isinstance(module, nn.Linear):
            if name.endswith(_COLWISE):
                plan[name] = ColwiseParallel(input_layouts=seq) if sequence_parallel else ColwiseParallel()
            else:
                plan[name] = RowwiseParallel(output_layouts=seq) if sequence_parallel else RowwiseParallel()
        elif sequence_parallel and (isinstance(module, nn.LayerNorm) or name.endswith("lm_head.dense")):
            # Per-token modules: their replicated weights' gradients, partial sums over this rank's
            # tokens, are summed over TP by DTensor.
            plan[name] = SequenceParallel()
        if name.endswith("attn.qkv") and isinstance(module, nn.Linear):
            head_dim = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "head_dim", 1)
            heads = module.out_features // (3 * head_dim)
            if heads % tp_mesh.size():
                raise ValueError(f"{heads} attention heads do not split over tp={tp_mesh.size()}")
    parallelize_module(model, tp_mesh, plan)
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()

    def shard(full: torch.Tensor, rows: int) -> torch.Tensor:
        # On the meta device (train.setup builds there) the slice is a shape; materialised, the rank
        # keeps its rows of the whole tensor. Either way, no communication.
        local = full.detach()[rank * rows : (rank + 1) * rows].clone()
        return DTensor.from_local(local, tp_mesh, [Shard(0)], run_check=False)

    _split_vocabulary(model, tp=tp, rank=rank, group=tp_mesh.get_group(), shard=shard)
    layers = getattr(model, "layers", None)
    if sequence_parallel and getattr(model, "wpe", None) is not None and layers:
        # The embeddings (word + position) are summed whole on every rank, as Megatron does; the
        # first layer takes this rank's tokens (no communication), and their gradient is gathered.
        def scatter_tokens(_: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            whole = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
            return (whole.redistribute(tp_mesh, [seq]).to_local(), *args[1:])

        next(iter(layers.values())).register_forward_pre_hook(scatter_tokens)


def apply_tp_plain(model: nn.Module, *, tp_group: dist.ProcessGroup) -> None:
    """apply_tp's split (the same layers, heads and vocabulary rows) with plain tensors and explicit
    collectives, as Megatron's own layers do it, for an engine that flattens and partitions the
    parameters itself and cannot take DTensors: DeepSpeed's ZeRO. Every sharded parameter is marked
    `tensor_model_parallel = True`, the attribute DeepSpeed (given train.ds_engine's mpu) reads to sum
    its gradient norm over TP and count replicated parameters once."""
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if tp == 1:
        return
    for name, module in list(model.named_modules()):
        if not (name.endswith(_COLWISE + _ROWWISE) and isinstance(module, nn.Linear)):
            continue
        if name.endswith("attn.qkv"):
            head_dim = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "head_dim", 1)
            heads = module.out_features // (3 * head_dim)
            if heads % tp:
                raise ValueError(f"{heads} attention heads do not split over tp={tp}")
        parent_name, _, attr = name.rpartition(".")
        layer: nn.Module = (
            ColumnParallelLinear(module, rank=rank, tp=tp, group=tp_group)
            if name.endswith(_COLWISE)
            else RowParallelLinear(module, rank=rank, tp=tp, group=tp_group)
        )
        setattr(model.get_submodule(parent_name), attr, layer)

    def shard(full: torch.Tensor, rows: int) -> torch.Tensor:
        return full.detach()[rank * rows : (rank + 1) * rows].clone()

    _split_vocabulary(model, tp=tp, rank=rank, group=tp_group, shard=shard)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            vocab = module.rows * tp
            mark_shard(module, "weight", ShardSpec((vocab, module.weight.shape[1]), 0, module.start))
        elif isinstance(module, MaskedLMHead):
            rows = module.bias.shape[0]
            mark_shard(module, "bias", ShardSpec((rows * tp,), 0, rank * rows))
    mark_tensor_parallel(model)


def mark_tensor_parallel(model: nn.Module) -> None:
    """Flag every TP-sharded plain tensor `tensor_model_parallel = True`, the attribute DeepSpeed (given
    train.ds_engine's mpu) reads to sum its gradient norm over TP and count replicated parameters
    once. Call again after `to_empty`, which replaces parameters (and drops their attributes)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            for p in module.parameters(recurse=False):
                p.tensor_model_parallel = True  # type: ignore[attr-defined]
        elif isinstance(module, RowParallelLinear):
            module.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
        elif isinstance(module, MaskedLMHead):
            module.bias.tensor_model_parallel = True  # type: ignore[attr-defined]


def _shard_param(
    module: nn.Module, attr: str, full: torch.Tensor, *, dim: int, rank: int, tp: int
) -> nn.Parameter:
    size = full.shape[dim] // tp
    mark_shard(module, attr, ShardSpec(tuple(full.shape), dim, rank * size))
    return nn.Parameter(full.detach().narrow(dim, rank * size, size).clone())


class ColumnParallelLinear(nn.Module):
    """This rank's output features of a Linear (weight rows and bias), on the replicated input."""

    def __init__(self, full: nn.Linear, *, rank: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        if full.out_features % tp:
            raise ValueError(f"{full.out_features} output features do not split over tp={tp}")
        self.weight = _shard_param(self, "weight", full.weight, dim=0, rank=rank, tp=tp)
        self.bias = None if full.bias is None else _shard_param(self, "bias", full.bias, dim=0, rank=rank, tp=tp)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_EnterTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of a Linear (weight columns), summed over TP; the bias, replicated,
    is added once after the sum."""

    def __init__(self, full: nn.Linear, *, rank: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        if full.in_features % tp:
            raise ValueError(f"{full.in_features} input features do not split over tp={tp}")
        self.weight = _shard_param(self, "weight", full.weight, dim=1, rank=rank, tp=tp)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _SumOverTP.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class _SumOverTP(torch.autograd.Function):
    """Forward: the sum of the TP ranks' partial results. Backward: the gradient unchanged, since
    every rank goes on with the same sum and so already holds the whole gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _EnterTP(torch.autograd.Function):
    """Forward: the replicated input unchanged. Backward: the sum of the ranks' gradients, each of
    which covers only that rank's share of the output (its vocabulary rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class VocabParallelEmbedding(nn.Module):
    """The word embedding's rows [start, start + rows) of the padded vocabulary, as a Shard(0)
    DTensor parameter named `weight` (so checkpoints, the optimizer and the gradient norm see a
    TP-sharded tensor under the model's own name), serving as embedding and tied output layer.
    Under apply_tp_plain the weight is the plain tensor of those rows."""

    def __init__(
        self, weight: torch.Tensor, *, start: int, group: dist.ProcessGroup, vocab_size: int | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start, self.rows = start, local(weight).shape[0]
        self.group = group
        self.vocab_size = start + self.rows if vocab_size is None else vocab_size
        """The real vocabulary: rows from it on are padding, whose logits are -inf."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = (tokens >= self.start) & (tokens < self.start + self.rows)
        # Tokens of other ranks look up row 0 and are zeroed, so their gradient is zero too.
        looked_up = F.embedding(torch.where(mine, tokens - self.start, 0), local(self.weight))
        return _SumOverTP.apply(looked_up.masked_fill(~mine.unsqueeze(-1), 0.0), self.group)

    def logits(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's slice of the logits, [b, s, rows] (a plain tensor: the pipeline schedule
        passes it to the loss as it is)."""
        if is_dtensor(x):
            # Sequence parallel: gather the tokens, whose gradients, each rank's share of the
            # vocabulary, are then reduce-scattered back to the tokens' ranks.
            from torch.distributed.tensor import Partial, Replicate

            whole = x.redistribute(x.device_mesh, [Replicate()])  # type: ignore[attr-defined]
            x = whole.to_local(grad_placements=[Partial()])
        else:
            x = _EnterTP.apply(x, self.group)
        weight = local(self.weight)
        # The padded rows' logits are -inf through the bias, so that the vocab-parallel max and sum
        # of exponentials leave them out (no logit-sized mask).
        bias = exclude_padding(
            None if bias is None else local(bias), rows=self.rows, real=self.vocab_size - self.start, like=weight
        )
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.rows - 1}, dim {self.weight.shape[1]}, vocab_size {self.vocab_size}"


def _split_vocabulary(
    model: nn.Module,
    *,
    tp: int,
    rank: int,
    group: dist.ProcessGroup,
    shard: Callable[[torch.Tensor, int], torch.Tensor],
) -> None:
    """Swap every WordEmbedding of `model` for this rank's VocabParallelEmbedding, and shard BERT's
    decoder bias with the same rows; shard(full, rows) makes this rank's tensor of `rows` rows."""
    for name, module in list(model.named_modules()):
        if isinstance(module, WordEmbedding):
            vocab = module.num_embeddings
            if vocab % tp:
                raise ValueError(
                    f"padded vocabulary {vocab} does not split over tp={tp}: build the model with "
                    f"tp={tp} (it pads to a multiple of make_vocab_size_divisible_by x tp)"
                )
            rows = vocab // tp
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(
                parent,
                name.rpartition(".")[2],
                VocabParallelEmbedding(
                    shard(module.weight, rows), start=rank * rows, group=group, vocab_size=module.vocab_size
                ),
            )
        elif isinstance(module, MaskedLMHead):
            module.bias = nn.Parameter(shard(module.bias, module.bias.shape[0] // tp))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of logits split by vocabulary over TP ranks: the max and the sum of
    exponentials are all-reduced (two small [N] reductions), never the [N, V] logits."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, start: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        mine = (labels >= start) & (labels < start + logits.shape[-1])
        index = torch.where(mine, labels - start, 0)
        target = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        both = torch.stack([target, exp.sum(dim=-1)])  # one all-reduce for both
        dist.all_reduce(both, group=group)
        target, sum_exp = both[0], both[1]
        labelled = labels != IGNORE_INDEX
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, labelled)
        return (sum_exp.log() - target).masked_fill(~labelled, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, mine, labelled = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, index.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        out.mul_((labelled.to(out.dtype) * grad).unsqueeze(-1))
        return out, None, None, None


def vocab_parallel_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, *, start: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """lm_loss_sum for a vocabulary slice of the logits (rows start.. of this TP rank); every TP
    rank returns the same, whole loss."""
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(
        logits.float().flatten(0, 1), labels.flatten(), start, group
    )
    return out


def lm_loss_fn(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The summed token cross-entropy for the logits `model` (after apply_tp or apply_tp_plain)
    returns: train.model.lm_loss_sum when they are whole, the vocab-parallel one when they are a slice."""
    wte = getattr(model, "wte", None)
    if not isinstance(wte, VocabParallelEmbedding):
        return lm_loss_sum
    start, group = wte.start, wte.group

    def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_loss_sum(logits, labels, start=start, group=group)

    return loss_sum


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism.


class PipelineStageModule(nn.Module):
    """One pipeline stage of a TransformerLM: some of its Blocks, plus the embeddings on the first
    stage and the final norm and tied output layer on the last, under the model's own names.

    The last stage holds its own copy of the word embedding for the output layer (initialised
    identically: train.init fills a parameter by its name, whichever stage holds it); the trainer
    all-reduces the two copies' gradients so they stay equal, as Megatron does.

    With `virtual_stages` v > 1 (the interleaved schedule, train.planner.schedule) the rank holds v
    chunks: chunk c is virtual stage c*pp + stage. All of them are registered in one `layers` dict
    (chunk by chunk), so DP, the optimizer, clipping and checkpoints see one module as for v = 1;
    forward(x, chunk=c) runs one chunk, the embeddings before chunk 0 of the first rank and the
    head after chunk v-1 of the last.
    """

    def __init__(self, model: TransformerLM, *, stage: int, num_stages: int, virtual_stages: int = 1) -> None:
        super().__init__()
        self.stage, self.num_stages, self.virtual_stages = stage, num_stages, virtual_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        chunks = [
            [str(i) for i in chunk_layers(len(model.layers), rank=stage, chunk=c, pp=num_stages, virtual_stages=virtual_stages)]
            for c in range(virtual_stages)
        ]
        self.chunk_layers: tuple[tuple[str, ...], ...] = tuple(tuple(c) for c in chunks)
        """Each chunk's layer names (keys of `layers`), in order."""
        self.layers = nn.ModuleDict({i: model.layers[i] for c in chunks for i in c})
        self.wte = model.wte if self.is_first or self.is_last else None
        self.wpe = model.wpe if self.is_first else None
        self.norm = model.norm if self.is_last else None
        self.lm_head: MaskedLMHead | None = model.lm_head if self.is_last else None

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        if self.is_first and chunk == 0:
            assert self.wte is not None and self.wpe is not None
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for name in self.chunk_layers[chunk]:
            x = self.layers[name](x)
        if not (self.is_last and chunk == self.virtual_stages - 1):
            return x
        assert self.norm is not None and self.wte is not None
        x = self.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x, self.wte)
        return self.wte.logits(x)

    def tied_copy(self) -> torch.Tensor | None:
        """The output layer's copy of the word embedding, on a last stage that is not also first."""
        return self.wte.weight if self.is_last and not self.is_first and self.wte is not None else None


def split_for_pipeline(model: TransformerLM, *, pp_mesh: DeviceMesh, virtual_stages: int = 1) -> PipelineStageModule:
    """This rank's stage of `model` (all of it when pp = 1), in `virtual_stages` chunks."""
    return PipelineStageModule(
        model, stage=pp_mesh.get_local_rank(), num_stages=pp_mesh.size(), virtual_stages=virtual_stages
    )


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
    dist.all_reduce(local(weight.grad), group=group)


# ---------------------------------------------------------------------------------------------
# Data parallelism and ZeRO-1 (train.dp does the work).


def apply_dp(
    model: nn.Module, *, dp_mesh: DeviceMesh, groups: Sequence[tuple[Sequence[nn.Parameter], float]], zero: bool
) -> GradSync:
    """The gradient reduction of `model`'s replicas over DP, overlapped with backward: all-reduce, or
    with `zero` (ZeRO-1) reduce-scatter into this rank's slices. `groups` are the optimizer's
    (parameters, weight decay) groups, which buckets do not mix. A no-op when dp = 1."""
    # The word embedding on a pipeline's first and last stage: its copies are summed across the
    # stages first (tie_embedding_grads), so it is reduced last.
    tied: list[nn.Parameter] = []
    if isinstance(model, PipelineStageModule) and model.num_stages > 1 and model.wte is not None:
        tied.append(model.wte.weight)  # type: ignore[arg-type]  # a Parameter, typed as a Tensor
    group = _group(dp_mesh)
    return GradSync(
        make_buckets(groups, dp=dp_mesh.size(), deferred=tied),
        group=group,
        size=dp_mesh.size(),
        rank=dp_mesh.get_local_rank(),
        shard=zero and group is not None,
    )


def apply_zero1(optimizer: torch.optim.Optimizer, *, sync: GradSync) -> torch.optim.Optimizer:
    """ZeRO-1 over `sync`'s buckets: Adam on this DP rank's slices, an optimizer of the same class and
    settings as `optimizer` (unchanged when dp = 1)."""
    if not sync.shard:
        return optimizer
    cls = type(optimizer)
    # The constructor's own keywords: `defaults` also holds settings a subclass fixes (AdamW's
    # decoupled_weight_decay), which its constructor does not take.
    accepted = inspect.signature(cls.__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    zero = DistributedOptimizer(sync, make_inner=lambda groups: cls(groups, **settings))
    sync.zero = zero
    return zero


def separate_dtensor_groups(optimizer: torch.optim.Optimizer) -> None:
    """Split every param group into its DTensor (TP-sharded) and plain parameters, in place.

    torch's fused and foreach Adam kernels take one tensor list per group and refuse a mix of
    DTensors and plain tensors; the hyperparameters of both halves stay those of the group.
    Call before the first step (no optimizer state exists yet).
    """
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        sharded = [p for p in group["params"] if is_dtensor(p)]
        plain = [p for p in group["params"] if not is_dtensor(p)]
        groups.extend({**group, "params": params} for params in (sharded, plain) if params)
    optimizer.param_groups[:] = groups


# ---------------------------------------------------------------------------------------------
# fp16 loss scaling over every layout.


class GlobalGradScaler(torch.amp.GradScaler):
    """torch's dynamic loss scaler, for any layout: it unscales TP-sharded (DTensor) gradients by
    their local shards and makes the inf/NaN decision the OR over `group` (default: the whole
    world), so every rank skips the same steps and keeps the same loss scale.

    Each TP rank and pipeline stage checks only the gradients it holds; if one rank skipped its
    update and another did not, the model's shards would drift apart and the scales diverge
    (Megatron all-reduces the same flag). Only the gradient walk is replaced (torch's kernel would
    refuse DTensors beside its plain found-inf flag); scale(), step(), update() and the state dict
    are GradScaler's own. Every rank must unscale (a collective) at every step.
    """

    def __init__(
        self, device: str = "cuda", *, enabled: bool = True, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(device, enabled=enabled)
        self.group = group

    def _unscale_grads_(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = local(param.grad)
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    by_dtype.setdefault(grad.dtype, []).append(grad)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        return {found_inf.device: found_inf}
