"""What a rank holds of a tensor: a DTensor's local shard, or a plain tensor itself.

torch.distributed.tensor costs about a second of start-up, which every process without TP would
pay: it is imported where it is used, and no DTensor can exist before its module is imported, so
an unimported module answers "no" here without importing it.
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(t: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's shard, a plain tensor itself)."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def is_tp_sharded(t: torch.Tensor) -> bool:
    """A DTensor split over its mesh (its local shard is one part of a larger tensor)."""
    return is_dtensor(t) and any(pl.is_shard() for pl in t.placements)  # type: ignore[attr-defined]
