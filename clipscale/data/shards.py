"""An endless, exactly resumable stream of training batches from webdataset shards.

Every (rank, loader worker) pair is one *consumer*. In epoch e the shard list
is permuted with a seed derived from (seed, e); consumer c reads every
C-th shard of that order (or, with fewer shards than consumers, every C-th
sample of all shards), shuffles through a buffer seeded by (seed, e, c),
decodes and batches. The stream never ends, so every rank takes exactly
`train.steps` steps whatever the shard sizes.

Resumption is exact: every batch carries its worker's cursor (epoch and the
number of raw samples consumed in that epoch). The trainer records the cursor
of the last batch it used from each worker; a resumed stream skips whole
epochs for free and replays only the current epoch's raw samples without
decoding them. DataLoader hands out batches round-robin over its workers, so
a resumed loader also rotates which logical worker its first slot serves.

Nothing in the data stops a run or shrinks a batch. Samples that cannot be
decoded (corrupt image bytes, no caption) are skipped and counted; a shard
that cannot be read to its end (a truncated or missing tar file) gives the
samples before the damage, the rest is skipped and the event counted. Both
counts travel with the batch; StreamState keeps this rank's totals, so they
survive a resume (replayed samples are not counted twice).

With data offload (`train.offload`), a batch's images stay encoded: the stream keeps
each sample's image bytes as read from the shard, plus the random crop it drew, in one
`EncodedImages` buffer. `DeferredTransform` splits the image transform in three: the
random draw (in the loader, under the sample's seed, so it is the crop the decoded
path would take), the decode (PIL, crop, resize, to uint8: a pure function of the
sample, run per chunk in GradCache's threads in both passes) and the rest (to float,
normalise: on the device). The loader still decodes every image once, to skip and
count exactly the samples the decoded path would; it keeps only the bytes.
"""

from __future__ import annotations

import io
import random
import warnings
import zlib
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Optional

import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
import webdataset as wds
from PIL import Image

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
TEXT_KEYS = ("txt", "text", "caption")


@dataclass
class StreamState:
    """Where each logical worker of one rank stands: {worker: (epoch, raw samples consumed)}."""

    cursors: dict = field(default_factory=dict)
    batches: int = 0  # batches consumed by the trainer; decides the worker rotation on resume
    skipped_samples: int = 0  # undecodable samples in those batches' stretch of the stream
    shard_errors: int = 0  # shards that could not be read to their end

    def update(self, batch: dict) -> None:
        worker, epoch, position = batch["cursor"]
        self.cursors[worker] = (epoch, position)
        self.batches += 1
        self.skipped_samples += batch["skipped_samples"]
        self.shard_errors += batch["shard_errors"]


class ShardErrors:
    """webdataset error handler that warns, counts and carries on with the next shard.

    It counts shards, not exceptions: webdataset reports a tar file cut short
    once or twice (from the member read and again from the archive iterator)."""

    def __init__(self):
        self.count = 0
        self.current_shard_failed = False

    def __call__(self, exn: Exception) -> bool:
        if not self.current_shard_failed:
            self.count += 1
            self.current_shard_failed = True
            warnings.warn(f"skipping the rest of a shard: {exn!r}")
        return True

    def read(self, url: str):
        """The samples of one shard, up to the first error."""
        self.current_shard_failed = False
        yield from wds.tarfile_to_samples(handler=self)(iter([{"url": url}]))


def decode_sample(raw: dict, image_transform: Callable) -> Optional[tuple]:
    """(image tensor, caption) or None when the sample is unusable."""
    image_key = next((k for k in IMAGE_KEYS if k in raw), None)
    text_key = next((k for k in TEXT_KEYS if k in raw), None)
    if image_key is None or text_key is None:
        return None
    try:
        with Image.open(io.BytesIO(raw[image_key])) as img:
            image = image_transform(img.convert("RGB"))
        caption = raw[text_key].decode("utf-8").strip()
    except Exception:  # noqa: BLE001 - any undecodable sample is skipped and counted
        return None
    return (image, caption) if caption else None


def encode_sample(raw: dict, deferred: "DeferredTransform") -> Optional[tuple]:
    """(image bytes, drawn crop, caption) or None when the sample is unusable.

    The same judgement as `decode_sample`: the image is fully decoded (PIL decodes
    lazily; convert() forces it), so bytes that would fail later fail here and the
    sample is skipped and counted now. Only the bytes are kept."""
    image_key = next((k for k in IMAGE_KEYS if k in raw), None)
    text_key = next((k for k in TEXT_KEYS if k in raw), None)
    if image_key is None or text_key is None:
        return None
    try:
        data = raw[image_key]
        with Image.open(io.BytesIO(data)) as img:
            params = deferred.draw(img.convert("RGB"))
        caption = raw[text_key].decode("utf-8").strip()
    except Exception:  # noqa: BLE001 - any undecodable sample is skipped and counted
        return None
    return (bytes(data), params, caption) if caption else None


