"""JPEG decoding on the training device (`data.decoder: device`).

The workers only read the shards and draw each JPEG's crop from its header (what is not a JPEG
the device takes, they decode themselves); the device decodes. These tests hold that path to the loader's PIL path on JPEG shards with damage
in them: the same samples skipped and counted, the same crops, pixels within the
resampling kernels' rounding, Gradient Cache's two passes on identical pixels, and the
trainer's loss curve. On a CPU the device decoder is torchvision's CPU decoder, the code
the GPU runs but for nvJPEG itself (that half is measured in scripts/bench_e2e.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time
from itertools import islice
from pathlib import Path

import pytest
import torch
import torchvision.transforms.functional as TF
from open_clip.transform import image_transform
from PIL import Image

from clipscale.data.chunks import Arrivals, ChunkSource, KeepBudget
from clipscale.data.decoders import DeviceDecodedRows, DeviceDecoder, EncodedImages, decode_rows, device_decodes, jpeg_frame
from clipscale.data.shards import ShardStream
from clipscale.data.transforms import SplitTransform
from clipscale.step import TrainStep

from tests.helpers.forked_child import answer_in_a_forked_child
from tests.helpers.gradients import float64_clip_loss, gradcache_grads, make_batch, relative_error, tiny_clip
from tests.helpers.jpeg_shards import jpeg, through_window_arenas, train_on_jpeg_shards
from tests.helpers.user_data import seeded_noise

# Shards of 48-px JPEGs (so the crop is resized down, through the antialiasing kernels) cropped to 32.
TRAIN = image_transform(32, is_train=True, aug_cfg={"scale": (0.5, 1.0)})
SPLIT = SplitTransform.split(TRAIN)


def rows_of(encoded: EncodedImages, start: int, stop: int) -> EncodedImages:
    """Rows [start, stop) of a piece as a piece of their own (the worker's pixels included)."""
    rows = range(start, stop)
    pixel_rows, where = encoded.decoded_rows(start, stop)
    decoded = [None] * (stop - start)
    for row, k in zip(pixel_rows, range(where.start, where.stop)):
        decoded[row] = encoded.worker_image(k)
    return EncodedImages.from_samples(tuple(encoded[i][0] for i in rows), tuple(encoded[i][1] for i in rows), tuple(decoded))


def _stream(urls, decode: bool, piece_size=50, worker_decode_share=0.0, keep_keys=False):
    return ShardStream(urls, piece_size=piece_size, rank=0, world_size=1, num_workers=1, seed=5, image_transform=TRAIN,
                       tokenizer=lambda captions: torch.tensor([len(c) for c in captions]), shuffle_buffer=64,
                       split=SPLIT, keep_encoded=True, decode=decode, worker_decode_share=worker_decode_share,
                       keep_keys=keep_keys)


def _encoded(img: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, **options)
    return out.getvalue()


def test_the_worker_tells_what_the_device_decodes_from_the_header_alone():
    """Baseline and progressive JPEGs, colour or grayscale, go to the device; a CMYK JPEG, a PNG,
    one cut short (no end marker), one with bytes after its end and damaged headers do not."""
    picture = seeded_noise((40, 30), 60, seed=0)
    baseline, progressive = _encoded(picture, format="JPEG"), _encoded(picture, format="JPEG", progressive=True)
    gray, cmyk = _encoded(picture.convert("L"), format="JPEG"), _encoded(picture.convert("CMYK"), format="JPEG")
    frames = {name: jpeg_frame(data) for name, data in
              (("baseline", baseline), ("progressive", progressive), ("gray", gray), ("cmyk", cmyk))}
    assert (frames["baseline"].height, frames["baseline"].width, frames["baseline"].components) == (30, 40, 3)
    assert (frames["progressive"].marker, frames["gray"].components, frames["cmyk"].components) == (0xC2, 1, 4)
    assert [device_decodes(frames[name], data) for name, data in
            (("baseline", baseline), ("progressive", progressive), ("gray", gray), ("cmyk", cmyk))] == [True, True, True, False]
    png = _encoded(picture, format="PNG")
    for refused in (png, baseline[: len(baseline) // 2], baseline + b"\x00", b"\xff\xd8\xff" + bytes(range(256)) + b"\xff\xd9",
                    b"", b"\xff\xd8"):
        assert not device_decodes(jpeg_frame(refused), refused)
    assert jpeg_frame(png) is None and jpeg_frame(baseline[:30] + b"\x00" * 40) is None


def test_every_kind_of_image_arrives_as_promised_through_the_device_path(tmp_path):
    """A progressive, a grayscale, a CMYK JPEG, a PNG and a truncated JPEG in a shard: the JPEGs
    the device takes come as bytes, the CMYK one and the PNG as the worker's pixels (the region of
    the crop the loader path draws, which the device resizes to the loader's pixels), the truncated
    one is skipped and counted."""
    import webdataset as wds

    picture = Image.merge("RGB", [Image.linear_gradient("L").rotate(angle).resize((48, 40)) for angle in (0, 90, 45)])
    images = {"progressive": _encoded(picture, format="JPEG", progressive=True), "gray": _encoded(picture.convert("L"), format="JPEG"),
              "cmyk": _encoded(picture.convert("CMYK"), format="JPEG"), "png": _encoded(picture, format="PNG"),
              "truncated": _encoded(picture, format="JPEG")[:300], "baseline": _encoded(picture, format="JPEG")}
    url = str(tmp_path / "kinds.tar")
    with wds.TarWriter(url) as sink:
        for name, data in images.items():
            sink.write({"__key__": name, "jpg": data, "txt": f"a {name} image"})
    stream = lambda decode: ShardStream([url], piece_size=5, rank=0, world_size=1, num_workers=1, seed=1, image_transform=TRAIN,  # noqa: E731
                                        tokenizer=lambda captions: torch.tensor([len(c) for c in captions]), shuffle_buffer=1,
                                        split=SPLIT, keep_encoded=True, decode=decode, keep_keys=True)
    device, loader = next(iter(stream(False))), next(iter(stream(True)))
    assert device["skipped_samples"] == loader["skipped_samples"] == 1
    names = [key for _, key in device["sample_keys"]]
    assert sorted(names) == ["baseline", "cmyk", "gray", "png", "progressive"]
    encoded = device["encoded"]
    by_worker = [names[row] for row in encoded.pixel_rows.tolist()]
    assert sorted(by_worker) == ["cmyk", "png"]
    for k, row in enumerate(encoded.pixel_rows.tolist()):
        top, left, height, width = encoded.params_of(row)
        with Image.open(io.BytesIO(images[names[row]])) as img:
            region = TF.pil_to_tensor(img.convert("RGB")).narrow(1, top, height).narrow(2, left, width)
        assert torch.equal(encoded.worker_image(k), region) and len(encoded.blob(row)) == 0
    pixels, black = decode_rows(SPLIT, encoded, 0, 5, torch.device("cpu"))
    assert black == 0 and (pixels.int() - loader["images"].int()).abs().max() <= 8
    # The worker's regions resized by the device: the loader's pixels but for rounding (PIL rounds
    # its horizontal pass to uint8 before the vertical one; at this image's sharp edges, 3 levels).
    for row in encoded.pixel_rows.tolist():
        assert (pixels[row].int() - loader["images"][row].int()).abs().max() <= 4


def test_a_runs_pieces_carry_nothing_per_sample_but_tensors(jpeg_shards):
    """What crosses from a loader worker to the trainer: tensors (and a few counts), no Python
    object a sample: no keys (those only where asked, `keep_keys`), no list of captions or crops."""
    piece = next(iter(_stream(jpeg_shards, decode=False)))
    assert "sample_keys" not in piece and "images" not in piece
    for key, value in piece.items():
        if isinstance(value, (list, tuple, dict)):
            assert len(value) < 50, f"{key} holds {len(value)} Python objects"
    encoded = piece["encoded"]
    assert all(isinstance(getattr(encoded, name), torch.Tensor) for name in ("data", "offsets", "params", "pixels", "pixel_sizes", "pixel_rows"))
    assert isinstance(piece["texts"], torch.Tensor) and len(piece["texts"]) == 50


def test_a_chunks_bytes_taken_at_once_equal_those_taken_sample_by_sample():
    data = jpeg(Image.new("RGB", (8, 8)))
    samples = (b"\xff", data, data[:-1], b"\x89PNG\r\n", data + b"\x00", b"\xff\xd8\xff\xd9", data, b"", data[:4] + data[-2:])
    encoded = EncodedImages.from_samples(samples, tuple((k, 0, 1, 1) for k in range(len(samples))))
    for start, stop in ((0, len(samples)), (1, 4), (6, 9), (3, 4)):
        blobs = encoded.blobs(start, stop)
        assert [bytes(b.numpy()) for b in blobs] == list(samples[start:stop])


def test_the_device_path_skips_the_same_samples_and_draws_the_same_crops(jpeg_shards):
    """Over two epochs: the same cursors, skip counts, tokens and crop boxes as the loader path, the
    bytes of the JPEGs the device takes, the worker's pixels of the others (a PNG, one with bytes
    after its end: the regions of the loader path's crops, which the device resizes), and the
    device's pixels within the resampling kernels' rounding of PIL's."""
    loader_path, device_path = iter(_stream(jpeg_shards, decode=True)), iter(_stream(jpeg_shards, decode=False))
    skipped = by_worker_pixels = 0
    for _ in range(24):  # 1,200 samples of 597 usable a pass
        a, b = next(loader_path), next(device_path)
        assert "images" not in b
        assert a["cursor"] == b["cursor"] and a["skipped_samples"] == b["skipped_samples"]
        assert torch.equal(a["texts"], b["texts"])
        assert torch.equal(a["encoded"].params, b["encoded"].params)
        by_worker = set(b["encoded"].pixel_rows.tolist())
        by_worker_pixels += len(by_worker)
        for i in range(50):
            if i not in by_worker:
                assert torch.equal(a["encoded"].blob(i), b["encoded"].blob(i))
        skipped += b["skipped_samples"]
        pixels, black = decode_rows(SPLIT, b["encoded"], 0, 50, torch.device("cpu"))
        assert pixels.dtype == torch.uint8 and pixels.shape == a["images"].shape and black == 0
        difference = (pixels.int() - a["images"].int()).abs()
        assert difference.max() <= 8 and difference.float().mean() < 0.5
        for i in by_worker:  # decoded by PIL as the loader's were: only the resize differs
            assert (pixels[i].int() - a["images"][i].int()).abs().max() <= 4
    assert skipped >= 4  # the truncated and the garbage sample, in each of two epochs
    assert by_worker_pixels >= 4  # the PNG and the one with trailing bytes, in each of two epochs


def test_the_workers_share_of_jpegs_is_decoded_without_pil_into_pils_very_pixels(tmp_path):
    """A worker decodes its share of the JPEGs the device takes with libjpeg-turbo directly
    (`SplitTransform.jpeg_region`): baseline, progressive, grayscale, each chroma subsampling, the
    crop's region equal to PIL's decode, bit for bit; damaged entropy data and a region the worker
    must resize are left to PIL (None), and through the stream PIL's region is what arrives."""
    import webdataset as wds

    picture = seeded_noise((52, 44), 60, seed=3)
    kinds = {"baseline": _encoded(picture, format="JPEG"), "progressive": _encoded(picture, format="JPEG", progressive=True),
             "gray": _encoded(picture.convert("L"), format="JPEG"), "444": _encoded(picture, format="JPEG", subsampling=0),
             "422": _encoded(picture, format="JPEG", subsampling=1, quality=50)}
    box = (3, 5, 30, 40)
    for name, data in kinds.items():
        with Image.open(io.BytesIO(data)) as img:
            assert torch.equal(SPLIT.jpeg_region(data, box), SPLIT.crop_region(img.convert("RGB"), box)), name
    baseline = bytearray(kinds["baseline"])
    baseline[len(baseline) // 2 : len(baseline) // 2 + 40] = bytes(range(40))  # damaged entropy-coded data, whole headers
    assert device_decodes(jpeg_frame(bytes(baseline)), bytes(baseline)) and SPLIT.jpeg_region(bytes(baseline), box) is None
    large = _encoded(seeded_noise((200, 150), 60, seed=4), format="JPEG")
    assert SPLIT.jpeg_region(large, (0, 0, 150, 200)) is None  # more than REGION_LIMIT outputs: PIL resizes it
    url = str(tmp_path / "kinds.tar")
    with wds.TarWriter(url) as sink:
        for name, data in {**kinds, "damaged": bytes(baseline)}.items():
            sink.write({"__key__": name, "jpg": data, "txt": f"a {name} image"})
    piece = next(iter(ShardStream([url], piece_size=6, rank=0, world_size=1, num_workers=1, seed=1, image_transform=TRAIN,
                                  tokenizer=lambda captions: torch.tensor([len(c) for c in captions]), shuffle_buffer=1,
                                  split=SPLIT, keep_encoded=True, decode=False, worker_decode_share=1.0, keep_keys=True)))
    encoded, names = piece["encoded"], [key for _, key in piece["sample_keys"]]
    assert encoded.all_by_worker() and sorted(names) == sorted([*kinds, "damaged"])
    for k, row in enumerate(encoded.pixel_rows.tolist()):
        with Image.open(io.BytesIO(kinds.get(names[row], bytes(baseline)))) as img:
            assert torch.equal(encoded.worker_image(k), SPLIT.crop_region(img.convert("RGB"), encoded.params_of(row))), names[row]


def test_the_workers_decode_their_share_of_the_gpus_jpegs_the_same_way_on_every_shape(jpeg_shards):
    """data.worker_decode_share: the workers decode that share of the JPEGs the device takes
    (as pixels, their bytes dropped), each sample's lot fixed by its seed: the same samples
    however the stream is cut into pieces; the same samples, crops and tokens as without it,
    and the chunk's pixels within the resampling kernels' rounding of the device's."""
    def lots(share: float, piece_size: int, pieces: int) -> dict:
        decided = {}
        for piece in islice(iter(_stream(jpeg_shards, decode=False, piece_size=piece_size, worker_decode_share=share,
                                         keep_keys=True)), pieces):
            by_worker = set(piece["encoded"].pixel_rows.tolist())
            decided.update({key: row in by_worker for row, key in enumerate(piece["sample_keys"])})
        return decided

    none, half, every = lots(0.0, 50, 12), lots(0.5, 50, 12), lots(1.0, 50, 12)
    assert all(every.values()) and sum(none.values()) <= 4  # without a share: only what the device cannot take
    assert 0.35 < sum(half.values()) / len(half) < 0.65
    assert lots(0.5, 30, 20) == half, "a sample's lot depends on how the stream is cut"
    plain, shared = iter(_stream(jpeg_shards, decode=False)), iter(_stream(jpeg_shards, decode=False, worker_decode_share=0.5))
    for _ in range(4):
        a, b = next(plain), next(shared)
        assert a["cursor"] == b["cursor"] and torch.equal(a["texts"], b["texts"])
        assert torch.equal(a["encoded"].params, b["encoded"].params)
        ours, theirs = decode_rows(SPLIT, b["encoded"], 0, 50, torch.device("cpu"))[0], decode_rows(SPLIT, a["encoded"], 0, 50, torch.device("cpu"))[0]
        difference = (ours.int() - theirs.int()).abs()
        assert difference.max() <= 8 and difference.float().mean() < 0.5
        by_worker = set(b["encoded"].pixel_rows.tolist())
        for row in range(50):  # the workers' share travels as pixels only; the rest as the same bytes
            assert len(b["encoded"].blob(row)) == 0 if row in by_worker else torch.equal(a["encoded"].blob(row), b["encoded"].blob(row))


@pytest.mark.parametrize("kept,ahead", [(True, True), (True, False), (False, False)],
                         ids=["decoded-ahead", "kept-on-device", "decoded-again"])
def test_device_decoded_chunks_give_gradient_cache_identical_pixels_in_both_passes(jpeg_shards, kept, ahead):
    """Chunks decoded as their pieces arrive (before pass 1 asks) or when pass 1 asks; pass 2
    takes the pixels pass 1 kept on the device (each image decoded once a step) or, without
    room for them, decodes its chunks again: either way the gradients equal those of the same
    decoded batch held whole."""
    piece = next(iter(_stream(jpeg_shards, decode=False, piece_size=12)))
    whole, _ = decode_rows(SPLIT, piece["encoded"], 0, 12, torch.device("cpu"))
    model, (_, texts) = tiny_clip(), make_batch(12, seed=1)
    arrivals = Arrivals()
    decoder = DeviceDecoder(SPLIT, torch.device("cpu"), chunk_size=4 if ahead else None)
    budget = KeepBudget(2**30) if kept else None
    images = decoder.column(12, arrivals, SPLIT.to_float, budget)

    def arrive():
        for start in range(0, 12, 3):
            images.put(slice(start, start + 3), {"encoded": rows_of(piece["encoded"], start, start + 3)})
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


def test_chunks_decoded_ahead_by_the_caller_take_an_even_share_within_the_budget(jpeg_shards):
    """`prepare_some_ahead` (the training thread, between the previous step's pass-2 chunks): each call
    decodes an even share of what is left over the calls left, stops where the budget has no room,
    and pass 1 takes what it decoded and decodes the rest itself: the gradients equal those of the
    same decoded batch held whole, and the budget ends empty."""
    piece = next(iter(_stream(jpeg_shards, decode=False, piece_size=12)))
    whole, _ = decode_rows(SPLIT, piece["encoded"], 0, 12, torch.device("cpu"))
    model, (_, texts) = tiny_clip(), make_batch(12, seed=1)
    chunk_bytes = 4 * 3 * 32 * 32
    budget, arrivals = KeepBudget(2 * chunk_bytes), Arrivals()
    decoder = DeviceDecoder(SPLIT, torch.device("cpu"), chunk_size=4, threads=0)
    images = decoder.column(12, arrivals, SPLIT.to_float, budget)
    images.put(slice(0, 12), piece)
    arrivals.add(12)
    images.prepare_some_ahead(calls_left=3)  # three chunks over three calls: one
    assert sorted(images.ahead) == [(0, 4)] and decoder.images_decoded == 4
    images.prepare_some_ahead(calls_left=1)  # the two left in one call, but room for one more only
    assert sorted(images.ahead) == [(0, 4), (4, 8)] and budget.used == budget.limit and decoder.images_decoded == 8
    _, streamed = gradcache_grads(model, float64_clip_loss, images, ChunkSource.of_tensor(texts), chunk_size=4)
    assert not images.ahead and budget.used == 0
    _, held = gradcache_grads(model, float64_clip_loss, SPLIT.to_float(whole), texts, chunk_size=4)
    assert relative_error(streamed, held) == 0.0


def test_pieces_of_a_chunk_decoded_ahead_go_back_to_their_arena_before_the_batch_trains(jpeg_shards):
    """Pieces in a worker's arena whose chunk the training thread decoded ahead (held in the budget:
    on the device until pass 2 is done with it) go back to the worker at once, in order, while the
    batch is still to train, so the worker writes the batch after there; pieces of chunks not
    decoded ahead stay. The step trains on the same pixels as the batch held whole, and a row
    given back is never read again."""
    from clipscale.data.chunks import WorkerArenas

    cpu = torch.device("cpu")
    arenas = WorkerArenas(workers=1, arena_bytes=4 * 2**20, sample_bytes=2**15)
    stream = _stream(jpeg_shards, decode=False, piece_size=4, worker_decode_share=1.0)
    stream.arenas = arenas
    pieces = [ShardStream.taken_from(arenas, carried) for carried in islice(stream, 3)]
    ends = [piece["encoded"].arena_span[2] for piece in pieces]
    whole = torch.cat([decode_rows(SPLIT, piece["encoded"], 0, 4, cpu)[0] for piece in pieces])
    model, (_, texts) = tiny_clip(), make_batch(12, seed=1)
    decoder = DeviceDecoder(SPLIT, cpu, chunk_size=4, threads=0, arenas=arenas)
    budget, arrivals = KeepBudget(2 * 4 * 3 * 32 * 32), Arrivals()
    images = decoder.column(12, arrivals, SPLIT.to_float, budget)
    for k, piece in enumerate(pieces):
        images.put(slice(4 * k, 4 * k + 4), piece)
    arrivals.add(12)
    assert int(arenas.released[0]) == 0
    images.prepare_some_ahead(calls_left=3)
    assert int(arenas.released[0]) == ends[0]
    images.prepare_some_ahead(calls_left=1)  # room in the budget for one more chunk only
    assert int(arenas.released[0]) == ends[1]
    with pytest.raises(RuntimeError, match="given back"):
        images.rows.encoded.rows(4, 8)
    _, streamed = gradcache_grads(model, float64_clip_loss, images, ChunkSource.of_tensor(texts), chunk_size=4)
    assert int(arenas.released[0]) == ends[1], "the last chunk's piece, decoded in pass 1 and again in pass 2, held"
    _, held = gradcache_grads(model, float64_clip_loss, SPLIT.to_float(whole), texts, chunk_size=4)
    assert relative_error(streamed, held) == 0.0
    images.release()
    assert int(arenas.released[0]) == ends[2]


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


def test_a_batch_released_before_its_step_frees_what_was_decoded_ahead(jpeg_shards):
    """The step's budget holds no bytes of a batch that no step will use (a run that stopped)."""
    piece = next(iter(_stream(jpeg_shards, decode=False, piece_size=12)))
    budget, decoder, arrivals = KeepBudget(2 * 4 * 3 * 32 * 32), DeviceDecoder(SPLIT, torch.device("cpu"), chunk_size=4), Arrivals()
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
    """With the default loader workers: the step gets the device column, and the run follows the
    loader-decoded run's curve, also with half of the JPEGs decoded by the workers (the same samples
    and crops; the pixels differ by the resize kernels' rounding) and counts the same skipped samples."""
    record: list = []
    device = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "device", "data.decoder=device",
                                  "data.worker_decode_share=0", monkeypatch=monkeypatch, record=record)
    loader = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "loader", "data.decoder=loader")
    shared = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "shared", "data.decoder=device",
                                  "data.worker_decode_share=0.5")
    monkeypatch.undo()
    assert len(record) == 18 and all(isinstance(images.rows, DeviceDecodedRows) for images in record[:6] + record[12:])

    def by_workers(steps: list) -> float:  # the share of a run's images the workers decoded
        pieces = [encoded for images in steps for _, encoded in images.rows.encoded.pieces]
        return sum(len(encoded.pixel_rows) for encoded in pieces) / sum(len(encoded) for encoded in pieces)

    assert by_workers(record[:6]) < 0.05 and 0.35 < by_workers(record[12:]) < 0.65
    for run in (device, shared):  # the second with half of the device's JPEGs decoded by the workers
        assert [m["loss"] for m in run] == pytest.approx([m["loss"] for m in loader], rel=1e-3)
        assert [m["skipped_samples_total"] for m in run] == [m["skipped_samples_total"] for m in loader]
    assert device[-1]["skipped_samples_total"] >= 1  # the stretch of six steps holds one damaged sample


