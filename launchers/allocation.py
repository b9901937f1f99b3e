"""The Slurm allocation of a run, and grouping of a sweep's configs into one job array per allocation.

Slurm gives every task of a job array the same allocation, so configs can share an array
only when they ask for the same nodes, tasks, GPUs, time and sbatch options. A sweep over
learning rates or environment variables is one array; a sweep over tp (or time limits, or
partitions) is one array per distinct value. Per-config settings that do not change the
allocation (cluster.env, the overrides themselves) travel with each task instead.

Torch-free: the launcher runs this on login nodes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from conf.schema import RunConfig
from train.planner.layout import Layout

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

__all__ = [
    "Allocation",
    "ArrayKey",
    "SbatchOptions",
    "allocation_of",
    "array_key",
    "chunk",
    "core_licenses",
    "group_by",
    "job_licenses",
    "sbatch_options",
]


@dataclass(frozen=True)
class Allocation:
    """What one run asks Slurm for: the nodes, tasks and GPUs that every rank of it needs."""

    nodes: int
    """Nodes (nodes)."""
    tasks_per_node: int
    """Processes started by srun on each node, one per device (tasks)."""
    gpus_per_node: int
    """GPUs requested per node; 0 on CPU hardware (devices)."""
    time_limit_min: int
    """Wall-clock limit (minutes)."""

    @property
    def tasks(self) -> int:
        """Processes in the whole job, i.e. the world size (tasks)."""
        return self.nodes * self.tasks_per_node

    def words(self) -> str:
        """The shape in a message's words: '2 node(s) x 4 task(s), 4 GPU(s)/node, 60 min'."""
        return (
            f"{self.nodes} node(s) x {self.tasks_per_node} task(s), {self.gpus_per_node} GPU(s)/node, "
            f"{self.time_limit_min} min"
        )

    def as_dict(self) -> dict[str, int]:
        """JSON-ready dict, as stored in the manifest entry's `shape`."""
        return {
            "nodes": self.nodes,
            "tasks_per_node": self.tasks_per_node,
            "gpus_per_node": self.gpus_per_node,
            "time_limit_min": self.time_limit_min,
        }


def allocation_of(run: RunConfig) -> Allocation:
    """The allocation of one run: dp x tp x pp devices (dp null counts as 1 in a sweep).

    Devices fill whole nodes of hardware.devices_per_node; a run smaller than a node gets one
    partial node, so a tp=2 config does not hold an 8-GPU node's other six GPUs. Raises
    ValueError for a world that does not fill whole nodes: the rules reject those configs
    first (`whole_nodes`), so a launcher never asks.
    """
    hw = run.hardware
    layout = Layout.of(run.parallelism)
    nodes, tasks_per_node = layout.placement(hw.devices_per_node)
    return Allocation(
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        gpus_per_node=tasks_per_node if hw.device_type == "cuda" else 0,
        time_limit_min=run.cluster.time_limit_min,
    )


@dataclass(frozen=True)
class SbatchOptions:
    """The cluster settings that go on the sbatch command line (and so split arrays too)."""

    partition: str | None
    account: str | None
    qos: str | None
    gres: str | None
    constraint: str | None
    cpus_per_task: int
    mem_per_node_gb: int | None
    array_parallelism: int
    setup: tuple[str, ...]
    """Shell lines run in the batch script before srun (module loads, venv activation)."""
    exclusive: bool = False
    """Whole nodes (--exclusive); False for launch records written before the option existed."""
    core_license: str | None = None
    """License counting real cores, one per CPU the job runs (--licenses); None: none, as before it existed."""


@dataclass(frozen=True)
class ArrayKey:
    """Configs with equal keys can be one job array."""

    allocation: Allocation
    options: SbatchOptions


def array_key(run: RunConfig, *, array_parallelism: int | None = None) -> ArrayKey:
    """The grouping key of one run; `array_parallelism` overrides cluster.array_parallelism."""
    return ArrayKey(allocation=allocation_of(run), options=sbatch_options(run, array_parallelism=array_parallelism))


def sbatch_options(run: RunConfig, *, array_parallelism: int | None = None) -> SbatchOptions:
    """The sbatch options of `run`'s cluster settings, whatever its layout."""
    c = run.cluster
    return SbatchOptions(
        partition=c.partition,
        account=c.account,
        qos=c.qos,
        gres=c.gres,
        constraint=c.constraint,
        cpus_per_task=c.cpus_per_task,
        mem_per_node_gb=c.mem_per_node_gb,
        array_parallelism=array_parallelism if array_parallelism is not None else c.array_parallelism,
        setup=tuple(c.setup),
        exclusive=c.exclusive,
        core_license=c.core_license,
    )


def slurm_mem(gb: int | None) -> str | None:
    """cluster.mem_per_node_gb as sbatch's --mem value, or None to ask for none. A bare number is
    megabytes to Slurm, so the unit is written out: `--mem=256` asks for 256 MB, not 256 GB."""
    return None if gb is None else f"{gb}G"


def core_licenses(name: str | None, cpus: int, total: int | None) -> str | None:
    """sbatch's --licenses value for a job running `cpus` CPUs (tasks x cpus_per_task), or None.

    One license per CPU, so that the jobs holding the license never run on more CPUs at once than
    it counts (cluster.core_license). A job wider than the whole count (`total`, when the cluster
    says) asks for all of it: it then runs alone, instead of waiting for licenses that never come.
    """
    if name is None:
        return None
    if cpus < 1:
        raise ValueError(f"a job runs at least one CPU, got cpus={cpus}")
    wanted = cpus if total is None else max(1, min(cpus, total))
    return f"{name}:{wanted}"


def job_licenses(key: ArrayKey, totals: Mapping[str, int] | None) -> str | None:
    """--licenses of each job of `key`: its CPUs (nodes x tasks per node x cpus_per_task) of
    cluster.core_license, capped at that license's total in `totals` (launchers.site.license_totals)."""
    alloc, opt = key.allocation, key.options
    total = totals.get(opt.core_license) if totals and opt.core_license else None
    return core_licenses(opt.core_license, alloc.nodes * alloc.tasks_per_node * opt.cpus_per_task, total)


def group_by(items: Iterable[tuple[K, T]]) -> dict[K, list[T]]:
    """Items grouped by key, groups in order of first appearance, items in input order."""
    groups: dict[K, list[T]] = {}
    for key, item in items:
        groups.setdefault(key, []).append(item)
    return groups


def chunk(items: list[T], size: int) -> list[list[T]]:
    """Consecutive pieces of at most `size` items (an array larger than MaxArraySize is refused)."""
    if size < 1:
        raise ValueError(f"chunk size must be positive, got {size}")
    return [items[i * size : (i + 1) * size] for i in range(math.ceil(len(items) / size))]
