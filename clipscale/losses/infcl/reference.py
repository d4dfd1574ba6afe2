"""The Inf-CL tile primitives in plain PyTorch (any device), to the contract in
`clipscale.losses.infcl` (see its docstring for the exact math).

A block [m, d] x [n, d] is walked in tiles of at most `tile_size` rows and
columns, so the largest intermediate is a few [tile, tile] float32 tensors,
never [m, n]. Each tile's logits are recomputed from the features:

    x = scale * I_tile @ T_tile.T          (float32 accumulation)
    lse_pass:   row_lse <- logaddexp(row_lse, lse over the tile's columns)
                col_lse <- logaddexp(col_lse, lse over the tile's rows)
    grad_pass:  G = row_weight * exp(x - row_lse) + col_weight * exp(x - col_lse)
                    - positive_weight_i [j == partner_i]        (with positive=...)
                grad_image += scale * G @ T_tile ;  grad_text += scale * G.T @ I_tile
                scale_grad += sum G * (I_tile @ T_tile.T)      (with scale_grad=...)
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from clipscale.losses.infcl.precision import tf32_allowed

TILE_SIZE = 1024


def _spans(total: int, tile_size: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile_size, total)) for start in range(0, total, tile_size)]


def _matmul_precision(exact: bool):
    """exact=True: full fp32 products (no TF32) for float32 inputs; else PyTorch's setting."""
    return tf32_allowed(False) if exact else nullcontext()


class _Tiles:
    """The tiles of one block and their logits, masked on the global diagonal if asked."""

    def __init__(self, image, text, scale, row_offset, col_offset, mask_diagonal, tile_size):
        self.image, self.text, self.scale = image, text, scale
        self.row_offset, self.col_offset, self.mask_diagonal = row_offset, col_offset, mask_diagonal
        self.rows, self.cols = _spans(len(image), tile_size), _spans(len(text), tile_size)

    def __iter__(self):
        """Yields (row span, column span, image tile, text tile, raw dots, logits, mask or None)."""
        for r0, r1 in self.rows:
            # bf16/fp16 products are exact in float32, so upcasting tile by tile
            # gives float32 accumulation without ever holding a float32 copy of a block.
            image_tile = self.image[r0:r1].float()
            for c0, c1 in self.cols:
                text_tile = self.text[c0:c1].float()
                raw = image_tile @ text_tile.T
                logits = self.scale * raw
                mask = self._diagonal(r0, r1, c0, c1, logits.device)
                if mask is not None:
                    logits = logits.masked_fill(mask, float("-inf"))
                yield (r0, r1), (c0, c1), image_tile, text_tile, raw, logits, mask

    def _diagonal(self, r0, r1, c0, c1, device):
        rows = range(self.row_offset + r0, self.row_offset + r1)  # global indices
        cols = range(self.col_offset + c0, self.col_offset + c1)
        if not self.mask_diagonal or max(rows.start, cols.start) >= min(rows.stop, cols.stop):
            return None  # this tile does not touch the global diagonal
        return torch.tensor(rows, device=device)[:, None] == torch.tensor(cols, device=device)[None, :]


def lse_pass(
    image, text, scale, *, row_offset=0, col_offset=0, mask_diagonal=False, need_col=True, exact=False,
    tile_size=TILE_SIZE,
):
    """(row_lse [m], col_lse [n] or None), float32, over this block only."""
    row_lse = torch.full((len(image),), float("-inf"), device=image.device)
    col_lse = torch.full((len(text),), float("-inf"), device=text.device) if need_col else None
    with _matmul_precision(exact):
        for (r0, r1), (c0, c1), _, _, _, logits, _ in _Tiles(
            image, text, scale, row_offset, col_offset, mask_diagonal, tile_size
        ):
            row_lse[r0:r1] = torch.logaddexp(row_lse[r0:r1], logits.logsumexp(1))
            if need_col:
                col_lse[c0:c1] = torch.logaddexp(col_lse[c0:c1], logits.logsumexp(0))
    return row_lse, col_lse


def grad_pass(
    image, text, scale, row_lse, col_lse, row_weight, col_weight, *, row_offset=0, col_offset=0,
    mask_diagonal=False, grad_image=None, grad_text=None, exact=False, positive=None, scale_grad=None,
    out_dtype=None, tile_size=TILE_SIZE,
):
    """(grad_image [m, d], grad_text [n, d]) float32 (or fresh `out_dtype` tensors where
    None was passed), accumulated in place when given; see the package contract."""
    fresh = grad_image is None and grad_text is None
    if grad_image is None:
        grad_image = torch.zeros(image.shape, dtype=torch.float32, device=image.device)
    if grad_text is None:
        grad_text = torch.zeros(text.shape, dtype=torch.float32, device=text.device)
    if positive is not None:
        partner, positive_weight = positive
    with _matmul_precision(exact):
        for (r0, r1), (c0, c1), image_tile, text_tile, raw, logits, mask in _Tiles(
            image, text, scale, row_offset, col_offset, mask_diagonal, tile_size
        ):
            g = torch.zeros_like(logits)
            if row_weight is not None:
                g = g + row_weight[r0:r1, None] * torch.exp(logits - row_lse[r0:r1, None])
            if col_weight is not None:
                g = g + col_weight[None, c0:c1] * torch.exp(logits - col_lse[None, c0:c1])
            if mask is not None:
                g = g.masked_fill(mask, 0.0)  # exp(-inf - lse) is 0 unless a whole row is masked
            if positive is not None:  # -pw_i at (i, partner_i) where that column is in this tile
                cols = partner[r0:r1] - c0
                hit = (cols >= 0) & (cols < c1 - c0)
                rows = torch.arange(r1 - r0, device=g.device)[hit]
                g[rows, cols[hit]] -= positive_weight[r0:r1][hit]
            if scale_grad is not None:
                scale_grad += (g * raw).sum()
            grad_image[r0:r1] += scale * (g @ text_tile)
            grad_text[c0:c1] += scale * (g.T @ image_tile)
    if fresh and out_dtype is not None and out_dtype != torch.float32:
        grad_image, grad_text = grad_image.to(out_dtype), grad_text.to(out_dtype)
    return grad_image, grad_text


def positive_logits(image, text, partner):
    """<image_i, text_partner[i]> for every row, float32 [m] (multiply by the scale for the logits)."""
    return (image.float() * text[partner].float()).sum(1)
