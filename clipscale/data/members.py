"""A shard sample's members, decoded safely: only the members a reader uses, each by an explicit decoder.

webdataset's `.decode()` runs a decoder on every member of a sample, whatever the reader
keeps afterwards, and its defaults unpickle `.pyd` / `.pickle` members, `torch.load` `.pth`
ones and `np.load` `.npy` ones: a shard from elsewhere could run code. Every reader in
clipscale takes the raw bytes (`wds.WebDataset` or `tarfile_to_samples` without `.decode`)
and decodes its image, text and label members with the functions below; any other member
stays bytes that nothing looks at.

Images open only as JPEG, PNG or WebP (evaluation folders: also BMP, PPM and TIFF); PIL
would otherwise try every format it knows, EPS through Ghostscript among them. An image whose header claims more pixels than the bound
(`data.max_image_pixels`, by default PIL's `Image.MAX_IMAGE_PIXELS`) is refused from its
header, before anything is allocated for its pixels.
"""

from __future__ import annotations

import io
import struct
import warnings
from typing import Iterable, Optional

from PIL import Image

IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")
FOLDER_FORMATS = (*IMAGE_FORMATS, "BMP", "PPM", "TIFF")  # and the others torchvision's ImageFolder lists


class ImageTooLarge(ValueError):
    """An image whose header claims more pixels than the bound: an image bomb, or a picture too big to train on."""


# What bad sample bytes raise while being opened and decoded (UnicodeDecodeError and
# ImageTooLarge are ValueErrors; PIL raises SyntaxError and struct.error from broken chunks,
# DecompressionBombError where a later step finds an image too large).
# Anything else is a bug in the reader and keeps its traceback.
DATA_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


def first_member(sample: dict, keys: Iterable[str]) -> Optional[str]:
    """The first of `keys` that the sample has, or None."""
    return next((key for key in keys if key in sample), None)


def open_image(data: bytes, max_pixels: Optional[int] = None, formats: tuple[str, ...] = IMAGE_FORMATS) -> Image.Image:
    """A PIL image over `data` with only its header read (PIL decodes on `convert` or `load`).

    ImageTooLarge when the header claims more than `max_pixels` pixels (None: PIL's
    `Image.MAX_IMAGE_PIXELS`). A bound above PIL's own raises PIL's in this process,
    which would otherwise refuse such images itself."""
    bound = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels  # None there too: the user lifted PIL's
    if Image.MAX_IMAGE_PIXELS is not None and bound is not None and bound > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = bound
    with warnings.catch_warnings():  # between PIL's bound and twice it PIL only warns; the check below decides
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=formats)
        except Image.DecompressionBombError as err:  # over twice PIL's bound: PIL refuses it first
            raise ImageTooLarge(f"its header claims more pixels than PIL allows: {err}") from None
    try:
        check_pixel_bound(*image.size, max_pixels)
    except ImageTooLarge:
        image.close()
        raise
    return image


def check_pixel_bound(width: int, height: int, max_pixels: Optional[int] = None) -> None:
    """ImageTooLarge when a header's width x height is above `max_pixels` (None: PIL's
    `Image.MAX_IMAGE_PIXELS`, itself None when a user lifted it)."""
    bound = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    if bound is not None and width * height > bound:
        raise ImageTooLarge(f"its header claims {width} x {height} pixels, more than the bound of {bound:,}")


def decode_text(data: bytes) -> str:
    return data.decode("utf-8").strip()


def decode_label(data: bytes) -> int:
    """A class label member (`cls`): an integer written as text."""
    return int(data.decode("ascii").strip())