def test_images_no_decoder_takes_are_trained_black_and_counted_once(digits_root, tmp_path, monkeypatch):
    """JPEGs whole by their headers whose data decodes nowhere are trained black and counted in
    metrics.jsonl (images_trained_black): once each, whether Gradient Cache's pass 2 decodes
    their chunk again (nothing kept on the device) or finds it kept."""
    from tests.helpers import jpeg_shards as helper

    for index in (5, 6, 8, 9, 10, 11):
        monkeypatch.setitem(helper.DAMAGED, index, "huffman")
    (tmp_path / "shards").mkdir()
    urls = helper.write_jpeg_shards(digits_root, tmp_path / "shards")
    again = train_on_jpeg_shards(digits_root, tmp_path, urls, "again", "data.decoder=device")
    kept = train_on_jpeg_shards(digits_root, tmp_path, urls, "kept", "data.decoder=device", "data.keep_on_device_gib=1")
    totals = [m["images_trained_black_total"] for m in again]
    assert totals[-1] >= 1 and totals == sorted(totals) and sum(m["images_trained_black"] for m in again) == totals[-1]
    assert totals == [m["images_trained_black_total"] for m in kept]  # each at its own batch's step, chunks decoded ahead or not


def test_an_image_whose_data_does_not_decode_is_trained_black_with_a_warning():
    """A header that parses (the worker keeps the sample) over data neither nvJPEG nor PIL decodes:
    the batch keeps its size, the image is black, and the run is told."""
    good = jpeg(Image.new("RGB", (48, 48), (200, 30, 30)))
    broken = good[:20] + b"\x00" * 30 + good[50:]  # the quantisation tables overwritten
    with Image.open(io.BytesIO(broken)) as img:
        assert img.size == (48, 48)  # what the worker sees
    encoded = EncodedImages.from_samples((good, broken, good), ((0, 0, 48, 48),) * 3)
    with pytest.warns(UserWarning, match="does not decode"):
        pixels, black = decode_rows(SPLIT, encoded, 0, 3, torch.device("cpu"))
    assert pixels.shape == (3, 3, 32, 32) and black == 1
    assert torch.equal(pixels[1], torch.zeros(3, 32, 32, dtype=torch.uint8))
    assert torch.equal(pixels[0], pixels[2]) and pixels[0].float().mean() > 50


