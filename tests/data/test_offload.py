"""The streamed batch and data offload in the trainer.

Loader pieces hold uint8 pixels (`SplitTransform`: the float steps run on the device);
with offload they also keep each image's bytes and its drawn crop (`EncodedImages`), which
the second Gradient Cache pass decodes again in processes. These tests hold both to the
whole-transform path: the same pixels bit for bit, the same samples skipped, the same
batches, the same loss curve, the same resume.
"""

from __future__ import annotations

import copy
import json
import os
import signal
from itertools import chain, count

import pytest
import torch
import torchvision.transforms as T
from open_clip.transform import image_transform

from clipscale.config import load_config
from clipscale.data.pipeline import BatchStream
from clipscale.data.chunks import Arrivals
from clipscale.data.decoders import DecodePool, DeviceDecodedRows, DeviceDecoder, EncodedImages, OffloadedRows
from clipscale.data.shards import Cursor, ShardErrors, ShardStream, StreamState
from clipscale.data.sources import IMAGE
from clipscale.data.transforms import SplitTransform
from clipscale.step import TrainStep
from clipscale.metrics import read_metrics

from tests.helpers.tiny_runs import DIGITS_YAML, tiny_run

OPEN_CLIP_TRAIN = image_transform(32, is_train=True, aug_cfg={"scale": (0.5, 1.0)})  # what build_model gives, wider crops
PLAIN_CROP = T.Compose([T.RandomResizedCrop(32, scale=(0.5, 1.0)), T.ToTensor()])


def _shards(digits_root) -> list[str]:
    manifest = json.loads((digits_root / "manifest.json").read_text())
    return [str(digits_root / s) for s in manifest["train_shards"]]


def _stream(digits_root, transform, offload: bool, state=None, workers=0, split=True, piece_size=50):
    return ShardStream(
        _shards(digits_root), piece_size=piece_size, rank=0, world_size=1, num_workers=workers, seed=3,
        image_transform=transform, tokenizer=lambda captions: torch.tensor([len(c) for c in captions]),
        shuffle_buffer=100, state=state, split=SplitTransform.split(transform) if split or offload else None,
        keep_encoded=offload,
    )


@pytest.mark.slow
@pytest.mark.parametrize("transform", [OPEN_CLIP_TRAIN, PLAIN_CROP], ids=["open_clip", "crop_to_tensor"])
def test_uint8_pieces_and_kept_bytes_give_the_whole_transforms_pixels_bit_for_bit(digits_root, transform):
    split = SplitTransform.split(transform)
    assert split is not None
    whole = iter(_stream(digits_root, transform, offload=False, split=False))
    encoded = iter(_stream(digits_root, transform, offload=True))
    for _ in range(30):  # 1,500 samples: crosses an epoch boundary
        a, b = next(whole), next(encoded)
        assert a["cursor"] == b["cursor"] and torch.equal(a["texts"], b["texts"])
        assert b["images"].dtype == torch.uint8 and b["images"].shape == (50, 3, 32, 32)
        assert torch.equal(split.to_float(b["images"]), a["images"])
        rng = torch.get_rng_state()
        again = torch.stack([split.decode(b["encoded"][i]) for i in range(50)])
        assert torch.equal(torch.get_rng_state(), rng), "decode touched the global RNG"
        assert torch.equal(again, b["images"])


def _streamed(loader, batch_size, piece_size, to_float, count):
    """`count` batches from BatchStream, as the trainer takes them, with the stream state after each."""
    state, out = StreamState(), []
    stream = BatchStream(loader, batch_size=batch_size, piece_size=piece_size, state=state, steps=count,
                         device_transform=to_float)
    cpu = torch.device("cpu")
    for _ in range(count):
        with stream.next() as batch:
            images = torch.cat(list(batch.images.chunks([(s, s + piece_size) for s in range(0, batch_size, piece_size)], cpu)))
            texts = torch.cat(list(batch.texts.chunks([(0, batch_size)], cpu))).clone()
        out.append((images, texts, copy.deepcopy(state)))
    stream.close()
    return out


@pytest.mark.parametrize("workers", [0, 1])
def test_a_streamed_batch_is_todays_whole_batch_bit_for_bit(digits_root, workers):
    """Pieces of 16 gathered into batches of 64 on the host == the whole batches of 64 that one
    worker assembled with the whole transform: pixels, tokens, cursors and counts."""
    split = SplitTransform.split(OPEN_CLIP_TRAIN)

    def loader(**kwargs):
        return torch.utils.data.DataLoader(_stream(digits_root, OPEN_CLIP_TRAIN, offload=False, workers=workers, **kwargs),
                                           batch_size=None, num_workers=workers)

    whole = [(b["images"], b["texts"], b["cursor"]) for b, _ in zip(loader(split=False, piece_size=64), range(8))]
    streamed = _streamed(loader(piece_size=16), 64, 16, split.to_float, 8)
    for (images, texts, cursor), (s_images, s_texts, state) in zip(whole, streamed):
        assert torch.equal(s_images, images) and torch.equal(s_texts, texts)
        assert state.cursors[cursor.worker] == cursor


