"""JPEG decoding on the training device (`data.decoder: device`).

The workers only read the shards and draw each image's crop from its header; the device
decodes. These tests hold that path to the loader's PIL path on JPEG shards with damage
in them: the same samples skipped and counted, the same crops, pixels within the
resampling kernels' rounding, Gradient Cache's two passes on identical pixels, and the
trainer's loss curve. On a CPU the device decoder is torchvision's CPU decoder, the code
the GPU runs but for nvJPEG itself (that half is measured in scripts/bench_e2e.py).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from open_clip.transform import image_transform
from PIL import Image

from clipscale.data.chunks import Arrivals, ChunkSource, KeepBudget
from clipscale.data.decode_process import DecodeProcess, ProcessDecodedRows
from clipscale.data.device_decode import DeviceDecoder, decode_rows
from clipscale.data.encoded import EncodedImages, is_whole_jpeg
from clipscale.data.shards import ShardStream
from clipscale.data.transforms import SplitTransform

from tests.helpers.gradients import float64_clip_loss, gradcache_grads, make_batch, relative_error, tiny_clip
from tests.helpers.jpeg_shards import jpeg, train_on_jpeg_shards

# Shards of 48-px JPEGs (so the crop is resized down, through the antialiasing kernels) cropped to 32.
TRAIN = image_transform(32, is_train=True, aug_cfg={"scale": (0.5, 1.0)})
SPLIT = SplitTransform.split(TRAIN)


def _decoder(where: str, chunk_size: int | None = None):
    """The device decoder in the training process's threads, or in a process of its own (the trainer's)."""
    if where == "thread":
        return DeviceDecoder(SPLIT, torch.device("cpu"), chunk_size=chunk_size)
    return DecodeProcess(SPLIT, torch.device("cpu"), "nvjpeg", chunk_size=chunk_size)


def _stream(urls, decode: bool, piece_size=50):
    return ShardStream(urls, piece_size=piece_size, rank=0, world_size=1, num_workers=1, seed=5, image_transform=TRAIN,
                       tokenizer=lambda captions: torch.tensor([len(c) for c in captions]), shuffle_buffer=64,
                       split=SPLIT, keep_encoded=True, decode=decode)


def test_whole_jpegs_are_told_by_their_markers():
    data = jpeg(Image.new("RGB", (8, 8)))
    assert is_whole_jpeg(data) and is_whole_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy())
    assert not is_whole_jpeg(data[:-1]) and not is_whole_jpeg(data + b"\x00") and not is_whole_jpeg(b"\x89PNG\r\n")


def test_a_chunks_bytes_and_jpeg_checks_taken_at_once_equal_those_taken_sample_by_sample():
    data = jpeg(Image.new("RGB", (8, 8)))
    samples = (b"\xff", data, data[:-1], b"\x89PNG\r\n", data + b"\x00", b"\xff\xd8\xff\xd9", data, b"", data[:4] + data[-2:])
    encoded = EncodedImages.from_samples(samples, tuple((k, 0, 1, 1) for k in range(len(samples))))
    for start, stop in ((0, len(samples)), (1, 4), (6, 9), (3, 4)):
        blobs = encoded.blobs(start, stop)
        assert [bytes(b.numpy()) for b in blobs] == list(samples[start:stop])
        assert encoded.whole_jpegs(start, stop).tolist() == [is_whole_jpeg(s) for s in samples[start:stop]]


def test_the_device_path_skips_the_same_samples_and_draws_the_same_crops(jpeg_shards):
    """Over two epochs: the same cursors, skip counts, tokens, bytes and crop boxes as the loader
    path, no pixels from the workers, and pixels decoded on the device within the resampling
    kernels' rounding of PIL's (PNG and judged samples go through PIL there too: equal)."""
    loader_path, device_path = iter(_stream(jpeg_shards, decode=True)), iter(_stream(jpeg_shards, decode=False))
    skipped = 0
    for _ in range(24):  # 1,200 samples of 597 usable a pass
        a, b = next(loader_path), next(device_path)
        assert "images" not in b
        assert a["cursor"] == b["cursor"] and a["skipped_samples"] == b["skipped_samples"]
        assert torch.equal(a["texts"], b["texts"])
        for column in ("data", "offsets", "params"):
            assert torch.equal(getattr(a["encoded"], column), getattr(b["encoded"], column))
        skipped += b["skipped_samples"]
        pixels = decode_rows(SPLIT, b["encoded"], 0, 50, torch.device("cpu"))
        assert pixels.dtype == torch.uint8 and pixels.shape == a["images"].shape
        difference = (pixels.int() - a["images"].int()).abs()
        assert difference.max() <= 8 and difference.float().mean() < 0.5
        for i in range(50):
            if not is_whole_jpeg(b["encoded"].blob(i).numpy()):
                assert torch.equal(pixels[i], a["images"][i])
    assert skipped >= 4  # the truncated and the garbage sample, in each of two epochs


@pytest.mark.parametrize("where", ["thread", "process"])
@pytest.mark.parametrize("kept,ahead", [(True, True), (True, False), (False, False)],
                         ids=["decoded-ahead", "kept-on-device", "decoded-again"])
def test_device_decoded_chunks_give_gradient_cache_identical_pixels_in_both_passes(jpeg_shards, kept, ahead, where):
    """Chunks decoded as their pieces arrive (before pass 1 asks) or when pass 1 asks; pass 2
    takes the pixels pass 1 kept on the device (each image decoded once a step) or, without
    room for them, decodes its chunks again: either way the gradients equal those of the same
    decoded batch held whole."""
    piece = next(iter(_stream(jpeg_shards, decode=False, piece_size=12)))
    whole = decode_rows(SPLIT, piece["encoded"], 0, 12, torch.device("cpu"))
    model, (_, texts) = tiny_clip(), make_batch(12, seed=1)
    arrivals = Arrivals()
    decoder = _decoder(where, chunk_size=4 if ahead else None)
    budget = KeepBudget(2**30) if kept else None
    images = decoder.column(12, arrivals, SPLIT.to_float, budget)

    def arrive():
        for start in range(0, 12, 3):
            encoded = piece["encoded"]
            rows = range(start, start + 3)
            part = EncodedImages.from_samples(tuple(encoded[i][0] for i in rows), tuple(encoded[i][1] for i in rows))
            images.put(slice(start, start + 3), {"encoded": part})
            arrivals.add(3)

    filler = threading.Thread(target=arrive)
    filler.start()
    if ahead:  # all pieces in before the step: every chunk is being decoded before pass 1 asks
        filler.join()
        deadline = time.monotonic() + 30
        while len(images.ahead) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(images.ahead) == [(0, 4), (4, 8), (8, 12)]
    _, streamed = gradcache_grads(model, float64_clip_loss, images, ChunkSource.of_tensor(texts), chunk_size=4)
    filler.join()
    decoder.close()
    # Chunks of 4: pass 2 re-encodes the first two (the last keeps its graph from pass 1).
    assert decoder.images_decoded == (12 if kept else 12 + 8)
    assert not images.kept and (budget is None or budget.used == 0), "pass 2 took and freed every kept chunk"
    assert not images.ahead, "every chunk decoded ahead was taken by pass 1"
    _, held = gradcache_grads(model, float64_clip_loss, SPLIT.to_float(whole), texts, chunk_size=4)
    assert relative_error(streamed, held) == 0.0


def test_what_pass_one_keeps_stays_within_the_budget(jpeg_shards):
    """A budget of two chunks keeps two and the other chunk is decoded again in pass 2."""
    piece = next(iter(_stream(jpeg_shards, decode=False, piece_size=12)))
    chunk_bytes = 4 * 3 * 32 * 32  # uint8 pixels of one chunk of 4 at the transform's 32 px
    budget = KeepBudget(2 * chunk_bytes)
    decoder = DeviceDecoder(SPLIT, torch.device("cpu"))
    arrivals = Arrivals()
    images = decoder.column(12, arrivals, SPLIT.to_float, budget)
    images.put(slice(0, 12), piece)
    arrivals.add(12)
    bounds = [(0, 4), (4, 8), (8, 12)]
    first = [chunk.clone() for chunk in images.chunks(bounds, torch.device("cpu"), 1, keep=bounds)]
    assert budget.used == 2 * chunk_bytes and len(images.kept) == 2 and decoder.images_decoded == 12
    second = list(images.chunks(bounds, torch.device("cpu"), 2))
    decoder.close()
    assert decoder.images_decoded == 16 and budget.used == 0 and not images.kept
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_batch_released_before_its_step_frees_what_was_decoded_ahead(jpeg_shards, where):
    """The step's budget holds no bytes of a batch that no step will use (a run that stopped)."""
    piece = next(iter(_stream(jpeg_shards, decode=False, piece_size=12)))
    budget, decoder, arrivals = KeepBudget(2 * 4 * 3 * 32 * 32), _decoder(where, chunk_size=4), Arrivals()
    images = decoder.column(12, arrivals, SPLIT.to_float, budget)
    images.put(slice(0, 12), piece)
    arrivals.add(12)
    deadline = time.monotonic() + 30
    while len(images.ahead) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(images.ahead) == [(0, 4), (4, 8)] and budget.used == budget.limit  # the third waits for room
    images.release()
    decoder.close()
    assert budget.used == 0 and not images.ahead


