"""GPU decoders against the loader's PIL pixels, on the same crops (run on a GPU machine: `-m gpu`).

The hardware JPEG engines (nvImageCodec, `JpegEngines`) and nvJPEG (`TorchvisionJpeg`) each
decode a chunk of JPEGs of several sizes and subsamplings; `decode_rows` crops and resizes them
in one batched pass. Each must agree with `SplitTransform.decode` (PIL decode, PIL resize: the
loader's pixels) to within a few grey levels, and an image the engines refuse (progressive,
CMYK) must come back decoded, not black.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from open_clip.transform import image_transform
from PIL import Image

from clipscale.data.device_decode import JpegEngines, TorchvisionJpeg, decode_rows
from clipscale.data.encoded import EncodedImages
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


@pytest.mark.parametrize("backend", ["nvimgcodec", "nvjpeg"])
def test_gpu_decoded_crops_match_the_loaders_pixels(backend):
    device = torch.device("cuda")
    if backend == "nvimgcodec":
        jpeg_decoder, why = JpegEngines.create(device)
        if jpeg_decoder is None:
            pytest.skip(why)
    else:
        jpeg_decoder = TorchvisionJpeg(device)
    encoded = chunk()
    got = decode_rows(SPLIT, encoded, 0, len(encoded), device, jpeg_decoder).cpu()
    want = torch.stack([SPLIT.decode(encoded[i]) for i in range(len(encoded))])
    assert got.shape == want.shape and got.dtype == torch.uint8
    for i in range(len(encoded)):
        difference = (got[i].int() - want[i].int()).abs().float()
        # JPEG decoders differ in IDCT and chroma upsampling by a level or two; the resize by one.
        assert difference.mean() < 1.5 and difference.quantile(0.99) <= 8, f"image {i}: {difference.mean():.2f}"
        assert got[i].float().mean() > 5, f"image {i} came back black"


def test_the_engines_decode_a_full_chunk_of_real_size_fast_enough_to_matter():
    """512 JPEGs of 224 px through the engines: all decoded (no fallback to the SMs needed)."""
    device = torch.device("cuda")
    engines, why = JpegEngines.create(device)
    if engines is None:
        pytest.skip(why)
    blobs = [torch.frombuffer(bytearray(jpeg(224, 224, seed)), dtype=torch.uint8) for seed in range(512)]
    images = engines.decoder.decode([engines.nvimgcodec.CodeStream(b.numpy()) for b in blobs], params=engines.params)
    assert all(image is not None for image in images)
    first = torch.as_tensor(images[0], device=device)
    assert first.shape == (3, 224, 224) and first.dtype == torch.uint8
