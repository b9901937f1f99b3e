"""The interleaved 1F1B pipeline schedule (Narayanan et al. 2021, section 2.2), as plain arithmetic.

With `v` = parallelism.virtual_stages > 1 each of the `pp` pipeline ranks holds v model chunks:
chunk c of rank r is virtual stage c*pp + r, the (c*pp + r)-th of pp*v equal blocks of layers. A
micro-batch goes through rank 0, 1, ..., pp-1 with chunk 0, then wraps from the last rank back to
the first for chunk 1, and so on; the bubble shrinks v-fold ((p-1)/(v*m) of the step instead of
(p-1)/m) at the price of v times as many point-to-point exchanges.

A rank's order of work follows Megatron-LM's interleaved schedule: its k-th forward is micro-batch
(k // (pp*v))*pp + k % pp on chunk (k // pp) % v, so groups of pp micro-batches go through chunk
0, then chunk 1, ...; backwards go the same way with the chunks reversed. It runs
`warmup_forwards` forwards, then alternates one forward and one backward, then drains the
backwards. This needs the micro-batch count m to be a multiple of pp (rule
`interleaved_micro_batches`).

The exchanges are matched by a clock (`rank_plan`): every rank's work is placed on shared ticks
by simulating all ranks at once (a unit runs at the first tick after its input arrived, in the
rank's order, at most one forward and one backward per tick), and what a rank computes at tick i
it sends at the end of tick i, where its neighbour receives it in its own tick-i exchange. Each
exchange therefore pairs with exchanges of the same tick only, so no order of blocking waits can
deadlock; inside an exchange, sends and receives are sorted by message, so two ranks that both
send and receive each other (pp = 2: the next rank is also the previous one) post them in the
same order, as backends without tags (NCCL) match them.

train.pipeline runs this plan; train.planner.memory and perf read its in-flight counts and its
bubble. Torch-free.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from train.planner.inventory import stage_layers


@dataclass(frozen=True, order=True)
class Unit:
    """One micro-batch through one model chunk of a rank."""

    micro_batch: int
    chunk: int


@dataclass(frozen=True, order=True)
class Message:
    """A tensor crossing a rank boundary: the output of (micro_batch, virtual stage `source`)
    forward, or the input gradient of its backward (`grad`)."""

    grad: bool
    micro_batch: int
    source: int
    """The sending virtual stage (chunk * pp + rank)."""


@dataclass(frozen=True)
class Tick:
    """One rank's work at one tick of the clock: compute, then one exchange with its neighbours."""

    work: tuple[tuple[bool, Unit], ...]
    """(is_backward, unit) in the order the rank runs them: at most one forward and one backward."""
    sends: tuple[tuple[Message, int], ...]
    """(message, destination rank), in message order."""
    recvs: tuple[tuple[Message, int], ...]
    """(message, source rank), in message order."""


def chunk_layers(num_layers: int, *, rank: int, chunk: int, pp: int, virtual_stages: int) -> range:
    """Layer indices of chunk `chunk` on pipeline rank `rank`: virtual stage chunk*pp + rank."""
    return stage_layers(num_layers, stage=chunk * pp + rank, num_stages=pp * virtual_stages)