def test_workers_decoding_every_image_write_into_arenas_and_train_on_the_threads_curve(digits_root, tmp_path, jpeg_shards,
                                                                                       monkeypatch):
    """data.worker_decode_share=1 with loader workers: each worker writes its crop regions into its
    arena (WorkerArenas), the training thread pulls the pieces and resizes each chunk itself (no
    gathering or decoding thread), and the run equals, loss for loss, the same share through the
    gathering thread's pinned copies (arenas refused), and half the share with the training thread
    decoding the other half's JPEGs (data.decode_workers=0); nothing kept on the device, so pass 2
    reads the arenas again before their pieces are given back."""
    import clipscale.data.pipeline as pipeline

    record: list = []
    real_call = TrainStep.__call__

    def recording(into: list):
        def call(step, images, texts, lr=None):
            into.append(images)
            return real_call(step, images, texts, lr)
        return call

    monkeypatch.setattr(TrainStep, "__call__", recording(record))
    arenas = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "arenas", "data.decoder=device",
                                  "data.worker_decode_share=1")
    assert all(encoded.arena_span is not None for images in record for _, encoded in images.rows.encoded.pieces)
    assert not [thread.name for thread in threading.enumerate() if thread.name.startswith(("clipscale-batches", "clipscale-decode",
                                                                                         "clipscale-ahead"))]
    half: list = []  # the training thread decodes the GPU's JPEGs, the workers half of them into arenas
    monkeypatch.setattr(TrainStep, "__call__", recording(half))
    both = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "both", "data.decoder=device",
                                "data.worker_decode_share=0.5", "data.decode_workers=0")
    pieces = [encoded for images in half for _, encoded in images.rows.encoded.pieces]
    assert all(encoded.arena_span is not None for encoded in pieces if len(encoded.pixel_rows))
    assert 0.3 < sum(len(encoded.pixel_rows) for encoded in pieces) / sum(len(encoded) for encoded in pieces) < 0.7
    monkeypatch.undo()
    monkeypatch.setattr(pipeline, "ARENA_HOST_FRACTION", 0.0)
    copied = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "copied", "data.decoder=device",
                                  "data.worker_decode_share=1")
    # The CPU decodes a JPEG the same way wherever it runs (the GPU's half is torchvision's CPU decoder here).
    for run in (copied, both):
        assert [m["loss"] for m in arenas] == [m["loss"] for m in run]
        assert [m["skipped_samples_total"] for m in arenas] == [m["skipped_samples_total"] for m in run]


