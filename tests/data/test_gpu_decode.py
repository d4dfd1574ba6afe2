"""GPU decoders against the loader's PIL pixels, on the same crops (run on a GPU machine: `-m gpu`).

nvJPEG decodes a chunk of JPEGs of several sizes and subsamplings: the baseline ones in one call
of the JPEG engines (`jpeg_engines`), the progressive ones in one call of torchvision's batched
decoder; `decode_rows` crops and resizes them in one batched pass. The crops must agree with
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

from clipscale.data.device_decode import decode_jpegs, decode_parts, decode_rows
from clipscale.data.encoded import EncodedImages
from clipscale.data.jpeg_engines import JpegEngines
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


def test_the_jpeg_engines_decode_a_chunk_as_torchvisions_call_does():
    """nvJPEG's hardware decode called directly (its buffers from PyTorch's allocators, on our
    stream): one call for 512 JPEGs of several sizes and subsamplings, each image's pixels equal
    to torchvision's batched call (the same engines), and the chunk's crops equal with and
    without the engines."""
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device, priority=-100)
    engines = JpegEngines.open(device, stream)
    name = torch.cuda.get_device_name()
    if engines is None and not any(kind in name for kind in ("A100", "H100", "H200", "B200", "GB200")):
        pytest.skip(f"{name} may have no JPEG engines (nvJPEG's hardware backend)")
    assert engines is not None, f"{name} has JPEG engines, yet nvJPEG's hardware backend did not open"
    sizes = [(224, 224), (375, 500), (131, 97), (480, 640), (200, 300)]
    blobs = [jpeg(w, h, seed, subsampling=seed % 3) for seed, (h, w) in ((s, sizes[s % 5]) for s in range(512))]
    params = [(0, 0, 64, 64)] * len(blobs)
    encoded = EncodedImages.from_samples(tuple(blobs), tuple(params))
    assert encoded.frames[:, 2].all() and encoded.frames[:5, :2].tolist() == [list(size) for size in sizes]
    with torch.cuda.stream(stream):
        spans = [encoded.data]
        out, starts = engines.decode(spans, encoded.offsets[:-1], encoded.offsets.diff(), encoded.frames[:, :2])
    stream.synchronize()
    want = decode_jpegs(list(encoded.blobs(0, len(encoded))), device)
    for k in (0, 1, 2, 3, 4, 255, 511):
        height, width = encoded.frames[k, :2].tolist()
        got = out[starts[k] : starts[k + 1]].view(3, height, width)
        assert torch.equal(got, want[k]), f"image {k}"
    mixed = chunk()  # baseline, progressive and CMYK (the worker's) together
    with torch.cuda.stream(stream):
        with_engines, black = decode_parts(SPLIT, [(mixed, 0, len(mixed))], device, engines)
        without, _ = decode_parts(SPLIT, [(mixed, 0, len(mixed))], device)
    stream.synchronize()
    assert black == 0 and torch.equal(with_engines, without)
