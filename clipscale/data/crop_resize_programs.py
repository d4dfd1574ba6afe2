"""The two Triton programs of `crop_resize.py` (its docstring has the math and the tiling).

`crop_resize.resized_crops` takes this module from `clipscale.triton_modes.programs`, decorated
for each call's mode: compiled for the GPU, or run in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from clipscale.triton_modes import interpreting

INTERPRET = interpreting()  # the mode @triton.jit decorates these programs in, read as it reads it
BLOCK_R, BLOCK_X = (8, 64) if not INTERPRET else (4, 16)  # a program's tile: rows x output columns

# The per-image table's columns (int64 [n, TABLE]): where the image's uint8 [3, height, width]
# pixels are, its size, and its crop box.
ADDRESS, HEIGHT, WIDTH, TOP, LEFT, CROP_H, CROP_W = (tl.constexpr(k) for k in range(7))
TABLE = tl.constexpr(7)


# Chunk by chunk the largest crop and the filter's reach change: not compiled anew for each value.
@triton.jit(do_not_specialize=["max_rows", "taps"])
def rows_kernel(table, starts, weights, rows, max_rows, out_w, taps,
                BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    """rows[n, c, r, j] = sum_k weights[n, j, k] * img[n, c, top + r, left + starts[n, j] + k]."""
    nc = tl.program_id(0)
    n = nc // 3
    c = nc % 3
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(2) * BLOCK_X + tl.arange(0, BLOCK_X)
    entry = table + n * TABLE
    image = tl.load(entry + ADDRESS).to(tl.pointer_type(tl.uint8))
    height, width = tl.load(entry + HEIGHT), tl.load(entry + WIDTH)
    crop_h, crop_w = tl.load(entry + CROP_H), tl.load(entry + CROP_W)
    row_start = (c * height + tl.load(entry + TOP) + r) * width + tl.load(entry + LEFT)  # int64
    in_rows = r < crop_h
    in_cols = j < out_w
    first = tl.load(starts + n * out_w + j, mask=in_cols, other=0)
    acc = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
    for k in range(taps):
        weight = tl.load(weights + (n * out_w + j) * taps + k, mask=in_cols, other=0.0)
        column = first + k
        mask = in_rows[:, None] & (in_cols & (column < crop_w))[None, :]
        pixel = tl.load(image + row_start[:, None] + column[None, :], mask=mask, other=0)
        acc += pixel.to(tl.float32) * weight[None, :]
    tl.store(rows + (nc * max_rows + r[:, None]) * out_w + j[None, :], acc, mask=in_rows[:, None] & in_cols[None, :])


@triton.jit(do_not_specialize=["max_rows", "taps"])
def columns_kernel(rows, table, starts, weights, out, max_rows, out_h, out_w, taps,
                   BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    """out[n, c, i, j] = round(clamp(sum_k weights[n, i, k] * rows[n, c, starts[n, i] + k, j], 0, 255))."""
    nc = tl.program_id(0)
    n = nc // 3
    i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(2) * BLOCK_X + tl.arange(0, BLOCK_X)
    crop_h = tl.load(table + n * TABLE + CROP_H)
    in_rows = i < out_h
    in_cols = j < out_w
    first = tl.load(starts + n * out_h + i, mask=in_rows, other=0)
    acc = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
    for k in range(taps):
        weight = tl.load(weights + (n * out_h + i) * taps + k, mask=in_rows, other=0.0)
        row = first + k
        mask = (in_rows & (row < crop_h))[:, None] & in_cols[None, :]
        value = tl.load(rows + (nc * max_rows + row[:, None]) * out_w + j[None, :], mask=mask, other=0.0)
        acc += value * weight[:, None]
    # Ties to even, as torch.round: an integer-factor enlargement makes exact halves.
    nearest = tl.floor(acc + 0.5)
    tie_to_odd = ((nearest - acc) == 0.5) & ((nearest - 2 * tl.floor(nearest * 0.5)) != 0)
    pixel = tl.minimum(tl.maximum(tl.where(tie_to_odd, nearest - 1, nearest), 0.0), 255.0)
    tl.store(out + (nc * out_h + i[:, None]) * out_w + j[None, :], pixel.to(tl.uint8), mask=in_rows[:, None] & in_cols[None, :])