def rows_prepared_ahead(monkeypatch) -> list[int]:
    """The rows each call of `ChunkSource.prepare_some_ahead` (pass 2's work-ahead) prepares, from now on."""
    ahead_rows: list[int] = []
    real_prepare = ChunkSource.prepare_some_ahead

    def counting(source, calls_left):
        before = source.ahead_until
        real_prepare(source, calls_left)
        ahead_rows.append(source.ahead_until - before)

    monkeypatch.setattr(ChunkSource, "prepare_some_ahead", counting)
    return ahead_rows


def test_a_batch_larger_than_the_arenas_streams_through_them_on_the_same_curve(digits_root, tmp_path, jpeg_shards,
                                                                                monkeypatch):
    """Share 1 with arenas that hold about half of a worker's pieces of a batch (`arena_window`): pass 1
    hands each chunk's pieces back to the arenas once the chunk is on the device, and what pass 2
    needs again and the budget could not keep waits on the host (`OnHost`), so the workers write
    the rest of the batch meanwhile. With nothing kept on the device, with some of it and with all
    of it, the run equals, loss for loss, the same share through the gathering thread's copies; a
    pass 1 that kept the pieces until the step's end would wait for room forever (the alarm below).
    Pass 2 reads only what pass 1 kept, on the device or the host, so between its chunks it begins
    the next batch (`BatchStream._work_ahead`), preparing its chunks ahead on the device where the
    budget has room again and beyond it into the host's slots pass 2 has read: every step after the
    first finds all its chunks prepared, however little the device keeps, and the workers write the
    rest of the next batch meanwhile. The host memory pass 2's chunks wait in (`HostWaitingRoom`) is
    made as the first batches need it and reused: never more than a batch's."""
    import clipscale.data.pipeline as pipeline
    from clipscale.data.chunks import HostWaitingRoom

    def stuck(signum, frame):
        raise TimeoutError("the run waited 120 s: a worker found no room in its arena")

    ahead_rows = rows_prepared_ahead(monkeypatch)

    batch, chunk, workers = 384, 8, 2
    sizes = (f"train.batch_size={batch}", f"train.chunk_size={chunk}", f"data.workers={workers}",
             "data.decoder=device", "data.worker_decode_share=1")
    monkeypatch.setattr(pipeline, "arenas_room", lambda: 0.0)
    copied = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "copied", *sizes)
    windows, from_host = through_window_arenas(monkeypatch, batch, chunk, workers)
    reread = 6 * (batch - chunk)  # pass 2's rows a run: every chunk but the last (its graph reused)
    chunk_bytes = chunk * 3 * 32 * 32
    monkeypatch.setattr(HostWaitingRoom, "SEGMENT_BYTES", 10 * chunk_bytes)
    room_bytes = []  # the waiting room's bytes as each batch's pass 1 begins
    begin_batch = HostWaitingRoom.begin_batch
    monkeypatch.setattr(HostWaitingRoom, "begin_batch", lambda room: room_bytes.append(room.bytes) or begin_batch(room))
    held_by_pass_1 = []  # chunks pass 1 copied into the room (not those prepared ahead there)
    hold = HostWaitingRoom.hold
    monkeypatch.setattr(HostWaitingRoom, "hold", lambda room, chunk, *args: held_by_pass_1.append(1) or hold(room, chunk, *args))
    # Rows read from the host: pass 2's, and pass 1's of chunks prepared ahead into the room.
    for kept_chunks, on_host in ((0, lambda rows, ahead: rows == reread + ahead), (20, lambda rows, ahead: 0 < rows < reread + ahead),
                                 (10**4, lambda rows, ahead: rows == 0)):
        from_host.clear()
        ahead_rows.clear()
        room_bytes.clear()
        held_by_pass_1.clear()
        previous = signal.signal(signal.SIGALRM, stuck)
        signal.alarm(120)
        try:
            streamed = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, f"streamed{kept_chunks}", *sizes,
                                            f"data.keep_on_device_gib={kept_chunks * chunk_bytes / 2**30}")
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        assert windows[-1] is not None and not windows[-1].holds_a_batch, windows
        assert on_host(sum(from_host), sum(ahead_rows)), (kept_chunks, sum(from_host), sum(ahead_rows))
        assert len(room_bytes) == 6 and room_bytes == sorted(room_bytes), room_bytes
        assert room_bytes[-1] <= reread // 6 * chunk_bytes // chunk + 10 * chunk_bytes, (kept_chunks, room_bytes)
        assert sum(ahead_rows) == 5 * batch, (kept_chunks, ahead_rows)
        if kept_chunks == 0:  # the first step's chunks only: a chunk prepared ahead into the room stays in its slot
            assert len(held_by_pass_1) == reread // 6 // chunk, len(held_by_pass_1)
        assert [m["loss"] for m in streamed] == [m["loss"] for m in copied], kept_chunks
        assert [m["skipped_samples_total"] for m in streamed] == [m["skipped_samples_total"] for m in copied]


