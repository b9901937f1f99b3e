"""train.planner.schedule: the interleaved 1F1B plan, checked by replaying every rank's exchanges."""

from __future__ import annotations

from collections import defaultdict

import pytest

from train.planner.schedule import (
    Message,
    ScheduleError,
    Unit,
    chunk_layers,
    in_flight_peaks,
    plan,
    rank_layers,
    receiver,
)

LAYOUTS = [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 6), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16)]


@pytest.mark.parametrize(("pp", "v", "m"), LAYOUTS)
def test_every_exchange_pairs_with_its_neighbours_exchange_of_the_same_tick(pp: int, v: int, m: int) -> None:
    ticks = plan(pp=pp, virtual_stages=v, micro_batches=m)
    assert len({len(t) for t in ticks}) == 1  # one clock for all ranks
    for i in range(len(ticks[0])):
        # What rank a sends rank b at tick i is what b receives from a at tick i, in the same order
        # (FIFO matching without tags: pp = 2 sends both directions' tensors to the same peer).
        sent: dict[tuple[int, int], list[Message]] = defaultdict(list)
        got: dict[tuple[int, int], list[Message]] = defaultdict(list)
        for r in range(pp):
            for msg, to in ticks[r][i].sends:
                sent[(r, to)].append(msg)
            for msg, src in ticks[r][i].recvs:
                got[(src, r)].append(msg)
        assert sent == got


@pytest.mark.parametrize(("pp", "v", "m"), LAYOUTS)
def test_each_unit_runs_once_after_its_input_arrived(pp: int, v: int, m: int) -> None:
    ticks = plan(pp=pp, virtual_stages=v, micro_batches=m)
    last_stage = pp * v - 1
    for r in range(pp):
        arrived: dict[tuple[bool, Unit], int] = {}
        done: dict[tuple[bool, Unit], int] = {}
        for i, tick in enumerate(ticks[r]):
            for backward, u in tick.work:
                stage = u.chunk * pp + r
                if not (stage == last_stage if backward else stage == 0):
                    assert arrived[(backward, u)] < i  # received in an earlier exchange
                if backward:
                    assert done[(False, u)] <= i  # its forward came first
                done[(backward, u)] = i
            for msg, _ in tick.recvs:
                arrived[(msg.grad, receiver(msg, pp=pp))] = i
        units = {(mb, c) for mb in range(m) for c in range(v)}
        assert {(u.micro_batch, u.chunk) for b, u in done if not b} == units
        assert {(u.micro_batch, u.chunk) for b, u in done if b} == units
        assert len(done) == 2 * m * v
    # The loss comes out in micro-batch order (the losses list is summed in that order).
    final = [u.micro_batch for t in ticks[-1] for b, u in t.work if not b and u.chunk == v - 1]
    assert final == list(range(m))


def test_chunks_take_layer_blocks_round_robin() -> None:
    # 8 layers, pp 2, v 2: rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3.
    assert [list(chunk_layers(8, rank=0, chunk=c, pp=2, virtual_stages=2)) for c in (0, 1)] == [[0, 1], [4, 5]]
    assert rank_layers(8, rank=1, pp=2, virtual_stages=2) == [2, 3, 6, 7]
    assert sorted(i for r in range(4) for i in rank_layers(24, rank=r, pp=4, virtual_stages=3)) == list(range(24))
    assert rank_layers(8, rank=1, pp=2, virtual_stages=1) == [4, 5, 6, 7]  # v = 1: the plain split


@pytest.mark.parametrize(("pp", "v"), [(2, 2), (4, 2), (4, 4), (8, 3)])
def test_first_rank_holds_one_plus_p_minus_1_over_pv_of_the_1f1b_activations(pp: int, v: int) -> None:
    # Megatron's warm-up: 2(p-1) + (v-1)p forwards, one more in the steady state. Each unit is 1/v of
    # the rank's layers, so the first rank holds (1 + (p-1)/(p*v)) times 1F1B's p micro-batches.
    m = 4 * pp
    units = max(u for u, _, _ in in_flight_peaks(rank=0, pp=pp, virtual_stages=v, micro_batches=m))
    assert units == (v + 1) * pp - 1
    assert units / v == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
    # The last rank holds fewer: its chunk v-1 backward follows its forward at once.
    assert max(u for u, _, _ in in_flight_peaks(rank=pp - 1, pp=pp, virtual_stages=v, micro_batches=m)) == (v - 1) * pp + 1


def test_micro_batches_must_come_in_groups_of_pp() -> None:
    with pytest.raises(ScheduleError, match="multiple of pp"):
        plan(pp=4, virtual_stages=2, micro_batches=6)