def rank_layers(num_layers: int, *, rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Every layer a pipeline rank holds, chunk by chunk."""
    return [
        i
        for c in range(virtual_stages)
        for i in chunk_layers(num_layers, rank=rank, chunk=c, pp=pp, virtual_stages=virtual_stages)
    ]


def forward_unit(k: int, *, pp: int, virtual_stages: int) -> Unit:
    """A rank's k-th forward (module docstring)."""
    group, within = divmod(k, pp * virtual_stages)
    return Unit(group * pp + within % pp, within // pp)


def backward_unit(k: int, *, pp: int, virtual_stages: int) -> Unit:
    """A rank's k-th backward: the forwards' order with the chunks reversed."""
    u = forward_unit(k, pp=pp, virtual_stages=virtual_stages)
    return Unit(u.micro_batch, virtual_stages - 1 - u.chunk)


def warmup_forwards(*, rank: int, pp: int, virtual_stages: int, micro_batches: int) -> int:
    """Forwards before a rank's first backward (Megatron-LM's interleaved schedule).

    The first forward of chunk v-1 on the last rank waits for (v-1)*pp forwards of it; rank r, two
    hops of latency (a forward and the backward coming back) per rank after it, starts its first
    backward 2*(pp-1-r) forwards later. With as many micro-batches as ranks every forward comes
    first, as Megatron does."""
    total = micro_batches * virtual_stages
    if micro_batches == pp:
        return total
    return min(total, 2 * (pp - rank - 1) + (virtual_stages - 1) * pp)


def rank_order(*, rank: int, pp: int, virtual_stages: int, micro_batches: int) -> list[tuple[bool, Unit]]:
    """A rank's work in order: (is_backward, unit)."""
    total = micro_batches * virtual_stages
    warm = warmup_forwards(rank=rank, pp=pp, virtual_stages=virtual_stages, micro_batches=micro_batches)
    order = [(False, forward_unit(k, pp=pp, virtual_stages=virtual_stages)) for k in range(warm)]
    for j in range(total - warm):
        order.append((False, forward_unit(warm + j, pp=pp, virtual_stages=virtual_stages)))
        order.append((True, backward_unit(j, pp=pp, virtual_stages=virtual_stages)))
    order += [(True, backward_unit(j, pp=pp, virtual_stages=virtual_stages)) for j in range(total - warm, total)]
    return order


def receiver(msg: Message, *, pp: int) -> Unit:
    """The unit that consumes `msg` on the receiving rank: the next virtual stage's forward input,
    or the previous one's output gradient."""
    stage = msg.source - 1 if msg.grad else msg.source + 1
    return Unit(msg.micro_batch, stage // pp)


class ScheduleError(ValueError):
    """A layout the interleaved schedule cannot run (the rules reject it first)."""


@functools.lru_cache(maxsize=64)
def plan(*, pp: int, virtual_stages: int, micro_batches: int) -> tuple[tuple[Tick, ...], ...]:
    """Every rank's ticks (rank_plan), simulated together once per (pp, v, m)."""
    v, m = virtual_stages, micro_batches
    if pp < 2 or v < 1 or m < 1 or m % pp:
        raise ScheduleError(
            f"the interleaved schedule needs pp >= 2, virtual_stages >= 1 and a micro-batch count that is "
            f"a multiple of pp; got pp={pp}, virtual_stages={v}, micro-batches={m}"
        )
    last_stage = pp * v - 1
    orders = [rank_order(rank=r, pp=pp, virtual_stages=v, micro_batches=m) for r in range(pp)]
    done = [0] * pp
    # arrived[(grad, micro_batch, stage)]: the tick after whose exchange the tensor is there.
    arrived: dict[tuple[bool, int, int], int] = {}
    ticks: list[list[Tick]] = [[] for _ in range(pp)]
    tick = 0
    while any(done[r] < len(orders[r]) for r in range(pp)):
        computed: list[list[tuple[bool, Unit]]] = [[] for _ in range(pp)]
        for r in range(pp):
            kinds: set[bool] = set()
            while done[r] < len(orders[r]):
                backward, u = orders[r][done[r]]
                stage = u.chunk * pp + r
                if backward in kinds:
                    break  # at most one forward and one backward per tick
                needs = (backward, u.micro_batch, stage)
                ends = stage == last_stage if backward else stage == 0
                if not ends and arrived.get(needs, tick) >= tick:
                    break
                computed[r].append((backward, u))
                kinds.add(backward)
                done[r] += 1
        if not any(computed):  # nothing new is sent, so nothing would ever change
            raise ScheduleError(f"the interleaved schedule stalled (pp={pp}, virtual_stages={v}, m={m})")
        sends: list[list[tuple[Message, int]]] = [[] for _ in range(pp)]
        recvs: list[list[tuple[Message, int]]] = [[] for _ in range(pp)]
        for r in range(pp):
            for backward, u in computed[r]:
                stage = u.chunk * pp + r
                if (stage == 0) if backward else (stage == last_stage):
                    continue  # the loss, or the first embedding: nothing goes on
                to = (r - 1) % pp if backward else (r + 1) % pp
                msg = Message(backward, u.micro_batch, stage)
                sends[r].append((msg, to))
                recvs[to].append((msg, r))
                arrived[(backward, u.micro_batch, stage - 1 if backward else stage + 1)] = tick
        for r in range(pp):
            ticks[r].append(Tick(tuple(computed[r]), tuple(sorted(sends[r])), tuple(sorted(recvs[r]))))
        tick += 1
    return tuple(tuple(t) for t in ticks)


def rank_plan(*, rank: int, pp: int, virtual_stages: int, micro_batches: int) -> tuple[Tick, ...]:
    """Rank `rank`'s ticks of one step (module docstring): compute at tick i, then exchange what
    it and its neighbours computed at tick i. Ticks with nothing to do are kept (empty)."""
    return plan(pp=pp, virtual_stages=virtual_stages, micro_batches=micro_batches)[rank]


@functools.lru_cache(maxsize=1 << 12)
def in_flight_peaks(*, rank: int, pp: int, virtual_stages: int, micro_batches: int) -> tuple[tuple[int, int, int], ...]:
    """The rank's in-flight units just after each forward, as distinct (all, chunk 0, chunk v-1)
    counts that no other moment exceeds in every count: the activations the rank holds at its
    peak, whichever chunk carries more (the embedding on the first rank's chunk 0, the head on the
    last rank's chunk v-1). Needs no multiple of pp (the planner asks for any layout)."""
    v = virtual_stages
    counts = [0] * v
    seen: set[tuple[int, int, int]] = set()
    for backward, u in rank_order(rank=rank, pp=pp, virtual_stages=v, micro_batches=micro_batches):
        counts[u.chunk] += -1 if backward else 1
        if not backward:
            seen.add((sum(counts), counts[0], counts[-1]))
    return tuple(sorted(p for p in seen if not any(q != p and all(a >= b for a, b in zip(q, p, strict=True)) for q in seen)))


def bubble_slots(*, pp: int, virtual_stages: int) -> float:
    """Idle time of the step in micro-batch slots of a whole stage: (pp - 1) / virtual_stages
    (Narayanan et al. 2021: bubble fraction (p-1)/(v*m) with v chunks per device)."""
    return (pp - 1) / virtual_stages


__all__ = [
    "Message",
    "ScheduleError",
    "Tick",
    "Unit",
    "backward_unit",
    "bubble_slots",
    "chunk_layers",
    "forward_unit",
    "in_flight_peaks",
    "plan",
    "rank_layers",
    "rank_order",
    "rank_plan",
    "receiver",
    "warmup_forwards",
]
