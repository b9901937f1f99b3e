"""Slurm allocations and array grouping (launchers/allocation.py): pure arithmetic, no Slurm."""

from __future__ import annotations

import dataclasses

import pytest

from conf.schema import ClusterConfig, HardwareConfig, ParallelismConfig, RunConfig
from launchers.allocation import Allocation, allocation_of, array_key, chunk, group_by


def run(
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    *,
    per_node: int = 8,
    device: str = "cuda",
    **cluster: object,
) -> RunConfig:
    return RunConfig(
        parallelism=ParallelismConfig(tp=tp, pp=pp, dp=dp),
        hardware=HardwareConfig(device_type=device, devices_per_node=per_node),
        cluster=dataclasses.replace(ClusterConfig(), **cluster),  # type: ignore[arg-type]
    )


def test_small_runs_take_part_of_one_node() -> None:
    assert allocation_of(run()) == Allocation(nodes=1, tasks_per_node=1, gpus_per_node=1, time_limit_min=60)
    assert allocation_of(run(tp=2)) == Allocation(1, 2, 2, 60)
    # dp null counts as 1 in a sweep: tp x pp devices.
    assert allocation_of(run(tp=2, pp=2)).tasks == 4


def test_large_runs_fill_whole_nodes() -> None:
    shape = allocation_of(run(tp=8, pp=2, dp=2))
    assert (shape.nodes, shape.tasks_per_node, shape.gpus_per_node) == (4, 8, 8)
    assert shape.tasks == 32
    with pytest.raises(ValueError, match="whole nodes"):
        allocation_of(run(tp=4, pp=3, per_node=8))


def test_cpu_runs_ask_for_no_gpus() -> None:
    assert allocation_of(run(tp=2, device="cpu")).gpus_per_node == 0


def test_array_key_splits_on_allocation_and_sbatch_options_only() -> None:
    base = array_key(run(tp=2))
    assert array_key(run(tp=2, env={"NCCL_DEBUG": "INFO"})) == base  # env travels per task
    assert array_key(run(tp=4)) != base
    assert array_key(run(tp=2, time_limit_min=5)) != base
    assert array_key(run(tp=2, partition="other")) != base
    assert array_key(run(tp=2), array_parallelism=3).options.array_parallelism == 3
    assert base.options.array_parallelism == ClusterConfig().array_parallelism


def test_group_by_and_chunk_keep_order() -> None:
    assert group_by([("a", 1), ("b", 2), ("a", 3)]) == {"a": [1, 3], "b": [2]}
    assert list(group_by([("b", 0), ("a", 1)])) == ["b", "a"]
    assert chunk(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    assert chunk([], 3) == []
    with pytest.raises(ValueError):
        chunk([1], 0)
