"""Pipeline parallelism's schedule: Megatron-LM's 1F1B over point-to-point sends.

A stage runs `warmup = min(pp - stage - 1, m)` forwards, then alternates one forward and one
backward, then drains the remaining backwards. Stage i therefore holds at most min(pp - i, m)
micro-batches in flight, and only those: each one's input (the received activation, which its
first layer saves anyway) and its output (kept as the root of its backward). With fewer
micro-batches than stages the warm-up covers all of them: all forwards, then all backwards.

torch.distributed.pipelining, which megasweep used before, allocates a receive buffer for every
micro-batch of a step for the activations and another for their gradients, and keeps each one's
input gradient until the next step: at BLOOM's 512 micro-batches per step that is about 180 GB
per stage. Here a received tensor lives only while its micro-batch is in flight.

Every exchange between two neighbouring stages is a matched pair (one sends, the other receives
the same shape in the same order), posted together with `batch_isend_irecv` where a stage both
sends and receives, as Megatron's p2p_communication does, so no order of blocking calls can deadlock.
The activations crossing a stage boundary are the residual stream: [b, s, h] fp32 under every
precision (the embeddings are fp32, and autocast's 16-bit outputs promote when added to it).

With parallelism.virtual_stages > 1, `interleaved_one_f_one_b` runs Megatron's interleaved
schedule over the rank's model chunks instead: the order of work and the matched exchanges come
from train.planner.schedule (torch-free, so the planner's memory and time models read the same
schedule), and a micro-batch wraps from the last rank back to the first for its next chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from train.planner.schedule import Message, Unit, rank_plan, receiver

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StageLinks:
    """Where a stage's activations come from and go to."""

    stage: int
    num_stages: int
    group: dist.ProcessGroup
    """The pipeline group (its ranks are the stages, in order)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)


def one_f_one_b(
    stage_module: nn.Module,
    batches: Sequence[Batch],
    *,
    links: StageLinks,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shape: tuple[int, ...],
    device: torch.device,
) -> list[torch.Tensor]:
    """Forward and backward of every micro-batch of a step on this stage; the last stage returns the
    (detached) loss of each micro-batch as `loss_fn` gave it, the other stages an empty list."""
    m = len(batches)
    warmup = min(links.num_stages - links.stage - 1, m)
    comm = _Comm(links, activation_shape, device)
    in_flight: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()
    losses: list[torch.Tensor] = []

    def forward(index: int, x: torch.Tensor | None) -> torch.Tensor:
        tokens, labels = batches[index]
        out = stage_module(tokens if links.is_first else x)
        if links.is_last:
            loss = loss_fn(out, labels)
            losses.append(loss.detach())
            return loss
        return out

    def backward(dy: torch.Tensor | None) -> torch.Tensor | None:
        x, y = in_flight.popleft()
        torch.autograd.backward(y, grad_tensors=None if links.is_last else dy)
        return None if x is None else x.grad

    for i in range(warmup):
        x = comm.recv_forward()
        y = forward(i, x)
        comm.send_forward(y)
        in_flight.append((x, y))
    x = comm.recv_forward() if m > warmup else None
    for i in range(warmup, m):
        y = forward(i, x)
        dy = comm.send_forward_recv_backward(y)
        in_flight.append((x, y))
        dx = backward(dy)
        x = comm.send_backward_recv_forward(dx, last=i == m - 1)
    for _ in range(warmup):
        dy = comm.recv_backward()
        comm.send_backward(backward(dy))
    return losses


def interleaved_one_f_one_b(
    stage_module: nn.Module,
    batches: Sequence[Batch],
    *,
    links: StageLinks,
    virtual_stages: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shape: tuple[int, ...],
    device: torch.device,
) -> list[torch.Tensor]:
    """one_f_one_b over `virtual_stages` model chunks per rank (train.planner.schedule): chunk c of
    this rank is called as stage_module(x, chunk=c). The rank holding the last virtual stage
    returns the (detached) loss of each micro-batch, in micro-batch order; the others []."""
    pp, rank, v = links.num_stages, links.stage, virtual_stages
    ticks = rank_plan(rank=rank, pp=pp, virtual_stages=v, micro_batches=len(batches))
    first = 0 if rank == 0 else None  # the chunk fed by token ids, on rank 0 only
    last = v - 1 if rank == pp - 1 else None  # the chunk that ends in the loss, on the last rank only
    received: dict[tuple[bool, Unit], torch.Tensor] = {}
    """Inputs (False) and output gradients (True) that arrived, by the unit that consumes them."""
    in_flight: dict[Unit, tuple[torch.Tensor | None, torch.Tensor]] = {}
    outgoing: dict[Message, torch.Tensor] = {}
    losses: list[torch.Tensor] = []

    def forward(u: Unit) -> None:
        tokens, labels = batches[u.micro_batch]
        x = None if u.chunk == first else received.pop((False, u))
        out = stage_module(tokens if x is None else x, chunk=u.chunk)
        if u.chunk == last:
            out = loss_fn(out, labels)
            losses.append(out.detach())
        else:
            outgoing[Message(False, u.micro_batch, u.chunk * pp + rank)] = out.detach()
        in_flight[u] = (x, out)

    def backward(u: Unit) -> None:
        x, y = in_flight.pop(u)
        dy = None if u.chunk == last else received.pop((True, u))
        torch.autograd.backward(y, grad_tensors=dy)
        if x is not None:
            assert x.grad is not None
            outgoing[Message(True, u.micro_batch, u.chunk * pp + rank)] = x.grad

    for tick in ticks:
        for is_backward, u in tick.work:
            (backward if is_backward else forward)(u)
        recvs = [(torch.empty(activation_shape, dtype=torch.float32, device=device), msg, src) for msg, src in tick.recvs]
        ops = [dist.P2POp(dist.isend, outgoing.pop(msg).contiguous(), links.peer(to), links.group) for msg, to in tick.sends]
        ops += [dist.P2POp(dist.irecv, buf, links.peer(src), links.group) for buf, _, src in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buf, msg, _ in recvs:
            received[(msg.grad, receiver(msg, pp=pp))] = buf if msg.grad else buf.requires_grad_()
    assert not (received or in_flight or outgoing), "the interleaved schedule left work undone"
    return losses


class _Comm:
    """The point-to-point exchanges of one stage with its neighbours (no-ops at the pipeline's ends)."""

    def __init__(self, links: StageLinks, shape: tuple[int, ...], device: torch.device) -> None:
        self.links, self.shape, self.device = links, shape, device
        self.prev = None if links.is_first else links.peer(links.stage - 1)
        self.next = None if links.is_last else links.peer(links.stage + 1)

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=torch.float32, device=self.device)

    def _run(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, self.links.group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, self.links.group) for t, peer in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def recv_forward(self) -> torch.Tensor | None:
        if self.prev is None:
            return None
        x = self._empty()
        self._run([], [(x, self.prev)])
        return x.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if self.next is not None:
            self._run([(y.detach(), self.next)], [])

    def recv_backward(self) -> torch.Tensor | None:
        if self.next is None:
            return None
        dy = self._empty()
        self._run([], [(dy, self.next)])
        return dy

    def send_backward(self, dx: torch.Tensor | None) -> None:
        if self.prev is not None:
            assert dx is not None
            self._run([(dx, self.prev)], [])

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        if self.next is None:
            return None
        dy = self._empty()
        self._run([(y.detach(), self.next)], [(dy, self.next)])
        return dy

    def send_backward_recv_forward(self, dx: torch.Tensor | None, *, last: bool) -> torch.Tensor | None:
        """Send this micro-batch's input gradient back, and (unless it was the step's last forward
        already) receive the next micro-batch's input."""
        if self.prev is None:
            return None
        assert dx is not None
        if last:
            self._run([(dx, self.prev)], [])
            return None
        x = self._empty()
        self._run([(dx, self.prev)], [(x, self.prev)])
        return x.requires_grad_()
