"""Data parallelism: gradient reduction overlapped with backward, and ZeRO-1 with reduce-scatter.

`GradSync` groups a replica's parameters into buckets (reverse registration order, about the order
backward produces their gradients; one weight-decay group and dtype per bucket, at most
BUCKET_BYTES). A hook on each parameter counts the gradients accumulated into it; when every
parameter of a bucket has its last micro-batch's gradient, the bucket's reduction is launched
asynchronously while backward goes on, as DDP and Megatron do. Gradients are SUMMED over the
replicas (the loss is already divided by the global batch's token count).

* dp without ZeRO: each bucket is flattened and all-reduced; the reduced flat buffer then backs the
  parameters' .grad (views into it), so a bucket's memory is never held twice for long.
* ZeRO-1 (`DistributedOptimizer`, Megatron's distributed optimizer): each bucket is padded to a
  multiple of dp and reduce-scattered; DP rank r keeps slice r of every bucket: the reduced
  gradient, an fp32 copy of the parameters (the main parameters its Adam updates) and Adam's
  moments, all 1/dp of the bucket. The model's own gradients are dropped once flattened. After
  the step the updated slices are all-gathered back into every replica's parameters.

The word embedding shared by a pipeline's first and last stage is reduced last: its two copies'
gradients must be summed across the stages first (train.parallel.tie_embedding_grads), and on
the first stage it is the last gradient backward produces anyway.

Everything works on a parameter's local tensor, so TP shards (DTensors) are buckets' members like
any tensor; the gradient norm of ZeRO-1 is computed over the slices, each element classified by
the parameter it belongs to (TP-sharded, replicated, or the tied copy counted on the first stage).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from train.planner.inventory import BUCKET_BYTES, plan_buckets
from train.tensors import is_dtensor, is_tp_sharded, local

# torch 2.13 renamed the flat-tensor collectives (the old names warn on every call); a cluster's own
# older torch (pyproject allows 2.4) has only the old ones. Same arguments either way.
reduce_scatter_flat: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Bucket:
    """Parameters reduced together, laid out one after another in a flat buffer."""

    params: list[nn.Parameter]
    offsets: list[int]
    """Where each parameter's local tensor starts in the flat buffer (elements)."""
    numel: int
    padded: int
    """numel rounded up to a multiple of dp (ZeRO-1 slices the bucket into dp equal parts)."""
    weight_decay: float
    deferred: bool = False
    """Reduced only when backward is over (the tied embedding)."""
    ready: int = 0
    flat: torch.Tensor | None = None
    work: Any = None
    reduced: torch.Tensor | None = None
    """ZeRO-1: this rank's slice of the reduced gradient."""

    def slice_of(self, rank: int, size: int) -> tuple[int, int]:
        """[start, end) of DP rank `rank`'s slice of the (padded) bucket."""
        part = self.padded // size
        return rank * part, (rank + 1) * part


def make_buckets(
    groups: Sequence[tuple[Sequence[nn.Parameter], float]],
    *,
    dp: int,
    deferred: Iterable[nn.Parameter] = (),
    bucket_bytes: int = BUCKET_BYTES,
) -> list[Bucket]:
    """Buckets of (parameters, weight decay) groups as train.planner.inventory.plan_buckets lays them
    out (reverse order, one dtype per bucket, at most bucket_bytes each, a larger parameter alone;
    `deferred` parameters in buckets of their own), so that the planner counts the same bytes."""
    later = {id(p) for p in deferred}
    params = [list(g) for g, _ in groups]
    plans = plan_buckets(
        [[(local(p).numel(), local(p).element_size()) for p in g] for g in params],
        dp=dp,
        deferred=[(gi, i) for gi, g in enumerate(params) for i, p in enumerate(g) if id(p) in later],
        bucket_bytes=bucket_bytes,
        dtypes=[[local(p).dtype for p in g] for g in params],
    )
    buckets = []
    for plan in plans:
        members = [params[g][i] for g, i in plan.members]
        offsets = [0]
        for p in members[:-1]:
            offsets.append(offsets[-1] + local(p).numel())
        decay = groups[plan.members[0][0]][1]
        buckets.append(Bucket(members, offsets, plan.numel, plan.padded, decay, deferred=plan.deferred))
    return buckets


def _weak_hook(sync: GradSync) -> Callable[[torch.Tensor], None]:
    """The parameters' post-accumulate-grad hook of `sync`, holding it only weakly.

    A bound method would close a reference cycle (parameter -> hook -> GradSync -> bucket ->
    parameter) that the collector cannot always see through the autograd engine, so the GradSync
    and its process group would outlive the run until the interpreter's teardown, after
    destroy_process_group, where gloo may abort the process ("terminate called without an active
    exception") after a record that says ok. The trainer's Setup owns the GradSync instead; a
    backward after its owner let it go is an error, never a gradient left unreduced.
    """
    ref = weakref.ref(sync)

    def on_grad(p: torch.Tensor) -> None:
        owner = ref()
        if owner is None:
            raise RuntimeError("a data-parallel parameter got a gradient after its GradSync was freed: keep the "
                               "GradSync (train.parallel.apply_dp's result) for as long as the model trains")
        owner._on_grad(p)

    return on_grad


