"""Which parameter tensors one rank holds, in the order the model registers them, and how the DP
gradient reduction groups them into buckets.

The memory model counts model-state bytes from this list, and train.dp builds its buckets with
`plan_buckets`, so the planner's byte counts and the trainer's tensors agree exactly (tests compare
this inventory with the named parameters of a real stage).

A rank of a launched run holds a `PipelineStageModule` (train.parallel), which registers its
layers first, then the word and position embeddings (first stage), the final LayerNorm, BERT's LM
head and the output layer's word-embedding copy (last stage). A lone process holds the whole
`TransformerLM`, which registers the embeddings first. Tensor parallelism keeps the names and
divides the column-parallel rows (QKV, MLP-in, their biases), the row-parallel columns (attention
output, MLP-out), the vocabulary rows of the word embedding and BERT's decoder bias by tp.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from conf.schema import ModelConfig, ModelKind
from train.planner.sizes import padded_vocab_size


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor as a rank holds it."""

    name: str
    """Its name in the module (e.g. 'layers.3.attn.qkv.weight')."""
    numel: int
    """Elements this rank holds (its TP shard)."""
    matrix: bool
    """Two-dimensional: weight-decayed (train.optim.param_groups) and, except the embeddings' lookups,
    an operand of a GEMM."""
    gemm: bool
    """Used as a GEMM operand in the forward (autocast makes a 16-bit copy of it)."""
    tp_sharded: bool
    """Split over the TP ranks (else replicated on each)."""