def test_the_trainer_decodes_on_the_device_on_the_loaders_curve(digits_root, tmp_path, jpeg_shards, monkeypatch):
    """With the default loader workers: the step gets the device column (its bytes in the decode
    process, none in the training process), and the run follows the loader-decoded run's curve (the same samples and crops; the
    pixels differ by the resize kernels' rounding) and counts the same skipped samples."""
    record: list = []
    device = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "device", "data.decoder=device",
                                  monkeypatch=monkeypatch, record=record)
    monkeypatch.undo()
    loader = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "loader")
    assert len(record) == 6 and all(isinstance(images.rows, ProcessDecodedRows) for images in record)
    assert [m["loss"] for m in device] == pytest.approx([m["loss"] for m in loader], rel=1e-3)
    assert [m["skipped_samples_total"] for m in device] == [m["skipped_samples_total"] for m in loader]
    assert device[-1]["skipped_samples_total"] >= 1  # the stretch of six steps holds one damaged sample


def test_an_image_whose_data_does_not_decode_is_trained_black_with_a_warning():
    """A header that parses (the worker keeps the sample) over data neither nvJPEG nor PIL decodes:
    the batch keeps its size, the image is black, and the run is told."""
    good = jpeg(Image.new("RGB", (48, 48), (200, 30, 30)))
    broken = good[:20] + b"\x00" * 30 + good[50:]  # the quantisation tables overwritten
    with Image.open(io.BytesIO(broken)) as img:
        assert img.size == (48, 48)  # what the worker sees
    encoded = EncodedImages.from_samples((good, broken, good), ((0, 0, 48, 48),) * 3)
    with pytest.warns(UserWarning, match="does not decode"):
        pixels = decode_rows(SPLIT, encoded, 0, 3, torch.device("cpu"))
    assert pixels.shape == (3, 3, 32, 32)
    assert torch.equal(pixels[1], torch.zeros(3, 32, 32, dtype=torch.uint8))
    assert torch.equal(pixels[0], pixels[2]) and pixels[0].float().mean() > 50


