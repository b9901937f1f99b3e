"""The one description of how a run's devices are arranged: `Layout` (dp x tp x pp) and `Rank`.

Every part of megasweep that asks "how many replicas?", "which node?", "which samples does
this rank read?" asks it here: the planner and the rules (dp derived from a world size), the
launchers (nodes of an allocation), the trainer (a rank's mesh coordinates, its micro-batches'
sample indices) and the analysis (a record's degrees). Before, each kept its own copy of these
few lines, and the copies drifted.

Rank order is Megatron's: TP fastest (neighbouring ranks, so a TP group shares a node's fast
links whenever tp divides the devices per node), then DP, then PP.

Samples: micro-batch m of DP rank r in the step that starts after `consumed` samples reads
samples [consumed + (m*dp + r)*mbs, + mbs). Any split of a global batch into (mbs, dp) thus
covers the same samples exactly once, and every TP rank and pipeline stage of one replica reads
the same ones, so equal-loss comparisons between layouts hold sample for sample.

Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conf.schema import ParallelismConfig


class LayoutError(ValueError):
    """Degrees that no whole layout of the given world size has; the message names the fields."""


def _positive_int(value: object) -> bool:
    # bool is an int subclass, and True would otherwise pass as a degree of 1.
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class Coords:
    """A rank's position on the (pp, dp, tp) mesh."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """Data-, tensor- and pipeline-parallel degrees of one run (devices = dp x tp x pp)."""

    dp: int = 1
    """Model replicas."""
    tp: int = 1
    """Devices that split each layer's matrices."""
    pp: int = 1
    """Pipeline stages."""

    def __post_init__(self) -> None:
        bad = {k: v for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if not _positive_int(v)}
        if bad:
            listed = ", ".join(f"parallelism.{k}={v!r}" for k, v in bad.items())
            raise LayoutError(f"{listed}: parallel degrees are whole numbers of devices, at least 1")

    @classmethod
    def of(cls, par: ParallelismConfig, world_size: int | None = None) -> Layout:
        """The layout of `par` on `world_size` devices.

        An explicit parallelism.dp wins (it must then agree with the world size); without it dp is
        world_size / (tp x pp), and 1 while the world size is not known (a dry run). Raises
        LayoutError when no whole dp fits; the rule `world_size` says the same as a Violation.
        """
        if not (_positive_int(par.tp) and _positive_int(par.pp)):
            raise LayoutError(f"parallelism.tp={par.tp!r} and parallelism.pp={par.pp!r} must be positive integers")
        model_parallel = par.tp * par.pp
        if par.dp is not None and not _positive_int(par.dp):
            raise LayoutError(f"parallelism.dp={par.dp!r} must be a positive integer (or null to derive it)")
        if world_size is None:
            return cls(dp=par.dp or 1, tp=par.tp, pp=par.pp)
        if not _positive_int(world_size):
            raise LayoutError(f"world_size={world_size!r} must be a positive integer")
        if par.dp is not None:
            if par.dp * model_parallel != world_size:
                raise LayoutError(
                    f"world_size={world_size} does not equal parallelism.dp x tp x pp = "
                    f"{par.dp} x {par.tp} x {par.pp} = {par.dp * model_parallel}"
                )
            return cls(dp=par.dp, tp=par.tp, pp=par.pp)
        if world_size % model_parallel:
            raise LayoutError(
                f"world_size={world_size} is not a multiple of tp x pp = {par.tp} x {par.pp} = {model_parallel}"
            )
        return cls(dp=world_size // model_parallel, tp=par.tp, pp=par.pp)

    @property
    def world_size(self) -> int:
        """Devices (processes) of the run."""
        return self.dp * self.tp * self.pp

    @property
    def model_parallel(self) -> int:
        """Devices one model replica spans (tp x pp)."""
        return self.tp * self.pp

    def fills_whole_nodes(self, devices_per_node: int) -> bool:
        """Whether the run fits in one node or fills whole nodes of `devices_per_node` devices
        (Slurm gives every node of a job the same number of tasks)."""
        return self.world_size <= devices_per_node or self.world_size % devices_per_node == 0

    def placement(self, devices_per_node: int) -> tuple[int, int]:
        """(nodes, devices used per node): one partial node for a run smaller than a node, else
        whole nodes. Raises LayoutError when the run does not fill whole nodes (rule `whole_nodes`)."""
        if not _positive_int(devices_per_node):
            raise LayoutError(f"hardware.devices_per_node={devices_per_node!r} must be a positive integer")
        if self.world_size <= devices_per_node:
            return 1, self.world_size
        if not self.fills_whole_nodes(devices_per_node):
            raise LayoutError(
                f"dp x tp x pp = {self.world_size} devices do not fill whole nodes of "
                f"hardware.devices_per_node={devices_per_node}"
            )
        return self.world_size // devices_per_node, devices_per_node

    def nodes(self, devices_per_node: int) -> int:
        """Nodes the run occupies (a partial node counts as one; never raises)."""
        return math.ceil(self.world_size / max(devices_per_node, 1))

    def coords(self, rank: int) -> Coords:
        """Mesh position of global rank `rank` (TP fastest, then DP, then PP)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size}")
        return Coords(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    def micro_batches(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches each replica runs per step (the rules make the division exact)."""
        return global_batch_size // (micro_batch_size * self.dp)

    def sample_indices(
        self, rank: int, *, consumed: int, global_batch_size: int, micro_batch_size: int
    ) -> list[range]:
        """Global sample indices of rank `rank`'s micro-batches for the step after `consumed` samples."""
        dp, mbs, r = self.dp, micro_batch_size, self.coords(rank).dp
        return [
            range(consumed + (m * dp + r) * mbs, consumed + (m * dp + r + 1) * mbs)
            for m in range(self.micro_batches(global_batch_size, mbs))
        ]

    def label(self) -> str:
        """'dp2-tp1-pp4': the degrees as names and directories show them."""
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}"


@dataclass(frozen=True)
class Rank:
    """One process of a run: its layout, its global rank and its rank on its node."""

    layout: Layout = Layout()
    global_rank: int = 0
    local_rank: int = 0

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.global_rank)

    @property
    def lead(self) -> bool:
        """Rank 0 prints, logs to W&B and writes the record; the others train quietly."""
        return self.global_rank == 0


def shown_dp(par: ParallelismConfig, world_size: int | None) -> int:
    """The dp a table shows for a config, also one the rules rejected: the explicit dp, else the
    whole dp the world size gives, else 1. Never raises (Layout.of is the checked answer)."""
    if _positive_int(par.dp):
        assert par.dp is not None
        return par.dp
    if world_size is None or not (_positive_int(par.tp) and _positive_int(par.pp)):
        return 1
    return max(1, world_size // (par.tp * par.pp))
