"""Data offload in the trainer: the batch stays on the host as the shards' encoded bytes.

The loader keeps each image's bytes and its drawn crop (`EncodedImages`); GradCache
decodes a chunk at a time in both passes (`DeferredTransform.decode`, in threads) and
normalises on the device. These tests hold that path to the decoded one: the same
pixels bit for bit, the same samples skipped, the same loss curve, the same resume.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torchvision.transforms as T
from open_clip.transform import image_transform

from clipscale.config import load_config
from clipscale.data.offload import EncodedSamples
from clipscale.data.shards import DeferredTransform, EncodedImages, ShardErrors, ShardStream, StreamState
from clipscale.metrics import read_metrics

from tiny_runs import DIGITS_YAML, tiny_run

OPEN_CLIP_TRAIN = image_transform(32, is_train=True, aug_cfg={"scale": (0.5, 1.0)})  # what build_model gives, wider crops
PLAIN_CROP = T.Compose([T.RandomResizedCrop(32, scale=(0.5, 1.0)), T.ToTensor()])


def _shards(digits_root) -> list[str]:
    manifest = json.loads((digits_root / "manifest.json").read_text())
    return [str(digits_root / s) for s in manifest["train_shards"]]


def _stream(digits_root, transform, offload: bool, state=None, workers=0):
    return ShardStream(
        _shards(digits_root), batch_size=50, rank=0, world_size=1, num_workers=workers, seed=3,
        image_transform=transform, tokenizer=lambda captions: captions, shuffle_buffer=100, state=state,
        deferred=DeferredTransform.split(transform) if offload else None,
    )


def _decode_all(images: EncodedImages, deferred: DeferredTransform) -> torch.Tensor:
    return deferred.device_transform(torch.stack([deferred.decode(images[i]) for i in range(len(images))]))


@pytest.mark.parametrize("transform", [OPEN_CLIP_TRAIN, PLAIN_CROP], ids=["open_clip", "crop_to_tensor"])
def test_deferred_decode_gives_the_decoded_streams_pixels_bit_for_bit(digits_root, transform):
    deferred = DeferredTransform.split(transform)
    assert deferred is not None
    decoded = iter(_stream(digits_root, transform, offload=False))
    encoded = iter(_stream(digits_root, transform, offload=True))
    for _ in range(30):  # 1,500 samples: crosses an epoch boundary
        a, b = next(decoded), next(encoded)
        assert a["cursor"] == b["cursor"] and a["texts"] == b["texts"]
        assert isinstance(b["images"], EncodedImages) and len(b["images"]) == 50
        rng = torch.get_rng_state()
        pixels = torch.stack([deferred.decode(b["images"][i]) for i in range(50)])
        assert torch.equal(torch.get_rng_state(), rng), "decode touched the global RNG"
        assert pixels.dtype == torch.uint8 and pixels.shape == (50, 3, 32, 32)
        assert torch.equal(deferred.device_transform(pixels), a["images"])


@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")  # open_clip's, about items it does use
def test_transforms_that_cannot_be_deferred_are_refused():
    jitter = image_transform(32, is_train=True, aug_cfg={"color_jitter_prob": 0.5, "color_jitter": (0.4, 0.4, 0.4, 0.1)})
    assert DeferredTransform.split(jitter) is None  # a random step without explicit parameters
    assert DeferredTransform.split(T.Compose([T.Resize(40), T.RandomResizedCrop(32), T.ToTensor()])) is None
    assert DeferredTransform.split(T.Compose([T.RandomResizedCrop(32), T.ToTensor(), T.RandomErasing()])) is None
    assert DeferredTransform.split(image_transform(32, is_train=False)) is not None  # resize, centre crop: deterministic


def test_the_offloaded_batch_is_the_encoded_bytes(digits_root):
    """What the loader hands over is the shards' PNG bytes, in stream order, not pixels."""
    stream = _stream(digits_root, OPEN_CLIP_TRAIN, offload=True)
    batch = next(iter(stream))
    raw = [s["png"] for s, _ in zip(stream._raw_samples(0, 0, 1, ShardErrors()), range(50))]  # digits: none skipped
    images = batch["images"]
    assert images.data.numpy().tobytes() == b"".join(raw)
    assert [images[i][0] for i in range(50)] == raw
    assert images.nbytes == sum(map(len, raw)) + 51 * 8 + 50 * 4 * 8  # the bytes, the offsets, the crop boxes
    assert images.nbytes < 50 * 3 * 32 * 32  # smaller even than uint8 pixels (the float batch: 4x that)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_offloaded_stream_resumes_exactly(digits_root, workers):
    def batches(state, count):
        loader = torch.utils.data.DataLoader(_stream(digits_root, OPEN_CLIP_TRAIN, True, state, workers),
                                             batch_size=None, num_workers=workers)
        out = []
        for batch in loader:
            out.append(batch)
            if len(out) == count:
                return out

    uninterrupted = batches(StreamState(), 36)
    state = StreamState()
    for batch in uninterrupted[:21]:
        state.update(batch)
    resumed = batches(state, 15)
    for a, b in zip(uninterrupted[21:], resumed):
        assert a["cursor"] == b["cursor"] and a["texts"] == b["texts"]
        assert isinstance(b["images"], EncodedImages) and a["images"] == b["images"]


# --- the trainer -------------------------------------------------------------------------


def _train(digits_root, tmp_path, name, *extra, monkeypatch=None, record=None):
    import clipscale.trainer as trainer

    if record is not None:
        real_build_step = trainer.build_step

        def recording_build_step(*args):
            step = real_build_step(*args)

            def run(images, texts):
                record.append((images, texts))
                if len(record) == preempt_at:
                    os.kill(os.getpid(), signal.SIGTERM)  # as SLURM would: checkpoint after this step and stop
                return step(images, texts)

            return run

        monkeypatch.setattr(trainer, "build_step", recording_build_step)
    preempt_at = next((int(e.split("=")[1]) for e in extra if e.startswith("preempt_at=")), None)
    extra = [e for e in extra if not e.startswith("preempt_at=")]
    overrides = tiny_run(digits_root, tmp_path, f"run.name={name}", "eval.zeroshot=false", "train.steps=6",
                         "train.chunk_size=24", *extra)
    result = trainer.train(load_config(DIGITS_YAML, overrides))
    return result, [m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")]


def test_the_trainer_streams_encoded_images_to_gradcache(digits_root, tmp_path, monkeypatch, recwarn):
    record: list = []
    _train(digits_root, tmp_path, "offload", "data.workers=1", "train.offload=true", monkeypatch=monkeypatch, record=record)
    assert len(record) == 6
    for images, texts in record:
        assert isinstance(images, EncodedSamples) and isinstance(images.samples, EncodedImages)
        assert len(images) == len(texts) == 64
        assert images.samples.nbytes < 64 * 3 * 32 * 32  # PNG bytes, about 1.1 KB a digit
    assert not [w for w in recwarn if "cannot be deferred" in str(w.message)]


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