def test_the_waiting_rooms_first_segments_are_made_ahead_in_a_thread_of_their_own(monkeypatch):
    """Where a window of the arenas is planned, the room's segments for the first batch's pixels
    beyond the device are made from the start in a thread of its own (`HostWaitingRoom(make_ahead)`),
    while the towers compile, and taken in order as pass 1 reaches them; past them the room makes
    more where it is, as before. Every chunk lands in rows of its own."""
    import threading

    from clipscale.data import chunks
    from clipscale.data.chunks import HostWaitingRoom

    made_in = []
    real = chunks.pinned_empty
    monkeypatch.setattr(chunks, "pinned_empty", lambda shape, dtype: made_in.append(threading.current_thread().name)
                        or real(shape, dtype))
    monkeypatch.setattr(HostWaitingRoom, "SEGMENT_BYTES", 4_000)  # three chunks of 1,000 bytes (1,024 aligned) a segment
    room = HostWaitingRoom(make_ahead=6_000, chunk_bytes=1_000)  # two segments
    sent = [torch.full((1_000,), k, dtype=torch.uint8) for k in range(7)]
    held = [room.hold(chunk, None) for chunk in sent]
    assert made_in == ["clipscale-room_0", "clipscale-room_0", threading.current_thread().name], made_in
    assert len(room.segments) == 3 and room.bytes == 3 * 3_072
    assert all(torch.equal(chunk.host, expected) for chunk, expected in zip(held, sent))
    for chunk in held:
        chunk.leave(None)  # pass 2 has read them
    room.begin_batch()  # the next batch reuses them: nothing made
    held = [room.hold(chunk, None) for chunk in sent[:6]]
    assert len(made_in) == 3 and all(torch.equal(chunk.host, expected) for chunk, expected in zip(held, sent))


def test_pass_twos_chunks_beyond_the_rooms_limit_wait_on_disk_and_come_back_bit_for_bit(monkeypatch, tmp_path):
    """With a spill file (a batch too large for the device's keep and the host's room together), the
    room holds at most its planned bytes and the other chunks go to disk, spread over the batch at
    the spill's share rather than all at its end; each comes back bit for bit as pass 2 prepares
    it, `LOOKAHEAD` read ahead as `ChunkSource` does, though the disk is slower than the chunks
    come (a staging buffer is filled only after its last write); the next batch writes over the
    last one's from the file's start; the file is unlinked from the start (the folder stays
    empty), and a failed write is one error naming the folder when its chunk is read."""
    from collections import deque

    from clipscale.data.chunks import LOOKAHEAD, HostWaitingRoom, OnDisk, OnHost, SpillFile
    from clipscale.errors import UserError

    monkeypatch.setattr(HostWaitingRoom, "SEGMENT_BYTES", 4_000)  # three chunks of 1,000 bytes (1,024 aligned) a segment
    slow_write = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *args: time.sleep(0.02) or slow_write(*args))  # a disk slower than pass 1
    spill = SpillFile(str(tmp_path), share=0.5)
    room = HostWaitingRoom(make_ahead=6_144, chunk_bytes=1_000, spill=spill)  # two segments: six chunks

    def pass_two(held: list) -> list[torch.Tensor]:
        pending, back = deque(chunk.prepared() for chunk in held[:LOOKAHEAD]), []
        for chunk in held[LOOKAHEAD:] + [None] * LOOKAHEAD:
            read = pending.popleft()
            back.append(read.on_device(torch.device("cpu"), None))
            if isinstance(read, OnHost):
                read.leave(None)  # as `ChunkSource` does: its slot takes another chunk
            if chunk is not None:
                pending.append(chunk.prepared())
        return back

    for batch in range(2):
        room.begin_batch()
        sent = [torch.randint(0, 256, (1_000,), dtype=torch.uint8) for _ in range(14)]
        held = [room.hold(chunk, None) for chunk in sent]
        kinds = "".join("d" if isinstance(chunk, OnDisk) else "h" for chunk in held if isinstance(chunk, (OnDisk, OnHost)))
        assert kinds == "hd" * 6 + "dd", kinds  # every other chunk to disk until the room is full, then all
        assert room.bytes == 6_144 and os.listdir(tmp_path) == []
        assert all(torch.equal(back, chunk) for back, chunk in zip(pass_two(held), sent)), batch
        assert os.fstat(spill.fd).st_size == 8 * SpillFile.ALIGN  # the second batch wrote over the first
    assert len(spill.buffers) == SpillFile.BUFFERS

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    room.begin_batch()
    held = [room.hold(torch.zeros(1_000, dtype=torch.uint8), None) for _ in range(2)]
    with pytest.raises(UserError, match=f"spill file for pass 2's images in {tmp_path}: No space left on device"):
        held[1].prepared().on_device(torch.device("cpu"), None)
    spill.close()


def mapped_in_a_forked_child(addresses: list[int]) -> list[bool]:
    """Whether each address is mapped in a child forked now (read from its /proc/self/maps)."""
    def mapped() -> bytes:
        with open("/proc/self/maps") as maps:
            ranges = [[int(bound, 16) for bound in line.split()[0].split("-")] for line in maps]
        return bytes(any(low <= at < high for low, high in ranges) for at in addresses)

    return [bool(byte) for byte in answer_in_a_forked_child(mapped)]


