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


@triton.jit
def filter_weight(x, BICUBIC: tl.constexpr):
    """The filter at distance x (in filter units): Keys' cubic with a = -0.5, or the triangle."""
    x = tl.abs(x)
    if BICUBIC:
        near = (1.5 * x - 2.5) * x * x + 1.0
        far = ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0
        return tl.where(x < 1.0, near, tl.where(x < 2.0, far, 0.0))
    else:
        return tl.maximum(1.0 - x, 0.0)


@triton.jit
def taps_of(out_index, in_size, out_size, BICUBIC: tl.constexpr):
    """Where the taps of outputs `out_index` begin and end (exclusive) along an axis of `in_size`
    resized to `out_size`, their centre and the filter's stretch (crop_resize's reference math)."""
    scale = in_size.to(tl.float32) / out_size
    stretch = tl.maximum(scale, 1.0)  # downscaling widens the filter (antialiasing)
    support = (2.0 if BICUBIC else 1.0) * stretch
    center = scale * (out_index.to(tl.float32) + 0.5)
    first = tl.maximum(tl.floor(center - support + 0.5), 0.0).to(tl.int64)
    last = tl.minimum(tl.floor(center + support + 0.5).to(tl.int64), in_size)
    return first, last, center, stretch


# Chunk by chunk the largest crop and the filter's reach change: not compiled anew for each value.
@triton.jit(do_not_specialize=["max_rows", "taps"])
def rows_kernel(table, rows, max_rows, out_w, taps,
                BICUBIC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    """rows[n, c, r, j] = sum_k w(n, j, k) * img[n, c, top + r, left + first(n, j) + k] / sum_k w(n, j, k)."""
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
    first, last, center, stretch = taps_of(j, crop_w, out_w, BICUBIC)
    acc = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
    total = tl.zeros((BLOCK_X,), dtype=tl.float32)
    for k in range(taps):
        column = first + k
        used = in_cols & (column < last)
        weight = tl.where(used, filter_weight((column.to(tl.float32) - center + 0.5) / stretch, BICUBIC), 0.0)
        mask = in_rows[:, None] & used[None, :]
        pixel = tl.load(image + row_start[:, None] + column[None, :], mask=mask, other=0)
        acc += pixel.to(tl.float32) * weight[None, :]
        total += weight
    acc = acc / tl.where(total != 0.0, total, 1.0)[None, :]
    tl.store(rows + (nc * max_rows + r[:, None]) * out_w + j[None, :], acc, mask=in_rows[:, None] & in_cols[None, :])


@triton.jit(do_not_specialize=["max_rows", "taps"])
def columns_kernel(rows, table, out, max_rows, out_h, out_w, taps,
                   BICUBIC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    """out[n, c, i, j] = round(clamp(sum_k w(n, i, k) * rows[n, c, first(n, i) + k, j] / sum_k w(n, i, k), 0, 255))."""
    nc = tl.program_id(0)
    n = nc // 3
    i = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(2) * BLOCK_X + tl.arange(0, BLOCK_X)
    crop_h = tl.load(table + n * TABLE + CROP_H)
    in_rows = i < out_h
    in_cols = j < out_w
    first, last, center, stretch = taps_of(i, crop_h, out_h, BICUBIC)
    acc = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(taps):
        row = first + k
        used = in_rows & (row < last)
        weight = tl.where(used, filter_weight((row.to(tl.float32) - center + 0.5) / stretch, BICUBIC), 0.0)
        mask = used[:, None] & in_cols[None, :]
        value = tl.load(rows + (nc * max_rows + row[:, None]) * out_w + j[None, :], mask=mask, other=0.0)
        acc += value * weight[:, None]
        total += weight
    acc = acc / tl.where(total != 0.0, total, 1.0)[:, None]
    # Ties to even, as torch.round: an integer-factor enlargement makes exact halves.
    nearest = tl.floor(acc + 0.5)
    tie_to_odd = ((nearest - acc) == 0.5) & ((nearest - 2 * tl.floor(nearest * 0.5)) != 0)
    pixel = tl.minimum(tl.maximum(tl.where(tie_to_odd, nearest - 1, nearest), 0.0), 255.0)
    tl.store(out + (nc * out_h + i[:, None]) * out_w + j[None, :], pixel.to(tl.uint8), mask=in_rows[:, None] & in_cols[None, :])
