"""train.init: a shard gets exactly its place of the whole parameter's values, whatever the split."""

from __future__ import annotations

import math

import pytest
import torch

from conf.schema import ModelConfig, ModelKind
from train.init import (
    BLOCK_ROWS,
    INIT_STD,
    ShardSpec,
    block_seed,
    fill_normal,
    initialize,
    mark_shard,
    shard_of,
)
from train.model import build_model

SHAPE = (3 * BLOCK_ROWS + 17, 40)  # rows that do not fill the last block


def whole(shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    t = torch.empty(shape)
    fill_normal(t, ShardSpec(shape), std=1.0, seed=7, name="w")
    return t


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_row_shards_are_the_rows_of_the_whole(parts: int) -> None:
    rows = SHAPE[0] - SHAPE[0] % parts
    full = whole((rows, SHAPE[1]))
    size = rows // parts
    for i in range(parts):
        local = torch.empty(size, SHAPE[1])
        fill_normal(local, ShardSpec((rows, SHAPE[1]), 0, i * size), std=1.0, seed=7, name="w")
        assert torch.equal(local, full[i * size : (i + 1) * size])


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_column_shards_are_the_columns_of_the_whole(parts: int) -> None:
    full = whole()
    size = SHAPE[1] // parts
    for i in range(parts):
        local = torch.empty(SHAPE[0], size)
        fill_normal(local, ShardSpec(SHAPE, 1, i * size), std=1.0, seed=7, name="w")
        assert torch.equal(local, full[:, i * size : (i + 1) * size])


def test_values_depend_on_seed_and_name_and_look_normal() -> None:
    a = whole()
    b = torch.empty(SHAPE)
    fill_normal(b, ShardSpec(SHAPE), std=1.0, seed=8, name="w")
    c = torch.empty(SHAPE)
    fill_normal(c, ShardSpec(SHAPE), std=1.0, seed=7, name="v")
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert a.mean().abs() < 0.05 and a.std() == pytest.approx(1.0, rel=0.05)
    # Blocks are independent draws, not one draw repeated.
    assert not torch.equal(a[:BLOCK_ROWS], a[BLOCK_ROWS : 2 * BLOCK_ROWS])
    assert block_seed(7, "w", 0) != block_seed(7, "w", 1) and 0 <= block_seed(7, "w", 3) < 2**63


def test_marks_outlive_to_empty() -> None:
    # to_empty replaces a meta parameter by a new one: the mark lives on the module.
    with torch.device("meta"):
        linear = torch.nn.Linear(2, 4)
    assert shard_of(linear, "weight") == ShardSpec((4, 2))
    mark_shard(linear, "weight", ShardSpec((8, 2), 0, 4))
    linear.to_empty(device="cpu")
    assert shard_of(linear, "weight") == ShardSpec((8, 2), 0, 4) and shard_of(linear, "bias") == ShardSpec((4,))


@pytest.mark.parametrize("kind", [ModelKind.gpt, ModelKind.bert])
def test_the_model_starts_as_gpt2_and_megatron_do(kind: ModelKind) -> None:
    cfg = ModelConfig(name="m", kind=kind, num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=300)
    model = build_model(cfg, seed=3)
    params = dict(model.named_parameters())
    assert params["layers.0.attn.qkv.weight"].std().item() == pytest.approx(INIT_STD, rel=0.1)
    residual = INIT_STD / math.sqrt(2 * cfg.num_layers)
    assert params["layers.1.mlp.fc_out.weight"].std().item() == pytest.approx(residual, rel=0.1)
    assert torch.all(params["layers.2.ln_1.weight"] == 1) and torch.all(params["norm.bias"] == 0)
    assert torch.all(params["layers.3.attn.qkv.bias"] == 0)
    if kind == ModelKind.bert:
        assert torch.all(params["lm_head.bias"] == 0) and torch.all(params["lm_head.norm.weight"] == 1)
    # Built again from the same seed: the same values; on the meta device: no storage at all.
    again = build_model(cfg, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    meta = build_model(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    initialize(meta, seed=3, num_layers=cfg.num_layers)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), meta.parameters(), strict=True))
