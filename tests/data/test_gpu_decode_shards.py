"""Device decoding (`data.decoder: device`) on the GPU, from shards: nvJPEG (the hardware JPEG
engines for baseline JPEGs), then the batched crop-and-resize, against the loader's PIL pixels on the same crops,
and the same samples skipped. (test_gpu_decode.py holds each decoder to PIL on one
chunk; this follows the stream, its damaged samples and the trainer.)

The shards hold JPEGs of several sizes (smaller and larger than the 224-px crop, odd sizes,
4:2:0 and 4:4:4 chroma, greyscale, progressive, CMYK), a PNG, and damaged samples (cut short,
JPEG markers around garbage, bytes after the end marker). Each device-decoded crop is held to
two things apart:
  * our crop and resize: against the loader's own PIL steps run on the decoder's own whole
    image, so decoder differences cannot hide a wrong box or filter: the resamplers round
    differently by one grey level (measured on an H100: mean at most 0.2, 99th percentile 1);
  * the decoder: its whole image against PIL's. nvJPEG may upsample 4:2:0 chroma without
    libjpeg's "fancy" triangle filter, which on small grainy pictures costs up to about five
    levels on average (measured 4.75 at 48 px; under 1 from 224 px up). A swapped channel, a
    wrong colour transform or a black image costs tens.
Over the whole stream the crops' mean difference from the loader's pixels stays under one.
Anything not decoded on the device (the PNG, a CMYK JPEG, one with bytes after its end) the
worker decodes with PIL on both paths: equal.

On a CPU the same body runs torchvision's CPU decoder (the CI check of the test itself).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torchvision.transforms.functional as TF
import webdataset as wds
from open_clip.transform import image_transform
from PIL import Image, ImageDraw

from clipscale.data.decoders import decode_jpegs, decode_rows
from clipscale.data.shards import ShardStream
from clipscale.data.transforms import SplitTransform

from tests.helpers.jpeg_shards import through_window_arenas, train_on_jpeg_shards

pytestmark = pytest.mark.timeout(300)

TRAIN = image_transform(224, is_train=True)  # open_clip's RandomResizedCrop(224, scale=(0.9, 1.0)) pipeline
SPLIT = SplitTransform.split(TRAIN)
SIZES = [(97, 211), (224, 224), (333, 517), (640, 480), (1024, 768), (48, 48)]  # (width, height)
SAMPLES, PIECE = 60, 20


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Something like a photograph: smooth colour gradients, shapes with sharp edges, grain."""
    base = Image.merge("RGB", [Image.linear_gradient("L").rotate(angle).resize((width, height))
                               for angle in (seed * 37 % 360, seed * 71 % 360, seed * 113 % 360)])
    draw = ImageDraw.Draw(base)
    for k in range(4):
        x, y = (seed * 53 + k * 97) % width, (seed * 31 + k * 61) % height
        draw.ellipse((x, y, x + width // 3, y + height // 4), fill=((seed * 40 + k * 70) % 256, (k * 90) % 256, 200 - k * 40))
    grain = Image.effect_noise((width, height), 12).convert("RGB")  # pixel-sized: JPEG's hardest content
    return Image.blend(base, grain, 0.15)


def encoded(i: int) -> tuple[str, bytes]:
    """(extension, bytes) of sample i: mostly JPEGs of SIZES in their variants, and the odd ones."""
    width, height = SIZES[i % len(SIZES)]
    image, out = picture(width, height, i), io.BytesIO()
    kind = i % 10
    if kind == 3:
        image.save(out, "PNG")
        return "png", out.getvalue()
    if kind == 5:
        image.convert("L").save(out, "JPEG", quality=90)
    elif kind == 6:
        image.save(out, "JPEG", quality=90, progressive=True)
    elif kind == 7:
        image.convert("CMYK").save(out, "JPEG", quality=90)
    else:
        image.save(out, "JPEG", quality=85 + i % 10, subsampling=0 if kind == 8 else 2)
    data = out.getvalue()
    damage = {11: data[: len(data) // 2],  # cut short
              23: b"\xff\xd8\xff" + bytes(range(256)) * 4 + b"\xff\xd9",  # JPEG markers around nothing
              41: data + b"\x00" * 16}  # decodable, but not whole by its end marker: the worker judges it
    return "jpg", damage.get(i, data)


@pytest.fixture(scope="module")
def shards(module_tmp) -> list[str]:
    root = module_tmp("gpu_decode")
    urls = [str(root / f"part-{k}.tar") for k in range(2)]
    sinks = [wds.TarWriter(url) for url in urls]
    for i in range(SAMPLES):
        extension, data = encoded(i)
        sinks[i % 2].write({"__key__": f"s{i:04d}", extension: data, "txt": f"picture {i}".encode()})
    for sink in sinks:
        sink.close()
    return urls


def stream(urls: list[str], decode: bool):
    return ShardStream(urls, piece_size=PIECE, rank=0, world_size=1, num_workers=1, seed=3, image_transform=TRAIN,
                       tokenizer=lambda captions: torch.tensor([len(c) for c in captions]), shuffle_buffer=16,
                       split=SPLIT, keep_encoded=True, decode=decode)


def assert_the_crop_step_is_pils(got: torch.Tensor, by_pil: torch.Tensor, box: tuple) -> None:
    crop_step = (got.int() - by_pil.int()).abs().float()
    assert crop_step.mean() < 0.5 and crop_step.quantile(0.99) <= 1, \
        f"crop {box}: the crop and resize differ from PIL's on the same pixels by {crop_step.mean():.2f}"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])  # on a CPU: libjpeg-turbo
def test_device_decoding_gives_the_loaders_pixels_and_skips(shards, device):
    loader_path, device_path = iter(stream(shards, decode=True)), iter(stream(shards, decode=False))
    skipped = {"loader": 0, "device": 0}
    differences, whole_jpegs = [], 0
    passes = 2 if device == "cuda" else 1  # on a CPU, PIL's resize of large crops is slow
    for _ in range(passes * SAMPLES // PIECE):
        want, got = next(loader_path), next(device_path)
        assert want["cursor"] == got["cursor"]
        skipped["loader"] += want["skipped_samples"]
        skipped["device"] += got["skipped_samples"]
        assert torch.equal(want["encoded"].params, got["encoded"].params)  # the same samples and crop boxes
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="an image of this batch does not decode")  # none trained black
            pixels, black = decode_rows(SPLIT, got["encoded"], 0, PIECE, torch.device(device))
        assert pixels.device.type == device and pixels.dtype == torch.uint8 and pixels.shape == want["images"].shape
        by_worker = set(got["encoded"].pixel_rows.tolist())
        for i in range(PIECE):
            blob, box = got["encoded"].blob(i), got["encoded"].params_of(i)
            if i in by_worker:  # decoded by PIL on both paths; the device resized the worker's crop region
                assert_the_crop_step_is_pils(pixels[i].cpu(), want["images"][i], box)
                continue
            whole = decode_jpegs([blob], torch.device(device))[0]
            if whole is None:  # PIL on both paths
                assert torch.equal(pixels[i].cpu(), want["images"][i])
                continue
            whole_jpegs += 1
            whole = whole.cpu()
            assert_the_crop_step_is_pils(pixels[i].cpu(), SPLIT.apply(Image.fromarray(whole.permute(1, 2, 0).numpy()), box), box)
            with Image.open(io.BytesIO(blob.numpy().tobytes())) as img:
                by_pil = TF.pil_to_tensor(img.convert("RGB"))
            decoder = (whole.int() - by_pil.int()).abs().float()
            assert decoder.mean() < 6, f"{tuple(by_pil.shape)}: the decoder differs from PIL by {decoder.mean():.2f}"
            differences.append((pixels[i].cpu().int() - want["images"][i].int()).abs().flatten())
    everything = torch.cat(differences).float()
    assert everything.mean() < 1.0, f"mean difference {everything.mean():.3f}, largest {everything.max():.0f}"
    assert whole_jpegs >= SAMPLES // 2  # most samples went through the device decoder
    # The cut-short and the garbage samples (the shuffle buffer may carry one into the next pass); the
    # device path judges them in the worker too.
    assert skipped["device"] == skipped["loader"] >= passes, skipped


@pytest.mark.gpu
def test_the_trainer_decodes_on_the_gpu_on_the_loaders_curve(digits_root, tmp_path, jpeg_shards):
    """The whole path on the GPU: DeviceDecoder's thread and CUDA stream feeding both Gradient
    Cache passes; the run follows the loader-decoded run's curve and counts the same skips, also with
    half of the JPEGs decoded by the workers (data.worker_decode_share)."""
    # Uncompiled: this is about the data path, and compiling would cost each run a minute.
    device = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "device", "run.device=cuda", "data.decoder=device",
                                  "model.compile=false", "data.worker_decode_share=0")
    loader = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "loader", "run.device=cuda", "data.decoder=loader",
                                  "model.compile=false")
    shared = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "shared", "run.device=cuda", "data.decoder=device",
                                  "model.compile=false", "data.worker_decode_share=0.5")  # the workers' pixels pinned, sent per chunk
    for run in (device, shared):
        assert [m["loss"] for m in run] == pytest.approx([m["loss"] for m in loader], rel=2e-3)
        assert [m["skipped_samples_total"] for m in run] == [m["skipped_samples_total"] for m in loader]