@pytest.mark.timeout(120)  # what it holds against is a wait forever
def test_a_decode_process_that_dies_fails_the_chunks_asked_of_it(jpeg_shards):
    """A chunk asked of a decode process that is gone raises, naming its exit code, instead of
    waiting forever: both one asked before it died and one asked after."""
    piece = next(iter(_stream(jpeg_shards, decode=False, piece_size=12)))
    decoder = _decoder("process")
    images = decoder.column(12, Arrivals(), SPLIT.to_float, None)
    images.put(slice(0, 8), {"encoded": EncodedImages.from_samples(*zip(*(piece["encoded"][i] for i in range(8))))})
    first = images.rows.prepare(0, 8, 1).on_device(torch.device("cpu"), None)
    assert first.shape == (8, 3, 32, 32)
    waiting = images.rows.prepare(8, 12, 1)  # its rows never arrive
    decoder.process.kill()
    with pytest.raises(RuntimeError, match="decoding process ended .exit code -9"):
        waiting.on_device(torch.device("cpu"), None)
    decoder.process.join()
    with pytest.raises(RuntimeError, match="exit code -9"):
        images.rows.prepare(0, 4, 2).on_device(torch.device("cpu"), None)
    decoder.close()


@pytest.mark.timeout(120)
def test_the_decode_process_outlives_the_stop_signals_and_ends_on_the_trainers_sigterm(jpeg_shards):
    """Ctrl-C and Slurm's warning reach every process of the job; the trainer answers them (a
    checkpoint first), so the decoding process must go on decoding until the trainer closes it,
    and end on the SIGTERM multiprocessing sends it at the trainer's exit."""
    piece = next(iter(_stream(jpeg_shards, decode=False, piece_size=12)))
    decoder, cpu = _decoder("process"), torch.device("cpu")
    images = decoder.column(12, Arrivals(), SPLIT.to_float, None)
    images.put(slice(0, 12), piece)
    before = images.rows.prepare(0, 12, 1).on_device(cpu, None)  # the process is up, its handlers set
    for signum in (signal.SIGINT, signal.SIGUSR1):
        os.kill(decoder.process.pid, signum)
    subprocess.run(["kill", "-TERM", str(decoder.process.pid)], check=True)  # a SIGTERM from elsewhere: a user's kill
    assert torch.equal(images.rows.prepare(0, 12, 2).on_device(cpu, None), before)
    decoder.process.terminate()  # SIGTERM from its parent
    decoder.process.join(timeout=30)
    assert decoder.process.exitcode == 0
    decoder.close()