@pytest.mark.filterwarnings("ignore:This process.*multi-threaded:DeprecationWarning")  # the child only writes to a pipe and exits
def test_host_memory_made_to_be_page_locked_is_left_out_of_forked_loader_workers(tmp_path):
    """The waiting room's segments (`unforked_pages`, under `pinned_empty`) and the spill file's
    staging buffers are not mapped in a forked child: Linux copies pinned pages into every child
    at fork, and 14 loader workers forked while pass 2's room was page-locked each took a copy of
    it (a million samples on one H100: the host's 128 GiB gone before the first chunk)."""
    from clipscale.data.chunks import SpillFile, unforked_pages

    segment = unforked_pages(8 * 2**20)
    segment.fill_(1)
    spill = SpillFile(str(tmp_path), share=1.0)
    spill.hold(torch.zeros(4_096, dtype=torch.uint8), None).written.result()
    made = [segment.data_ptr()] + [buffer.data_ptr() for buffer in spill.buffers]
    plain = torch.ones(2**20, dtype=torch.uint8)  # a control: ordinary memory is the child's too
    assert mapped_in_a_forked_child(made + [plain.data_ptr()]) == [False] * len(made) + [True]
    spill.close()


def test_a_batch_beyond_the_host_spills_to_disk_through_the_arenas_window_on_the_same_curve(digits_root, tmp_path,
                                                                                              jpeg_shards, monkeypatch):
    """Share 1 with a window of the arenas on a host too small for pass 2's pixels beside it (a
    million samples on one 80 GB GPU, in miniature): the window takes the least it can, the host's
    room holds what it has left, and the rest waits on disk in $TMPDIR (`SpillFile`); the run
    equals, loss for loss, the same share through the gathering thread's copies, with pass 2's
    chunks read back from disk and from the host, and leaves nothing in the folder."""
    import tempfile

    import clipscale.data.pipeline as pipeline
    from clipscale.data.chunks import HostWaitingRoom, OnDisk

    batch, chunk, workers = 384, 8, 2
    sizes = (f"train.batch_size={batch}", f"train.chunk_size={chunk}", f"data.workers={workers}",
             "data.decoder=device", "data.worker_decode_share=1", "data.keep_on_device_gib=0")
    monkeypatch.setattr(pipeline, "arenas_room", lambda: 0.0)
    copied = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "copied", *sizes)
    windows, from_host = through_window_arenas(monkeypatch, batch, chunk, workers)
    on_host = batch * 3 * 32 * 32  # pass 2's pixels, nothing kept on the device
    # The host's three quarters: the least window (what a host of nothing but a disk gets) and half of pass 2's pixels.
    least = workers * pipeline.arena_window(workers, batch, chunk, chunk, 32, 32, 0, pipeline.arenas_room(), 0, 2**40).arena_bytes
    windows.clear()
    monkeypatch.setattr(pipeline, "host_bytes_per_rank", lambda: int((least + on_host // 2) / pipeline.STEP_HOST_FRACTION))
    monkeypatch.setattr(HostWaitingRoom, "SEGMENT_BYTES", 4 * chunk * 3 * 32 * 32)
    spilled_to = tmp_path / "spill"
    spilled_to.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spilled_to))
    ahead_rows = rows_prepared_ahead(monkeypatch)
    from_disk = []
    real_on_device = OnDisk.on_device
    monkeypatch.setattr(OnDisk, "on_device", lambda chunk, *args: from_disk.append(chunk.shape[0]) or real_on_device(chunk, *args))
    spilled = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "spilled", *sizes)
    window = windows[-1]
    assert window is not None and not window.holds_a_batch and 0 < window.spilled_bytes < on_host, window
    assert window.on_host_bytes + window.spilled_bytes == on_host
    # Pass 2's rows, and pass 1's of the chunks prepared ahead into the room's slots pass 2 had read.
    assert sum(ahead_rows) > 0 and sum(from_disk) + sum(from_host) == 6 * (batch - chunk) + sum(ahead_rows)
    assert from_disk and from_host
    assert [m["loss"] for m in spilled] == [m["loss"] for m in copied]
    assert os.listdir(spilled_to) == []


def test_the_training_thread_decodes_the_next_batch_between_pass_twos_chunks_on_the_same_curve(digits_root, tmp_path,
                                                                                                jpeg_shards, monkeypatch):
    """data.decode_workers=0 with every chunk kept on the device: between pass 2's chunks the
    training thread receives the next batch's pieces and decodes its chunks (`BatchStream._work_ahead`),
    so every step after the first finds all its chunks decoded, and no batch past the run's last is
    begun; the run equals, loss for loss, the gathering and decoding threads' run. At share 1 with
    arenas too small to hold two batches, the batch in use gives its pieces back before pass 2
    works ahead: without that the next batch's pieces never find room (the alarm below)."""
    import signal

    import clipscale.data.pipeline as pipeline

    ahead_rows = rows_prepared_ahead(monkeypatch)

    def stuck(signum, frame):
        raise TimeoutError("the run waited 120 s: a worker found no room in its arena")

    from clipscale.data.pipeline import BatchStream

    batches: list = []
    real_done_with = BatchStream.done_with

    def recording(stream, batch, used):
        own = batch.handed_out_after_s + batch.images.wait_s + batch.texts.wait_s  # waits inside the step's own calls
        batches.append((batch.received_ahead_s, batch.arrivals.wait_s, batch.data_wait_s, batch.receiving_next_s, own))
        real_done_with(stream, batch, used)

    monkeypatch.setattr(BatchStream, "done_with", recording)
    threads = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "threads", "data.decoder=device",
                                   "data.worker_decode_share=0.5")
    assert not ahead_rows  # the decoding threads decode ahead themselves
    ahead = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "ahead", "data.decoder=device",
                                 "data.worker_decode_share=0.5", "data.decode_workers=0", "data.keep_on_device_gib=1")
    assert sum(ahead_rows) == 5 * 64, "steps 2..6 of 64 samples find every chunk decoded ahead, nothing past step 6 is begun"
    # Their pieces were all received during the step before: that step's data wait, not theirs
    # (the training thread, blocked receiving, launched nothing meanwhile).
    # Each second counted once, in the step during which the training thread spent it.
    steps = batches[-6:]
    for before, after in zip(steps, steps[1:]):
        (_, _, _, receiving_next, _), (received, waited, _, _, _) = before, after
        assert received > 0 and waited == pytest.approx(received, abs=1e-3) and receiving_next >= received, steps
    for received, waited, data_wait, receiving_next, own in steps:
        assert data_wait == pytest.approx(own + (waited - received) + receiving_next, abs=1e-9), steps
    assert steps[-1][3] == 0, steps  # the last step begins no batch
    # Each worker's arena holds 2.3 outputs' pixels a sample of its share of a batch, and its 77 tokens and
    # table rows; these crops' regions average about 1.7 (48-px images, crops of half to all of them, 32-px
    # outputs): not two batches.
    monkeypatch.setattr(pipeline, "REGION_LIMIT", 2.3)
    monkeypatch.setattr(pipeline, "ARENA_TOKENS_BYTES", 77 * 8 + 64)
    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(120)
    try:
        tight = train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "tight", "data.decoder=device",
                                     "data.worker_decode_share=1", "data.keep_on_device_gib=1")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert sum(ahead_rows) == 10 * 64
    for run in (ahead, tight):  # the CPU decodes a JPEG the same way wherever it runs
        assert [m["loss"] for m in run] == [m["loss"] for m in threads]
        assert [m["skipped_samples_total"] for m in run] == [m["skipped_samples_total"] for m in threads]