@pytest.mark.gpu
def test_the_trainer_on_the_gpu_through_the_workers_arenas_on_the_loaders_curve(digits_root, tmp_path, jpeg_shards):
    """The workers' arenas on the GPU (page-locked shared memory, copied a chunk at a time by the
    training thread, no data thread): the workers decoding every image, and half of them with the
    training thread decoding the other half's JPEGs (data.decode_workers=0); both follow the
    loader-decoded run's curve and count the same skips."""
    loader = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "loader", "run.device=cuda", "data.decoder=loader",
                                  "model.compile=false")
    arenas = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "arenas", "run.device=cuda", "data.decoder=device",
                                  "model.compile=false", "data.worker_decode_share=1")
    half = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "half", "run.device=cuda", "data.decoder=device",
                                "model.compile=false", "data.worker_decode_share=0.5", "data.decode_workers=0")
    for run in (arenas, half):
        assert [m["loss"] for m in run] == pytest.approx([m["loss"] for m in loader], rel=2e-3)
        assert [m["skipped_samples_total"] for m in run] == [m["skipped_samples_total"] for m in loader]


@pytest.mark.gpu
def test_the_trainer_on_the_gpu_through_a_window_of_the_arenas_on_their_curve(digits_root, tmp_path, jpeg_shards, monkeypatch):
    """Arenas that hold half a batch on the GPU: pass 1 hands each chunk back to them once its copy
    has run and copies what pass 2 needs to page-locked host memory on a CUDA stream (`OnHost`),
    pass 2 copies it back on another; the run follows the whole arenas' curve."""
    sizes = ("train.batch_size=384", "train.chunk_size=8", "data.workers=2", "run.device=cuda", "data.decoder=device",
             "model.compile=false", "data.worker_decode_share=1")
    whole = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "whole", *sizes)
    windows, from_host = through_window_arenas(monkeypatch, 384, 8, 2)
    window = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "window", *sizes)
    assert windows and not windows[-1].holds_a_batch and sum(from_host) == 6 * (384 - 8)
    assert [m["loss"] for m in window] == pytest.approx([m["loss"] for m in whole], rel=1e-4)
    assert [m["skipped_samples_total"] for m in window] == [m["skipped_samples_total"] for m in whole]

