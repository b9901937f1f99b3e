"""train.parallel: DP, ZeRO-1, TP and PP on CPU gloo workers give the one-process losses.

Every layout is started through the real entry point (`python -m train ...` in a subprocess,
which spawns its workers) and compared on result.json's `losses`: same seed, same samples,
fp32, 3 optimizer steps. Tolerance rel 1e-5: the layouts only change the fp32 summation order
(reductions across ranks, split matmuls), which moved the losses by < 1e-7 relative here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from train import trainer
from train.parallel import _buckets, partition_params, stage_layers
from train.trainer import run_training

from .test_distributed import TINY, run_train
from .test_trainer import compose_run

RTOL = 1e-5


def launch(tmp_path: Path, name: str, *overrides: str) -> dict[str, Any]:
    proc, record = run_train(tmp_path / name, *TINY, *overrides)
    # Rank 0 alone prints: one line per iteration, not one per rank.
    assert sum(line.startswith(" iteration ") for line in proc.stdout.splitlines()) == 3
    return record


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    # The same config in this process (no launcher variables: one process, no process group).
    record = run_training(compose_run(*TINY), output_dir=tmp_path_factory.mktemp("single"), overrides=[])
    losses: list[float] = record["losses"]
    assert len(losses) == 3 and losses[0] != losses[2]  # the weights moved
    return losses


def test_stage_layers_split_evenly() -> None:
    assert [list(stage_layers(4, stage=s, num_stages=2)) for s in range(2)] == [[0, 1], [2, 3]]
    assert [len(stage_layers(7, stage=s, num_stages=3)) for s in range(3)] == [3, 2, 2]
    assert sorted(i for s in range(4) for i in stage_layers(10, stage=s, num_stages=4)) == list(range(10))


def test_zero1_partition_balances_and_covers() -> None:
    sizes = [100, 10, 60, 40, 5, 5]
    owner = partition_params(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owner, strict=True) if o == r) for r in range(2)]
    assert loads == [110, 110]  # 100+5+5 and 60+40+10
    assert partition_params(sizes, 1) == [0] * 6


def test_buckets_respect_size_and_dtype() -> None:
    import torch

    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30)]
    assert [len(b) for b in _buckets(ts, limit=80)] == [2, 1, 1]


def test_tp_and_pp_ranks_of_a_replica_read_the_same_samples() -> None:
    run = compose_run(*TINY)  # gbs 8, mbs 2

    # world 8 = pp2 x dp2 x tp2; rank = (pp * dp + d) * tp + t.
    def indices(rank: int) -> list[list[int]]:
        world = trainer.World(world_size=8, rank=rank, dp=2, tp=2, pp=2)
        return [list(r) for r in trainer.micro_batch_indices(run, world=world, consumed=0)]

    assert indices(0) == indices(1) == indices(4) == indices(5)  # dp 0: TP pair, both stages
    assert indices(2) == indices(3) == indices(6) == indices(7)  # dp 1
    assert sorted(i for r in (0, 2) for mb in indices(r) for i in mb) == list(range(8))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("dp2", ("parallelism.dp=2",)),
        ("tp2", ("parallelism.tp=2",)),
        ("pp2", ("parallelism.pp=2",)),
        (
            "dp2_tp2_pp2_zero1",
            ("parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.zero_stage=1"),
        ),
    ],
)
def test_layout_matches_one_process(
    tmp_path: Path, single: list[float], name: str, overrides: tuple[str, ...]
) -> None:
    record = launch(tmp_path, name, *overrides)
    assert record["status"] == "ok"
    assert record["losses"] == pytest.approx(single, rel=RTOL)
    world = record["world"]
    assert world["world_size"] == world["dp"] * world["tp"] * world["pp"]
    assert len(record["max_mem_gib_per_rank"]) == world["world_size"]  # gathered from every rank
    if "zero_stage=1" in " ".join(overrides):
        assert record["optimizer"].endswith("+ZeRO-1")