@pytest.mark.slow
@pytest.mark.parametrize("share", ["1", "0.5"], ids=["arenas", "threads"])
def test_loader_workers_killed_mid_run_end_the_run_in_one_error_line(digits_root, tmp_path, jpeg_shards, share):
    """train.py through the workers' arenas (share 1, the next batch begun during pass 2) or the
    gathering and decoding threads, its loader workers killed after its second step: the run ends,
    neither hanging on a piece that will not come nor waiting for room in an arena, with one
    `error:` line naming the loader worker and a non-zero status."""
    import subprocess
    import sys

    from tests.helpers.tiny_runs import JOB_MARK, TRAIN, job_env, job_processes, tiny_run

    overrides = tiny_run(digits_root, tmp_path, "eval.zeroshot=false", "train.steps=400", "train.chunk_size=16",
                         "data.kind=webdataset", "data.decoder=device", "data.workers=2", f"data.worker_decode_share={share}",
                         "data.keep_on_device_gib=1", f"data.train_shards={jpeg_shards[0].replace('train-0', 'train-{0..2}')}")
    env, log = job_env(), tmp_path / "run.log"
    with open(log, "w") as output:
        run = subprocess.Popen([sys.executable, TRAIN, "--config", "configs/digits.yaml", *overrides], cwd=Path(TRAIN).parent,
                               env=env, stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        metrics, deadline = tmp_path / "tiny" / "metrics.jsonl", time.monotonic() + 120
        while run.poll() is None and time.monotonic() < deadline and (
                not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
            time.sleep(0.1)
        assert run.poll() is None and metrics.exists(), log.read_text()[-3000:]  # two steps done, still running
        loaders = [pid for pid in job_processes(run.pid, env[JOB_MARK]) if pid != run.pid]
        assert loaders, "no loader worker found"
        for pid in loaders:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.wait(timeout=120)
    finally:
        for pid in job_processes(run.pid, env[JOB_MARK]):  # a hang: nothing left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    said = log.read_text()
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert run.returncode != 0 and len(errors) == 1 and "data loader worker" in errors[0], said[-3000:]
    assert "Traceback" not in said, said[-3000:]


def test_a_piece_crosses_the_loaders_queue_as_a_few_numbers_its_tensors_in_the_arena(jpeg_shards):
    """On the arenas' path a worker writes a piece's tensors (token ids, bytes, crops, pixels, tables)
    into its arena and the loader's queue carries where they are: no tensor, whose file descriptor
    the trainer would fetch from the busy worker, a round trip a tensor. The trainer's views equal
    the piece as it is made without arenas; a piece over its samples' room travels as tensors."""
    import pickle

    from clipscale.data.chunks import WorkerArenas
    from clipscale.data.shards import ShardStream

    def first_piece(arenas, share=1.0):
        stream = _stream(jpeg_shards, decode=False, worker_decode_share=share)
        stream.arenas = arenas
        return next(iter(stream))

    def tensors_in(value) -> int:
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, dict):
            value = list(value.values())
        return sum(tensors_in(v) for v in value) if isinstance(value, (list, tuple)) else 0

    for share in (1.0, 0.5):
        plain = first_piece(None, share)
        arenas = WorkerArenas(workers=1, arena_bytes=4 * 2**20, sample_bytes=2**15)
        carried = first_piece(arenas, share)
        assert "in_arena" in carried and tensors_in(carried) == 0 and len(pickle.dumps(carried)) < 4096
        taken = ShardStream.taken_from(arenas, carried)
        assert torch.equal(taken["texts"], plain["texts"]) and taken["encoded"].arena_span is not None
        for name, tensor in plain["encoded"].tensors().items():
            assert torch.equal(taken["encoded"].tensors()[name], tensor), name
        assert taken["encoded"].tensors()["pixels"].untyped_storage().data_ptr() == arenas.memory.untyped_storage().data_ptr()
    crowded = first_piece(WorkerArenas(workers=1, arena_bytes=4 * 2**20, sample_bytes=64))
    assert "in_arena" not in crowded and torch.equal(crowded["texts"], plain["texts"])


def test_an_arena_wraps_round_and_a_worker_waits_for_room_until_given_back():
    """A worker's pieces go one after another, a piece that does not fit before the end starts at
    the beginning, and a worker whose arena is full waits until the trainer gives pieces back (or
    closes: then it gets None). Each `place` runs in a thread: a wait where none is due fails here."""
    from clipscale.data.chunks import WorkerArenas

    arenas = WorkerArenas(workers=2, arena_bytes=100)

    def placing(worker: int, nbytes: int) -> tuple[threading.Thread, list]:
        placed: list = []
        thread = threading.Thread(target=lambda: placed.append(arenas.place(worker, nbytes)), daemon=True)
        thread.start()
        return thread, placed

    def placed_at_once(worker: int, nbytes: int):
        thread, placed = placing(worker, nbytes)
        thread.join(timeout=10)
        assert not thread.is_alive(), f"worker {worker}'s piece of {nbytes} bytes waited for room it had"
        return placed[0]

    first, place = placed_at_once(1, 60)
    place.fill_(7)
    assert first == 0 and torch.equal(arenas.view(1, 0, 60), torch.full((60,), 7, dtype=torch.uint8))
    assert arenas.view(0, 0, 60).sum() == 0  # worker 0's arena apart
    waiting, placed = placing(1, 50)
    time.sleep(0.1)
    assert waiting.is_alive()  # 60 + 50 bytes do not fit: it waits
    arenas.release(1, 60)
    waiting.join(timeout=10)
    start, place = placed[0]
    assert start == 100 and place.data_ptr() == arenas.view(1, 0, 1).data_ptr()  # wrapped to the beginning
    with pytest.raises(RuntimeError, match="does not fit"):
        arenas.place(1, 101)
    # The tail a wrapped piece skips holds no data: once the piece before it is given back, a piece
    # larger than what that one held goes in at once (a worker of a job waited here forever).
    arenas.release(1, 150)
    assert placed_at_once(1, 52)[0] == 200
    arenas.release(1, 252)
    assert placed_at_once(1, 53)[0] == 300  # does not fit before the end: at the beginning
    third, placed = placing(1, 60)  # would overwrite the piece still held
    time.sleep(0.1)
    assert third.is_alive()
    arenas.release(1, 353)
    third.join(timeout=10)
    assert not third.is_alive() and placed[0][0] == 400
    placed_at_once(0, 100)
    late, placed = placing(0, 1)
    arenas.close()
    late.join(timeout=10)
    assert placed == [None]


def test_a_piece_never_straddles_a_segment_of_its_arena():
    """CUDA page-locks an arena in segments, and refuses a copy that spans two registrations: a
    piece that does not fit before its segment's end starts at the next segment (or the arena's
    beginning), the tail it skips holds no data, and a piece larger than a segment is refused."""
    from clipscale.data.chunks import WorkerArenas

    arenas = WorkerArenas(workers=1, arena_bytes=250, segment_bytes=100)  # segments of 100, 100 and 50
    assert arenas.place(0, 60)[0] == 0
    assert arenas.place(0, 30)[0] == 60
    assert arenas.place(0, 20)[0] == 100  # 90 + 20 would cross into the second segment
    arenas.release(0, 120)
    assert arenas.place(0, 70)[0] == 120
    assert arenas.place(0, 60)[0] == 250  # the last segment holds 50: past it, to the beginning
    with pytest.raises(RuntimeError, match="does not fit"):
        arenas.place(0, 101)


def test_the_arenas_pages_come_into_being_as_written_and_are_locked_in_writing_order():
    """The arenas are a memory file whose pages the workers' first writes allocate: none before
    (torch's shared memory allocated all 41 GiB of them at 65,536 before a worker started). The
    page-locking's parts are each arena's segments, the first of every worker first, each on a page
    of its own (two registrations may not share one), covering every arena once."""
    import os

    from clipscale.data.chunks import PAGE, WorkerArenas

    arenas = WorkerArenas(workers=3, arena_bytes=10 * PAGE + 8, segment_bytes=4 * PAGE)
    allocated = lambda: os.fstat(arenas.shared.fd).st_blocks * 512  # noqa: E731
    assert allocated() == 0
    arenas.view(1, 0, 1).fill_(1)
    assert allocated() == PAGE
    parts = arenas.segments_in_writing_order()
    firsts = [arenas.view(w, 0, 1).data_ptr() for w in range(3)]
    assert [part.data_ptr() for part in parts[:3]] == firsts  # the first segment of every worker first
    assert all(part.data_ptr() % PAGE == 0 for part in parts)
    assert [part.numel() for part in parts] == [4 * PAGE] * 6 + [2 * PAGE + 8] * 3
    spans = sorted((part.data_ptr(), part.data_ptr() + part.numel()) for part in parts)
    assert all(stop <= start for (_, stop), (start, _) in zip(spans, spans[1:]))  # no byte twice


def test_populating_an_arena_brings_its_pages_in_and_leaves_what_workers_wrote():
    """Before CUDA registers a segment of the arenas its pages are brought in (`populate`), with
    the workers already writing there: every page comes into being, and nothing written changes
    (writing zeros in, as `pinned_empty` does with memory of its own, would erase their pieces)."""
    import os

    from clipscale.data.chunks import PAGE, SharedPages, populate

    shared = SharedPages(37 * PAGE + 5)
    allocated = lambda: os.fstat(shared.fd).st_blocks * 512  # noqa: E731
    written = torch.arange(3 * PAGE, dtype=torch.int64).remainder(251).to(torch.uint8) + 1
    shared.tensor[5 * PAGE:8 * PAGE] = written  # a worker's piece, three pages
    segment = shared.tensor[PAGE:]  # a segment of the arena, from its second page to its end
    assert allocated() == 3 * PAGE
    assert populate(segment)
    assert allocated() == 37 * PAGE  # every page of the segment, not the first page before it
    assert torch.equal(shared.tensor[5 * PAGE:8 * PAGE], written)
    assert int(shared.tensor[PAGE:5 * PAGE].sum()) == 0 and populate(segment[:0])


def test_the_arenas_are_page_locked_once_the_first_batchs_first_pass_is_over(digits_root, tmp_path, jpeg_shards, monkeypatch):
    """CUDA queues every other call of the process behind each registration, so the arenas are
    page-locked only once the first batch's pass 1 has copied all of its chunks: as its pass 2
    asks for its first chunk (in a first step, while the backward graphs compile), once in the
    run. Begun as the first batch's last piece came in, the registrations held up its last
    chunks' copies and its tokens (at 65,536: 12.8 s to the first batch against 9.75 s)."""
    from clipscale.data.chunks import WorkerArenas

    events: list = []
    real_chunks, real_lock = ChunkSource.chunks, WorkerArenas.page_lock_in_background

    def chunks(source, bounds, device, pass_number=1, keep=()):
        events.append(("asks", pass_number))  # a generator: when the pass asks for its first chunk
        yield from real_chunks(source, bounds, device, pass_number, keep)

    monkeypatch.setattr(ChunkSource, "chunks", chunks)
    monkeypatch.setattr(WorkerArenas, "page_lock_in_background", lambda arenas: events.append("page-lock") or real_lock(arenas))
    train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "arenas", "data.decoder=device", "data.worker_decode_share=1")
    assert events.count("page-lock") == 1
    locked_at = events.index("page-lock")
    assert events[locked_at - 1] == ("asks", 2), events[: locked_at + 1]
    assert ("asks", 2) not in events[: locked_at - 1], "locked in the first pass 2, not later"