class EncodedImages:
    """A batch's images as the shards hold them: all encoded bytes in one uint8 tensor,
    `offsets` [n + 1] delimiting the samples, and each sample's drawn crop in `params`
    [n, k]. Tensors, so loader workers hand it over through shared memory.

    Not a `Sequence` on purpose: DataLoader's collate and pin_memory leave it whole.
    `self[i]` is (bytes, params tuple), what `DeferredTransform.decode` takes."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, params: torch.Tensor):
        self.data, self.offsets, self.params = data, offsets, params

    @classmethod
    def from_samples(cls, blobs: list[bytes], params: list[tuple]) -> "EncodedImages":
        offsets = torch.zeros(len(blobs) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([len(b) for b in blobs], dtype=torch.int64), 0, out=offsets[1:])
        data = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
        width = len(params[0]) if params else 0
        return cls(data, offsets, torch.tensor(params, dtype=torch.int64).reshape(len(blobs), width))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[bytes, tuple]:
        offsets = self.offsets.numpy()
        return self.data.numpy()[offsets[i] : offsets[i + 1]].tobytes(), tuple(self.params.numpy()[i].tolist())

    @property
    def nbytes(self) -> int:
        """Host memory the batch's images take."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.offsets, self.params))

    def __eq__(self, other) -> bool:
        return isinstance(other, EncodedImages) and all(
            torch.equal(a, b) for a, b in zip((self.data, self.offsets, self.params), (other.data, other.offsets, other.params))
        )


class DeferredTransform:
    """An image transform split for offload: draw in the loader, decode per chunk, finish on the device.

    Handles the torchvision pipelines open_clip builds (`RandomResizedCrop` or
    `Resize`+`CenterCrop`, RGB conversion, `ToTensor`, `Normalize`): `split` returns
    None for anything else (colour jitter, flips, timm's pipelines), and the caller
    falls back to decoding in the loader.

      draw(img)      the transform's random parameters (the crop box) for one decoded
                     image, from the global RNG, as the whole transform would draw them;
                     the stream calls it under the sample's seed.
      decode(sample) (bytes, params) -> uint8 [3, H, W]: PIL decode, the crop with the
                     drawn box, the deterministic steps. Pure, no RNG: it runs in threads,
                     twice per step.
      device_transform(uint8 [n, 3, H, W]) -> the float tensor the whole transform gives
                     (the same operations as ToTensor and Normalize, so equal bit for bit
                     on the CPU), run on the device after the copy: 4x fewer bytes moved.
    """

    def __init__(self, pil_steps: list, normalize: list):
        self.pil_steps = pil_steps
        self.normalize = normalize
        self._stats: dict = {}  # per device: the Normalize means and stds as [3, 1, 1] tensors

    @classmethod
    def split(cls, transform: Callable) -> Optional["DeferredTransform"]:
        from open_clip.transform import MaybeConvertMode

        steps = list(transform.transforms) if isinstance(transform, T.Compose) else [transform]
        cut = next((k for k, step in enumerate(steps) if isinstance(step, T.ToTensor)), None)
        if cut is None or not all(isinstance(step, T.Normalize) for step in steps[cut + 1 :]):
            return None
        random_steps, resized = 0, False
        for step in steps[:cut]:
            if isinstance(step, T.RandomResizedCrop):
                # The box is drawn from the decoded image's size: only before any resize, and once.
                if resized or random_steps:
                    return None
                random_steps += 1
            elif isinstance(step, (T.Resize, T.CenterCrop)):
                resized = True
            elif not isinstance(step, MaybeConvertMode):
                return None
        return cls(steps[:cut], steps[cut + 1 :])

    def draw(self, img: Image.Image) -> tuple:
        for step in self.pil_steps:
            if isinstance(step, T.RandomResizedCrop):
                return tuple(step.get_params(img, step.scale, step.ratio))
        return ()

    def decode(self, sample: tuple[bytes, tuple]) -> torch.Tensor:
        data, params = sample
        with Image.open(io.BytesIO(data)) as img:
            image = img.convert("RGB")
        for step in self.pil_steps:
            if isinstance(step, T.RandomResizedCrop):
                image = TF.resized_crop(image, *params, step.size, step.interpolation, antialias=step.antialias)
            else:
                image = step(image)
        return TF.pil_to_tensor(image)

    def device_transform(self, pixels: torch.Tensor) -> torch.Tensor:
        images = pixels.to(torch.get_default_dtype()).div(255)  # ToTensor
        for mean, std in self._normalize_stats(images):  # Normalize, as F.normalize does it
            images = images.sub(mean).div(std)
        return images

    def _normalize_stats(self, images: torch.Tensor) -> list:
        key = (images.device, images.dtype)
        if key not in self._stats:  # made once: a tensor built per chunk would be a synchronous copy each time
            self._stats[key] = [
                tuple(torch.as_tensor(v, dtype=images.dtype, device=images.device).view(-1, 1, 1) for v in (n.mean, n.std))
                for n in self.normalize
            ]
        return self._stats[key]

    def __getstate__(self) -> dict:  # loader workers get the steps, not device tensors
        return {**self.__dict__, "_stats": {}}


