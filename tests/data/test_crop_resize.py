"""The device decoder's batched random resized crops (Triton, under TRITON_INTERPRET=1 on CPU
tensors) against torchvision's `resized_crop` on each image, the per-image path it replaces.

Images of different sizes in one call, crops that shrink and crops that enlarge, rectangular
outputs and crops at the image's edges; both filters open_clip's transforms use. The two
compute the same float32 sums in another order, so a pixel may round the other way: at most
one grey level apart, and nearly all equal.
"""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.functional as TF
from torchvision.transforms import InterpolationMode

from clipscale.data import crop_resize as C


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at each launch: no reload, whatever imported C first


def _images_and_boxes(seed: int):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(23, 31), (40, 17), (9, 50), (32, 32), (61, 44)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for h, w in shapes]
    # smooth parts too: random noise alone rarely lands a sum on a rounding boundary
    images[3] = torch.linspace(0, 255, 32 * 32).reshape(1, 32, 32).expand(3, 32, 32).round().to(torch.uint8).contiguous()
    boxes = [(0, 0, 23, 31),  # the whole image
             (5, 3, 30, 11),  # a narrow crop, enlarged across, shrunk down
             (2, 40, 5, 10),  # at the right edge, tiny: enlarged
             (7, 9, 13, 13),
             (0, 1, 61, 43)]  # at the bottom edge, shrunk
    return images, boxes


@pytest.mark.parametrize("interpolation, size", [("bicubic", (13, 17)), ("bilinear", (24, 24))])
def test_batched_crops_match_torchvisions_resized_crop_of_each_image(interpolation, size):
    images, boxes = _images_and_boxes(seed=len(interpolation) + size[0])
    got = C.resized_crops(images, boxes, size, interpolation)
    mode = InterpolationMode(interpolation)
    expected = torch.stack([TF.resized_crop(img, *box, list(size), mode, antialias=True) for img, box in zip(images, boxes)])
    assert got.shape == expected.shape == (len(images), 3, *size) and got.dtype == torch.uint8
    difference = (got.int() - expected.int()).abs()
    assert difference.max() <= 1
    assert (difference == 0).float().mean() >= 0.99


def test_an_unknown_interpolation_is_refused():
    with pytest.raises(ValueError, match="bicubic"):
        C.resized_crops([torch.zeros(3, 4, 4, dtype=torch.uint8)], [(0, 0, 4, 4)], (2, 2), "nearest")