def _write_into_arena(arenas, worker: int, value: int) -> None:
    arenas.view(worker, 0, 4096).fill_(value)


def test_a_window_of_the_arenas_is_page_locked_before_the_first_batchs_first_pass(digits_root, tmp_path, jpeg_shards,
                                                                                   monkeypatch):
    """A batch larger than the arenas goes round a window of them several times in its pass 1: the
    window is page-locked as reading starts (once), instead of every chunk being staged through
    pinned memory of its own until the first pass 2."""
    from clipscale.data.chunks import WorkerArenas

    events: list = []
    real_chunks, real_lock = ChunkSource.chunks, WorkerArenas.page_lock_in_background

    def chunks(source, bounds, device, pass_number=1, keep=()):
        events.append(("asks", pass_number))
        yield from real_chunks(source, bounds, device, pass_number, keep)

    windows, _ = through_window_arenas(monkeypatch, 384, 8, 2)
    monkeypatch.setattr(ChunkSource, "chunks", chunks)
    monkeypatch.setattr(WorkerArenas, "page_lock_in_background", lambda arenas: events.append("page-lock") or real_lock(arenas))
    train_on_jpeg_shards(digits_root, tmp_path, jpeg_shards, "window", "train.batch_size=384", "train.chunk_size=8",
                         "data.workers=2", "data.decoder=device", "data.worker_decode_share=1")
    assert windows and not windows[-1].holds_a_batch
    assert events.count("page-lock") == 1 and events[0] == "page-lock", events[:3]


def test_a_worker_started_by_a_fork_server_writes_into_the_trainers_arenas():
    """A job's loader workers come from a fork server: the arenas reach them pickled, their memory
    as its file's descriptor, so what a worker writes lands in the trainer's memory file, mapped
    where it was (pickled as a tensor, torch moves the memory into /dev/shm, all of it allocated at
    once, under the trainer's feet)."""
    import multiprocessing
    import os

    from clipscale.data.chunks import PAGE, WorkerArenas

    arenas = WorkerArenas(workers=2, arena_bytes=2 * PAGE)
    mapped_at = arenas.memory.data_ptr()
    worker = multiprocessing.get_context("forkserver").Process(target=_write_into_arena, args=(arenas, 1, 7))
    worker.start()
    worker.join(timeout=60)
    assert worker.exitcode == 0
    assert arenas.memory.data_ptr() == mapped_at and os.fstat(arenas.shared.fd).st_blocks * 512 == PAGE  # the page written
    assert torch.equal(arenas.view(1, 0, 4096), torch.full((4096,), 7, dtype=torch.uint8))
    assert arenas.view(0, 0, 4096).sum() == 0


@pytest.mark.slow
def test_a_job_of_two_processes_trains_through_arenas_on_the_threads_curve(digits_root, tmp_path, jpeg_shards):
    """train.py under torchrun, two ranks of two loader workers each, started from the fork server
    (the arenas reach them pickled, as a memory file's descriptor), one piece a worker a batch: the workers wrap
    round their arenas every step, and the run equals, loss for loss, the same job through the
    gathering and decoding threads (share 0.5: what the CPU decodes is the same either way)."""
    from clipscale.metrics import read_metrics
    from tests.helpers.tiny_runs import run_train, tiny_run

    losses = {}
    for name, share in (("arenas", "1"), ("threads", "0.5")):
        overrides = tiny_run(digits_root, tmp_path, f"run.name={name}", "eval.zeroshot=false", "train.steps=4",
                             "train.chunk_size=16", "data.kind=webdataset", "data.decoder=device", "data.workers=2",
                             f"data.train_shards={jpeg_shards[0].replace('train-0', 'train-{0..2}')}",
                             f"data.worker_decode_share={share}")
        result = run_train(overrides, nproc=2, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = [m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")]
    assert len(losses["arenas"]) == 4 and losses["arenas"] == losses["threads"]
