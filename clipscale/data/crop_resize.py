"""The random resized crops of a whole chunk in two Triton launches (the device decoder's resize),
and a chunk's uint8 pixels made normalised floats in one (`normalized`).

Done image by image with torchvision's tensor kernels, a chunk of 512 crops is thousands of
small kernel launches, and on an H100 they cost more than the JPEG decode itself. Here every
image of the chunk is cropped and resized by the same two programs, which also compute their
filter taps: the host gives one table, nothing per image and nothing to wait for.

Reference math (what `torchvision.transforms.functional.resized_crop(img, top, left, h, w,
size, interpolation, antialias=True)` computes, and PIL's resampling before it). Resizing is
linear and separable: for each image n and channel c,

    out[n, c] = round(clamp(Wy[n] @ img[n, c, top:top+h, left:left+w] @ Wx[n]^T, 0, 255))

where row j of Wx[n] (an output column) holds the filter taps over the crop's columns:
scale = w / out_w, support = r * max(scale, 1) (r = 1 bilinear, 2 bicubic),
center = scale * (j + 0.5), taps i in [trunc(center - support + 0.5), trunc(center + support
+ 0.5)) clipped to [0, w), tap weight filter((i - center + 0.5) / max(scale, 1)), normalised to
sum 1. The filters: bilinear 1 - |x| on |x| < 1; bicubic Keys' cubic with a = -0.5 on |x| < 2
(PIL's, which torchvision matches when antialias is on). Wy likewise over the rows.

Tiling (the programs below): `rows_kernel` applies Wx (the horizontal
pass) to every row of the crop and writes float32 rows [n, c, crop row, out_w]; `columns_kernel`
applies Wy to those, rounds and writes uint8 [n, c, out_h, out_w]. Each program owns a
[BLOCK_R, BLOCK_X] tile of one image's channel and loops over the taps, computing each tap's
weight (float32) as it goes and dividing by their sum at the end: at most 2 * support + 2 taps,
a handful for the crops a random resized crop draws. The images of a chunk differ in size and
each lives where its decoder put it, in its own layout (nvJPEG's [3, H, W] planes, a worker's
[H, W, 3] rows), so they are passed as a per-image table (address, the three strides, crop box).
No atomics: the result is the same on every call, which Gradient Cache's two passes over the same
bytes need.

The host code takes the programs from `clipscale.triton_modes.programs(__name__, ...)`: this module
as decorated for each call's mode, compiled for the GPU or run in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl

from clipscale.caption_length import to_device_async
from clipscale.triton_modes import interpreting, programs

INTERPRET = interpreting()  # the mode @triton.jit decorates these programs in, read as it reads it
BLOCK_R, BLOCK_X = (8, 64) if not INTERPRET else (8, 16)  # a program's tile: rows x output columns (the
# interpreter's narrower, so that the tests' small outputs still span several tiles across; each of its
# programs costs milliseconds, and (4, 16) took 66 s of a CI worker for one test)

# The per-image table's columns (int64 [n, TABLE]): where the image's uint8 pixels are, the
# strides of its channels, rows and columns (pixel (c, y, x) at address + c * CHANNEL_STRIDE +
# y * ROW_STRIDE + x * COLUMN_STRIDE), and its crop box.
ADDRESS, CHANNEL_STRIDE, ROW_STRIDE, COLUMN_STRIDE, TOP, LEFT, CROP_H, CROP_W = (tl.constexpr(k) for k in range(8))
TABLE = tl.constexpr(8)

FILTER_RADIUS = MappingProxyType({"bilinear": 1, "bicubic": 2})  # half the support at scale 1, in input pixels


def max_taps(largest: int, out_size: int, interpolation: str) -> int:
    """A bound on the taps of any output pixel along an axis whose largest crop is `largest`."""
    return int(2 * FILTER_RADIUS[interpolation] * max(1.0, largest / out_size) + 2)


def image_table(images: list[torch.Tensor]) -> torch.Tensor:
    """The table of images (uint8 [3, H, W], any strides: a CPU decoder's are views of [H, W, 3]
    memory): int64 [n, 4] on the host, each one's address and strides. Keep the images alive
    while the programs run."""
    where = torch.tensor([(img.data_ptr(), *img.stride()) for img in images], dtype=torch.int64)
    return where.reshape(-1, 4)


def resized_crops(images: list[torch.Tensor], boxes, size: tuple[int, int], interpolation: str) -> torch.Tensor:
    """uint8 [n, 3, size[0], size[1]]: image k (uint8 [3, H, W], all on one device) cropped to
    boxes[k] = (top, left, height, width) and resized with the antialiased `interpolation`
    ("bilinear" or "bicubic"), as torchvision's `resized_crop` on each would give (within one
    grey level: float rounding)."""
    if not images:
        return resized_crops_at(torch.empty(0, 4, dtype=torch.int64), boxes, size, interpolation, torch.device("cpu"))
    return resized_crops_at(image_table(images), boxes, size, interpolation, images[0].device)


def resized_crops_at(where: torch.Tensor, boxes, size: tuple[int, int], interpolation: str, device: torch.device) -> torch.Tensor:
    """`resized_crops` of the images that `where` (int64 [n, 4] on the host: address and strides,
    as `image_table` gives) places on `device`; the caller keeps them alive. The images
    stay where they are: the programs read each through its address in the table, so a chunk
    costs a few host calls whatever its size, and none of them waits for the device."""
    if interpolation not in FILTER_RADIUS:
        raise ValueError(f"interpolation must be one of {sorted(FILTER_RADIUS)}, got {interpolation!r}")
    n = len(where)
    if not n:
        return torch.empty(0, 3, *size, dtype=torch.uint8, device=device)
    out_h, out_w = size
    # A few tensor calls, not a tensor call per image: this runs in a thread of the training process,
    # where each call hands the GIL to the threads that launch the model's kernels and waits to get it back.
    boxes = torch.as_tensor(boxes, dtype=torch.int64).reshape(n, -1)[:, :4]
    table = torch.cat([where, boxes], 1)  # the columns TABLE names
    table = to_device_async(table, device)
    max_rows, max_columns = boxes[:, 2:4].max(0).values.tolist()
    rows = torch.empty(n, 3, max_rows, out_w, dtype=torch.float32, device=device)
    out = torch.empty(n, 3, out_h, out_w, dtype=torch.uint8, device=device)
    P = programs(__name__, interpreting())  # compiled, or Triton's interpreter
    block_r, block_x, bicubic = P.BLOCK_R, P.BLOCK_X, interpolation == "bicubic"
    grid = (n * 3, triton.cdiv(max_rows, block_r), triton.cdiv(out_w, block_x))
    P.rows_kernel[grid](table, rows, max_rows, out_w, max_taps(max_columns, out_w, interpolation),
                        BICUBIC=bicubic, BLOCK_R=block_r, BLOCK_X=block_x)
    grid = (n * 3, triton.cdiv(out_h, block_r), triton.cdiv(out_w, block_x))
    P.columns_kernel[grid](rows, table, out, max_rows, out_h, out_w, max_taps(max_rows, out_h, interpolation),
                           BICUBIC=bicubic, BLOCK_R=block_r, BLOCK_X=block_x)
    return out


def normalized(pixels: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float32 [n, 3, H, W]: each uint8 pixel of channel c replaced by `table[c, value]` ([3, 256]
    float32 on the pixels' device), in one pass. `SplitTransform.to_float` makes the table with
    ToTensor and Normalize's own kernels on the same device, so the result equals theirs bit for bit
    whatever their rounding (on a GPU a division by 255 is a product with its reciprocal, and a
    compiled product and subtraction may fuse into one rounding): no arithmetic is redone here."""
    pixels = pixels.contiguous()
    out = torch.empty(pixels.shape, dtype=torch.float32, device=pixels.device)
    if not pixels.numel():
        return out
    P = programs(__name__, interpreting())
    block = 1024 if not P.INTERPRET else 256
    P.table_kernel[(triton.cdiv(pixels.numel(), block),)](pixels, table.contiguous(), out, pixels.numel(),
                                                           pixels.shape[-2] * pixels.shape[-1], BLOCK=block)
    return out


# --- the programs -------------------------------------------------------------------------------


@triton.jit
def table_kernel(pixels, table, out, numel, plane, BLOCK: tl.constexpr):
    """out[k] = table[c, pixels[k]], c the channel of element k ([n, 3, H, W] contiguous)."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < numel
    channel = (at // plane) % 3
    value = tl.load(pixels + at, mask=inside, other=0).to(tl.int64)
    tl.store(out + at, tl.load(table + channel * 256 + value, mask=inside, other=0.0), mask=inside)


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
    row_stride, column_stride = tl.load(entry + ROW_STRIDE), tl.load(entry + COLUMN_STRIDE)
    crop_h, crop_w = tl.load(entry + CROP_H), tl.load(entry + CROP_W)
    row_start = c * tl.load(entry + CHANNEL_STRIDE) + (tl.load(entry + TOP) + r) * row_stride  # int64
    left = tl.load(entry + LEFT)
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
        pixel = tl.load(image + row_start[:, None] + (left + column[None, :]) * column_stride, mask=mask, other=0)
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