def test_the_device_decoder_resizes_a_chunk_in_one_pass_and_keeps_its_other_images_in_place(monkeypatch):
    """decode_rows on a chunk mixing JPEGs with a PNG (nvJPEG refuses it: decoded by PIL), an
    image that decodes nowhere (black) and two crop regions a worker decoded: in the batched pass the
    JPEGs' crops and the regions, in their places, within one grey level of the image-by-image path,
    and the others equal to it."""
    import io

    from open_clip.transform import image_transform
    from PIL import Image

    from clipscale.data import decoders
    from clipscale.data.decoders import EncodedImages
    from clipscale.data.transforms import SplitTransform
    from tests.helpers.user_data import seeded_noise

    split = SplitTransform.split(image_transform(16, is_train=True, aug_cfg={"scale": (0.5, 1.0)}))
    assert split.only_random_resized_crop() is not None

    def encoded(img: Image.Image, kind: str) -> bytes:
        out = io.BytesIO()
        img.save(out, format=kind, quality=90)
        return out.getvalue()

    pictures = [seeded_noise((24 + 3 * k, 20 + 2 * k), 40 + 10 * k, seed=k) for k in range(6)]
    blobs = [encoded(p, "JPEG") for p in pictures]
    blobs[1] = encoded(pictures[1], "PNG")
    blobs[3] = blobs[3][:20] + b"\x00" * 30 + blobs[3][50:]  # its quantisation tables overwritten: decodes nowhere
    boxes = [(1, 2, 18, 20), (0, 0, 20, 26), (3, 1, 10, 12), (0, 0, 26, 33), (2, 4, 25, 30), (1, 3, 21, 31)]
    regions = tuple(split.crop_region(pictures[k], boxes[k]) for k in (4, 5))  # the last two as a worker hands them over
    assert [region.shape for region in regions] == [(3, 25, 30), (3, 21, 31)]
    chunk = EncodedImages.from_samples(tuple(blobs), tuple(boxes), (None,) * 4 + regions)
    calls, real = [], C.resized_crops_at

    def counted(where, *args):
        calls.append(len(where))
        return real(where, *args)

    monkeypatch.setattr(C, "resized_crops_at", counted)
    with pytest.warns(UserWarning, match="does not decode"):
        batched, black = decoders.decode_rows(split, chunk, 0, 6, torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.warns(UserWarning, match="does not decode"):
        one_by_one, _ = decoders.decode_rows(split, chunk, 0, 6, torch.device("cpu"))
    assert calls == [4] and black == 1  # the two JPEGs and the two regions, in one call; the broken one trained black
    assert batched.shape == one_by_one.shape == (6, 3, 16, 16)
    assert (batched.int() - one_by_one.int()).abs().max() <= 1
    for k in (1, 3):
        assert torch.equal(batched[k], one_by_one[k])
    assert torch.equal(batched[3], torch.zeros(3, 16, 16, dtype=torch.uint8))


@pytest.mark.parametrize("batched", [True, False], ids=["one-pass", "image-by-image"])
def test_a_workers_crop_region_resized_by_the_device_gives_its_crop_and_a_large_one_is_resized_by_the_worker(batched, monkeypatch):
    """A worker hands the device its crop's region unresized, which the device resizes to PIL's
    crop within rounding; a region of more than REGION_LIMIT outputs' pixels (a large photo) the
    worker resizes itself, and the device's resize at scale 1 then keeps those pixels exactly."""
    import numpy as np
    from open_clip.transform import image_transform
    from PIL import Image

    from clipscale.data import decoders
    from clipscale.data.decoders import EncodedImages
    from clipscale.data.transforms import REGION_LIMIT, SplitTransform

    if not batched:
        monkeypatch.delenv("TRITON_INTERPRET")
    split = SplitTransform.split(image_transform(16, is_train=True))
    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8).astype(np.uint8)).resize((240, 180))
    small, large = (3, 5, 30, 31), (10, 20, 70, 90)  # (top, left, height, width)
    assert 30 * 31 <= REGION_LIMIT * 16 * 16 < 70 * 90
    regions = tuple(split.crop_region(picture, box) for box in (small, large))
    assert [region.shape for region in regions] == [(3, 30, 31), (3, 16, 16)]
    chunk = EncodedImages.from_samples((b"", b""), (small, large), regions)
    pixels, black = decoders.decode_rows(split, chunk, 0, 2, torch.device("cpu"))
    want = [split.apply(picture, box) for box in (small, large)]
    assert black == 0 and (pixels[0].int() - want[0].int()).abs().max() <= 2
    assert torch.equal(pixels[1], want[1])


def test_normalized_in_one_pass_equals_totensor_and_normalize_bit_for_bit():
    """The fused normalisation (one lookup a pixel in the table of each channel's 256 values that
    SplitTransform makes with the eager kernels) against those kernels on the whole chunk, at an
    odd size: every value equal, each channel its own."""
    from open_clip.transform import image_transform

    from clipscale.data.transforms import SplitTransform

    split = SplitTransform.split(image_transform(32, is_train=True))
    generator = torch.Generator().manual_seed(3)
    pixels = torch.randint(0, 256, (3, 3, 17, 23), dtype=torch.uint8, generator=generator)
    assert torch.equal(C.normalized(pixels, split._value_table(pixels.device)), split._eager_to_float(pixels))