@dataclass
class GradSync:
    """The DP gradient reduction of one replica's parameters (see the module docstring)."""

    buckets: list[Bucket]
    group: dist.ProcessGroup | None
    size: int
    rank: int
    shard: bool
    """ZeRO-1: reduce-scatter into slices (else all-reduce whole buckets)."""
    expected: int = 1
    counts: dict[int, int] = field(default_factory=dict)
    owner: dict[int, Bucket] = field(default_factory=dict)
    zero: DistributedOptimizer | None = None
    """The ZeRO-1 optimizer stepping this sync's slices (train.parallel.apply_zero1 sets it)."""

    def __post_init__(self) -> None:
        hook = _weak_hook(self)
        for bucket in self.buckets:
            for p in bucket.params:
                self.owner[id(p)] = bucket
                if self.group is not None and not bucket.deferred:
                    p.register_post_accumulate_grad_hook(hook)

    def begin_step(self, micro_batches: int) -> None:
        """Before a step's first backward: each parameter will get `micro_batches` gradients."""
        self.expected = micro_batches
        self.counts.clear()
        for bucket in self.buckets:
            bucket.ready, bucket.flat, bucket.work, bucket.reduced = 0, None, None, None

    def _on_grad(self, p: torch.Tensor) -> None:
        count = self.counts.get(id(p), 0) + 1
        self.counts[id(p)] = count
        if count == self.expected:
            bucket = self.owner[id(p)]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        flat = torch.zeros(bucket.padded, dtype=local(bucket.params[0]).dtype, device=local(bucket.params[0]).device)
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            grad = local(p.grad) if p.grad is not None else None
            if grad is not None:  # a parameter unused on this rank contributes zeros
                flat[offset : offset + grad.numel()].copy_(grad.reshape(-1))
            p.grad = None  # the flat buffer holds it now
        bucket.flat = flat
        if self.shard:
            start, end = bucket.slice_of(self.rank, self.size)
            bucket.reduced = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
            bucket.work = reduce_scatter_flat(bucket.reduced, flat, group=self.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """After backward (and the tied embedding's sum): launch what has not gone out, wait for every
        reduction, and put the results in place: reduced gradients back into the parameters' .grad
        (views into the flat buffers), or, under ZeRO-1, each bucket's reduced slice."""
        if self.group is None:
            return
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            if self.shard:
                bucket.flat = None
                continue
            assert bucket.flat is not None
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = bucket.flat[offset : offset + local(p).numel()].view_as(local(p))
                p.grad = _like(p, view)
            bucket.flat = None
        if self.zero is not None:
            self.zero.attach_gradients()

    def clip_grad_norm(
        self,
        params: Iterable[nn.Parameter],
        *,
        max_norm: float,
        tp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        exclude: torch.Tensor | None = None,
    ) -> float:
        """The global gradient norm, clipped to max_norm: over the reduced gradients of `params`, or
        under ZeRO-1 over this rank's reduced slices (which are all that exists of them)."""
        if self.zero is not None:
            return self.zero.clip_grad_norm(max_norm=max_norm, tp_group=tp_group, pp_group=pp_group, exclude=exclude)
        return clip_grad_norm(params, max_norm=max_norm, tp_group=tp_group, pp_group=pp_group, exclude=exclude)


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
    ref = next((local(g) for _, g in grads), torch.zeros(()))
    sharded = torch.zeros((), device=ref.device, dtype=torch.float32)
    replicated = torch.zeros((), device=ref.device, dtype=torch.float32)
    for p, g in grads:
        if p is exclude:
            continue
        # vector_norm reduces without the full-size temporary that g.pow(2) would allocate.
        sq = torch.linalg.vector_norm(local(g), dtype=torch.float32) ** 2
        if is_tp_sharded(p):
            sharded += sq
        else:
            replicated += sq
    norm, coef = _global_norm(sharded, replicated, max_norm=max_norm, tp_group=tp_group, pp_group=pp_group)
    if coef is not None:
        for _, g in grads:
            local(g).mul_(coef)
    return norm


def _global_norm(
    sharded: torch.Tensor,
    replicated: torch.Tensor,
    *,
    max_norm: float,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> tuple[float, float | None]:
    """The global L2 norm from this rank's squared sums (TP-sharded ones summed over TP, replicated
    ones once, then every stage's over PP), and the factor to scale the gradients by, as
    torch.nn.utils.clip_grad_norm_ computes it (None: leave them, the norm is within bounds or not
    finite)."""
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    return norm, coef if coef < 1.0 and math.isfinite(norm) else None


def _like(p: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """`data` as a gradient of `p`: a DTensor with p's placements when p is one."""
    if is_dtensor(p):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(data, p.device_mesh, p.placements, run_check=False)  # type: ignore[attr-defined]
    return data


# ---------------------------------------------------------------------------------------------
# ZeRO-1.


class DistributedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: Adam over this DP rank's slices of the buckets (see the module docstring).

    Its param_groups hold the slices (fp32 main parameters, with the reduced gradient slices as
    their .grad), so the loss scaler unscales them and the learning-rate schedule reaches them; the
    inner optimizer (an instance of the class the native engine chose, with the same settings)
    steps them; step() then all-gathers every bucket's slices into the model's parameters.
    """

    def __init__(self, sync: GradSync, *, make_inner: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> None:
        self.sync = sync
        self.main: list[nn.Parameter] = []
        groups: dict[float, list[nn.Parameter]] = {}
        for bucket in sync.buckets:
            start, end = bucket.slice_of(sync.rank, sync.size)
            flat = _flatten(bucket)
            main = nn.Parameter(flat[start:end].clone().float(), requires_grad=False)
            self.main.append(main)
            groups.setdefault(bucket.weight_decay, []).append(main)
        param_groups = [{"params": params, "weight_decay": decay} for decay, params in groups.items()]
        self.inner = make_inner(param_groups)
        super().__init__([{**g, "params": list(g["params"])} for g in self.inner.param_groups], dict(self.inner.defaults))

    def attach_gradients(self) -> None:
        """After GradSync.finish: each main slice's .grad is its bucket's reduced slice."""
        for main, bucket in zip(self.main, self.sync.buckets, strict=True):
            assert bucket.reduced is not None
            main.grad = bucket.reduced.float() if bucket.reduced.dtype != torch.float32 else bucket.reduced

    def zero_grad(self, set_to_none: bool = True) -> None:
        for main in self.main:
            main.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner["lr"], inner["weight_decay"] = outer["lr"], outer["weight_decay"]
        self.inner.step()
        for main, bucket in zip(self.main, self.sync.buckets, strict=True):
            full = torch.empty(bucket.padded, dtype=main.dtype, device=main.device)
            all_gather_flat(full, main.detach(), group=self.sync.group)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                target = local(p)
                target.copy_(full[offset : offset + target.numel()].view_as(target))

    @torch.no_grad()
    def refresh_from_model(self) -> None:
        """Copy the model's parameters into the main slices (after a checkpoint restored the model)."""
        for main, bucket in zip(self.main, self.sync.buckets, strict=True):
            start, end = bucket.slice_of(self.sync.rank, self.sync.size)
            main.copy_(_flatten(bucket)[start:end])

    def named_states(self, prefix: str) -> dict[str, dict[str, Any]]:
        """{f'{prefix}.bucket{k}': Adam's state of slice k} (references), for the checkpoint."""
        return {
            f"{prefix}.bucket{k}": dict(self.inner.state[main])
            for k, main in enumerate(self.main)
            if self.inner.state.get(main)
        }

    def clip_grad_norm(
        self, *, max_norm: float, tp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None,
        exclude: torch.Tensor | None = None,
    ) -> float:
        """The global gradient norm from the slices (each element counted once over DP, TP shards
        summed over TP, replicated ones once, the tied copy left out), then the slices scaled."""
        ref = self.main[0]
        sharded = torch.zeros((), device=ref.device, dtype=torch.float32)
        replicated = torch.zeros((), device=ref.device, dtype=torch.float32)
        for main, bucket in zip(self.main, self.sync.buckets, strict=True):
            assert main.grad is not None
            start, end = bucket.slice_of(self.sync.rank, self.sync.size)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                lo, hi = max(offset, start), min(offset + local(p).numel(), end)
                if lo >= hi or p is exclude:
                    continue
                sq = torch.linalg.vector_norm(main.grad[lo - start : hi - start], dtype=torch.float32) ** 2
                if is_tp_sharded(p):
                    sharded += sq
                else:
                    replicated += sq
        both = torch.stack([sharded, replicated])
        dist.all_reduce(both, group=self.sync.group)
        norm, coef = _global_norm(both[0], both[1], max_norm=max_norm, tp_group=tp_group, pp_group=pp_group)
        if coef is not None:
            for main in self.main:
                assert main.grad is not None
                main.grad.mul_(coef)
        return norm


def _flatten(bucket: Bucket) -> torch.Tensor:
    """The bucket's parameters as one padded flat tensor (a copy)."""
    first = local(bucket.params[0])
    flat = torch.zeros(bucket.padded, dtype=first.dtype, device=first.device)
    for p, offset in zip(bucket.params, bucket.offsets, strict=True):
        t = local(p)
        flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
    return flat