class ShardStream(torch.utils.data.IterableDataset):
    def __init__(
        self,
        shards: list[str],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        seed: int,
        image_transform: Callable,
        tokenizer: Callable,
        shuffle_buffer: int = 1000,
        state: Optional[StreamState] = None,
        deferred: Optional[DeferredTransform] = None,
    ):
        """With `deferred` (data offload), batches hold their images as `EncodedImages`
        to be decoded later with it; without, as one decoded float tensor."""
        if not shards:
            raise ValueError("no training shards given")
        self.shards = list(shards)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = max(1, num_workers)
        self.seed = seed
        self.image_transform = image_transform
        self.tokenizer = tokenizer
        self.shuffle_buffer = shuffle_buffer
        self.deferred = deferred
        state = state or StreamState()
        self.cursors = dict(state.cursors)
        self.first_worker = state.batches % self.num_workers

    def _raw_samples(self, epoch: int, consumer: int, consumers: int, errors: ShardErrors):
        order = list(self.shards)
        random.Random(f"{self.seed}/shards/{epoch}").shuffle(order)
        if len(order) >= consumers:
            mine, keep = order[consumer::consumers], None
        else:
            mine, keep = order, consumer
        samples = chain.from_iterable(errors.read(url) for url in mine)
        if keep is not None:
            samples = (s for i, s in enumerate(samples) if i % consumers == keep)
        return wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, seed=f"{self.seed}/{epoch}/{consumer}")(samples)

    def _collate(self, images: list[tuple]):
        if self.deferred is None:
            return torch.stack([image for image, in images])
        blobs, params = zip(*images)
        return EncodedImages.from_samples(list(blobs), list(params))

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        slot = info.id if info is not None else 0
        worker = (slot + self.first_worker) % self.num_workers
        consumer = self.rank * self.num_workers + worker
        consumers = self.world_size * self.num_workers
        epoch, position = self.cursors.get(worker, (0, 0))
        images, captions, skipped, errors = [], [], 0, ShardErrors()
        epochs_without_a_sample = 0
        while True:
            usable = 0
            for index, raw in enumerate(self._raw_samples(epoch, consumer, consumers, errors)):
                if index < position:  # consumed before a resume: its errors were counted then
                    errors.count = 0
                    continue
                position = index + 1
                # Augmentation randomness is a function of the sample's place in the
                # stream, so a resumed run draws the same crops as an uninterrupted one.
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(zlib.crc32(f"{self.seed}/{epoch}/{consumer}/{position}".encode()))
                    if self.deferred is None:
                        decoded = decode_sample(raw, self.image_transform)
                    else:  # the same draws, kept as (bytes, crop) to be decoded by GradCache
                        decoded = encode_sample(raw, self.deferred)
                if decoded is None:
                    skipped += 1
                    continue
                usable += 1
                images.append(decoded[:-1])
                captions.append(decoded[-1])
                if len(images) == self.batch_size:
                    yield {
                        "images": self._collate(images),
                        "texts": self.tokenizer(captions),
                        "cursor": (worker, epoch, position),
                        "skipped_samples": skipped,
                        "shard_errors": errors.count,
                    }
                    images, captions, skipped, errors.count = [], [], 0, 0
            if position == 0:
                raise RuntimeError(f"consumer {consumer} found no samples in its shards: {self.shards}")
            # Shards move between consumers every epoch, so one bad pass can be bad luck;
            # several in a row mean the data itself is broken, and waiting would hang the run.
            epochs_without_a_sample = 0 if usable else epochs_without_a_sample + 1
            if epochs_without_a_sample == 3:
                raise RuntimeError(f"consumer {consumer} decoded no sample in 3 passes over its shards ({skipped} skipped)")
            epoch, position = epoch + 1, 0
