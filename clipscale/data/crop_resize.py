"""The random resized crops of a whole chunk in two Triton launches (the device decoder's resize).

Done image by image with torchvision's tensor kernels, a chunk of 512 crops is thousands of
small kernel launches, and on an H100 they cost more than the JPEG decode itself. Here every
image of the chunk is cropped and resized by the same two programs.

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

Tiling (the programs are in `crop_resize_programs.py`): `rows_kernel` applies Wx (the horizontal
pass) to every row of the crop and writes float32 rows [n, c, crop row, out_w]; `columns_kernel`
applies Wy to those, rounds and writes uint8 [n, c, out_h, out_w]. Each program owns a [BLOCK_R, BLOCK_X] tile of one image's channel
and loops over the taps: at most 2 * support + 1 of them, a handful for the crops a random
resized crop draws. The images of a chunk differ in size and each lives where the JPEG decoder
put it, so they are passed as a per-image table (address, height, width, crop box); the taps as
a start index and weights per output row or column. No atomics: the result is the same on every call,
which Gradient Cache's two passes over the same bytes need.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton

from clipscale.triton_modes import interpreting, programs

FILTER_RADIUS = MappingProxyType({"bilinear": 1, "bicubic": 2})  # half the support at scale 1, in input pixels

# The per-image table, int64 [n, 7]: the columns crop_resize_programs.TABLE names (the image's
# address, its height and width, then the crop box: top, left, crop height, crop width).


def _filter(x: torch.Tensor, interpolation: str) -> torch.Tensor:
    x = x.abs()
    if interpolation == "bilinear":
        return (1 - x).clamp(min=0)
    a = -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def filter_taps(in_sizes: torch.Tensor, out_size: int, interpolation: str, largest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's taps along one axis: first input index int32 [n, out_size] and weights
    float32 [n, out_size, taps] (zero past an output's last tap), computed in float64 as
    ATen's antialiased kernels compute them (`_compute_weights_aa`). `largest`: the largest
    of `in_sizes`, known on the host (reading it from the device would wait for the GPU)."""
    sizes = in_sizes.to(torch.float64)[:, None]
    scale = sizes / out_size
    stretch = scale.clamp(min=1)  # downscaling widens the filter (antialiasing)
    support = FILTER_RADIUS[interpolation] * stretch
    center = scale * (torch.arange(out_size, dtype=torch.float64, device=in_sizes.device) + 0.5)
    first = (center - support + 0.5).trunc().clamp(min=0)
    last = torch.minimum((center + support + 0.5).trunc(), sizes)  # exclusive
    taps = int(2 * FILTER_RADIUS[interpolation] * max(1.0, largest / out_size) + 2)  # bounds last - first
    index = torch.arange(taps, dtype=torch.float64, device=in_sizes.device)
    weights = _filter((first[..., None] + index - center[..., None] + 0.5) / stretch[..., None], interpolation)
    weights = torch.where(index < (last - first)[..., None], weights, 0)
    total = weights.sum(-1, keepdim=True)
    weights = torch.where(total != 0, weights / total, weights)
    return first.to(torch.int32), weights.to(torch.float32)


def resized_crops(images: list[torch.Tensor], boxes, size: tuple[int, int], interpolation: str) -> torch.Tensor:
    """uint8 [n, 3, size[0], size[1]]: image k (uint8 [3, H, W], contiguous, all on one device)
    cropped to boxes[k] = (top, left, height, width) and resized with the antialiased
    `interpolation` ("bilinear" or "bicubic"), as torchvision's `resized_crop` on each would give
    (within one grey level: float rounding). The images stay where they are: the programs read
    each through its address in the table, so a chunk costs a few host calls whatever its size."""
    if interpolation not in FILTER_RADIUS:
        raise ValueError(f"interpolation must be one of {sorted(FILTER_RADIUS)}, got {interpolation!r}")
    if not images:
        return torch.empty(0, 3, *size, dtype=torch.uint8)
    device = images[0].device
    out_h, out_w = size
    # A few tensor calls, not a tensor call per image: this runs in a thread of the training process,
    # where each call hands the GIL to the threads that launch the model's kernels and waits to get it back.
    boxes = torch.as_tensor(boxes, dtype=torch.int64).reshape(len(images), -1)[:, :4]
    images = [img if img.is_contiguous() else img.contiguous() for img in images]  # the GPU decoder's are; a CPU one's are HWC views
    where = torch.tensor([(img.data_ptr(), img.shape[1], img.shape[2]) for img in images], dtype=torch.int64)
    table = torch.cat([where, boxes], 1)  # the columns TABLE names
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
    max_rows, max_columns = boxes[:, 2:4].max(0).values.tolist()
    row_starts, row_weights = filter_taps(boxes[:, 2].to(device), out_h, interpolation, max_rows)
    column_starts, column_weights = filter_taps(boxes[:, 3].to(device), out_w, interpolation, max_columns)
    rows = torch.empty(len(images), 3, max_rows, out_w, dtype=torch.float32, device=device)
    out = torch.empty(len(images), 3, out_h, out_w, dtype=torch.uint8, device=device)
    P = programs("clipscale.data.crop_resize_programs", interpreting())  # compiled, or Triton's interpreter
    block_r, block_x = P.BLOCK_R, P.BLOCK_X
    grid = (len(images) * 3, triton.cdiv(max_rows, block_r), triton.cdiv(out_w, block_x))
    P.rows_kernel[grid](table, column_starts, column_weights, rows, max_rows, out_w, column_weights.shape[-1],
                        BLOCK_R=block_r, BLOCK_X=block_x)
    grid = (len(images) * 3, triton.cdiv(out_h, block_r), triton.cdiv(out_w, block_x))
    P.columns_kernel[grid](rows, table, row_starts, row_weights, out, max_rows, out_h, out_w, row_weights.shape[-1],
                           BLOCK_R=block_r, BLOCK_X=block_x)
    return out
