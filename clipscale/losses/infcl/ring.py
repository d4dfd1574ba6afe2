"""Inf-CL's ring (Algorithm 1 of the paper): every rank's text block visits every rank.

At step k rank r holds the block of rank (r - k) mod world. While it works on
that block, the block moves on to rank r + 1 and the next one arrives from
rank r - 1 (one `batch_isend_irecv`), so communication hides behind compute.

Each visit may produce a *partial* result for the visiting block (its column
LSE over this rank's images in the forward, its text gradient from this rank's
images in the backward). Partials travel one step behind their block: the
running total for the block in hand arrives from rank r - 1 during the visit,
is combined with this rank's partial after it, and leaves for rank r + 1
during the next visit. After `world` visits the last block in hand has been
seen by every rank; one final exchange sends each total home.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from clipscale.distributed import rank_and_world


class _Ring:
    def __init__(self, group):
        self.group = group
        self.rank, self.world = rank_and_world(group)
        self.next = self._global_rank((self.rank + 1) % self.world)
        self.previous = self._global_rank((self.rank - 1) % self.world)

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def start_shift(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Send `tensors` to the next rank, receive the previous rank's into new buffers.

        Returns the buffers and the requests to wait on. Every tensor gets its own
        tag so that sends to the same peer cannot be matched out of order.
        """
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag) for tag, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, buf, self.previous, self.group, tag) for tag, buf in enumerate(received)]
        return received, dist.batch_isend_irecv(ops) if ops else []


def circulate(
    block: Sequence[torch.Tensor],
    visit: Callable[..., torch.Tensor | None],
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group=None,
) -> torch.Tensor | None:
    """Show this rank's `block` to every rank; return the combined partials for it.

    visit(owner, *visiting_block) is called once per rank's block (owner = its
    group rank), in ring order, and returns a partial result for that block or
    None (then nothing travels back). combine(a, b) merges two partials.
    """
    ring = _Ring(group)
    total = None  # running total of the partials for the block in hand
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        # One batch: the block moves on (unless every rank has seen it), and the
        # total for the previous block leaves while the total for this one arrives.
        outgoing = [*block] if step < ring.world - 1 else []
        if total is not None:
            outgoing.append(total)
        received, requests = ring.start_shift(outgoing)
        partial = visit(owner, *block)
        for request in requests:
            request.wait()
        total = partial if total is None else combine(partial, received.pop())
        block = received
    if total is None or ring.world == 1:
        return total
    # The block in hand (that of rank r + 1) has visited every rank: send its total home.
    (home,), requests = ring.start_shift([total])
    for request in requests:
        request.wait()
    return home