def stage_layers(num_layers: int, *, stage: int, num_stages: int) -> range:
    """Layer indices of one pipeline stage: an even split, the remainder (if any) on the first stages."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def layer_params(model: ModelConfig, index: int, tp: int = 1) -> list[ParamSpec]:
    """Layer `index`'s tensors on one TP rank, in registration order (ln_1, attn, ln_2, mlp)."""
    h, f = model.hidden_size, model.ffn
    p = f"layers.{index}."

    def vec(name: str, n: int, sharded: bool = False) -> ParamSpec:
        return ParamSpec(p + name, n // tp if sharded else n, matrix=False, gemm=False, tp_sharded=sharded)

    def mat(name: str, n: int) -> ParamSpec:
        return ParamSpec(p + name, n // tp, matrix=True, gemm=True, tp_sharded=True)

    return [
        vec("ln_1.weight", h), vec("ln_1.bias", h),
        mat("attn.qkv.weight", 3 * h * h), vec("attn.qkv.bias", 3 * h, sharded=True),
        mat("attn.proj.weight", h * h), vec("attn.proj.bias", h),
        vec("ln_2.weight", h), vec("ln_2.bias", h),
        mat("mlp.fc_in.weight", f * h), vec("mlp.fc_in.bias", f, sharded=True),
        mat("mlp.fc_out.weight", h * f), vec("mlp.fc_out.bias", h),
    ]  # fmt: skip


def stage_params(
    model: ModelConfig, *, tp: int = 1, stage: int = 0, num_stages: int = 1, whole_model: bool = False
) -> list[ParamSpec]:
    """The tensors one rank of pipeline stage `stage` holds, in registration order.

    `whole_model`: the order of a lone process's TransformerLM (embeddings first) instead of a
    launched rank's PipelineStageModule (layers first); the tensors are the same."""
    # Memoised: a layout search asks for the same stages thousands of times.
    return list(_stage_params(model, tp, stage, num_stages, whole_model))


@functools.lru_cache(maxsize=1 << 12)
def stage_numel(model: ModelConfig, *, tp: int = 1, stage: int = 0, num_stages: int = 1) -> int:
    """Elements of the tensors one rank of `stage` holds (the sum over stage_params)."""
    return sum(p.numel for p in _stage_params(model, tp, stage, num_stages, False))


@functools.lru_cache(maxsize=1 << 12)
def _stage_params(model: ModelConfig, tp: int, stage: int, num_stages: int, whole_model: bool) -> tuple[ParamSpec, ...]:
    h, vocab = model.hidden_size, padded_vocab_size(model, tp)
    first, last = stage == 0, stage == num_stages - 1
    wte = ParamSpec("wte.weight", vocab * h // tp, matrix=True, gemm=last, tp_sharded=True)
    wpe = ParamSpec("wpe.weight", model.seq_length * h, matrix=True, gemm=False, tp_sharded=False)
    layers = [
        spec
        for i in stage_layers(model.num_layers, stage=stage, num_stages=num_stages)
        for spec in layer_params(model, i, tp)
    ]
    head: list[ParamSpec] = []
    if last:
        head = [
            ParamSpec("norm.weight", h, matrix=False, gemm=False, tp_sharded=False),
            ParamSpec("norm.bias", h, matrix=False, gemm=False, tp_sharded=False),
        ]
        if model.kind == ModelKind.bert:
            head += [
                ParamSpec("lm_head.dense.weight", h * h, matrix=True, gemm=True, tp_sharded=False),
                ParamSpec("lm_head.dense.bias", h, matrix=False, gemm=False, tp_sharded=False),
                ParamSpec("lm_head.norm.weight", h, matrix=False, gemm=False, tp_sharded=False),
                ParamSpec("lm_head.norm.bias", h, matrix=False, gemm=False, tp_sharded=False),
                ParamSpec("lm_head.bias", vocab // tp, matrix=False, gemm=False, tp_sharded=True),
            ]
    if whole_model:
        return (wte, wpe, *layers, *head)
    embeddings = [wte, wpe] if first else []
    # PipelineStageModule registers wte (first or last stage) before wpe, norm and the LM head.
    if last and not first:
        return (*layers, wte, *head)
    return (*layers, *embeddings, *head)


def module_sizes(params: Sequence[ParamSpec]) -> list[int]:
    """Parameters per module, counting a module's own tensors only (ZeRO-3 gathers, ZeRO-2 reduces
    one module's worth at a time; DeepSpeed's estimate_zero3_model_states_mem_needs_all_live takes
    its `largest_layer_params` the same way, `module.parameters(recurse=False)`)."""
    sizes: dict[str, int] = {}
    for p in params:
        owner = p.name.rpartition(".")[0]
        sizes[owner] = sizes.get(owner, 0) + p.numel
    return list(sizes.values())


def tied_word_embedding(*, stage: int, num_stages: int) -> bool:
    """Whether the stage's word embedding has a twin on another stage (first and last of several),
    whose gradient is summed with it before the DP reduction (so it is reduced last, alone)."""
    return num_stages > 1 and stage in (0, num_stages - 1)


# ---------------------------------------------------------------------------------------------
# DP gradient buckets.

BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per bucket: large enough to amortise a collective's latency, small enough that
flattening a bucket costs little memory (DDP's default size)."""


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: which (group, position) tensors it holds, and its flat sizes."""

    members: tuple[tuple[int, int], ...]
    """(group index, index within the group) of each tensor, in bucket order."""
    numel: int
    padded: int
    """numel rounded up to a multiple of dp (ZeRO-1 slices the bucket into dp equal parts)."""
    deferred: bool
    """Reduced only when backward is over (the tied word embedding)."""


def plan_buckets(
    groups: Sequence[Sequence[tuple[int, int]]],
    *,
    dp: int,
    deferred: Sequence[tuple[int, int]] = (),
    bucket_bytes: int = BUCKET_BYTES,
    dtypes: Sequence[Sequence[object]] | None = None,
) -> list[BucketPlan]:
    """Buckets of each group's tensors, given as (numel, bytes per element): the group walked in
    reverse (about the order backward produces gradients), a new bucket when the next tensor would
    pass bucket_bytes or has another dtype (`dtypes`, parallel to `groups`), a tensor larger than
    bucket_bytes alone; `deferred` (group, index) pairs get buckets of their own."""
    later = set(deferred)
    buckets: list[BucketPlan] = []

    def close(members: list[tuple[int, int]], *, held: bool = False) -> None:
        if members:
            total = sum(groups[g][i][0] for g, i in members)
            buckets.append(BucketPlan(tuple(members), total, -(-total // dp) * dp, held))

    for g, group in enumerate(groups):
        current: list[tuple[int, int]] = []
        size = 0
        for i in reversed(range(len(group))):
            numel, element = group[i]
            if (g, i) in later:
                close([(g, i)], held=True)
                continue
            nbytes = numel * element
            kind = dtypes[g][i] if dtypes is not None else None
            first_kind = dtypes[g][current[0][1]] if dtypes is not None and current else None
            if current and (size + nbytes > bucket_bytes or kind != first_kind):
                close(current)
                current, size = [], 0
            current.append((g, i))
            size += nbytes
        close(current)
    return buckets


def optimizer_groups(params: Sequence[ParamSpec]) -> list[list[ParamSpec]]:
    """train.optim.param_groups' split: weight-decayed matrices first, then vectors."""
    return [[p for p in params if p.matrix], [p for p in params if not p.matrix]]


def stage_buckets(
    params: Sequence[ParamSpec], *, dp: int, element_bytes: int, tied: bool, bucket_bytes: int = BUCKET_BYTES
) -> list[BucketPlan]:
    """The buckets train.dp builds for a stage's parameters (`tied`: its word embedding is deferred)."""
    groups = optimizer_groups(params)
    deferred = tuple((0, i) for i, p in enumerate(groups[0]) if tied and p.name == "wte.weight")
    sizes = tuple(tuple((p.numel, element_bytes) for p in g) for g in groups)
    return list(_cached_buckets(sizes, dp, deferred, bucket_bytes))


@functools.lru_cache(maxsize=1 << 12)
def _cached_buckets(
    groups: tuple[tuple[tuple[int, int], ...], ...], dp: int, deferred: tuple[tuple[int, int], ...], bucket_bytes: int
) -> tuple[BucketPlan, ...]:
    return tuple(plan_buckets(groups, dp=dp, deferred=deferred, bucket_bytes=bucket_bytes))
