"""Parameter initialization that gives a shard the values of its place in the whole parameter.

A model is built without storage (`torch.device("meta")`), split into this rank's pipeline stage and
sharded for tensor parallelism before any parameter exists; only then does each rank allocate its
shards (`to_empty`) and fill them here. So no rank ever holds more than its share, yet every shard
starts with exactly the values the one-process model has at the same place.

That rules out torch's ordinary initializers: `nn.init.normal_` on a shard draws from the rank's
generator in the shard's own order, so TP shards would all start equal (and DTensor's offset-based
RNG tracker, which would fix that, serves CUDA-like devices only; checked on CPU with gloo, torch
2.13). Instead every parameter is drawn in blocks of BLOCK_ROWS rows of its full shape, each block
from a generator seeded by (training.seed, the parameter's name, the block's index). A shard
draws the blocks its rows touch and keeps its own rows and columns of them: a row shard draws
about its share, a column shard every block (so tp times its share in time, one block in memory).

The distributions are GPT-2's and Megatron's: weights N(0, 0.02), the two projections that write
into the residual stream (attn.proj, mlp.fc_out) N(0, 0.02 / sqrt(2 x layers)), biases 0,
LayerNorms weight 1 and bias 0.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from train.tensors import local as local_of

BLOCK_ROWS = 128
"""Rows of a parameter drawn from one generator (a 1-D parameter is one column of rows)."""
INIT_STD = 0.02
_RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.fc_out.weight")


@dataclass(frozen=True)
class ShardSpec:
    """Where a parameter's local tensor sits in the whole parameter."""

    full_shape: tuple[int, ...]
    dim: int | None = None
    """The dimension it is split along (None: the whole parameter)."""
    offset: int = 0
    """Index along `dim` of its first element."""


def mark_shard(module: nn.Module, attr: str, shard: ShardSpec) -> None:
    """Say where `module`'s plain-tensor parameter `attr` (train.parallel.apply_tp_plain) sits in the
    whole parameter. Kept on the module: `to_empty` replaces a meta parameter by a new object, and
    attributes of the old one would be lost. DTensors say where they sit themselves."""
    shards = module.__dict__.setdefault("megasweep_shards", {})
    shards[attr] = shard


def shard_of(module: nn.Module, attr: str) -> ShardSpec:
    """Where `module`'s parameter `attr` sits: a mark, its DTensor placement, or the whole parameter."""
    marked = module.__dict__.get("megasweep_shards", {}).get(attr)
    if marked is not None:
        return marked
    param = getattr(module, attr)
    placements = getattr(param, "placements", None)
    if placements:
        mesh = param.device_mesh
        for placement in placements:
            if placement.is_shard():
                dim = placement.dim
                size = param.shape[dim] // mesh.size()
                return ShardSpec(tuple(param.shape), dim, mesh.get_local_rank() * size)
    return ShardSpec(tuple(param.shape))


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of one block: stable across processes and Python versions (not hash())."""
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch.Generator takes up to 2^63 - 1 here


@torch.no_grad()
def fill_normal(local: torch.Tensor, shard: ShardSpec, *, std: float, seed: int, name: str) -> None:
    """Fill `local` (the shard) with its part of a N(0, std) draw of the whole parameter."""
    full = shard.full_shape
    rows = full[0]
    cols = math.prod(full[1:]) if len(full) > 1 else 1
    # The local region as (row range, column range) of the full parameter viewed as rows x cols.
    r0, c0 = 0, 0
    local_rows, local_cols = local.shape[0], (math.prod(local.shape[1:]) if local.dim() > 1 else 1)
    if shard.dim == 0:
        r0 = shard.offset
    elif shard.dim == 1:
        c0 = shard.offset * (cols // full[1])
    elif shard.dim is not None:
        raise ValueError(f"{name}: shards along dim {shard.dim} are not supported")
    view = local.view(local_rows, local_cols)
    generator = torch.Generator(device=local.device)
    for block in range(r0 // BLOCK_ROWS, math.ceil((r0 + local_rows) / BLOCK_ROWS)):
        b0, b1 = block * BLOCK_ROWS, min((block + 1) * BLOCK_ROWS, rows)
        generator.manual_seed(block_seed(seed, name, block))
        values = torch.empty(b1 - b0, cols, device=local.device, dtype=torch.float32)
        values.normal_(0.0, std, generator=generator)
        first, last = max(b0, r0), min(b1, r0 + local_rows)
        view[first - r0 : last - r0].copy_(values[first - b0 : last - b0, c0 : c0 + local_cols])


@torch.no_grad()
def initialize(model: nn.Module, *, seed: int, num_layers: int) -> None:
    """Fill every parameter of `model` (a whole model, a pipeline stage, TP shards) in place."""
    for module_name, module in model.named_modules():
        initialize_module(module, prefix=module_name, seed=seed, num_layers=num_layers)


@torch.no_grad()
def initialize_module(module: nn.Module, *, prefix: str, seed: int, num_layers: int) -> None:
    """Fill `module`'s own parameters (not its children's); `prefix` is its name in the whole model."""
    residual_std = INIT_STD / math.sqrt(2.0 * max(num_layers, 1))
    for attr, param in module.named_parameters(recurse=False):
        name = f"{prefix}.{attr}" if prefix else attr
        local = local_of(param)
        if isinstance(module, nn.LayerNorm):
            local.fill_(1.0 if attr == "weight" else 0.0)
        elif attr == "bias":
            local.zero_()
        else:
            std = residual_std if name.endswith(_RESIDUAL_OUTPUTS) else INIT_STD
            fill_normal(local, shard_of(module, attr), std=std, seed=seed, name=name)
