"""The data path built from the configuration: one part of the run, saved by the checkpoint as "data".

`TrainingBatches` reads the training shards in the loader's workers (`ShardStream`), decodes
beside them as `data.decoder` says (`resolve_data_path`), gathers each step's batch (`BatchStream`)
and keeps where the stream stands (`StreamState`) and its data-error counts; it shuts all of it
down. docs/architecture.md tells how a batch flows.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from clipscale.config import Config, ConfigError
from clipscale.data import prepare_data
from clipscale.data.batches import BatchStream, ImageDecoder, StreamedBatch, piece_size_for
from clipscale.data.captions import CaptionTokenizer
from clipscale.data.chunks import KeepBudget
from clipscale.data.decoders import DecodePool, DeviceDecoder
from clipscale.data.epoch import WorkList
from clipscale.data.shards import ShardStream, StreamState
from clipscale.data.transforms import SplitTransform
from clipscale.distributed import World, all_reduce_sum_list
from clipscale.signals import ignore_stop_signals

if TYPE_CHECKING:
    from clipscale.checks import RunPlan

@dataclass
class DataPath:
    """What the configuration resolves to on this machine, and the lines that say why."""

    decoder: str  # loader | device
    offload: bool
    notes: list[str]
    worker_decode_share: float = 0.0  # device: the share of the GPU's JPEGs the workers decode instead

    def describe(self) -> str:
        who = "the GPU (nvJPEG)" if self.decoder == "device" else "the loader workers (PIL)"
        if self.worker_decode_share:
            who += f", {self.worker_decode_share:.0%} of its JPEGs by the loader workers (PIL)"
        return f"training images decoded by {who}" + ("; the batch offloaded to the host as JPEG bytes" if self.offload else "")


# data.worker_decode_share=auto: the share measured best with 14 loader workers a GPU (ViT-B/32 at
# 32,768 on an H200: 0.25, 0.4 and 0.6 gave 0.78, 0.80-0.82 and 0.81 of the towers' ceiling, 0.4 the
# least data wait; results/bench_e2e_h200_b32_32k_worker_share.json, ..._share_peer*.json), scaled
# down with fewer workers: what the workers take is what they decode a second.
AUTO_SHARE, AUTO_SHARE_WORKERS = 0.4, 14
# A rank's host holds about three batches' worth of the workers' pixels at once (the one training,
# the one being gathered, the loader's pieces: measured 5.8 GiB more at 32,768 and 0.4, when the
# workers handed over final 224-px pixels); auto keeps them under this fraction of the host's
# memory a rank.
AUTO_SHARE_HOST_FRACTION, BATCHES_HELD = 0.25, 3


def auto_worker_share(workers: int, per_rank_batch: int, image_bytes: int, host_bytes: int) -> tuple[float, str | None]:
    """data.worker_decode_share=auto for a rank: (the share, a note where the host's memory set it to 0)."""
    share = AUTO_SHARE * min(1.0, workers / AUTO_SHARE_WORKERS)
    held = BATCHES_HELD * per_rank_batch * share * image_bytes
    if held > AUTO_SHARE_HOST_FRACTION * host_bytes:
        return 0.0, (f"data.worker_decode_share=auto: 0, the GPU decodes every JPEG it can (at {share:.2f} the workers' "
                     f"pixels would hold {held / 2**30:.0f} GiB of the host's {host_bytes / 2**30:.0f} GiB a rank)")
    return share, None


def host_bytes_per_rank() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def resolve_data_path(cfg: Config, split: SplitTransform | None, device: torch.device, per_rank_batch: int) -> DataPath:
    """data.decoder as this machine can run it."""
    notes = []
    decoder = cfg.data.decoder
    share = cfg.data.worker_decode_share
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
        if share not in ("auto", 0):
            notes.append(f"data.worker_decode_share={share} does nothing here: the loader workers "
                         "decode every image (it shares the GPU decoder's images, data.decoder=device)")
        return DataPath("loader", cfg.train.offload, notes)
    crop = None if split is None else split.only_random_resized_crop()
    if crop is None:
        raise ConfigError("data.decoder=device needs an image transform that is a single random resized crop "
                          "(open_clip's training transform with its defaults)")
    if share == "auto":
        # A worker's image is its crop's region (SplitTransform.crop_region): about 1.7 outputs' worth
        # on img2dataset's 256-px images, at most REGION_LIMIT; counted as two.
        height, width = crop.size
        share, note = auto_worker_share(cfg.data.workers, per_rank_batch, 2 * 3 * height * width, host_bytes_per_rank())
        notes += [note] if note else []
    return DataPath("device", True, notes, share)


class TrainingBatches:
    """The data path of a run, built from the configuration and its plan, the world, the model's
    training transform and tokenizer, and the chunk. A part of the run's checkpoint (`state_dict`), whose
    state is read when the stream starts: load it before the first `next()`.

        with batches.next() as batch:            # at once: its pieces keep arriving
            step(batch.images, batch.texts, lr)  # Gradient Cache asks each column for its chunks
        # leaving it marks the batch used: the cursors move past it
    """

    def __init__(self, cfg: Config, plan: RunPlan, world: World, image_transform, tokenizer, chunk: int):
        data = prepare_data(cfg.data, world)
        self.world = world
        per_rank = plan.per_rank_batch
        piece = piece_size_for(per_rank, chunk)
        split = SplitTransform.split(image_transform)
        if split is None and world.is_main:
            warnings.warn(f"the image transform {image_transform} does not split into uint8 host steps and float "
                          "device steps: loader pieces and the host batch hold float32 images (4x the memory)")
        self.path = resolve_data_path(cfg, split, world.device, per_rank)
        if self.path.offload and split is None:
            raise ConfigError("train.offload needs an image transform whose random crop can be kept with the image bytes "
                              f"(open_clip's RandomResizedCrop pipelines); got {image_transform}")
        self.workers = cfg.data.workers
        self.state = StreamState(workers=max(1, cfg.data.workers))
        stream = ShardStream(
            data.train_shards,
            piece_size=piece,
            rank=world.rank,
            world_size=world.world_size,
            num_workers=cfg.data.workers,
            seed=cfg.run.seed,
            image_transform=image_transform,
            tokenizer=CaptionTokenizer.of(tokenizer),
            shuffle_buffer=cfg.data.shuffle_buffer,
            state=self.state,
            split=split,
            keep_encoded=self.path.offload,
            decode=self.path.decoder == "loader",
            worker_decode_share=self.path.worker_decode_share,
            max_image_pixels=cfg.data.max_image_pixels,
        )
        self.order = stream.order
        # A generator of its own: the loader's seed draw leaves the global RNG (dropout's) as restored.
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=cfg.data.workers,
                                             persistent_workers=cfg.data.workers > 0, worker_init_fn=ignore_stop_signals,
                                             generator=torch.Generator().manual_seed(cfg.run.seed + world.rank))
        self.decoder: ImageDecoder | None = None
        if self.path.decoder == "device":
            self.decoder = DeviceDecoder(split, world.device, chunk_size=chunk)
        elif self.path.offload:
            # Without workers the batch is gathered whole before the step (BatchStream's in_thread): no bound then.
            window = 2 * max(1, chunk // piece) if cfg.data.workers else 0
            self.decoder = DecodePool(split.decode, cfg.data.decode_workers or max(1, cfg.data.workers), window)
        self.stream = BatchStream(loader, batch_size=per_rank, piece_size=piece, state=self.state, steps=cfg.train.steps,
                                  device_transform=split.to_float if split is not None else None, decoder=self.decoder,
                                  budget=KeepBudget(plan.keep_on_device_bytes), in_thread=cfg.data.workers > 0)

    def next(self) -> StreamedBatch:
        return self.stream.next()

    def error_totals(self) -> list[int]:
        """metrics.DATA_COUNTS over all ranks since the run began (every rank calls it)."""
        return all_reduce_sum_list([self.state.skipped_samples, self.state.shard_errors, self.state.captions_cut,
                                    self.state.images_trained_black], self.world.device)

    def take_problem_shards(self) -> list[str]:
        """The shards (this rank's) where the batches used since the last call met skipped samples or a cut."""
        shards, self.stream.problem_shards = self.stream.problem_shards, []
        return shards

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_every_rank(self, saved: list[dict]) -> str:
        """This rank's share of the stream states that every rank of the checkpoint saved, on this
        run's shape (`StreamState.resumed`); the line that says where the data order goes on."""
        if "work" not in saved[0]:  # saved before the order was the same on every shape: its cursors mean nothing now
            begun = [{**state, "cursors": {}, "work": asdict(WorkList()), "workers": 1, "drawn": {}} for state in saved]
            self.state.load_state_dict(StreamState.reshaped(begun, self.world.rank, self.state.workers).state_dict())
            return "the checkpoint's data cursors predate the order shared by every shape: the data order starts again at the first epoch"
        resumed = StreamState.resumed(saved, self.world.rank, self.world.world_size, self.state.workers)
        self.state.load_state_dict(resumed.state_dict())
        epoch = self.order.slot(StreamState.work_left(saved).frontier).epoch
        drawn = sum(state["drawn"].get(epoch, 0) for state in saved)
        ranks = self.world.world_size
        return (f"resuming at sample {drawn:,} of epoch {epoch} on {ranks} rank{'s' * (ranks != 1)}, "
                f"{self.workers} worker{'s' * (self.workers != 1)} each")

    def close(self) -> None:
        """The gathering thread, the loader's workers and the decoder stop (each batch first: a
        batch being decoded ahead stops before its decoder does)."""
        self.stream.close()
        if self.decoder is not None:
            self.decoder.close()
