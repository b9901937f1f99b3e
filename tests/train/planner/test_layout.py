"""train.planner.layout: one value for the degrees, the world size, a rank's place and its samples."""

from __future__ import annotations

import pytest

from conf.schema import ParallelismConfig
from train.planner.layout import Coords, Layout, LayoutError, Rank, shown_dp


def test_dp_is_explicit_or_derived_from_the_world() -> None:
    assert Layout.of(ParallelismConfig(tp=2, pp=2), 8) == Layout(dp=2, tp=2, pp=2)
    assert Layout.of(ParallelismConfig(tp=2, pp=2, dp=2), 8).dp == 2
    # Without a world (a dry run) dp is the config's, or 1.
    assert Layout.of(ParallelismConfig(tp=2)).world_size == 2
    assert Layout.of(ParallelismConfig(tp=2, dp=3)).world_size == 6
    with pytest.raises(LayoutError, match="does not equal"):
        Layout.of(ParallelismConfig(tp=2, dp=3), 8)
    with pytest.raises(LayoutError, match="not a multiple"):
        Layout.of(ParallelismConfig(tp=3), 8)
    with pytest.raises(LayoutError, match="parallelism.tp=0"):
        Layout(tp=0)


def test_shown_dp_never_raises() -> None:
    assert shown_dp(ParallelismConfig(tp=3), 8) == 2
    assert shown_dp(ParallelismConfig(tp=0), 8) == 1
    assert shown_dp(ParallelismConfig(dp=4), None) == 4


def test_megatron_rank_order_tp_fastest_then_dp_then_pp() -> None:
    layout = Layout(dp=2, tp=2, pp=2)
    assert [layout.coords(r) for r in (0, 1, 2, 5, 7)] == [
        Coords(pp=0, dp=0, tp=0),
        Coords(pp=0, dp=0, tp=1),
        Coords(pp=0, dp=1, tp=0),
        Coords(pp=1, dp=0, tp=1),
        Coords(pp=1, dp=1, tp=1),
    ]
    assert Rank(layout, global_rank=5).coords == Coords(1, 0, 1) and not Rank(layout, global_rank=5).lead
    with pytest.raises(LayoutError):
        layout.coords(8)


def test_placement_fills_whole_nodes() -> None:
    assert Layout(tp=2).placement(8) == (1, 2)  # part of one node
    assert Layout(dp=2, tp=8, pp=2).placement(8) == (4, 8)
    assert not Layout(tp=4, pp=3).fills_whole_nodes(8)
    with pytest.raises(LayoutError, match="whole nodes"):
        Layout(tp=4, pp=3).placement(8)
    assert Layout(tp=4, pp=3).nodes(8) == 2


def test_micro_batches_cover_the_global_batch_once() -> None:
    one = Layout()
    ranges = one.sample_indices(0, consumed=16, global_batch_size=8, micro_batch_size=2)
    assert [list(r) for r in ranges] == [[16, 17], [18, 19], [20, 21], [22, 23]]
    # Two DP ranks interleave micro-batches and together cover the same 8 samples.
    two = [Layout(dp=2).sample_indices(r, consumed=0, global_batch_size=8, micro_batch_size=2) for r in (0, 1)]
    assert sorted(i for rank in two for r in rank for i in r) == list(range(8))


def test_tp_and_pp_ranks_of_a_replica_read_the_same_samples() -> None:
    # world 8 = pp2 x dp2 x tp2; rank = (pp * dp + d) * tp + t; gbs 8, mbs 2.
    layout = Layout(dp=2, tp=2, pp=2)

    def indices(rank: int) -> list[list[int]]:
        return [list(r) for r in layout.sample_indices(rank, consumed=0, global_batch_size=8, micro_batch_size=2)]

    assert indices(0) == indices(1) == indices(4) == indices(5)  # dp 0: TP pair, both stages
    assert indices(2) == indices(3) == indices(6) == indices(7)  # dp 1
    assert sorted(i for r in (0, 2) for mb in indices(r) for i in mb) == list(range(8))
