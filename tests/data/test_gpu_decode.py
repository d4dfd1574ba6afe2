"""GPU decoders against the loader's PIL pixels, on the same crops (run on a GPU machine: `-m gpu`).

nvJPEG (torchvision's batched decoder: the hardware engines for baseline JPEGs, its hybrid
decoder for progressive ones) decodes a chunk of JPEGs of several sizes and subsamplings in one
call; `decode_rows` crops and resizes them in one batched pass. The crops must agree with
`SplitTransform.decode` (PIL decode, PIL resize: the loader's pixels) to within a few grey
levels, and an image nvJPEG refuses must come back decoded by PIL, not black.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from open_clip.transform import image_transform
from PIL import Image

from clipscale.data.decoders import EncodedImages, decode_jpegs, decode_rows
from clipscale.data.transforms import SplitTransform

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPLIT = SplitTransform.split(image_transform(224, is_train=True))


def jpeg(width: int, height: int, seed: int, **options) -> bytes:
    rng = np.random.default_rng(seed)
    # A smooth gradient with noise: like a photo, unlike a flat colour.
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=options.pop("quality", 85), **options)
    return buffer.getvalue()


def chunk() -> EncodedImages:
    blobs = [jpeg(224, 224, 0), jpeg(500, 375, 1), jpeg(97, 131, 2), jpeg(640, 480, 3, subsampling=0),
             jpeg(300, 200, 4, subsampling=1), jpeg(256, 256, 5, progressive=True)]
    cmyk = io.BytesIO()
    Image.new("CMYK", (120, 90), (10, 200, 30, 5)).save(cmyk, format="JPEG")
    blobs.append(cmyk.getvalue())
    generator = torch.Generator().manual_seed(0)
    params = []
    for blob in blobs:
        with Image.open(io.BytesIO(blob)) as img:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
                params.append(SPLIT.draw(img))
    return EncodedImages.from_samples(tuple(blobs), tuple(params))


def test_gpu_decoded_crops_match_the_loaders_pixels():
    device = torch.device("cuda")
    encoded = chunk()
    got, black = decode_rows(SPLIT, encoded, 0, len(encoded), device)
    got = got.cpu()
    want = torch.stack([SPLIT.decode(encoded[i]) for i in range(len(encoded))])
    assert got.shape == want.shape and got.dtype == torch.uint8 and black == 0
    for i in range(len(encoded)):
        difference = (got[i].int() - want[i].int()).abs().float()
        # JPEG decoders differ in IDCT and chroma upsampling by a level or two; the resize by one.
        assert difference.mean() < 1.5 and difference.quantile(0.99) <= 8, f"image {i}: {difference.mean():.2f}"
        assert got[i].float().mean() > 5, f"image {i} came back black"


def test_a_full_chunk_of_real_size_decodes_in_one_call():
    """512 JPEGs of 224 px (a few progressive and grayscale): all decoded by the one call."""
    device = torch.device("cuda")
    blobs = [torch.frombuffer(bytearray(jpeg(224, 224, seed, progressive=seed % 50 == 0)), dtype=torch.uint8)
             for seed in range(512)]
    images = decode_jpegs(blobs, device)
    assert all(image is not None for image in images)
    assert images[0].shape == (3, 224, 224) and images[0].dtype == torch.uint8 and images[0].is_cuda


def test_normalized_on_the_gpu_equals_the_eager_kernels_bit_for_bit():
    """The fused normalisation (SplitTransform.to_float on a GPU) against ToTensor and Normalize's
    eager kernels on the same GPU, at a chunk's real size: every value equal (Triton's plain
    float32 division would miss by an ulp)."""
    pixels = torch.randint(0, 256, (512, 3, 224, 224), dtype=torch.uint8, device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    (step,) = SPLIT.normalize
    mean, std = (torch.tensor(v, device="cuda").view(3, 1, 1) for v in (step.mean, step.std))
    assert torch.equal(SPLIT.to_float(pixels), pixels.float().div(255).sub(mean).div(std))
