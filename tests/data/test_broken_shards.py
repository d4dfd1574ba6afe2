"""Broken data is skipped and counted: corrupt images, samples without a caption, a shard cut off
mid-sample, in the stream, across a resume, and in a run (with and without offload) that goes on to
its end."""

from __future__ import annotations

import io
import tarfile
from itertools import islice
from pathlib import Path

import pytest
import torch
import torchvision.transforms as T
import webdataset as wds
from PIL import Image

from clipscale.checkpoint import latest_checkpoint
from clipscale.config import load_config
from clipscale.data import prepare_data
from clipscale.data.shards import SKIPS_NAMED, ShardErrors, ShardStream, StreamState
from clipscale.data.transforms import SplitTransform
from clipscale.distributed import World
from clipscale.errors import UserError
from clipscale.metrics import read_metrics

from tests.helpers.tiny_runs import DIGITS_YAML, tiny_run
from tests.helpers.user_data import write_csv

SAMPLES_PER_SHARD = 40
CORRUPT = {f"corrupt-{i:03d}" for i in range(0, SAMPLES_PER_SHARD, 5)}  # 8 images of garbage bytes


def _png(seed: int) -> bytes:
    """Seeded noise (PIL's effect_noise draws from the C library's unseeded generator: its PNGs'
    sizes, and so where the truncated shard was cut, changed from one process to the next)."""
    pixels = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def broken_shards(module_tmp) -> list[str]:
    """Four shards: clean; 8 corrupt images; 6 samples without a caption and 2 with an empty one;
    and one cut off in the middle of a sample (a copy that died half-way)."""
    root = module_tmp("broken")
    shards = {name: str(root / f"{name}.tar") for name in ("clean", "corrupt", "uncaptioned", "truncated")}
    for name, path in shards.items():
        with wds.TarWriter(path) as sink:
            for i in range(SAMPLES_PER_SHARD):
                key = f"{name}-{i:03d}"
                sample = {"__key__": key, "png": _png(i), "txt": b"a handwritten digit"}
                if key in CORRUPT:
                    sample["png"] = sample["png"][:20] + bytes(200)  # a PNG header, then zeros
                if name == "uncaptioned" and i < 8:
                    sample["txt"] = b"  " if i < 2 else None
                sink.write({k: v for k, v in sample.items() if v is not None})
    # Cut in the middle of a member's data, three fifths in: a cut inside a header block would end
    # the archive there without an error (Python's tarfile reads a short header as the end).
    with tarfile.open(shards["truncated"]) as tar:
        members = tar.getmembers()
    cut = members[len(members) * 3 // 5]
    whole = Path(shards["truncated"]).read_bytes()
    Path(shards["truncated"]).write_bytes(whole[: cut.offset_data + cut.size // 2])
    return list(shards.values())


def _stream(shards, state=None, shuffle_buffer=30, offload=False):
    """offload: pieces also keep the encoded image bytes (train.offload), judged by the same decode."""
    return ShardStream(
        shards, piece_size=16, rank=0, world_size=1, num_workers=0, seed=5, image_transform=T.ToTensor(),
        tokenizer=lambda captions: captions, shuffle_buffer=shuffle_buffer, state=state,
        split=SplitTransform.split(T.ToTensor()) if offload else None, keep_encoded=offload,
    )


def _unusable(raw: dict) -> bool:
    caption = raw.get("txt", b"").strip()
    return raw["__key__"] in CORRUPT or not caption


def _consume(batches, state: StreamState) -> StreamState:
    for batch in batches:
        assert len(batch["images"]) == len(batch["texts"]) == 16, "a batch lost samples"
        state.update(batch)
    return state


@pytest.mark.parametrize("offload", [False, True], ids=["decoded", "offload"])
def test_broken_samples_and_shards_are_skipped_and_counted(broken_shards, offload):
    stream = _stream(broken_shards, offload=offload)
    state = _consume(islice(stream, 30), StreamState())  # ~4 epochs of ~130 usable samples
    (cursor,) = state.cursors.values()
    item, draws, epoch = cursor.item, cursor.position[0], stream.order.slot(cursor.item).epoch
    # Every sample the stream consumed, in its order (one consumer: its item k is slot k), judged by
    # what the fixture broke.
    consumed = [raw for number in range(item) for raw in stream.shuffled_slot(number, ShardErrors()).samples()]
    consumed += list(islice(stream.shuffled_slot(item, ShardErrors()).samples(), draws))
    assert state.skipped_samples == sum(map(_unusable, consumed)) >= 3 * 16
    # The truncated shard counts once per epoch (in the read of its first part), perhaps not yet in this one.
    assert epoch <= state.shard_errors <= epoch + 1
    if offload:  # the same samples skipped, the same cursors, as when the loader keeps pixels
        assert state == _consume(islice(_stream(broken_shards), 30), StreamState())


@pytest.mark.parametrize("offload", [False, True], ids=["decoded", "offload"])
def test_a_resumed_stream_counts_on_without_counting_replayed_samples(broken_shards, offload):
    uninterrupted = _consume(islice(_stream(broken_shards, offload=offload), 30), StreamState())
    checkpointed = _consume(islice(_stream(broken_shards, offload=offload), 11), StreamState())
    resumed = _consume(islice(_stream(broken_shards, StreamState(**vars(checkpointed)), offload=offload), 19), checkpointed)
    assert resumed == uninterrupted


def test_a_piece_names_its_first_skipped_samples_and_why(broken_shards):
    """Each piece names the first SKIPS_NAMED samples it skipped, as (where, why) strings: the shard
    and key of a sample the fixture broke, and what is wrong with it."""
    named = set()
    for piece in islice(_stream(broken_shards), 30):
        assert len(piece["skips"]) == min(piece["skipped_samples"], SKIPS_NAMED), piece["skips"]
        for where, why in piece["skips"]:
            assert isinstance(where, str) and isinstance(why, str)
            shard, key = where.split(": sample ")
            assert Path(shard).name == key.split("-")[0] + ".tar", where
            index = int(key.split("-")[1])
            if key in CORRUPT:
                assert why.startswith("UnidentifiedImageError: "), (where, why)
            elif key.startswith("uncaptioned") and index < 2:
                assert why == "an empty caption", (where, why)
            else:
                assert key.startswith("uncaptioned") and index < 8, where
                assert why == "no caption member (data.caption_key)", (where, why)
            named.add(key)
    assert any(key in CORRUPT for key in named) and any(key.startswith("uncaptioned") for key in named), named


def test_a_csv_tables_skipped_samples_are_named_by_their_image_file(tmp_path):
    """A CSV table has no shard: a skipped row is named by its image file, with why."""
    table = write_csv(tmp_path, rows=20, missing={3})
    (tmp_path / "images" / "5.png").write_bytes(b"not an image")
    (tmp_path / "images" / "7.png").unlink()
    (tmp_path / "images" / "7.png").mkdir()
    cfg = load_config(DIGITS_YAML, ["data.kind=csv", f"data.train_shards={table}", "data.shuffle_buffer=4"])
    stream = ShardStream(prepare_data(cfg.data, World()).train_shards, piece_size=5, rank=0, world_size=1, num_workers=0,
                         seed=5, image_transform=T.ToTensor(), tokenizer=list, shuffle_buffer=4)
    named = dict(skip for piece in islice(stream, 4) for skip in piece["skips"])  # 17 usable samples an epoch
    images = tmp_path / "images"
    assert named == {str(images / "3.png"): "cannot read the file: no such file",
                     str(images / "5.png"): "UnidentifiedImageError: not a JPEG, PNG or WebP image, or cut short before its size",
                     str(images / "7.png"): "cannot read the file"}, named


def test_a_stream_without_one_usable_sample_stops_with_a_clear_message(tmp_path):
    shard = str(tmp_path / "uncaptioned.tar")
    with wds.TarWriter(shard) as sink:
        for i in range(5):
            sink.write({"__key__": f"s{i}", "png": _png(i)})
    with pytest.raises(UserError, match="decoded no sample in 3 passes") as raised:
        next(iter(_stream([shard])))
    assert f"the first: {shard}: sample s" in str(raised.value) and "(no caption member (data.caption_key))" in str(raised.value)


@pytest.mark.timeout(180)
def test_training_on_data_without_a_usable_sample_ends_in_one_error_line(tmp_path):
    """train.py with the default loader workers on shards whose samples have no caption: one
    `error:` line naming what to check, status 2, no traceback."""
    from tests.helpers.tiny_runs import run_train
    from tests.helpers.trainer_harness import shard_run

    shard = tmp_path / "shards" / "uncaptioned.tar"
    shard.parent.mkdir()
    with wds.TarWriter(str(shard)) as sink:
        for i in range(20):
            sink.write({"__key__": f"s{i}", "png": _png(i)})
    done = run_train(shard_run(str(shard), tmp_path / "runs", "nothing", "train.steps=2", "train.batch_size=8"))
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: the training data holds no usable sample") and "data.caption_key" in lines[-1]
    assert f"the first: {shard}: sample s" in lines[-1] and "no caption member" in lines[-1], lines[-1]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_training_on_broken_shards_runs_to_the_end_and_logs_the_counts(broken_shards, tmp_path):
    """In a loader worker process, as in a real run: nothing kills the worker or hangs. With
    train.offload the batch keeps encoded bytes, and the same samples are skipped and counted."""
    from clipscale.trainer import train

    pattern = str(Path(broken_shards[0]).parent / "{clean,corrupt,uncaptioned,truncated}.tar")
    counts = {}
    for name, extra in {"decoded": [], "offload": ["train.offload=true", "train.chunk_size=24"]}.items():
        overrides = tiny_run(tmp_path, tmp_path, f"run.name={name}", "data.kind=webdataset", f"data.train_shards={pattern}",
                             "data.workers=1", "data.shuffle_buffer=30", "eval.zeroshot=false", "train.steps=5", *extra)
        train(load_config(DIGITS_YAML, overrides))
        metrics = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
        last = metrics[-1]
        assert sum(m["skipped_samples"] for m in metrics) == last["skipped_samples_total"] >= 2 * 16
        assert sum(m["shard_errors"] for m in metrics) == last["shard_errors_total"] >= 2  # 320 samples: 2+ epochs
        checkpoint = torch.load(latest_checkpoint(tmp_path / name / "checkpoints"), weights_only=True)
        assert checkpoint["data"][0]["skipped_samples"] == last["skipped_samples_total"]
        # The same samples, cursors and counts; the offloaded run's loader pieces are smaller (its chunks are).
        stream = [{k: v for k, v in rank.items() if k != "pieces"} for rank in checkpoint["data"]]
        counts[name] = [(m["skipped_samples"], m["shard_errors"]) for m in metrics], stream
    assert counts["offload"] == counts["decoded"]
