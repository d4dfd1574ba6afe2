"""Where the right answer lands in a ranking, with ties broken one documented way.

Tie rule (used by every metric in clipscale.eval): candidates are ordered by
descending score and, among equal scores, by ascending candidate index, i.e.
the order of a *stable* descending sort. `torch.topk` gives no such promise
(CLIP_benchmark uses it, so on exactly tied scores the two may differ; on
real models exact ties essentially never happen).

The rank of the target is computed by counting, not sorting:
    rank = #{j : s_j > s_t} + #{j < t : s_j == s_t}
and "target in the top k" is `rank < k`. This costs one pass over the scores
and gives the same answer as the stable sort.
"""

from __future__ import annotations

import torch

# Rows per chunk are chosen so one chunk's comparison matrix stays near this many elements.
_CHUNK_ELEMENTS = 1 << 24


def target_rank(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """0-based rank of `target[i]` among `scores[i]` under the tie rule above.

    scores: [n, m] float; target: [n] long in [0, m). Returns [n] long.
    """
    n, m = scores.shape
    if target.numel() and (target.min() < 0 or target.max() >= m):
        raise ValueError(f"targets must lie in [0, {m}); got values in [{target.min()}, {target.max()}]")
    candidate = torch.arange(m, device=scores.device)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(m, 1))
    ranks = []
    for start in range(0, n, rows_per_chunk):
        s = scores[start : start + rows_per_chunk]
        t = target[start : start + rows_per_chunk, None]
        s_t = s.gather(1, t)
        ahead = (s > s_t) | ((s == s_t) & (candidate < t))
        ranks.append(ahead.sum(dim=1))
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long, device=scores.device)

