"""The training batches, built from the configuration: the one home of the data path.

    batches = TrainingBatches.build(cfg, data, towers, world, stream_state, chunk, steps)
    batch = batches.next()                 # at once: its pieces keep arriving
    step(batch.images, batch.texts, lr)    # Gradient Cache asks each column for its chunks, per pass
    batch.consumed(stream_state); batches.release(batch)
    batches.close()                        # the loader's workers and the decoder stop

shards -> loader workers (`ShardStream`: pieces of uint8 pixels, or of JPEG bytes and crops)
       -> `BatchStream` (a thread gathering each step's pinned host batch, one batch ahead)
       -> the step's columns: `ArrivingTensor` (pixels), `OffloadedImages` (bytes + a window of
          pixels, pass 2 decoded in a process pool) or `DeviceDecodedImages` (bytes, decoded
          on the GPU) -> chunks on the device, pass 1's kept there for pass 2 (`DeviceBudget`)

Who decodes the training images (`data.decoder`):
  loader  the loader workers, with PIL, as open_clip_train does.
  device  the workers read the shards, draw each crop and check the JPEG at 1/8 scale; the GPU
          decodes: its hardware JPEG engines through nvImageCodec where they are there
          (`data.device_decoder`), nvJPEG on the SMs otherwise. The host holds the batch as
          JPEG bytes (about a tenth of its pixels).
  auto    device on a GPU (when the image transform is a random resized crop the device can
          run), loader otherwise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from clipscale.config import Config, ConfigError
from clipscale.data import PreparedData
from clipscale.data.batches import BatchStream, DeviceBudget, StreamedBatch, piece_size_for
from clipscale.data.device_decode import DeviceDecodedImages, DeviceDecoder, JpegEngines, TorchvisionJpeg
from clipscale.data.offload import DecodePool, OffloadedImages
from clipscale.data.shards import ShardStream, StreamState
from clipscale.data.transforms import SplitTransform
from clipscale.distributed import World
from clipscale.signals import ignore_stop_signals

GIB = 2**30
DEVICE_SHARE_KEPT = 0.25  # of a GPU's memory, for pass-1 chunks kept for pass 2 (data.keep_on_device_gib: null)
HOST_KEPT_GIB = 1.0  # the same on a CPU device


@dataclass
class DataPath:
    """What the configuration resolves to on this machine, and the lines that say why."""

    decoder: str  # loader | device
    device_decoder: str | None  # nvimgcodec | nvjpeg, with decoder=device
    offload: bool
    notes: list[str]

    def describe(self) -> str:
        who = f"the GPU ({self.device_decoder})" if self.decoder == "device" else "the loader workers (PIL)"
        return f"training images decoded by {who}" + ("; the batch offloaded to the host as JPEG bytes" if self.offload else "")


def resolve_data_path(cfg: Config, split: SplitTransform | None, device: torch.device) -> tuple[DataPath, object]:
    """data.decoder and data.device_decoder as this machine can run them: the choice, and the
    JPEG decoder for decoder=device (None otherwise)."""
    notes = []
    decoder = cfg.data.decoder
    if decoder == "auto":
        if device.type != "cuda":
            decoder = "loader"
        elif split is None or split.only_random_resized_crop() is None:
            decoder = "loader"
            notes.append("data.decoder=auto: the image transform is not a single random resized crop, so the loader "
                         "workers decode (data.decoder=device needs one)")
        else:
            decoder = "device"
    if decoder == "loader":
        return DataPath("loader", None, cfg.train.offload, notes), None
    if split is None:
        raise ConfigError("data.decoder=device needs an image transform whose random crop can be kept with the image "
                          "bytes (open_clip's RandomResizedCrop pipelines)")
    jpeg, why = None, "not asked for"
    if cfg.data.device_decoder in ("auto", "nvimgcodec"):
        jpeg, why = JpegEngines.create(device)
        if jpeg is None and cfg.data.device_decoder == "nvimgcodec":
            raise ConfigError(f"data.device_decoder=nvimgcodec: {why}")
    if jpeg is None:
        jpeg = TorchvisionJpeg(device)
        if device.type == "cuda":
            notes.append(f"data.device_decoder: the GPU's hardware JPEG decoders are not used ({why}); "
                         "decoding with nvJPEG on the GPU's SMs")
    return DataPath("device", jpeg.name, True, notes), jpeg


def kept_bytes(cfg: Config, device: torch.device) -> int:
    """data.keep_on_device_gib in bytes: what pass-1 chunks may hold on the device for pass 2."""
    if cfg.data.keep_on_device_gib is not None:
        return int(cfg.data.keep_on_device_gib * GIB)
    if device.type == "cuda":
        return int(DEVICE_SHARE_KEPT * torch.cuda.get_device_properties(device).total_memory)
    return int(HOST_KEPT_GIB * GIB)


class TrainingBatches:
    """The loader, whoever decodes beside it, and the thread that gathers each step's batch."""

    def __init__(self, stream: BatchStream, decoder: DecodePool | DeviceDecoder | None, path: DataPath):
        self.stream = stream
        self.decoder = decoder
        self.path = path

    @classmethod
    def build(cls, cfg: Config, data: PreparedData, train_transform, tokenizer, world: World, stream_state: StreamState,
              chunk: int, steps: int) -> "TrainingBatches":
        per_rank = cfg.train.batch_size // world.world_size
        piece = piece_size_for(per_rank, chunk)
        split = SplitTransform.split(train_transform)
        if split is None and world.is_main:
            warnings.warn(f"the image transform {train_transform} does not split into uint8 host steps and float "
                          "device steps: loader pieces and the host batch hold float32 images (4x the memory)")
        path, jpeg = resolve_data_path(cfg, split, world.device)
        if path.offload and split is None:
            raise ConfigError("train.offload needs an image transform whose random crop can be kept with the image bytes "
                              f"(open_clip's RandomResizedCrop pipelines); got {train_transform}")
        stream = ShardStream(
            data.train_shards,
            piece_size=piece,
            rank=world.rank,
            world_size=world.world_size,
            num_workers=cfg.data.workers,
            seed=cfg.run.seed,
            image_transform=train_transform,
            tokenizer=tokenizer,
            shuffle_buffer=cfg.data.shuffle_buffer,
            state=stream_state,
            split=split,
            keep_encoded=path.offload,
            decode=path.decoder == "loader",
            max_image_pixels=cfg.data.max_image_pixels,
        )
        # A generator of its own: the loader's seed draw leaves the global RNG (dropout's) as restored.
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=cfg.data.workers,
                                             persistent_workers=cfg.data.workers > 0, worker_init_fn=ignore_stop_signals,
                                             generator=torch.Generator().manual_seed(cfg.run.seed + world.rank))
        decoder, image_column = None, None
        if path.decoder == "device":
            decoder = DeviceDecoder(split, world.device, jpeg)
            crop = split.only_random_resized_crop()
            ahead = (chunk, 3 * crop.size[0] * crop.size[1]) if crop is not None else None

            def image_column(batch_size, arrivals, to_float, budget):
                return DeviceDecodedImages(batch_size, arrivals, to_float, budget, decoder, ahead)
        elif path.offload:
            decoder = DecodePool(split.decode, cfg.data.decode_workers or max(1, cfg.data.workers))
            # Without workers the batch is gathered whole before the step (BatchStream's in_thread): no bound then.
            window = 2 * max(1, chunk // piece) if cfg.data.workers else 0

            def image_column(batch_size, arrivals, to_float, budget):
                return OffloadedImages(batch_size, arrivals, to_float, budget, decoder, window)
        to_float = split.to_float if split is not None else None
        batches = BatchStream(loader, batch_size=per_rank, piece_size=piece, batches=steps, to_float=to_float,
                              image_column=image_column, in_thread=cfg.data.workers > 0,
                              budget=DeviceBudget(kept_bytes(cfg, world.device)))
        return cls(batches, decoder, path)

    def next(self) -> StreamedBatch:
        return self.stream.next()

    def release(self, batch: StreamedBatch) -> None:
        self.stream.release(batch)

    def close(self) -> None:
        self.stream.close()
        if self.decoder is not None:
            self.decoder.close()
