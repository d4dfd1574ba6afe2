"""Combining per-rank evaluation results: one collective per evaluation.

Ranks add up *counts* (never averages), so the result is exact and identical
on every rank whatever the split. Rows are concatenated in rank order, so if
each rank holds a contiguous block of the dataset (see
`clipscale.eval.datasets.rank_shard`) the concatenation is the dataset order
and tie-breaking by index matches a single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clipscale.distributed import is_distributed


def sum_over_ranks(counts: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        counts = counts.clone()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts


def concat_over_ranks(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's `rows` ([n_r, ...], n_r may differ) concatenated in rank order."""
    if not is_distributed():
        return rows
    world = dist.get_world_size()
    size = torch.tensor([rows.shape[0]], device=rows.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    sizes = [int(s) for s in sizes]
    # all_gather needs equal shapes: pad to the largest part, trim after.
    padded = rows.new_zeros((max(sizes), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def offset_of_this_rank(count: int, device) -> int:
    """The sum of `count` over lower ranks: where this rank's block starts in the concatenation."""
    if not is_distributed():
        return 0
    counts = concat_over_ranks(torch.tensor([count], device=device))
    return int(counts[: dist.get_rank()].sum())