class _CountedPieces:
    """Numbered pieces of 2 token rows, counting how many the stream took."""

    def __init__(self):
        self.taken = 0

    def __iter__(self):
        while True:
            self.taken += 1
            yield {"images": torch.zeros(2, 3, 4, 4, dtype=torch.uint8), "texts": torch.full((2, 1), self.taken),
                   "cursor": Cursor(0, 0, (self.taken,)), "drawn": {0: 3}, "sample_keys": [(0, "a"), (0, "b")],
                   "skipped_samples": 1, "shard_errors": 0, "captions_cut": 1, "problem_shards": []}


def test_a_batch_moves_the_stream_on_when_its_step_is_done_and_not_when_the_step_fails():
    pieces, state = _CountedPieces(), StreamState()
    stream = BatchStream(pieces, batch_size=4, piece_size=2, state=state, steps=5, gather="whole")
    with pytest.raises(ValueError):
        with stream.next():
            raise ValueError("the step failed")
    assert state == StreamState(), "a batch whose step failed was not used"
    with stream.next() as batch:
        assert torch.cat(list(batch.texts.chunks([(0, 4)], torch.device("cpu")))).flatten().tolist() == [3, 3, 4, 4]
    assert state == StreamState(cursors={0: Cursor(0, 0, (4,))}, drawn={0: 6}, pieces=2, batches=1, skipped_samples=2, captions_cut=2)
    stream.close()


def test_the_stream_gathers_no_batch_beyond_the_runs_last_step():
    """A run resumed after 3 of its 5 steps gathers 2 batches, the second while the first is used."""
    pieces = _CountedPieces()
    stream = BatchStream(pieces, batch_size=4, piece_size=2, state=StreamState(batches=3), steps=5)
    for _ in range(2):
        with stream.next():
            pass
    stream.thread.join(timeout=10)
    assert not stream.thread.is_alive() and pieces.taken == 2 * 2
    stream.close()


@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")  # open_clip's, about items it does use
def test_transforms_that_cannot_be_split_are_refused():
    jitter = image_transform(32, is_train=True, aug_cfg={"color_jitter_prob": 0.5, "color_jitter": (0.4, 0.4, 0.4, 0.1)})
    assert SplitTransform.split(jitter) is None  # a random step without explicit parameters
    assert SplitTransform.split(T.Compose([T.Resize(40), T.RandomResizedCrop(32), T.ToTensor()])) is None
    assert SplitTransform.split(T.Compose([T.RandomResizedCrop(32), T.ToTensor(), T.RandomErasing()])) is None
    assert SplitTransform.split(image_transform(32, is_train=False)) is not None  # resize, centre crop: deterministic


def test_the_offloaded_piece_keeps_the_encoded_bytes(digits_root):
    """What the loader hands over with offload is the shards' PNG bytes, in stream order."""
    stream = _stream(digits_root, OPEN_CLIP_TRAIN, offload=True)
    piece = next(iter(stream))
    shuffled = chain.from_iterable(stream.shuffled_slot(number, ShardErrors()).samples() for number in count())
    raw = [s[IMAGE] for s, _ in zip(shuffled, range(50))]  # digits: none skipped
    encoded = piece["encoded"]
    assert encoded.data.numpy().tobytes() == b"".join(raw)
    assert [encoded[i][0] for i in range(50)] == raw
    assert encoded.nbytes == sum(map(len, raw)) + 51 * 8 + 50 * 4 * 8 + 8  # the bytes, the offsets, the crop boxes, no worker image
    assert encoded.nbytes < 50 * 3 * 32 * 32  # smaller even than uint8 pixels


@pytest.mark.parametrize("workers", [0, 2])
def test_an_offloaded_stream_resumes_exactly(digits_root, workers):
    def batches(state, count):
        loader = torch.utils.data.DataLoader(_stream(digits_root, OPEN_CLIP_TRAIN, True, state, workers),
                                             batch_size=None, num_workers=workers)
        out = []
        for piece in loader:
            out.append(piece)
            if len(out) == count:
                return out

    uninterrupted = batches(StreamState(), 36)
    state = StreamState()
    for batch in uninterrupted[:21]:
        state.update(batch)
    resumed = batches(state, 15)
    for a, b in zip(uninterrupted[21:], resumed):
        assert a["cursor"] == b["cursor"] and torch.equal(a["texts"], b["texts"])
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["encoded"].data, b["encoded"].data)


# --- the trainer -------------------------------------------------------------------------


def _train(digits_root, tmp_path, name, *extra, monkeypatch=None, record=None):
    import clipscale.trainer as trainer

    if record is not None:
        real_call = TrainStep.__call__

        def recording_call(step, images, texts, lr=None):
            record.append((images, texts))
            if len(record) == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)  # as SLURM would: checkpoint after this step and stop
            return real_call(step, images, texts, lr)

        monkeypatch.setattr(TrainStep, "__call__", recording_call)
    preempt_at = next((int(e.split("=")[1]) for e in extra if e.startswith("preempt_at=")), None)
    extra = [e for e in extra if not e.startswith("preempt_at=")]
    # Nothing kept on the device (data.keep_on_device_gib=0): pass 2 decodes every chunk again.
    overrides = tiny_run(digits_root, tmp_path, f"run.name={name}", "eval.zeroshot=false", "train.steps=6",
                         "train.chunk_size=24", "data.keep_on_device_gib=0", *extra)
    result = trainer.train(load_config(DIGITS_YAML, overrides))
    return result, [m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")]


@pytest.mark.slow
def test_the_trainer_streams_offloaded_images_to_the_step(digits_root, tmp_path, monkeypatch, recwarn):
    record: list = []
    _train(digits_root, tmp_path, "offload", "data.workers=1", "train.offload=true", monkeypatch=monkeypatch, record=record)
    assert len(record) == 6
    for images, texts in record:
        assert isinstance(images.rows, OffloadedRows)
        assert len(images) == len(texts) == 64
        assert images.rows.encoded.nbytes < 64 * 3 * 32 * 32  # PNG bytes, about 1.1 KB a digit
    assert not [w for w in recwarn if "does not split" in str(w.message)]


@pytest.mark.slow
def test_an_offloaded_run_follows_the_streamed_runs_curve(digits_root, tmp_path):
    """Pass 2 decodes the kept bytes again in processes: the same losses as holding the pixels."""
    _, streamed = _train(digits_root, tmp_path, "pixels", "data.workers=1")
    _, offloaded = _train(digits_root, tmp_path, "bytes", "data.workers=1", "train.offload=true")
    assert offloaded == pytest.approx(streamed, rel=1e-6, abs=1e-6)


@pytest.mark.slow
def test_an_offloaded_run_resumes_on_the_same_curve(digits_root, tmp_path, monkeypatch):
    """SIGTERM after step 3 of an offloaded run, rerun: the same losses as an uninterrupted one."""
    _, uninterrupted = _train(digits_root, tmp_path, "whole", "data.workers=1", "train.offload=true")
    record: list = []
    result, first = _train(digits_root, tmp_path, "stopped", "data.workers=1", "train.offload=true", "preempt_at=3",
                           monkeypatch=monkeypatch, record=record)
    assert result == {"preempted_by": signal.SIGTERM} and len(first) == 3
    monkeypatch.undo()
    _, resumed = _train(digits_root, tmp_path, "stopped", "data.workers=1", "train.offload=true")
    assert len(resumed) == 6
    assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)


class _OnePiece(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"encoded": EncodedImages.from_samples((b"\xff\xd8 first", b"\xff\xd8 second"), ((0, 0, 8, 8), (1, 1, 6, 6))),
               "images": torch.zeros(2, 3, 8, 8, dtype=torch.uint8)}


def test_the_kept_bytes_are_copied_out_of_the_loader_workers_shared_memory():
    """A loader worker hands its tensors over in shared memory, each holding a file descriptor
    until it is freed: a column that kept them for a million-sample batch would run out of them."""
    piece = next(iter(torch.utils.data.DataLoader(_OnePiece(), batch_size=None, num_workers=1)))
    assert piece["encoded"].data.is_shared()  # as the worker sent it
    pool, decoder = DecodePool(lambda sample: None, processes=1, window=1), DeviceDecoder(None, torch.device("cpu"))
    try:
        for rows in (OffloadedRows(2, Arrivals(), pool), DeviceDecodedRows(2, Arrivals(), decoder)):
            rows.put(slice(0, 2), piece)
            [(first_row, kept)] = rows.encoded.pieces
            assert first_row == 0 and [kept[i] for i in range(2)] == [piece["encoded"][i] for i in range(2)]
            assert not any(tensor.is_shared() for tensor in (kept.data, kept.offsets, kept.params)), type(rows).__name__
    finally:
        pool.close()
        decoder.close()
